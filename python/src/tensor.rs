//! Tensors and streams as the binding's CUDA codec and engine take them: torch's objects (or
//! any object with their methods), read and checked here, once, so that neither takes a memory
//! address or stream handle as a number. Nothing here imports torch: a tensor is read through
//! `data_ptr()`, `numel()`, `element_size()`, `is_contiguous()`, `dtype` and `device`, a stream
//! through `cuda_stream` and `device`.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::codec::dtype_of;

/// Where memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    Host,
    Cuda(usize),
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Place::Host => write!(f, "cpu"),
            Place::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// The place of a `torch.device`.
fn place_of(device: &Bound<'_, PyAny>, what: &str) -> PyResult<Place> {
    let kind: String = device.getattr("type")?.extract()?;
    match kind.as_str() {
        "cpu" => Ok(Place::Host),
        "cuda" => {
            let index: Option<usize> = device.getattr("index")?.extract()?;
            Ok(Place::Cuda(index.unwrap_or(0)))
        }
        other => Err(PyValueError::new_err(format!(
            "{what} is on a {other} device; cfc's engine takes cpu and cuda tensors"
        ))),
    }
}

/// The name of `obj`'s type, for errors.
fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".to_string(), |n| n.to_string())
}

/// A contiguous tensor's memory.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Memory {
    pub addr: u64,
    pub numel: u64,
    pub bytes: u64,
    pub dtype: cfc::DType,
}

/// The contiguous tensor `obj`, which must be on CUDA device `device`; `what` names it in
/// errors.
///
/// # Errors
/// As [`at`].
pub(crate) fn on_device(obj: &Bound<'_, PyAny>, device: usize, what: &str) -> PyResult<Memory> {
    at(obj, Place::Cuda(device), what)
}

/// The contiguous tensor `obj`, which must be at `place`; `what` names it in errors.
///
/// # Errors
/// `TypeError` for an object that is not a tensor or of a dtype cfc does not know; `ValueError`
/// for a tensor that is not contiguous, elsewhere, with a null `data_ptr`, or whose element
/// size is not its dtype's.
pub(crate) fn at(obj: &Bound<'_, PyAny>, place: Place, what: &str) -> PyResult<Memory> {
    let not_a_tensor =
        |_| PyTypeError::new_err(format!("{what} must be a tensor, got {}", type_name(obj)));
    let contiguous: bool = obj
        .call_method0("is_contiguous")
        .map_err(not_a_tensor)?
        .extract()?;
    if !contiguous {
        return Err(PyValueError::new_err(format!("{what} must be contiguous")));
    }
    let at = place_of(&obj.getattr("device").map_err(not_a_tensor)?, what)?;
    if at != place {
        return Err(PyValueError::new_err(format!(
            "{what} is on {at}; it must be on {place}"
        )));
    }
    let name = obj.getattr("dtype")?.str()?.to_string();
    let dtype = dtype_of(name.trim_start_matches("torch."))?;
    let size: usize = obj.call_method0("element_size")?.extract()?;
    if size != dtype.size() {
        return Err(PyValueError::new_err(format!(
            "{what}: {size}-byte elements for a {name} tensor"
        )));
    }
    let addr: u64 = obj.call_method0("data_ptr")?.extract()?;
    let numel: u64 = obj.call_method0("numel")?.extract()?;
    if addr == 0 && numel > 0 {
        return Err(PyValueError::new_err(format!(
            "{what}: a null data_ptr for {numel} elements"
        )));
    }
    Ok(Memory {
        addr,
        numel,
        bytes: numel * size as u64,
        dtype,
    })
}

/// The stream an engine at `place` orders its results on, as the core takes it: a CUDA engine
/// takes a `torch.cuda.Stream` of its device, a host engine none (0 for the core).
///
/// # Errors
/// `ValueError` for a stream given to a host engine, none given to a CUDA engine, or a stream
/// of another device; `TypeError` for an object that is not a CUDA stream.
pub(crate) fn stream_at(obj: Option<&Bound<'_, PyAny>>, place: Place) -> PyResult<u64> {
    match (obj, place) {
        (None, Place::Host) => Ok(0),
        (Some(_), Place::Host) => Err(PyValueError::new_err(
            "a CUDA stream for an engine on the cpu: give None",
        )),
        (None, Place::Cuda(i)) => Err(PyValueError::new_err(format!(
            "this engine runs on cuda:{i}: give the stream its results are ordered on"
        ))),
        (Some(s), Place::Cuda(i)) => match cuda_stream(s)? {
            (d, raw) if d == i => Ok(raw),
            (d, _) => Err(PyValueError::new_err(format!(
                "the stream is of cuda:{d}, this engine's device is cuda:{i}"
            ))),
        },
    }
}

/// The CUDA stream `obj` (a `torch.cuda.Stream`): its device and its `CUstream`.
///
/// # Errors
/// `TypeError` for an object that is not a CUDA stream.
pub(crate) fn cuda_stream(obj: &Bound<'_, PyAny>) -> PyResult<(usize, u64)> {
    let raw = obj.getattr("cuda_stream").map_err(|_| {
        PyTypeError::new_err("stream must be a torch.cuda.Stream (it has no cuda_stream)")
    })?;
    match place_of(&obj.getattr("device")?, "the stream")? {
        Place::Cuda(i) => Ok((i, raw.extract()?)),
        Place::Host => Err(PyTypeError::new_err("stream must be a torch.cuda.Stream")),
    }
}

/// A contiguous host array, as the host codec takes it: read from its `__array_interface__`
/// (numpy's protocol; the buffer protocol is not part of the stable ABI before Python 3.11, and
/// the wheel is abi3 for 3.9+).
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostArray {
    addr: usize,
    len: usize,
    read_only: bool,
}

/// The contiguous host array `obj` (a numpy array, or anything with `__array_interface__`);
/// `what` names it in errors.
///
/// # Errors
/// `TypeError` for an object without the interface; `ValueError` for one that is not
/// C-contiguous, whose size overflows, or with a null address and elements.
pub(crate) fn host_array(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<HostArray> {
    let iface = obj.getattr("__array_interface__").map_err(|_| {
        PyTypeError::new_err(format!(
            "{what} must be a numpy array, got {}",
            type_name(obj)
        ))
    })?;
    let (addr, read_only): (usize, bool) = iface.get_item("data")?.extract()?;
    let shape: Vec<usize> = iface.get_item("shape")?.extract()?;
    let typestr: String = iface.get_item("typestr")?.extract()?;
    let strides = iface.call_method1("get", ("strides",))?;
    if !strides.is_none() {
        return Err(PyValueError::new_err(format!(
            "{what} must be C-contiguous"
        )));
    }
    let item: usize = typestr
        .get(2..)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| PyValueError::new_err(format!("{what}: an array of type {typestr:?}")))?;
    let len = shape
        .iter()
        .try_fold(item, |a, &d| a.checked_mul(d))
        .ok_or_else(|| PyValueError::new_err(format!("{what}: a size that overflows")))?;
    if addr == 0 && len > 0 {
        return Err(PyValueError::new_err(format!(
            "{what}: a null address for {len} bytes"
        )));
    }
    Ok(HostArray {
        addr,
        len,
        read_only,
    })
}

impl HostArray {
    /// Whether its bytes and `other`'s overlap.
    pub(crate) fn overlaps(&self, other: &HostArray) -> bool {
        self.len > 0
            && other.len > 0
            && self.addr < other.addr + other.len
            && other.addr < self.addr + self.len
    }

    /// Its bytes.
    ///
    /// # Safety
    /// The array must stay alive and keep its memory while the slice is used (the binding's
    /// functions hold a reference to it for the call, and a numpy array with references cannot
    /// be resized).
    pub(crate) unsafe fn bytes<'a>(&self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: non-null (checked at reading) and `len` bytes long; alive by the contract.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    /// Its bytes, to write; `what` names it in errors.
    ///
    /// # Safety
    /// As [`HostArray::bytes`], and no other slice of its memory may be in use meanwhile.
    ///
    /// # Errors
    /// `ValueError` for a read-only array.
    pub(crate) unsafe fn bytes_mut<'a>(&self, what: &str) -> PyResult<&'a mut [u8]> {
        if self.read_only {
            return Err(PyValueError::new_err(format!("{what} is read-only")));
        }
        if self.len == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as `bytes`, and exclusive by the contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) })
    }
}
