//! The codec on the CPU, the reference every other backend matches bit for bit.
//!
//! Layers, each using only those above it:
//! - [`format`]: the frame (header, lengths, writing a frame with its optional zstd stage);
//! - `element`, `bitplane`, `parallel`: element types, bit planes, the split over threads;
//! - `bounded`: the error-bounded codec (compression, and the decoding of its codes);
//!   [`lossless`]: the lossless codec;
//! - `frame`: reading a frame of any codec, checked whole before anything is decoded;
//! - `rice`: the Rice-coded body (codec 3), blocks of 1024 codes; [`scales`]: block scales;
//! - `sum`: summable codes (frames added as integers); `feedback`: error feedback.

pub(crate) mod bitplane;
pub(crate) mod bounded;
pub(crate) mod element;
pub(crate) mod feedback;
pub mod format;
pub(crate) mod frame;
pub mod lossless;
pub(crate) mod parallel;
pub(crate) mod rice;
pub mod scales;
pub(crate) mod sum;

#[cfg_attr(not(feature = "cuda"), allow(unused_imports))]
pub(crate) use bounded::{check_abs_bound, check_bits, check_rel};
pub use bounded::{
    compress, compress_bytes, compress_scaled, fixed_rate_size, Bound, CompressOptions,
};
pub(crate) use element::elements;
pub use frame::{decompress, decompress_into_bytes, validate, OpenFrame};
