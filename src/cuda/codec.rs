//! The error-bounded codec's operations: compress (with error feedback), decompress, fold a
//! residual into a bucket sent uncompressed, and a bucket's statistics.

use super::*;

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
    /// Block scales (docs/FORMAT.md, "Block scales"): device memory holding a shift per block of
    /// `2^block_log2` elements, or 0 for none. Block `b` is coded with the bound's step and eps
    /// halved `shift[b]` times; the frame records the shifts. An `Abs` bound only; bit planes
    /// ([`compress`]) or Rice codes ([`compress_rice`]).
    pub scales: u64,
    /// `log2` of the elements per block of `scales` (5 to 24), 0 without scales.
    pub block_log2: u8,
}

/// Compresses on the device, producing exactly the bytes of [`crate::compress`], and returns
/// without waiting for the GPU. The frame's size is written (as a u64) at
/// [`FRAME_SIZE_OFFSET`] of the workspace (and at `size_to`, if given; with error feedback,
/// the residual's running maximum is raised at `max_error_to`, if given); in `rel` mode a nonzero u32 at [`BOUND_ERROR_OFFSET`] means the bound was unusable (the
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
    let (n, ndim) = (args.n, args.shape.len());
    let (mode, value, fixed) = check_compress_args(args)?;
    check_scales(args, mode)?;
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
    check_compress_alignment("compress", args, 1)?;
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
    let scales_len = if args.scales != 0 {
        crate::scales::blocks_for(n, args.block_log2)
    } else {
        0
    };
    // The kernels number the modes as frames do (`make_params` in kernels/codec/codec.cuh).
    let mode_code = u32::from(mode.code());
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
            Arg::Ptr(args.out + header_len + scales_len),
            ws,
            residual,
            Arg::Ptr(args.scales),
            Arg::U32(args.block_log2 as u32),
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
            Arg::Ptr(args.scales),
            Arg::U32(args.block_log2 as u32),
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

/// Block scales are given with an absolute bound and a block size from 32 to 2^24, or not at all.
pub(super) fn check_scales(args: &CompressArgs<'_>, mode: BoundMode) -> Result<()> {
    if args.scales == 0 {
        return Ok(());
    }
    if mode != BoundMode::Abs {
        return Err(Error::InvalidBound {
            what: "bound",
            reason: "given block scales take an absolute bound (eps), fixed at the launch".into(),
        });
    }
    crate::scales::check_log2(args.block_log2)
}

/// Refuses addresses of `args` that the encoders would load or store misaligned: a device fault
/// ends the whole context. The u64 and f64 words need 8 bytes, the workspace 16 (its tables are
/// stored as `uint4`), the residual its floats' 4, the input its elements' size, the output
/// `out_align` (8 for a rice frame, whose heads are stored as u64; bit planes take any).
pub(super) fn check_compress_alignment(
    op: &str,
    args: &CompressArgs<'_>,
    out_align: u64,
) -> Result<()> {
    for (what, at, align) in [
        ("frame size's", args.size_to, 8),
        ("running maximum's", args.max_error_to, 8),
        ("workspace's", args.workspace, 16),
        ("residual's", args.residual, 4),
        ("input's", args.input, args.dtype.size() as u64),
        ("output's", args.out, out_align),
    ] {
        if at % align != 0 {
            return Err(Error::Cuda(format!(
                "{op}: the {what} address {at:#x} is not {align}-aligned"
            )));
        }
    }
    Ok(())
}

/// What every encoder checks first: the shape, a float dtype, and the bound, returned as
/// [`bound_parts`] gives it.
pub(super) fn check_compress_args(args: &CompressArgs<'_>) -> Result<(BoundMode, f64, u32)> {
    check_shape(args.shape, args.n)?;
    if !args.dtype.is_quantizable() {
        return Err(Error::NotQuantizable(args.dtype));
    }
    bound_parts(args.bound)
}

/// A bound as the encoders take it (mode, value, fixed width or 0), checked as the CPU codec
/// checks it.
pub(super) fn bound_parts(bound: Bound) -> Result<(BoundMode, f64, u32)> {
    Ok(match bound {
        Bound::Abs(eps) => {
            crate::codec::check_abs_bound(eps, "eps")?;
            (BoundMode::Abs, eps, 0)
        }
        Bound::Rel(rel) => {
            crate::codec::check_rel(rel)?;
            (BoundMode::Rel, rel, 0)
        }
        Bound::Bits(b) => {
            crate::codec::check_bits(b)?;
            (BoundMode::Bits, b as f64, b as u32)
        }
        Bound::Rms { .. } => {
            return Err(Error::InvalidBound {
                what: "rms",
                reason: "block scales are encoded by the CPU codec only".into(),
            })
        }
    })
}

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
    if args.codec == crate::Codec::Rice {
        // SAFETY: this function's contract.
        return unsafe { decompress_rice(args, &dev, &stream) };
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
pub(super) const STATS_BLOCKS: u64 = 256;

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
