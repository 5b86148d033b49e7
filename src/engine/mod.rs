//! The engine: cfc's one compressed all-reduce (and reduce-scatter), from "bucket ready on the
//! caller's stream" to "result written in place".
//!
//! ```text
//!            +--------------------- engine (this module) ----------------------+
//!  submit -> | bound -> compress + error feedback -> exchange -> decode + scale | -> wait
//!  (1 call)  |  (abs/rms/rel,   (frames, or shards     (all-gather of frames,   |   (the step's
//!            |   agreed)         of one step)           or reduce-scatter of    |    outcome,
//!            |                                          codes + all-gather)     |    every rank)
//!            +---- backend: CUDA kernels | CPU codec ---- transport: NCCL | TCP | threads ----+
//! ```
//!
//! An [`Engine`] is a handle to one comm thread (`worker.rs`), fed first in first out, so that
//! every rank issues the same collectives in the same order. [`Engine::submit`] hands a job
//! over and returns at once; [`Engine::wait`] returns once every job submitted is done on the
//! host (exchanged, decoding queued) and orders the caller's stream after the results, or
//! reports the failure, on every rank.
//!
//! Two seams and nothing else pluggable: the backend (`backend/`: the CPU reference codec, or
//! the CUDA kernels, which write the same bytes) and the transport (`transport/`: threads of one
//! process, TCP between processes, NCCL). The same state machine (bounds, slots and resends,
//! the warm-up, the trial and the fallback, failures) runs on every pair, so CI runs it on the
//! CPU with several ranks.
//!
//! Failures reach every rank: a rank that fails raises it on the failure board (`control.rs`),
//! which tells its peers at once; a rank whose process dies is seen by its peers' links. Every
//! wait looks at the board, so no rank waits for a timeout.

pub mod backend;
mod block_scales;
mod close;
pub mod control;
mod exchange;
pub mod job;
mod levels;
mod open;
pub mod options;
pub mod policy;
mod progress;
mod rows;
pub mod step_check;
mod tails;
pub mod topology;
pub mod transport;
mod worker;

pub use control::{Control, Failure};
pub use job::{Job, Op, Scale, Tensor};
pub use options::{Algorithm, BoundRule, Fallback, FsdpOptions, Options};
pub use policy::{BucketState, EngineState};
pub use progress::Stats;
pub(crate) use progress::{Progress, Sent, Shared};
pub use step_check::StepCheckState;
pub use topology::{Levels, Topology};

use crate::error::{Error, Result};
use backend::Backend;
use crossbeam_channel::Sender;
use std::any::Any;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use transport::Transport;

/// A fault to inject into an engine's next compressed job, for tests of failure handling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The frame this rank sends is corrupted after compression: its peers' decoding refuses it.
    Corrupt,
    /// The next scratch allocation fails.
    Alloc,
    /// The next compressed job fails as a device error would.
    Device,
    /// The next compressed job hangs (looking only at the failure board), as a device or a
    /// link that never answers would: the caller's wait runs out of time.
    Hang,
}

/// How long a wait that ran out of time gives the engine's thread to give up its work (see
/// [`Engine::settled`]).
const GIVE_UP_GRACE: Duration = Duration::from_secs(10);

/// Messages to the comm thread.
pub(crate) enum Msg {
    Job(Job, Box<dyn Any + Send>),
    Flush,
    /// The step's end, with where the caller's stream stood then (its `Ready`).
    EndStep(Box<dyn Any + Send>),
    Agree(u64),
    /// The jobs so far finished on the comm thread, and their mark published under this number
    /// (see [`Engine::order`]).
    Order(u64),
    /// Every rank's bytes, in rank order, to every rank (see [`Engine::gather`]).
    Gather(Vec<u8>, Sender<Vec<Vec<u8>>>),
    Reset,
    State(Sender<EngineState>),
    /// The next step's ways (see [`Engine::ways`]).
    Ways(Sender<(bool, Vec<u64>)>),
    Load(EngineState, Sender<()>),
    Inject(Fault),
    Stop,
}

impl Msg {
    /// Whether it is a *point* of the failure board (it may run collectives; every rank sends
    /// the same ones in the same order): see `control.rs`.
    pub(crate) fn is_point(&self) -> bool {
        matches!(
            self,
            Msg::Job(..)
                | Msg::Flush
                | Msg::EndStep(_)
                | Msg::Agree(_)
                | Msg::Gather(..)
                | Msg::Reset
                | Msg::Stop
        )
    }
}

/// What a caller's stream waits on after a close (an event on the GPU; nothing on the CPU).
pub(crate) type Done = Box<dyn Fn(u64) -> Result<()> + Send + Sync>;
/// What a submission records for the engine to wait on (an event on the caller's stream).
pub(crate) type ReadyFn = Arc<dyn Fn(u64) -> Result<Box<dyn Any + Send>> + Send + Sync>;

/// One rank's handle to an engine; see the module docs.
pub struct Engine {
    tx: Sender<Msg>,
    shared: Arc<Shared>,
    control: Arc<Control>,
    ready: ReadyFn,
    /// Orders made so far (see [`Engine::order`]); held while one is handed over, so that
    /// orders reach the comm thread in their numbers' order.
    orders: Mutex<u64>,
    rank: usize,
    world: usize,
    options: Options,
    /// This rank's place in the two-level exchange; `None`: flat.
    levels: Option<Levels>,
    /// Publications asked for so far (closes, agreements).
    expected: Mutex<u64>,
    /// Whether jobs were sent after the latest counted message (their memory is in use until a
    /// later one is published: see [`Engine::settled`]).
    uncounted: std::sync::atomic::AtomicBool,
    /// Points (see `Msg::is_point`) handed over so far.
    points: std::sync::atomic::AtomicU64,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("options", &self.options)
            .finish()
    }
}

impl Engine {
    /// Starts an engine on `be` and `tr` with `options`, and its agreement round with `token`
    /// (a value every rank must give alike, e.g. which checkpoint it resumed from): ranks that
    /// disagree on the options, the nodes or the token get [`Error::RankMismatch`] from their
    /// first wait. `nodes` holds each rank's node index ([`topology::node_indices`]; empty:
    /// one node); with the option `topology`, it chooses the flat or the two-level exchange.
    ///
    /// # Errors
    /// [`Error::InvalidBound`] and the other errors of [`Options::check`]; a node map of the
    /// wrong length, or `topology="two-level"` over nodes of different sizes; a thread that
    /// cannot be started.
    pub(crate) fn start<B: Backend, T: Transport<B> + 'static>(
        be: B,
        tr: T,
        options: Options,
        token: u64,
        nodes: &[usize],
    ) -> Result<Engine> {
        options.check()?;
        let (rank, world) = (tr.rank(), tr.world());
        if !nodes.is_empty() && nodes.len() != world {
            return Err(Error::Transport(format!(
                "a node map of {} ranks for an engine of {world}",
                nodes.len()
            )));
        }
        let levels = match topology::plan(options.topology, nodes, rank)? {
            Some(_) if !tr.can_group() && options.topology == Topology::TwoLevel => {
                return Err(Error::NcclUnavailable(
                    "topology='two-level' needs ncclCommSplit (NCCL 2.18 or later); this NCCL \
                     has none ('auto' falls back to flat)"
                        .into(),
                ))
            }
            Some(_) if !tr.can_group() => {
                if rank == 0 {
                    tracing::warn!("cfc: this NCCL cannot split communicators; exchanging flat");
                }
                None
            }
            planned => planned,
        };
        let control = tr.control().clone();
        let ready = be.ready_maker();
        let shared = Shared::new();
        let (tx, rx) = crossbeam_channel::unbounded();
        let worker = worker::Worker::new(
            be,
            tr,
            options.clone(),
            shared.clone(),
            rx,
            nodes,
            levels.clone(),
        );
        let thread = std::thread::Builder::new()
            .name(format!("cfc-engine-{rank}"))
            .spawn(move || {
                let fallback = worker.fallback_failure();
                let control = worker.control();
                let shared = worker.shared();
                // A panic on this thread (a bug) must not leave the ranks waiting: it fails the
                // engine like any other error.
                let outcome =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || worker.run()));
                if outcome.is_err() {
                    control.raise(fallback, true);
                    shared.note_failure(control.failure());
                    // Waiters read the failure from now on (no more publications come).
                    shared.fail_all_waiters();
                }
            })
            .map_err(|e| Error::Transport(format!("cannot start the engine's thread: {e}")))?;
        let engine = Engine {
            tx,
            shared,
            control,
            ready,
            orders: Mutex::new(0),
            rank,
            world,
            options,
            levels,
            expected: Mutex::new(0),
            uncounted: std::sync::atomic::AtomicBool::new(false),
            points: std::sync::atomic::AtomicU64::new(0),
            thread: Mutex::new(Some(thread)),
        };
        engine.send_counted(Msg::Agree(token))?;
        Ok(engine)
    }

    /// This rank's place in the two-level exchange, or `None` where the exchange is flat.
    pub fn levels(&self) -> Option<&Levels> {
        self.levels.as_ref()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The options.
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// The failure board (e.g. to see a peer's failure without waiting).
    pub fn control(&self) -> &Arc<Control> {
        &self.control
    }

    fn send(&self, msg: Msg) -> Result<()> {
        let point = msg.is_point();
        self.tx
            .send(msg)
            .map_err(|_| Error::Transport("the engine's thread has ended".into()))?;
        if point {
            self.points
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        Ok(())
    }

    fn send_counted(&self, msg: Msg) -> Result<u64> {
        let mut e = self.expected.lock().unwrap_or_else(|e| e.into_inner());
        self.send(msg)?;
        *e += 1;
        self.uncounted
            .store(false, std::sync::atomic::Ordering::SeqCst);
        Ok(*e)
    }

    /// Hands `job` to the engine and returns at once. A job the engine refuses (its dtype,
    /// lengths, alignment) is refused on every rank: this rank raises it on the failure board.
    ///
    /// # Safety
    /// The job's tensors must be memory of the engine's device (host memory for a CPU engine),
    /// valid for their elements, and must not be read or written by anything else from this
    /// call until [`Engine::wait`] returns (on a CUDA engine: work queued on `stream` before
    /// this call is done first, and work queued on the stream the wait names comes after).
    /// `stream` is a `CUstream` of the device's primary context (ignored on the CPU).
    ///
    /// # Errors
    /// The failure of any rank, raised so far; the job's refusal (see above).
    pub unsafe fn submit(&self, job: Job, stream: u64) -> Result<()> {
        if let Some(f) = self.control.failure() {
            return Err(f.error());
        }
        let checked = job
            .check(self.world, self.options.error_feedback)
            .and_then(|()| {
                if let Op::ReduceScatter { out } = job.op {
                    let (a, b) = (job.data.region(), out.region());
                    if a.addr < b.addr + b.len && b.addr < a.addr + a.len {
                        return Err(Error::Transport(
                            "a reduce-scatter's output lies inside its input".into(),
                        ));
                    }
                }
                Ok(())
            });
        if let Err(e) = checked {
            self.fail(&e.to_string());
            return Err(e);
        }
        let ready = match (self.ready)(stream) {
            Ok(r) => r,
            Err(e) => {
                // (the peers would otherwise wait for this rank's job)
                self.fail(&e.to_string());
                return Err(e);
            }
        };
        if job.last {
            self.send_counted(Msg::Job(job, ready))?;
        } else {
            let _counted = self.expected.lock().unwrap_or_else(|e| e.into_inner());
            self.send(Msg::Job(job, ready))?;
            self.uncounted
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
        Ok(())
    }

    /// Waits until every job submitted so far is done on the host (exchanged, its decoding
    /// queued) and the step is closed, then orders `stream` (a `CUstream`; ignored on the CPU)
    /// after the results.
    ///
    /// # Errors
    /// The first failure of any rank ([`Error::PeerFailed`] names the rank where it began);
    /// [`Error::Timeout`] when the engine does not answer within twice its timeout.
    pub fn wait(&self, stream: u64) -> Result<()> {
        let want = self.send_counted(Msg::Flush)?;
        self.wait_for(want)?;
        let done = self.shared.progress().done.clone();
        match done {
            Some(d) => d(stream),
            None => Ok(()),
        }
    }

    /// Orders `stream` (a `CUstream`; ignored on the CPU) after the results of every job
    /// submitted so far, without closing the step: for callers that hand each job's result on
    /// before the step ends (FSDP2's reduce-scatters). Waits on the host until the comm thread
    /// has finished the jobs' exchange and queued their decoding, as [`Engine::wait`] does, but
    /// without the closing round (every rank's decoding status, gathered) and without counting
    /// a step: the outcome (success, or the failure of any rank, a frame some rank could not
    /// decode included) is reported by the next [`Engine::wait`] or [`Engine::end_step`], on
    /// every rank, so what the stream computes from the results before then may come from a
    /// step that fails. When it returns, the engine is done with the jobs' memory as far as
    /// the host is concerned (its work on it is queued, and `stream` comes after that work).
    ///
    /// # Errors
    /// The failure of any rank, raised so far or met while waiting; device errors;
    /// [`Error::Timeout`] as for [`Engine::wait`].
    pub fn order(&self, stream: u64) -> Result<()> {
        if let Some(f) = self.control.failure() {
            return Err(f.error());
        }
        let at = {
            let mut n = self.orders.lock().unwrap_or_else(|e| e.into_inner());
            *n += 1;
            self.send(Msg::Order(*n))?;
            *n
        };
        // (a failure ends the wait: a failed comm thread queues nothing more)
        self.wait_until(|p| p.queued >= at || p.failure.is_some())?;
        let p = self.shared.progress();
        if p.queued < at {
            return Err(self.failure_of(&p));
        }
        let done = p.queued_done.clone();
        drop(p);
        match done {
            Some(d) => d(stream),
            None => Ok(()),
        }
    }

    /// Closes the step without a job of its own: for callers that learn where a step ends only
    /// after its last job (FSDP2 runs one group per call, [`Engine::order`]ing each, and
    /// ends the step when the backward pass does). The warm-up and the trial count such steps.
    /// Every rank must call it at the same point of its jobs. Waits like [`Engine::wait`],
    /// without ordering a stream. `stream` (a `CUstream`; ignored on the CPU) is where the
    /// caller's step ends: the step check, which times whole steps, waits for it there (see
    /// `step_check.rs`).
    ///
    /// # Errors
    /// As [`Engine::wait`]; device errors.
    pub fn end_step(&self, stream: u64) -> Result<()> {
        let mark = match (self.ready)(stream) {
            Ok(m) => m,
            Err(e) => {
                // (the peers would otherwise wait for this rank's closing round)
                self.fail(&e.to_string());
                return Err(e);
            }
        };
        let want = self.send_counted(Msg::EndStep(mark))?;
        self.wait_for(want)
    }

    /// The error a failed wait reports.
    fn failure_of(&self, p: &Progress) -> Error {
        match p.failure.clone().or_else(|| self.control.failure()) {
            Some(f) => f.error(),
            None => Error::Transport("the engine's thread has ended".into()),
        }
    }

    fn wait_for(&self, want: u64) -> Result<()> {
        self.wait_until(|p| p.published >= want)?;
        let p = self.shared.progress();
        if p.succeeded(want) {
            Ok(())
        } else {
            Err(self.failure_of(&p))
        }
    }

    /// Waits until `reached` holds of the comm thread's progress (Ok), or the thread ends, or
    /// the wait runs out of time (twice the timeout and 10 s).
    fn wait_until(&self, reached: impl Fn(&Progress) -> bool) -> Result<()> {
        let limit = self.patience();
        let t0 = Instant::now();
        let mut p = self.shared.progress();
        loop {
            if p.dead {
                return Err(self.failure_of(&p));
            }
            if reached(&p) {
                return Ok(());
            }
            let left = limit.saturating_sub(t0.elapsed());
            if left.is_zero() {
                return Err(self.give_up(p, reached, limit));
            }
            p = self.shared.wait(p, left.min(Duration::from_millis(100)));
        }
    }

    /// A wait that ran out of time: a failure of every rank, so that the engine's thread gives
    /// up at its next look at the board and lets go of the caller's memory, and a short grace
    /// for it to say so (see [`Engine::settled`]).
    fn give_up(
        &self,
        p: std::sync::MutexGuard<'_, Progress>,
        reached: impl Fn(&Progress) -> bool,
        limit: Duration,
    ) -> Error {
        let seconds = limit.as_secs_f64();
        let failure = Failure {
            rank: self.rank,
            reason: format!(
                "rank {}'s engine did not finish its work within {seconds} s",
                self.rank
            ),
            at: 0,
        };
        // (raising tells the peers over their links: not under the progress lock)
        drop(p);
        self.control.raise(failure, true);
        let t0 = Instant::now();
        let mut p = self.shared.progress();
        while !(p.dead || reached(&p)) && t0.elapsed() < GIVE_UP_GRACE {
            p = self.shared.wait(p, Duration::from_millis(50));
        }
        Error::Timeout {
            peer: self.rank,
            seconds,
        }
    }

    /// Whether the engine is done with the memory of every job submitted: it finished them,
    /// or gave them up after a failure and its device drained. Only then may the caller free
    /// that memory. It is false while jobs are at work (jobs submitted since the latest wait,
    /// step end or close count as at work), and after a wait that ran out of time while the
    /// engine's thread was still at work, or whose device never drained: the caller must then
    /// keep the memory alive.
    pub fn settled(&self) -> bool {
        let sent = self.expected.lock().unwrap_or_else(|e| e.into_inner());
        let uncounted = self.uncounted.load(std::sync::atomic::Ordering::SeqCst);
        let p = self.shared.progress();
        !p.stranded && (p.dead || (!uncounted && p.published >= *sent))
    }

    /// Checks again, with every rank, the options and `token` (e.g. after loading a
    /// checkpoint), in order with the jobs; waits for the round.
    ///
    /// # Errors
    /// [`Error::RankMismatch`] on every rank where they differ; a failure of any rank.
    pub fn agree(&self, token: u64) -> Result<()> {
        let want = self.send_counted(Msg::Agree(token))?;
        self.wait_for(want)
    }

    /// Every rank's `mine` (a few bytes: what the ranks must agree on, e.g. the step times of
    /// cfc.fsdp's step check), in rank order, on every rank: a round of the engine's
    /// own links, in order with the jobs, that a failure anywhere ends as it ends any wait
    /// (where a collective of the caller's process group would wait for its timeout).
    ///
    /// # Errors
    /// [`Error::Transport`] for more than [`transport::MESSAGE_FLOOR`] bytes (nothing is sent);
    /// a failure of any rank; the timeout.
    pub fn gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        if mine.len() > transport::MESSAGE_FLOOR {
            return Err(Error::Transport(format!(
                "a gather of {} bytes; it takes at most {}",
                mine.len(),
                transport::MESSAGE_FLOOR
            )));
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        let want = self.send_counted(Msg::Gather(mine.to_vec(), tx))?;
        self.wait_for(want)?;
        rx.try_recv()
            .map_err(|_| Error::Transport("internal: a gather published without its bytes".into()))
    }

    /// Fails this rank with `reason` (an error of the caller's, e.g. an exception in a hook):
    /// every rank's next wait reports it, and every later job is refused. The failure is at the
    /// next point (see `control.rs`): this rank's peers finish the jobs it submitted, and this
    /// rank gives up at its next job, wait, step end or close, as they do.
    pub fn fail(&self, reason: &str) {
        let next = self.points.load(std::sync::atomic::Ordering::SeqCst) + 1;
        self.control.raise(
            Failure {
                rank: self.rank,
                reason: reason.to_string(),
                at: next,
            },
            true,
        );
    }

    /// What the engine has done so far.
    pub fn stats(&self) -> Stats {
        self.shared.stats().clone()
    }

    /// Forgets every bucket (after the jobs submitted so far): the warm-up and the trial start
    /// again, residuals of later jobs are the caller's.
    ///
    /// # Errors
    /// The engine's thread has ended.
    pub fn reset(&self) -> Result<()> {
        self.send_counted(Msg::Reset).map(|_| ())
    }

    /// What a checkpoint needs of the engine (after the jobs submitted so far).
    ///
    /// # Errors
    /// The engine's thread has ended.
    pub fn state(&self) -> Result<EngineState> {
        self.ask(Msg::State)
    }

    /// The ways of the next step, for callers that send plain buckets themselves (`cfc.fsdp`
    /// sends them through torch's own reduce-scatter): whether every bucket goes plain (the
    /// step check's plain steps, or its verdict: `step_check.rs`), and the keys the trial
    /// chose plain. Read after a step's end, it is the same on every rank.
    ///
    /// # Errors
    /// The engine's thread has ended.
    pub fn ways(&self) -> Result<(bool, Vec<u64>)> {
        self.ask(Msg::Ways)
    }

    /// Replaces the engine's state with a checkpoint's (before the next job).
    ///
    /// # Errors
    /// A state whose origin (where its warm-up began) is past its step; the engine's thread
    /// has ended.
    pub fn load_state(&self, state: EngineState) -> Result<()> {
        if state.origin > state.step {
            return Err(Error::Transport(format!(
                "a checkpoint whose warm-up began at step {}, past its step {}",
                state.origin, state.step
            )));
        }
        self.ask(|tx| Msg::Load(state, tx))
    }

    /// Sends the comm thread a message carrying a reply channel (`msg` makes it) and waits for
    /// the answer, at most as long as any wait of the handle ([`Engine::patience`]).
    fn ask<R>(&self, msg: impl FnOnce(Sender<R>) -> Msg) -> Result<R> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.send(msg(tx))?;
        rx.recv_timeout(self.patience())
            .map_err(|_| Error::Transport("the engine's thread did not answer".into()))
    }

    /// How long the handle waits for the comm thread: twice the timeout and 10 s (the thread's
    /// own waits end within the timeout).
    fn patience(&self) -> Duration {
        self.options.timeout * 2 + Duration::from_secs(10)
    }

    /// Makes `fault` happen at the next compressed job (for tests of failure handling).
    ///
    /// # Errors
    /// The engine's thread has ended.
    pub fn inject(&self, fault: Fault) -> Result<()> {
        self.send(Msg::Inject(fault))
    }

    /// Finishes the jobs submitted, then stops the engine's thread and closes its links (its
    /// peers then know it left on purpose). Waits at most as long as [`Engine::wait`] (twice
    /// the timeout and 10 s, then a grace of 10 s where the thread is still at work). A failure
    /// is not reported again here: [`Engine::wait`] and [`Engine::submit`] report it.
    ///
    /// # Errors
    /// [`Error::Timeout`] when the thread does not end in time (it is then left to end alone).
    pub fn close(&self) -> Result<()> {
        let handle = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(handle) = handle else {
            return Ok(());
        };
        // One deadline for the whole close: the thread ends right after the stop's outcome is
        // published, so the wait for that is the wait for the thread.
        let limit = self.options.timeout * 2 + Duration::from_secs(10) + GIVE_UP_GRACE;
        let t0 = Instant::now();
        let _ = self
            .send_counted(Msg::Stop)
            .and_then(|want| self.wait_for(want));
        while !handle.is_finished() && t0.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(1));
        }
        if !handle.is_finished() {
            return Err(Error::Timeout {
                peer: self.rank,
                seconds: limit.as_secs_f64(),
            });
        }
        let _ = handle.join();
        Ok(())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Never waits: the thread stops on its own, and is kept in DROPPED so that a process
        // about to exit can wait for it (settle_dropped).
        let handle = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(handle) = handle {
            let _ = self.tx.send(Msg::Stop);
            let mut dropped = DROPPED.lock().unwrap_or_else(|e| e.into_inner());
            join_finished(&mut dropped);
            dropped.push(handle);
        }
    }
}

/// The threads of engines dropped without [`Engine::close`]. Each ends on its own once it has
/// finalized its NCCL communicator and freed its memory; a process that exits while one is
/// still at it unloads CUDA and NCCL under it (4 ranks on GPUs that dropped their engines
/// without closing them crashed at exit; closed, they did not). [`settle_dropped`] waits for
/// them.
static DROPPED: Mutex<Vec<std::thread::JoinHandle<()>>> = Mutex::new(Vec::new());

/// Joins the threads of `handles` that have ended, and keeps the others.
fn join_finished(handles: &mut Vec<std::thread::JoinHandle<()>>) {
    let (done, running): (Vec<_>, Vec<_>) = handles.drain(..).partition(|h| h.is_finished());
    *handles = running;
    for h in done {
        let _ = h.join();
    }
}

/// Waits at most `limit` for the threads of engines dropped without [`Engine::close`] to end
/// (for a process about to exit); returns how many still run.
pub fn settle_dropped(limit: Duration) -> usize {
    let t0 = Instant::now();
    loop {
        let left = {
            let mut dropped = DROPPED.lock().unwrap_or_else(|e| e.into_inner());
            join_finished(&mut dropped);
            dropped.len()
        };
        if left == 0 || t0.elapsed() >= limit {
            return left;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[cfg(test)]
mod tests;
