//! The compressed all-reduce of data that lives on the GPU, over NCCL.
//!
//! Each rank compresses its buffer on the device with error feedback (the [`crate::cuda`]
//! codec: the bytes of the CPU codec), the frames are all-gathered with NCCL, and every rank
//! decodes and adds all frames in rank order in one pass that writes the average (or the sum)
//! over its input: the same bits on every rank. This is the all-gather variant of
//! [`crate::collective`]; with frames compressed at one bound, the result is within `eps` of
//! the exact average (each rank's rounding error is at most `eps`, and its residual carries
//! that error into the next call).
//!
//! Frame sizes depend on the data, and NCCL needs byte counts on the host. Each frame travels
//! in a slot sized from the chunk's previous frames (`bucket_exchange::next_slot`), after
//! a 16-byte row head that holds its size; the host reads every rank's size once the exchange
//! is done, and a frame too big for its slot (every rank sees it) is sent again, whole. The
//! first call sends only the heads and then the frames: two exchanges.
//!
//! Large buffers are cut into chunks (`chunk_numel` elements). All chunks are compressed on the
//! caller's stream and exchanged on a stream of the reducer's own, one behind the other, so
//! the exchange of one chunk overlaps the compression of the next; decoding follows, on the
//! caller's stream. [`GpuAllReducer::allreduce`] returns once every exchange is done and the
//! decoding is queued: it waits for the frame sizes, never for the decoding.
//!
//! Where compression does not pay (a fast link such as NVLink, a small buffer), the reducer
//! can give way to NCCL's own all-reduce ([`Fallback`]): always, or after timing both ways on
//! the first calls with a buffer ([`Fallback::Auto`]). Error feedback survives the switch: the
//! residuals are added to the input before it goes out uncompressed.

use crate::collective::AllReduceReport;
use crate::cuda;
use crate::cuda::{driver_err, ContextGuard};
use crate::error::{Error, Result};
use crate::format::{DType, FIXED_HEADER_LEN};
use crate::gpu_memory::{DecodeStatus, DeviceBuffer, PinnedBuffer};
use crate::nccl::Communicator;
use crate::Bound;
use cudarc::driver::{result, CudaEvent, CudaStream};
use std::sync::Arc;

/// Bytes before each frame in its row: the frame's size (u64), then padding, so that frames
/// stay 16-byte aligned.
const ROW_HEAD: u64 = 16;

/// When [`GpuAllReducer::allreduce`] sends its input uncompressed, with NCCL's own all-reduce.
///
/// An uncompressed call first adds the residuals of earlier compressed calls to the input (and
/// clears them), so what they dropped still reaches the result; its report has `eps` and
/// `bound` 0 (the result is NCCL's, exact but for its rounding).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// Always compress.
    Never,
    /// Never compress: e.g. for warm-up steps, or to compare.
    Always,
    /// Try both, then keep the faster. The first `2 * trials` calls with a buffer alternate
    /// compressed and uncompressed, each timed from the call to its result on the device after
    /// the ranks have lined up, so that a rank arriving late does not count against a way. (An
    /// uncompressed trial call adds the residuals before its timing starts: after the trial
    /// only the first uncompressed call does that.) Then the ranks exchange their times and all
    /// take the way whose slowest rank's best time was lower, for as long as the size and
    /// options stay the same. `trials` of 0 counts as 1; the first compressed call also sizes
    /// the slots and may compile the kernels, so 2 or more give a fairer choice.
    Auto {
        /// Timed calls of each way.
        trials: u32,
    },
}

impl Fallback {
    fn code(self) -> (u8, u32) {
        match self {
            Fallback::Never => (0, 0),
            Fallback::Always => (1, 0),
            Fallback::Auto { trials } => (2, trials.max(1)),
        }
    }
}

/// Options of [`GpuAllReducer::allreduce`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuAllReduceOptions {
    /// Each rank's quantization bound; only `Bound::Abs(eps)` (all ranks on one grid).
    pub bound: Bound,
    /// Divide the sum by the number of ranks (by multiplying with `1 / world` rounded to f32).
    pub average: bool,
    /// Error feedback: keep what each rank's quantization drops and add it to its next call.
    pub feedback: bool,
    /// Elements per chunk.
    pub chunk_numel: u64,
    /// When to send the input uncompressed instead.
    pub fallback: Fallback,
}

impl GpuAllReduceOptions {
    /// An average with error feedback, in chunks of 64 Mi elements (256 MB of float32: over
    /// NVLink, 256 MB chunks took 1.05-1.14 ms for 256 MB against 1.16-1.24 ms with 64 MB
    /// chunks and 2.4 ms with 16 MB ones, `docs/perf-notes.md`; over sockets they were as fast),
    /// always compressed.
    pub fn new(eps: f64) -> GpuAllReduceOptions {
        GpuAllReduceOptions {
            bound: Bound::Abs(eps),
            average: true,
            feedback: true,
            chunk_numel: 1 << 26,
            fallback: Fallback::Never,
        }
    }
}

/// One chunk's place in the buffers.
struct Chunk {
    /// First element and element count.
    start: u64,
    len: u64,
    /// Frame capacity (bytes, a multiple of 16).
    cap: u64,
    /// Offsets of its row in `rows` and of its rows in `recv`.
    row_at: u64,
    recv_at: u64,
    /// Frame bytes its next exchange carries (0: sizes only).
    slot: u64,
}

/// How a plan's calls go.
enum Way {
    Compress,
    Plain,
    /// [`Fallback::Auto`]'s trial: the seconds of each timed call so far, and how many of each
    /// way it takes.
    Trial {
        compressed: Vec<f64>,
        plain: Vec<f64>,
        trials: usize,
    },
}

/// Everything sized for one (buffer, options) that all ranks agreed on.
struct Plan {
    descriptor: Vec<u8>,
    chunks: Vec<Chunk>,
    rows: DeviceBuffer,
    recv: DeviceBuffer,
    workspace: DeviceBuffer,
    sum_workspace: DeviceBuffer,
    residual: Option<DeviceBuffer>,
    sizes: PinnedBuffer,
    /// 16 bytes per rank and this rank's: [`GpuAllReducer::exchange16`].
    probe: DeviceBuffer,
    way: Way,
    /// Whether the residuals may hold something (a compressed call since they were last added
    /// to an uncompressed one).
    residual_dirty: bool,
}

/// One call of [`GpuAllReducer::allreduce`], its arguments checked: the caller's stream
/// (borrowed, and as the raw handle the kernels take), the tensor, and the absolute bound.
struct Call<'a> {
    caller: Arc<CudaStream>,
    stream: usize,
    data: u64,
    n: u64,
    dtype: DType,
    eps: f64,
    opts: &'a GpuAllReduceOptions,
}

/// One rank's compressed all-reduce of GPU buffers, with its error-feedback residuals.
///
/// Every rank calls [`GpuAllReducer::allreduce`] with the same size, dtype and options, in the
/// same order. The first call with new ones checks that (one small exchange): ranks that
/// disagree all get [`Error::RankMismatch`]. A call whose size and options are those of this
/// rank's last call exchanges nothing first (so as not to wait for the host on every call):
/// where one rank alone changes them, or fails a call before its collectives (a bad argument,
/// an allocation) while the others go on, the collectives of the ranks no longer match, and
/// the ranks fail with an NCCL error or at the communicator's timeout instead. The residuals
/// are kept while the size and options stay the same; a call with others starts afresh. The bound may change from call to call
/// and differ between ranks (each frame carries its step): the average is then within the
/// mean of the ranks' bounds, and the report gives this rank's. With a [`Fallback`], calls
/// may go out uncompressed instead, the same way on every rank.
pub struct GpuAllReducer {
    comm: Communicator,
    stream: Arc<CudaStream>,
    plan: Option<Plan>,
    /// The decoder's status, kept across calls: once a frame fails its check on the device,
    /// nothing more is decoded. Its copy on the host is read where every rank reads the same
    /// (see [`Self::compressed`]).
    status: DecodeStatus,
    /// Recorded on the caller's stream at the end of the last call: the next call's work waits
    /// for it, whatever stream it comes on, since both use the plan's buffers and residuals.
    last_call: Option<CudaEvent>,
}

impl std::fmt::Debug for GpuAllReducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuAllReducer")
            .field("comm", &self.comm)
            .finish()
    }
}

/// The buffer and options every rank must agree on. Not the bound: each frame carries its own
/// step and `decode_sum` adds frames of any steps, so a bound that changes from call to call
/// (e.g. a multiple of the data's RMS) keeps the residuals and needs no new agreement.
fn descriptor(n: u64, dtype: DType, o: &GpuAllReduceOptions) -> Vec<u8> {
    let mut d = Vec::with_capacity(32);
    d.extend_from_slice(&n.to_le_bytes());
    d.push(dtype.code());
    d.push(o.average as u8);
    d.push(o.feedback as u8);
    d.push(0);
    d.extend_from_slice(&o.chunk_numel.to_le_bytes());
    let (fallback, trials) = o.fallback.code();
    d.push(fallback);
    d.extend_from_slice(&[0; 3]);
    d.extend_from_slice(&trials.to_le_bytes());
    d.resize(32, 0);
    d
}

/// A descriptor in words (it may come from a peer: nothing in it is trusted).
fn describe(d: &[u8]) -> String {
    let u64_at = |o: usize| u64::from_le_bytes(d[o..o + 8].try_into().unwrap_or([0; 8]));
    if d.len() != 32 {
        return format!("a descriptor of {} bytes", d.len());
    }
    let dtype = DType::from_code(d[8]).map_or("?", |t| t.name());
    let trials = u32::from_le_bytes([d[24], d[25], d[26], d[27]]);
    let fallback = match d[20] {
        0 => "never".to_string(),
        1 => "always".to_string(),
        2 => format!("auto ({trials} trials)"),
        other => format!("? ({other})"),
    };
    format!(
        "{} x {dtype}, average={}, feedback={}, chunk={}, fallback={fallback}",
        u64_at(0),
        d[9] != 0,
        d[10] != 0,
        u64_at(12)
    )
}

/// [`Fallback::Auto`]'s choice, the same on every rank: every rank's best time of each way
/// (`[compressed, plain]`, in rank order), and whether to compress. The way whose slowest
/// rank was faster wins; compressed on a tie.
fn compress_wins(best: &[[f64; 2]]) -> bool {
    let slowest = |k: usize| best.iter().map(|b| b[k]).fold(0.0, f64::max);
    slowest(0) <= slowest(1)
}

fn round16(x: u64) -> u64 {
    x.div_ceil(16) * 16
}

impl GpuAllReducer {
    /// A reducer over `comm`, with a stream of its own for the exchanges.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn new(comm: Communicator) -> Result<GpuAllReducer> {
        let _restore = ContextGuard::save()?;
        let ctx = comm.context().clone();
        let stream = ctx.new_stream().map_err(driver_err)?;
        Ok(GpuAllReducer {
            comm,
            stream,
            plan: None,
            status: DecodeStatus::new(&ctx)?,
            last_call: None,
        })
    }

    /// Waits for the work of the last call (its all-reduce or exchange, its decoding) to finish
    /// on the device, within the communicator's timeout: a peer that stopped is then an NCCL
    /// error, and the communicator is aborted, where a wait for the caller's stream would
    /// block for good (an uncompressed call's all-reduce is queued on that stream, and nothing
    /// on the host waits for it). After the communicator was aborted (the error was then
    /// reported by the call that met it) there is nothing to wait for: its kernels stopped.
    ///
    /// # Errors
    /// [`Error::Nccl`] (NCCL's message, or the timeout), CUDA errors.
    pub fn wait(&mut self) -> Result<()> {
        if self.comm.aborted().is_some() {
            return Ok(());
        }
        let _restore = ContextGuard::save()?;
        match &self.last_call {
            Some(last) => self.comm.wait_event(last),
            None => Ok(()),
        }
    }

    /// Forgets what the calls so far left (the residuals, [`Fallback::Auto`]'s trial and
    /// choice), after waiting for the last call's work: the next call starts afresh, as a call
    /// with new options does (its first exchange is collective, so every rank resets at the
    /// same point). For a benchmark that runs several bounds one after the other.
    ///
    /// # Errors
    /// As [`GpuAllReducer::wait`].
    pub fn reset(&mut self) -> Result<()> {
        self.wait()?;
        let _restore = ContextGuard::save()?;
        self.plan = None;
        Ok(())
    }

    /// The communicator (e.g. to change its timeout, or for a plain all-reduce).
    pub fn communicator(&mut self) -> &mut Communicator {
        &mut self.comm
    }

    /// Every rank's descriptor, compared on every rank.
    fn agree(&mut self, mine: &[u8]) -> Result<()> {
        let world = self.comm.world();
        let ctx = self.comm.context().clone();
        let buf = DeviceBuffer::new(&ctx, 32 * (world + 1))?;
        let cu = self.stream.cu_stream();
        // SAFETY: `buf` holds the descriptor and every rank's; the stream is waited for before
        // `mine` and `buf` go away.
        unsafe {
            result::memcpy_htod_async(buf.ptr(), mine, cu).map_err(driver_err)?;
            self.comm.all_gather(buf.ptr(), buf.ptr() + 32, 32, cu)?;
        }
        self.comm.wait(&self.stream)?;
        let mut all = vec![0u8; 32 * world];
        // SAFETY: the stream is idle; `all` has room for every descriptor.
        unsafe { result::memcpy_dtoh_sync(&mut all, buf.ptr() + 32) }.map_err(driver_err)?;
        let first = &all[..32];
        if let Some(j) = (1..world).find(|&j| &all[32 * j..32 * (j + 1)] != first) {
            return Err(Error::RankMismatch {
                what: format!("rank 0 has {}", describe(first)),
                theirs: format!("rank {j} has {}", describe(&all[32 * j..32 * (j + 1)])),
            });
        }
        Ok(())
    }

    fn plan(&mut self, n: u64, dtype: DType, o: &GpuAllReduceOptions) -> Result<()> {
        let d = descriptor(n, dtype, o);
        if self.plan.as_ref().is_some_and(|p| p.descriptor == d) {
            return Ok(());
        }
        self.plan = None; // its buffers go before the new ones are made
        self.agree(&d)?;
        let world = self.comm.world() as u64;
        let ctx = self.comm.context().clone();
        let step = o.chunk_numel.max(1);
        let mut chunks = Vec::new();
        let (mut rows_len, mut recv_len, mut ws_len, mut sum_ws_len) = (0u64, 0u64, 0u64, 0u64);
        let mut start = 0;
        while start < n {
            let len = step.min(n - start);
            let cap = round16(cuda::compress_capacity(len, dtype, 1, o.bound));
            chunks.push(Chunk {
                start,
                len,
                cap,
                row_at: rows_len,
                recv_at: recv_len,
                slot: 0,
            });
            rows_len += ROW_HEAD + cap;
            recv_len += world * (ROW_HEAD + cap);
            ws_len = ws_len.max(cuda::compress_workspace_len(len, o.feedback));
            sum_ws_len = sum_ws_len.max(cuda::decode_sum_workspace_len(len, world));
            start += len;
        }
        let residual = if o.feedback && n > 0 {
            let r = DeviceBuffer::new(&ctx, 4 * n as usize)?;
            // SAFETY: `r` holds `4 n` bytes; a synchronous memset, done when it returns.
            unsafe { result::memset_d8_sync(r.ptr(), 0, r.len()) }.map_err(driver_err)?;
            Some(r)
        } else {
            None
        };
        let way = match o.fallback {
            Fallback::Never => Way::Compress,
            Fallback::Always => Way::Plain,
            Fallback::Auto { trials } => Way::Trial {
                compressed: Vec::new(),
                plain: Vec::new(),
                trials: trials.max(1) as usize,
            },
        };
        self.plan = Some(Plan {
            descriptor: d,
            rows: DeviceBuffer::new(&ctx, rows_len as usize)?,
            recv: DeviceBuffer::new(&ctx, recv_len as usize)?,
            workspace: DeviceBuffer::new(&ctx, ws_len as usize)?,
            sum_workspace: DeviceBuffer::new(&ctx, sum_ws_len as usize)?,
            sizes: PinnedBuffer::new(&ctx, 8 * chunks.len().max(1) * world as usize)?,
            probe: DeviceBuffer::new(&ctx, 16 * (world as usize + 1))?,
            chunks,
            residual,
            way,
            residual_dirty: false,
        });
        Ok(())
    }

    /// Whether calls with the current buffer and options are compressed: `None` before the
    /// first call and while [`Fallback::Auto`] is still trying both ways.
    pub fn compressing(&self) -> Option<bool> {
        match self.plan.as_ref().map(|p| &p.way) {
            Some(Way::Compress) => Some(true),
            Some(Way::Plain) => Some(false),
            _ => None,
        }
    }

    /// The error of a frame that failed its check on the device, as far as the copies of the
    /// decoder's status queued so far have arrived. Nothing is waited for: a caller that has
    /// waited for its last call ([`GpuAllReducer::wait`]) learns about every call so far (as
    /// `cfc.distributed.NcclAllReducer.check` does, and its `close`). Compressed calls fail
    /// with the error of an earlier call by themselves, once its copy is certain to be in on
    /// every rank.
    ///
    /// # Errors
    /// [`Error::Transport`] naming the frame's rank and what was wrong with it.
    pub fn check_frames_seen(&self) -> Result<()> {
        self.status.check("an earlier call")
    }

    /// A small exchange of the trial that every rank waits for: `mine` (16 bytes) from every
    /// rank, in rank order. Waits for the caller's earlier work first.
    fn exchange16(&mut self, caller: &Arc<CudaStream>, mine: [u8; 16]) -> Result<Vec<u8>> {
        self.comm.wait(caller)?;
        let world = self.comm.world();
        let buf = self.plan.as_ref().expect("planned by run").probe.ptr();
        let cu = self.stream.cu_stream();
        // SAFETY: the plan's probe holds this rank's 16 bytes and every rank's; the stream is
        // waited for before `mine` goes away, and before the probe is used again.
        unsafe {
            result::memcpy_htod_async(buf, &mine, cu).map_err(driver_err)?;
            self.comm.all_gather(buf, buf + 16, 16, cu)?;
        }
        self.comm.wait(&self.stream)?;
        let mut all = vec![0u8; 16 * world];
        // SAFETY: the stream is idle; `all` has room for every rank's bytes.
        unsafe { result::memcpy_dtoh_sync(&mut all, buf + 16) }.map_err(driver_err)?;
        Ok(all)
    }

    /// Files a trial call's time; after the last one, every rank's best times are exchanged
    /// and the way chosen.
    fn record_trial(
        &mut self,
        caller: &Arc<CudaStream>,
        compressed: bool,
        seconds: f64,
    ) -> Result<()> {
        let Some(Plan {
            way:
                Way::Trial {
                    compressed: c,
                    plain: p,
                    trials,
                },
            ..
        }) = self.plan.as_mut()
        else {
            return Ok(());
        };
        if compressed {
            c.push(seconds)
        } else {
            p.push(seconds)
        }
        if c.len() < *trials || p.len() < *trials {
            return Ok(());
        }
        let best = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
        let mut mine = [0u8; 16];
        mine[..8].copy_from_slice(&best(c).to_le_bytes());
        mine[8..].copy_from_slice(&best(p).to_le_bytes());
        let all = self.exchange16(caller, mine)?;
        let f64_at = |o: usize| f64::from_le_bytes(all[o..o + 8].try_into().unwrap_or([0; 8]));
        let times: Vec<[f64; 2]> = (0..all.len() / 16)
            .map(|j| [f64_at(16 * j), f64_at(16 * j + 8)])
            .collect();
        let compress = compress_wins(&times);
        tracing::debug!(?times, compress, "fallback trial done");
        if let Some(plan) = self.plan.as_mut() {
            plan.way = if compress { Way::Compress } else { Way::Plain };
        }
        Ok(())
    }

    /// Averages (or sums) `n` elements of `dtype` at device address `data` over all ranks, in
    /// place, compressed (or, as `opts.fallback` says, with NCCL's own all-reduce). Compression
    /// and decoding are queued on `stream` (a raw `CUstream` of the communicator's device, e.g.
    /// PyTorch's current stream): the result is there once `stream` reaches this point. Waits
    /// for the exchanges (the frame sizes), not for the decoding; an uncompressed call waits for
    /// nothing, and a call of [`Fallback::Auto`]'s trial for its result.
    ///
    /// # Safety
    /// `data` must be a device address of the communicator's device valid for `n` elements of
    /// `dtype` until the queued work completes; `stream` a live stream of the device's primary
    /// context.
    ///
    /// # Errors
    /// [`Error::InvalidBound`] (only absolute bounds), [`Error::NotQuantizable`],
    /// [`Error::RankMismatch`] (on every rank), [`Error::Nccl`] (NCCL's message, or a peer
    /// that stopped: after the communicator's timeout), [`Error::Transport`] for frame sizes
    /// that no rank could have sent, CUDA errors.
    pub unsafe fn allreduce(
        &mut self,
        stream: usize,
        data: u64,
        n: u64,
        dtype: DType,
        opts: &GpuAllReduceOptions,
    ) -> Result<AllReduceReport> {
        let eps = match opts.bound {
            Bound::Abs(e) => {
                crate::codec::check_abs_bound(e, "eps")?;
                e
            }
            _ => {
                return Err(Error::InvalidBound {
                    what: "bound",
                    reason: "the GPU all-reduce takes an absolute bound (eps), the one grid \
                             every rank's frame is decoded on"
                        .into(),
                })
            }
        };
        if !dtype.is_quantizable() {
            return Err(Error::NotQuantizable(dtype));
        }
        let world = self.comm.world();
        if world as u64 > cuda::MAX_SUM_PARTS {
            return Err(Error::Transport(format!(
                "the GPU all-reduce adds at most {} frames; the communicator has {world} ranks",
                cuda::MAX_SUM_PARTS
            )));
        }
        // Binding the device's context must not outlive the call (PyTorch reads the current
        // context as its current device, which may be another one).
        let _restore = ContextGuard::save()?;
        let device = self.comm.device();
        let call = Call {
            caller: cuda::borrowed_stream(device, stream)?,
            stream,
            data,
            n,
            dtype,
            eps,
            opts,
        };
        let result = self.run(&call);
        if result.is_err() {
            self.plan = None; // the next call agrees afresh (residuals start at zero)
        }
        result
    }

    fn run(&mut self, call: &Call) -> Result<AllReduceReport> {
        let caller = &call.caller;
        // The last call's work (its decoding, on the stream it came on) comes before this
        // one's on the caller's stream: the buffers and residuals are the same.
        if let Some(last) = &self.last_call {
            caller.wait(last).map_err(driver_err)?;
        }
        // The caller's earlier work on `stream` (what wrote `data`) comes first for the
        // agreement's exchange too, on this reducer's stream.
        self.stream
            .wait(&caller.record_event(None).map_err(driver_err)?)
            .map_err(driver_err)?;
        self.plan(call.n, call.dtype, call.opts)?;
        let (compress, trial) = match &self.plan.as_ref().expect("planned above").way {
            Way::Compress => (true, false),
            Way::Plain => (false, false),
            Way::Trial {
                compressed, plain, ..
            } => (compressed.len() <= plain.len(), true),
        };
        // A timed trial call: every rank starts it together, and it ends with the result.
        // An uncompressed one adds the residuals first, untimed: only the first call after
        // compressed ones does that, and every one in the trial would.
        let t0 = if trial {
            if !compress {
                self.fold(call)?;
            }
            self.exchange16(caller, [0; 16])?;
            Some(std::time::Instant::now())
        } else {
            None
        };
        let report = if compress {
            self.compressed(call)?
        } else {
            self.plain(call)?
        };
        self.last_call = Some(caller.record_event(None).map_err(driver_err)?);
        let Some(t0) = t0 else {
            return Ok(report);
        };
        self.comm.wait(caller)?;
        self.record_trial(caller, compress, t0.elapsed().as_secs_f64())?;
        Ok(report)
    }

    /// One call with NCCL's all-reduce of the input, residuals added first.
    fn plain(&mut self, call: &Call) -> Result<AllReduceReport> {
        let world = self.comm.world();
        self.fold(call)?;
        // On the caller's stream, as a plain all-reduce would be: two cross-stream waits cost
        // 1-2% of it over NVLink. (Every earlier exchange of the reducer's stream is already
        // behind the caller's stream: the decoding waited for it.)
        // SAFETY: `data` holds `n` elements of `dtype` until the queued work completes.
        unsafe {
            self.comm.all_reduce(
                call.data,
                call.data,
                call.n as usize,
                call.dtype,
                call.opts.average,
                call.caller.cu_stream(),
            )?
        };
        let ring = crate::collective::ring_bytes(call.n * call.dtype.size() as u64, world);
        Ok(AllReduceReport {
            eps: 0.0,
            bound: 0.0,
            bytes_sent: ring,
            bytes_uncompressed: ring,
        })
    }

    /// Adds the residuals to the input on `stream`, if a compressed call may have left any.
    fn fold(&mut self, call: &Call) -> Result<()> {
        let plan = self.plan.as_mut().expect("planned by run");
        if plan.residual_dirty {
            if let Some(r) = &plan.residual {
                // SAFETY: `data` holds `n` elements of `dtype` (the call's contract) and the
                // residual `n` float32, on the communicator's device.
                unsafe {
                    cuda::fold_residual(
                        self.comm.device(),
                        call.stream,
                        call.data,
                        call.n,
                        call.dtype,
                        r.ptr(),
                    )?
                };
            }
            plan.residual_dirty = false;
        }
        Ok(())
    }

    /// One compressed call.
    fn compressed(&mut self, call: &Call) -> Result<AllReduceReport> {
        let Call {
            ref caller,
            stream,
            data,
            n,
            dtype,
            eps,
            opts,
        } = *call;
        let (world, device) = (self.comm.world() as u64, self.comm.device());
        let size = dtype.size() as u64;
        let ring = crate::collective::ring_bytes(n * size, world as usize);
        let comm_cu = self.stream.cu_stream();
        let plan = self.plan.as_mut().expect("planned by run");
        plan.residual_dirty |= plan.residual.is_some();
        let mut sent = 0u64;
        // 1. Every chunk compressed (caller's stream) and its rows all-gathered (own stream).
        let mut gathered: Vec<CudaEvent> = Vec::with_capacity(plan.chunks.len());
        for (c, ch) in plan.chunks.iter().enumerate() {
            let row = plan.rows.ptr() + ch.row_at;
            let args = cuda::CompressArgs {
                device,
                stream,
                input: data + ch.start * size,
                n: ch.len,
                dtype,
                shape: &[ch.len],
                bound: Bound::Abs(eps),
                out: row + ROW_HEAD,
                out_len: ch.cap,
                workspace: plan.workspace.ptr(),
                workspace_len: plan.workspace.len() as u64,
                residual: plan.residual.as_ref().map_or(0, |r| r.ptr() + 4 * ch.start),
                // The row's head: the frame's size, written by the compressor itself.
                size_to: row,
                max_error_to: 0,
                bound_at: 0,
            };
            let row_len = ROW_HEAD + ch.slot;
            let recv = plan.recv.ptr() + ch.recv_at;
            // SAFETY: every buffer was sized for this chunk by `plan` (rows start 16-aligned);
            // `data` is the caller's (this function's contract); the workspace is reused by the
            // next chunk in the order of the caller's stream.
            unsafe {
                cuda::compress(&args)?;
                let compressed = caller.record_event(None).map_err(driver_err)?;
                self.stream.wait(&compressed).map_err(driver_err)?;
                self.comm.all_gather(row, recv, row_len as usize, comm_cu)?;
                cuda::copy_rows(&cuda::CopyRowsArgs {
                    device,
                    stream: comm_cu as usize,
                    src: recv,
                    src_pitch: row_len,
                    dst: plan.sizes.addr() + 8 * c as u64 * world,
                    dst_pitch: 8,
                    width: 8,
                    rows: world,
                })?;
            }
            sent += (world - 1) * row_len;
            gathered.push(self.stream.record_event(None).map_err(driver_err)?);
        }
        // 2. Each chunk's sizes read, its frames sent again if one outgrew the slot, and
        // every frame decoded and added into the chunk.
        let min_frame = (FIXED_HEADER_LEN + 8) as u64;
        let scale = if opts.average {
            1.0f32 / world as f32
        } else {
            1.0
        };
        for (c, ch) in plan.chunks.iter_mut().enumerate() {
            self.comm.wait_event(&gathered[c])?;
            if c == 0 {
                // The status as the last call's decoding left it: its copy was queued before
                // `last_call`, which this exchange came after, and nothing of this call has
                // been decoded yet. Every rank decoded the same frames, so every rank reads
                // the same here and all stop together, past the same collectives. (The
                // status itself, not check_frames_seen: the plan is borrowed.)
                self.status.check("an earlier call")?;
            }
            let sizes: Vec<u64> = (0..world as usize)
                .map(|j| plan.sizes.u64_at(c * world as usize + j))
                .collect();
            if sizes.iter().any(|&s| s < min_frame || s > ch.cap) {
                return Err(Error::Transport(format!(
                    "ranks sent frame sizes {sizes:?} for a chunk of {} elements (at most {})",
                    ch.len, ch.cap
                )));
            }
            let largest = sizes.iter().copied().max().unwrap_or(0);
            let recv = plan.recv.ptr() + ch.recv_at;
            let mut row_len = ROW_HEAD + ch.slot;
            let mut arrived = None;
            if largest > ch.slot {
                row_len = ROW_HEAD + round16(largest);
                let row = plan.rows.ptr() + ch.row_at;
                // SAFETY: `recv` holds `world` rows of the chunk's full capacity.
                unsafe { self.comm.all_gather(row, recv, row_len as usize, comm_cu)? };
                sent += (world - 1) * row_len;
                arrived = Some(self.stream.record_event(None).map_err(driver_err)?);
            }
            ch.slot = crate::bucket_exchange::next_slot(largest, ch.cap);
            let frames: Vec<u64> = (0..world).map(|j| recv + j * row_len + ROW_HEAD).collect();
            // Decoding waits for this chunk's exchange only, not for the later chunks'.
            caller
                .wait(arrived.as_ref().unwrap_or(&gathered[c]))
                .map_err(driver_err)?;
            // SAFETY: every frame lies in its row (sizes checked above against the capacity,
            // the same on every rank by the agreement); `decode_sum` checks the rest on the
            // device; `data` is the caller's.
            unsafe {
                cuda::decode_sum(&cuda::DecodeSumArgs {
                    device,
                    stream,
                    frames: &frames,
                    frame_lens: &sizes,
                    lens_before: 0,
                    n: ch.len,
                    dtype,
                    ndim: 1,
                    scale,
                    out: data + ch.start * size,
                    out_dtype: dtype,
                    workspace: plan.sum_workspace.ptr(),
                    workspace_len: plan.sum_workspace.len() as u64,
                    status: self.status.ptr(),
                })?;
            }
        }
        // SAFETY: `stream` is the caller's, a live stream of the device's primary context (the
        // call's contract), the context of the status.
        unsafe { self.status.publish(device, stream)? };
        Ok(AllReduceReport {
            eps,
            bound: if opts.average {
                eps
            } else {
                world as f64 * eps
            },
            bytes_sent: sent,
            bytes_uncompressed: ring,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_way_whose_slowest_rank_was_faster_wins() {
        // Rank 1 is slow compressed: its time decides, though rank 0 found compression faster.
        assert!(!compress_wins(&[[1.0, 2.0], [3.0, 2.5]]));
        assert!(compress_wins(&[[1.0, 2.0], [1.5, 2.5]]));
        assert!(compress_wins(&[[2.0, 2.0]]), "a tie compresses");
        assert!(!compress_wins(&[[2.0, 1.0], [0.5, 1.0]]));
    }

    #[test]
    fn descriptors_tell_fallbacks_apart_and_name_them() {
        let o = GpuAllReduceOptions::new(0.1);
        let auto = GpuAllReduceOptions {
            fallback: Fallback::Auto { trials: 3 },
            ..o
        };
        let d = descriptor(10, DType::F32, &auto);
        assert_ne!(d, descriptor(10, DType::F32, &o));
        assert_eq!(d.len(), 32);
        assert!(
            describe(&d).ends_with("fallback=auto (3 trials)"),
            "{}",
            describe(&d)
        );
        let always = GpuAllReduceOptions {
            fallback: Fallback::Always,
            ..o
        };
        assert!(describe(&descriptor(10, DType::BF16, &always)).contains("fallback=always"));
        // The bound is not part of it.
        assert_eq!(
            descriptor(10, DType::F32, &o),
            descriptor(10, DType::F32, &GpuAllReduceOptions::new(0.2))
        );
    }

    /// Whether one GPU and NCCL are here (a failure instead of a skip under
    /// `CFC_REQUIRE_GPU=1`, as on the GPU machine: `scripts/gpu_rust.sh`).
    fn one_gpu() -> bool {
        let why = if cuda::device_count() == 0 {
            Some("no CUDA device".to_string())
        } else {
            crate::nccl::library().err().map(|e| e.to_string())
        };
        match why {
            None => true,
            Some(w) if std::env::var("CFC_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
                panic!("CFC_REQUIRE_GPU=1 but {w}")
            }
            Some(w) => {
                eprintln!("skipped: needs a GPU and NCCL ({w})");
                false
            }
        }
    }

    /// A reducer over a communicator of one rank on GPU 0, and a stream of its context.
    fn one_rank_reducer() -> (GpuAllReducer, Arc<CudaStream>) {
        let id = crate::nccl::UniqueId::new().unwrap();
        let comm = Communicator::new(0, &id, 0, 1).unwrap();
        let stream = comm.context().new_stream().unwrap();
        (GpuAllReducer::new(comm).unwrap(), stream)
    }

    /// A frame that failed its check on the device reaches `check_frames_seen` once the
    /// caller has waited for its stream, and fails every later compressed call (after its
    /// first exchange). One rank on one GPU: its own frames are sound, so the failure is
    /// written into the status as `check_frames` writes it for rank 0's frame.
    #[test]
    fn a_bad_frame_shows_in_the_check_after_a_wait_and_fails_later_calls() {
        if !one_gpu() {
            return;
        }
        let (mut reducer, stream) = one_rank_reducer();
        let ctx = stream.context().clone();
        let x: Vec<f32> = (0..10_000).map(|i| (i as f32 * 0.01).sin()).collect();
        let d = stream.clone_htod(&x).unwrap();
        let opts = GpuAllReduceOptions::new(1e-3);
        let raw = stream.cu_stream() as usize;
        let call = |reducer: &mut GpuAllReducer| {
            let (ptr, _sync) = cudarc::driver::DevicePtr::device_ptr(&d, &stream);
            // SAFETY: `d` holds 10 000 float32 on the communicator's device and outlives the
            // call; `stream` is a live stream of its primary context.
            unsafe { reducer.allreduce(raw, ptr, 10_000, DType::F32, &opts) }
        };
        call(&mut reducer).unwrap();
        stream.synchronize().unwrap();
        reducer.check_frames_seen().unwrap();
        let y = stream.clone_dtoh(&d).unwrap();
        assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() <= 1e-3));

        // Error bits SUM_BAD_FRAME (kernels/codec.cu), then the frame's index + 1.
        let bad: u64 = 4 | (1 << 32);
        ctx.bind_to_thread().unwrap();
        // SAFETY: the status's 8 bytes of device memory, in the bound context; no work that
        // uses them is in flight (the stream was waited for).
        unsafe { result::memcpy_htod_sync(reducer.status.ptr(), &bad.to_le_bytes()) }.unwrap();
        // The host's copy is still clean: this call runs, decodes nothing and copies the status.
        call(&mut reducer).unwrap();
        stream.synchronize().unwrap();
        let e = reducer.check_frames_seen().unwrap_err();
        assert!(matches!(e, Error::Transport(_)), "{e:?}");
        assert!(e.to_string().contains("the frame of rank 0"), "{e}");
        assert!(e.to_string().contains("error bits 0x4"), "{e}");
        let e = call(&mut reducer).unwrap_err();
        assert!(
            e.to_string()
                .contains("an earlier call received a bad frame"),
            "{e}"
        );
    }

    /// With error feedback, a call leaves residuals that the next call of the same size adds;
    /// after `reset` the next call starts from none, and so gives what the first call gave
    /// (one rank: its result is its own input decoded, bit for bit the same from the same
    /// input). Without the reset, the second call's result differs (it carries the residual).
    #[test]
    fn reset_forgets_the_residuals() {
        if !one_gpu() {
            return;
        }
        let (mut reducer, stream) = one_rank_reducer();
        let x: Vec<f32> = (0..10_000).map(|i| (i as f32 * 0.37).sin() * 0.3).collect();
        let opts = GpuAllReduceOptions::new(1e-2);
        let raw = stream.cu_stream() as usize;
        let call = |reducer: &mut GpuAllReducer| -> Vec<f32> {
            let d = stream.clone_htod(&x).unwrap();
            {
                let (ptr, _sync) = cudarc::driver::DevicePtr::device_ptr(&d, &stream);
                // SAFETY: `d` holds 10 000 float32 on the communicator's device and outlives
                // the call (the stream is waited for below); `stream` is live.
                unsafe { reducer.allreduce(raw, ptr, 10_000, DType::F32, &opts) }.unwrap();
            }
            stream.synchronize().unwrap();
            stream.clone_dtoh(&d).unwrap()
        };
        let first = call(&mut reducer);
        let carried = call(&mut reducer);
        assert_ne!(
            first, carried,
            "the second call adds the first one's residual"
        );
        reducer.reset().unwrap();
        assert_eq!(call(&mut reducer), first, "after reset, as the first call");
    }
}
