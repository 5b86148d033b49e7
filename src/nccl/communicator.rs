//! A communicator: the ranks that share one [`UniqueId`], their collectives queued on a
//! stream, and waits that poll instead of hanging (see the module above).

use super::*;

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

/// The configuration of cfc's communicators, joined or split. Non-blocking: every call returns
/// at once and is then polled, so that a wait for a peer (for all to join; later a connection
/// made at the first collective) can end in a timeout instead of blocking the thread for good.
/// `CFC_NCCL_BLOCKING=1` makes NCCL's calls block instead (only the waits for the GPU then time
/// out).
fn config() -> RawConfig {
    let blocking = crate::env::nccl_blocking();
    RawConfig {
        size: std::mem::size_of::<RawConfig>(),
        magic: 0xcafe_beef,
        version: 21700,
        blocking: blocking as c_int,
        cga_cluster_size: CONFIG_UNDEF,
        min_ctas: CONFIG_UNDEF,
        max_ctas: CONFIG_UNDEF,
        net_name: std::ptr::null(),
    }
}

impl Communicator {
    /// Joins the communicator of `id` as `rank` of `world`, on device `device` (its primary
    /// context, the one PyTorch uses), with the default timeout (`CFC_TIMEOUT` seconds,
    /// else 300). Waits until every rank has joined (NCCL's rule).
    ///
    /// # Errors
    /// [`Error::NcclUnavailable`], [`Error::CudaUnavailable`], [`Error::Nccl`] (NCCL's message),
    /// [`Error::Transport`] for a rank outside `0..world` or a malformed `CFC_TIMEOUT`.
    pub fn new(device: usize, id: &UniqueId, rank: usize, world: usize) -> Result<Communicator> {
        Communicator::with_timeout(device, id, rank, world, default_timeout()?)
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
        let mut config = config();
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

    /// Whether this NCCL can split communicators (2.18 and later).
    pub fn can_split(&self) -> bool {
        self.nccl.comm_split.is_some()
    }

    /// A communicator of the ranks that give the same `color` (every rank of this one calls
    /// it, at the same point), in which this rank is `rank` of `world` (the order of `rank`
    /// given as NCCL's key). It keeps this one's timeout; the failure board is set apart.
    ///
    /// # Errors
    /// [`Error::NcclUnavailable`] for an NCCL older than 2.18 (no `ncclCommSplit`);
    /// [`Error::Nccl`]; the timeout.
    pub fn split(&mut self, color: usize, rank: usize, world: usize) -> Result<Communicator> {
        self.usable()?;
        let split = self.nccl.comm_split.ok_or_else(|| {
            Error::NcclUnavailable(format!(
                "{} has no ncclCommSplit (NCCL 2.18 or later is needed for a two-level \
                 exchange; topology='flat' works with this one)",
                self.nccl.path()
            ))
        })?;
        if rank >= world || color > i32::MAX as usize || world > i32::MAX as usize {
            return Err(Error::Transport(format!(
                "internal: rank {rank} of {world} (color {color}) is not a place in a split"
            )));
        }
        let _restore = crate::cuda::ContextGuard::save()?;
        self.ctx.bind_to_thread().map_err(driver_err)?;
        let mut config = config();
        // A non-blocking split writes the new communicator when it is complete, from NCCL's own
        // thread (null until then): it is read atomically while polling, from the heap, so that
        // a split given up on may still write it (the slot is then leaked).
        let slot = Box::new(std::sync::atomic::AtomicPtr::<c_void>::new(
            std::ptr::null_mut(),
        ));
        // SAFETY: a live communicator, a valid out pointer (alive until NCCL is done with it, see
        // above) and config; every rank of this communicator makes the same call (the engine's
        // one schedule).
        let code = unsafe {
            split(
                self.raw,
                color as c_int,
                rank as c_int,
                slot.as_ptr(),
                &mut config,
            )
        };
        if code == NCCL_SUCCESS || code == NCCL_IN_PROGRESS {
            // Done when NCCL has written the new communicator and the parent is usable again
            // (it is in progress until the split's job ends, after the write).
            let ready = |c: &mut Self| -> Result<bool> {
                let state = c.async_state("ncclCommSplit")?;
                Ok(!slot.load(std::sync::atomic::Ordering::Acquire).is_null()
                    && state == NCCL_SUCCESS)
            };
            if let Err(e) = self.poll("ncclCommSplit", ready) {
                Box::leak(slot);
                return Err(e);
            }
        }
        let raw: RawComm = slot.load(std::sync::atomic::Ordering::Acquire);
        let mut comm = Communicator {
            nccl: self.nccl,
            raw,
            ctx: self.ctx.clone(),
            device: self.device,
            rank,
            world,
            timeout: self.timeout,
            spin: self.spin,
            nap: self.nap,
            broken: None,
            interrupt: self.interrupt.clone(),
        };
        if raw.is_null() {
            self.check(code, "ncclCommSplit")?;
            return Err(Error::Nccl("ncclCommSplit gave no communicator".into()));
        }
        comm.settle(code, "ncclCommSplit")?;
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
