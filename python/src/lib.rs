//! `cfc._native`: the Python binding of the cfc core.
//!
//! No logic lives here: arguments are converted and checked, the GIL is released around the
//! work, and errors are mapped to Python exceptions in `error.rs`. The Python package
//! `torch_hook/cfc` builds the user-facing API on top.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};

mod error;
use error::{to_py, CfcError, FormatError};

// Tensor memory crosses as (address, length) because the buffer protocol is not part of the
// stable ABI before Python 3.11 and the wheel is abi3 for 3.9+. The Python package computes
// both from a live, contiguous numpy array or torch tensor that it keeps referenced for the
// duration of the call; this module never imports torch.

/// Host memory handed over by address: `len` bytes at `addr`.
fn host_slice<'a>(addr: usize, len: usize, what: &str) -> PyResult<&'a [u8]> {
    if len == 0 {
        return Ok(&[]);
    }
    if addr == 0 {
        return Err(PyValueError::new_err(format!(
            "{what}: null address with {len} bytes"
        )));
    }
    // SAFETY: the caller (cfc.codec) passes the address and byte length of a contiguous host
    // array it keeps alive and does not resize until this call returns; `addr` is non-null.
    Ok(unsafe { std::slice::from_raw_parts(addr as *const u8, len) })
}

/// The error-feedback residual handed over by address (float32 host memory, updated in place):
/// `None` for address 0.
fn residual_slice<'a>(addr: usize, len: usize) -> PyResult<Option<&'a mut [u8]>> {
    if addr == 0 {
        return if len == 0 {
            Ok(None)
        } else {
            Err(PyValueError::new_err("residual: null address"))
        };
    }
    // SAFETY: the caller (cfc.codec / cfc.distributed) passes the non-null address of `len`
    // writable bytes of a contiguous float32 host tensor it keeps alive for the call, distinct
    // from the data.
    Ok(Some(unsafe {
        std::slice::from_raw_parts_mut(addr as *mut u8, len)
    }))
}

fn dtype_of(name: &str) -> PyResult<cfc::DType> {
    cfc::DType::from_name(name).ok_or_else(|| {
        PyTypeError::new_err(format!(
            "unsupported dtype {name:?}: cfc compresses float32, bfloat16 and float16 with a \
             bound, and also float64, uint8, int8, int16, int32, int64 and bool losslessly"
        ))
    })
}

/// A fixed rate from Python's integer: one that no `u8` holds is refused here, the rest (2 to
/// 32) by the codec.
fn bits_of(b: i64) -> PyResult<u8> {
    u8::try_from(b)
        .map_err(|_| PyValueError::new_err(format!("invalid bits: {b} is not between 2 and 32")))
}

fn bound_of(eps: Option<f64>, rel: Option<f64>, bits: Option<i64>) -> PyResult<cfc::Bound> {
    match (eps, rel, bits) {
        (Some(e), None, None) => Ok(cfc::Bound::Abs(e)),
        (None, Some(r), None) => Ok(cfc::Bound::Rel(r)),
        (None, None, Some(b)) => bits_of(b).map(cfc::Bound::Bits),
        _ => Err(PyValueError::new_err(
            "give exactly one of eps=, rel= or bits=",
        )),
    }
}

/// Compresses raw little-endian element bytes into a cfc frame.
///
/// Args:
///     data_ptr: address of the elements (contiguous host memory, kept alive by the caller).
///     nbytes: their size in bytes.
///     dtype: "float32", "bfloat16" or "float16".
///     shape: the tensor's dimensions (their product is the element count).
///     eps, rel, bits: exactly one of them sets the error bound.
///     zstd_level: if given, run the body through zstd at this level.
///     threads: threads to use, 0 for automatic.
///     residual_ptr, residual_nbytes: error feedback: contiguous, 4-byte aligned float32 host
///         memory, one value per element, kept alive by the caller and updated in place
///         (0, 0 for none).
///
/// Returns:
///     bytes: the frame.
#[pyfunction]
#[pyo3(signature = (data_ptr, nbytes, dtype, shape, *, eps=None, rel=None, bits=None, zstd_level=None, threads=0, residual_ptr=0, residual_nbytes=0))]
#[allow(clippy::too_many_arguments)]
fn compress<'py>(
    py: Python<'py>,
    data_ptr: usize,
    nbytes: usize,
    dtype: &str,
    shape: Vec<usize>,
    eps: Option<f64>,
    rel: Option<f64>,
    bits: Option<i64>,
    zstd_level: Option<i32>,
    threads: usize,
    residual_ptr: usize,
    residual_nbytes: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let dtype = dtype_of(dtype)?;
    let opts = cfc::CompressOptions {
        bound: bound_of(eps, rel, bits)?,
        zstd_level,
        threads,
    };
    let input = host_slice(data_ptr, nbytes, "data")?;
    let residual = residual_slice(residual_ptr, residual_nbytes)?;
    let frame = py
        .detach(|| match residual {
            None => cfc::compress_bytes(input, dtype, &shape, &opts),
            Some(r) => cfc::compress_bytes_with_feedback(input, dtype, r, &shape, &opts),
        })
        .map_err(to_py)?;
    Ok(PyBytes::new(py, &frame))
}

/// Compresses raw little-endian element bytes into a lossless cfc frame (any dtype cfc knows).
///
/// Args:
///     data_ptr: address of the elements (contiguous host memory, kept alive by the caller).
///     nbytes: their size in bytes.
///     dtype: "float32", "bfloat16", "float16", "float64", "uint8", "int8", "int16", "int32",
///         "int64" or "bool".
///     shape: the tensor's dimensions (their product is the element count).
///     zstd_level: if given, run the body through zstd at this level.
///     threads: threads to use, 0 for automatic.
///
/// Returns:
///     bytes: the frame.
#[pyfunction]
#[pyo3(signature = (data_ptr, nbytes, dtype, shape, *, zstd_level=None, threads=0))]
fn compress_lossless<'py>(
    py: Python<'py>,
    data_ptr: usize,
    nbytes: usize,
    dtype: &str,
    shape: Vec<usize>,
    zstd_level: Option<i32>,
    threads: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let dtype = dtype_of(dtype)?;
    let opts = cfc::LosslessOptions {
        zstd_level,
        threads,
    };
    let input = host_slice(data_ptr, nbytes, "data")?;
    let frame = py
        .detach(|| cfc::compress_lossless_bytes(input, dtype, &shape, &opts))
        .map_err(to_py)?;
    Ok(PyBytes::new(py, &frame))
}

/// Plain zstd of host bytes (no cfc frame), for comparisons such as `examples/compress_model.py`.
#[pyfunction]
#[pyo3(signature = (data_ptr, nbytes, level=3))]
fn zstd_compress<'py>(
    py: Python<'py>,
    data_ptr: usize,
    nbytes: usize,
    level: i32,
) -> PyResult<Bound<'py, PyBytes>> {
    let input = host_slice(data_ptr, nbytes, "data")?;
    let out = py
        .detach(|| zstd::bulk::compress(input, level))
        .map_err(|e| CfcError::new_err(format!("zstd failed: {e}")))?;
    Ok(PyBytes::new(py, &out))
}

/// Decompresses a frame into a new bytearray holding the elements' raw bytes.
///
/// The whole frame is checked before the output is allocated, so a crafted header cannot make
/// this allocate more than the frame really describes.
///
/// Args:
///     frame: the compressed frame.
///     threads: threads to use, 0 for automatic.
///
/// Returns:
///     bytearray: the decoded elements, little-endian, in the frame's dtype.
#[pyfunction]
#[pyo3(signature = (frame, *, threads=0))]
fn decompress<'py>(
    py: Python<'py>,
    frame: &[u8],
    threads: usize,
) -> PyResult<Bound<'py, PyByteArray>> {
    let open = py.detach(|| cfc::OpenFrame::open(frame)).map_err(to_py)?;
    let len = usize::try_from(open.header().decoded_len())
        .map_err(|_| PyValueError::new_err("frame too large for this platform"))?;
    PyByteArray::new_with(py, len, |out| {
        py.detach(|| open.decode_into_bytes(out, threads))
            .map_err(to_py)
    })
}

/// Reads a frame's header.
///
/// Returns:
///     dict: dtype, shape, numel, eps, step, mode, bits, codec, zstd, exceptions, nbytes,
///     decoded_nbytes, version.
#[pyfunction]
fn frame_info<'py>(py: Python<'py>, frame: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let h = cfc::read_header(frame).map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("dtype", h.dtype.name())?;
    d.set_item("shape", h.shape.clone())?;
    d.set_item("numel", h.n)?;
    d.set_item("eps", h.eps)?;
    d.set_item("step", h.step)?;
    d.set_item("mode", h.mode.name())?;
    d.set_item("bits", h.bits)?;
    d.set_item(
        "codec",
        match h.codec {
            cfc::Codec::Quantized => "quantized",
            cfc::Codec::Raw => "raw",
            cfc::Codec::Lossless => "lossless",
        },
    )?;
    d.set_item("zstd", h.zstd)?;
    d.set_item("exceptions", h.n_exceptions)?;
    d.set_item("nbytes", frame.len())?;
    d.set_item("decoded_nbytes", h.decoded_len())?;
    d.set_item("version", cfc::format::VERSION)?;
    Ok(d)
}

/// Checks a whole frame (header, body, widths, exception indices) without decoding it.
#[pyfunction]
fn validate(py: Python<'_>, frame: &[u8]) -> PyResult<()> {
    py.detach(|| cfc::validate(frame)).map_err(to_py)?;
    Ok(())
}

/// Sums frames quantized with the same step into one frame, adding their codes exactly.
#[pyfunction]
#[pyo3(signature = (frames, *, zstd_level=None))]
fn sum_frames<'py>(
    py: Python<'py>,
    frames: Vec<Bound<'py, PyBytes>>,
    zstd_level: Option<i32>,
) -> PyResult<Bound<'py, PyBytes>> {
    let slices: Vec<&[u8]> = frames.iter().map(|f| f.as_bytes()).collect();
    let out = py
        .detach(|| cfc::sum_frames(&slices, zstd_level))
        .map_err(to_py)?;
    Ok(PyBytes::new(py, &out))
}

/// Exact size of a fixed-rate frame of finite data with this shape and width.
#[pyfunction]
fn fixed_rate_size(shape: Vec<usize>, bits: i64) -> PyResult<u64> {
    cfc::fixed_rate_size(&shape, bits_of(bits)?).map_err(to_py)
}

// ---- the compressed all-reduce over a transport written in Python -------------------------

/// A `cfc::collective::Transport` whose `all_to_all` is a Python object's method
/// (`cfc.distributed.TorchTransport` over torch.distributed).
struct PyTransport {
    obj: Py<PyAny>,
    rank: usize,
    world: usize,
}

/// The most ranks a Python transport may report (a bound on what the all-reduce allocates per
/// rank before any message moves).
const MAX_TRANSPORT_WORLD: usize = 1 << 16;

impl PyTransport {
    /// Reads and checks `transport.rank` and `transport.world`.
    fn new(transport: Bound<'_, PyAny>) -> PyResult<PyTransport> {
        let rank: usize = transport.getattr("rank")?.extract()?;
        let world: usize = transport.getattr("world")?.extract()?;
        if world == 0 || world > MAX_TRANSPORT_WORLD || rank >= world {
            return Err(PyValueError::new_err(format!(
                "the transport says rank {rank} of {world} ranks: a world of 1 to \
                 {MAX_TRANSPORT_WORLD} ranks, and a rank below it, were expected"
            )));
        }
        Ok(PyTransport {
            rank,
            world,
            obj: transport.unbind(),
        })
    }
}

impl cfc::collective::Transport for PyTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_to_all(&mut self, parts: Vec<Vec<u8>>) -> cfc::Result<Vec<Vec<u8>>> {
        Python::attach(|py| {
            let parts: Vec<Bound<'_, PyBytes>> =
                parts.iter().map(|p| PyBytes::new(py, p)).collect();
            let got = self
                .obj
                .call_method1(py, "all_to_all", (parts,))
                .and_then(|r| r.extract::<Vec<Vec<u8>>>(py))
                .map_err(|e| cfc::Error::Transport(e.to_string()))?;
            if got.len() != self.world {
                return Err(cfc::Error::Transport(format!(
                    "all_to_all returned {} parts for {} ranks",
                    got.len(),
                    self.world
                )));
            }
            Ok(got)
        })
    }
}

/// Sums (or averages) a host buffer over the ranks of `transport`, compressed (see
/// `cfc::collective::allreduce`). The caller keeps `data` (and the residual) alive.
///
/// Args:
///     transport: an object with `rank`, `world` and `all_to_all(list[bytes]) -> list[bytes]`.
///     data_ptr, nbytes, dtype: the elements.
///     eps, rel: the bound each rank's contribution is quantized with (exactly one).
///     average: divide the sum by the number of ranks.
///     residual_ptr, residual_nbytes: error feedback (float32, updated in place), or 0, 0.
///     algorithm: "reduce-scatter" (the default), "all-gather", or None.
///
/// Returns:
///     tuple[bytearray, dict]: the result's elements, and eps, bound, bytes_sent,
///     bytes_uncompressed.
#[pyfunction]
#[pyo3(signature = (transport, data_ptr, nbytes, dtype, *, eps=None, rel=None, average=false, zstd_level=None, residual_ptr=0, residual_nbytes=0, algorithm=None))]
#[allow(clippy::too_many_arguments)]
fn allreduce<'py>(
    py: Python<'py>,
    transport: Bound<'py, PyAny>,
    data_ptr: usize,
    nbytes: usize,
    dtype: &str,
    eps: Option<f64>,
    rel: Option<f64>,
    average: bool,
    zstd_level: Option<i32>,
    residual_ptr: usize,
    residual_nbytes: usize,
    algorithm: Option<&str>,
) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyDict>)> {
    use cfc::collective::Algorithm;
    let mut t = PyTransport::new(transport)?;
    let parsed = (|| {
        let dtype = dtype_of(dtype)?;
        let algorithm = match algorithm {
            None => None,
            Some("reduce-scatter") => Some(Algorithm::ReduceScatter),
            Some("all-gather") => Some(Algorithm::AllGather),
            Some(other) => {
                return Err(PyValueError::new_err(format!(
                    "algorithm must be 'reduce-scatter', 'all-gather' or None, got {other:?}"
                )))
            }
        };
        let opts = cfc::collective::AllReduceOptions {
            bound: bound_of(eps, rel, None)?,
            average,
            zstd_level,
            algorithm,
        };
        let input = host_slice(data_ptr, nbytes, "data")?;
        let residual = residual_slice(residual_ptr, residual_nbytes)?;
        Ok((dtype, opts, input, residual))
    })();
    let (dtype, opts, input, residual) = match parsed {
        Ok(p) => p,
        Err(e) => {
            // The peers are in (or on their way to) the agreement round: refuse there, so
            // that they fail now rather than wait for this rank until their timeout.
            let reason = e.to_string();
            py.detach(|| cfc::collective::refuse(&mut t, &reason));
            return Err(e);
        }
    };
    let (values, report) = py
        .detach(|| cfc::collective::allreduce_bytes(&mut t, input, dtype, residual, &opts))
        .map_err(to_py)?;
    Ok((PyByteArray::new(py, &values), report_dict(py, &report)?))
}

/// Takes part in the agreement round of an `allreduce` this rank refuses (`reason`: the error
/// it is about to raise, found before it could call `allreduce`), so that its peers raise
/// `CfcError` ("rank R refused its input") at once instead of waiting for it.
#[pyfunction]
fn allreduce_refuse(py: Python<'_>, transport: Bound<'_, PyAny>, reason: &str) -> PyResult<()> {
    let mut t = PyTransport::new(transport)?;
    py.detach(|| cfc::collective::refuse(&mut t, reason));
    Ok(())
}

/// An all-reduce's report as the dict both Python entry points return.
fn report_dict<'py>(
    py: Python<'py>,
    report: &cfc::collective::AllReduceReport,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("eps", report.eps)?;
    d.set_item("bound", report.bound)?;
    d.set_item("bytes_sent", report.bytes_sent)?;
    d.set_item("bytes_uncompressed", report.bytes_uncompressed)?;
    Ok(d)
}

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

/// Queues a strided copy between device memory and/or pinned host memory: `rows` rows of
/// `width` bytes (returns before the GPU finishes).
#[pyfunction]
#[pyo3(signature = (device, stream, src, src_pitch, dst, dst_pitch, width, rows))]
#[allow(clippy::too_many_arguments)]
fn cuda_copy_rows(
    py: Python<'_>,
    device: usize,
    stream: usize,
    src: u64,
    src_pitch: u64,
    dst: u64,
    dst_pitch: u64,
    width: u64,
    rows: u64,
) -> PyResult<()> {
    let args = cfc::cuda::CopyRowsArgs {
        device,
        stream,
        src,
        src_pitch,
        dst,
        dst_pitch,
        width,
        rows,
    };
    // SAFETY: cfc passes the addresses of tensors (device or pinned) it keeps alive until the
    // stream's work is done, with pitches and widths inside them.
    py.detach(|| unsafe { cfc::cuda::copy_rows(&args) })
        .map_err(to_py)
}

/// Queues the sum of squares of the finite values `float32(x) + residual` (f64, deterministic)
/// into the last 8 bytes of `workspace` (`CUDA_SUM_SQUARES_WORKSPACE` bytes), and a copy of it
/// to `out` unless 0 (returns before the GPU finishes).
#[pyfunction]
#[pyo3(signature = (device, stream, data_ptr, numel, dtype, residual_ptr, workspace_ptr, out_ptr))]
#[allow(clippy::too_many_arguments)]
fn cuda_sum_squares(
    py: Python<'_>,
    device: usize,
    stream: usize,
    data_ptr: u64,
    numel: u64,
    dtype: &str,
    residual_ptr: u64,
    workspace_ptr: u64,
    out_ptr: u64,
) -> PyResult<()> {
    let args = cfc::cuda::SumSquaresArgs {
        device,
        stream,
        data: data_ptr,
        n: numel,
        dtype: dtype_of(dtype)?,
        residual: residual_ptr,
        workspace: workspace_ptr,
        out: out_ptr,
    };
    // SAFETY: cfc passes the addresses of tensors it keeps alive until the stream's work is
    // done: `numel` elements of `dtype` (and as many float32 residuals), a workspace of
    // CUDA_SUM_SQUARES_WORKSPACE bytes, 8 pinned or device bytes for the copy.
    py.detach(|| unsafe { cfc::cuda::sum_squares(&args) })
        .map_err(to_py)
}

/// Queues `target = max(target, max |finite r|)` over `numel` float32 residuals, the maximum
/// kept as f64 bits in 8 bytes of device memory (returns before the GPU finishes).
#[pyfunction]
#[pyo3(signature = (device, stream, residual_ptr, numel, target_ptr))]
fn cuda_running_max_abs(
    py: Python<'_>,
    device: usize,
    stream: usize,
    residual_ptr: u64,
    numel: u64,
    target_ptr: u64,
) -> PyResult<()> {
    // SAFETY: cfc passes a residual of `numel` float32 and an 8-byte device word it keeps alive
    // until the stream's work is done.
    py.detach(|| unsafe {
        cfc::cuda::running_max_abs(device, stream, residual_ptr, numel, target_ptr)
    })
    .map_err(to_py)
}

/// Queues lossless compression of device memory on a CUDA stream (returns before the GPU
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
#[pyo3(signature = (device, stream, input_ptr, numel, dtype, shape, out_ptr, out_len, ws_ptr, ws_len, *, eps=None, rel=None, bits=None, residual_ptr=0, size_ptr=0, max_error_ptr=0, bound_ptr=0))]
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
) -> PyResult<()> {
    let args = cfc::cuda::CompressArgs {
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
    py.detach(|| unsafe { cfc::cuda::compress(&args) })
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
        other => {
            return Err(PyValueError::new_err(format!(
                "codec must be 'quantized', 'raw' or 'lossless', got {other:?}"
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
/// torch.distributed), who all pass it to `NcclAllReducer`. Loads NCCL: `CFC_NCCL_LIBRARY` if
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

/// Joins the NCCL communicator of `unique_id` (hex) as `rank` of `world` on `device`, with
/// `timeout` seconds for every wait (None: `CFC_NCCL_TIMEOUT`, else 300), then makes `then` of
/// it: what `NcclAllReducer` and `BucketExchange` are built on. The GIL is released while the
/// ranks join.
fn join_communicator<T: Send>(
    py: Python<'_>,
    device: usize,
    unique_id: &str,
    rank: usize,
    world: usize,
    timeout: Option<f64>,
    then: impl FnOnce(cfc::nccl::Communicator) -> cfc::Result<T> + Send,
) -> PyResult<T> {
    let id = cfc::nccl::UniqueId::from_hex(unique_id).map_err(to_py)?;
    let timeout = match timeout {
        None => None,
        Some(t) => Some(
            std::time::Duration::try_from_secs_f64(t)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| {
                    PyValueError::new_err(format!(
                        "timeout must be a positive number of seconds a Duration holds, got {t}"
                    ))
                })?,
        ),
    };
    py.detach(|| {
        let comm = match timeout {
            Some(t) => cfc::nccl::Communicator::with_timeout(device, &id, rank, world, t)?,
            None => cfc::nccl::Communicator::new(device, &id, rank, world)?,
        };
        then(comm)
    })
    .map_err(to_py)
}

/// What a Python class holds over an NCCL communicator until its `close()`: the classes that
/// own one (`NcclAllReducer`, `BucketExchange`) keep it here.
// A Mutex only for `Sync` (a communicator's handles are raw pointers); the methods take
// `&mut self`, so it is never contended.
struct Closable<T: Send>(std::sync::Mutex<Option<T>>);

/// Drops `value` (a GPU object of cfc's: its buffers and streams bind their device's context to
/// be freed), then makes the thread's current CUDA context what it was.
fn drop_restoring_context<T>(value: T) {
    let restore = cfc::cuda::ContextGuard::save().ok();
    drop(value);
    drop(restore);
}

/// Leaving a communicator waits for its peers (within its timeout): one collected without
/// `close()` is left without the GIL too, so that no other Python thread waits meanwhile.
fn drop_detached<T: Send>(value: Option<T>) {
    if value.is_some() {
        // (`try_attach` runs nothing only where the thread cannot attach at all: the closure,
        // and the value in it, are then dropped here as they are)
        let _ = Python::try_attach(|py| py.detach(move || drop_restoring_context(value)));
    }
}

impl<T: Send> Closable<T> {
    fn new(value: T) -> Self {
        Closable(std::sync::Mutex::new(Some(value)))
    }

    fn held(&mut self) -> Option<&mut T> {
        self.0.get_mut().unwrap_or_else(|p| p.into_inner()).as_mut()
    }

    /// The value, or an error naming `class` once it was closed.
    fn live(&mut self, class: &str) -> PyResult<&mut T> {
        self.held()
            .ok_or_else(|| CfcError::new_err(format!("this {class} was closed")))
    }

    /// Drops the value (which leaves the communicator) without the GIL.
    fn close(&mut self, py: Python<'_>) {
        let inner = self.0.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        py.detach(move || drop_restoring_context(inner));
    }
}

impl<T: Send> Drop for Closable<T> {
    fn drop(&mut self) {
        drop_detached(self.0.get_mut().unwrap_or_else(|p| p.into_inner()).take());
    }
}

/// cfc's GPU all-reduce over an NCCL communicator of its own (`cfc::gpu_allreduce`), run by
/// the Rust core: compression with error feedback, the exchange of frames and their decoding,
/// with no Python in between. `cfc.distributed.NcclAllReducer` is the user-facing wrapper.
#[pyclass(module = "cfc._native")]
struct NcclAllReducer {
    inner: Closable<cfc::gpu_allreduce::GpuAllReducer>,
}

#[pymethods]
impl NcclAllReducer {
    /// Joins the communicator of `unique_id` (hex, from `nccl_unique_id`) as `rank` of
    /// `world` on CUDA device `device`; waits until every rank has joined (NCCL's rule), at
    /// most `timeout` seconds (default: `CFC_NCCL_TIMEOUT`, else 300) for it and every later
    /// wait.
    #[new]
    #[pyo3(signature = (device, unique_id, rank, world, *, timeout=None))]
    fn new(
        py: Python<'_>,
        device: usize,
        unique_id: &str,
        rank: usize,
        world: usize,
        timeout: Option<f64>,
    ) -> PyResult<Self> {
        let reducer = join_communicator(py, device, unique_id, rank, world, timeout, |comm| {
            cfc::gpu_allreduce::GpuAllReducer::new(comm)
        })?;
        Ok(NcclAllReducer {
            inner: Closable::new(reducer),
        })
    }

    /// Averages (or sums) `numel` elements of `dtype` at device address `data_ptr` in place
    /// over all ranks, queued on the raw CUDA stream `stream`; see
    /// `cfc::gpu_allreduce::GpuAllReducer::allreduce`. `fallback`: "never", "always" or
    /// "auto" (`trials` timed calls of each way first). Returns this call's report: eps,
    /// bound, bytes_sent, bytes_uncompressed and compressed.
    #[pyo3(signature = (stream, data_ptr, numel, dtype, *, eps, average=true, feedback=true, chunk_numel=1 << 26, fallback="never", trials=3))]
    #[allow(clippy::too_many_arguments)]
    fn allreduce<'py>(
        &mut self,
        py: Python<'py>,
        stream: usize,
        data_ptr: u64,
        numel: u64,
        dtype: &str,
        eps: f64,
        average: bool,
        feedback: bool,
        chunk_numel: u64,
        fallback: &str,
        trials: u32,
    ) -> PyResult<Bound<'py, PyDict>> {
        use cfc::gpu_allreduce::{Fallback, GpuAllReduceOptions};
        let dtype = dtype_of(dtype)?;
        let fallback = match fallback {
            "never" => Fallback::Never,
            "always" => Fallback::Always,
            "auto" => Fallback::Auto { trials },
            other => {
                return Err(PyValueError::new_err(format!(
                    "fallback must be \"never\", \"always\" or \"auto\", got {other:?}"
                )))
            }
        };
        if chunk_numel == 0 {
            return Err(PyValueError::new_err("chunk_numel must be at least 1"));
        }
        let reducer = self.inner.live("NcclAllReducer")?;
        let opts = GpuAllReduceOptions {
            bound: cfc::Bound::Abs(eps),
            average,
            feedback,
            chunk_numel,
            fallback,
        };
        let report = py
            // SAFETY: the Python package passes a live, contiguous CUDA tensor of `numel`
            // elements of `dtype` on the communicator's device, and that device's current
            // stream, and keeps the tensor referenced (work on it is queued on that stream).
            .detach(|| unsafe { reducer.allreduce(stream, data_ptr, numel, dtype, &opts) })
            .map_err(to_py)?;
        let d = report_dict(py, &report)?;
        // An uncompressed call reports eps 0.
        d.set_item("compressed", report.eps > 0.0)?;
        Ok(d)
    }

    /// Whether calls with the current size and options are compressed (None before the first
    /// call and during the "auto" trial).
    fn compressing(&mut self) -> PyResult<Option<bool>> {
        Ok(self.inner.live("NcclAllReducer")?.compressing())
    }

    /// Raises the error of a frame that failed its check on the GPU, as far as the copies of
    /// the decoder's status have arrived (no wait: `wait()` first to learn about every call
    /// so far).
    fn check(&mut self) -> PyResult<()> {
        self.inner
            .live("NcclAllReducer")?
            .check_frames_seen()
            .map_err(to_py)
    }

    /// Waits for the last call's work on the GPU (its all-reduce or exchange, its decoding),
    /// at most the communicator's timeout, without the GIL: a peer that stopped is then a
    /// CfcError (and the communicator is aborted), not a wait for good.
    fn wait(&mut self, py: Python<'_>) -> PyResult<()> {
        let reducer = self.inner.live("NcclAllReducer")?;
        py.detach(|| reducer.wait()).map_err(to_py)
    }

    /// Leaves the communicator (NCCL finalizes it; waits for this rank's queued work).
    fn close(&mut self, py: Python<'_>) {
        self.inner.close(py);
    }
}

/// The compressed exchange of `cfc_hook`'s CUDA buckets over an NCCL communicator of cfc's
/// own (`cfc::bucket_exchange`): per bucket, one call queues the sum of squares, the
/// compression and the all-gather, and one waits for the frame sizes and queues the average.
/// `cfc.ddp` drives it from its comm thread, or hands it to a `BucketPipeline`.
#[pyclass(module = "cfc._native")]
struct BucketExchange {
    // Shared with the pipelines made of it (`BucketPipeline`); None once closed.
    inner: cfc::bucket_pipeline::SharedExchange,
}

impl Drop for BucketExchange {
    fn drop(&mut self) {
        // The pipelines made of it may still hold the exchange: only the last holder leaves.
        let inner = std::mem::take(&mut self.inner);
        drop_detached(Some(inner));
    }
}

impl BucketExchange {
    /// Runs `f` on the exchange without the GIL.
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut cfc::bucket_exchange::BucketExchange) -> cfc::Result<R> + Send,
    ) -> PyResult<R> {
        let inner = &self.inner;
        py.detach(|| {
            let mut guard = inner.lock().unwrap_or_else(|p| p.into_inner());
            match guard.as_mut() {
                Some(exchange) => f(exchange).map_err(to_py),
                None => Err(CfcError::new_err("this BucketExchange was closed")),
            }
        })
    }
}

#[pymethods]
impl BucketExchange {
    /// Joins the communicator of `unique_id` (hex, from `nccl_unique_id`) as `rank` of
    /// `world` on CUDA device `device`; waits until every rank has joined, at most `timeout`
    /// seconds (default: `CFC_NCCL_TIMEOUT`, else 300) for it and every later wait.
    #[new]
    #[pyo3(signature = (device, unique_id, rank, world, *, timeout=None))]
    fn new(
        py: Python<'_>,
        device: usize,
        unique_id: &str,
        rank: usize,
        world: usize,
        timeout: Option<f64>,
    ) -> PyResult<Self> {
        let exchange = join_communicator(py, device, unique_id, rank, world, timeout, |comm| {
            cfc::bucket_exchange::BucketExchange::new(comm)
        })?;
        Ok(BucketExchange {
            inner: std::sync::Arc::new(std::sync::Mutex::new(Some(exchange))),
        })
    }

    /// Where a bucket's `launch` places its parts in one device allocation
    /// (`cfc::bucket_exchange::ScratchLayout`): a dict of `capacity`, `slot` (the one asked for,
    /// clamped and rounded up to 16), `recv_at`, `workspace_at`, `workspace_len` and `len`, all
    /// in bytes; this rank's row is at 0.
    #[staticmethod]
    #[pyo3(signature = (numel, dtype, eps, feedback, slot, world))]
    fn scratch_layout<'py>(
        py: Python<'py>,
        numel: u64,
        dtype: &str,
        eps: f64,
        feedback: bool,
        slot: u64,
        world: u64,
    ) -> PyResult<Bound<'py, PyDict>> {
        check_device_sizes(numel, 1, world)?;
        let l = cfc::bucket_exchange::ScratchLayout::new(
            numel,
            dtype_of(dtype)?,
            eps,
            feedback,
            slot,
            world,
        );
        let d = PyDict::new(py);
        d.set_item("capacity", l.capacity)?;
        d.set_item("slot", l.slot)?;
        d.set_item("recv_at", l.recv_at)?;
        d.set_item("workspace_at", l.workspace_at)?;
        d.set_item("workspace_len", l.workspace_len)?;
        d.set_item("len", l.len)?;
        Ok(d)
    }

    /// Queues bucket `key`'s sum of squares (when `sum_ws_ptr` is not 0), compression and frame
    /// exchange; see `cfc::bucket_exchange::LaunchArgs` (returns before the GPU finishes).
    #[pyo3(signature = (key, stream, data_ptr, numel, dtype, residual_ptr, row_ptr, capacity, ws_ptr, ws_len, sum_ws_ptr, sum_out_ptr, slot, recv_ptr, max_error_ptr, *, eps=None, rel=None))]
    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        py: Python<'_>,
        key: u64,
        stream: usize,
        data_ptr: u64,
        numel: u64,
        dtype: &str,
        residual_ptr: u64,
        row_ptr: u64,
        capacity: u64,
        ws_ptr: u64,
        ws_len: u64,
        sum_ws_ptr: u64,
        sum_out_ptr: u64,
        slot: u64,
        recv_ptr: u64,
        max_error_ptr: u64,
        eps: Option<f64>,
        rel: Option<f64>,
    ) -> PyResult<()> {
        let args = cfc::bucket_exchange::LaunchArgs {
            key,
            stream,
            data: data_ptr,
            n: numel,
            dtype: dtype_of(dtype)?,
            residual: residual_ptr,
            bound: bound_of(eps, rel, None)?,
            row: row_ptr,
            capacity,
            workspace: ws_ptr,
            workspace_len: ws_len,
            sum_squares: (sum_ws_ptr != 0).then_some((sum_ws_ptr, sum_out_ptr)),
            slot,
            recv: recv_ptr,
            max_error: max_error_ptr,
        };
        // SAFETY: cfc.ddp passes data_ptr()s of CUDA tensors on the communicator's device of the
        // sizes the arguments state, which it keeps referenced until the bucket's finish has
        // queued its decoding on `stream` (the comm thread's current stream).
        self.with(py, |exchange| unsafe { exchange.launch(&args) })
    }

    /// Waits for bucket `key`'s frame sizes and queues the average into the bucket. Returns
    /// `(0, bytes sent, next slot)` when done, or `(row length, 0, 0)` when a frame outgrew its
    /// slot: call again with `resend_recv_ptr` holding `world` rows of that length.
    #[pyo3(signature = (key, stream, scale, ws_ptr, ws_len, resend_recv_ptr=0))]
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        py: Python<'_>,
        key: u64,
        stream: usize,
        scale: f32,
        ws_ptr: u64,
        ws_len: u64,
        resend_recv_ptr: u64,
    ) -> PyResult<(u64, u64, u64)> {
        use cfc::bucket_exchange::Finish;
        let args = cfc::bucket_exchange::FinishArgs {
            key,
            stream,
            scale,
            workspace: ws_ptr,
            workspace_len: ws_len,
            resend_recv: resend_recv_ptr,
        };
        // SAFETY: as launch; the workspace and the resend rows are CUDA tensors of the stated
        // sizes that cfc.ddp keeps referenced until the stream's work is done.
        let done = self.with(py, |exchange| unsafe { exchange.finish(&args) })?;
        Ok(match done {
            Finish::Done { sent, next_slot } => (0, sent, next_slot),
            Finish::Resend { row_len } => (row_len, 0, 0),
        })
    }

    /// Raises the error of a frame that failed its check on the GPU, as far as the copies of the
    /// decoder's status have arrived (no wait: synchronize the stream of the last `finish`
    /// first to learn about every bucket so far).
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |exchange| exchange.check_frames_seen())
    }

    /// Makes `stream` wait for every exchange queued so far (before a collective of another
    /// communicator on that stream).
    fn fence(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        // SAFETY: cfc.ddp passes the comm thread's live stream.
        self.with(py, |exchange| unsafe { exchange.fence(stream) })
    }

    /// How the waits poll (`cfc::nccl::Communicator::set_polling`): without a pause for
    /// `spin_us` microseconds, then sleeping `nap_us` between polls.
    fn set_polling(&self, py: Python<'_>, spin_us: u64, nap_us: u64) -> PyResult<()> {
        self.with(py, |exchange| {
            exchange.communicator().set_polling(
                std::time::Duration::from_micros(spin_us),
                std::time::Duration::from_micros(nap_us),
            );
            Ok(())
        })
    }

    /// Whether each bucket's compression and decoding are submitted as one CUDA graph each
    /// (`cfc::bucket_exchange::BucketExchange::set_graphs`; off by default).
    fn set_graphs(&self, py: Python<'_>, on: bool) -> PyResult<()> {
        self.with(py, |exchange| {
            exchange.set_graphs(on);
            Ok(())
        })
    }

    /// Graphs instantiated so far, over every bucket.
    fn graphs_instantiated(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |exchange| Ok(exchange.graphs_instantiated()))
    }

    /// Graphs launched as they were, without recording again
    /// (`cfc::bucket_exchange::BucketExchange::graphs_reused`).
    fn graphs_reused(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |exchange| Ok(exchange.graphs_reused()))
    }

    /// Buckets with something kept by the exchange (events, pinned sizes, graphs).
    fn buckets(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |exchange| Ok(exchange.buckets()))
    }

    /// Lets go of what is kept for the buckets `keys`, which will not run again; waits for the
    /// device first. Returns how many went. Raises for a key whose exchange is in flight.
    fn forget(&self, py: Python<'_>, keys: Vec<u64>) -> PyResult<usize> {
        self.with(py, |exchange| exchange.forget(&keys))
    }

    /// Leaves the communicator (NCCL finalizes it; waits for this rank's queued work). Close
    /// the pipelines made of it first.
    fn close(&self, py: Python<'_>) {
        let inner = &self.inner;
        py.detach(|| {
            let taken = inner.lock().unwrap_or_else(|p| p.into_inner()).take();
            drop_restoring_context(taken);
        });
    }
}

/// A step's CUDA buckets through a `BucketExchange` on a thread of cfc's own, with no Python on
/// it (`cfc::bucket_pipeline`): `submit` per bucket returns at once, `end_step` at the step's
/// last bucket finishes the exchanges, waits for the GPU and reports. `cfc.ddp` uses it in the
/// steps after the warm-up and the trial when the state asks for it (`CfcState._use_pipeline`).
#[pyclass(module = "cfc._native")]
struct BucketPipeline {
    inner: Closable<cfc::bucket_pipeline::BucketPipeline>,
}

#[pymethods]
impl BucketPipeline {
    /// A pipeline over `exchange`; the decoded sums are multiplied by `scale` (1 / world as an
    /// f32, for an average).
    #[new]
    fn new(py: Python<'_>, exchange: &BucketExchange, scale: f32) -> PyResult<Self> {
        let shared = exchange.inner.clone();
        let pipeline = py
            .detach(|| cfc::bucket_pipeline::BucketPipeline::new(shared, scale))
            .map_err(to_py)?;
        Ok(BucketPipeline {
            inner: Closable::new(pipeline),
        })
    }

    /// Hands bucket `key` to the thread after the work queued so far on the raw CUDA stream
    /// `stream`: `numel` elements of `dtype` at `data_ptr`, averaged in place, with `numel`
    /// float32 residuals at `residual_ptr` (0: none). `compress=False`: NCCL's plain average;
    /// else the bound `eps`, or with `eps=None` the multiple `rms` of the bucket's RMS, measured
    /// now. `sum_out_ptr`: 8 bytes of pinned memory for the sum of squares the next step's
    /// `rms` bound follows (0: none). `slot`: frame bytes per rank of the exchange;
    /// `max_error_ptr`: the running maximum of the error sent (0: none).
    #[pyo3(signature = (key, stream, data_ptr, numel, dtype, residual_ptr, *, compress, eps=None, rms=None, sum_out_ptr=0, slot=0, max_error_ptr=0))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &mut self,
        key: u64,
        stream: usize,
        data_ptr: u64,
        numel: u64,
        dtype: &str,
        residual_ptr: u64,
        compress: bool,
        eps: Option<f64>,
        rms: Option<f64>,
        sum_out_ptr: u64,
        slot: u64,
        max_error_ptr: u64,
    ) -> PyResult<()> {
        use cfc::bucket_pipeline::{CompressJob, Job, JobBound};
        let compress = if compress {
            let bound = match (eps, rms) {
                (Some(e), None) => JobBound::Abs(e),
                (None, Some(m)) => JobBound::RmsOfThisStep(m),
                _ => return Err(PyValueError::new_err("give exactly one of eps= or rms=")),
            };
            Some(CompressJob {
                bound,
                sum_out: sum_out_ptr,
                slot,
                max_error: max_error_ptr,
            })
        } else {
            None
        };
        let job = Job {
            key,
            data: data_ptr,
            n: numel,
            dtype: dtype_of(dtype)?,
            residual: residual_ptr,
            compress,
        };
        let pipeline = self.inner.live("BucketPipeline")?;
        // SAFETY: cfc.ddp passes data_ptr()s of CUDA tensors of the stated sizes on the
        // exchange's device, and pinned and device scalars, all of which it keeps referenced and
        // leaves unwritten until end_step returns; `stream` is the autograd thread's current
        // stream. (The GIL is kept: the call records an event and queues the bucket.)
        unsafe { pipeline.submit(stream, job) }.map_err(to_py)
    }

    /// Finishes the step (the last exchanges, the wait for the GPU, the check of the frames
    /// decoded) and returns what its buckets did: a dict of `bytes_sent`, `resends`,
    /// `seconds`, `eps` and `slots` ({key: frame bytes per rank for the next exchange}).
    /// Raises the first failure of the step's buckets (or of an earlier step's).
    fn end_step<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let pipeline = self.inner.live("BucketPipeline")?;
        let report = py.detach(|| pipeline.end_step()).map_err(to_py)?;
        let d = PyDict::new(py);
        d.set_item("bytes_sent", report.sent)?;
        d.set_item("resends", report.resends)?;
        d.set_item("seconds", report.seconds)?;
        d.set_item("eps", report.eps)?;
        let slots = PyDict::new(py);
        for (key, slot) in report.slots {
            slots.set_item(key, slot)?;
        }
        d.set_item("slots", slots)?;
        Ok(d)
    }

    /// Fault injection, for tests of the frame checks: the next time bucket `key` is finished,
    /// rank 0's frame is overwritten after it arrived, before it is decoded.
    fn _corrupt_next_received(&mut self, key: u64) -> PyResult<()> {
        self.inner
            .live("BucketPipeline")?
            .corrupt_next_received(key)
            .map_err(to_py)
    }

    /// Waits until the thread has handled every bucket submitted so far.
    fn sync(&mut self, py: Python<'_>) -> PyResult<()> {
        let pipeline = self.inner.live("BucketPipeline")?;
        py.detach(|| pipeline.sync()).map_err(to_py)
    }

    /// Buckets with an event kept by the pipeline.
    fn buckets(&mut self) -> PyResult<usize> {
        Ok(self.inner.live("BucketPipeline")?.buckets())
    }

    /// Lets go of the events kept for the buckets `keys`, which will not run again. Returns
    /// how many went.
    fn forget(&mut self, keys: Vec<u64>) -> PyResult<usize> {
        Ok(self.inner.live("BucketPipeline")?.forget(&keys))
    }

    /// Stops the thread (after finishing what is in flight, within the communicator's timeout).
    fn close(&mut self, py: Python<'_>) {
        self.inner.close(py);
    }
}

fn init_logging() {
    // `CFC_LOG=debug` (any tracing-subscriber filter) turns on cfc's own log lines on stderr.
    if let Ok(filter) = std::env::var("CFC_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .try_init();
    }
}

/// The native core of cfc.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("FORMAT_VERSION", cfc::format::VERSION)?;
    m.add("CfcError", m.py().get_type::<CfcError>())?;
    m.add("FormatError", m.py().get_type::<FormatError>())?;
    m.add_function(wrap_pyfunction!(compress, m)?)?;
    m.add_function(wrap_pyfunction!(compress_lossless, m)?)?;
    m.add_function(wrap_pyfunction!(zstd_compress, m)?)?;
    m.add_function(wrap_pyfunction!(decompress, m)?)?;
    m.add_function(wrap_pyfunction!(frame_info, m)?)?;
    m.add_function(wrap_pyfunction!(validate, m)?)?;
    m.add_function(wrap_pyfunction!(sum_frames, m)?)?;
    m.add_function(wrap_pyfunction!(fixed_rate_size, m)?)?;
    m.add_function(wrap_pyfunction!(allreduce, m)?)?;
    m.add_function(wrap_pyfunction!(allreduce_refuse, m)?)?;
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
    m.add_function(wrap_pyfunction!(cuda_copy_rows, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_sum_squares, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_running_max_abs, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_version, m)?)?;
    m.add_class::<NcclAllReducer>()?;
    m.add_class::<BucketExchange>()?;
    m.add_class::<BucketPipeline>()?;
    m.add("CUDA_SUM_STEPS_DIFFER", cfc::cuda::SUM_STEPS_DIFFER)?;
    m.add("CUDA_SUM_OVERFLOW", cfc::cuda::SUM_OVERFLOW)?;
    m.add("CUDA_SUM_BAD_FRAME", cfc::cuda::SUM_BAD_FRAME)?;
    m.add("CUDA_SUM_EPS_OVERFLOW", cfc::cuda::SUM_EPS_OVERFLOW)?;
    m.add("CUDA_DECODE_BAD_FRAME", cfc::cuda::DECODE_BAD_FRAME)?;
    m.add("CUDA_FRAME_SIZE_OFFSET", cfc::cuda::FRAME_SIZE_OFFSET)?;
    m.add("CUDA_BOUND_ERROR_OFFSET", cfc::cuda::BOUND_ERROR_OFFSET)?;
    m.add(
        "CUDA_SUM_SQUARES_WORKSPACE",
        cfc::cuda::SUM_SQUARES_WORKSPACE,
    )?;
    Ok(())
}
