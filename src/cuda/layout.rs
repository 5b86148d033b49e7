//! Sizes and layouts of the kernels' work: tiles, spans, workspaces, the capacities of
//! outputs, and the checks of element counts and shapes they rest on.

use super::*;

/// Threads per block of the codec kernels (8 warps; `TILE_THREADS` in `kernels/codec/`).
pub(super) const BLOCK: u32 = 256;
/// Groups per chunk, chunks per tile of the decoder (the encoder's tiles are 8 or 32 chunks, see
/// [`compress`]), tiles per span, and the workspace offset of the spans' counters:
/// `CHUNK_GROUPS`, `TILE_CHUNKS`, `SPAN_TILES` and `WS_SPANS` in `kernels/codec/`, whose
/// comment gives the whole layout.
pub(super) const CHUNK_GROUPS: u64 = 8;
pub(super) const TILE_CHUNKS: u64 = 32;
pub(super) const SPAN_TILES: u64 = 16;
pub(super) const WS_SPANS: u64 = 112;
/// Shared memory of each encoder thread: its group's 32 values in a row of `STAGE_ROW` (33)
/// floats (`kernels/codec/`).
pub(super) const ENCODER_ROW_BYTES: u32 = 33 * 4;
/// Workspace offset of the plane words' total (u64), after the last block of a pass.
pub(super) const WS_TOTAL_WORDS: u64 = 96;
/// Values per block of the scan kernels (must match `SCAN_BLOCK` in `kernels/scan.cu`).
pub(super) const SCAN_BLOCK: u64 = 1024;
/// Workspace bytes before the scan arrays: `CfcParams` (48 bytes, room for 64), the frame size
/// (u64 at 64) and the raw flag (u32 at 72).
pub(super) const WS_HEADER: u64 = 80;
/// Offset in the workspace of the compressed frame's size (a u64 written on the device).
pub const FRAME_SIZE_OFFSET: u64 = 64;
/// Offset in the workspace of the raw-frame flag (u32) that the compressors write.
pub(super) const RAW_FLAG_OFFSET: u64 = 72;
/// Offset in the workspace of the bound error flag (u32; nonzero: rel gave an unusable eps).
pub const BOUND_ERROR_OFFSET: u64 = 40;

/// A compressor's shape: at most [`MAX_NDIM`] dimensions whose product is `n`.
pub(super) fn check_shape(shape: &[u64], n: u64) -> Result<()> {
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
pub(super) fn check_count(n: u64) -> Result<()> {
    if n > MAX_ELEMENTS {
        return Err(Error::Cuda(format!(
            "{n} elements: the device codec takes at most {MAX_ELEMENTS} (2^48)"
        )));
    }
    Ok(())
}

/// What every decoder checks of its arguments before anything is queued: the element count,
/// the workspace's size and the header's dimensions.
pub(super) fn check_decompress_args(args: &DecompressArgs) -> Result<()> {
    check_count(args.n)?;
    let need_ws = workspace_len(args.n);
    if args.workspace_len < need_ws {
        return Err(Error::OutputSize {
            expected: need_ws,
            got: args.workspace_len,
        });
    }
    check_ndim(args.ndim)
}

/// Refuses more dimensions than a frame's header holds ([`MAX_NDIM`]), as its reader does.
pub(super) fn check_ndim(ndim: usize) -> Result<()> {
    if ndim > MAX_NDIM {
        return Err(crate::FormatError::BadField {
            field: "ndim",
            value: ndim.to_string(),
        }
        .into());
    }
    Ok(())
}

/// Scan arrays for `len` values need this many u64 of block sums, all levels together.
pub(super) fn scan_sums_len(len: u64) -> u64 {
    let blocks = len.div_ceil(SCAN_BLOCK).max(1);
    if blocks <= 1 {
        1
    } else {
        blocks + scan_sums_len(blocks)
    }
}

/// How the codec kernels cut `n` elements, and where their state lies in a workspace (the
/// layout in `kernels/codec/`).
pub(super) struct TileLayout {
    /// Tiles: `tile_chunks` chunks of 8 groups, one block of the encoder's passes (at least one,
    /// which writes an empty frame); spans: 16 tiles (one block of the decoder's first pass);
    /// the blocks of the decoder's second pass, which takes a chunk per warp.
    pub(super) tiles: u64,
    pub(super) spans: u64,
    pub(super) chunk_blocks: u64,
    /// Bytes zeroed before each call: parameters, counters and the spans' counters.
    pub(super) zeroed: u64,
    /// End of what decoding needs; compressing also needs exception masks and staged planes.
    pub(super) decode_end: u64,
    pub(super) compress_end: u64,
    /// Bytes past `compress_end` that error feedback needs (compensated values, widths).
    pub(super) feedback_len: u64,
}

pub(super) fn tile_layout(n: u64, tile_chunks: u64) -> TileLayout {
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
    tile_layout(n, TILE_CHUNKS)
        .decode_end
        .max(lossless)
        .max(rice_workspace_len(n))
}

/// Chunks per encoder tile that need the most workspace (the most tiles).
pub(super) const SMALLEST_TILE: u64 = WARPS;
/// Warps per block of the codec kernels.
pub(super) const WARPS: u64 = BLOCK as u64 / 32;

/// Workspace bytes [`compress`] needs for `n` elements: the chunks' offsets, each group's
/// exception mask, and room to stage every chunk's bit planes (up to 32 words per group); with
/// error feedback (`feedback`), also room for the compensated values of the groups whose
/// values the second pass could not rebuild otherwise, and each group's width.
pub fn compress_workspace_len(n: u64, feedback: bool) -> u64 {
    let layout = tile_layout(n, SMALLEST_TILE);
    layout.compress_end + if feedback { layout.feedback_len } else { 0 }
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
