//! The codec functions of `cfc._native`: host memory in, frames out, and back.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};

use crate::error::{to_py, CfcError};

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

pub(crate) fn dtype_of(name: &str) -> PyResult<cfc::DType> {
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

pub(crate) fn bound_of(
    eps: Option<f64>,
    rel: Option<f64>,
    bits: Option<i64>,
) -> PyResult<cfc::Bound> {
    block_bound_of(eps, rel, bits, None, None)
}

/// The bound of `cfc.compress`: one of `eps=`, `rel=`, `bits=` or `rms=` (block scales, with
/// `block=` elements per block, a power of two).
pub(crate) fn block_bound_of(
    eps: Option<f64>,
    rel: Option<f64>,
    bits: Option<i64>,
    rms: Option<f64>,
    block: Option<u64>,
) -> PyResult<cfc::Bound> {
    if block.is_some() && rms.is_none() {
        return Err(PyValueError::new_err("block= goes with rms="));
    }
    match (eps, rel, bits, rms) {
        (Some(e), None, None, None) => Ok(cfc::Bound::Abs(e)),
        (None, Some(r), None, None) => Ok(cfc::Bound::Rel(r)),
        (None, None, Some(b), None) => bits_of(b).map(cfc::Bound::Bits),
        (None, None, None, Some(k)) => Ok(cfc::Bound::Rms {
            k,
            block_log2: block_log2_of(block.unwrap_or(DEFAULT_BLOCK))?,
        }),
        _ => Err(PyValueError::new_err(
            "give exactly one of eps=, rel=, bits= or rms=",
        )),
    }
}

/// Elements per block of `rms=` when `block=` is not given.
const DEFAULT_BLOCK: u64 = 256;

/// `log2` of a block size: a power of two from 32 to 2^24.
pub(crate) fn block_log2_of(block: u64) -> PyResult<u8> {
    let lo = 1u64 << cfc::scales::MIN_BLOCK_LOG2;
    let hi = 1u64 << cfc::scales::MAX_BLOCK_LOG2;
    if block.is_power_of_two() && (lo..=hi).contains(&block) {
        Ok(block.trailing_zeros() as u8)
    } else {
        Err(PyValueError::new_err(format!(
            "block must be a power of two from {lo} to {hi}, not {block}"
        )))
    }
}

/// Compresses raw little-endian element bytes into a cfc frame.
///
/// Args:
///     data_ptr: address of the elements (contiguous host memory, kept alive by the caller).
///     nbytes: their size in bytes.
///     dtype: "float32", "bfloat16" or "float16".
///     shape: the tensor's dimensions (their product is the element count).
///     eps, rel, bits, rms: exactly one of them sets the error bound (rms: each block's bound
///         is this fraction of its RMS, rounded down to a power of two).
///     block: elements per block of rms= (a power of two, 32 to 2^24; default 256).
///     zstd_level: if given, run the body through zstd at this level.
///     threads: threads to use, 0 for automatic.
///     coder: "planes" (bit planes) or "rice" (Rice codes, fewer bytes).
///     residual_ptr, residual_nbytes: error feedback: contiguous, 4-byte aligned float32 host
///         memory, one value per element, kept alive by the caller and updated in place
///         (0, 0 for none).
///
/// Returns:
///     bytes: the frame.
#[pyfunction]
#[pyo3(signature = (data_ptr, nbytes, dtype, shape, *, eps=None, rel=None, bits=None, rms=None, block=None, zstd_level=None, threads=0, coder="planes", residual_ptr=0, residual_nbytes=0))]
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
    rms: Option<f64>,
    block: Option<u64>,
    zstd_level: Option<i32>,
    threads: usize,
    coder: &str,
    residual_ptr: usize,
    residual_nbytes: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let dtype = dtype_of(dtype)?;
    let coder = cfc::Coder::from_name(coder).ok_or_else(|| {
        PyValueError::new_err(format!(
            "coder must be \"planes\" or \"rice\", not {coder:?}"
        ))
    })?;
    let opts = cfc::CompressOptions {
        bound: block_bound_of(eps, rel, bits, rms, block)?,
        zstd_level,
        threads,
        coder,
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
///     dict: dtype, shape, numel, eps, step, mode, bits, block (elements per block of a frame
///     with block scales, else 0), codec, zstd, exceptions, nbytes, decoded_nbytes, version.
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
        "block",
        if h.block_log2 == 0 {
            0
        } else {
            1u64 << h.block_log2
        },
    )?;
    d.set_item(
        "codec",
        match h.codec {
            cfc::Codec::Quantized => "quantized",
            cfc::Codec::Raw => "raw",
            cfc::Codec::Lossless => "lossless",
            cfc::Codec::Rice => "rice",
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

/// Adds the codec's functions to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(compress, m)?)?;
    m.add_function(wrap_pyfunction!(compress_lossless, m)?)?;
    m.add_function(wrap_pyfunction!(zstd_compress, m)?)?;
    m.add_function(wrap_pyfunction!(decompress, m)?)?;
    m.add_function(wrap_pyfunction!(frame_info, m)?)?;
    m.add_function(wrap_pyfunction!(validate, m)?)?;
    m.add_function(wrap_pyfunction!(sum_frames, m)?)?;
    m.add_function(wrap_pyfunction!(fixed_rate_size, m)?)?;
    m.add("FORMAT_VERSION", cfc::format::VERSION)?;
    Ok(())
}
