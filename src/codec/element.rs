//! The element types cfc compresses, behind one trait so the codec is written once.

use crate::codec::format::DType;
use crate::error::{Error, Result};
use half::{bf16, f16};

/// A floating-point element type the codec handles.
///
/// The decoded value of a code is defined once, here, for every backend: the code times the
/// step in `f64`, rounded to `f32`, then rounded (to nearest, ties to even) to the element
/// type. The CUDA kernels mirror this exactly, so both produce the same values and bytes.
pub trait Element: Copy + Send + Sync + bytemuck::Pod + 'static {
    /// The dtype tag written in frames.
    const DTYPE: DType;
    /// Widens to `f64` (exact for all three types).
    fn to_f64(self) -> f64;
    /// Rounds an `f32` to this type, to nearest with ties to even.
    fn from_f32(v: f32) -> Self;
    /// Raw bits, zero-extended.
    fn to_bits32(self) -> u32;
    /// From raw bits (the low `8 * size` bits are used).
    fn from_bits32(b: u32) -> Self;
    /// Neither NaN nor infinite.
    fn is_finite(self) -> bool;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn to_bits32(self) -> u32 {
        self.to_bits()
    }
    #[inline(always)]
    fn from_bits32(b: u32) -> Self {
        f32::from_bits(b)
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        f32::is_finite(self)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    #[inline(always)]
    fn to_bits32(self) -> u32 {
        self.to_bits() as u32
    }
    #[inline(always)]
    fn from_bits32(b: u32) -> Self {
        bf16::from_bits(b as u16)
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        bf16::is_finite(self)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    #[inline(always)]
    fn to_bits32(self) -> u32 {
        self.to_bits() as u32
    }
    #[inline(always)]
    fn from_bits32(b: u32) -> Self {
        f16::from_bits(b as u16)
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        f16::is_finite(self)
    }
}

/// The value code `q` decodes to with quantization step `step` (see [`Element`]).
#[inline(always)]
pub(crate) fn dequantize<T: Element>(q: i64, step: f64) -> T {
    T::from_f32((q as f64 * step) as f32)
}

/// Raw little-endian bytes as elements of `T`: borrowed when aligned, copied otherwise.
pub(crate) fn elements<T: Element>(bytes: &[u8]) -> Result<std::borrow::Cow<'_, [T]>> {
    if bytes.len() % std::mem::size_of::<T>() != 0 {
        return Err(Error::MisalignedInput {
            len: bytes.len(),
            element_size: std::mem::size_of::<T>(),
        });
    }
    Ok(match bytemuck::try_cast_slice::<u8, T>(bytes) {
        Ok(data) => std::borrow::Cow::Borrowed(data),
        Err(_) => std::borrow::Cow::Owned(bytemuck::pod_collect_to_vec::<u8, T>(bytes)),
    })
}
