//! A DDP step's CUDA buckets through [`BucketExchange`] on a thread of cfc's own, with no
//! Python on it: what `cfc_hook` runs in the steps after its warm-up and trial when the state
//! asks for it (`CfcState._use_pipeline`; the Python comm thread otherwise, which measured as
//! fast at one rank: `docs/perf-notes.md`, "The native bucket pipeline").
//!
//! The hook (on PyTorch's autograd thread) calls [`BucketPipeline::submit`] once per bucket:
//! that records an event on the hook's stream (the bucket's gradient is ready there) and hands
//! the bucket to the pipeline's thread, which returns at once. The thread makes its own stream
//! wait for that event and runs the bucket as the Python engine's comm thread does, in the
//! same order of collectives: a compressed bucket's launch (sum of squares, compression, the
//! all-gather of frames), then the finish of the bucket before it (the wait for the frame
//! sizes, the decoded average into the bucket), so that one bucket is on the wire while the
//! next is compressed; a plain bucket is NCCL's average on the same communicator. At the step's
//! last bucket the hook calls [`BucketPipeline::end_step`], which finishes the last bucket,
//! waits for the GPU (within the communicator's timeout) and reports the step.
//!
//! Why a thread with no Python: the Python comm thread needed Python's lock for every call it
//! made, and each time it held it, the autograd thread, which the hook runs on, waited for it
//! at its next call into torch. This one shares no lock with the autograd thread but the
//! channel's.
//!
//! Memory: each compressed bucket needs its row, every rank's rows and a workspace. They come
//! from two buffers used in turn, grown as needed: bucket `k` uses the buffer of bucket `k - 2`,
//! whose decoding was queued before on the same stream, so the stream's order keeps them apart.
//! A buffer that grows, and the rows of a frame sent again, are freed at the step's end, after
//! the wait for the GPU.

use crate::bucket_exchange::{
    BucketExchange, Finish, FinishArgs, LaunchArgs, ScratchLayout, ROW_HEAD,
};
use crate::cuda::{self, driver_err, ContextGuard};
use crate::error::{Error, Result};
use crate::format::DType;
use crate::gpu_memory::{DeviceBuffer, PinnedBuffer};
use crate::Bound;
use crossbeam_channel::{unbounded, Receiver, Sender};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

/// An exchange shared between the Python engine (which calls it between steps of its own) and
/// a pipeline; `None` once closed.
pub type SharedExchange = Arc<Mutex<Option<BucketExchange>>>;

/// The bound of a compressed bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum JobBound {
    /// This absolute bound.
    Abs(f64),
    /// This multiple of the RMS of the bucket's own values (with its residual), measured now:
    /// the thread waits for that sum. A bucket's first compressed step with an `rms` bound;
    /// later steps take the sum of the step before (`Abs`, computed by the caller).
    RmsOfThisStep(f64),
}

/// A compressed bucket's options.
#[derive(Debug, Clone, Copy)]
pub struct CompressJob {
    /// The bound.
    pub bound: JobBound,
    /// 8 bytes of pinned host memory where the sum of squares of the bucket's values (with its
    /// residual) goes, for the next step's `rms` bound; 0 for none.
    pub sum_out: u64,
    /// Frame bytes the exchange carries per rank (see [`crate::bucket_exchange::next_slot`]);
    /// 0 for the sizes only.
    pub slot: u64,
    /// 8 bytes of device memory holding the largest error sent so far (f64 bits), raised by
    /// this bucket's residual; 0 for none.
    pub max_error: u64,
}

/// One bucket (or one part of a bucket: any tensor the caller keeps apart under its key).
#[derive(Debug, Clone, Copy)]
pub struct Job {
    /// The bucket's key: unique within a step.
    pub key: u64,
    /// `n` elements of `dtype`, averaged in place; device memory of the exchange's device.
    pub data: u64,
    /// Elements.
    pub n: u64,
    /// float32, bfloat16 or float16.
    pub dtype: DType,
    /// `n` float32 residuals (error feedback, updated in place), or 0 for none.
    pub residual: u64,
    /// `Some`: compressed; `None`: NCCL's plain average.
    pub compress: Option<CompressJob>,
}

/// What a step's buckets did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepReport {
    /// Bytes this rank sent (frames sent again included; a plain bucket counts a ring
    /// all-reduce's).
    pub sent: u64,
    /// Frames that outgrew a slot that was not 0 and were sent again.
    pub resends: u64,
    /// Seconds the thread spent on the step's buckets (waits for the frame sizes included,
    /// waits for the next bucket not).
    pub seconds: f64,
    /// The largest bound used.
    pub eps: f64,
    /// `(key, slot)` for each compressed bucket's next exchange.
    pub slots: Vec<(u64, u64)>,
}

enum Msg {
    Job(Job, Arc<CudaEvent>),
    EndStep(Sender<Result<StepReport>>),
    Sync(Sender<()>),
    Corrupt(u64),
    Stop,
}

/// The thread and its channel; see the module.
pub struct BucketPipeline {
    ctx: Arc<CudaContext>,
    tx: Sender<Msg>,
    thread: Option<JoinHandle<()>>,
    /// Per key, the event [`Self::submit`] records on the caller's stream.
    ready: HashMap<u64, Arc<CudaEvent>>,
}

impl std::fmt::Debug for BucketPipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BucketPipeline")
            .field("buckets", &self.ready.len())
            .finish()
    }
}

impl BucketPipeline {
    /// A pipeline over `exchange`, whose decoded sums are multiplied by `scale` (`1 / world` as
    /// an f32 for an average). Starts its thread.
    ///
    /// # Errors
    /// A closed exchange; CUDA errors.
    pub fn new(exchange: SharedExchange, scale: f32) -> Result<BucketPipeline> {
        let (ctx, device, world) = {
            let mut guard = exchange.lock().unwrap_or_else(|p| p.into_inner());
            let comm = guard.as_mut().ok_or_else(closed)?.communicator();
            (comm.context().clone(), comm.device(), comm.world())
        };
        let _restore = ContextGuard::save()?;
        let stream = ctx.new_stream().map_err(driver_err)?;
        let worker = Worker {
            exchange,
            ctx: ctx.clone(),
            stream,
            device,
            world: world as u64,
            scale,
            ring: [None, None],
            turn: 0,
            retired: Vec::new(),
            sum_ws: DeviceBuffer::new(&ctx, cuda::SUM_SQUARES_WORKSPACE as usize)?,
            sum_host: PinnedBuffer::new(&ctx, 8)?,
            deferred: None,
            report: StepReport::default(),
            failed: None,
            corrupt: None,
        };
        let (tx, rx) = unbounded();
        let thread = std::thread::Builder::new()
            .name("cfc-pipeline".into())
            .spawn(move || worker.run(rx))
            .map_err(|e| Error::Transport(format!("could not start cfc's bucket thread: {e}")))?;
        Ok(BucketPipeline {
            ctx,
            tx,
            thread: Some(thread),
            ready: HashMap::new(),
        })
    }

    /// Hands a bucket to the thread, after the work queued so far on `stream` (the caller's).
    /// Returns at once; an error of the bucket's own work shows at [`Self::end_step`].
    ///
    /// # Safety
    /// Every address of `job` must stay valid, and `data` and `residual` unwritten by anyone
    /// else, until [`Self::end_step`] has returned; `stream` a live stream of the exchange
    /// device's primary context.
    ///
    /// # Errors
    /// A job that cannot be run (no elements, a null address, a dtype other than float32,
    /// bfloat16 or float16, a bound that is not positive and finite); CUDA errors; a thread
    /// that has stopped.
    pub unsafe fn submit(&mut self, stream: usize, job: Job) -> Result<()> {
        if job.n == 0
            || job.data == 0
            || !matches!(job.dtype, DType::F32 | DType::BF16 | DType::F16)
        {
            return Err(Error::Transport(format!(
                "bucket {}: {} elements of {:?} at {:#x} (a pipeline takes float32, bfloat16 \
                 or float16 buckets of at least one element)",
                job.key, job.n, job.dtype, job.data
            )));
        }
        if let Some(c) = &job.compress {
            let (JobBound::Abs(b) | JobBound::RmsOfThisStep(b)) = c.bound;
            if !(b.is_finite() && b > 0.0) {
                return Err(Error::Transport(format!(
                    "bucket {}: a bound of {b} (positive and finite)",
                    job.key
                )));
            }
        }
        let _restore = ContextGuard::save()?;
        self.ctx.bind_to_thread().map_err(driver_err)?;
        let event = match self.ready.get(&job.key) {
            Some(e) => e.clone(),
            None => {
                let e = Arc::new(self.ctx.new_event(None).map_err(driver_err)?);
                self.ready.insert(job.key, e.clone());
                e
            }
        };
        // SAFETY: `stream` is a live stream of this context (this function's contract); a
        // borrowed stream is never destroyed by cudarc.
        let caller = unsafe {
            self.ctx
                .wrap_borrowed_stream(stream as cudarc::driver::sys::CUstream)
        };
        event.record(&caller).map_err(driver_err)?;
        self.tx.send(Msg::Job(job, event)).map_err(|_| stopped())
    }

    /// Finishes the step: the last bucket's exchange, the wait for the GPU (the exchanges
    /// within the communicator's timeout), and the check of every frame decoded. Returns what
    /// the step's buckets did.
    ///
    /// # Errors
    /// The first error of the step's buckets (later buckets were not run), or of an earlier
    /// step's ("failed earlier"); a frame that failed its check on the device; a thread that
    /// has stopped.
    pub fn end_step(&mut self) -> Result<StepReport> {
        let (reply, answer) = crossbeam_channel::bounded(1);
        self.tx.send(Msg::EndStep(reply)).map_err(|_| stopped())?;
        answer.recv().map_err(|_| stopped())?
    }

    /// Fault injection, for tests of the frame checks: the next time bucket `key` is finished,
    /// the first byte of rank 0's frame is overwritten after it arrived, before it is decoded
    /// (the frame then fails its check on the device, as one corrupted in transit would).
    ///
    /// # Errors
    /// A thread that has stopped.
    pub fn corrupt_next_received(&mut self, key: u64) -> Result<()> {
        self.tx.send(Msg::Corrupt(key)).map_err(|_| stopped())
    }

    /// Waits until the thread has handled every bucket submitted so far (a bucket whose finish
    /// waits for the next one's launch stays in flight).
    ///
    /// # Errors
    /// A thread that has stopped.
    pub fn sync(&mut self) -> Result<()> {
        let (reply, answer) = crossbeam_channel::bounded(1);
        self.tx.send(Msg::Sync(reply)).map_err(|_| stopped())?;
        answer.recv().map_err(|_| stopped())
    }

    /// Buckets with an event kept here: every key submitted and not forgotten.
    pub fn buckets(&self) -> usize {
        self.ready.len()
    }

    /// Lets go of the events kept for `keys`: buckets that will not run again. (A bucket still
    /// queued holds its event until the thread is done with it.) Returns how many went.
    pub fn forget(&mut self, keys: &[u64]) -> usize {
        keys.iter()
            .filter(|k| self.ready.remove(k).is_some())
            .count()
    }
}

impl Drop for BucketPipeline {
    fn drop(&mut self) {
        let _ = self.tx.send(Msg::Stop);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("cfc's bucket thread panicked");
            }
        }
    }
}

fn closed() -> Error {
    Error::Transport("the bucket exchange was closed".into())
}

fn stopped() -> Error {
    Error::Transport("cfc's bucket thread has stopped".into())
}

/// Bytes one rank sends in a ring all-reduce of `bytes` (what a plain bucket counts).
fn ring_bytes(bytes: u64, world: u64) -> u64 {
    2 * (world - 1) * bytes.div_ceil(world)
}

/// A compressed bucket launched and not yet finished.
struct Deferred {
    key: u64,
    slot: u64,
    /// Every rank's rows.
    recv: u64,
    workspace: u64,
    workspace_len: u64,
    busy: f64,
}

/// The thread's state.
struct Worker {
    exchange: SharedExchange,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    device: usize,
    world: u64,
    scale: f32,
    ring: [Option<DeviceBuffer>; 2],
    turn: usize,
    /// Buffers the GPU may still use, freed after the step's wait.
    retired: Vec<DeviceBuffer>,
    sum_ws: DeviceBuffer,
    /// Where a sum measured for this step's bound lands when the job names no place.
    sum_host: PinnedBuffer,
    deferred: Option<Deferred>,
    report: StepReport,
    /// The first failure, and then its message for every later step.
    failed: Option<(Option<Error>, String)>,
    /// [`BucketPipeline::corrupt_next_received`]'s bucket.
    corrupt: Option<u64>,
}

impl Worker {
    fn run(mut self, rx: Receiver<Msg>) {
        if let Err(e) = self.ctx.bind_to_thread().map_err(driver_err) {
            self.fail(e);
        }
        while let Ok(msg) = rx.recv() {
            match msg {
                Msg::Job(job, ready) => {
                    if self.failed.is_none() {
                        if let Err(e) = self.job(&job, &ready) {
                            self.fail(e);
                        }
                    }
                }
                Msg::EndStep(reply) => {
                    let r = self.end_step();
                    let _ = reply.send(r);
                }
                Msg::Sync(reply) => {
                    let _ = reply.send(());
                }
                Msg::Corrupt(key) => self.corrupt = Some(key),
                Msg::Stop => break,
            }
        }
        // Stopped mid-step (or the owner is gone): what is in flight is finished, as far as
        // the peers take part (the waits have the communicator's timeout), so that nothing the
        // GPU still writes is freed.
        if self.deferred.is_some() || !self.retired.is_empty() {
            if let Err(e) = self.end_step() {
                tracing::warn!(error = %e, "cfc's bucket thread stopped with work in flight");
            }
        }
    }

    fn fail(&mut self, e: Error) {
        tracing::error!(error = %e, "cfc's bucket thread failed");
        if let Some(d) = self.deferred.take() {
            // Not finished now: its key would stay in flight in the exchange for good, which
            // then refuses to launch or forget it. (What it queued is waited for at the step's
            // end, which comes after every failure.)
            let exchange = self.exchange.clone();
            let mut guard = exchange.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(ex) = guard.as_mut() {
                ex.abandon(d.key);
            }
        }
        if self.failed.is_none() {
            let msg = e.to_string();
            self.failed = Some((Some(e), msg));
        }
    }

    fn job(&mut self, job: &Job, ready: &CudaEvent) -> Result<()> {
        let t0 = Instant::now();
        self.stream.wait(ready).map_err(driver_err)?;
        let exchange = self.exchange.clone();
        let mut guard = exchange.lock().unwrap_or_else(|p| p.into_inner());
        let ex = guard.as_mut().ok_or_else(closed)?;
        let raw = self.stream.cu_stream() as usize;
        let Some(c) = job.compress else {
            // SAFETY: `submit`'s contract.
            unsafe { ex.plain(raw, job.data, job.n, job.dtype)? };
            self.report.sent += ring_bytes(job.n * job.dtype.size() as u64, self.world);
            self.report.seconds += t0.elapsed().as_secs_f64();
            return self.finish_deferred(ex);
        };
        let (eps, sum_squares) = match c.bound {
            JobBound::Abs(eps) => (
                eps,
                (c.sum_out != 0).then_some((self.sum_ws.ptr(), c.sum_out)),
            ),
            JobBound::RmsOfThisStep(multiple) => {
                (self.measure(ex, job, c.sum_out, multiple)?, None)
            }
        };
        let layout =
            ScratchLayout::new(job.n, job.dtype, eps, job.residual != 0, c.slot, self.world);
        let base = self.scratch(layout.len)?;
        let args = LaunchArgs {
            key: job.key,
            stream: raw,
            data: job.data,
            n: job.n,
            dtype: job.dtype,
            residual: job.residual,
            bound: Bound::Abs(eps),
            row: base,
            capacity: layout.capacity,
            workspace: base + layout.workspace_at,
            workspace_len: layout.workspace_len,
            sum_squares,
            slot: layout.slot,
            recv: base + layout.recv_at,
            max_error: if job.residual != 0 { c.max_error } else { 0 },
        };
        // SAFETY: the scratch buffer holds the row, the rows and the workspace at the offsets
        // above and lives until the step's end; the rest is `submit`'s contract.
        unsafe { ex.launch(&args)? };
        self.report.eps = self.report.eps.max(eps);
        let busy = t0.elapsed().as_secs_f64();
        // This bucket is the one deferred from here on, even if finishing the one before fails
        // (then `fail` gives up on it).
        let before = self.deferred.replace(Deferred {
            key: job.key,
            slot: layout.slot,
            recv: base + layout.recv_at,
            workspace: base + layout.workspace_at,
            workspace_len: layout.workspace_len,
            busy,
        });
        self.finish(ex, before)
    }

    /// The bound `multiple x` the RMS of the bucket's finite values (with its residual), waited
    /// for; the sum is left at `sum_out` (0: the thread's own place) for the next step's bound.
    /// An all-zero (or all non-finite) bucket takes any positive bound, 1e-30. The wait goes
    /// through the communicator: the stream may hold an earlier plain bucket's all-reduce,
    /// which a peer that is gone never finishes (an error after the timeout, not a hang).
    fn measure(
        &mut self,
        ex: &mut BucketExchange,
        job: &Job,
        sum_out: u64,
        multiple: f64,
    ) -> Result<f64> {
        let out = if sum_out != 0 {
            sum_out
        } else {
            self.sum_host.addr()
        };
        // SAFETY: `submit`'s contract for the bucket and its residual; the workspace is the
        // thread's; `out` 8 bytes of pinned memory (the job's contract, or the thread's).
        unsafe {
            cuda::sum_squares(&cuda::SumSquaresArgs {
                device: self.device,
                stream: self.stream.cu_stream() as usize,
                data: job.data,
                n: job.n,
                dtype: job.dtype,
                residual: job.residual,
                workspace: self.sum_ws.ptr(),
                out,
            })?;
        }
        ex.communicator().wait(&self.stream)?;
        // SAFETY: 8 bytes of pinned memory the copy above wrote and the stream has finished.
        let sum = unsafe { std::ptr::read_volatile(out as *const f64) };
        let rms = (sum / job.n.max(1) as f64).sqrt();
        Ok(if rms > 0.0 && rms.is_finite() {
            multiple * rms
        } else {
            1e-30
        })
    }

    /// The address of this bucket's scratch buffer, at least `len` bytes.
    fn scratch(&mut self, len: u64) -> Result<u64> {
        let turn = self.turn;
        self.turn ^= 1;
        let slot = &mut self.ring[turn];
        if slot.as_ref().is_none_or(|b| (b.len() as u64) < len) {
            // Grown by a quarter more, so that buckets that grow a little do not reallocate at
            // every step; the old buffer may still be read by a decoding in flight.
            let grown = DeviceBuffer::new(&self.ctx, (len + len / 4) as usize)?;
            if let Some(old) = slot.replace(grown) {
                self.retired.push(old);
            }
        }
        Ok(slot.as_ref().expect("set above").ptr())
    }

    fn finish_deferred(&mut self, ex: &mut BucketExchange) -> Result<()> {
        let d = self.deferred.take();
        self.finish(ex, d)
    }

    /// Finishes `d`'s exchange (if any); on an error, gives up on it in the exchange (a
    /// failure may come before or after the exchange's own `finish`, e.g. allocating the rows
    /// of a resend), so that its key is not left in flight.
    fn finish(&mut self, ex: &mut BucketExchange, d: Option<Deferred>) -> Result<()> {
        let Some(d) = d else {
            return Ok(());
        };
        let key = d.key;
        let done = self.finish_one(ex, d);
        if done.is_err() {
            ex.abandon(key);
        }
        done
    }

    fn finish_one(&mut self, ex: &mut BucketExchange, d: Deferred) -> Result<()> {
        let t0 = Instant::now();
        if self.corrupt == Some(d.key) {
            self.corrupt = None;
            ex.wait_exchanges()?; // the frames have arrived
                                  // SAFETY: the rows hold rank 0's head and at least its frame's first byte (a frame
                                  // is never empty); the stream's later decoding reads it.
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    d.recv + ROW_HEAD,
                    b'X',
                    1,
                    self.stream.cu_stream(),
                )
            }
            .map_err(driver_err)?;
        }
        let mut args = FinishArgs {
            key: d.key,
            stream: self.stream.cu_stream() as usize,
            scale: self.scale,
            workspace: d.workspace,
            workspace_len: d.workspace_len,
            resend_recv: 0,
        };
        // SAFETY: the workspace is the bucket's scratch (live until the step's end); the rest
        // is `submit`'s contract.
        let mut done = unsafe { ex.finish(&args)? };
        if let Finish::Resend { row_len } = done {
            let rows = DeviceBuffer::new(&self.ctx, (self.world * row_len) as usize)?;
            args.resend_recv = rows.ptr();
            self.retired.push(rows);
            // SAFETY: as above; `rows` holds `world` rows of `row_len` bytes until the step's end.
            done = unsafe { ex.finish(&args)? };
            if d.slot != 0 {
                self.report.resends += 1;
            }
        }
        let Finish::Done { sent, next_slot } = done else {
            return Err(Error::Transport(format!(
                "bucket {}: the exchange asked for a second resend",
                d.key
            )));
        };
        self.report.sent += sent;
        self.report.slots.push((d.key, next_slot));
        self.report.seconds += d.busy + t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// Waits for the thread's stream to finish everything queued on it, whatever a wait
    /// through the communicator gave before. The stream holds decodings into the callers'
    /// tensors and compressions of them, which must be done before `end_step` returns (the
    /// callers may then free them). A failed wait through the communicator aborted it, or found
    /// it aborted or closed, so NCCL's kernels have returned and this wait ends.
    fn drain_stream(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver_err)
    }

    fn end_step(&mut self) -> Result<StepReport> {
        let exchange = self.exchange.clone();
        let mut guard = exchange.lock().unwrap_or_else(|p| p.into_inner());
        let result = match guard.as_mut() {
            None => {
                // (a closed exchange's communicator is gone, and its kernels with it)
                let _ = self.drain_stream();
                Err(closed())
            }
            Some(ex) => {
                let finished = if self.failed.is_none() {
                    self.finish_deferred(ex)
                } else {
                    Ok(())
                };
                // Waited for even after a failure, so that the buffers are free to go: the
                // exchanges and this thread's stream through the communicator (the timeout),
                // then the stream in full whatever that gave (drain_stream).
                let waited = ex
                    .wait_exchanges()
                    .and_then(|()| ex.communicator().wait(&self.stream));
                let drained = self.drain_stream();
                finished
                    .and(waited)
                    .and(drained)
                    .and_then(|()| ex.check_frames_seen())
            }
        };
        drop(guard);
        if let Err(e) = result {
            self.fail(e);
        }
        self.retired.clear();
        let report = std::mem::take(&mut self.report);
        match &mut self.failed {
            None => Ok(report),
            Some((first, msg)) => Err(first.take().unwrap_or_else(|| {
                Error::Transport(format!("cfc's bucket thread failed earlier: {msg}"))
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_bucket_counts_a_ring_all_reduce() {
        assert_eq!(ring_bytes(1000, 2), 1000);
        assert_eq!(ring_bytes(1000, 4), 2 * 3 * 250);
        assert_eq!(ring_bytes(1001, 4), 2 * 3 * 251);
        assert_eq!(ring_bytes(1000, 1), 0);
    }
}
