//! Block exponents on the device: each block's `floor(log2(rms))` byte of `x + r`, what the
//! engine's block scales are agreed from (`crate::scales::block_exponents`, bit for bit).

use super::*;

/// Arguments of [`block_exponents`].
#[derive(Debug, Clone, Copy)]
pub struct ExponentsArgs {
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
    /// `log2` of the elements per block (5 to 24).
    pub block_log2: u8,
    /// Where the bytes go: one per block, `ceil(n / 2^block_log2)` bytes of device memory.
    pub out: u64,
}

/// Queues each block's exponent byte of `float32(data) + residual` into `out` (a warp per block).
///
/// # Safety
/// Every address must be valid for the bytes [`ExponentsArgs`] describes, on `args.device`,
/// until the queued work completes.
///
/// # Errors
/// [`Error::NotQuantizable`] for a dtype other than float32, bfloat16 and float16;
/// [`Error::InvalidBound`] for a block size out of range; CUDA errors.
pub unsafe fn block_exponents(args: &ExponentsArgs) -> Result<()> {
    if !args.dtype.is_quantizable() {
        return Err(Error::NotQuantizable(args.dtype));
    }
    crate::scales::check_log2(args.block_log2)?;
    let blocks = crate::scales::blocks_for(args.n, args.block_log2);
    if blocks == 0 {
        return Ok(());
    }
    let _restore = ContextGuard::save()?;
    let dev = device(args.device)?;
    let stream = dev.stream(args.stream)?;
    let k = dev.kernels(args.dtype)?;
    // A warp per block, at most a few waves of the device's blocks (the kernel strides over the rest).
    let cfg = launch_cfg((blocks * 32).min(dev.grid_blocks * BLOCK as u64), BLOCK);
    let a = [
        Arg::Ptr(args.data),
        Arg::U64(args.n),
        Arg::Ptr(args.residual),
        Arg::U32(args.block_log2 as u32),
        Arg::Ptr(args.out),
    ];
    // SAFETY: this function's contract; `launch` checks the arguments against the signature.
    unsafe {
        launch(
            &stream,
            &k.block_exponents,
            Family::Codec,
            "block_exponents",
            cfg,
            &a,
        )
    }
}
