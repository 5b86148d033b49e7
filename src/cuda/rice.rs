//! Rice frames on the device (`kernels/codec/rice.cu`): compress and decompress, the bytes of the
//! CPU reference (`src/codec/rice.rs`), with error feedback as [`crate::compress_with_feedback`].

use super::*;
use crate::codec::rice::BLOCK as RICE_BLOCK;

/// Warps per thread block of the rice kernels (`RICE_WARPS` in `kernels/codec/rice.cu`, whose
/// shared memory holds a block of codes, or of stop-bit positions, per warp).
const RICE_WARPS: u64 = 4;

fn blocks(n: u64) -> u64 {
    n.div_ceil(RICE_BLOCK as u64)
}

/// Workspace bytes a rice compress or decompress of `n` elements needs: the block heads, the
/// words and exceptions per block (scanned in place) and the scans' scratch.
pub fn rice_workspace_len(n: u64) -> u64 {
    let b = blocks(n);
    WS_HEADER + 8 * (b + 2 * (b + 1) + scan_sums_len(b + 1))
}

/// Bytes of output buffer that always suffice for a rice frame of `n` elements: a body is
/// only written when smaller than the raw bytes.
pub fn rice_capacity(n: u64, dtype: DType, ndim: usize) -> u64 {
    (FIXED_HEADER_LEN + 8 * ndim) as u64 + n * dtype.size() as u64
}

fn warp_per_block(n: u64) -> LaunchConfig {
    // (at least one warp: block 0 writes the parameters and the header even for n = 0)
    launch_cfg(blocks(n).max(1) * 32, (RICE_WARPS * 32) as u32)
}

/// [`compress`] into a rice frame (coder rice): the same arguments, checked the same way, except
/// that fixed rate (`Bound::Bits`) is refused, and the output and workspace need [`rice_capacity`] and [`rice_workspace_len`] bytes. The
/// frame's size lands at [`FRAME_SIZE_OFFSET`] of the workspace (and `size_to`), an unusable
/// `rel` bound at [`BOUND_ERROR_OFFSET`], the residual and its running maximum are updated, as
/// for [`compress`].
///
/// # Safety
/// As [`compress`].
///
/// # Errors
/// As [`compress`]; [`Error::InvalidBound`] for a fixed rate.
pub unsafe fn compress_rice(args: &CompressArgs<'_>) -> Result<()> {
    let (n, ndim) = (args.n, args.shape.len());
    let (mode, value, fixed) = check_compress_args(args)?;
    if fixed != 0 {
        return Err(crate::codec::rice::fixed_rate_error());
    }
    check_scales(args, mode)?;
    for (what, need, got) in [
        ("output", rice_capacity(n, args.dtype, ndim), args.out_len),
        ("workspace", rice_workspace_len(n), args.workspace_len),
    ] {
        if got < need {
            tracing::debug!(what, need, got, "rice buffer too small");
            return Err(Error::OutputSize {
                expected: need,
                got,
            });
        }
    }
    check_compress_alignment("compress_rice", args, 8)?;
    let _restore = ContextGuard::save()?;
    let dev = device(args.device)?;
    let stream = dev.stream(args.stream)?;
    let k = dev.kernels(args.dtype)?;
    let (scan_block, scan_add) = (
        dev.function(Family::Scan, "block", None)?,
        dev.function(Family::Scan, "add", None)?,
    );
    let b = blocks(n);
    let ws = args.workspace;
    let (words, excs, sums) = (
        ws + WS_HEADER + 8 * b,
        ws + WS_HEADER + 8 * (2 * b + 1),
        ws + WS_HEADER + 8 * (3 * b + 2),
    );
    let (input, n_a, ws_a) = (Arg::Ptr(args.input), Arg::U64(n), Arg::Ptr(ws));
    let residual = Arg::Ptr(args.residual);
    let mode_code = Arg::U32(u32::from(mode.code()));
    let (shifts, block_log2) = (Arg::Ptr(args.scales), Arg::U32(args.block_log2 as u32));
    // SAFETY: (every launch below) the caller's buffers, whose sizes were checked above; the
    // scans run over the `b + 1` words and exceptions within the workspace, with their scratch
    // after them (`rice_workspace_len`); `launch` checks each argument list.
    unsafe {
        zero(&stream, ws, WS_HEADER)?;
        if mode != BoundMode::Abs {
            let elements = launch_cfg(n.min(dev.grid_blocks * BLOCK as u64), BLOCK);
            let max_abs = [input, n_a, ws_a, residual];
            launch(
                &stream,
                &k.max_abs,
                Family::Codec,
                "max_abs",
                elements,
                &max_abs,
            )?;
        }
        let size = [
            input,
            n_a,
            mode_code,
            Arg::F64(value),
            ws_a,
            residual,
            shifts,
            block_log2,
        ];
        let cfg = warp_per_block(n);
        launch(
            &stream,
            &k.rice_size,
            Family::Codec,
            "rice_size",
            cfg,
            &size,
        )?;
        scan(&scan_block, &scan_add, &stream, words, b + 1, sums)?;
        scan(&scan_block, &scan_add, &stream, excs, b + 1, sums)?;
        let write = [
            input,
            n_a,
            Arg::U32(args.dtype.code() as u32),
            mode_code,
            Arg::U32(ndim as u32),
            Arg::Dims(Dims::of(args.shape)),
            Arg::Ptr(args.out),
            ws_a,
            Arg::Ptr(args.size_to),
            residual,
            Arg::Ptr(args.max_error_to),
            shifts,
            block_log2,
        ];
        launch(
            &stream,
            &k.rice_write,
            Family::Codec,
            "rice_write",
            cfg,
            &write,
        )?;
    }
    Ok(())
}

/// [`decompress`]'s work for a rice frame.
///
/// # Safety
/// As [`decompress`]; the workspace holds [`rice_workspace_len`] bytes (which
/// [`workspace_len`] covers).
pub(super) unsafe fn decompress_rice(
    args: &DecompressArgs,
    dev: &Device,
    stream: &CudaStream,
) -> Result<()> {
    if args.frame % 8 != 0 {
        return Err(Error::Cuda(format!(
            "decompress: a rice frame's address {:#x} is not 8-aligned",
            args.frame
        )));
    }
    let k = dev.kernels(args.dtype)?;
    let (scan_block, scan_add) = (
        dev.function(Family::Scan, "block", None)?,
        dev.function(Family::Scan, "add", None)?,
    );
    let n = args.n;
    let b = blocks(n);
    let ws = args.workspace;
    let header_len = (FIXED_HEADER_LEN + 8 * args.ndim) as u64;
    let common = [
        Arg::Ptr(args.frame),
        Arg::U64(header_len),
        Arg::U64(n),
        Arg::Ptr(ws),
    ];
    let with_out = [
        common[0],
        common[1],
        common[2],
        common[3],
        Arg::Ptr(args.out),
        Arg::Ptr(0),
    ];
    // SAFETY: the frame was checked on the host (this function's contract), so its heads, data
    // and exceptions lie within it; the workspace holds `rice_workspace_len(n)` bytes.
    unsafe {
        let heads = launch_cfg(b + 1, BLOCK);
        launch(
            stream,
            &k.rice_offsets,
            Family::Codec,
            "rice_offsets",
            heads,
            &common,
        )?;
        let words = ws + WS_HEADER + 8 * b;
        scan(
            &scan_block,
            &scan_add,
            stream,
            words,
            b + 1,
            ws + WS_HEADER + 8 * (3 * b + 2),
        )?;
        launch(
            stream,
            &k.rice_decode,
            Family::Codec,
            "rice_decode",
            warp_per_block(n),
            &with_out,
        )?;
        let exc_cfg = launch_cfg(n.clamp(1, 1 << 16), BLOCK);
        launch(
            stream,
            &k.rice_scatter,
            Family::Codec,
            "rice_scatter",
            exc_cfg,
            &with_out,
        )?;
    }
    Ok(())
}

/// Workspace bytes [`rice_decode_sum`] needs for `n` elements of `dtype`: a rice decode's, a
/// decoded frame and the f32 sum.
pub fn rice_decode_sum_workspace_len(n: u64, dtype: DType) -> u64 {
    let round = |x: u64| x.div_ceil(16) * 16;
    round(rice_workspace_len(n)) + round(n * dtype.size() as u64) + 4 * n
}

/// [`decode_sum`] for rice frames (or the raw frames a rice encoder falls back to), each of its
/// region's exact length (`lens_before` must be 0): every frame is checked on the device as the
/// CPU's reader checks it before anything is decoded from it, and one that fails sets
/// [`DECODE_BAD_FRAME`] in `status` (and its index + 1 in the next u32); nothing is written then.
/// The values are [`decode_sum`]'s. The workspace needs [`rice_decode_sum_workspace_len`] bytes.
///
/// # Safety
/// As [`decode_sum`].
///
/// # Errors
/// As [`decode_sum`].
pub unsafe fn rice_decode_sum(args: &DecodeSumArgs<'_>) -> Result<()> {
    check_decode_sum_args(args)?;
    let n = args.n;
    if args.frame_lens.len() != args.frames.len() {
        return Err(Error::Incompatible {
            what: "count",
            left: format!("{} frames", args.frames.len()),
            right: format!("{} lengths", args.frame_lens.len()),
        });
    }
    if args.lens_before != 0 {
        return Err(Error::Cuda(format!(
            "rice_decode_sum: lengths {} bytes before the frames (rice frames come unsized)",
            args.lens_before
        )));
    }
    let need = rice_decode_sum_workspace_len(n, args.dtype);
    if args.workspace_len < need {
        return Err(Error::OutputSize {
            expected: need,
            got: args.workspace_len,
        });
    }
    if args.frames.iter().any(|&f| f % 8 != 0) || args.workspace % 16 != 0 || args.status % 4 != 0 {
        return Err(Error::Cuda(
            "rice_decode_sum: frames must be 8-aligned, the workspace 16-aligned".into(),
        ));
    }
    let _restore = ContextGuard::save()?;
    let dev = device(args.device)?;
    let stream = dev.stream(args.stream)?;
    let k = dev.kernels(args.dtype)?;
    let finish = dev.function(Family::Codec, "rice_finish", Some(args.out_dtype))?;
    let (scan_block, scan_add) = (
        dev.function(Family::Scan, "block", None)?,
        dev.function(Family::Scan, "add", None)?,
    );
    let b = blocks(n);
    let ws = args.workspace;
    let round = |x: u64| x.div_ceil(16) * 16;
    let values = ws + round(rice_workspace_len(n));
    let acc = values + round(n * args.dtype.size() as u64);
    let header_len = (FIXED_HEADER_LEN + 8 * args.ndim) as u64;
    let (n_a, ws_a, status) = (Arg::U64(n), Arg::Ptr(ws), Arg::Ptr(args.status));
    let (size_a, ndim_a) = (
        Arg::U32(args.dtype.size() as u32),
        Arg::U32(args.ndim as u32),
    );
    let elements = launch_cfg(n.clamp(1, dev.grid_blocks * BLOCK as u64), BLOCK);
    // SAFETY: (every launch below) `frame_lens[p]` bytes are readable at frame p (this
    // function's contract) and the checks read no further; the decoders run only for frames
    // that passed them (each reads the status first); the workspace holds `need` bytes.
    unsafe {
        for (p, (&frame, &len)) in args.frames.iter().zip(args.frame_lens).enumerate() {
            let (f, part) = (Arg::Ptr(frame), Arg::U32(p as u32));
            let bad = Arg::U32(DECODE_BAD_FRAME);
            let heads = [
                f,
                Arg::U64(len),
                n_a,
                Arg::U32(args.dtype.code() as u32),
                size_a,
                ndim_a,
                ws_a,
                status,
                bad,
                part,
                Arg::U32(args.block_log2 as u32),
            ];
            launch(
                &stream,
                &k.rice_check_heads,
                Family::Codec,
                "rice_check_heads",
                launch_cfg(b + 1, BLOCK),
                &heads,
            )?;
            scan(
                &scan_block,
                &scan_add,
                &stream,
                ws + WS_HEADER + 8 * b,
                b + 1,
                ws + WS_HEADER + 8 * (3 * b + 2),
            )?;
            let blocks_args = [f, n_a, size_a, ndim_a, ws_a, status, bad, part];
            launch(
                &stream,
                &k.rice_check_blocks,
                Family::Codec,
                "rice_check_blocks",
                warp_per_block(n),
                &blocks_args,
            )?;
            let decode = [f, Arg::U64(header_len), n_a, ws_a, Arg::Ptr(values), status];
            launch(
                &stream,
                &k.rice_decode,
                Family::Codec,
                "rice_decode",
                warp_per_block(n),
                &decode,
            )?;
            let exc_cfg = launch_cfg(n.clamp(1, 1 << 16), BLOCK);
            launch(
                &stream,
                &k.rice_scatter,
                Family::Codec,
                "rice_scatter",
                exc_cfg,
                &decode,
            )?;
            let add = [
                Arg::Ptr(values),
                n_a,
                Arg::Ptr(acc),
                Arg::U32((p == 0) as u32),
                status,
            ];
            launch(
                &stream,
                &k.rice_accumulate,
                Family::Codec,
                "rice_accumulate",
                elements,
                &add,
            )?;
        }
        let fin = [
            Arg::Ptr(acc),
            n_a,
            Arg::F64(args.scale as f64),
            Arg::Ptr(args.out),
            status,
        ];
        launch(
            &stream,
            &finish,
            Family::Codec,
            "rice_finish",
            elements,
            &fin,
        )?;
    }
    Ok(())
}
