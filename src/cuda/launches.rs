//! Launching kernels: grid sizes, arguments checked against the kernel table
//! ([`crate::kernels::SIGNATURES`]), the device-wide scan, zeroing a workspace.

use super::*;

/// Zeroes the first `len` bytes of the workspace at `ws` on `stream` (an asynchronous memset).
///
/// # Safety
/// `ws` must be a device address valid for `len` bytes until the queued work completes.
pub(super) unsafe fn zero(stream: &CudaStream, ws: u64, len: u64) -> Result<()> {
    // SAFETY: this function's contract; the stream is live for the call.
    unsafe { cudarc::driver::result::memset_d8_async(ws, 0, len as usize, stream.cu_stream()) }
        .map_err(driver_err)
}

/// The most blocks a grid's x dimension may have (CUDA's limit, 2^31 - 1).
pub(super) const MAX_GRID_X: u32 = i32::MAX as u32;

/// A one-dimensional launch of at least `threads` threads in blocks of `block`. A count past
/// what one grid can hold saturates at `u32::MAX` blocks, which [`launch`] refuses: the kernels
/// map fixed work to each block, so a clamped grid would leave work undone without an error.
pub(super) fn launch_cfg(threads: u64, block: u32) -> LaunchConfig {
    let blocks = threads.div_ceil(block as u64).clamp(1, u32::MAX as u64) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One kernel argument, by value.
#[derive(Debug, Clone, Copy)]
pub(super) enum Arg {
    Ptr(u64),
    U64(u64),
    U32(u32),
    F64(f64),
    Dims(Dims),
}

impl Arg {
    pub(super) fn ty(&self) -> Ty {
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
pub(super) unsafe fn launch(
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
pub(super) fn check_grid(op: &str, cfg: &LaunchConfig) -> Result<()> {
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
pub(super) unsafe fn scan(
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

/// The shape as the `Dims` struct of the `finish` kernels.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims(pub(super) [u64; MAX_NDIM]);

impl Dims {
    /// A shape of at most [`MAX_NDIM`] dimensions (checked by the caller), zero-padded.
    pub(super) fn of(shape: &[u64]) -> Dims {
        let mut d = [0u64; MAX_NDIM];
        d[..shape.len()].copy_from_slice(shape);
        Dims(d)
    }
}

// SAFETY: `Dims` is `repr(C)`, plain old data, with the layout of `struct Dims { u64 d[8]; }`.
unsafe impl cudarc::driver::DeviceRepr for Dims {}
