//! NCCL, loaded at run time, and its communicators.
//!
//! The library is opened by path: `CFC_NCCL_LIBRARY` when set (and then only that), else
//! `libnccl.so.2` and `libnccl.so` from the loader's search path. pip's NCCL
//! (`site-packages/nvidia/nccl/lib/libnccl.so.2`, the one PyTorch uses) ships only the `.so.2`
//! name, so point `CFC_NCCL_LIBRARY` at it or put its folder on `LD_LIBRARY_PATH`. A library
//! that is missing is an [`Error::NcclUnavailable`], never a panic, and is looked for again at
//! the next call.
//!
//! A [`Communicator`] joins the ranks that share one [`UniqueId`]: rank 0 makes it and hands it
//! to the others (threads of one process, as `cfc-bench --gpu` does; or through the environment,
//! [`UniqueId::from_env`]; or any channel the job already has, such as torch.distributed).
//! Every wait on a communicator's work polls the GPU and NCCL's asynchronous error: a peer that
//! is gone becomes an [`Error::Nccl`] after the communicator's timeout, and the communicator is
//! aborted, instead of a hang.
//!
//! The engine's NCCL transport (`crate::engine::transport::nccl`) drives a communicator of its
//! own; its waits also end at the first failure on the engine's failure board
//! ([`Communicator::set_interrupt`]).

use crate::cuda::driver_err;
use crate::error::{Error, Result};
use crate::DType;
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// `ncclComm_t`.
type RawComm = *mut c_void;
/// `ncclResult_t`.
type NcclResult = c_int;
const NCCL_SUCCESS: NcclResult = 0;
/// `ncclInProgress`: an operation of a non-blocking communicator is still running.
const NCCL_IN_PROGRESS: NcclResult = 7;
/// `ncclDataType_t` values.
const NCCL_UINT8: c_int = 1;
const NCCL_FLOAT16: c_int = 6;
const NCCL_FLOAT32: c_int = 7;
const NCCL_BFLOAT16: c_int = 9;
/// `ncclRedOp_t` values.
const NCCL_SUM: c_int = 0;
const NCCL_AVG: c_int = 4;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawUniqueId {
    internal: [c_char; 128],
}

/// `ncclConfig_t` as NCCL 2.17 laid it out. NCCL reads a config by its own `size` and
/// `version` fields and gives every field a newer release added its default, so this prefix
/// is understood by every release since 2.17.
#[repr(C)]
struct RawConfig {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
}

/// `NCCL_CONFIG_UNDEF_INT`: let NCCL choose.
const CONFIG_UNDEF: c_int = c_int::MIN;

/// The entry points cfc calls, looked up once.
pub struct Library {
    path: String,
    get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    get_unique_id: unsafe extern "C" fn(*mut RawUniqueId) -> NcclResult,
    comm_init_rank_config:
        unsafe extern "C" fn(*mut RawComm, c_int, RawUniqueId, c_int, *mut RawConfig) -> NcclResult,
    comm_finalize: unsafe extern "C" fn(RawComm) -> NcclResult,
    comm_destroy: unsafe extern "C" fn(RawComm) -> NcclResult,
    comm_abort: unsafe extern "C" fn(RawComm) -> NcclResult,
    comm_get_async_error: unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        sys::CUstream,
    ) -> NcclResult,
    all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        RawComm,
        sys::CUstream,
    ) -> NcclResult,
    reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        sys::CUstream,
    ) -> NcclResult,
    send: unsafe extern "C" fn(
        *const c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        sys::CUstream,
    ) -> NcclResult,
    recv: unsafe extern "C" fn(
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        sys::CUstream,
    ) -> NcclResult,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
    get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    /// `ncclCommSplit` (NCCL 2.18 and later): the node and rail communicators of a two-level
    /// exchange.
    comm_split: Option<
        unsafe extern "C" fn(RawComm, c_int, c_int, *mut RawComm, *mut RawConfig) -> NcclResult,
    >,
    /// `ncclGetLastError` (NCCL 2.13 and later): the detail behind a failed call.
    get_last_error: Option<unsafe extern "C" fn(RawComm) -> *const c_char>,
    _lib: libloading::Library,
}

impl std::fmt::Debug for Library {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Library").field("path", &self.path).finish()
    }
}

impl Library {
    /// Opens the NCCL library at `path` (a file name is looked up by the system's loader).
    ///
    /// # Errors
    /// [`Error::NcclUnavailable`] when the file cannot be loaded or lacks an entry point cfc
    /// needs.
    pub fn open(path: &str) -> Result<Library> {
        // SAFETY: loading runs the library's initialisers; NCCL's are sound to run at any time.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| Error::NcclUnavailable(format!("{path}: {e}")))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is NCCL's entry point of that name, whose C signature is
                // the field's type (nccl.h); the library stays loaded as long as `Library`.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| {
                    Error::NcclUnavailable(format!("{path} is not a usable NCCL ({}: {e})", $name))
                })?
            };
        }
        Ok(Library {
            path: path.to_string(),
            get_version: sym!("ncclGetVersion"),
            get_unique_id: sym!("ncclGetUniqueId"),
            comm_init_rank_config: sym!("ncclCommInitRankConfig"),
            comm_finalize: sym!("ncclCommFinalize"),
            comm_destroy: sym!("ncclCommDestroy"),
            comm_abort: sym!("ncclCommAbort"),
            comm_get_async_error: sym!("ncclCommGetAsyncError"),
            all_reduce: sym!("ncclAllReduce"),
            all_gather: sym!("ncclAllGather"),
            reduce_scatter: sym!("ncclReduceScatter"),
            send: sym!("ncclSend"),
            recv: sym!("ncclRecv"),
            group_start: sym!("ncclGroupStart"),
            group_end: sym!("ncclGroupEnd"),
            get_error_string: sym!("ncclGetErrorString"),
            // SAFETY: as in `sym!`; older libraries lack it, which only a two-level exchange
            // needs (its absence is an error there).
            comm_split: unsafe { lib.get(b"ncclCommSplit\0") }.ok().map(|s| *s),
            // SAFETY: as in `sym!`; older libraries lack it, which only shortens messages.
            get_last_error: unsafe { lib.get(b"ncclGetLastError\0") }.ok().map(|s| *s),
            _lib: lib,
        })
    }

    /// Where the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// NCCL's version as (major, minor, patch).
    ///
    /// # Errors
    /// [`Error::Nccl`] if NCCL refuses.
    pub fn version(&self) -> Result<(u32, u32, u32)> {
        let mut v: c_int = 0;
        // SAFETY: a valid out pointer.
        let code = unsafe { (self.get_version)(&mut v) };
        self.check(code, "ncclGetVersion", None)?;
        let v = v.max(0) as u32;
        // NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z since 2.9.
        Ok((v / 10000, (v / 100) % 100, v % 100))
    }

    /// NCCL's message for `code` (and, with a communicator, its last error), as an error.
    fn check(&self, code: NcclResult, call: &str, comm: Option<RawComm>) -> Result<()> {
        if code == NCCL_SUCCESS {
            return Ok(());
        }
        // SAFETY: NCCL returns a static NUL-terminated string for any code.
        let what = unsafe { cstr((self.get_error_string)(code)) };
        let detail = match (self.get_last_error, comm) {
            // SAFETY: a live communicator (or null, which NCCL accepts); a static string back.
            (Some(last), Some(c)) => unsafe { cstr(last(c)) },
            _ => String::new(),
        };
        let detail = if detail.is_empty() {
            String::new()
        } else {
            format!(" ({detail})")
        };
        Err(Error::Nccl(format!("{call} failed: {what}{detail}")))
    }
}

/// A C string from NCCL, or "" for null.
///
/// # Safety
/// `p` is null or a NUL-terminated string that lives for the call.
unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: this function's contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The process's NCCL: `CFC_NCCL_LIBRARY` if set, else `libnccl.so.2`, else `libnccl.so`.
/// Loaded at the first call that succeeds and kept for the life of the process.
///
/// # Errors
/// [`Error::NcclUnavailable`], naming every place tried.
pub fn library() -> Result<&'static Library> {
    static NCCL: OnceLock<Library> = OnceLock::new();
    static LOADING: Mutex<()> = Mutex::new(());
    if let Some(l) = NCCL.get() {
        return Ok(l);
    }
    let _one_at_a_time = LOADING.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(l) = NCCL.get() {
        return Ok(l);
    }
    let names: Vec<String> = match crate::env::nccl_library() {
        Some(p) => vec![p],
        None => vec!["libnccl.so.2".into(), "libnccl.so".into()],
    };
    let mut tried = Vec::new();
    for name in &names {
        match Library::open(name) {
            Ok(l) => return Ok(NCCL.get_or_init(|| l)),
            // (the reason alone: the error below says once that NCCL is not available)
            Err(Error::NcclUnavailable(why)) => tried.push(why),
            Err(e) => tried.push(e.to_string()),
        }
    }
    Err(Error::NcclUnavailable(format!(
        "{}; set CFC_NCCL_LIBRARY to the library's path (pip's NCCL: \
         site-packages/nvidia/nccl/lib/libnccl.so.2)",
        tried.join("; ")
    )))
}

/// What joins the ranks of one communicator: made once by one rank, given to all.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId(pub [u8; 128]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({}..)", &self.to_hex()[..16])
    }
}

impl UniqueId {
    /// A new id (NCCL also starts its bootstrap listener for it in this process).
    ///
    /// # Errors
    /// [`Error::NcclUnavailable`], or [`Error::Nccl`] (e.g. no usable network interface).
    pub fn new() -> Result<UniqueId> {
        let nccl = library()?;
        let mut raw = RawUniqueId { internal: [0; 128] };
        // SAFETY: a valid out pointer to a 128-byte `ncclUniqueId`.
        let code = unsafe { (nccl.get_unique_id)(&mut raw) };
        nccl.check(code, "ncclGetUniqueId", None)?;
        Ok(UniqueId(raw.internal.map(|c| c as u8)))
    }

    /// The id as 256 hex digits (to pass through the environment or a file).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The id from [`UniqueId::to_hex`]'s digits.
    ///
    /// # Errors
    /// [`Error::Transport`] for anything but 256 hex digits.
    pub fn from_hex(s: &str) -> Result<UniqueId> {
        let s = s.trim();
        let bad = || Error::Transport(format!("an NCCL id is 256 hex digits, got {:?}", s));
        if s.len() != 256 || !s.is_ascii() {
            return Err(bad());
        }
        let mut id = [0u8; 128];
        for (i, b) in id.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(UniqueId(id))
    }

    /// The id in the environment variable `CFC_NCCL_ID` (hex, set by the job's launcher or
    /// rank 0's parent).
    ///
    /// # Errors
    /// [`Error::Transport`] when it is not set or not an id.
    pub fn from_env() -> Result<UniqueId> {
        let v = crate::env::nccl_id()
            .ok_or_else(|| Error::Transport("CFC_NCCL_ID is not set".into()))?;
        UniqueId::from_hex(&v)
    }
}

/// How long a wait on NCCL may see no progress before the communicator is aborted, unless
/// [`Communicator::set_timeout`] says otherwise: `CFC_TIMEOUT` seconds, default 300.
///
/// # Errors
/// A malformed `CFC_TIMEOUT` ([`crate::env::timeout`]).
fn default_timeout() -> Result<Duration> {
    Ok(crate::env::timeout()?.unwrap_or(Duration::from_secs(300)))
}

mod communicator;
pub use communicator::Communicator;
