//! The lossless codec's operations: the encoder, and the decoder's offsets and chunks.

use super::*;

/// Bytes a chunk's staging slot takes in [`compress_lossless`]'s workspace: the raw chunk,
/// which bounds whatever method the chunk gets.
pub(super) fn lossless_slot(dtype: DType) -> u64 {
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
pub(super) const LOSSLESS_THREADS: u32 = 128;

/// The lossless part of [`decompress`]: the chunks' offsets, then every chunk.
///
/// # Safety
/// As [`decompress`]; the workspace size was checked there.
pub(super) unsafe fn decompress_lossless(
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

pub(super) fn check_lossless(args: &DecompressArgs) -> Result<()> {
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
pub(super) unsafe fn lossless_offsets_on(
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
pub(super) unsafe fn lossless_chunks_on(
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
