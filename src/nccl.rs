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
    let names: Vec<String> = match std::env::var("CFC_NCCL_LIBRARY") {
        Ok(p) if !p.is_empty() => vec![p],
        _ => vec!["libnccl.so.2".into(), "libnccl.so".into()],
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
        let v = std::env::var("CFC_NCCL_ID")
            .map_err(|_| Error::Transport("CFC_NCCL_ID is not set".into()))?;
        UniqueId::from_hex(&v)
    }
}

/// How long a wait on NCCL may see no progress before the communicator is aborted, unless
/// [`Communicator::set_timeout`] says otherwise: `CFC_TIMEOUT` seconds, default 300.
fn default_timeout() -> Duration {
    std::env::var("CFC_TIMEOUT")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        // (not a number, or more seconds than a Duration holds: the default)
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .unwrap_or(Duration::from_secs(300))
}

/// One rank's NCCL communicator on one device.
///
/// Its collectives are queued on a stream the caller names and never wait; [`Communicator::wait`]
/// waits for a stream with the communicator's timeout.
pub struct Communicator {
    nccl: &'static Library,
    raw: RawComm,
    ctx: Arc<CudaContext>,
    device: usize,
    rank: usize,
    world: usize,
    timeout: Duration,
    /// How long a wait polls without a pause, then the pause between polls
    /// ([`Communicator::set_polling`]).
    spin: Duration,
    nap: Duration,
    /// Why the communicator was aborted; every later call fails with it.
    broken: Option<String>,
    /// A failure board whose failures end every wait at once (the communicator is then
    /// aborted): NCCL alone cannot tell that a peer died.
    interrupt: Option<std::sync::Arc<crate::engine::Control>>,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time (`&mut self` on every
// operation ensures that).
unsafe impl Send for Communicator {}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("device", &self.device)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

/// NCCL's data type and operation for a reduction of `dtype`, summed or averaged.
fn reduction(dtype: DType, average: bool) -> Result<(c_int, c_int)> {
    let dt = match dtype {
        DType::F32 => NCCL_FLOAT32,
        DType::BF16 => NCCL_BFLOAT16,
        DType::F16 => NCCL_FLOAT16,
        other => return Err(Error::NotQuantizable(other)),
    };
    Ok((dt, if average { NCCL_AVG } else { NCCL_SUM }))
}

impl Communicator {
    /// Joins the communicator of `id` as `rank` of `world`, on device `device` (its primary
    /// context, the one PyTorch uses), with the default timeout (`CFC_TIMEOUT` seconds,
    /// else 300). Waits until every rank has joined (NCCL's rule).
    ///
    /// # Errors
    /// [`Error::NcclUnavailable`], [`Error::CudaUnavailable`], [`Error::Nccl`] (NCCL's message),
    /// [`Error::Transport`] for a rank outside `0..world`.
    pub fn new(device: usize, id: &UniqueId, rank: usize, world: usize) -> Result<Communicator> {
        Communicator::with_timeout(device, id, rank, world, default_timeout())
    }

    /// As [`Communicator::new`], with `timeout` for the wait for every rank to join as for
    /// every later wait ([`Communicator::set_timeout`]): a rank that never joins is an error
    /// after `timeout`, and the communicator is aborted (not with `CFC_NCCL_BLOCKING=1`, where
    /// NCCL's join itself blocks until every rank is there).
    ///
    /// # Errors
    /// As [`Communicator::new`].
    pub fn with_timeout(
        device: usize,
        id: &UniqueId,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Communicator> {
        if world == 0 || rank >= world || world > i32::MAX as usize {
            return Err(Error::Transport(format!(
                "rank {rank} of {world} ranks is not a place in a communicator"
            )));
        }
        let nccl = library()?;
        // (the caller's current context comes back after the device's is bound for the join)
        let _restore = crate::cuda::ContextGuard::save()?;
        let ctx = crate::cuda::context(device)?;
        let mut raw: RawComm = std::ptr::null_mut();
        let uid = RawUniqueId {
            internal: id.0.map(|b| b as c_char),
        };
        // Non-blocking: every call returns at once and is then polled, so that a wait for a
        // peer (here for all to join; later a connection made at the first collective) can
        // end in a timeout instead of blocking this thread for good. `CFC_NCCL_BLOCKING=1`
        // makes NCCL's calls block instead (only the waits for the GPU then time out).
        let blocking = std::env::var("CFC_NCCL_BLOCKING").is_ok_and(|v| v == "1");
        let mut config = RawConfig {
            size: std::mem::size_of::<RawConfig>(),
            magic: 0xcafe_beef,
            version: 21700,
            blocking: blocking as c_int,
            cga_cluster_size: CONFIG_UNDEF,
            min_ctas: CONFIG_UNDEF,
            max_ctas: CONFIG_UNDEF,
            net_name: std::ptr::null(),
        };
        // SAFETY: valid out pointer and config; the device's context is current on this thread
        // (`context` binds it), which NCCL takes as the communicator's device.
        let code = unsafe {
            (nccl.comm_init_rank_config)(&mut raw, world as c_int, uid, rank as c_int, &mut config)
        };
        let mut comm = Communicator {
            nccl,
            raw,
            ctx,
            device,
            rank,
            world,
            timeout,
            spin: Duration::from_millis(5),
            nap: Duration::from_micros(50),
            broken: None,
            interrupt: None,
        };
        if raw.is_null() {
            comm.check(code, "ncclCommInitRankConfig")?;
            return Err(Error::Nccl(
                "ncclCommInitRankConfig gave no communicator".into(),
            ));
        }
        comm.settle(code, "ncclCommInitRankConfig")?;
        Ok(comm)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The device ordinal.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The device's primary context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// How long [`Communicator::wait`] waits without progress before it aborts the
    /// communicator (default: `CFC_TIMEOUT` seconds, or 300).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Why the communicator was aborted (by a timeout, an NCCL error or its owner), if it was:
    /// its calls fail from then on, and its kernels have stopped.
    pub fn aborted(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// The wait's timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Ends every wait at once, aborting the communicator, when a failure is raised on
    /// `board` (by this rank or a peer).
    pub fn set_interrupt(&mut self, board: std::sync::Arc<crate::engine::Control>) {
        self.interrupt = Some(board);
    }

    /// How the waits poll: without a pause for their first `spin` (default 5 ms), then with a
    /// sleep of `nap` (default 50 us) between polls. Each poll is a query of the CUDA driver,
    /// which the threads launching work on the same device also call into.
    pub fn set_polling(&mut self, spin: Duration, nap: Duration) {
        self.spin = spin;
        self.nap = nap;
    }

    fn usable(&self) -> Result<()> {
        match &self.broken {
            Some(why) => Err(Error::Nccl(format!(
                "the communicator was aborted earlier: {why}"
            ))),
            None => {
                self.ctx.bind_to_thread().map_err(driver_err)?;
                Ok(())
            }
        }
    }

    fn check(&self, code: NcclResult, call: &str) -> Result<()> {
        self.nccl.check(code, call, Some(self.raw))
    }

    /// Waits until the call that returned `code` has finished on the host (a non-blocking
    /// communicator returns `ncclInProgress` while it waits, e.g. for a peer to connect),
    /// polling NCCL's asynchronous state. An error, or the timeout, aborts the communicator.
    fn settle(&mut self, code: NcclResult, call: &str) -> Result<()> {
        if code != NCCL_IN_PROGRESS {
            return match self.check(code, call) {
                Ok(()) => Ok(()),
                Err(e) => Err(self.abort_with(e.to_string())),
            };
        }
        self.poll(call, |c| Ok(c.async_state(call)? == NCCL_SUCCESS))
    }

    /// NCCL's asynchronous state of the communicator: `ncclSuccess` or `ncclInProgress`; a
    /// failure (reported as one of `what`) aborts the communicator and is returned.
    fn async_state(&mut self, what: &str) -> Result<NcclResult> {
        let mut state: NcclResult = NCCL_SUCCESS;
        // SAFETY: a live communicator and a valid out pointer.
        let got = unsafe { (self.nccl.comm_get_async_error)(self.raw, &mut state) };
        self.check(got, "ncclCommGetAsyncError")?;
        if state != NCCL_SUCCESS && state != NCCL_IN_PROGRESS {
            let why = self
                .check(state, what)
                .err()
                .map_or_else(String::new, |e| e.to_string());
            return Err(self.abort_with(why));
        }
        Ok(state)
    }

    /// Calls `done` until it says so (or fails), within the timeout: past it, `what` "made no
    /// progress" and the communicator is aborted. Spins for the first few milliseconds (a
    /// collective, or a non-blocking communicator's launch, usually ends within microseconds;
    /// sleeping between polls would add the sleep's granularity, tens of microseconds, to every
    /// call), then leaves the core to others.
    fn poll(&mut self, what: &str, mut done: impl FnMut(&mut Self) -> Result<bool>) -> Result<()> {
        let t0 = Instant::now();
        loop {
            if done(self)? {
                return Ok(());
            }
            if let Some(f) = self.interrupt.as_ref().and_then(|b| b.due()) {
                let _ = self.abort_with(f.error().to_string());
                return Err(f.error());
            }
            let waited = t0.elapsed();
            if waited > self.timeout {
                let why = format!(
                    "rank {} of {}: {what} made no progress within {:.1} s (a peer is gone or \
                     stalled); the communicator was aborted",
                    self.rank,
                    self.world,
                    self.timeout.as_secs_f64()
                );
                return Err(self.abort_with(why));
            }
            if waited < self.spin {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(self.nap);
            }
        }
    }

    /// Queues an all-reduce of `count` elements of `dtype` from `send` to `recv` (they may be
    /// the same), summed or averaged (`average`), on `stream`.
    ///
    /// # Safety
    /// `send` and `recv` must be device addresses of this communicator's device valid for
    /// `count` elements until the queued work completes; `stream` a live stream of the device's
    /// primary context.
    ///
    /// # Errors
    /// [`Error::NotQuantizable`] for a dtype NCCL is not asked to reduce here (float32, bfloat16
    /// and float16 are); [`Error::Nccl`].
    pub unsafe fn all_reduce(
        &mut self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        average: bool,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.usable()?;
        let (dt, op) = reduction(dtype, average)?;
        // SAFETY: this function's contract.
        let code = unsafe {
            (self.nccl.all_reduce)(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dt,
                op,
                self.raw,
                stream,
            )
        };
        self.settle(code, "ncclAllReduce")
    }

    /// Queues a reduce-scatter: `count` elements of `dtype` per rank, summed or averaged
    /// (`average`) over the ranks, from `send` (`world * count` elements, rank-major) into
    /// `recv` (`count`), on `stream`.
    ///
    /// # Safety
    /// As [`Communicator::all_reduce`], for `world * count` elements at `send` and `count` at
    /// `recv`.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    pub unsafe fn reduce_scatter(
        &mut self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        average: bool,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.usable()?;
        let (dt, op) = reduction(dtype, average)?;
        // SAFETY: this function's contract.
        let code = unsafe {
            (self.nccl.reduce_scatter)(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dt,
                op,
                self.raw,
                stream,
            )
        };
        self.settle(code, "ncclReduceScatter")
    }

    /// Queues an all-gather of `bytes` bytes from every rank: rank `j`'s land at
    /// `recv + j * bytes`.
    ///
    /// # Safety
    /// `send` valid for `bytes` and `recv` for `world * bytes` bytes of this device until the
    /// queued work completes; `stream` a live stream of the device's primary context.
    ///
    /// # Errors
    /// [`Error::Nccl`].
    pub unsafe fn all_gather(
        &mut self,
        send: u64,
        recv: u64,
        bytes: usize,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.usable()?;
        // SAFETY: this function's contract.
        let code = unsafe {
            (self.nccl.all_gather)(
                send as *const c_void,
                recv as *mut c_void,
                bytes,
                NCCL_UINT8,
                self.raw,
                stream,
            )
        };
        self.settle(code, "ncclAllGather")
    }

    /// Queues, as one group, a send of `sends[j]` (address, bytes) to every rank `j` and a
    /// receive of `recvs[j]` from it (this rank's own entries and empty ones are skipped).
    ///
    /// # Safety
    /// Every range must be device memory of this device valid until the queued work completes;
    /// `stream` a live stream of the device's primary context; every peer must queue the
    /// matching receives and sends.
    ///
    /// # Errors
    /// [`Error::Nccl`].
    pub unsafe fn send_recv(
        &mut self,
        sends: &[(u64, usize)],
        recvs: &[(u64, usize)],
        stream: sys::CUstream,
    ) -> Result<()> {
        self.usable()?;
        let nccl = self.nccl;
        // SAFETY: no arguments.
        self.check(unsafe { (nccl.group_start)() }, "ncclGroupStart")?;
        let mut first_err = Ok(());
        for peer in 0..self.world {
            if peer == self.rank {
                continue;
            }
            if let Some(&(p, len)) = sends.get(peer).filter(|s| s.1 > 0) {
                // SAFETY: this function's contract.
                let code = unsafe {
                    (nccl.send)(
                        p as *const c_void,
                        len,
                        NCCL_UINT8,
                        peer as c_int,
                        self.raw,
                        stream,
                    )
                };
                first_err = first_err.and(self.check(code, "ncclSend"));
            }
            if let Some(&(p, len)) = recvs.get(peer).filter(|r| r.1 > 0) {
                // SAFETY: this function's contract.
                let code = unsafe {
                    (nccl.recv)(
                        p as *mut c_void,
                        len,
                        NCCL_UINT8,
                        peer as c_int,
                        self.raw,
                        stream,
                    )
                };
                first_err = first_err.and(self.check(code, "ncclRecv"));
            }
        }
        // The group is always closed, even after a failed call inside it.
        // SAFETY: no arguments; closes the group opened above.
        let end = unsafe { (nccl.group_end)() };
        let settled = self.settle(end, "ncclGroupEnd");
        first_err.and(settled)
    }

    /// Waits until `stream` has done everything queued on it so far, polling the stream and
    /// NCCL's asynchronous error. An NCCL error, or no completion within the timeout, aborts
    /// the communicator (its kernels stop, so the stream can drain) and is returned.
    ///
    /// # Errors
    /// [`Error::Nccl`] (NCCL's message, or the timeout), [`Error::Cuda`].
    pub fn wait(&mut self, stream: &CudaStream) -> Result<()> {
        self.usable()?;
        let event = stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(driver_err)?;
        self.wait_event(&event)
    }

    /// As [`Communicator::wait`], for the work before `event`.
    ///
    /// # Errors
    /// As [`Communicator::wait`].
    pub fn wait_event(&mut self, event: &CudaEvent) -> Result<()> {
        self.usable()?;
        self.poll("the queued work", |c| {
            if event.try_is_complete().map_err(driver_err)? {
                return Ok(true);
            }
            c.async_state("an NCCL collective")?;
            Ok(false)
        })
    }

    /// Leaves the communicator at once, without waiting for its peers (as a rank that gives
    /// up on a job does): the peers' collectives with this rank fail or time out.
    pub fn abort(mut self) {
        self.abort_now();
    }

    /// [`Communicator::abort`], keeping the (now unusable) value: its calls fail from then on.
    pub fn abort_now(&mut self) {
        if self.broken.is_none() {
            let _ = self.abort_with("aborted by its owner".into());
        }
    }

    /// Aborts the communicator (NCCL's kernels give up) and returns the error to report.
    fn abort_with(&mut self, why: String) -> Error {
        tracing::error!(rank = self.rank, why, "aborting the NCCL communicator");
        if !self.raw.is_null() {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: a live communicator, not used again (`broken` is set, `raw` cleared).
            let _ = unsafe { (self.nccl.comm_abort)(self.raw) };
        }
        self.raw = std::ptr::null_mut();
        self.broken = Some(why.clone());
        Error::Nccl(why)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if self.raw.is_null() {
            return;
        }
        let _restore = crate::cuda::ContextGuard::save().ok();
        let _ = self.ctx.bind_to_thread();
        // Finalize (which a non-blocking communicator does in the background: polled, within
        // the timeout), then free; a communicator that cannot finalize is aborted instead.
        // SAFETY: a live communicator.
        let code = unsafe { (self.nccl.comm_finalize)(self.raw) };
        if self.settle(code, "ncclCommFinalize").is_ok() {
            // SAFETY: a live, finalized communicator, destroyed once.
            let _ = unsafe { (self.nccl.comm_destroy)(self.raw) };
        }
    }
}
