//! Error feedback: compress `x + residual` and keep, in the residual, what the decoder will not
//! reproduce, so that over many steps nothing is lost.
//!
//! The rule (the CUDA codec applies the same one, in one fused pass, bit for bit):
//! 1. the compensated value `c = f32(x) + r` in f32 (round to nearest); a NaN residual counts
//!    as 0, and a non-finite `x` is sent as it is (`c = f32(x)`, `v = x`, bits untouched), so no
//!    arithmetic ever sees a NaN (CPUs and GPUs give NaN results different bits);
//! 2. `v = dtype(c)`, compressed as any tensor (so its frame's bound holds for `v`);
//! 3. `r' = c - f32(decoded v)` in f32, or 0 where `c` or the decoded value is not finite (an
//!    overflowing step is skipped by the optimizer; its NaN must not poison later steps).

use crate::codec::element::Element;
use crate::codec::format::DType;
use crate::codec::scales::BlockScales;
use crate::codec::{compress, compress_scaled, decompress, elements, CompressOptions};
use crate::error::{Error, Result};
use half::{bf16, f16};

/// Compresses `data + residual` and updates `residual` in place (see the module docs).
///
/// `residual` is float32 whatever the element type, so that the small amounts it carries are
/// not rounded away in bfloat16 or float16.
///
/// # Errors
/// As [`compress`], plus [`Error::ShapeMismatch`] when `residual` and `data` differ in length.
pub fn compress_with_feedback<T: Element>(
    data: &[T],
    residual: &mut [f32],
    shape: &[usize],
    opts: &CompressOptions,
) -> Result<Vec<u8>> {
    compress_with_feedback_scaled(data, residual, shape, opts, None)
}

/// [`compress_with_feedback`], with block scales given (see [`crate::compress_scaled`]).
///
/// # Errors
/// As [`compress_with_feedback`] and [`crate::compress_scaled`].
pub fn compress_with_feedback_scaled<T: Element>(
    data: &[T],
    residual: &mut [f32],
    shape: &[usize],
    opts: &CompressOptions,
    scales: Option<&BlockScales>,
) -> Result<Vec<u8>> {
    if residual.len() != data.len() {
        return Err(Error::ShapeMismatch {
            shape_elements: Some(residual.len() as u64),
            elements: data.len() as u64,
            ndim: 1,
        });
    }
    let (compensated, values): (Vec<f32>, Vec<T>) = data
        .iter()
        .zip(residual.iter())
        .map(|(&x, &r)| compensate(x, r))
        .unzip();
    let frame = match scales {
        Some(s) => compress_scaled(&values, shape, opts, s)?,
        None => compress(&values, shape, opts)?,
    };
    let (_, decoded) = decompress::<T>(&frame)?;
    for ((r, &c), d) in residual.iter_mut().zip(&compensated).zip(&decoded) {
        let d = d.to_f64() as f32;
        *r = if c.is_finite() && d.is_finite() {
            c - d
        } else {
            0.0
        };
    }
    Ok(frame)
}

/// [`compress_with_feedback`] over raw little-endian bytes of `dtype` (any alignment) and a
/// float32 residual given as bytes (4-byte aligned, updated in place).
///
/// # Errors
/// As [`compress_with_feedback`], plus [`Error::MisalignedInput`] for a residual that is not
/// whole, aligned float32 values.
pub fn compress_bytes_with_feedback(
    bytes: &[u8],
    dtype: DType,
    residual: &mut [u8],
    shape: &[usize],
    opts: &CompressOptions,
) -> Result<Vec<u8>> {
    let residual = residual_f32(residual)?;
    match dtype {
        DType::F32 => compress_with_feedback(&elements::<f32>(bytes)?, residual, shape, opts),
        DType::BF16 => compress_with_feedback(&elements::<bf16>(bytes)?, residual, shape, opts),
        DType::F16 => compress_with_feedback(&elements::<f16>(bytes)?, residual, shape, opts),
        other => Err(crate::Error::NotQuantizable(other)),
    }
}

/// A float32 residual given as bytes: whole, 4-byte aligned values, viewed in place.
pub(crate) fn residual_f32(bytes: &mut [u8]) -> Result<&mut [f32]> {
    let len = bytes.len();
    bytemuck::try_cast_slice_mut(bytes).map_err(|_| Error::MisalignedInput {
        len,
        element_size: 4,
    })
}

/// Step 1 of the rule: the compensated value `c` of `x` with residual `r`, and the value sent.
#[inline]
pub(crate) fn compensate<T: Element>(x: T, r: f32) -> (f32, T) {
    let xf = x.to_f64() as f32;
    if !x.is_finite() {
        (xf, x)
    } else {
        let c = if r.is_nan() { xf } else { xf + r };
        (c, T::from_f32(c))
    }
}
