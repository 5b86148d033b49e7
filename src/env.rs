//! The environment variables cfc reads: each is named and read here and nowhere else (the
//! Python package reads them through `cfc._native`), and the README's "Environment" section
//! lists them for users. A malformed value is an error of what uses it, with the variable's
//! name, never silently ignored.

use crate::engine::options::timeout_from_seconds;
use crate::error::{Error, Result};
use std::net::IpAddr;
use std::time::Duration;

/// Seconds any wait for a peer lasts where no `timeout=` says otherwise (default 300).
pub const TIMEOUT: &str = "CFC_TIMEOUT";
/// The IP address the engine's links listen on (default: loopback on one host, else the
/// interface that reaches `MASTER_ADDR`).
pub const LINK_ADDR: &str = "CFC_LINK_ADDR";
/// This rank's node for the two-level exchange (default: its host name): nodes emulated on
/// one host.
pub const NODE: &str = "CFC_NODE";
/// The NCCL library to load (default: `libnccl.so.2`, then `libnccl.so`).
pub const NCCL_LIBRARY: &str = "CFC_NCCL_LIBRARY";
/// `1`: NCCL's calls block (default: non-blocking, so that waits for peers can time out).
pub const NCCL_BLOCKING: &str = "CFC_NCCL_BLOCKING";
/// An NCCL unique id in hex, for processes that join a communicator without cfc's engine
/// (`cfc-bench`, the NCCL tests).
pub const NCCL_ID: &str = "CFC_NCCL_ID";
/// A directory holding CUDA's headers for compiling the kernels (before `CUDA_HOME`,
/// `CUDA_PATH` and the usual paths).
pub const CUDA_INCLUDE: &str = "CFC_CUDA_INCLUDE";
/// `1`: the CPU backend checks the ordering of its two lanes (always on in tests).
pub const CHECK_LANES: &str = "CFC_CHECK_LANES";
/// A `tracing` filter (e.g. `debug`) for cfc's own log lines on stderr, in the Python package.
pub const LOG: &str = "CFC_LOG";

/// The variable's value where it is set and not empty.
fn value(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// `CFC_TIMEOUT`, checked (0.1 s to 30 days), or `None` where it is not set.
///
/// # Errors
/// [`Error::Transport`] naming the variable, for a value that is not a number of seconds in
/// that range.
pub fn timeout() -> Result<Option<Duration>> {
    let Some(v) = value(TIMEOUT) else {
        return Ok(None);
    };
    let seconds: f64 = v
        .trim()
        .parse()
        .map_err(|_| Error::Transport(format!("{TIMEOUT} must be seconds, got {v:?}")))?;
    timeout_from_seconds(seconds)
        .map(Some)
        .map_err(|e| Error::Transport(format!("{TIMEOUT}: {e}")))
}

/// `CFC_LINK_ADDR`, or `None` where it is not set.
///
/// # Errors
/// [`Error::Transport`] for a value that is not an IP address.
pub fn link_addr() -> Result<Option<IpAddr>> {
    value(LINK_ADDR)
        .map(|a| {
            a.trim()
                .parse()
                .map_err(|_| Error::Transport(format!("{LINK_ADDR}={a} is not an IP address")))
        })
        .transpose()
}

/// `CFC_NODE`, or `None`.
pub fn node() -> Option<String> {
    value(NODE)
}

/// `CFC_NCCL_LIBRARY`, or `None`.
pub fn nccl_library() -> Option<String> {
    value(NCCL_LIBRARY)
}

/// Whether `CFC_NCCL_BLOCKING` is `1`.
pub fn nccl_blocking() -> bool {
    value(NCCL_BLOCKING).is_some_and(|v| v == "1")
}

/// `CFC_NCCL_ID`, or `None`.
pub fn nccl_id() -> Option<String> {
    value(NCCL_ID)
}

/// `CFC_CUDA_INCLUDE`, or `None`.
pub fn cuda_include() -> Option<String> {
    value(CUDA_INCLUDE)
}

/// Whether `CFC_CHECK_LANES` is `1`.
pub fn check_lanes() -> bool {
    value(CHECK_LANES).is_some_and(|v| v == "1")
}

/// `CFC_LOG`, or `None`.
pub fn log_filter() -> Option<String> {
    value(LOG)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (One test, so that no other test of this module sees the variable half set.)
    #[test]
    fn a_malformed_timeout_is_an_error_that_names_the_variable() {
        let name = TIMEOUT;
        std::env::set_var(name, "soon");
        let e = timeout().unwrap_err().to_string();
        assert!(e.contains("CFC_TIMEOUT must be seconds"), "{e}");
        std::env::set_var(name, "1e9");
        assert!(timeout().unwrap_err().to_string().contains("CFC_TIMEOUT"));
        std::env::set_var(name, " 2.5 ");
        assert_eq!(timeout().unwrap(), Some(Duration::from_millis(2500)));
        std::env::set_var(name, "");
        assert_eq!(timeout().unwrap(), None);
        std::env::remove_var(name);
        assert_eq!(timeout().unwrap(), None);
    }
}
