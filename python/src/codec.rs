//! The codec functions of `cfc._native`: host memory in, frames out, and back.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};

use crate::error::{to_py, CfcError};
use crate::tensor::host_array;

// Host memory crosses as numpy arrays, read and checked in one place (`tensor::host_array`).

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
///     data: the elements' bytes (a C-contiguous numpy array).
///     dtype: "float32", "bfloat16" or "float16".
///     shape: the tensor's dimensions (their product is the element count).
///     eps, rel, bits, rms: exactly one of them sets the error bound (rms: each block's bound
///         is this fraction of its RMS, rounded down to a power of two).
///     block: elements per block of rms= (a power of two, 32 to 2^24; default 256).
///     zstd_level: if given, run the body through zstd at this level.
///     threads: threads to use, 0 for automatic.
///     coder: "planes" (bit planes) or "rice" (Rice codes, fewer bytes).
///     residual: error feedback: a writable C-contiguous numpy array of float32 residuals (or
///         their bytes), one per element, 4-byte aligned, apart from `data`, updated in place;
///         None for none.
///
/// Returns:
///     bytes: the frame.
#[pyfunction]
#[pyo3(signature = (data, dtype, shape, *, eps=None, rel=None, bits=None, rms=None, block=None, zstd_level=None, threads=0, coder="planes", residual=None))]
#[allow(clippy::too_many_arguments)]
fn compress<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
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
    residual: Option<&Bound<'py, PyAny>>,
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
    let data = host_array(data, "data")?;
    let residual = residual
        .map(|r| host_array(r, "the residual"))
        .transpose()?;
    if residual.is_some_and(|r| r.overlaps(&data)) {
        return Err(PyValueError::new_err(
            "the residual overlaps the data: give it memory of its own",
        ));
    }
    // SAFETY: both arrays are referenced by this call's arguments until it returns (a numpy
    // array with references keeps its memory), and they do not overlap (checked above).
    let input = unsafe { data.bytes() };
    let residual = match residual {
        None => None,
        // SAFETY: as `input`; nothing else reads or writes the residual during the call.
        Some(r) => Some(unsafe { r.bytes_mut("the residual") }?),
    };
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
///     data: the elements' bytes (a C-contiguous numpy array).
///     dtype: "float32", "bfloat16", "float16", "float64", "uint8", "int8", "int16", "int32",
///         "int64" or "bool".
///     shape: the tensor's dimensions (their product is the element count).
///     zstd_level: if given, run the body through zstd at this level.
///     threads: threads to use, 0 for automatic.
///
/// Returns:
///     bytes: the frame.
#[pyfunction]
#[pyo3(signature = (data, dtype, shape, *, zstd_level=None, threads=0))]
fn compress_lossless<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
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
    let data = host_array(data, "data")?;
    // SAFETY: `data` is referenced by this call's argument until it returns.
    let input = unsafe { data.bytes() };
    let frame = py
        .detach(|| cfc::compress_lossless_bytes(input, dtype, &shape, &opts))
        .map_err(to_py)?;
    Ok(PyBytes::new(py, &frame))
}

/// Plain zstd of a host array's bytes (no cfc frame), for comparisons such as
/// `examples/compress_model.py`.
#[pyfunction]
#[pyo3(signature = (data, level=3))]
fn zstd_compress<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
    level: i32,
) -> PyResult<Bound<'py, PyBytes>> {
    let data = host_array(data, "data")?;
    // SAFETY: `data` is referenced by this call's argument until it returns.
    let input = unsafe { data.bytes() };
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
