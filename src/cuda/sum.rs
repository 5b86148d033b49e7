//! Sums of frames on the device: frames added as integer codes into one frame
//! ([`sum`]), and decoded frames added, scaled and written in a bucket's dtype ([`decode_sum`]).

use super::*;

/// Where [`sum`] keeps its state in a workspace: the packer's chunk offsets (tiles of 8 chunks),
/// the sum's exception mask, codes (i64) and exception values (u32 bits), the table of the
/// parts' frame addresses, and a region per part for its chunk offsets.
pub(super) struct SumLayout {
    pub(super) tiles: TileLayout,
    pub(super) union_mask: u64,
    pub(super) acc: u64,
    pub(super) value_bits: u64,
    pub(super) table: u64,
    pub(super) parts: u64,
    /// Bytes of each part's region, and of the counters at its start zeroed before use.
    pub(super) part_stride: u64,
    pub(super) part_zeroed: u64,
    pub(super) end: u64,
}

pub(super) fn sum_layout(n: u64, parts: u64) -> SumLayout {
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
    // (a byte per group covers block scales: blocks hold at least a group)
    header + groups_for(n) * (2 + 4 * 64) + n * (index_size_for(n) as u64 + dtype.size() as u64)
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
    /// Block scales the frames have (`log2` of the elements per block, 5 to 24), or 0 for none:
    /// every quantized frame must then have these, the same in every frame (raw frames fit any),
    /// and the sum keeps them.
    pub block_log2: u8,
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
/// group, and with block scales a byte per block: what `sum_offsets` reads before anything is
/// checked on the device). A block size out of range is refused here too.
pub(super) fn check_frame_lens(
    frames: &[u64],
    lens: &[u64],
    ndim: usize,
    n: u64,
    block_log2: u8,
) -> Result<()> {
    if lens.len() != frames.len() {
        return Err(Error::Incompatible {
            what: "count",
            left: format!("{} frames", frames.len()),
            right: format!("{} frame lengths", lens.len()),
        });
    }
    let mut needed = crate::format::min_frame_len(n, ndim);
    if block_log2 != 0 {
        crate::scales::check_log2(block_log2)?;
        needed += crate::scales::blocks_for(n, block_log2);
    }
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
/// `shape`) whose dimensions are not those, or (with `block_log2`) a quantized frame without
/// those block scales.
///
/// # Safety
/// The table must hold 16 bytes per frame and each region `stride` bytes (at least the
/// decoder's `decode_end` for `n` elements), `status` 8 bytes, valid until the queued work
/// completes; each frame `lens[p]` readable bytes, at least [`check_frame_lens`]'s.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn checked_part_offsets(
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
    block_log2: u8,
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
                Arg::U32(block_log2 as u32),
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
                Arg::U32(block_log2 as u32),
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
    check_frame_lens(args.frames, args.frame_lens, ndim, n, args.block_log2)?;
    let _restore = ContextGuard::save()?;
    let dev = device(args.device)?;
    let stream = dev.stream(args.stream)?;
    let k = dev.kernels(args.dtype)?;
    let header_len = (FIXED_HEADER_LEN + 8 * ndim) as u64;
    let log2 = Arg::U32(args.block_log2 as u32);
    let scales_len = if args.block_log2 != 0 {
        crate::scales::blocks_for(n, args.block_log2)
    } else {
        0
    };
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
            args.block_log2,
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
            Arg::Ptr(args.out + header_len + scales_len),
            ws_a,
            log2,
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
            log2,
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
            table,
            Arg::U32(parts as u32),
            log2,
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
pub(super) fn decode_sum_layout(n: u64, parts: u64) -> (u64, u64, u64) {
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
    /// Block scales the frames have (`log2` of the elements per block, 5 to 24), or 0 for none:
    /// every quantized frame must then have them (raw frames have none).
    pub block_log2: u8,
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
/// [`DecodeSumArgs::status`]; [`crate::error::decode_status_error`] words it).
pub const DECODE_BAD_FRAME: u32 = 1;

/// What every decoded sum checks of its arguments first: the element count, 1 to
/// [`MAX_SUM_PARTS`] frames, float dtypes in and out, at most [`MAX_NDIM`] dimensions.
pub(super) fn check_decode_sum_args(args: &DecodeSumArgs<'_>) -> Result<()> {
    check_count(args.n)?;
    let parts = args.frames.len() as u64;
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
    check_ndim(args.ndim)
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
    check_decode_sum_args(args)?;
    let (n, parts) = (args.n, args.frames.len() as u64);
    let (table_len, stride, need) = decode_sum_layout(n, parts);
    if args.workspace_len < need {
        return Err(Error::OutputSize {
            expected: need,
            got: args.workspace_len,
        });
    }
    check_frame_lens(args.frames, args.frame_lens, args.ndim, n, args.block_log2)?;
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
            args.block_log2,
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
            Arg::U32(args.block_log2 as u32),
        ];
        launch(&stream, to, Family::Codec, op, one_chunk_per_warp, &sum)?;
    }
    Ok(())
}
