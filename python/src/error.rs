//! The one place where `cfc::Error` becomes a Python exception.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyMemoryError, PyTypeError, PyValueError};
use pyo3::PyErr;

create_exception!(
    cfc,
    CfcError,
    PyException,
    "Base class of cfc's own errors: malformed buffers (FormatError), CUDA, NCCL, disagreeing ranks, a failed peer. A bad argument (bound, shape, dtype) raises ValueError or TypeError instead; an allocation, MemoryError."
);
create_exception!(
    cfc,
    FormatError,
    CfcError,
    "A compressed buffer is malformed: truncated, corrupted, crafted or from a newer cfc."
);

/// Maps a core error to the Python exception callers are expected to catch.
pub fn to_py(e: cfc::Error) -> PyErr {
    let msg = e.to_string();
    match e {
        cfc::Error::Format(_) => FormatError::new_err(msg),
        cfc::Error::InvalidBound { .. }
        | cfc::Error::ShapeMismatch { .. }
        | cfc::Error::MisalignedInput { .. }
        | cfc::Error::InvalidBool { .. }
        | cfc::Error::OutputSize { .. } => PyValueError::new_err(msg),
        cfc::Error::Incompatible { what: "dtype", .. } | cfc::Error::NotQuantizable(_) => {
            PyTypeError::new_err(msg)
        }
        cfc::Error::Allocation { .. } => PyMemoryError::new_err(msg),
        _ => CfcError::new_err(msg),
    }
}
