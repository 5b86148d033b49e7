//! Devices and kernels: the driver loaded at run time, one context per device (the primary
//! one, PyTorch's), NVRTC compiling each kernel family once per device to a CUBIN.

use super::*;

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

pub(super) struct Device {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) modules: Mutex<HashMap<Family, Arc<CudaModule>>>,
    pub(super) kernels: Mutex<HashMap<DType, Arc<Kernels>>>,
    /// Blocks that keep every SM busy with grid-stride warps.
    pub(super) grid_blocks: u64,
}

/// Every kernel one compress or decompress of a dtype launches, looked up once.
pub(super) struct Kernels {
    pub(super) max_abs: CudaFunction,
    pub(super) fold: CudaFunction,
    pub(super) encode: CudaFunction,
    pub(super) pack: CudaFunction,
    pub(super) offsets: CudaFunction,
    pub(super) decode: CudaFunction,
    pub(super) scatter: CudaFunction,
    pub(super) sum_table: CudaFunction,
    pub(super) sum_lens: CudaFunction,
    pub(super) sum_offsets: CudaFunction,
    pub(super) sum_chunks: CudaFunction,
    pub(super) sum_values: CudaFunction,
    pub(super) check_frames: CudaFunction,
    pub(super) sum_pack: CudaFunction,
    /// `decode_sum_to_<o>`, by output dtype: f32, bf16, f16.
    pub(super) decode_sum: [CudaFunction; 3],
    pub(super) stats: CudaFunction,
    pub(super) block_exponents: CudaFunction,
    pub(super) stats_total: CudaFunction,
    pub(super) rice_size: CudaFunction,
    pub(super) rice_write: CudaFunction,
    pub(super) rice_offsets: CudaFunction,
    pub(super) rice_decode: CudaFunction,
    pub(super) rice_scatter: CudaFunction,
    pub(super) rice_check_heads: CudaFunction,
    pub(super) rice_check_blocks: CudaFunction,
    pub(super) rice_accumulate: CudaFunction,
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
pub(super) const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

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
pub(super) fn driver_present() -> Result<()> {
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
pub(super) fn driver_initialized() -> Result<()> {
    static DONE: AtomicBool = AtomicBool::new(false);
    if DONE.load(Ordering::Relaxed) {
        return Ok(());
    }
    driver_present()?;
    cudarc::driver::result::init().map_err(driver_err)?;
    DONE.store(true, Ordering::Relaxed);
    Ok(())
}

pub(super) fn device(ordinal: usize) -> Result<Arc<Device>> {
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
pub(super) fn cuda_include_dir() -> Result<String> {
    let mut candidates: Vec<String> = Vec::new();
    if let Some(p) = crate::env::cuda_include() {
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
pub(super) fn compile(family: Family, arch: &str) -> Result<Vec<u8>> {
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

pub(super) fn poisoned<T>(_: T) -> Error {
    Error::Cuda("kernel cache poisoned".into())
}

impl Device {
    pub(super) fn module(&self, family: Family) -> Result<Arc<CudaModule>> {
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

    pub(super) fn function(
        &self,
        family: Family,
        op: &str,
        dtype: Option<DType>,
    ) -> Result<CudaFunction> {
        let name = kernel_name(family, op, dtype);
        self.module(family)?
            .load_function(&name)
            .map_err(|e| Error::Cuda(format!("kernel {name}: {e:?}")))
    }

    /// The kernels for `dtype`, compiled and looked up on first use.
    pub(super) fn kernels(&self, dtype: DType) -> Result<Arc<Kernels>> {
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
            block_exponents: self.function(c, "block_exponents", d)?,
            stats_total: self.function(c, "stats_total", None)?,
            rice_size: self.function(c, "rice_size", d)?,
            rice_write: self.function(c, "rice_write", d)?,
            rice_offsets: self.function(c, "rice_offsets", None)?,
            rice_decode: self.function(c, "rice_decode", d)?,
            rice_scatter: self.function(c, "rice_scatter", d)?,
            rice_check_heads: self.function(c, "rice_check_heads", None)?,
            rice_check_blocks: self.function(c, "rice_check_blocks", None)?,
            rice_accumulate: self.function(c, "rice_accumulate", d)?,
        });
        self.kernels
            .lock()
            .map_err(poisoned)?
            .insert(dtype, k.clone());
        Ok(k)
    }

    pub(super) fn stream(&self, raw: usize) -> Result<Arc<CudaStream>> {
        // SAFETY: `raw` is a live CUstream of this device's primary context, owned by the
        // caller (e.g. torch.cuda.current_stream().cuda_stream) for the duration of the call;
        // a borrowed stream is never destroyed by cudarc.
        Ok(unsafe { self.ctx.wrap_borrowed_stream(raw as sys::CUstream) })
    }
}
