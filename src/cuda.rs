//! The codec on CUDA devices: launches of the `kernels/` sources on a caller's stream, over
//! caller-owned device memory (typically PyTorch's), with no host synchronization.
//!
//! Libraries are loaded at run time (cudarc's dynamic loading): this module builds anywhere and
//! reports a missing driver or NVRTC as [`Error::CudaUnavailable`], never a panic. Kernels are
//! compiled by NVRTC at first use to a CUBIN for the device's own compute capability and
//! cached per (device, family).
//!
//! Device memory is never allocated here: the caller passes the output and a workspace of the
//! sizes that [`compress_capacity`] and [`workspace_len`] give (PyTorch's caching allocator
//! provides them in the Python package), and nothing is freed.

use crate::error::{Error, Result};
use crate::format::{groups_for, index_size_for, BoundMode, DType, FIXED_HEADER_LEN, MAX_NDIM};
use crate::kernels::{kernel_name, signature, Family, Ty};
use crate::Bound;
use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Threads per block of the codec kernels (8 warps; `TILE_THREADS` in `kernels/codec.cu`).
const BLOCK: u32 = 256;
/// Groups per chunk, chunks per tile of the decoder (the encoder's tiles are 8 or 32 chunks, see
/// [`compress`]), tiles per span, and the workspace offset of the spans' counters:
/// `CHUNK_GROUPS`, `TILE_CHUNKS`, `SPAN_TILES` and `WS_SPANS` in `kernels/codec.cu`, whose
/// comment gives the whole layout.
const CHUNK_GROUPS: u64 = 8;
const TILE_CHUNKS: u64 = 32;
const SPAN_TILES: u64 = 16;
const WS_SPANS: u64 = 112;
/// Shared memory of each encoder thread: its group's 32 values in a row of `STAGE_ROW` (33)
/// floats (`kernels/codec.cu`).
const ENCODER_ROW_BYTES: u32 = 33 * 4;
/// Workspace offset of the plane words' total (u64), after the last block of a pass.
const WS_TOTAL_WORDS: u64 = 96;
/// Values per block of the scan kernels (must match `SCAN_BLOCK` in `kernels/scan.cu`).
const SCAN_BLOCK: u64 = 1024;
/// Workspace bytes before the scan arrays: `CfcParams` (48 bytes, room for 64), the frame size
/// (u64 at 64) and the raw flag (u32 at 72).
const WS_HEADER: u64 = 80;
/// Offset in the workspace of the compressed frame's size (a u64 written on the device).
pub const FRAME_SIZE_OFFSET: u64 = 64;
/// Offset in the workspace of the raw-frame flag (u32) that the compressors write.
const RAW_FLAG_OFFSET: u64 = 72;
/// Offset in the workspace of the bound error flag (u32; nonzero: rel gave an unusable eps).
pub const BOUND_ERROR_OFFSET: u64 = 40;

pub(crate) fn driver_err(e: cudarc::driver::DriverError) -> Error {
    Error::Cuda(format!("{e:?}"))
}

/// Whether the CUDA driver library can be loaded and sees at least one device.
pub fn available() -> bool {
    device_count() > 0
}

/// Devices the driver sees (0 without a driver).
pub fn device_count() -> usize {
    if driver_present().is_err() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

struct Device {
    ctx: Arc<CudaContext>,
    modules: Mutex<HashMap<Family, Arc<CudaModule>>>,
    kernels: Mutex<HashMap<DType, Arc<Kernels>>>,
    /// Blocks that keep every SM busy with grid-stride warps.
    grid_blocks: u64,
}

/// Every kernel one compress or decompress of a dtype launches, looked up once.
struct Kernels {
    max_abs: CudaFunction,
    fold: CudaFunction,
    encode: CudaFunction,
    pack: CudaFunction,
    offsets: CudaFunction,
    decode: CudaFunction,
    scatter: CudaFunction,
    sum_table: CudaFunction,
    sum_lens: CudaFunction,
    sum_offsets: CudaFunction,
    sum_chunks: CudaFunction,
    sum_values: CudaFunction,
    check_frames: CudaFunction,
    sum_pack: CudaFunction,
    /// `decode_sum_to_<o>`, by output dtype: f32, bf16, f16.
    decode_sum: [CudaFunction; 3],
    stats: CudaFunction,
    stats_total: CudaFunction,
}

/// Restores the calling thread's current CUDA context when dropped. Binding a device's context
/// must not leak out of a call: PyTorch reads the current context as its current device. cfc's
/// entry points hold one; so should a caller that drops cfc's GPU objects (their buffers and
/// streams bind their device's context to be freed) where another device may be current.
pub struct ContextGuard(Option<sys::CUcontext>);

impl ContextGuard {
    /// Remembers the calling thread's current context (initializing the driver if need be).
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] without a driver; [`Error::Cuda`].
    pub fn save() -> Result<ContextGuard> {
        driver_initialized()?;
        cudarc::driver::result::ctx::get_current()
            .map(ContextGuard)
            .map_err(driver_err)
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if let Some(ctx) = self.0 {
            // SAFETY: `ctx` was the thread's current context when the guard was made; contexts
            // that PyTorch (or anyone) made current are not destroyed during a cfc call.
            if let Err(e) = unsafe { cudarc::driver::result::ctx::set_current(ctx) } {
                tracing::warn!(error = ?e, "could not restore the current CUDA context");
            }
        }
    }
}

/// Smallest compute capability cfc's kernels run on (they use `__reduce_or_sync`).
const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// Whether device `ordinal` can run cfc's kernels: a driver, the device, compute capability 8.0+.
pub fn supported(ordinal: usize) -> bool {
    if !available() {
        return false;
    }
    let Ok(_restore) = ContextGuard::save() else {
        return false;
    };
    device(ordinal)
        .and_then(|d| d.ctx.compute_capability().map_err(driver_err))
        .is_ok_and(|cc| cc >= MIN_COMPUTE_CAPABILITY)
}

/// cudarc panics on the first call into a library it cannot load: check before any call.
///
/// The probe tries up to 17 library names with `dlopen` (about 100 us when the first ones are
/// missing), and every compress and decompress asks: once the library has been found it is
/// remembered (cudarc keeps it loaded for the life of the process); a failure is not, so a
/// library installed later is still found.
fn driver_present() -> Result<()> {
    static FOUND: AtomicBool = AtomicBool::new(false);
    if FOUND.load(Ordering::Relaxed) {
        return Ok(());
    }
    // SAFETY: only probes whether the shared library can be opened; no CUDA call is made.
    if unsafe { sys::is_culib_present() } {
        FOUND.store(true, Ordering::Relaxed);
        Ok(())
    } else {
        Err(Error::CudaUnavailable(
            "the CUDA driver library (libcuda.so.1) is not present".into(),
        ))
    }
}

/// [`driver_present`], and the driver initialized (`cuInit`), once per process: the current
/// context can be asked for only then. PyTorch initializes the driver when it first uses CUDA,
/// but a process may reach cfc first (`cfc-bench`, a communicator made before any tensor).
fn driver_initialized() -> Result<()> {
    static DONE: AtomicBool = AtomicBool::new(false);
    if DONE.load(Ordering::Relaxed) {
        return Ok(());
    }
    driver_present()?;
    cudarc::driver::result::init().map_err(driver_err)?;
    DONE.store(true, Ordering::Relaxed);
    Ok(())
}

fn device(ordinal: usize) -> Result<Arc<Device>> {
    static DEVICES: OnceLock<Mutex<Vec<Option<Arc<Device>>>>> = OnceLock::new();
    driver_present()?;
    let mut devices = DEVICES
        .get_or_init(|| Mutex::new(Vec::new()))
        .lock()
        .map_err(|_| Error::Cuda("device cache poisoned".into()))?;
    if devices.len() <= ordinal {
        // Checked before the cache grows: an ordinal from a caller may be anything.
        let count = CudaContext::device_count().map_err(driver_err)?.max(0) as usize;
        if ordinal >= count {
            return Err(Error::CudaUnavailable(format!(
                "there is no CUDA device {ordinal}: {count} visible"
            )));
        }
        devices.resize(ordinal + 1, None);
    }
    if let Some(d) = &devices[ordinal] {
        d.ctx.bind_to_thread().map_err(driver_err)?;
        return Ok(d.clone());
    }
    // Retains the device's primary context: the one PyTorch uses.
    let ctx = CudaContext::new(ordinal).map_err(driver_err)?;
    // SAFETY: cfc never hands cudarc memory it allocated; all pointers are the caller's, whose
    // ordering is the caller's stream order, so cudarc's per-allocation events are not needed.
    unsafe { ctx.disable_event_tracking() };
    let sms = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(driver_err)?;
    let d = Arc::new(Device {
        ctx,
        modules: Mutex::new(HashMap::new()),
        kernels: Mutex::new(HashMap::new()),
        grid_blocks: 8 * sms.max(1) as u64,
    });
    devices[ordinal] = Some(d.clone());
    Ok(d)
}

/// The primary context of device `ordinal` (the one PyTorch uses), made current on this thread:
/// cfc's collectives allocate their buffers and streams in it, and so may their callers.
///
/// # Errors
/// [`Error::CudaUnavailable`] without a driver, [`Error::Cuda`] for a bad ordinal.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    let d = device(ordinal)?;
    d.ctx.bind_to_thread().map_err(driver_err)?;
    Ok(d.ctx.clone())
}

/// A caller's raw stream of device `ordinal`, borrowed (see `Device::stream`).
pub(crate) fn borrowed_stream(ordinal: usize, raw: usize) -> Result<Arc<CudaStream>> {
    device(ordinal)?.stream(raw)
}

/// Directories holding `cuda_fp16.h`, tried in order: `CFC_CUDA_INCLUDE`, `CUDA_HOME`,
/// `CUDA_PATH`, the usual install paths.
fn cuda_include_dir() -> Result<String> {
    let mut candidates: Vec<String> = Vec::new();
    if let Ok(p) = std::env::var("CFC_CUDA_INCLUDE") {
        candidates.push(p);
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(p) = std::env::var(var) {
            candidates.push(format!("{p}/include"));
        }
    }
    candidates.extend(
        [
            "/usr/local/cuda/include",
            "/usr/local/cuda-13.0/include",
            "/usr/local/cuda-12/include",
            "/usr/include",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    candidates
        .iter()
        .find(|d| std::path::Path::new(d).join("cuda_fp16.h").exists())
        .cloned()
        .ok_or_else(|| Error::CudaUnavailable(format!(
            "cuda_fp16.h not found in {candidates:?}; set CFC_CUDA_INCLUDE to CUDA's include directory"
        )))
}

/// Compiles a family to a CUBIN for `sm_<major><minor>`.
fn compile(family: Family, arch: &str) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys as nsys};
    // SAFETY: only probes whether the shared library can be opened.
    if !unsafe { nsys::is_culib_present() } {
        return Err(Error::CudaUnavailable(
            "NVRTC (libnvrtc) is not present".into(),
        ));
    }
    let src = std::ffi::CString::new(family.source()).map_err(|_| Error::Nvrtc {
        log: "kernel source contains a NUL byte".into(),
    })?;
    let opts = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        // Contracting a*b+c into one FMA would change results against the CPU reference.
        "--fmad=false".to_string(),
        format!("-I{}", cuda_include_dir()?),
    ];
    let nvrtc_err = |what: &str, e: &dyn std::fmt::Debug| Error::Nvrtc {
        log: format!("{what}: {e:?}"),
    };
    let prog = result::create_program(&src, None).map_err(|e| nvrtc_err("create_program", &e))?;
    // SAFETY: `prog` is a live program created above; options are valid C strings.
    let compiled = unsafe { result::compile_program(prog, &opts) };
    let out = match compiled {
        Err(e) => {
            // SAFETY: `prog` is live; the log is read before the program is destroyed.
            let log = unsafe { result::get_program_log(prog) }.unwrap_or_default();
            let log: String = log.iter().map(|&c| c as u8 as char).collect();
            Err(Error::Nvrtc {
                log: format!("{e:?} with options {opts:?}:\n{log}"),
            })
        }
        Ok(()) => {
            let mut size = 0usize;
            // SAFETY: `prog` compiled successfully; `size` is a valid out pointer.
            unsafe { nsys::nvrtcGetCUBINSize(prog, &mut size) }
                .result()
                .map_err(|e| nvrtc_err("nvrtcGetCUBINSize", &e))?;
            let mut buf = vec![0u8; size];
            // SAFETY: `buf` has exactly the size NVRTC reported for the CUBIN.
            unsafe { nsys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut _) }
                .result()
                .map_err(|e| nvrtc_err("nvrtcGetCUBIN", &e))?;
            Ok(buf)
        }
    };
    // SAFETY: `prog` is live and destroyed exactly once.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

fn poisoned<T>(_: T) -> Error {
    Error::Cuda("kernel cache poisoned".into())
}

impl Device {
    fn module(&self, family: Family) -> Result<Arc<CudaModule>> {
        let mut modules = self.modules.lock().map_err(poisoned)?;
        if let Some(m) = modules.get(&family) {
            return Ok(m.clone());
        }
        let (major, minor) = self.ctx.compute_capability().map_err(driver_err)?;
        let arch = format!("sm_{major}{minor}");
        let t0 = std::time::Instant::now();
        let cubin = compile(family, &arch)?;
        tracing::debug!(
            family = family.name(),
            arch,
            ms = t0.elapsed().as_millis() as u64,
            "compiled kernels"
        );
        let m = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(driver_err)?;
        modules.insert(family, m.clone());
        Ok(m)
    }

    fn function(&self, family: Family, op: &str, dtype: Option<DType>) -> Result<CudaFunction> {
        let name = kernel_name(family, op, dtype);
        self.module(family)?
            .load_function(&name)
            .map_err(|e| Error::Cuda(format!("kernel {name}: {e:?}")))
    }

    /// The kernels for `dtype`, compiled and looked up on first use.
    fn kernels(&self, dtype: DType) -> Result<Arc<Kernels>> {
        if let Some(k) = self.kernels.lock().map_err(poisoned)?.get(&dtype) {
            return Ok(k.clone());
        }
        let (c, d) = (Family::Codec, Some(dtype));
        let encode = self.function(c, "encode_groups", d)?;
        // With error feedback the encoder's rows take twice the shared memory (66 KiB), past the
        // 48 KiB that a launch may ask for without opting in; every supported GPU (compute
        // capability 8.0 and up) allows at least 99 KiB.
        encode
            .set_attribute(
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                (2 * BLOCK * ENCODER_ROW_BYTES) as i32,
            )
            .map_err(driver_err)?;
        let k = Arc::new(Kernels {
            max_abs: self.function(c, "max_abs", d)?,
            fold: self.function(c, "fold_residual", d)?,
            encode,
            pack: self.function(c, "pack_chunks", d)?,
            offsets: self.function(c, "decode_offsets", None)?,
            decode: self.function(c, "decode_chunks", d)?,
            scatter: self.function(c, "scatter_exceptions", d)?,
            sum_table: self.function(c, "sum_table", None)?,
            sum_lens: self.function(c, "sum_lens", None)?,
            sum_offsets: self.function(c, "sum_offsets", None)?,
            sum_chunks: self.function(c, "sum_chunks", d)?,
            sum_values: self.function(c, "sum_values", d)?,
            check_frames: self.function(c, "check_frames", None)?,
            sum_pack: self.function(c, "sum_pack", d)?,
            decode_sum: [
                self.function(c, "decode_sum_to_f32", d)?,
                self.function(c, "decode_sum_to_bf16", d)?,
                self.function(c, "decode_sum_to_f16", d)?,
            ],
            stats: self.function(c, "stats", d)?,
            stats_total: self.function(c, "stats_total", None)?,
        });
        self.kernels
            .lock()
            .map_err(poisoned)?
            .insert(dtype, k.clone());
        Ok(k)
    }

    fn stream(&self, raw: usize) -> Result<Arc<CudaStream>> {
        // SAFETY: `raw` is a live CUstream of this device's primary context, owned by the
        // caller (e.g. torch.cuda.current_stream().cuda_stream) for the duration of the call;
        // a borrowed stream is never destroyed by cudarc.
        Ok(unsafe { self.ctx.wrap_borrowed_stream(raw as sys::CUstream) })
    }
}

/// A compressor's shape: at most [`MAX_NDIM`] dimensions whose product is `n`.
fn check_shape(shape: &[u64], n: u64) -> Result<()> {
    check_count(n)?;
    let prod = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
    if shape.len() > MAX_NDIM || prod != Some(n) {
        return Err(Error::ShapeMismatch {
            shape_elements: prod,
            elements: n,
            ndim: shape.len(),
        });
    }
    Ok(())
}

/// Refuses more than [`MAX_ELEMENTS`] elements, before any size is computed from them (a size
/// past it could wrap, and a buffer checked against it pass while too small).
fn check_count(n: u64) -> Result<()> {
    if n > MAX_ELEMENTS {
        return Err(Error::Cuda(format!(
            "{n} elements: the device codec takes at most {MAX_ELEMENTS} (2^48)"
        )));
    }
    Ok(())
}

/// What every decoder checks of its arguments before anything is queued: the element count,
/// the workspace's size and the header's dimensions.
fn check_decompress_args(args: &DecompressArgs) -> Result<()> {
    check_count(args.n)?;
    let need_ws = workspace_len(args.n);
    if args.workspace_len < need_ws {
        return Err(Error::OutputSize {
            expected: need_ws,
            got: args.workspace_len,
        });
    }
    if args.ndim > MAX_NDIM {
        return Err(crate::FormatError::BadField {
            field: "ndim",
            value: args.ndim.to_string(),
        }
        .into());
    }
    Ok(())
}

/// Scan arrays for `len` values need this many u64 of block sums, all levels together.
fn scan_sums_len(len: u64) -> u64 {
    let blocks = len.div_ceil(SCAN_BLOCK).max(1);
    if blocks <= 1 {
        1
    } else {
        blocks + scan_sums_len(blocks)
    }
}

/// How the codec kernels cut `n` elements, and where their state lies in a workspace (the
/// layout in `kernels/codec.cu`).
struct TileLayout {
    /// Tiles: `tile_chunks` chunks of 8 groups, one block of the encoder's passes (at least one,
    /// which writes an empty frame); spans: 16 tiles (one block of the decoder's first pass);
    /// the blocks of the decoder's second pass, which takes a chunk per warp.
    tiles: u64,
    spans: u64,
    chunk_blocks: u64,
    /// Bytes zeroed before each call: parameters, counters and the spans' counters.
    zeroed: u64,
    /// End of what decoding needs; compressing also needs exception masks and staged planes.
    decode_end: u64,
    compress_end: u64,
    /// Bytes past `compress_end` that error feedback needs (compensated values, widths).
    feedback_len: u64,
}

fn tile_layout(n: u64, tile_chunks: u64) -> TileLayout {
    let groups = groups_for(n);
    let chunks = groups.div_ceil(CHUNK_GROUPS);
    let tiles = chunks.div_ceil(tile_chunks).max(1);
    let spans = tiles.div_ceil(SPAN_TILES);
    let zeroed = WS_SPANS + 4 * spans;
    // Tile and span sums (u64 pairs), then 16 bytes of chunk information per chunk.
    let decode_end = zeroed.div_ceil(16) * 16 + 16 * (tiles + spans) + 16 * chunks;
    TileLayout {
        tiles,
        spans,
        chunk_blocks: chunks.div_ceil(BLOCK as u64 / 32).max(1),
        zeroed,
        decode_end,
        compress_end: decode_end
            + 4 * groups
            + 4 * crate::format::GROUP as u64 * CHUNK_GROUPS * chunks,
        feedback_len: (4 * crate::format::GROUP as u64 + 1) * groups,
    }
}

/// The most elements the size functions of this module ([`workspace_len`],
/// [`compress_capacity`], [`sum_workspace_len`] and the others) are exact for: 2^48, far past
/// any device's memory. With at most [`crate::format::MAX_NDIM`] dimensions and
/// [`MAX_SUM_PARTS`] parts, none of their u64 sums and products wraps below it; past it one
/// could, and a buffer allocated from such a size would be too small. The entry points that
/// check buffers against those sizes ([`compress`], [`decompress`], [`sum`], [`decode_sum`], the
/// lossless ones) refuse larger counts; the Python binding refuses them in its size functions.
pub const MAX_ELEMENTS: u64 = 1 << 48;

/// Workspace bytes [`decompress`] needs for `n` elements: the chunk offsets of the quantized
/// decoder, or those of the lossless one, whichever is larger.
pub fn workspace_len(n: u64) -> u64 {
    let chunks = n.div_ceil(crate::lossless::CHUNK as u64);
    let lossless = WS_HEADER + 8 * (chunks + 1 + scan_sums_len(chunks + 1));
    tile_layout(n, TILE_CHUNKS).decode_end.max(lossless)
}

/// Chunks per encoder tile that need the most workspace (the most tiles).
const SMALLEST_TILE: u64 = WARPS;
/// Warps per block of the codec kernels.
const WARPS: u64 = BLOCK as u64 / 32;

/// Workspace bytes [`compress`] needs for `n` elements: the chunks' offsets, each group's
/// exception mask, and room to stage every chunk's bit planes (up to 32 words per group); with
/// error feedback (`feedback`), also room for the compensated values of the groups whose
/// values the second pass could not rebuild otherwise, and each group's width.
pub fn compress_workspace_len(n: u64, feedback: bool) -> u64 {
    let layout = tile_layout(n, SMALLEST_TILE);
    layout.compress_end + if feedback { layout.feedback_len } else { 0 }
}

/// Zeroes the first `len` bytes of the workspace at `ws` on `stream` (an asynchronous memset).
///
/// # Safety
/// `ws` must be a device address valid for `len` bytes until the queued work completes.
unsafe fn zero(stream: &CudaStream, ws: u64, len: u64) -> Result<()> {
    // SAFETY: this function's contract; the stream is live for the call.
    unsafe { cudarc::driver::result::memset_d8_async(ws, 0, len as usize, stream.cu_stream()) }
        .map_err(driver_err)
}

/// Bytes of output buffer that always suffice for a frame of `n` elements compressed on the
/// device (the frame's real size is written to the workspace).
pub fn compress_capacity(n: u64, dtype: DType, ndim: usize, bound: Bound) -> u64 {
    let header = (FIXED_HEADER_LEN + 8 * ndim) as u64;
    let size = dtype.size() as u64;
    let raw = n * size;
    match bound {
        // Fixed rate keeps its layout even when it is not smaller than the raw bytes.
        Bound::Bits(b) => {
            header + groups_for(n) * (1 + 4 * b as u64) + n * (index_size_for(n) as u64 + size)
        }
        // Quantized bodies are only chosen when strictly smaller than the raw bytes.
        _ => header + raw.max(groups_for(n)),
    }
}

/// Arguments of [`compress`]; pointers are device addresses on `device`.
#[derive(Debug, Clone)]
pub struct CompressArgs<'a> {
    /// Device ordinal.
    pub device: usize,
    /// A `CUstream` of the device's primary context; all work is queued on it.
    pub stream: usize,
    /// The elements (contiguous, `n * dtype.size()` bytes, aligned to the element size).
    pub input: u64,
    /// Element count.
    pub n: u64,
    /// Element type.
    pub dtype: DType,
    /// Dimensions (product `n`).
    pub shape: &'a [u64],
    /// The bound.
    pub bound: Bound,
    /// Output buffer, at least [`compress_capacity`] bytes.
    pub out: u64,
    /// Its size.
    pub out_len: u64,
    /// Workspace, 16-aligned, at least [`compress_workspace_len`] bytes (`feedback`: a
    /// residual is given).
    pub workspace: u64,
    /// Its size.
    pub workspace_len: u64,
    /// Error feedback: `n` float32 residuals (4-aligned) updated in place (see
    /// [`crate::compress_with_feedback`]), or 0 for none.
    pub residual: u64,
    /// Where the frame's size is also written (a u64, 8-aligned device memory), or 0 for
    /// nowhere: the head of a row that an exchange sends, written by the last kernel rather
    /// than by a copy queued after it (one driver call fewer per frame).
    pub size_to: u64,
    /// With error feedback, a running maximum that the largest finite |residual| this frame
    /// leaves raises (f64 bits in 8-aligned device memory, initialised; a maximum of non-negative
    /// doubles orders as their bits do), or 0 for
    /// none: raised by the last kernel rather than by a kernel of its own after it.
    pub max_error_to: u64,
    /// With an `Abs` bound, 8-aligned device memory whose f64 the encoder reads as `eps` when
    /// it runs, or 0 to take `bound`'s value at the launch. `bound` must hold the value that
    /// memory will hold (it is what the host checks). An unusable one is reported as with a
    /// `Rel` bound: it codes with eps 1, leaves the residual as it was, sets the workspace's
    /// error word and breaks the frame's magic, so that readers on the device (a peer's
    /// `decode_sum`) refuse the frame. For work recorded once as a CUDA graph and replayed with
    /// each step's bound (a CUDA graph).
    pub bound_at: u64,
}

/// The most blocks a grid's x dimension may have (CUDA's limit, 2^31 - 1).
const MAX_GRID_X: u32 = i32::MAX as u32;

/// A one-dimensional launch of at least `threads` threads in blocks of `block`. A count past
/// what one grid can hold saturates at `u32::MAX` blocks, which [`launch`] refuses: the kernels
/// map fixed work to each block, so a clamped grid would leave work undone without an error.
fn launch_cfg(threads: u64, block: u32) -> LaunchConfig {
    let blocks = threads.div_ceil(block as u64).clamp(1, u32::MAX as u64) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One kernel argument, by value.
#[derive(Debug, Clone, Copy)]
enum Arg {
    Ptr(u64),
    U64(u64),
    U32(u32),
    F64(f64),
    Dims(Dims),
}

impl Arg {
    fn ty(&self) -> Ty {
        match self {
            Arg::Ptr(_) => Ty::Ptr,
            Arg::U64(_) => Ty::U64,
            Arg::U32(_) => Ty::U32,
            Arg::F64(_) => Ty::F64,
            Arg::Dims(_) => Ty::Dims,
        }
    }
}

/// Queues kernel `op` of `family` with `args`, after checking them, in number and type, against
/// the kernel's signature (`kernels::SIGNATURES`, itself checked against the `.cu` sources).
///
/// # Safety
/// Pointer arguments must be device addresses valid, for everything the kernel reads and writes
/// there, until the queued work completes.
unsafe fn launch(
    stream: &CudaStream,
    f: &CudaFunction,
    family: Family,
    op: &str,
    cfg: LaunchConfig,
    args: &[Arg],
) -> Result<()> {
    let sig = signature(family, op)
        .ok_or_else(|| Error::Cuda(format!("internal: no signature for kernel {op}")))?;
    check_grid(op, &cfg)?;
    let given: Vec<Ty> = args.iter().map(Arg::ty).collect();
    if given != sig {
        return Err(Error::Cuda(format!(
            "internal: kernel {op} takes {sig:?}, was given {given:?}"
        )));
    }
    let mut b = stream.launch_builder(f);
    for a in args {
        match a {
            Arg::Ptr(v) | Arg::U64(v) => b.arg(v),
            Arg::U32(v) => b.arg(v),
            Arg::F64(v) => b.arg(v),
            Arg::Dims(v) => b.arg(v),
        };
    }
    // SAFETY: the arguments match the kernel's parameters in number and type (checked above);
    // the caller guarantees the pointers are valid for the kernel's accesses.
    unsafe { b.launch(cfg) }.map_err(driver_err)?;
    Ok(())
}

/// Refuses a grid larger than the device takes (see [`launch_cfg`]): more than 2^31 - 1 blocks
/// along x or 65535 along y or z.
fn check_grid(op: &str, cfg: &LaunchConfig) -> Result<()> {
    let (x, y, z) = cfg.grid_dim;
    if x == 0 || x > MAX_GRID_X || y == 0 || y > 65535 || z == 0 || z > 65535 {
        return Err(Error::Cuda(format!(
            "kernel {op} would need a grid of {x} x {y} x {z} blocks, past what one launch \
             takes (2^31 - 1 x 65535 x 65535): too many elements for one call"
        )));
    }
    Ok(())
}

/// Exclusive scan of `len` u64 at `data`, in place, with `sums` as scratch.
///
/// # Safety
/// `data` must hold `len` u64 and `sums` at least `scan_sums_len(len)` u64, on the stream's device.
unsafe fn scan(
    block: &CudaFunction,
    add: &CudaFunction,
    stream: &CudaStream,
    data: u64,
    len: u64,
    sums: u64,
) -> Result<()> {
    let blocks = len.div_ceil(SCAN_BLOCK).max(1);
    let cfg = launch_cfg(blocks * SCAN_BLOCK, SCAN_BLOCK as u32);
    let args = [Arg::Ptr(data), Arg::U64(len), Arg::Ptr(sums)];
    // SAFETY: sizes as this function's contract states.
    unsafe { launch(stream, block, Family::Scan, "block", cfg, &args) }?;
    if blocks > 1 {
        // SAFETY: the next level's data is `blocks` u64 at `sums`, with its own scratch after
        // them (`scan_sums_len` counts both).
        unsafe { scan(block, add, stream, sums, blocks, sums + 8 * blocks) }?;
        // SAFETY: as the first launch.
        unsafe { launch(stream, add, Family::Scan, "add", cfg, &args) }?;
    }
    Ok(())
}

/// Bytes a chunk's staging slot takes in [`compress_lossless`]'s workspace: the raw chunk,
/// which bounds whatever method the chunk gets.
fn lossless_slot(dtype: DType) -> u64 {
    (crate::lossless::CHUNK as u64 * dtype.size() as u64).div_ceil(4) * 4
}

/// Workspace bytes [`compress_lossless`] needs for `n` elements of `dtype`: the chunk lengths
/// and their scan, the chunk table, and a staging slot per chunk.
pub fn lossless_workspace_len(n: u64, dtype: DType) -> u64 {
    let chunks = n.div_ceil(crate::lossless::CHUNK as u64);
    WS_HEADER
        + 8 * (chunks + 1 + scan_sums_len(chunks + 1))
        + 8 * chunks.div_ceil(2)
        + chunks * lossless_slot(dtype)
}

/// Bytes of output buffer that always hold [`compress_lossless`]'s frame (its real size is
/// written to the workspace): the header, a table entry and up to 3 bytes of padding per
/// chunk, and the elements.
pub fn lossless_capacity(n: u64, dtype: DType, ndim: usize) -> u64 {
    let chunks = n.div_ceil(crate::lossless::CHUNK as u64);
    (FIXED_HEADER_LEN + 8 * ndim) as u64 + 8 * chunks + n * dtype.size() as u64
}

/// Arguments of [`compress_lossless`].
#[derive(Debug, Clone)]
pub struct LosslessCompressArgs<'a> {
    /// Device ordinal.
    pub device: usize,
    /// A `CUstream` of the device's primary context.
    pub stream: usize,
    /// The elements: `n` of `dtype`, contiguous.
    pub input: u64,
    /// Element count.
    pub n: u64,
    /// Element type (any).
    pub dtype: DType,
    /// Dimensions (their product is `n`).
    pub shape: &'a [u64],
    /// Output buffer for the frame.
    pub out: u64,
    /// Its size, at least [`lossless_capacity`].
    pub out_len: u64,
    /// Workspace, at least [`lossless_workspace_len`] bytes.
    pub workspace: u64,
    /// Its size.
    pub workspace_len: u64,
}

/// Compresses losslessly on the device, producing exactly the bytes of
/// [`crate::compress_lossless_bytes`] (without a zstd stage), and returns without waiting for
/// the GPU. The frame's size is written (as a u64) at [`FRAME_SIZE_OFFSET`] of the workspace.
///
/// The elements are not checked: a `bool` input must hold only bytes 0 and 1 (the host encoder
/// refuses others with [`Error::InvalidBool`], and every reader refuses a frame holding them).
///
/// # Safety
/// Every pointer must be a device address on `args.device` valid for its stated length until
/// the work queued on `args.stream` completes; `input`, `out` and `workspace` must not overlap
/// one another.
///
/// # Errors
/// [`Error::ShapeMismatch`], [`Error::OutputSize`] for bad arguments (checked before anything
/// is queued); [`Error::CudaUnavailable`], [`Error::Nvrtc`], [`Error::Cuda`] from the driver.
pub unsafe fn compress_lossless(args: &LosslessCompressArgs<'_>) -> Result<()> {
    let n = args.n;
    let ndim = args.shape.len();
    check_shape(args.shape, n)?;
    let need_out = lossless_capacity(n, args.dtype, ndim);
    if args.out_len < need_out {
        return Err(Error::OutputSize {
            expected: need_out,
            got: args.out_len,
        });
    }
    let need_ws = lossless_workspace_len(n, args.dtype);
    if args.workspace_len < need_ws {
        return Err(Error::OutputSize {
            expected: need_ws,
            got: args.workspace_len,
        });
    }
    let _restore = ContextGuard::save()?;
    let dev = device(args.device)?;
    let stream = dev.stream(args.stream)?;
    let l = Family::Lossless;
    let w = args.dtype.size();
    let encode_op = match w {
        1 => "encode_w1",
        2 => "encode_w2",
        4 => "encode_w4",
        _ => "encode_w8",
    };
    let encode = dev.function(l, encode_op, None)?;
    let (lengths, finish, gather) = (
        dev.function(l, "entry_lengths", None)?,
        dev.function(l, "finish", None)?,
        dev.function(l, "gather", None)?,
    );
    let (scan_block, scan_add) = (
        dev.function(Family::Scan, "block", None)?,
        dev.function(Family::Scan, "add", None)?,
    );
    let chunks = n.div_ceil(crate::lossless::CHUNK as u64);
    let words = args.workspace + WS_HEADER;
    let sums = words + 8 * (chunks + 1);
    let entries = sums + 8 * scan_sums_len(chunks + 1);
    let staging = entries + 8 * chunks.div_ceil(2);
    let header_len = (FIXED_HEADER_LEN + 8 * ndim) as u64;
    let per_chunk = |threads: u32| LaunchConfig {
        grid_dim: (chunks.clamp(1, u32::MAX as u64) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let one = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    let (frame_size, raw_flag) = (
        args.workspace + FRAME_SIZE_OFFSET,
        args.workspace + RAW_FLAG_OFFSET,
    );
    // SAFETY: (every launch) the input holds `n` elements of `dtype` and the output and
    // workspace sizes were checked above against `lossless_capacity` and
    // `lossless_workspace_len`, whose layout is the one used here; `launch` checks each argument
    // list against the kernel's signature.
    unsafe {
        if chunks > 0 {
            launch(
                &stream,
                &encode,
                l,
                encode_op,
                per_chunk(LOSSLESS_THREADS),
                &[
                    Arg::Ptr(args.input),
                    Arg::U64(n),
                    Arg::Ptr(staging),
                    Arg::Ptr(entries),
                ],
            )?;
        }
        launch(
            &stream,
            &lengths,
            l,
            "entry_lengths",
            launch_cfg(chunks + 1, BLOCK),
            &[Arg::Ptr(entries), Arg::U64(chunks), Arg::Ptr(words)],
        )?;
        scan(&scan_block, &scan_add, &stream, words, chunks + 1, sums)?;
        launch(
            &stream,
            &finish,
            l,
            "finish",
            one,
            &[
                Arg::Ptr(args.out),
                Arg::U64(n),
                Arg::U64(chunks),
                Arg::U32(args.dtype.code() as u32),
                Arg::U32(w as u32),
                Arg::U32(ndim as u32),
                Arg::Dims(Dims::of(args.shape)),
                Arg::Ptr(words),
                Arg::Ptr(frame_size),
                Arg::Ptr(raw_flag),
            ],
        )?;
        if chunks > 0 {
            launch(
                &stream,
                &gather,
                l,
                "gather",
                per_chunk(BLOCK),
                &[
                    Arg::Ptr(args.input),
                    Arg::U64(n),
                    Arg::U32(w as u32),
                    Arg::U64(header_len),
                    Arg::Ptr(staging),
                    Arg::Ptr(entries),
                    Arg::Ptr(words),
                    Arg::Ptr(raw_flag),
                    Arg::Ptr(args.out),
                ],
            )?;
        }
    }
    Ok(())
}

/// Threads per block of the lossless decoder (`LL_THREADS` in `kernels/lossless.cu`).
const LOSSLESS_THREADS: u32 = 128;

/// The lossless part of [`decompress`]: the chunks' offsets, then every chunk.
///
/// # Safety
/// As [`decompress`]; the workspace size was checked there.
unsafe fn decompress_lossless(
    args: &DecompressArgs,
    dev: &Device,
    stream: &CudaStream,
) -> Result<()> {
    // SAFETY: this function's contract.
    unsafe {
        lossless_offsets_on(args, dev, stream)?;
        lossless_chunks_on(args, dev, stream, 0, u64::MAX)
    }
}

fn check_lossless(args: &DecompressArgs) -> Result<()> {
    if args.codec != crate::Codec::Lossless {
        return Err(Error::Incompatible {
            what: "codec",
            left: "lossless".into(),
            right: format!("{:?}", args.codec).to_lowercase(),
        });
    }
    check_decompress_args(args)
}

/// First half of decoding a lossless frame in parts: queues the computation of every chunk's
/// offset into the workspace. Only the frame's header and chunk table need to be on the device
/// yet, so the copy of the chunks can overlap it (see [`lossless_chunks`]).
///
/// # Safety
/// As [`decompress`] (a lossless frame checked on the host), except that only the header and
/// the chunk table must be on the device when the queued work runs.
///
/// # Errors
/// As [`decompress`], and [`Error::Incompatible`] for a frame that is not lossless.
pub unsafe fn lossless_offsets(args: &DecompressArgs) -> Result<()> {
    check_lossless(args)?;
    let _restore = ContextGuard::save()?;
    let dev = device(args.device)?;
    let stream = dev.stream(args.stream)?;
    // SAFETY: this function's contract.
    unsafe { lossless_offsets_on(args, &dev, &stream) }
}

/// Second half: queues the decoding of chunks `first..last` (clamped to the frame's chunks),
/// after [`lossless_offsets`] was queued with the same arguments. Those chunks' payloads must
/// be on the device when the queued work runs.
///
/// # Safety
/// As [`lossless_offsets`], for the payloads of chunks `first..last`.
///
/// # Errors
/// As [`lossless_offsets`].
pub unsafe fn lossless_chunks(args: &DecompressArgs, first: u64, last: u64) -> Result<()> {
    check_lossless(args)?;
    let _restore = ContextGuard::save()?;
    let dev = device(args.device)?;
    let stream = dev.stream(args.stream)?;
    // SAFETY: this function's contract.
    unsafe { lossless_chunks_on(args, &dev, &stream, first, last) }
}

/// # Safety
/// As [`lossless_offsets`].
unsafe fn lossless_offsets_on(
    args: &DecompressArgs,
    dev: &Device,
    stream: &CudaStream,
) -> Result<()> {
    let chunks = args.n.div_ceil(crate::lossless::CHUNK as u64);
    if chunks == 0 {
        return Ok(());
    }
    let l = Family::Lossless;
    let lengths = dev.function(l, "lengths", None)?;
    let (scan_block, scan_add) = (
        dev.function(Family::Scan, "block", None)?,
        dev.function(Family::Scan, "add", None)?,
    );
    // `workspace_len(n)` holds 2 (groups + 1) u64 plus scan sums; chunks < groups.
    let words = args.workspace + WS_HEADER;
    let sums = words + 8 * (chunks + 1);
    let header_len = (FIXED_HEADER_LEN + 8 * args.ndim) as u64;
    // SAFETY: the frame was checked on the host (the caller's contract), so its chunk table
    // holds `chunks` entries; the workspace holds `chunks + 1` words and their scan sums.
    unsafe {
        launch(
            stream,
            &lengths,
            l,
            "lengths",
            launch_cfg(chunks + 1, BLOCK),
            &[
                Arg::Ptr(args.frame),
                Arg::U64(header_len),
                Arg::U64(chunks),
                Arg::Ptr(words),
            ],
        )?;
        scan(&scan_block, &scan_add, stream, words, chunks + 1, sums)
    }
}

/// # Safety
/// As [`lossless_chunks`].
unsafe fn lossless_chunks_on(
    args: &DecompressArgs,
    dev: &Device,
    stream: &CudaStream,
    first: u64,
    last: u64,
) -> Result<()> {
    let chunks = args.n.div_ceil(crate::lossless::CHUNK as u64);
    let last = last.min(chunks);
    if first >= last {
        return Ok(());
    }
    let op = match args.dtype.size() {
        1 => "decode_w1",
        2 => "decode_w2",
        4 => "decode_w4",
        _ => "decode_w8",
    };
    let decode = dev.function(Family::Lossless, op, None)?;
    let header_len = (FIXED_HEADER_LEN + 8 * args.ndim) as u64;
    // One block per chunk: many short blocks balance better across SMs than few long ones.
    let grid = LaunchConfig {
        grid_dim: ((last - first).min(u32::MAX as u64) as u32, 1, 1),
        block_dim: (LOSSLESS_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the frame was checked on the host and the offsets were queued before (the
    // caller's contract), so chunks `first..last` lie within the frame and decode to their
    // elements of `out`, which holds `n`.
    unsafe {
        launch(
            stream,
            &decode,
            Family::Lossless,
            op,
            grid,
            &[
                Arg::Ptr(args.frame),
                Arg::U64(header_len),
                Arg::U64(args.n),
                Arg::Ptr(args.workspace + WS_HEADER),
                Arg::Ptr(args.out),
                Arg::U64(first),
                Arg::U64(last),
            ],
        )
    }
}

/// Compresses on the device, producing exactly the bytes of [`crate::compress`], and returns
/// without waiting for the GPU. The frame's size is written (as a u64) at
/// [`FRAME_SIZE_OFFSET`] of the workspace (and at `size_to`, if given; with error feedback,
/// the residual's running maximum is raised at `max_error_to`, if given); in `rel` mode (or
/// with `bound_at`) a nonzero u32 at [`BOUND_ERROR_OFFSET`] means the bound was unusable (the
/// CPU codec's `InvalidBound`), and the frame's first byte is then 0, not a magic any reader
/// takes.
///
/// # Safety
/// Every pointer must be a device address on `args.device` valid for its stated length until
/// the work queued on `args.stream` completes; `input`, `out`, `workspace`, `residual`,
/// `size_to` and `max_error_to` must not overlap one another.
///
/// # Errors
/// [`Error::InvalidBound`], [`Error::ShapeMismatch`], [`Error::OutputSize`] for bad arguments
/// (checked before anything is queued); [`Error::CudaUnavailable`], [`Error::Nvrtc`],
/// [`Error::Cuda`] from the driver.
pub unsafe fn compress(args: &CompressArgs<'_>) -> Result<()> {
    let n = args.n;
    let ndim = args.shape.len();
    check_shape(args.shape, n)?;
    if !args.dtype.is_quantizable() {
        return Err(Error::NotQuantizable(args.dtype));
    }
    let (mode, value, fixed) = match args.bound {
        Bound::Abs(eps) => {
            crate::codec::check_abs_bound(eps, "eps")?;
            (BoundMode::Abs, eps, 0u32)
        }
        Bound::Rel(rel) => {
            crate::codec::check_rel(rel)?;
            (BoundMode::Rel, rel, 0)
        }
        Bound::Bits(b) => {
            crate::codec::check_bits(b)?;
            (BoundMode::Bits, b as f64, b as u32)
        }
    };
    if args.bound_at != 0 && mode != BoundMode::Abs {
        return Err(Error::Cuda(
            "compress: a bound read from device memory must be an absolute one".into(),
        ));
    }
    let need_out = compress_capacity(n, args.dtype, ndim, args.bound);
    if args.out_len < need_out {
        return Err(Error::OutputSize {
            expected: need_out,
            got: args.out_len,
        });
    }
    let need_ws = compress_workspace_len(n, args.residual != 0);
    if args.workspace_len < need_ws {
        return Err(Error::OutputSize {
            expected: need_ws,
            got: args.workspace_len,
        });
    }
    // A misaligned load or store would be a device fault, which ends the whole context: the
    // u64 and f64 words need 8 bytes, the workspace 16 (its chunk table is stored as `uint4`),
    // the residual its floats' 4 and the input its elements' size.
    for (what, at, align) in [
        ("frame size's", args.size_to, 8),
        ("running maximum's", args.max_error_to, 8),
        ("bound's", args.bound_at, 8),
        ("workspace's", args.workspace, 16),
        ("residual's", args.residual, 4),
        ("input's", args.input, args.dtype.size() as u64),
    ] {
        if at % align != 0 {
            return Err(Error::Cuda(format!(
                "compress: the {what} address {at:#x} is not {align}-aligned"
            )));
        }
    }
    let _restore = ContextGuard::save()?;
    let dev = device(args.device)?;
    let stream = dev.stream(args.stream)?;
    let k = dev.kernels(args.dtype)?;
    // A tile is 8 `wc` chunks: the packer's warps take `wc` chunks each, 4 when that still gives
    // every SM a few waves of blocks, else 1 (more blocks for small inputs); the encoder runs a
    // thread per group, so 64 `wc` threads per tile, each with a row of its group's values in
    // shared memory.
    let chunks = groups_for(n).div_ceil(CHUNK_GROUPS);
    let wc = if chunks / (4 * WARPS) >= 2 * dev.grid_blocks {
        4
    } else {
        1
    };
    let layout = tile_layout(n, WARPS * wc);
    let header_len = (FIXED_HEADER_LEN + 8 * ndim) as u64;
    let mode_code = match mode {
        BoundMode::Abs => 0u32,
        BoundMode::Rel => 1,
        _ => 2,
    };
    let elements = launch_cfg(n.min(dev.grid_blocks * BLOCK as u64), BLOCK);
    let one_tile_each = launch_cfg(layout.tiles * BLOCK as u64, BLOCK);
    let encoder_threads = (WARPS * wc * CHUNK_GROUPS) as u32;
    // A row of values per thread, and with error feedback a row of compensated values.
    let rows = if args.residual != 0 { 2 } else { 1 };
    let encoder_tiles = LaunchConfig {
        shared_mem_bytes: rows * encoder_threads * ENCODER_ROW_BYTES,
        ..launch_cfg(layout.tiles * encoder_threads as u64, encoder_threads)
    };
    let (input, residual, ws) = (
        Arg::Ptr(args.input),
        Arg::Ptr(args.residual),
        Arg::Ptr(args.workspace),
    );
    let (n_a, fixed_a) = (Arg::U64(n), Arg::U32(fixed));
    // SAFETY: (every launch below) pointers are the caller's device buffers, whose sizes were
    // checked above against `compress_workspace_len` and `compress_capacity`, and the residual
    // (if any) holds `n` floats by this function's contract; `launch` checks each argument list
    // against the kernel's signature.
    unsafe {
        zero(&stream, args.workspace, layout.zeroed)?;
        if mode != BoundMode::Abs {
            let max_abs = [input, n_a, ws, residual];
            launch(
                &stream,
                &k.max_abs,
                Family::Codec,
                "max_abs",
                elements,
                &max_abs,
            )?;
        }
        let encode = [
            input,
            n_a,
            Arg::U32(mode_code),
            Arg::F64(value),
            fixed_a,
            Arg::Ptr(args.out + header_len),
            ws,
            residual,
            Arg::Ptr(args.bound_at),
        ];
        launch(
            &stream,
            &k.encode,
            Family::Codec,
            "encode_groups",
            encoder_tiles,
            &encode,
        )?;
        let pack = [
            input,
            n_a,
            Arg::U32(args.dtype.code() as u32),
            Arg::U32(mode_code),
            fixed_a,
            Arg::U32(ndim as u32),
            Arg::Dims(Dims::of(args.shape)),
            Arg::Ptr(args.out),
            ws,
            residual,
            Arg::U32(wc as u32),
            Arg::Ptr(args.size_to),
            Arg::Ptr(args.max_error_to),
        ];
        launch(
            &stream,
            &k.pack,
            Family::Codec,
            "pack_chunks",
            one_tile_each,
            &pack,
        )?;
    }
    Ok(())
}

/// The shape as the `Dims` struct of the `finish` kernels.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Dims([u64; MAX_NDIM]);

impl Dims {
    /// A shape of at most [`MAX_NDIM`] dimensions (checked by the caller), zero-padded.
    fn of(shape: &[u64]) -> Dims {
        let mut d = [0u64; MAX_NDIM];
        d[..shape.len()].copy_from_slice(shape);
        Dims(d)
    }
}

// SAFETY: `Dims` is `repr(C)`, plain old data, with the layout of `struct Dims { u64 d[8]; }`.
unsafe impl cudarc::driver::DeviceRepr for Dims {}

/// Arguments of [`decompress`].
#[derive(Debug, Clone)]
pub struct DecompressArgs {
    /// Device ordinal.
    pub device: usize,
    /// A `CUstream` of the device's primary context.
    pub stream: usize,
    /// The frame in device memory: checked on the host ([`crate::validate`]) or written by
    /// [`compress`]; without a zstd stage (the caller checks the header's flag).
    pub frame: u64,
    /// Element count (from the frame's header).
    pub n: u64,
    /// Element type (from the header).
    pub dtype: DType,
    /// How the body stores the elements (from the header).
    pub codec: crate::Codec,
    /// Dimensions in the header (sets the header's length).
    pub ndim: usize,
    /// Output: `n` elements of `dtype`.
    pub out: u64,
    /// Workspace, at least [`workspace_len`] bytes.
    pub workspace: u64,
    /// Its size.
    pub workspace_len: u64,
}

/// Decodes a frame on the device into `out`, without waiting for the GPU.
///
/// # Safety
/// Pointers must be device addresses on `args.device`, valid until the queued work completes.
/// The frame must have been checked by [`crate::validate`] (or [`crate::OpenFrame::open`]) on
/// the host, or written by [`compress`]: the kernels read what its header and widths say.
///
/// `n`, `dtype` and `ndim` must be the frame's own (the kernels trust them to size reads).
///
/// # Errors
/// [`Error::OutputSize`] for a small workspace, [`Error::Format`] for more than 8 dimensions,
/// and CUDA errors.
pub unsafe fn decompress(args: &DecompressArgs) -> Result<()> {
    check_decompress_args(args)?;
    let _restore = ContextGuard::save()?;
    let dev = device(args.device)?;
    let stream = dev.stream(args.stream)?;
    if args.codec == crate::Codec::Lossless {
        // SAFETY: this function's contract.
        return unsafe { decompress_lossless(args, &dev, &stream) };
    }
    if !args.dtype.is_quantizable() {
        // A raw frame of another dtype: the caller copies its body (no kernel needed).
        return Err(Error::NotQuantizable(args.dtype));
    }
    let k = dev.kernels(args.dtype)?;
    let n = args.n;
    let layout = tile_layout(n, TILE_CHUNKS);
    let header_len = (FIXED_HEADER_LEN + 8 * args.ndim) as u64;
    let frame = Arg::Ptr(args.frame);
    let (hl, n_a, ws) = (Arg::U64(header_len), Arg::U64(n), Arg::Ptr(args.workspace));
    let offsets = [frame, hl, n_a, ws];
    let decode = [frame, hl, n_a, ws, Arg::Ptr(args.out)];
    let nwords = args.workspace + WS_TOTAL_WORDS;
    let scatter = [
        frame,
        Arg::U64(header_len),
        Arg::U64(n),
        Arg::U64(groups_for(n)),
        Arg::Ptr(nwords),
        Arg::Ptr(args.out),
    ];
    // SAFETY: (every launch below) the frame was checked on the host or written by `compress`,
    // and `n`, `dtype`, `ndim` are its own (this function's contract), so its widths, planes and
    // exceptions lie within it; the workspace size was checked above; `launch` checks each
    // argument list against the kernel's signature.
    unsafe {
        zero(&stream, args.workspace, layout.zeroed)?;
        let one_chunk_per_warp = launch_cfg(layout.chunk_blocks * BLOCK as u64, BLOCK);
        let one_span_each = launch_cfg(layout.spans * BLOCK as u64, BLOCK);
        launch(
            &stream,
            &k.offsets,
            Family::Codec,
            "decode_offsets",
            one_span_each,
            &offsets,
        )?;
        launch(
            &stream,
            &k.decode,
            Family::Codec,
            "decode_chunks",
            one_chunk_per_warp,
            &decode,
        )?;
        // Exceptions are rare: a small grid walks them (and returns at once when there are none).
        let exc_cfg = launch_cfg(n.min(1 << 16), BLOCK);
        launch(
            &stream,
            &k.scatter,
            Family::Codec,
            "scatter_exceptions",
            exc_cfg,
            &scatter,
        )?;
    }
    Ok(())
}

/// Where [`sum`] keeps its state in a workspace: the packer's chunk offsets (tiles of 8 chunks),
/// the sum's exception mask, codes (i64) and exception values (u32 bits), the table of the
/// parts' frame addresses, and a region per part for its chunk offsets.
struct SumLayout {
    tiles: TileLayout,
    union_mask: u64,
    acc: u64,
    value_bits: u64,
    table: u64,
    parts: u64,
    /// Bytes of each part's region, and of the counters at its start zeroed before use.
    part_stride: u64,
    part_zeroed: u64,
    end: u64,
}

fn sum_layout(n: u64, parts: u64) -> SumLayout {
    let tiles = tile_layout(n, SMALLEST_TILE);
    let part = tile_layout(n, TILE_CHUNKS);
    let union_mask = tiles.decode_end.div_ceil(16) * 16;
    let acc = (union_mask + 4 * groups_for(n)).div_ceil(16) * 16;
    let value_bits = acc + 8 * n;
    let table = (value_bits + 4 * n).div_ceil(16) * 16;
    let parts_at = (table + 16 * parts).div_ceil(16) * 16;
    let part_stride = part.decode_end.div_ceil(16) * 16;
    SumLayout {
        tiles,
        union_mask,
        acc,
        value_bits,
        table,
        parts: parts_at,
        part_stride,
        part_zeroed: part.zeroed,
        end: parts_at + parts * part_stride,
    }
}

/// Workspace bytes [`sum`] needs for `parts` frames of `n` elements: the sum's codes (8 bytes
/// per element), exception values (4) and mask, and every part's chunk offsets (about 0.07 bytes
/// per element each).
pub fn sum_workspace_len(n: u64, parts: u64) -> u64 {
    sum_layout(n, parts).end
}

/// Bytes of output that always suffice for the sum of frames of `n` elements: widths up to 64
/// bits, and every element possibly an exception (the frame's real size goes to the workspace).
pub fn sum_capacity(n: u64, dtype: DType, ndim: usize) -> u64 {
    let header = (FIXED_HEADER_LEN + 8 * ndim) as u64;
    header + groups_for(n) * (1 + 4 * 64) + n * (index_size_for(n) as u64 + dtype.size() as u64)
}

/// Arguments of [`sum`]; pointers are device addresses on `device`.
#[derive(Debug, Clone)]
pub struct SumArgs<'a> {
    /// Device ordinal.
    pub device: usize,
    /// A `CUstream` of the device's primary context; all work is queued on it.
    pub stream: usize,
    /// The frames to add, in order: quantized or raw frames (not lossless ones, not with a
    /// zstd stage) of `n` elements of `dtype` with `shape`. They are checked on the device
    /// before anything is added (see [`SUM_BAD_FRAME`]), so they may come from anywhere.
    pub frames: &'a [u64],
    /// Bytes readable at each frame (its size, or the room it lies in): nothing past them
    /// is read.
    pub frame_lens: &'a [u64],
    /// Element count of every frame.
    pub n: u64,
    /// Element type of every frame.
    pub dtype: DType,
    /// Dimensions of every frame (product `n`); the sum gets them too.
    pub shape: &'a [u64],
    /// Output buffer, at least [`sum_capacity`] bytes.
    pub out: u64,
    /// Its size.
    pub out_len: u64,
    /// Workspace, at least [`sum_workspace_len`] bytes. The frame's size is written at
    /// [`FRAME_SIZE_OFFSET`] (0 when the sum failed) and the failure at
    /// [`BOUND_ERROR_OFFSET`] (a u32: [`SUM_STEPS_DIFFER`], [`SUM_OVERFLOW`], [`SUM_BAD_FRAME`]
    /// and/or [`SUM_EPS_OVERFLOW`], then a u32 that, with [`SUM_BAD_FRAME`], holds a bad frame's
    /// index + 1). A failed sum's output starts with a 0 byte, not a magic any reader takes
    /// (another sum, a decoding, queued before anyone waits for this one).
    pub workspace: u64,
    /// Its size.
    pub workspace_len: u64,
}

/// Most frames one [`sum`] takes: `sum_offsets` gives each its own row of the grid, whose
/// second dimension CUDA caps at 65535.
pub const MAX_SUM_PARTS: u64 = 65535;

/// Error bit of [`sum`]: the frames' steps are not all the same.
pub const SUM_STEPS_DIFFER: u32 = 1;
/// Error bit of [`sum`]: a sum of codes leaves the 64-bit range.
pub const SUM_OVERFLOW: u32 = 2;
/// Error bit of [`sum`]: a frame is not a frame of these elements laid out as its header
/// says, within its length (nothing was added).
pub const SUM_BAD_FRAME: u32 = 4;
/// Error bit of [`sum`]: the parts' eps add up to more than the largest f64 (the CPU's
/// [`crate::sum_frames`] refuses that sum as well).
pub const SUM_EPS_OVERFLOW: u32 = 8;

/// Checks on the host that every frame's readable length could hold a frame of `n` elements
/// in `ndim` dimensions ([`crate::format::min_frame_len`]: its header and a width byte per
/// group, what `sum_offsets` reads before anything is checked on the device).
fn check_frame_lens(frames: &[u64], lens: &[u64], ndim: usize, n: u64) -> Result<()> {
    if lens.len() != frames.len() {
        return Err(Error::Incompatible {
            what: "count",
            left: format!("{} frames", frames.len()),
            right: format!("{} frame lengths", lens.len()),
        });
    }
    let needed = crate::format::min_frame_len(n, ndim);
    match lens.iter().find(|&&len| len < needed) {
        Some(&len) => Err(crate::FormatError::Truncated {
            part: "frame",
            needed,
            available: len,
        }
        .into()),
        None => Ok(()),
    }
}

/// Queues what [`sum`] and [`decode_sum`] both start with: the frames' addresses, then their
/// readable lengths, into the table at `table`, 8 to a launch (no host memory is copied, so
/// nothing waits); every frame's chunk offsets (`sum_offsets`, a frame per grid row) into its
/// region of `stride` bytes at `regions`, whose counters must be zero; then `check_frames`,
/// which sets `bit` in the u32 at `status` (and a bad frame's index + 1 in the u32 after it)
/// for a frame that is not what its header says, within its length, or (with `Some` dims in
/// `shape`) whose dimensions are not those.
///
/// # Safety
/// The table must hold 16 bytes per frame and each region `stride` bytes (at least the
/// decoder's `decode_end` for `n` elements), `status` 8 bytes, valid until the queued work
/// completes; each frame `lens[p]` readable bytes, at least [`check_frame_lens`]'s.
#[allow(clippy::too_many_arguments)]
unsafe fn checked_part_offsets(
    stream: &CudaStream,
    k: &Kernels,
    frames: &[u64],
    lens: &[u64],
    lens_before: u64,
    table: u64,
    regions: u64,
    stride: u64,
    shape: (u64, DType, usize, Option<&[u64]>),
    status: (u64, u32),
) -> Result<()> {
    let (n, dtype, ndim, dims) = shape;
    let header_len = (FIXED_HEADER_LEN + 8 * ndim) as u64;
    let parts = frames.len() as u64;
    // SAFETY: (every launch) this function's contract; `launch` checks each argument list.
    unsafe {
        // The frames' addresses, then their lengths, back to back: eight values a launch (one
        // launch for up to four frames). With `lens_before`, each length is then lowered on the
        // device to the size before its frame.
        let values: Vec<u64> = frames.iter().chain(lens).copied().collect();
        for (b, batch) in values.chunks(MAX_NDIM).enumerate() {
            let mut eight = [0u64; MAX_NDIM];
            eight[..batch.len()].copy_from_slice(batch);
            launch(
                stream,
                &k.sum_table,
                Family::Codec,
                "sum_table",
                launch_cfg(32, 32),
                &[
                    Arg::Ptr(table + 8 * (b * MAX_NDIM) as u64),
                    Arg::Dims(Dims(eight)),
                    Arg::U32(batch.len() as u32),
                ],
            )?;
        }
        if lens_before != 0 {
            launch(
                stream,
                &k.sum_lens,
                Family::Codec,
                "sum_lens",
                launch_cfg(32, 32),
                &[
                    Arg::Ptr(table),
                    Arg::U32(parts as u32),
                    Arg::U64(lens_before),
                ],
            )?;
        }
        let mut offsets = launch_cfg(tile_layout(n, TILE_CHUNKS).spans * BLOCK as u64, BLOCK);
        offsets.grid_dim.1 = frames.len() as u32;
        launch(
            stream,
            &k.sum_offsets,
            Family::Codec,
            "sum_offsets",
            offsets,
            &[
                Arg::Ptr(table),
                Arg::U64(header_len),
                Arg::U64(n),
                Arg::Ptr(regions),
                Arg::U64(stride),
            ],
        )?;
        // Every block of a frame's row checks its header; they share out its exception list.
        let mut check = launch_cfg(n.min(16 * BLOCK as u64), BLOCK);
        check.grid_dim.1 = parts as u32;
        launch(
            stream,
            &k.check_frames,
            Family::Codec,
            "check_frames",
            check,
            &[
                Arg::Ptr(table),
                Arg::U32(parts as u32),
                Arg::U64(header_len),
                Arg::U64(n),
                Arg::U32(dtype.code() as u32),
                Arg::U32(dtype.size() as u32),
                Arg::U32(ndim as u32),
                Arg::Dims(Dims::of(dims.unwrap_or(&[]))),
                Arg::U32(dims.is_some() as u32),
                Arg::Ptr(regions),
                Arg::U64(stride),
                Arg::Ptr(status.0),
                Arg::U32(status.1),
            ],
        )
    }
}

/// Queues the element-wise sum of frames into one frame of mode `sum`, with the bytes that
/// [`crate::sum_frames`] (without zstd) gives for the same frames, without waiting for the GPU.
/// Frames whose steps differ, or whose codes overflow, and frames that are not what their
/// headers say, are known on the device only: the workspace then reports them (see
/// [`SumArgs::workspace`]) and the frame's size is 0.
///
/// # Safety
/// Pointers must be device addresses on `args.device`, valid until the queued work completes;
/// `frame_lens[p]` bytes must be readable at `frames[p]`.
///
/// # Errors
/// [`Error::Incompatible`] for no frames or lengths for other frames, [`Error::NotQuantizable`],
/// [`Error::ShapeMismatch`], [`Error::OutputSize`] for small buffers, a truncated frame for a
/// length that cannot hold one frame's header and widths (all checked before anything is
/// queued), and CUDA errors.
pub unsafe fn sum(args: &SumArgs<'_>) -> Result<()> {
    let n = args.n;
    let ndim = args.shape.len();
    let parts = args.frames.len() as u64;
    if parts == 0 {
        return Err(Error::Incompatible {
            what: "count",
            left: "at least one frame".into(),
            right: "none".into(),
        });
    }
    if parts > MAX_SUM_PARTS {
        return Err(Error::Incompatible {
            what: "count",
            left: format!("at most {MAX_SUM_PARTS} frames"),
            right: parts.to_string(),
        });
    }
    if !args.dtype.is_quantizable() {
        return Err(Error::NotQuantizable(args.dtype));
    }
    check_shape(args.shape, n)?;
    let need_out = sum_capacity(n, args.dtype, ndim);
    if args.out_len < need_out {
        return Err(Error::OutputSize {
            expected: need_out,
            got: args.out_len,
        });
    }
    let layout = sum_layout(n, parts);
    if args.workspace_len < layout.end {
        return Err(Error::OutputSize {
            expected: layout.end,
            got: args.workspace_len,
        });
    }
    check_frame_lens(args.frames, args.frame_lens, ndim, n)?;
    let _restore = ContextGuard::save()?;
    let dev = device(args.device)?;
    let stream = dev.stream(args.stream)?;
    let k = dev.kernels(args.dtype)?;
    let header_len = (FIXED_HEADER_LEN + 8 * ndim) as u64;
    let ws = args.workspace;
    let (ws_a, n_a, hl) = (Arg::Ptr(ws), Arg::U64(n), Arg::U64(header_len));
    let table = Arg::Ptr(ws + layout.table);
    let (parts_a, stride) = (Arg::Ptr(ws + layout.parts), Arg::U64(layout.part_stride));
    let union_a = Arg::Ptr(ws + layout.union_mask);
    let (acc_a, bits_a) = (Arg::Ptr(ws + layout.acc), Arg::Ptr(ws + layout.value_bits));
    let one_tile_each = launch_cfg(layout.tiles.tiles * BLOCK as u64, BLOCK);
    // SAFETY: (every call below) the workspace and output sizes were checked above against
    // `sum_layout` and `sum_capacity`, the frames' lengths against their headers' and widths'
    // (this function's contract: so much is readable); the kernels that add them run only for
    // frames that `check_frames` found to lie within their lengths; `launch` checks each
    // argument list against the kernel's signature.
    unsafe {
        zero(&stream, ws, layout.tiles.zeroed)?;
        for p in 0..parts {
            zero(
                &stream,
                ws + layout.parts + p * layout.part_stride,
                layout.part_zeroed,
            )?;
        }
        checked_part_offsets(
            &stream,
            &k,
            args.frames,
            args.frame_lens,
            0,
            ws + layout.table,
            ws + layout.parts,
            layout.part_stride,
            (n, args.dtype, ndim, Some(args.shape)),
            (ws + BOUND_ERROR_OFFSET, SUM_BAD_FRAME),
        )?;
        let chunks = [
            table,
            Arg::U32(parts as u32),
            hl,
            n_a,
            parts_a,
            stride,
            acc_a,
            union_a,
            Arg::Ptr(args.out + header_len),
            ws_a,
        ];
        launch(
            &stream,
            &k.sum_chunks,
            Family::Codec,
            "sum_chunks",
            one_tile_each,
            &chunks,
        )?;
        let values = [
            table,
            Arg::U32(parts as u32),
            hl,
            n_a,
            parts_a,
            stride,
            union_a,
            bits_a,
            Arg::Ptr(ws + BOUND_ERROR_OFFSET),
        ];
        launch(
            &stream,
            &k.sum_values,
            Family::Codec,
            "sum_values",
            one_tile_each,
            &values,
        )?;
        let pack = [
            acc_a,
            bits_a,
            n_a,
            Arg::U32(args.dtype.code() as u32),
            Arg::U32(ndim as u32),
            Arg::Dims(Dims::of(args.shape)),
            Arg::Ptr(args.out),
            ws_a,
            union_a,
        ];
        launch(
            &stream,
            &k.sum_pack,
            Family::Codec,
            "sum_pack",
            one_tile_each,
            &pack,
        )?;
    }
    Ok(())
}

/// Where [`decode_sum`] keeps its state in a workspace: the table of the frames' addresses and
/// lengths, then a region per frame for its chunk offsets.
fn decode_sum_layout(n: u64, parts: u64) -> (u64, u64, u64) {
    let regions = 16 * parts;
    let stride = tile_layout(n, TILE_CHUNKS).decode_end.div_ceil(16) * 16;
    (regions, stride, regions + parts * stride)
}

/// Workspace bytes [`decode_sum`] needs for `parts` frames of `n` elements (about 0.07 bytes
/// per element and frame: each frame's chunk offsets).
pub fn decode_sum_workspace_len(n: u64, parts: u64) -> u64 {
    decode_sum_layout(n, parts).2
}

/// Arguments of [`decode_sum`]; pointers are device addresses on `device`.
#[derive(Debug, Clone)]
pub struct DecodeSumArgs<'a> {
    /// Device ordinal.
    pub device: usize,
    /// A `CUstream` of the device's primary context; all work is queued on it.
    pub stream: usize,
    /// The frames to add, in order: quantized or raw frames (not lossless ones, not with a
    /// zstd stage) of `n` elements of `dtype` in `ndim` dimensions. Each may have its own
    /// step. They are checked on the device before anything is written (see
    /// [`DecodeSumArgs::status`]), so they may come from anywhere.
    pub frames: &'a [u64],
    /// Bytes readable at each frame (its size, or the room it lies in): nothing past them
    /// is read.
    pub frame_lens: &'a [u64],
    /// 0, or the offset before each frame (8-aligned, readable) of a u64 that holds the frame's
    /// size when the decoding runs (a row's head, in cfc's exchanges): each frame's length is
    /// then the smaller of that and its `frame_lens` value (the room it lies in), read on the
    /// device, so that work recorded once as a CUDA graph replays with each step's sizes.
    pub lens_before: u64,
    /// Element count of every frame.
    pub n: u64,
    /// Element type of every frame.
    pub dtype: DType,
    /// Dimensions in every frame's header (sets the header's length).
    pub ndim: usize,
    /// What the sum is multiplied by before it is written (an f32; e.g. `1 / world` for an
    /// average). 1 writes the sum itself.
    pub scale: f32,
    /// Output: `n` elements of `out_dtype` (float32, bfloat16 or float16).
    pub out: u64,
    /// Element type of the output.
    pub out_dtype: DType,
    /// Workspace, at least [`decode_sum_workspace_len`] bytes.
    pub workspace: u64,
    /// Its size.
    pub workspace_len: u64,
    /// 8 bytes of device memory, zeroed before their first use and kept from call to call:
    /// a u32 of error bits ([`DECODE_BAD_FRAME`]: a frame is not a frame of these elements
    /// laid out as its header says, within its length), then a u32 that holds a bad frame's
    /// index + 1. While they are not zero, nothing is written: a caller that keeps them
    /// across calls reads them back whenever it likes, and no call after a failure decodes.
    pub status: u64,
}

/// Error bit of [`decode_sum`]'s status: a frame is not what its header says (see
/// [`DecodeSumArgs::status`]).
pub const DECODE_BAD_FRAME: u32 = 1;

/// What a [`decode_sum`] status reports (its 8 bytes read back as a little-endian u64: the
/// error bits, then the bad frame's index + 1), for frames that come from `source`s counted
/// from 0 (e.g. "rank"): `None` while it reports nothing.
pub fn decode_status_error(status: u64, source: &str) -> Option<String> {
    let status = [status as u32, (status >> 32) as u32];
    if status[0] == 0 {
        return None;
    }
    let which = match status[1] {
        0 => "a frame".to_string(),
        i => format!("the frame of {source} {}", i - 1),
    };
    Some(format!(
        "{which} is not a frame of the elements decoded, laid out as its header says within its \
         size (checked on the device): nothing was decoded from then on (error bits {:#x})",
        status[0]
    ))
}

/// Queues the decoded sum of frames, scaled and written in another dtype, in one pass that
/// writes nothing but the output: `out[i] = scale * (v_0[i] + v_1[i] + ...)`, where `v_p[i]`
/// is what [`decompress`] gives for frame `p`, widened to f32; the sum runs in f32 in frame
/// order from `v_0[i]`, and the product (skipped when `scale` is 1) is rounded to f32, then
/// to `out_dtype` (to nearest even). A NaN comes out as `out_dtype`'s canonical quiet NaN. One frame
/// with `scale` 1 gives [`decompress`]'s values, in any output dtype. Nothing waits for the
/// GPU.
///
/// # Safety
/// Pointers must be device addresses on `args.device`, valid until the queued work completes;
/// `frame_lens[p]` bytes must be readable at `frames[p]`, `out` must hold `n` elements of
/// `out_dtype`, `status` 8 bytes.
///
/// # Errors
/// [`Error::Incompatible`] for no frames, more than [`MAX_SUM_PARTS`] or lengths for other
/// frames, [`Error::NotQuantizable`] for a dtype other than float32, bfloat16 or float16,
/// [`Error::Format`] for more than 8 dimensions or a length that cannot hold one frame's
/// header and widths, [`Error::OutputSize`] for a small workspace (all checked before
/// anything is queued), and CUDA errors.
pub unsafe fn decode_sum(args: &DecodeSumArgs<'_>) -> Result<()> {
    let (n, parts) = (args.n, args.frames.len() as u64);
    check_count(n)?;
    if parts == 0 || parts > MAX_SUM_PARTS {
        return Err(Error::Incompatible {
            what: "count",
            left: format!("1 to {MAX_SUM_PARTS} frames"),
            right: parts.to_string(),
        });
    }
    for d in [args.dtype, args.out_dtype] {
        if !d.is_quantizable() {
            return Err(Error::NotQuantizable(d));
        }
    }
    if args.ndim > MAX_NDIM {
        return Err(crate::FormatError::BadField {
            field: "ndim",
            value: args.ndim.to_string(),
        }
        .into());
    }
    let (table_len, stride, need) = decode_sum_layout(n, parts);
    if args.workspace_len < need {
        return Err(Error::OutputSize {
            expected: need,
            got: args.workspace_len,
        });
    }
    check_frame_lens(args.frames, args.frame_lens, args.ndim, n)?;
    let b = args.lens_before;
    if b != 0 && (b % 8 != 0 || args.frames.iter().any(|&f| f % 8 != 0 || f < b)) {
        // A misaligned load would be a device fault, which ends the whole context.
        return Err(Error::Cuda(format!(
            "decode_sum: lengths {b} bytes before frames that are not 8-aligned past them"
        )));
    }
    let _restore = ContextGuard::save()?;
    let dev = device(args.device)?;
    let stream = dev.stream(args.stream)?;
    let k = dev.kernels(args.dtype)?;
    let (to, op) = match args.out_dtype {
        DType::F32 => (&k.decode_sum[0], "decode_sum_to_f32"),
        DType::BF16 => (&k.decode_sum[1], "decode_sum_to_bf16"),
        _ => (&k.decode_sum[2], "decode_sum_to_f16"),
    };
    let header_len = (FIXED_HEADER_LEN + 8 * args.ndim) as u64;
    let decoding = tile_layout(n, TILE_CHUNKS);
    let ws = args.workspace;
    let table = Arg::Ptr(ws);
    let (regions, stride_a) = (Arg::Ptr(ws + table_len), Arg::U64(stride));
    // SAFETY: (every call below) the workspace size was checked above against
    // `decode_sum_layout`, the frames' lengths against their headers' and widths' (this
    // function's contract: so much is readable, as is the output); the decoding runs only for
    // frames that `check_frames` found to lie within their lengths; `launch` checks each
    // argument list against the kernel's signature.
    unsafe {
        // Every frame's counters (and the rest of its region: one memset for all frames).
        zero(&stream, ws + table_len, parts * stride)?;
        checked_part_offsets(
            &stream,
            &k,
            args.frames,
            args.frame_lens,
            args.lens_before,
            ws,
            ws + table_len,
            stride,
            (n, args.dtype, args.ndim, None),
            (args.status, DECODE_BAD_FRAME),
        )?;
        if n == 0 {
            // Nothing to write, but the frames were checked: a frame from elsewhere that is
            // not an empty frame of this dtype is reported for 0 elements as for any other.
            return Ok(());
        }
        let (hl, n_a) = (Arg::U64(header_len), Arg::U64(n));
        let one_chunk_per_warp = launch_cfg(decoding.chunk_blocks * BLOCK as u64, BLOCK);
        let sum = [
            table,
            Arg::U32(parts as u32),
            hl,
            n_a,
            regions,
            stride_a,
            Arg::F64(args.scale as f64),
            Arg::Ptr(args.out),
            Arg::Ptr(args.status),
        ];
        launch(&stream, to, Family::Codec, op, one_chunk_per_warp, &sum)?;
    }
    Ok(())
}

/// Queues `x = dtype(x + r)`, `r = 0` over `n` elements of `dtype` at `data` and their float32
/// residuals at `residual`, on `stream` of device `ordinal`: error feedback for a call that
/// sends `data` without compressing it (the GPU all-reduce's fallback to NCCL's own
/// all-reduce). Non-finite values are left as they are and their residuals dropped, as the
/// compressor does.
///
/// # Safety
/// `data` must hold `n` elements of `dtype` and `residual` `n` float32, both device memory of
/// `ordinal`, until the queued work completes; `stream` a live stream of the device's primary
/// context.
///
/// # Errors
/// [`Error::NotQuantizable`] for a dtype other than float32, bfloat16 and float16; CUDA errors.
pub unsafe fn fold_residual(
    ordinal: usize,
    stream: usize,
    data: u64,
    n: u64,
    dtype: DType,
    residual: u64,
) -> Result<()> {
    if !dtype.is_quantizable() {
        return Err(Error::NotQuantizable(dtype));
    }
    if n == 0 {
        return Ok(());
    }
    let _restore = ContextGuard::save()?;
    let dev = device(ordinal)?;
    let stream = dev.stream(stream)?;
    let k = dev.kernels(dtype)?;
    let cfg = launch_cfg(n.min(dev.grid_blocks * BLOCK as u64), BLOCK);
    let args = [Arg::Ptr(data), Arg::U64(n), Arg::Ptr(residual)];
    // SAFETY: this function's contract; `launch` checks the arguments against the signature.
    unsafe { launch(&stream, &k.fold, Family::Codec, "fold_residual", cfg, &args) }
}

/// Most blocks [`stats`] launches: a number that depends on the element count only, so that
/// its partial sums, added in one order, give the same bits on any GPU.
const STATS_BLOCKS: u64 = 256;

/// Workspace bytes [`stats`] needs: a pair of partials per block.
pub const STATS_WORKSPACE: u64 = 16 * STATS_BLOCKS;

/// Arguments of [`stats`].
#[derive(Debug, Clone, Copy)]
pub struct StatsArgs {
    /// Device ordinal.
    pub device: usize,
    /// A `CUstream` of the device's primary context; the work is queued on it.
    pub stream: usize,
    /// `n` elements of `dtype`, device memory.
    pub data: u64,
    /// Elements.
    pub n: u64,
    /// float32, bfloat16 or float16.
    pub dtype: DType,
    /// `n` float32 added to the elements first (error feedback's residual), or 0 for none.
    pub residual: u64,
    /// [`STATS_WORKSPACE`] bytes of device memory, 8-aligned.
    pub workspace: u64,
    /// Where the statistics go (16 bytes of device memory, 8-aligned), and again every `pitch`
    /// bytes, `copies` times in all.
    pub out: u64,
    /// Bytes between copies (a multiple of 8).
    pub pitch: u64,
    /// Copies (at least 1).
    pub copies: u32,
}

/// Queues the statistics of the engine's bounds: the sum of squares of the finite values
/// `float32(data) + residual` (in f64, added in an order that depends on `n` only) and their
/// largest magnitude, written as two f64 at `out` (and
/// every `pitch` bytes after it, `copies` times).
///
/// # Safety
/// Every address must be valid for the bytes [`StatsArgs`] describes, on `args.device`, until
/// the queued work completes.
///
/// # Errors
/// [`Error::NotQuantizable`] for a dtype other than float32, bfloat16 and float16; misaligned
/// outputs; CUDA errors.
pub unsafe fn stats(args: &StatsArgs) -> Result<()> {
    if !args.dtype.is_quantizable() {
        return Err(Error::NotQuantizable(args.dtype));
    }
    if args.out % 8 != 0 || args.pitch % 8 != 0 || args.copies == 0 {
        return Err(Error::Cuda(format!(
            "stats: outputs at {:#x} every {} bytes, {} times, are not aligned f64 pairs",
            args.out, args.pitch, args.copies
        )));
    }
    let _restore = ContextGuard::save()?;
    let dev = device(args.device)?;
    let stream = dev.stream(args.stream)?;
    let k = dev.kernels(args.dtype)?;
    let blocks = args.n.div_ceil(BLOCK as u64).clamp(1, STATS_BLOCKS);
    let partial = [
        Arg::Ptr(args.data),
        Arg::U64(args.n),
        Arg::Ptr(args.residual),
        Arg::Ptr(args.workspace),
    ];
    // SAFETY: this function's contract; `launch` checks the arguments against the signature.
    unsafe {
        launch(
            &stream,
            &k.stats,
            Family::Codec,
            "stats",
            launch_cfg(blocks * BLOCK as u64, BLOCK),
            &partial,
        )
    }?;
    let total = [
        Arg::Ptr(args.workspace),
        Arg::U32(blocks as u32),
        Arg::Ptr(args.out),
        Arg::U64(args.pitch),
        Arg::U32(args.copies),
    ];
    // SAFETY: as above; `blocks` pairs of partials were written.
    unsafe {
        launch(
            &stream,
            &k.stats_total,
            Family::Codec,
            "stats_total",
            launch_cfg(32, 32),
            &total,
        )
    }
}

/// Queues `len` bytes copied from `src` to `dst` (device memory of the stream's device, or
/// pinned host memory) on `stream`.
///
/// # Safety
/// Both ranges valid until the copy completes; `stream` a live stream of the device's primary
/// context, current on this thread.
///
/// # Errors
/// CUDA errors.
pub(crate) unsafe fn copy_async(stream: &CudaStream, dst: u64, src: u64, len: u64) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: this function's contract.
    unsafe { sys::cuMemcpyAsync(dst, src, len as usize, stream.cu_stream()) }
        .result()
        .map_err(driver_err)
}

/// Queues the writing of the u64 `word` at `dst` and every `pitch` bytes after it, `rows`
/// times, on `stream` (two 2D memsets of its halves: two driver calls however many rows).
///
/// # Safety
/// `dst` 4-aligned device memory valid for the rows until the memsets complete; `pitch` a
/// multiple of 4 (at least 8 with more than one row); `stream` live, its context current.
///
/// # Errors
/// CUDA errors.
pub(crate) unsafe fn put_rows(
    stream: &CudaStream,
    dst: u64,
    pitch: u64,
    rows: u64,
    word: u64,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let pitch = pitch.max(8) as usize;
    for (at, half) in [(0u64, word as u32), (4, (word >> 32) as u32)] {
        // SAFETY: this function's contract: one u32 per row, `pitch` apart.
        unsafe {
            sys::cuMemsetD2D32Async(dst + at, pitch, half, 1, rows as usize, stream.cu_stream())
        }
        .result()
        .map_err(driver_err)?;
    }
    Ok(())
}

/// Arguments of [`copy_rows`]: `rows` rows of `width` bytes, from `src` (rows `src_pitch` bytes
/// apart) to `dst` (rows `dst_pitch` apart). Each side is device memory of `device` or pinned
/// host memory (unified addressing tells which).
#[derive(Debug, Clone, Copy)]
pub struct CopyRowsArgs {
    /// Device ordinal.
    pub device: usize,
    /// A `CUstream` of the device's primary context; the copy is queued on it.
    pub stream: usize,
    /// First byte read.
    pub src: u64,
    /// Bytes from one source row to the next (at least `width` when `rows > 1`).
    pub src_pitch: u64,
    /// First byte written.
    pub dst: u64,
    /// Bytes from one destination row to the next (at least `width` when `rows > 1`).
    pub dst_pitch: u64,
    /// Bytes per row.
    pub width: u64,
    /// Rows.
    pub rows: u64,
}

/// Queues a strided copy (one driver call), without waiting: e.g. the size that trails each
/// rank's slot in a frame exchange, straight from the device rows to pinned host memory.
/// Replaces the several tensor operations (slice, dense copy, view, copy) PyTorch needs for
/// the same, which cost host time on every bucket of every step.
///
/// # Safety
/// Both ranges must be valid device addresses on `args.device` or pinned host memory, for
/// every byte of every row, until the queued copy completes.
///
/// # Errors
/// [`Error::Cuda`] for a pitch smaller than the width (checked before anything is queued) and
/// from the driver.
pub unsafe fn copy_rows(args: &CopyRowsArgs) -> Result<()> {
    if args.rows > 1 && (args.src_pitch < args.width || args.dst_pitch < args.width) {
        return Err(Error::Cuda(format!(
            "copy_rows: the pitches ({} and {}) must be at least the width ({})",
            args.src_pitch, args.dst_pitch, args.width
        )));
    }
    if args.rows == 0 || args.width == 0 {
        return Ok(());
    }
    let _restore = ContextGuard::save()?;
    let dev = device(args.device)?;
    let stream = dev.stream(args.stream)?;
    if args.rows == 1 {
        // SAFETY: as below; one contiguous range on each side.
        return unsafe {
            sys::cuMemcpyAsync(args.dst, args.src, args.width as usize, stream.cu_stream())
        }
        .result()
        .map_err(driver_err);
    }
    let unified = sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED;
    let copy = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: unified,
        srcHost: std::ptr::null(),
        srcDevice: args.src,
        srcArray: std::ptr::null_mut(),
        srcPitch: args.src_pitch.max(args.width) as usize,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: unified,
        dstHost: std::ptr::null_mut(),
        dstDevice: args.dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: args.dst_pitch.max(args.width) as usize,
        WidthInBytes: args.width as usize,
        Height: args.rows as usize,
    };
    // SAFETY: the descriptor is fully initialised and lives for the call; the ranges are valid
    // until the copy completes (this function's contract); the stream is live for the call.
    unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream.cu_stream()) }
        .result()
        .map_err(driver_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel family compiles with NVRTC for the oldest and the newest architecture cfc
    /// runs on: a kernel that does not compile would otherwise show only on a GPU machine.
    /// NVRTC needs no GPU. Skipped (with a message) where NVRTC or CUDA's headers are missing,
    /// unless `CFC_NVRTC_CHECK=1` (set by `scripts/env.sh` where the Python environment has
    /// them), which makes their absence a failure.
    #[test]
    fn every_kernel_family_compiles_with_nvrtc() {
        let required = std::env::var("CFC_NVRTC_CHECK").is_ok_and(|v| v == "1");
        // SAFETY: only probes whether the shared library can be opened.
        let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
        if !nvrtc || cuda_include_dir().is_err() {
            assert!(
                !required,
                "CFC_NVRTC_CHECK=1 but NVRTC ({nvrtc}) or cuda_fp16.h ({:?}) is missing",
                cuda_include_dir().err()
            );
            eprintln!("skipped: NVRTC or CUDA's headers are not installed");
            return;
        }
        for family in [Family::Codec, Family::Scan, Family::Lossless] {
            for arch in ["sm_80", "sm_90"] {
                let cubin = compile(family, arch)
                    .unwrap_or_else(|e| panic!("{} for {arch}: {e}", family.name()));
                assert!(cubin.starts_with(b"\x7fELF"), "a CUBIN is an ELF file");
            }
        }
    }

    /// More than [`MAX_ELEMENTS`] elements are refused before a size is computed from them or
    /// a device is touched (with sizes that wrap, buffers of any length could pass their checks).
    #[test]
    fn entry_points_refuse_counts_past_max_elements() {
        let n = MAX_ELEMENTS + 1;
        let shape = [n];
        let frames = [0x1000u64];
        let lens = [u64::MAX];
        let refused = |r: Result<()>, what: &str| match r {
            Err(Error::Cuda(m)) if m.contains("at most 281474976710656") => {}
            other => panic!("{what}: {other:?}"),
        };
        // SAFETY: each call must fail on its arguments before any address is read.
        unsafe {
            refused(
                compress(&CompressArgs {
                    device: 0,
                    stream: 0,
                    input: 0x1000,
                    n,
                    dtype: DType::F32,
                    shape: &shape,
                    bound: Bound::Abs(1e-3),
                    out: 0x1000,
                    out_len: u64::MAX,
                    workspace: 0x1000,
                    workspace_len: u64::MAX,
                    residual: 0,
                    size_to: 0,
                    max_error_to: 0,
                    bound_at: 0,
                }),
                "compress",
            );
            refused(
                compress_lossless(&LosslessCompressArgs {
                    device: 0,
                    stream: 0,
                    input: 0x1000,
                    n,
                    dtype: DType::F32,
                    shape: &shape,
                    out: 0x1000,
                    out_len: u64::MAX,
                    workspace: 0x1000,
                    workspace_len: u64::MAX,
                }),
                "compress_lossless",
            );
            for codec in [crate::Codec::Quantized, crate::Codec::Lossless] {
                refused(
                    decompress(&DecompressArgs {
                        device: 0,
                        stream: 0,
                        frame: 0x1000,
                        n,
                        dtype: DType::F32,
                        codec,
                        ndim: 1,
                        out: 0x1000,
                        workspace: 0x1000,
                        workspace_len: u64::MAX,
                    }),
                    "decompress",
                );
            }
            refused(
                sum(&SumArgs {
                    device: 0,
                    stream: 0,
                    frames: &frames,
                    frame_lens: &lens,
                    n,
                    dtype: DType::F32,
                    shape: &shape,
                    out: 0x1000,
                    out_len: u64::MAX,
                    workspace: 0x1000,
                    workspace_len: u64::MAX,
                }),
                "sum",
            );
            refused(
                decode_sum(&DecodeSumArgs {
                    device: 0,
                    stream: 0,
                    frames: &frames,
                    frame_lens: &lens,
                    lens_before: 0,
                    n,
                    dtype: DType::F32,
                    ndim: 1,
                    scale: 1.0,
                    out: 0x1000,
                    out_dtype: DType::F32,
                    workspace: 0x1000,
                    workspace_len: u64::MAX,
                    status: 0,
                }),
                "decode_sum",
            );
        }
    }

    /// A grid past what one launch takes is refused rather than clamped: every kernel maps fixed
    /// work to each block, so a clamped grid would leave elements undone without an error (one
    /// block per 4096-byte lossless chunk reaches 2^31 blocks below `MAX_ELEMENTS`).
    #[test]
    fn grids_past_the_device_limit_are_refused() {
        let fits = launch_cfg(u64::from(MAX_GRID_X) * 256, 256);
        assert_eq!(fits.grid_dim, (MAX_GRID_X, 1, 1));
        assert!(check_grid("k", &fits).is_ok());
        let too_many = launch_cfg(u64::from(MAX_GRID_X) * 256 + 1, 256);
        assert!(too_many.grid_dim.0 > MAX_GRID_X);
        let huge = launch_cfg(MAX_ELEMENTS, 1);
        assert_eq!(huge.grid_dim.0, u32::MAX);
        for cfg in [too_many, huge] {
            match check_grid("decode_w1", &cfg) {
                Err(Error::Cuda(m)) if m.contains("decode_w1") && m.contains("grid") => {}
                other => panic!("{:?}: {other:?}", cfg.grid_dim),
            }
        }
        let mut tall = launch_cfg(1, 256);
        tall.grid_dim.1 = 65536;
        assert!(check_grid("k", &tall).is_err());
        assert_eq!(launch_cfg(0, 256).grid_dim, (1, 1, 1));
    }
}
