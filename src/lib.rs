//! cfc: error-bounded and lossless compression of float tensors.
//!
//! The core crate has no Python in it. [`compress`] turns a float32, bfloat16 or float16
//! tensor into a self-describing frame (see `docs/FORMAT.md`) in which every finite element
//! is reconstructed within a strict bound; [`decompress`] reverses it and treats its input as
//! hostile. [`Codes`] exposes the integer codes of a frame so that frames quantized with the
//! same step can be summed exactly, the basis of cfc's compressed all-reduce.
//!
//! ```
//! use cfc::{compress, decompress, Bound, CompressOptions};
//! let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.01).sin()).collect();
//! let frame = compress(&x, &[1000], &CompressOptions::new(Bound::Abs(1e-3)))?;
//! let (header, y) = decompress::<f32>(&frame)?;
//! assert!(x.iter().zip(&y).all(|(a, b)| (*a as f64 - *b as f64).abs() <= header.eps));
//! assert!(frame.len() < 4000 / 2); // 1340 bytes: 10-bit codes for 1000 values, header, widths
//! # Ok::<(), cfc::Error>(())
//! ```

mod codec;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod engine;
pub mod env;
mod error;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod kernels;
#[cfg(feature = "cuda")]
pub mod nccl;

// The codec's modules, at the crate's root as well: `cfc::format` and `cfc::lossless` are part
// of the API, and the rest of the crate names them from there.
pub use codec::bounded::{MAX_EPS, MIN_EPS};
use codec::{bitplane, element, feedback, sum};
pub use codec::{format, lossless, scales};

pub use bitplane::{unzigzag, zigzag};
pub use codec::{
    compress, compress_bytes, compress_scaled, decompress, decompress_into_bytes, fixed_rate_size,
    validate, Bound, CompressOptions, OpenFrame,
};
pub use element::Element;
pub use error::{decode_status_error, Error, FormatError, Result};
pub use feedback::{
    compress_bytes_with_feedback, compress_with_feedback, compress_with_feedback_scaled,
};
pub use format::{read_header, BoundMode, Codec, Coder, DType, Header};
pub use lossless::{compress_lossless_bytes, LosslessOptions};
pub use sum::{sum_frames, Codes};
