//! One DDP gradient bucket's compressed average over NCCL, in two calls: what `cfc_hook` runs
//! for each compressed CUDA bucket.
//!
//! [`BucketExchange::launch`] queues, on the caller's stream, the bucket's sum of squares (the
//! next step's `rms` bound), its compression with error feedback (whose last kernel also writes
//! the frame's size into the row's head and raises the running maximum of the error sent), then
//! on a stream of the exchange's own the all-gather of every rank's row and a copy of the sizes
//! to pinned host memory; it returns without waiting. [`BucketExchange::finish`] waits for those
//! sizes (within the communicator's timeout), and queues on the caller's stream the decoding of
//! every rank's frame, added in rank order and averaged into the bucket. The frames are checked
//! on the device before they are added (the host sees only their sizes); a frame that is not
//! what its header says leaves the bucket as it was, as every later decoding does, and
//! [`BucketExchange::check_frames_seen`] reports it once the caller has waited for its stream. (Not earlier, without a wait: ranks would see
//! the status copy arrive at different buckets, and one that stopped there would leave its
//! peers waiting in the next bucket's all-gather.) The caller launches the next bucket before
//! finishing this one, so its compression runs while this one is on the wire.
//!
//! This is the exchange of [`crate::gpu_allreduce`] (a row per rank: a 16-byte head with the
//! frame's size, then the frame, in a slot sized from the bucket's previous frames; a frame
//! that outgrew its slot is sent again, whole), cut at the wait for the sizes, with the buffers
//! the caller's (PyTorch's caching allocator: a bucket's buffers are not held between steps).
//! In the Python engine the same work took about 25 CUDA and collective calls per bucket, each
//! costing host time on a thread that competes with the backward pass; here it is two.

use crate::cuda::{self, driver_err, ContextGuard};
use crate::error::{Error, Result};
use crate::format::DType;
use crate::gpu_memory::{DecodeStatus, DeviceBuffer, PinnedBuffer};
use crate::nccl::Communicator;
use crate::stream_graph::Replay;
use crate::Bound;
use cudarc::driver::{sys, CudaEvent, CudaStream};
use std::collections::HashMap;
use std::sync::Arc;

/// Bytes before each frame in its row: the frame's size (u64), then padding, so that frames
/// stay 16-byte aligned.
pub const ROW_HEAD: u64 = 16;

/// `x` rounded up to a multiple of 16.
pub fn round16(x: u64) -> u64 {
    x.div_ceil(16) * 16
}

/// Bytes a row needs for a frame of `capacity` bytes (its head included).
pub fn row_len(capacity: u64) -> u64 {
    ROW_HEAD + round16(capacity)
}

/// Frame bytes a bucket's next exchange carries, from the largest frame of this one: 12.5% and
/// 256 bytes above it, so that most steps send once; at most the frame capacity. (Over the 217M
/// LM's buckets, frames grew by more than 6.25% from one step to the next in about one bucket of
/// seven, and by more than 12.5% in one of twenty; the wider margin sent fewer bytes in all,
/// `benches/slot_margin.py`.)
pub fn next_slot(largest: u64, capacity: u64) -> u64 {
    round16(largest + largest / 8 + 256).min(round16(capacity))
}

/// [`next_slot`], but keeping the `current` slot while the frames fit it with their margin and
/// it would shrink by less than a sixteenth: with graphs, so that a bucket's rows keep their
/// length (and its recorded decoding its addresses) from step to step, for rows at most a
/// fifteenth longer than [`next_slot`]'s. The same on every rank, as its arguments are.
pub fn steady_slot(largest: u64, capacity: u64, current: u64) -> u64 {
    let fresh = next_slot(largest, capacity);
    if fresh <= current && fresh >= current - current / 16 {
        current
    } else {
        fresh
    }
}

/// Where a bucket's exchange keeps its parts in the one device allocation its caller makes for
/// it: this rank's row at 0, the workspace (compression's, then decoding's: one after the other
/// on the stream) at `workspace_at`, then every rank's rows of `slot` frame bytes at `recv_at`,
/// both 256-byte aligned. The parts whose sizes do not depend on the slot come first, so that
/// their addresses stay the same from step to step (a recorded graph's do: see
/// [`BucketExchange::set_graphs`]). The pipeline and the Python hook both place their scratch
/// by it, so that the two send the same bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScratchLayout {
    /// This rank's frame capacity, a multiple of 16 ([`LaunchArgs::capacity`]).
    pub capacity: u64,
    /// Frame bytes each rank's row carries, a multiple of 16 and at most `capacity`
    /// ([`LaunchArgs::slot`]).
    pub slot: u64,
    /// Offset of every rank's rows ([`LaunchArgs::recv`]).
    pub recv_at: u64,
    /// Offset of the workspace ([`LaunchArgs::workspace`]).
    pub workspace_at: u64,
    /// Workspace bytes ([`LaunchArgs::workspace_len`]).
    pub workspace_len: u64,
    /// Bytes of the whole allocation.
    pub len: u64,
}

impl ScratchLayout {
    /// The layout for a bucket of `n` elements of `dtype` compressed within `eps` (with error
    /// feedback when `feedback`), among `world` ranks, with `slot` frame bytes asked for (0:
    /// none yet; clamped to the capacity and rounded up to 16).
    pub fn new(n: u64, dtype: DType, eps: f64, feedback: bool, slot: u64, world: u64) -> Self {
        let capacity = round16(cuda::compress_capacity(n, dtype, 1, Bound::Abs(eps)));
        // (Clamped before rounding: the capacity is a multiple of 16, and any slot rounds.)
        let slot = round16(slot.min(capacity));
        let workspace_at = row_len(capacity).div_ceil(256) * 256;
        let workspace_len =
            cuda::compress_workspace_len(n, feedback).max(cuda::decode_sum_workspace_len(n, world));
        let recv_at = (workspace_at + workspace_len).div_ceil(256) * 256;
        ScratchLayout {
            capacity,
            slot,
            recv_at,
            workspace_at,
            workspace_len,
            len: recv_at + world * (ROW_HEAD + slot),
        }
    }
}

/// Arguments of [`BucketExchange::launch`]. Addresses are device memory of the communicator's
/// device unless said otherwise.
#[derive(Debug, Clone, Copy)]
pub struct LaunchArgs {
    /// The bucket (any number the caller keeps apart: one exchange per key is in flight).
    pub key: u64,
    /// A `CUstream` of the device's primary context: compression and, at `finish`, decoding
    /// are queued on it.
    pub stream: usize,
    /// The bucket: `n` elements of `dtype`, averaged in place at `finish`.
    pub data: u64,
    /// Elements.
    pub n: u64,
    /// float32, bfloat16 or float16.
    pub dtype: DType,
    /// `n` float32 residuals (error feedback, updated in place), or 0 for none.
    pub residual: u64,
    /// This rank's bound (`Abs` or `Rel`).
    pub bound: Bound,
    /// This rank's row: [`row_len`]`(capacity)` bytes; the frame is written after its head.
    pub row: u64,
    /// Frame capacity: at least [`cuda::compress_capacity`] of the bucket, a multiple of 16.
    pub capacity: u64,
    /// The compressor's workspace ([`cuda::compress_workspace_len`]).
    pub workspace: u64,
    /// Its size.
    pub workspace_len: u64,
    /// The sum of squares of `data + residual`, before compression: ([`cuda::SUM_SQUARES_WORKSPACE`]
    /// bytes of workspace, 8 bytes of pinned host memory it is copied to), or `None`.
    pub sum_squares: Option<(u64, u64)>,
    /// Frame bytes this exchange carries (a multiple of 16, at most `capacity`; 0: the sizes
    /// only, for a bucket's first exchange).
    pub slot: u64,
    /// Every rank's row: `world * (ROW_HEAD + slot)` bytes.
    pub recv: u64,
    /// 8 bytes of device memory holding the largest error sent so far (f64 bits), raised by
    /// the residual this compression leaves; 0 for none.
    pub max_error: u64,
}

/// Arguments of [`BucketExchange::finish`].
#[derive(Debug, Clone, Copy)]
pub struct FinishArgs {
    /// The bucket, as launched.
    pub key: u64,
    /// The caller's stream (as at launch).
    pub stream: usize,
    /// Multiplies the sum of the decoded frames (`1 / world` for an average, as an f32).
    pub scale: f32,
    /// The decoder's workspace ([`cuda::decode_sum_workspace_len`] for `world` parts).
    pub workspace: u64,
    /// Its size.
    pub workspace_len: u64,
    /// Where the frames go when one outgrew its slot: `world` rows of the length the first
    /// call returned ([`Finish::Resend`]); 0 on the first call.
    pub resend_recv: u64,
}

/// What [`BucketExchange::finish`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// The average is queued on the caller's stream.
    Done {
        /// Bytes this rank sent, resends included.
        sent: u64,
        /// The slot for the bucket's next exchange (the same on every rank).
        next_slot: u64,
    },
    /// A frame outgrew its slot (every rank sees it): call again with `resend_recv` holding
    /// `world` rows of `row_len` bytes.
    Resend {
        /// Bytes per row.
        row_len: u64,
    },
}

/// What a launched exchange needs at its finish.
struct InFlight {
    data: u64,
    n: u64,
    dtype: DType,
    row: u64,
    capacity: u64,
    slot: u64,
    recv: u64,
    sent: u64,
}

/// A bucket's events and pinned sizes, kept from step to step.
struct Entry {
    compressed: CudaEvent,
    gathered: CudaEvent,
    sizes: PinnedBuffer,
    in_flight: Option<InFlight>,
    /// Launches so far (the first one runs directly: it may load the kernels, which a stream
    /// capture must not do).
    launches: u64,
    /// The compression's and the decoding's work, replayed as graphs (with `graphs` on).
    compression: Replay,
    decoding: Replay,
    /// With graphs, the bucket's `eps`: written here by the host at each launch, copied to
    /// `bound_dev` by the recorded work, and read there by the encoder (so that a graph
    /// replays with each step's bound). Each launch writes it only after the previous one's
    /// compression has run: its finish waited for the all-gather that follows it. (A launch
    /// that failed after queuing its compression has no finish: a later launch may rewrite the
    /// word before that orphaned compression copies it, which changes only work whose frame is
    /// never sent and whose step has failed.)
    bound_host: PinnedBuffer,
    bound_dev: DeviceBuffer,
}

/// The compressed exchanges of `cfc_hook`'s buckets over an NCCL communicator of cfc's own.
///
/// Every rank must launch and finish the same keys in the same order (NCCL's rule for
/// collectives): `cfc_hook` does so from one thread per process.
pub struct BucketExchange {
    comm: Communicator,
    /// Where the all-gathers run, so that the caller's stream (the next bucket's compression,
    /// the last one's decoding) never waits for the wire.
    side: Arc<CudaStream>,
    entries: HashMap<u64, Entry>,
    /// The decoder's status, kept across buckets: once a frame fails its check, no later
    /// bucket is decoded; read at every call.
    status: DecodeStatus,
    /// Whether each bucket's compression and decoding are submitted as one graph each
    /// ([`crate::stream_graph`]) rather than kernel by kernel: see [`BucketExchange::set_graphs`].
    /// Turned off where a graph fails (on this rank only).
    graphs: bool,
    /// Slots by [`steady_slot`]: as `set_graphs` last asked, which every rank does alike (a
    /// failed graph does not change it: the slots must stay the same on every rank).
    steady_slots: bool,
}

impl std::fmt::Debug for BucketExchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BucketExchange")
            .field("comm", &self.comm)
            .field("buckets", &self.entries.len())
            .finish()
    }
}

impl BucketExchange {
    /// Exchanges over `comm`, connected: a first all-gather of a row head between all ranks (a
    /// collective: every rank makes its exchange at the same point), so that NCCL's connections
    /// are set up now and not in the first bucket's exchange, which `fallback="auto"`'s trial
    /// may be timing.
    ///
    /// # Errors
    /// CUDA and NCCL errors (the wait has the communicator's timeout).
    pub fn new(comm: Communicator) -> Result<BucketExchange> {
        let _restore = ContextGuard::save()?;
        let ctx = comm.context().clone();
        let side = ctx.new_stream().map_err(driver_err)?;
        let mut exchange = BucketExchange {
            comm,
            side,
            entries: HashMap::new(),
            status: DecodeStatus::new(&ctx)?,
            graphs: false,
            steady_slots: false,
        };
        let world = exchange.comm.world();
        let rows = DeviceBuffer::new(&ctx, ROW_HEAD as usize * (world + 1))?;
        // SAFETY: `rows` holds this rank's head and a head per rank; it is freed only after the
        // wait below.
        unsafe {
            exchange.comm.all_gather(
                rows.ptr(),
                rows.ptr() + ROW_HEAD,
                ROW_HEAD as usize,
                exchange.side.cu_stream(),
            )?;
        }
        exchange.comm.wait(&exchange.side)?;
        Ok(exchange)
    }

    /// The communicator (e.g. for its rank, world or timeout).
    pub fn communicator(&mut self) -> &mut Communicator {
        &mut self.comm
    }

    /// Submits each bucket's compression (its sum of squares included) and its decoding as one
    /// CUDA graph each, recorded from the launches at the bucket's second exchange. From then on
    /// the graph is launched as it is while the bucket's addresses and sizes stay the same (the
    /// bound and the frames' sizes are read from memory: [`cuda::CompressArgs::bound_at`],
    /// [`cuda::DecodeSumArgs::lens_before`]), and recorded again and updated where they moved.
    /// Slots then follow [`steady_slot`], so that the rows keep their length. Not on a default
    /// stream (which cannot be recorded). Where recording or replaying fails, the work runs
    /// kernel by kernel instead and graphs are turned off (with a warning). The frames and
    /// results are the same either way.
    ///
    /// Off by default: on one H100 beside a backward pass, the finish's host time fell by about
    /// 20 us per bucket, the launch's (NCCL's call among it) did not, and the step time showed
    /// neither (`docs/perf-notes.md`, "CUDA graphs launched without recording").
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs = on;
        self.steady_slots = on;
    }

    /// Graphs instantiated so far, over every bucket (a replay that works instantiates one per
    /// bucket and shape, then only updates it).
    pub fn graphs_instantiated(&self) -> u64 {
        self.entries
            .values()
            .map(|e| e.compression.instantiated + e.decoding.instantiated)
            .sum()
    }

    /// Graphs launched as they were, without recording the work again, over every bucket: the
    /// replays whose addresses and sizes were those of the bucket's last recording.
    pub fn graphs_reused(&self) -> u64 {
        self.entries
            .values()
            .map(|e| e.compression.reused + e.decoding.reused)
            .sum()
    }

    /// Runs `work` (which queues on `stream`) through `replay` when graphs are on and the
    /// bucket's kernels are loaded (`warm`), else directly; `key` as
    /// [`crate::stream_graph::Replay::run_keyed`]'s. A replay that fails is followed by
    /// the direct run; if that one works, graphs are turned off for good.
    ///
    /// # Safety
    /// As [`crate::stream_graph::Replay::run_keyed`].
    unsafe fn submit(
        graphs: &mut bool,
        replay: &mut Replay,
        warm: bool,
        stream: usize,
        key: &[u64],
        work: impl Fn() -> Result<()>,
    ) -> Result<()> {
        // The legacy and per-thread default streams (handles 0 to 2) cannot be captured.
        if !*graphs || !warm || stream <= 2 {
            return work();
        }
        // SAFETY: this function's contract.
        match unsafe { replay.run_keyed(stream as sys::CUstream, key, &work) } {
            Ok(()) => Ok(()),
            Err(graph_err) => {
                work()?;
                tracing::warn!(error = %graph_err, "cfc: replaying a bucket's work as a CUDA graph failed; graphs are off");
                *graphs = false;
                Ok(())
            }
        }
    }

    fn caller(&self, raw: usize) -> Arc<CudaStream> {
        // SAFETY: `raw` is a live CUstream of this device's primary context, owned by the
        // caller for the duration of the call (this type's callers' contract); a borrowed
        // stream is never destroyed by cudarc.
        unsafe {
            self.comm
                .context()
                .wrap_borrowed_stream(raw as cudarc::driver::sys::CUstream)
        }
    }

    /// Queues the bucket's compression and the all-gather of every rank's row; see the module.
    ///
    /// # Safety
    /// Every address must be valid for the bytes [`LaunchArgs`] describes until the work queued
    /// here, and at [`BucketExchange::finish`], completes; `data` and `residual` must not be
    /// written by anyone else until then; `stream` a live stream of the device's primary
    /// context.
    ///
    /// # Errors
    /// [`Error::Transport`] for a key already in flight or a slot past the capacity (nothing
    /// is queued); codec, CUDA and NCCL errors (an NCCL error aborts the communicator).
    pub unsafe fn launch(&mut self, a: &LaunchArgs) -> Result<()> {
        if a.slot > a.capacity || a.slot % 16 != 0 || a.capacity % 16 != 0 {
            return Err(Error::Transport(format!(
                "bucket {}: a slot of {} bytes for a frame capacity of {} (both multiples of 16, \
                 the slot at most the capacity)",
                a.key, a.slot, a.capacity
            )));
        }
        if self
            .entries
            .get(&a.key)
            .is_some_and(|e| e.in_flight.is_some())
        {
            return Err(Error::Transport(format!(
                "bucket {} was launched again before its exchange finished",
                a.key
            )));
        }
        let _restore = ContextGuard::save()?;
        let world = self.comm.world() as u64;
        let device = self.comm.device();
        let ctx = self.comm.context().clone();
        if let std::collections::hash_map::Entry::Vacant(vacant) = self.entries.entry(a.key) {
            vacant.insert(Entry {
                compressed: ctx.new_event(None).map_err(driver_err)?,
                gathered: ctx.new_event(None).map_err(driver_err)?,
                sizes: PinnedBuffer::new(&ctx, 8 * world as usize)?,
                in_flight: None,
                launches: 0,
                compression: Replay::default(),
                decoding: Replay::default(),
                bound_host: PinnedBuffer::new(&ctx, 8)?,
                bound_dev: DeviceBuffer::zeroed(&ctx, 8)?,
            });
        }
        let caller = self.caller(a.stream);
        let side_cu = self.side.cu_stream();
        let entry = self.entries.get_mut(&a.key).expect("inserted above");
        // With graphs, an absolute bound goes through the entry's words (see `Entry`), so that
        // the recorded work is the same from step to step and replays without recording.
        let by_word = match a.bound {
            Bound::Abs(eps) if self.graphs && a.stream > 2 => {
                crate::codec::check_abs_bound(eps, "eps")?;
                entry.bound_host.set_u64(0, eps.to_bits());
                Some((entry.bound_host.addr(), entry.bound_dev.ptr()))
            }
            _ => None,
        };
        // The sum of squares and the compression, on the caller's stream.
        let compression = || -> Result<()> {
            if let Some((host, dev)) = by_word {
                // SAFETY: 8 bytes of pinned memory and 8 of device memory, the entry's.
                unsafe {
                    cuda::copy_rows(&cuda::CopyRowsArgs {
                        device,
                        stream: a.stream,
                        src: host,
                        src_pitch: 8,
                        dst: dev,
                        dst_pitch: 8,
                        width: 8,
                        rows: 1,
                    })?;
                }
            }
            if let Some((workspace, out)) = a.sum_squares {
                // SAFETY: this function's contract.
                unsafe {
                    cuda::sum_squares(&cuda::SumSquaresArgs {
                        device,
                        stream: a.stream,
                        data: a.data,
                        n: a.n,
                        dtype: a.dtype,
                        residual: a.residual,
                        workspace,
                        out,
                    })?;
                }
            }
            // SAFETY: this function's contract: the row holds the head and `capacity` frame
            // bytes.
            unsafe {
                cuda::compress(&cuda::CompressArgs {
                    device,
                    stream: a.stream,
                    input: a.data,
                    n: a.n,
                    dtype: a.dtype,
                    shape: &[a.n],
                    bound: a.bound,
                    out: a.row + ROW_HEAD,
                    out_len: a.capacity,
                    workspace: a.workspace,
                    workspace_len: a.workspace_len,
                    residual: a.residual,
                    // The row's head: the frame's size, written by the compressor itself.
                    size_to: a.row,
                    max_error_to: if a.residual != 0 { a.max_error } else { 0 },
                    bound_at: by_word.map_or(0, |(_, dev)| dev),
                })
            }
        };
        // Everything the compression's work depends on but the bound's value, where that is
        // read from the entry's word.
        let (mode, value) = match (by_word, a.bound) {
            (Some((_, dev)), _) => (0, dev),
            (None, Bound::Abs(eps)) => (1, eps.to_bits()),
            (None, Bound::Rel(rel)) => (2, rel.to_bits()),
            (None, Bound::Bits(bits)) => (3, bits as u64),
        };
        let (sum_ws, sum_out) = a.sum_squares.unwrap_or((0, 0));
        let key = [
            a.data,
            a.n,
            a.dtype.code() as u64,
            a.residual,
            mode,
            value,
            a.row,
            a.capacity,
            a.workspace,
            a.workspace_len,
            a.sum_squares.is_some() as u64,
            sum_ws,
            sum_out,
            a.max_error,
        ];
        let warm = entry.launches > 0;
        // SAFETY: this function's contract; the work queues kernels and memsets on the
        // caller's stream only.
        unsafe {
            Self::submit(
                &mut self.graphs,
                &mut entry.compression,
                warm,
                a.stream,
                &key,
                compression,
            )?;
        }
        entry.launches += 1;
        let row_bytes = ROW_HEAD + a.slot;
        // SAFETY: this function's contract: `recv` holds a row of `ROW_HEAD + slot` bytes per
        // rank, the pinned sizes 8 bytes per rank.
        unsafe {
            entry.compressed.record(&caller).map_err(driver_err)?;
            self.side.wait(&entry.compressed).map_err(driver_err)?;
            self.comm
                .all_gather(a.row, a.recv, row_bytes as usize, side_cu)?;
            cuda::copy_rows(&cuda::CopyRowsArgs {
                device,
                stream: side_cu as usize,
                src: a.recv,
                src_pitch: row_bytes,
                dst: entry.sizes.addr(),
                dst_pitch: 8,
                width: 8,
                rows: world,
            })?;
            entry.gathered.record(&self.side).map_err(driver_err)?;
        }
        entry.in_flight = Some(InFlight {
            data: a.data,
            n: a.n,
            dtype: a.dtype,
            row: a.row,
            capacity: a.capacity,
            slot: a.slot,
            recv: a.recv,
            sent: (world - 1) * row_bytes,
        });
        Ok(())
    }

    /// Waits for the bucket's frame sizes and queues the average into the bucket; see
    /// [`Finish`].
    ///
    /// # Safety
    /// As [`BucketExchange::launch`], for the launch of `key`; `resend_recv`, when given, must
    /// hold `world` rows of the length the previous call returned, and the workspaces their
    /// stated sizes.
    ///
    /// # Errors
    /// [`Error::Transport`] for a key not in flight or frame sizes no rank's compressor writes
    /// (the exchange is dropped); NCCL's errors and the communicator's timeout (which aborts
    /// it); codec and CUDA errors.
    pub unsafe fn finish(&mut self, f: &FinishArgs) -> Result<Finish> {
        let world = self.comm.world();
        let device = self.comm.device();
        let caller = self.caller(f.stream);
        let Some(entry) = self.entries.get_mut(&f.key) else {
            return Err(not_in_flight(f.key));
        };
        let Some(fl) = entry.in_flight.as_mut() else {
            return Err(not_in_flight(f.key));
        };
        let _restore = ContextGuard::save()?;
        let side_cu = self.side.cu_stream();
        self.comm.wait_event(&entry.gathered)?;
        let sizes: Vec<u64> = (0..world).map(|j| entry.sizes.u64_at(j)).collect();
        // (what decode_sum's host check refuses: refused here alike with graphs or without)
        let min_frame = crate::format::min_frame_len(fl.n, 1);
        if sizes.iter().any(|&s| s < min_frame || s > fl.capacity) {
            let why = format!(
                "ranks sent frame sizes {sizes:?} for a bucket of {} elements (frames of {min_frame} \
                 to {} bytes)",
                fl.n, fl.capacity
            );
            entry.in_flight = None;
            return Err(Error::Transport(why));
        }
        let largest = sizes.iter().copied().max().unwrap_or(0);
        let mut row_bytes = ROW_HEAD + fl.slot;
        let mut recv = fl.recv;
        if largest > fl.slot {
            row_bytes = ROW_HEAD + round16(largest);
            if f.resend_recv == 0 {
                return Ok(Finish::Resend { row_len: row_bytes });
            }
            recv = f.resend_recv;
            // `resend_recv` is the caller's new memory: its allocator may have handed over a
            // block that work queued earlier on the caller's stream (a previous bucket's
            // decoding) still uses. The exchange's stream writes it only after that work.
            entry.compressed.record(&caller).map_err(driver_err)?;
            self.side.wait(&entry.compressed).map_err(driver_err)?;
            // SAFETY: the row holds the head and `capacity >= round16(largest)` frame bytes;
            // `resend_recv` holds `world` rows of `row_bytes` (this function's contract).
            unsafe {
                self.comm
                    .all_gather(fl.row, recv, row_bytes as usize, side_cu)?;
            }
            entry.gathered.record(&self.side).map_err(driver_err)?;
            fl.sent += (world as u64 - 1) * row_bytes;
            // Decoding must not start before the frames are in: waited for on the host too,
            // so that a peer that never sends ends in the timeout, not in a stuck stream.
            self.comm.wait_event(&entry.gathered)?;
        }
        // The decoding waits for this bucket's exchange only.
        caller.wait(&entry.gathered).map_err(driver_err)?;
        let frames: Vec<u64> = (0..world as u64)
            .map(|j| recv + j * row_bytes + ROW_HEAD)
            .collect();
        let fl = entry.in_flight.take().expect("checked above");
        let status = &self.status;
        // With graphs, the decoder reads the frames' sizes from their rows' heads (the values
        // checked above), so that the recorded work is the same from step to step. Not after a
        // resend: those rows came in a second all-gather, whose heads the host has not read.
        let lens_before = if self.graphs && f.stream > 2 && recv == fl.recv {
            ROW_HEAD
        } else {
            0
        };
        // The lengths passed: the sizes checked above, or with the sizes read from the heads,
        // the rows' room (the same every step).
        let lens = if lens_before != 0 {
            vec![row_bytes - ROW_HEAD; world]
        } else {
            sizes
        };
        let decoding = || -> Result<()> {
            // SAFETY: every frame's size was checked against the capacity, the same on every
            // rank, and lies in its row; `decode_sum` checks the rest on the device; `data` is
            // the caller's (launch's contract), as are the workspaces.
            unsafe {
                cuda::decode_sum(&cuda::DecodeSumArgs {
                    device,
                    stream: f.stream,
                    frames: &frames,
                    frame_lens: &lens,
                    lens_before,
                    n: fl.n,
                    dtype: fl.dtype,
                    ndim: 1,
                    scale: f.scale,
                    out: fl.data,
                    out_dtype: fl.dtype,
                    workspace: f.workspace,
                    workspace_len: f.workspace_len,
                    status: status.ptr(),
                })?;
                status.publish(device, f.stream)
            }
        };
        let key = [
            recv,
            row_bytes,
            world as u64,
            fl.n,
            fl.dtype.code() as u64,
            f.scale.to_bits() as u64,
            fl.data,
            f.workspace,
            f.workspace_len,
            lens_before,
        ];
        // The bucket's first decoding runs directly (it may load the decoder's kernels), as its
        // first compression does; so does a resend's (other rows, and the lengths passed: its
        // graph would replace the bucket's usual one, and the next step's would replace it
        // again).
        let warm = entry.launches > 1 && lens_before != 0;
        // SAFETY: as above; the work queues kernels, a memset and a copy on the caller's
        // stream only (its wait for the frames is queued above, outside the graph).
        unsafe {
            Self::submit(
                &mut self.graphs,
                &mut entry.decoding,
                warm,
                f.stream,
                &key,
                decoding,
            )?;
        }
        Ok(Finish::Done {
            sent: fl.sent,
            next_slot: if self.steady_slots {
                steady_slot(largest, fl.capacity, fl.slot)
            } else {
                next_slot(largest, fl.capacity)
            },
        })
    }

    /// Queues a plain average of `n` elements of `dtype` at `data` over the communicator (NCCL's
    /// all-reduce), on the exchange's stream after the work queued so far on `stream`, which
    /// then waits for it: a bucket that [`crate::bucket_pipeline`] sends uncompressed, in the
    /// one order of this communicator's collectives.
    ///
    /// # Safety
    /// `data` valid for `n` elements of `dtype` on the communicator's device until the queued
    /// work completes, and not written by anyone else until then; `stream` a live stream of the
    /// device's primary context.
    ///
    /// # Errors
    /// CUDA and NCCL errors (an NCCL error aborts the communicator).
    pub unsafe fn plain(&mut self, stream: usize, data: u64, n: u64, dtype: DType) -> Result<()> {
        let _restore = ContextGuard::save()?;
        let caller = self.caller(stream);
        let before = caller.record_event(None).map_err(driver_err)?;
        self.side.wait(&before).map_err(driver_err)?;
        // SAFETY: this function's contract.
        unsafe {
            self.comm
                .all_reduce(data, data, n as usize, dtype, true, self.side.cu_stream())?;
        }
        let after = self.side.record_event(None).map_err(driver_err)?;
        caller.wait(&after).map_err(driver_err)
    }

    /// Waits, within the communicator's timeout, for the exchanges queued so far.
    ///
    /// # Errors
    /// NCCL's errors and the timeout (which aborts the communicator); CUDA errors.
    pub fn wait_exchanges(&mut self) -> Result<()> {
        let _restore = ContextGuard::save()?;
        let side = self.side.clone();
        self.comm.wait(&side)
    }

    /// Makes `stream` wait for every exchange queued so far: before the caller runs a
    /// collective of another communicator, so that the GPU meets the two in the order the ranks
    /// issued them.
    ///
    /// # Safety
    /// `stream` a live stream of the device's primary context.
    ///
    /// # Errors
    /// CUDA errors.
    pub unsafe fn fence(&mut self, stream: usize) -> Result<()> {
        let _restore = ContextGuard::save()?;
        let done = self.side.record_event(None).map_err(driver_err)?;
        self.caller(stream).wait(&done).map_err(driver_err)
    }

    /// The error of a frame that failed its check on the device, as far as the copies of the
    /// decoder's status queued so far have arrived (nothing is waited for). A caller that has
    /// waited for the stream of its last [`Self::finish`] learns about every bucket so far,
    /// as every rank does at the same point: `cfc.ddp` checks at a step's last bucket, so that
    /// no optimizer step runs on a bucket left undecoded and every rank raises there.
    ///
    /// # Errors
    /// [`Error::Transport`] naming the frame's rank and what was wrong with it.
    pub fn check_frames_seen(&self) -> Result<()> {
        self.status.check("a bucket's exchange")
    }

    /// Whether `key` has an exchange launched and not finished.
    pub fn in_flight(&self, key: u64) -> bool {
        self.entries
            .get(&key)
            .is_some_and(|e| e.in_flight.is_some())
    }

    /// Gives up on `key`'s exchange in flight without finishing it (an owner that stopped
    /// mid-step on an error), so that the key may be launched or forgotten again. The work
    /// already queued still runs: its buffers must stay until the device has done it (e.g.
    /// after [`BucketExchange::wait_exchanges`] and a wait for the caller's stream). Returns
    /// whether it was in flight.
    pub fn abandon(&mut self, key: u64) -> bool {
        self.entries
            .get_mut(&key)
            .is_some_and(|e| e.in_flight.take().is_some())
    }

    /// Buckets with something kept here (events, pinned sizes, graphs): every key launched and
    /// not forgotten.
    pub fn buckets(&self) -> usize {
        self.entries.len()
    }

    /// Lets go of what is kept for `keys` (those with nothing kept are skipped): buckets that
    /// will not run again, as after a resume with another bucket size. Waits for the device
    /// first, so that no queued work still reads an entry's words or runs its graphs. Returns
    /// how many entries went.
    ///
    /// # Errors
    /// [`Error::Transport`] where one of `keys` is in flight (nothing is let go); CUDA errors.
    pub fn forget(&mut self, keys: &[u64]) -> Result<usize> {
        if let Some(key) = keys.iter().find(|&&k| self.in_flight(k)) {
            return Err(Error::Transport(format!(
                "bucket {key} cannot be forgotten while its exchange is in flight"
            )));
        }
        if !keys.iter().any(|k| self.entries.contains_key(k)) {
            return Ok(0);
        }
        let _restore = ContextGuard::save()?;
        self.comm.context().synchronize().map_err(driver_err)?;
        Ok(keys
            .iter()
            .filter(|k| self.entries.remove(k).is_some())
            .count())
    }
}

fn not_in_flight(key: u64) -> Error {
    Error::Transport(format!(
        "bucket {key} has no exchange in flight (finish follows launch, once)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_and_rows_stay_aligned_and_within_the_capacity() {
        assert_eq!(round16(0), 0);
        assert_eq!(round16(1), 16);
        assert_eq!(round16(32), 32);
        assert_eq!(row_len(100), 16 + 112);
        assert_eq!(next_slot(1600, 1 << 20), round16(1600 + 200 + 256));
        assert_eq!(next_slot(1000, 1008), 1008, "never past the capacity");
        assert_eq!(
            next_slot(1000, 1001),
            1008,
            "the capacity rounded up, as rows are"
        );
        for largest in [64, 1000, 12345, 1 << 24] {
            let s = next_slot(largest, u64::MAX / 2);
            assert_eq!(s % 16, 0);
            assert!(s > largest, "a frame of the same size fits next time");
        }
        let cap = 1 << 30;
        let slot = next_slot(100_000, cap);
        assert_eq!(steady_slot(100_000, cap, slot), slot);
        assert_eq!(
            steady_slot(97_000, cap, slot),
            slot,
            "kept: a little smaller"
        );
        assert_eq!(
            steady_slot(90_000, cap, slot),
            next_slot(90_000, cap),
            "shrinks: much smaller"
        );
        assert_eq!(
            steady_slot(101_000, cap, slot),
            next_slot(101_000, cap),
            "grows: past the margin"
        );
    }

    #[test]
    fn the_scratch_layout_keeps_its_parts_apart_and_aligned() {
        for (n, world, slot) in [
            (1u64, 2u64, 0u64),
            (1000, 2, 64),
            (1 << 20, 8, 1 << 30),
            (12345, 3, 1000),
        ] {
            for feedback in [false, true] {
                let l = ScratchLayout::new(n, DType::F32, 1e-3, feedback, slot, world);
                assert_eq!(l.capacity % 16, 0);
                assert!(l.capacity >= cuda::compress_capacity(n, DType::F32, 1, Bound::Abs(1e-3)));
                assert_eq!(
                    l.slot,
                    round16(slot).min(l.capacity),
                    "clamped to the capacity"
                );
                assert!(
                    l.workspace_at >= row_len(l.capacity),
                    "this rank's whole row first"
                );
                assert_eq!(l.workspace_at % 256, 0);
                assert_eq!(l.recv_at % 256, 0);
                assert!(l.recv_at >= l.workspace_at + l.workspace_len);
                assert!(l.workspace_len >= cuda::compress_workspace_len(n, feedback));
                assert!(l.workspace_len >= cuda::decode_sum_workspace_len(n, world));
                assert_eq!(l.len, l.recv_at + world * (ROW_HEAD + l.slot));
                let other = ScratchLayout::new(n, DType::F32, 1e-3, feedback, slot / 2, world);
                assert_eq!(
                    (other.workspace_at, other.recv_at),
                    (l.workspace_at, l.recv_at),
                    "the slot moves nothing but the end"
                );
            }
        }
    }
}
