//! `cfc._native`: the Python binding of the cfc core.
//!
//! No logic lives here: arguments are converted and checked, the GIL is released around the
//! work, and errors are mapped to Python exceptions in `error.rs`. The Python package
//! `torch_hook/cfc` builds the user-facing API on top. One file per role: the codec on host
//! memory (`codec.rs`), the CUDA codec (`cuda.rs`), the engine (`engine.rs`).
//!
//! No function takes a memory address as a number: the CUDA codec (`cuda.rs`) and the engine
//! (`engine.rs`) take torch tensors and streams, the host codec (`codec.rs`) numpy arrays
//! (through `__array_interface__`: the buffer protocol is not part of the stable ABI before
//! Python 3.11, and the wheel is abi3 for 3.9+), all read and checked in one place
//! (`tensor.rs`). The engine's caller keeps its tensors alive until the engine is done with
//! them (`cfc._engine`). This module never imports torch.

use pyo3::prelude::*;

mod codec;
mod cuda;
mod engine;
mod engine_state;
mod error;
mod tensor;
use error::{CfcError, FormatError};

fn init_logging() {
    // `CFC_LOG=debug` (any tracing-subscriber filter) turns on cfc's own log lines on stderr.
    if let Some(filter) = cfc::env::log_filter() {
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
    m.add("CfcError", m.py().get_type::<CfcError>())?;
    m.add("FormatError", m.py().get_type::<FormatError>())?;
    codec::register(m)?;
    cuda::register(m)?;
    engine::register(m)?;
    Ok(())
}
