//! The codec on CUDA devices: launches of the `kernels/` sources on a caller's stream, over
//! caller-owned device memory (typically PyTorch's), with no host synchronization.
//!
//! Libraries are loaded at run time (cudarc's dynamic loading): this module builds anywhere and
//! reports a missing driver or NVRTC as [`Error::CudaUnavailable`], never a panic. Kernels are
//! compiled by NVRTC at first use to a CUBIN for the device's own compute capability and
//! cached per (device, family).
//!
//! Device memory is never allocated here: the caller passes the output and a workspace of the
//! sizes that [`compress_capacity`] and [`workspace_len`] give (PyTorch's caching allocator
//! provides them in the Python package), and nothing is freed.
//!
//! Files: `devices` (driver, contexts, compilation), `launches`, `layout` (sizes), one file per
//! operation family (`codec`, `rice`, `lossless`, `sum`, `copy`, `scales`), `memory` (device
//! buffers the engine owns).

use crate::error::{Error, Result};
use crate::format::{groups_for, index_size_for, BoundMode, DType, FIXED_HEADER_LEN, MAX_NDIM};
use crate::kernels::{kernel_name, signature, Family, Ty};
use crate::Bound;
use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

mod codec;
mod copy;
mod devices;
mod launches;
mod layout;
mod lossless;
pub(crate) mod memory;
mod rice;
mod scales;
mod sum;
#[cfg(test)]
mod tests;

pub use codec::*;
pub use copy::*;
pub use devices::*;
use launches::*;
pub use layout::*;
pub use lossless::*;
pub use rice::*;
pub use scales::*;
pub use sum::*;
