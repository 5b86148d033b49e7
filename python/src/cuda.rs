//! The CUDA codec functions of `cfc._native`: device memory of tensors the Python package keeps
//! alive, work queued on the caller's stream (nothing waits for the GPU), and NCCL's id.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::codec::{bound_of, dtype_of};
use crate::error::to_py;

// ---- CUDA: device pointers from torch tensors the Python package keeps alive ----------------

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

/// Queues the sum of device-resident frames (quantized or raw, `frame_lens[p]` bytes readable
/// at `frame_ptrs[p]`, checked on the device) into one frame of mode `sum` (returns before the
/// GPU finishes; the frame's size, and any failure, are written to the workspace).
#[pyfunction]
#[pyo3(signature = (device, stream, frame_ptrs, frame_lens, numel, dtype, shape, out_ptr, out_len, ws_ptr, ws_len))]
#[allow(clippy::too_many_arguments)]
fn cuda_sum(
    py: Python<'_>,
    device: usize,
    stream: usize,
    frame_ptrs: Vec<u64>,
    frame_lens: Vec<u64>,
    numel: u64,
    dtype: &str,
    shape: Vec<u64>,
    out_ptr: u64,
    out_len: u64,
    ws_ptr: u64,
    ws_len: u64,
) -> PyResult<()> {
    let args = cfc::cuda::SumArgs {
        block_log2: 0,
        device,
        stream,
        frames: &frame_ptrs,
        frame_lens: &frame_lens,
        n: numel,
        dtype: dtype_of(dtype)?,
        shape: &shape,
        out: out_ptr,
        out_len,
        workspace: ws_ptr,
        workspace_len: ws_len,
    };
    // SAFETY: cfc.codec passes tensors of the frames' lengths (what is checked on the device
    // lies within them), and buffers it keeps alive until the stream's work is done.
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

/// Queues the decoded sum of device-resident frames (`frame_lens[p]` bytes readable at
/// `frame_ptrs[p]`, checked on the device), times `scale`, written as `out_dtype` (returns
/// before the GPU finishes). `status_ptr`: 8 bytes of device memory, zeroed before their first
/// use, where a frame that fails its check is reported (and while they are not zero, nothing
/// is written). `lens_before` (0: none) is `DecodeSumArgs::lens_before`.
#[pyfunction]
#[pyo3(signature = (device, stream, frame_ptrs, frame_lens, numel, dtype, ndim, scale, out_ptr, out_dtype, ws_ptr, ws_len, status_ptr, *, lens_before=0))]
#[allow(clippy::too_many_arguments)]
fn cuda_decode_sum(
    py: Python<'_>,
    device: usize,
    stream: usize,
    frame_ptrs: Vec<u64>,
    frame_lens: Vec<u64>,
    numel: u64,
    dtype: &str,
    ndim: usize,
    scale: f32,
    out_ptr: u64,
    out_dtype: &str,
    ws_ptr: u64,
    ws_len: u64,
    status_ptr: u64,
    lens_before: u64,
) -> PyResult<()> {
    let args = cfc::cuda::DecodeSumArgs {
        block_log2: 0,
        device,
        stream,
        frames: &frame_ptrs,
        frame_lens: &frame_lens,
        lens_before,
        n: numel,
        dtype: dtype_of(dtype)?,
        ndim,
        scale,
        out: out_ptr,
        out_dtype: dtype_of(out_dtype)?,
        workspace: ws_ptr,
        workspace_len: ws_len,
        status: status_ptr,
    };
    // SAFETY: as cuda_sum, and an output of `numel` elements of `out_dtype`, a status of 8
    // bytes.
    py.detach(|| unsafe { cfc::cuda::decode_sum(&args) })
        .map_err(to_py)
}
/// finishes; the frame's size is written to the workspace).
#[pyfunction]
#[pyo3(signature = (device, stream, data_ptr, numel, dtype, shape, out_ptr, out_len, ws_ptr, ws_len))]
#[allow(clippy::too_many_arguments)]
fn cuda_compress_lossless(
    py: Python<'_>,
    device: usize,
    stream: usize,
    data_ptr: u64,
    numel: u64,
    dtype: &str,
    shape: Vec<u64>,
    out_ptr: u64,
    out_len: u64,
    ws_ptr: u64,
    ws_len: u64,
) -> PyResult<()> {
    let args = cfc::cuda::LosslessCompressArgs {
        device,
        stream,
        input: data_ptr,
        n: numel,
        dtype: dtype_of(dtype)?,
        shape: &shape,
        out: out_ptr,
        out_len,
        workspace: ws_ptr,
        workspace_len: ws_len,
    };
    // SAFETY: as cuda_compress: cfc.codec passes data_ptr()s and sizes of CUDA tensors on
    // `device` that it keeps alive until the stream's work is done.
    py.detach(|| unsafe { cfc::cuda::compress_lossless(&args) })
        .map_err(to_py)
}

/// Queues compression of device memory on a CUDA stream (returns before the GPU finishes).
///
/// The caller (cfc.codec) passes `data_ptr()`s of live CUDA tensors on `device` that it keeps
/// referenced, and `stream` = `torch.cuda.current_stream(device).cuda_stream`. `size_ptr`,
/// `max_error_ptr` and `bound_ptr` (0: none) are `CompressArgs::size_to`,
/// `CompressArgs::max_error_to` and `CompressArgs::bound_at`.
#[pyfunction]
#[pyo3(signature = (device, stream, input_ptr, numel, dtype, shape, out_ptr, out_len, ws_ptr, ws_len, *, eps=None, rel=None, bits=None, residual_ptr=0, size_ptr=0, max_error_ptr=0, bound_ptr=0, coder="planes"))]
#[allow(clippy::too_many_arguments)]
fn cuda_compress(
    py: Python<'_>,
    device: usize,
    stream: usize,
    input_ptr: u64,
    numel: u64,
    dtype: &str,
    shape: Vec<u64>,
    out_ptr: u64,
    out_len: u64,
    ws_ptr: u64,
    ws_len: u64,
    eps: Option<f64>,
    rel: Option<f64>,
    bits: Option<i64>,
    residual_ptr: u64,
    size_ptr: u64,
    max_error_ptr: u64,
    bound_ptr: u64,
    coder: &str,
) -> PyResult<()> {
    let coder = cfc::Coder::from_name(coder).ok_or_else(|| {
        PyValueError::new_err(format!("coder must be 'planes' or 'rice', not {coder:?}"))
    })?;
    let args = cfc::cuda::CompressArgs {
        scales: 0,
        block_log2: 0,
        device,
        stream,
        input: input_ptr,
        n: numel,
        dtype: dtype_of(dtype)?,
        shape: &shape,
        bound: bound_of(eps, rel, bits)?,
        out: out_ptr,
        out_len,
        workspace: ws_ptr,
        workspace_len: ws_len,
        residual: residual_ptr,
        size_to: size_ptr,
        max_error_to: max_error_ptr,
        bound_at: bound_ptr,
    };
    // SAFETY: cfc.codec passes data_ptr()s and sizes of CUDA tensors on `device` that it keeps
    // alive (and, through torch's caching allocator, unreused) until the stream's work is done.
    py.detach(|| unsafe {
        match coder {
            cfc::Coder::Planes => cfc::cuda::compress(&args),
            // (the planes' capacity and workspace, which cfc.codec allocates, cover a rice frame's)
            cfc::Coder::Rice => cfc::cuda::compress_rice(&args),
        }
    })
    .map_err(to_py)
}

/// Queues decoding of a device-resident frame (checked on the host or made by cuda_compress).
#[pyfunction]
#[pyo3(signature = (device, stream, frame_ptr, numel, dtype, ndim, out_ptr, ws_ptr, ws_len, codec="quantized"))]
#[allow(clippy::too_many_arguments)]
fn cuda_decompress(
    py: Python<'_>,
    device: usize,
    stream: usize,
    frame_ptr: u64,
    numel: u64,
    dtype: &str,
    ndim: usize,
    out_ptr: u64,
    ws_ptr: u64,
    ws_len: u64,
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
    let args = decompress_args(
        device, stream, frame_ptr, numel, dtype, codec, ndim, out_ptr, ws_ptr, ws_len,
    )?;
    // SAFETY: as for cuda_compress; cfc.codec validates host frames (cfc::validate) before
    // uploading them, and frames made by cuda_compress are well-formed by construction.
    py.detach(|| unsafe { cfc::cuda::decompress(&args) })
        .map_err(to_py)
}

/// Queues the chunk offsets of a checked lossless frame whose header and chunk table are on the
/// device (the rest may still be arriving): the first half of a decode in parts.
#[pyfunction]
#[pyo3(signature = (device, stream, frame_ptr, numel, dtype, ndim, ws_ptr, ws_len))]
#[allow(clippy::too_many_arguments)]
fn cuda_lossless_offsets(
    py: Python<'_>,
    device: usize,
    stream: usize,
    frame_ptr: u64,
    numel: u64,
    dtype: &str,
    ndim: usize,
    ws_ptr: u64,
    ws_len: u64,
) -> PyResult<()> {
    let args = decompress_args(
        device,
        stream,
        frame_ptr,
        numel,
        dtype,
        cfc::Codec::Lossless,
        ndim,
        0,
        ws_ptr,
        ws_len,
    )?;
    // SAFETY: as cuda_decompress; cfc.codec checked the frame on the host (cfc.pin) and queues
    // this after the copy of its header and chunk table, on the same stream.
    py.detach(|| unsafe { cfc::cuda::lossless_offsets(&args) })
        .map_err(to_py)
}

/// Queues the decoding of chunks `first..last` of a lossless frame, after
/// `cuda_lossless_offsets` and after those chunks' bytes reached the device.
#[pyfunction]
#[pyo3(signature = (device, stream, frame_ptr, numel, dtype, ndim, out_ptr, ws_ptr, ws_len, first, last))]
#[allow(clippy::too_many_arguments)]
fn cuda_lossless_chunks(
    py: Python<'_>,
    device: usize,
    stream: usize,
    frame_ptr: u64,
    numel: u64,
    dtype: &str,
    ndim: usize,
    out_ptr: u64,
    ws_ptr: u64,
    ws_len: u64,
    first: u64,
    last: u64,
) -> PyResult<()> {
    let args = decompress_args(
        device,
        stream,
        frame_ptr,
        numel,
        dtype,
        cfc::Codec::Lossless,
        ndim,
        out_ptr,
        ws_ptr,
        ws_len,
    )?;
    // SAFETY: as cuda_lossless_offsets; the stream waits for the copy of these chunks first.
    py.detach(|| unsafe { cfc::cuda::lossless_chunks(&args, first, last) })
        .map_err(to_py)
}

/// The arguments of every decoding call (`cuda_decompress`, `cuda_lossless_*`).
#[allow(clippy::too_many_arguments)]
fn decompress_args(
    device: usize,
    stream: usize,
    frame: u64,
    n: u64,
    dtype: &str,
    codec: cfc::Codec,
    ndim: usize,
    out: u64,
    workspace: u64,
    workspace_len: u64,
) -> PyResult<cfc::cuda::DecompressArgs> {
    Ok(cfc::cuda::DecompressArgs {
        device,
        stream,
        frame,
        n,
        dtype: dtype_of(dtype)?,
        codec,
        ndim,
        out,
        workspace,
        workspace_len,
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
