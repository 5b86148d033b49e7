//! `cfc._native`: the Python binding of the cfc core.
//!
//! No logic lives here: arguments are converted and checked, the GIL is released around the
//! work, and errors are mapped to Python exceptions in `error.rs`. The Python package
//! `torch_hook/cfc` builds the user-facing API on top.

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

mod error;
use error::{to_py, CfcError, FormatError};

/// A C-contiguous, byte-formatted view of a Python buffer.
fn bytes_of<'a>(buf: &'a PyBuffer<u8>, what: &str) -> PyResult<&'a [u8]> {
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{what} must be C-contiguous"
        )));
    }
    if buf.len_bytes() == 0 {
        return Ok(&[]);
    }
    // SAFETY: the buffer is C-contiguous with `len_bytes()` bytes starting at `buf_ptr()`, and
    // `buf` (which keeps the exporter's memory alive and pinned) outlives the returned slice.
    Ok(unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, buf.len_bytes()) })
}

fn dtype_of(name: &str) -> PyResult<cfc::DType> {
    cfc::DType::from_name(name).ok_or_else(|| {
        PyTypeError::new_err(format!(
            "unsupported dtype {name:?}: cfc compresses float32, bfloat16 and float16"
        ))
    })
}

fn bound_of(eps: Option<f64>, rel: Option<f64>, bits: Option<i64>) -> PyResult<cfc::Bound> {
    match (eps, rel, bits) {
        (Some(e), None, None) => Ok(cfc::Bound::Abs(e)),
        (None, Some(r), None) => Ok(cfc::Bound::Rel(r)),
        (None, None, Some(b)) => u8::try_from(b).map(cfc::Bound::Bits).map_err(|_| {
            PyValueError::new_err(format!("invalid bits: {b} is not between 2 and 32"))
        }),
        _ => Err(PyValueError::new_err(
            "give exactly one of eps=, rel= or bits=",
        )),
    }
}

/// Compresses raw little-endian element bytes into a cfc frame.
///
/// Args:
///     data: a C-contiguous buffer of bytes (format 'B') holding the elements.
///     dtype: "float32", "bfloat16" or "float16".
///     shape: the tensor's dimensions (their product is the element count).
///     eps, rel, bits: exactly one of them sets the error bound.
///     zstd_level: if given, run the body through zstd at this level.
///     threads: threads to use, 0 for automatic.
///
/// Returns:
///     bytes: the frame.
#[pyfunction]
#[pyo3(signature = (data, dtype, shape, *, eps=None, rel=None, bits=None, zstd_level=None, threads=0))]
#[allow(clippy::too_many_arguments)]
fn compress<'py>(
    py: Python<'py>,
    data: PyBuffer<u8>,
    dtype: &str,
    shape: Vec<usize>,
    eps: Option<f64>,
    rel: Option<f64>,
    bits: Option<i64>,
    zstd_level: Option<i32>,
    threads: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let dtype = dtype_of(dtype)?;
    let opts = cfc::CompressOptions {
        bound: bound_of(eps, rel, bits)?,
        zstd_level,
        threads,
    };
    let input = bytes_of(&data, "data")?;
    let frame = py
        .detach(|| cfc::compress_bytes(input, dtype, &shape, &opts))
        .map_err(to_py)?;
    Ok(PyBytes::new(py, &frame))
}

/// Decompresses a frame into a writable, C-contiguous byte buffer of exactly the decoded size.
///
/// Args:
///     frame: the compressed buffer.
///     out: writable bytes (format 'B') receiving the elements.
///     threads: threads to use, 0 for automatic.
#[pyfunction]
#[pyo3(signature = (frame, out, *, threads=0))]
fn decompress_into(
    py: Python<'_>,
    frame: PyBuffer<u8>,
    out: PyBuffer<u8>,
    threads: usize,
) -> PyResult<()> {
    if out.readonly() {
        return Err(PyValueError::new_err("out must be writable"));
    }
    let input = bytes_of(&frame, "frame")?;
    let target = bytes_of(&out, "out")?;
    let (ptr, len) = (target.as_ptr() as usize, target.len());
    py.detach(|| {
        // SAFETY: `out` is a writable, C-contiguous buffer of `len` bytes kept alive by `out`
        // for the whole call; the frame's bytes live in a different Python object.
        let dst = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
        cfc::decompress_into_bytes(input, dst, threads)
    })
    .map_err(to_py)?;
    Ok(())
}

/// Reads a frame's header.
///
/// Returns:
///     dict: dtype, shape, numel, eps, step, mode, bits, codec, zstd, exceptions, nbytes,
///     decoded_nbytes, version.
#[pyfunction]
fn frame_info<'py>(py: Python<'py>, frame: PyBuffer<u8>) -> PyResult<Bound<'py, PyDict>> {
    let input = bytes_of(&frame, "frame")?;
    let h = cfc::read_header(input).map_err(to_py)?;
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
        },
    )?;
    d.set_item("zstd", h.zstd)?;
    d.set_item("exceptions", h.n_exceptions)?;
    d.set_item("nbytes", input.len())?;
    d.set_item("decoded_nbytes", h.decoded_len())?;
    d.set_item("version", cfc::format::VERSION)?;
    Ok(d)
}

/// Checks a whole frame (header, body, widths, exception indices) without decoding it.
#[pyfunction]
fn validate(py: Python<'_>, frame: PyBuffer<u8>) -> PyResult<()> {
    let input = bytes_of(&frame, "frame")?;
    py.detach(|| cfc::validate(input)).map_err(to_py)?;
    Ok(())
}

/// Sums frames quantized with the same step into one frame, adding their codes exactly.
#[pyfunction]
#[pyo3(signature = (frames, *, zstd_level=None))]
fn sum_frames<'py>(
    py: Python<'py>,
    frames: Vec<PyBuffer<u8>>,
    zstd_level: Option<i32>,
) -> PyResult<Bound<'py, PyBytes>> {
    let slices = frames
        .iter()
        .map(|f| bytes_of(f, "frame"))
        .collect::<PyResult<Vec<_>>>()?;
    let out = py
        .detach(|| cfc::sum_frames(&slices, zstd_level))
        .map_err(to_py)?;
    Ok(PyBytes::new(py, &out))
}

/// Exact size of a fixed-rate frame of finite data with this shape and width.
#[pyfunction]
fn fixed_rate_size(shape: Vec<usize>, bits: u8) -> PyResult<u64> {
    cfc::fixed_rate_size(&shape, bits).ok_or_else(|| PyValueError::new_err("shape too large"))
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
    m.add_function(wrap_pyfunction!(decompress_into, m)?)?;
    m.add_function(wrap_pyfunction!(frame_info, m)?)?;
    m.add_function(wrap_pyfunction!(validate, m)?)?;
    m.add_function(wrap_pyfunction!(sum_frames, m)?)?;
    m.add_function(wrap_pyfunction!(fixed_rate_size, m)?)?;
    Ok(())
}
