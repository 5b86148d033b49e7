//! The CUDA codec functions of `cfc._native`: CUDA tensors the Python package keeps alive (read
//! and checked in `tensor.rs`: no address crosses as a number), work queued on the caller's
//! stream (nothing waits for the GPU), and NCCL's id.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::codec::{bound_of, dtype_of};
use crate::error::to_py;
use crate::tensor;

// ---- CUDA: torch tensors the Python package keeps alive, read in `tensor.rs` ------------------

/// Whether a CUDA driver and at least one device are present.
#[pyfunction]
fn cuda_available() -> bool {
    cfc::cuda::available()
}

/// Whether device `device` can run cfc's kernels (driver present, compute capability 8.0+).
#[pyfunction]
fn cuda_supported(device: usize) -> bool {
    cfc::cuda::supported(device)
}

/// Refuses sizes past those the device codec's size functions are exact for
/// (`cfc::cuda::MAX_ELEMENTS` elements, `MAX_NDIM` dimensions, `MAX_SUM_PARTS` frames): their
/// arithmetic could wrap, and a buffer allocated from a wrapped size would be too small.
fn check_device_sizes(numel: u64, ndim: usize, parts: u64) -> PyResult<()> {
    if numel > cfc::cuda::MAX_ELEMENTS {
        return Err(PyValueError::new_err(format!(
            "the device codec takes at most 2^48 elements, got {numel}"
        )));
    }
    if ndim > cfc::format::MAX_NDIM {
        return Err(PyValueError::new_err(format!(
            "at most {} dimensions, got {ndim}",
            cfc::format::MAX_NDIM
        )));
    }
    if parts > cfc::cuda::MAX_SUM_PARTS {
        return Err(PyValueError::new_err(format!(
            "at most {} frames or ranks, got {parts}",
            cfc::cuda::MAX_SUM_PARTS
        )));
    }
    Ok(())
}

/// Workspace bytes the CUDA codec needs for `numel` elements (compressing needs more, and more
/// again with error feedback).
#[pyfunction]
#[pyo3(signature = (numel, *, compress=false, feedback=false))]
fn cuda_workspace_len(numel: u64, compress: bool, feedback: bool) -> PyResult<u64> {
    check_device_sizes(numel, 0, 0)?;
    Ok(if compress {
        cfc::cuda::compress_workspace_len(numel, feedback)
    } else {
        cfc::cuda::workspace_len(numel)
    })
}

/// Output bytes that always hold a frame compressed on the device.
#[pyfunction]
#[pyo3(signature = (numel, dtype, ndim, *, eps=None, rel=None, bits=None))]
fn cuda_compress_capacity(
    numel: u64,
    dtype: &str,
    ndim: usize,
    eps: Option<f64>,
    rel: Option<f64>,
    bits: Option<i64>,
) -> PyResult<u64> {
    check_device_sizes(numel, ndim, 0)?;
    Ok(cfc::cuda::compress_capacity(
        numel,
        dtype_of(dtype)?,
        ndim,
        bound_of(eps, rel, bits)?,
    ))
}

/// Output and workspace bytes of a lossless compression on the device.
#[pyfunction]
fn cuda_lossless_sizes(numel: u64, dtype: &str, ndim: usize) -> PyResult<(u64, u64)> {
    check_device_sizes(numel, ndim, 0)?;
    let dtype = dtype_of(dtype)?;
    Ok((
        cfc::cuda::lossless_capacity(numel, dtype, ndim),
        cfc::cuda::lossless_workspace_len(numel, dtype),
    ))
}

/// Output and workspace bytes of a sum of `parts` frames on the device.
#[pyfunction]
fn cuda_sum_sizes(numel: u64, dtype: &str, ndim: usize, parts: u64) -> PyResult<(u64, u64)> {
    check_device_sizes(numel, ndim, parts)?;
    Ok((
        cfc::cuda::sum_capacity(numel, dtype_of(dtype)?, ndim),
        cfc::cuda::sum_workspace_len(numel, parts),
    ))
}

/// The frames of a sum (uint8 tensors on `device`): their addresses and lengths.
fn frames_on(frames: &[Bound<'_, PyAny>], device: usize) -> PyResult<(Vec<u64>, Vec<u64>)> {
    let mut addrs = Vec::with_capacity(frames.len());
    let mut lens = Vec::with_capacity(frames.len());
    for (i, f) in frames.iter().enumerate() {
        let m = tensor::on_device(f, device, &format!("frame {i}"))?;
        addrs.push(m.addr);
        lens.push(m.bytes);
    }
    Ok((addrs, lens))
}

/// Elements of `shape`, refused where they overflow.
fn elements(shape: &[u64]) -> PyResult<u64> {
    shape
        .iter()
        .try_fold(1u64, |n, d| n.checked_mul(*d))
        .ok_or_else(|| PyValueError::new_err(format!("a shape of too many elements: {shape:?}")))
}

/// Queues on `stream` (a `torch.cuda.Stream`) the sum of `frames` (uint8 CUDA tensors of its
/// device, each a frame of `dtype` and `shape`, quantized or raw, checked on the device to lie
/// within its tensor) into one frame of mode `sum` in `out` (returns before the GPU finishes;
/// the frame's size, and any failure, are written to `workspace`).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn cuda_sum(
    py: Python<'_>,
    stream: &Bound<'_, PyAny>,
    frames: Vec<Bound<'_, PyAny>>,
    dtype: &str,
    shape: Vec<u64>,
    out: &Bound<'_, PyAny>,
    workspace: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let (device, stream) = tensor::cuda_stream(stream)?;
    let (addrs, lens) = frames_on(&frames, device)?;
    let out = tensor::on_device(out, device, "out")?;
    let ws = tensor::on_device(workspace, device, "the workspace")?;
    let args = cfc::cuda::SumArgs {
        block_log2: 0,
        device,
        stream: stream as usize,
        frames: &addrs,
        frame_lens: &lens,
        n: elements(&shape)?,
        dtype: dtype_of(dtype)?,
        shape: &shape,
        out: out.addr,
        out_len: out.bytes,
        workspace: ws.addr,
        workspace_len: ws.bytes,
    };
    // SAFETY: every address and length is a live, contiguous CUDA tensor's of the stream's
    // device (read above), which cfc.codec keeps alive until the stream's work is done; what is
    // checked on the device lies within each frame's tensor.
    py.detach(|| unsafe { cfc::cuda::sum(&args) })
        .map_err(to_py)
}

/// What a `cuda_decode_sum` status reports (its 8 bytes as a little-endian u64), or None: the
/// message the engine gives too (`cfc::decode_status_error`).
#[pyfunction]
fn decode_status_error(status: u64) -> Option<String> {
    cfc::decode_status_error(status)
}

/// Workspace bytes of `cuda_decode_sum` for `parts` frames of `numel` elements.
#[pyfunction]
fn cuda_decode_sum_workspace_len(numel: u64, parts: u64) -> PyResult<u64> {
    check_device_sizes(numel, 0, parts)?;
    Ok(cfc::cuda::decode_sum_workspace_len(numel, parts))
}

/// Queues on `stream` the decoded sum of `frames` (uint8 CUDA tensors, each an `ndim`-dimensional
/// frame of `dtype`, checked on the device), times `scale`, written into `out` (float32,
/// bfloat16 or float16, one element per frame element) (returns before the GPU finishes).
/// `status`: 8 bytes of device memory, zeroed before their first use, where a frame that fails
/// its check is reported (and while they are not zero, nothing is written). `lens_before`
/// (0: none) is `DecodeSumArgs::lens_before`: each frame's length read from the u64 that many
/// bytes before it, as the engine's rows carry it.
#[pyfunction]
#[pyo3(signature = (stream, frames, dtype, ndim, scale, out, workspace, status, *, lens_before=0))]
#[allow(clippy::too_many_arguments)]
fn cuda_decode_sum(
    py: Python<'_>,
    stream: &Bound<'_, PyAny>,
    frames: Vec<Bound<'_, PyAny>>,
    dtype: &str,
    ndim: usize,
    scale: f32,
    out: &Bound<'_, PyAny>,
    workspace: &Bound<'_, PyAny>,
    status: &Bound<'_, PyAny>,
    lens_before: u64,
) -> PyResult<()> {
    let (device, stream) = tensor::cuda_stream(stream)?;
    let (addrs, lens) = frames_on(&frames, device)?;
    let out = tensor::on_device(out, device, "out")?;
    let ws = tensor::on_device(workspace, device, "the workspace")?;
    let st = tensor::on_device(status, device, "the status")?;
    if st.bytes != 8 {
        return Err(PyValueError::new_err(format!(
            "the status takes 8 bytes, got {}",
            st.bytes
        )));
    }
    check_device_sizes(out.numel, ndim, addrs.len() as u64)?;
    let args = cfc::cuda::DecodeSumArgs {
        block_log2: 0,
        device,
        stream: stream as usize,
        frames: &addrs,
        frame_lens: &lens,
        lens_before,
        n: out.numel,
        dtype: dtype_of(dtype)?,
        ndim,
        scale,
        out: out.addr,
        out_dtype: out.dtype,
        workspace: ws.addr,
        workspace_len: ws.bytes,
        status: st.addr,
    };
    // SAFETY: as cuda_sum; `out` holds its `numel` elements of its dtype, the status 8 bytes.
    py.detach(|| unsafe { cfc::cuda::decode_sum(&args) })
        .map_err(to_py)
}

/// Queues on `stream` the lossless compression of `data` (a contiguous CUDA tensor of the
/// stream's device) into `out` (uint8, at least `cuda_lossless_sizes`' capacity), as a frame of
/// `shape` (returns before the GPU finishes; the frame's size is written to `workspace`).
#[pyfunction]
fn cuda_compress_lossless(
    py: Python<'_>,
    stream: &Bound<'_, PyAny>,
    data: &Bound<'_, PyAny>,
    shape: Vec<u64>,
    out: &Bound<'_, PyAny>,
    workspace: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let (device, stream) = tensor::cuda_stream(stream)?;
    let input = tensor::on_device(data, device, "data")?;
    let out = tensor::on_device(out, device, "out")?;
    let ws = tensor::on_device(workspace, device, "the workspace")?;
    same_elements(&shape, input.numel)?;
    let args = cfc::cuda::LosslessCompressArgs {
        device,
        stream: stream as usize,
        input: input.addr,
        n: input.numel,
        dtype: input.dtype,
        shape: &shape,
        out: out.addr,
        out_len: out.bytes,
        workspace: ws.addr,
        workspace_len: ws.bytes,
    };
    // SAFETY: as cuda_sum: live, contiguous CUDA tensors of the stream's device, read above.
    py.detach(|| unsafe { cfc::cuda::compress_lossless(&args) })
        .map_err(to_py)
}

/// Refuses a frame shape of other than `numel` elements.
fn same_elements(shape: &[u64], numel: u64) -> PyResult<()> {
    let n = elements(shape)?;
    if n != numel {
        return Err(PyValueError::new_err(format!(
            "a shape of {n} elements for a tensor of {numel}"
        )));
    }
    Ok(())
}

/// Queues on `stream` the compression of `data` (a contiguous float32, bfloat16 or float16
/// CUDA tensor of the stream's device) into `out` (uint8, at least `cuda_compress_capacity`),
/// as a frame of `shape`, with error feedback into `residual` (float32, `data`'s size) when
/// given (returns before the GPU finishes; the frame's size is written to `workspace`). The
/// engine's own uses, reached here for their tests: `size` (8 bytes or more: the frame's size
/// is also written at its start) and `max_error` (8 bytes or more: a float64 at its start is
/// raised to the largest error left in the residual).
#[pyfunction]
#[pyo3(signature = (stream, data, shape, out, workspace, *, eps=None, rel=None, bits=None, residual=None, coder="planes", size=None, max_error=None))]
#[allow(clippy::too_many_arguments)]
fn cuda_compress(
    py: Python<'_>,
    stream: &Bound<'_, PyAny>,
    data: &Bound<'_, PyAny>,
    shape: Vec<u64>,
    out: &Bound<'_, PyAny>,
    workspace: &Bound<'_, PyAny>,
    eps: Option<f64>,
    rel: Option<f64>,
    bits: Option<i64>,
    residual: Option<&Bound<'_, PyAny>>,
    coder: &str,
    size: Option<&Bound<'_, PyAny>>,
    max_error: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let coder = cfc::Coder::from_name(coder).ok_or_else(|| {
        PyValueError::new_err(format!("coder must be 'planes' or 'rice', not {coder:?}"))
    })?;
    let (device, stream) = tensor::cuda_stream(stream)?;
    let input = tensor::on_device(data, device, "data")?;
    let out = tensor::on_device(out, device, "out")?;
    let ws = tensor::on_device(workspace, device, "the workspace")?;
    same_elements(&shape, input.numel)?;
    let residual = match residual {
        Some(r) => {
            let r = tensor::on_device(r, device, "the residual")?;
            if r.dtype != cfc::DType::F32 || r.numel != input.numel {
                return Err(PyValueError::new_err(format!(
                    "the residual must be float32 of {} elements, got {} of {}",
                    input.numel,
                    r.dtype.name(),
                    r.numel
                )));
            }
            // (an empty input has no residual to write)
            if input.numel == 0 {
                0
            } else {
                r.addr
            }
        }
        None => 0,
    };
    let word = |t: Option<&Bound<'_, PyAny>>, what: &str| -> PyResult<u64> {
        match t {
            None => Ok(0),
            Some(t) => {
                let m = tensor::on_device(t, device, what)?;
                if m.bytes < 8 {
                    return Err(PyValueError::new_err(format!(
                        "{what} takes 8 bytes, got {}",
                        m.bytes
                    )));
                }
                Ok(m.addr)
            }
        }
    };
    let size_to = word(size, "size")?;
    let max_error_to = word(max_error, "max_error")?;
    let args = cfc::cuda::CompressArgs {
        scales: 0,
        block_log2: 0,
        device,
        stream: stream as usize,
        input: input.addr,
        n: input.numel,
        dtype: input.dtype,
        shape: &shape,
        bound: bound_of(eps, rel, bits)?,
        out: out.addr,
        out_len: out.bytes,
        workspace: ws.addr,
        workspace_len: ws.bytes,
        residual,
        size_to,
        max_error_to,
    };
    // SAFETY: as cuda_sum: live, contiguous CUDA tensors of the stream's device, read above,
    // the residual of the input's size (cfc.codec checks that it does not overlap the input).
    py.detach(|| unsafe {
        match coder {
            cfc::Coder::Planes => cfc::cuda::compress(&args),
            // (the planes' capacity and workspace, which cfc.codec allocates, cover a rice frame's)
            cfc::Coder::Rice => cfc::cuda::compress_rice(&args),
        }
    })
    .map_err(to_py)
}

/// Queues on `stream` the decoding of `frame` (a uint8 CUDA tensor holding a frame checked on
/// the host or made by cuda_compress) into `out` (its dtype and element count the frame's),
/// `ndim` the frame's dimensions.
#[pyfunction]
#[pyo3(signature = (stream, frame, ndim, out, workspace, codec="quantized"))]
fn cuda_decompress(
    py: Python<'_>,
    stream: &Bound<'_, PyAny>,
    frame: &Bound<'_, PyAny>,
    ndim: usize,
    out: &Bound<'_, PyAny>,
    workspace: &Bound<'_, PyAny>,
    codec: &str,
) -> PyResult<()> {
    let codec = match codec {
        "quantized" => cfc::Codec::Quantized,
        "raw" => cfc::Codec::Raw,
        "lossless" => cfc::Codec::Lossless,
        "rice" => cfc::Codec::Rice,
        other => {
            return Err(PyValueError::new_err(format!(
                "codec must be 'quantized', 'raw', 'lossless' or 'rice', got {other:?}"
            )))
        }
    };
    let (device, stream) = tensor::cuda_stream(stream)?;
    let out = tensor::on_device(out, device, "out")?;
    let args = decompress_args(device, stream, frame, ndim, out, codec, workspace)?;
    // SAFETY: live CUDA tensors of the stream's device, read above; cfc.codec validates host
    // frames (cfc::validate) before uploading them, and frames made by cuda_compress are
    // well-formed by construction.
    py.detach(|| unsafe { cfc::cuda::decompress(&args) })
        .map_err(to_py)
}

/// Queues on `stream` the chunk offsets of a checked lossless frame (a uint8 CUDA tensor)
/// whose header and chunk table are on the device (the rest may still be arriving), to be
/// decoded into `out`: the first half of a decode in parts.
#[pyfunction]
fn cuda_lossless_offsets(
    py: Python<'_>,
    stream: &Bound<'_, PyAny>,
    frame: &Bound<'_, PyAny>,
    ndim: usize,
    out: &Bound<'_, PyAny>,
    workspace: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let (device, stream) = tensor::cuda_stream(stream)?;
    let out = tensor::on_device(out, device, "out")?;
    let mut args = decompress_args(
        device,
        stream,
        frame,
        ndim,
        out,
        cfc::Codec::Lossless,
        workspace,
    )?;
    args.out = 0; // (nothing is written into it yet)
                  // SAFETY: as cuda_decompress; cfc.codec checked the frame on the host (cfc.pin) and queues
                  // this after the copy of its header and chunk table, on the same stream.
    py.detach(|| unsafe { cfc::cuda::lossless_offsets(&args) })
        .map_err(to_py)
}

/// Queues on `stream` the decoding of chunks `first..last` of a lossless frame into `out`,
/// after `cuda_lossless_offsets` and after those chunks' bytes reached the device.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn cuda_lossless_chunks(
    py: Python<'_>,
    stream: &Bound<'_, PyAny>,
    frame: &Bound<'_, PyAny>,
    ndim: usize,
    out: &Bound<'_, PyAny>,
    workspace: &Bound<'_, PyAny>,
    first: u64,
    last: u64,
) -> PyResult<()> {
    let (device, stream) = tensor::cuda_stream(stream)?;
    let out = tensor::on_device(out, device, "out")?;
    let args = decompress_args(
        device,
        stream,
        frame,
        ndim,
        out,
        cfc::Codec::Lossless,
        workspace,
    )?;
    // SAFETY: as cuda_lossless_offsets; the stream waits for the copy of these chunks first.
    py.detach(|| unsafe { cfc::cuda::lossless_chunks(&args, first, last) })
        .map_err(to_py)
}

/// The arguments of every decoding call (`cuda_decompress`, `cuda_lossless_*`): the frame and
/// workspace read from their tensors, the output's element count and dtype from `out`.
fn decompress_args(
    device: usize,
    stream: u64,
    frame: &Bound<'_, PyAny>,
    ndim: usize,
    out: tensor::Memory,
    codec: cfc::Codec,
    workspace: &Bound<'_, PyAny>,
) -> PyResult<cfc::cuda::DecompressArgs> {
    let frame = tensor::on_device(frame, device, "the frame")?;
    let ws = tensor::on_device(workspace, device, "the workspace")?;
    check_device_sizes(out.numel, ndim, 0)?;
    Ok(cfc::cuda::DecompressArgs {
        device,
        stream: stream as usize,
        frame: frame.addr,
        n: out.numel,
        dtype: out.dtype,
        codec,
        ndim,
        out: out.addr,
        workspace: ws.addr,
        workspace_len: ws.bytes,
    })
}

/// A new NCCL unique id, as hex: one rank makes it and hands it to the others (e.g. over
/// the process group's store), who all pass it to `Engine`. Loads NCCL: `CFC_NCCL_LIBRARY` if
/// set, else `libnccl.so.2` or `libnccl.so` (once torch has loaded pip's `libnccl.so.2`, that
/// name finds torch's copy).
#[pyfunction]
fn nccl_unique_id(py: Python<'_>) -> PyResult<String> {
    py.detach(cfc::nccl::UniqueId::new)
        .map(|id| id.to_hex())
        .map_err(to_py)
}

/// The version of the NCCL library cfc loads, as (major, minor, patch).
#[pyfunction]
fn nccl_version() -> PyResult<(u32, u32, u32)> {
    cfc::nccl::library()
        .and_then(|l| l.version())
        .map_err(to_py)
}

/// Adds the CUDA codec's functions and constants to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_supported, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_workspace_len, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_compress_capacity, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_compress, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_decompress, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_lossless_sizes, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_compress_lossless, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_lossless_offsets, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_lossless_chunks, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_sum_sizes, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_sum, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_decode_sum_workspace_len, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_decode_sum, m)?)?;
    m.add_function(wrap_pyfunction!(decode_status_error, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_version, m)?)?;
    m.add("CUDA_SUM_STEPS_DIFFER", cfc::cuda::SUM_STEPS_DIFFER)?;
    m.add("CUDA_SUM_OVERFLOW", cfc::cuda::SUM_OVERFLOW)?;
    m.add("CUDA_SUM_BAD_FRAME", cfc::cuda::SUM_BAD_FRAME)?;
    m.add("CUDA_SUM_EPS_OVERFLOW", cfc::cuda::SUM_EPS_OVERFLOW)?;
    m.add("CUDA_DECODE_BAD_FRAME", cfc::cuda::DECODE_BAD_FRAME)?;
    m.add("CUDA_FRAME_SIZE_OFFSET", cfc::cuda::FRAME_SIZE_OFFSET)?;
    m.add("CUDA_BOUND_ERROR_OFFSET", cfc::cuda::BOUND_ERROR_OFFSET)?;
    Ok(())
}
