//! Copies on a stream: bytes, words written into rows, rows gathered.

use super::*;

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
