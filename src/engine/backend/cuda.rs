//! The CUDA backend: the kernels of [`crate::cuda`], queued on two streams of the engine's own
//! (the compute lane and the comm lane), in scratch memory the engine allocates once and reuses.
//! Nothing here waits for the GPU: the transport waits for marks, polling.

use super::{Backend, FrameKind, Lane, Memory};
use crate::cuda::memory::{DeviceBuffer, PinnedBuffer};
use crate::cuda::{self, driver_err, ContextGuard};
use crate::engine::job::{Region, Tensor};
use crate::engine::{Done, ReadyFn};
use crate::error::{Error, Result};
use crate::format::{Coder, DType};
use crate::Bound;
use crossbeam_channel::{Receiver, Sender};
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};
use std::sync::Arc;

/// The engine's scratch on the device. Dropped anywhere, it goes back to its backend's pool
/// instead of being freed: `cuMemFree` waits for the device, and a stage that fails unwinds
/// while collectives it queued may run until the transport is aborted (`Worker::fail_with`
/// aborts, then lets the device drain). Given back with `Backend::free` or dropped, a buffer
/// is handed out again by a later `alloc` under the same rules.
pub struct Scratch {
    buf: Option<DeviceBuffer>,
    home: Sender<DeviceBuffer>,
}

impl Memory for Scratch {
    fn region(&self) -> Region {
        self.buf
            .as_ref()
            .map_or(Region { addr: 0, len: 0 }, |b| Region {
                addr: b.ptr(),
                len: b.len() as u64,
            })
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            // With the backend gone, the buffer is freed here (the device is idle by then).
            let _ = self.home.send(b);
        }
    }
}

/// Scratch is allocated in steps of this many bytes, so that a bucket whose frames grow a
/// little reuses its buffers.
const GRAIN: u64 = 1 << 20;

/// A fetch: pinned host memory the lane copies into, and how many of its bytes it holds.
/// Dropped, its memory goes back to the backend (as [`Scratch`] does, and for the same reason:
/// `cuMemFreeHost` waits for the device).
pub struct Fetch {
    host: Option<PinnedBuffer>,
    len: usize,
    home: Sender<PinnedBuffer>,
}

impl Drop for Fetch {
    fn drop(&mut self) {
        if let Some(h) = self.host.take() {
            let _ = self.home.send(h);
        }
    }
}

/// Memory handed out by a backend and coming back when dropped: the pool, and the way back.
struct Pool<T> {
    free: Vec<T>,
    home: Sender<T>,
    back: Receiver<T>,
}

impl<T> Pool<T> {
    fn new() -> Pool<T> {
        let (home, back) = crossbeam_channel::unbounded();
        Pool {
            free: Vec::new(),
            home,
            back,
        }
    }

    /// The free buffers, with those dropped since.
    fn gathered(&mut self) -> &mut Vec<T> {
        self.free.extend(self.back.try_iter());
        &mut self.free
    }

    /// Leaks every buffer (see `Backend::abandon`).
    fn leak(&mut self) {
        for b in self.gathered().drain(..) {
            std::mem::forget(b);
        }
    }
}

/// A job's input is ready: an event recorded on the caller's stream.
pub struct Ready(Option<CudaEvent>);

/// The CUDA backend (see the module docs).
pub struct CudaBackend {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    comm: Arc<CudaStream>,
    /// The engine's scratch, given back for reuse (rows, on both lanes).
    pool: Pool<DeviceBuffer>,
    /// The kernels' workspaces (compute lane only), given back for reuse.
    work: Vec<DeviceBuffer>,
    pinned: Pool<PinnedBuffer>,
    /// Uploads on their way: pinned memory a copy reads until its event is reached.
    uploads: Vec<(CudaEvent, Fetch)>,
    /// The device may never finish its queued work (`Backend::abandon`): leak, don't free.
    abandoned: bool,
    /// The decoding status (8 bytes) and the running maximum of the error left in residuals
    /// (f64 bits), zeroed once.
    words: std::mem::ManuallyDrop<DeviceBuffer>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.ordinal)
            .finish()
    }
}

impl CudaBackend {
    /// A backend on device `ordinal` (its primary context, the one PyTorch uses).
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`], [`Error::Cuda`]; a device older than compute capability 8.0.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        if !cuda::supported(ordinal) {
            return Err(Error::CudaUnavailable(format!(
                "device {ordinal} cannot run cfc's kernels (compute capability 8.0 or newer is needed)"
            )));
        }
        let _restore = ContextGuard::save()?;
        let ctx = cuda::context(ordinal)?;
        Ok(CudaBackend {
            ordinal,
            compute: ctx.new_stream().map_err(driver_err)?,
            comm: ctx.new_stream().map_err(driver_err)?,
            words: std::mem::ManuallyDrop::new(DeviceBuffer::zeroed(&ctx, 16)?),
            ctx,
            pool: Pool::new(),
            work: Vec::new(),
            pinned: Pool::new(),
            uploads: Vec::new(),
            abandoned: false,
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The comm lane's stream (for transports).
    pub(crate) fn comm_stream(&self) -> &Arc<CudaStream> {
        &self.comm
    }

    /// The device's primary context.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn stream(&self, lane: Lane) -> &Arc<CudaStream> {
        match lane {
            Lane::Compute => &self.compute,
            Lane::Comm => &self.comm,
        }
    }

    fn raw(&self, lane: Lane) -> usize {
        self.stream(lane).cu_stream() as usize
    }

    /// A buffer of at least `len` bytes from `pool` (the smallest that fits), or a new one.
    fn take(
        ctx: &Arc<CudaContext>,
        pool: &mut Vec<DeviceBuffer>,
        len: u64,
    ) -> Result<DeviceBuffer> {
        if let Some(i) = super::best_fit(pool, |b| b.len() as u64, len) {
            return Ok(pool.swap_remove(i));
        }
        let size = len.max(1).div_ceil(GRAIN) * GRAIN;
        DeviceBuffer::new(ctx, size as usize).map_err(|e| match e {
            Error::Cuda(m) if m.contains("could not allocate") => Error::Allocation { bytes: size },
            other => other,
        })
    }

    /// A kernel workspace of `len` bytes, used on the compute lane and given back at once
    /// (later compute work is queued after the kernel that uses it).
    fn workspace(&mut self, len: u64) -> Result<DeviceBuffer> {
        Self::take(&self.ctx, &mut self.work, len)
    }

    fn give_back(&mut self, ws: DeviceBuffer) {
        self.work.push(ws);
    }
}

/// `e` with the operation it came from, so that a device error (reported by the next call after
/// the kernel that caused it, or at once with `CUDA_LAUNCH_BLOCKING=1`) says where it surfaced.
fn during(op: &'static str) -> impl Fn(Error) -> Error {
    move |e| match e {
        Error::Cuda(m) => Error::Cuda(format!("{op}: {m}")),
        other => other,
    }
}

fn event(stream: &CudaStream) -> Result<CudaEvent> {
    stream
        .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
        .map_err(driver_err)
}

impl Backend for CudaBackend {
    type Buf = Scratch;
    type Mark = CudaEvent;
    type Ready = Ready;
    type Fetched = Fetch;

    fn label(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn alloc(&mut self, len: u64) -> Result<Scratch> {
        let buf = Self::take(&self.ctx, self.pool.gathered(), len)?;
        Ok(Scratch {
            buf: Some(buf),
            home: self.pool.home.clone(),
        })
    }

    fn free(&mut self, buf: Scratch) {
        drop(buf); // back to the pool (see `Scratch`)
    }

    fn abandon(&mut self) {
        self.abandoned = true;
    }

    fn begin(&mut self, ready: Ready) -> Result<()> {
        match ready.0 {
            Some(e) => self.compute.wait(&e).map_err(driver_err),
            None => Ok(()),
        }
    }

    fn ready_mark(&mut self, ready: Ready) -> Option<CudaEvent> {
        ready.0
    }

    fn join(&mut self, to: Lane, from: Lane) -> Result<()> {
        let e = event(self.stream(from)).map_err(during("join"))?;
        self.stream(to)
            .wait(&e)
            .map_err(driver_err)
            .map_err(during("join"))
    }

    fn stats(
        &mut self,
        x: Tensor,
        r: Option<Tensor>,
        out: Region,
        pitch: u64,
        count: u64,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        // (the last copy's 16 bytes lie within `out`)
        out.sub((count - 1) * pitch, 16)?;
        let ws = self.workspace(cuda::STATS_WORKSPACE)?;
        let args = cuda::StatsArgs {
            device: self.ordinal,
            stream: self.raw(Lane::Compute),
            data: x.addr,
            n: x.numel,
            dtype: x.dtype,
            residual: r.map_or(0, |r| r.addr),
            workspace: ws.ptr(),
            out: out.addr,
            pitch,
            copies: count as u32,
        };
        // SAFETY: the job's tensors (vouched for by the submitter), the workspace just taken,
        // and `out` checked above; all on this device.
        let r = unsafe { cuda::stats(&args) }.map_err(during("stats"));
        self.give_back(ws);
        r
    }

    fn exponents(&mut self, x: Tensor, r: Option<Tensor>, log2: u8, out: Region) -> Result<()> {
        let blocks = crate::scales::blocks_for(x.numel, log2);
        if out.len != blocks {
            return Err(Error::Transport(format!(
                "internal: {blocks} block exponents into {} bytes",
                out.len
            )));
        }
        let args = cuda::ExponentsArgs {
            device: self.ordinal,
            stream: self.raw(Lane::Compute),
            data: x.addr,
            n: x.numel,
            dtype: x.dtype,
            residual: r.map_or(0, |r| r.addr),
            block_log2: log2,
            out: out.addr,
        };
        // SAFETY: the job's tensors (vouched for by the submitter) and `out` (checked above),
        // on this device.
        unsafe { cuda::block_exponents(&args) }.map_err(during("block exponents"))
    }

    fn upload(&mut self, lane: Lane, dst: Region, bytes: &[u8]) -> Result<()> {
        if bytes.len() as u64 != dst.len {
            return Err(Error::Transport(format!(
                "internal: {} bytes uploaded into {}",
                bytes.len(),
                dst.len
            )));
        }
        if bytes.is_empty() {
            return Ok(());
        }
        // Pinned memory of earlier uploads goes back once their copies ran.
        let mut i = 0;
        while i < self.uploads.len() {
            if self.uploads[i].0.try_is_complete().map_err(driver_err)? {
                self.uploads.swap_remove(i);
            } else {
                i += 1;
            }
        }
        let pinned = self.pinned.gathered();
        let mut host = match pinned.iter().position(|p| p.len() >= bytes.len()) {
            Some(i) => pinned.swap_remove(i),
            None => PinnedBuffer::new(&self.ctx, bytes.len().max(4096))?,
        };
        host.write(bytes);
        let addr = host.addr();
        let held = Fetch {
            host: Some(host),
            len: bytes.len(),
            home: self.pinned.home.clone(),
        };
        // SAFETY: `dst` is the engine's scratch (checked by the caller's `sub`); the pinned
        // memory is kept (in `uploads`) until an event after the copy is reached.
        unsafe { cuda::copy_async(self.stream(lane), dst.addr, addr, dst.len) }
            .map_err(during("upload"))?;
        let e = event(self.stream(lane)).map_err(during("upload"))?;
        self.uploads.push((e, held));
        Ok(())
    }

    fn copy(&mut self, lane: Lane, src: Region, dst: Region) -> Result<()> {
        if src.len != dst.len {
            return Err(Error::Transport(format!(
                "internal: {} bytes copied into {}",
                src.len, dst.len
            )));
        }
        // SAFETY: both regions are the engine's scratch (checked by the caller's `sub`), which
        // lives until the lane's work on it is done.
        unsafe { cuda::copy_async(self.stream(lane), dst.addr, src.addr, dst.len) }
            .map_err(during("copy"))
    }

    fn frame_capacity(&self, n: u64, dtype: DType) -> u64 {
        cuda::compress_capacity(n, dtype, 1, Bound::Abs(1.0)).div_ceil(16) * 16
    }

    fn compress(
        &mut self,
        x: Tensor,
        r: Option<Tensor>,
        eps: f64,
        coder: Coder,
        scales: Option<(u8, Region)>,
        frame: Region,
        size_at: Region,
    ) -> Result<()> {
        let (block_log2, shifts) = match scales {
            Some((log2, s)) => {
                let blocks = crate::scales::blocks_for(x.numel, log2);
                (log2, s.sub(0, blocks)?.addr)
            }
            None => (0, 0),
        };
        let size_at = size_at.sub(0, 8)?;
        let ws_len = match coder {
            Coder::Planes => cuda::compress_workspace_len(x.numel, r.is_some()),
            Coder::Rice => cuda::rice_workspace_len(x.numel),
        };
        let ws = self.workspace(ws_len)?;
        let args = cuda::CompressArgs {
            device: self.ordinal,
            stream: self.raw(Lane::Compute),
            input: x.addr,
            n: x.numel,
            dtype: x.dtype,
            shape: &[x.numel],
            bound: Bound::Abs(eps),
            out: frame.addr,
            out_len: frame.len,
            workspace: ws.ptr(),
            workspace_len: ws.len() as u64,
            residual: r.map_or(0, |r| r.addr),
            size_to: size_at.addr,
            max_error_to: if r.is_some() { self.words.ptr() + 8 } else { 0 },
            scales: shifts,
            block_log2,
        };
        // SAFETY: as in `stats`; the frame region is the engine's scratch (checked by `sub`).
        let out = unsafe {
            match coder {
                Coder::Planes => cuda::compress(&args),
                Coder::Rice => cuda::compress_rice(&args),
            }
        }
        .map_err(during("compress"));
        self.give_back(ws);
        out
    }

    fn sum_capacity(&self, n: u64, dtype: DType) -> u64 {
        cuda::sum_capacity(n, dtype, 1).div_ceil(16) * 16
    }

    fn sum(
        &mut self,
        frames: &[Region],
        n: u64,
        dtype: DType,
        block_log2: u8,
        out: Region,
        size_at: Region,
    ) -> Result<()> {
        let size_at = size_at.sub(0, 8)?;
        let addrs: Vec<u64> = frames.iter().map(|f| f.addr).collect();
        let lens: Vec<u64> = frames.iter().map(|f| f.len).collect();
        let ws = self.workspace(cuda::sum_workspace_len(n, frames.len() as u64))?;
        let args = cuda::SumArgs {
            device: self.ordinal,
            stream: self.raw(Lane::Compute),
            frames: &addrs,
            frame_lens: &lens,
            n,
            dtype,
            shape: &[n],
            out: out.addr,
            out_len: out.len,
            block_log2,
            workspace: ws.ptr(),
            workspace_len: ws.len() as u64,
        };
        // SAFETY: frames received by the transport into the engine's scratch, the output and the
        // workspace likewise; the frames are checked on the device before anything is added.
        let summed = unsafe { cuda::sum(&args) }.and_then(|()| {
            // The sum's size (0 when it failed) goes to the row's head.
            // SAFETY: 8 bytes of the workspace and of the head, both live until the copy ran
            // (the workspace is reused only by later work on this stream).
            unsafe {
                cuda::copy_async(
                    &self.compute,
                    size_at.addr,
                    ws.ptr() + cuda::FRAME_SIZE_OFFSET,
                    8,
                )
            }
        });
        self.give_back(ws);
        summed.map_err(during("sum"))
    }

    #[allow(clippy::too_many_arguments)] // (the frames, how to read them, and the output)
    fn decode(
        &mut self,
        frames: &[Region],
        sized: bool,
        n: u64,
        dtype: DType,
        kind: FrameKind,
        scale: f32,
        out: Tensor,
    ) -> Result<()> {
        let coder = kind.coder;
        let addrs: Vec<u64> = frames.iter().map(|f| f.addr).collect();
        let lens: Vec<u64> = frames.iter().map(|f| f.len).collect();
        let ws_len = match coder {
            Coder::Planes => cuda::decode_sum_workspace_len(n, frames.len() as u64),
            Coder::Rice => cuda::rice_decode_sum_workspace_len(n, dtype),
        };
        let ws = self.workspace(ws_len)?;
        let args = cuda::DecodeSumArgs {
            device: self.ordinal,
            stream: self.raw(Lane::Compute),
            frames: &addrs,
            frame_lens: &lens,
            lens_before: if sized { crate::engine::rows::HEAD } else { 0 },
            n,
            dtype,
            ndim: 1,
            scale,
            out: out.addr,
            out_dtype: out.dtype,
            block_log2: kind.block_log2,
            workspace: ws.ptr(),
            workspace_len: ws.len() as u64,
            status: self.words.ptr(),
        };
        // SAFETY: frames in the engine's scratch, the job's output tensor; frames are checked on
        // the device before anything is written.
        let r = unsafe {
            match coder {
                Coder::Planes => cuda::decode_sum(&args),
                Coder::Rice => cuda::rice_decode_sum(&args),
            }
        }
        .map_err(during("decode"));
        self.give_back(ws);
        r
    }

    fn fold(&mut self, x: Tensor, r: Tensor) -> Result<()> {
        // SAFETY: the job's tensors, vouched for by the submitter.
        unsafe {
            cuda::fold_residual(
                self.ordinal,
                self.raw(Lane::Compute),
                x.addr,
                x.numel,
                x.dtype,
                r.addr,
            )
        }
        .map_err(during("fold"))
    }

    fn put(&mut self, lane: Lane, dst: Region, pitch: u64, count: u64, word: u64) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        dst.sub((count - 1) * pitch, 8)?;
        // SAFETY: checked above; the engine's scratch.
        unsafe { cuda::put_rows(self.stream(lane), dst.addr, pitch, count, word) }
            .map_err(during("put"))
    }

    fn fetch(
        &mut self,
        lane: Lane,
        src: Region,
        pitch: u64,
        width: u64,
        rows: u64,
    ) -> Result<Fetch> {
        if rows > 0 {
            src.sub((rows - 1) * pitch, width)?;
        }
        let len = (width * rows) as usize;
        let pinned = self.pinned.gathered();
        let host = match pinned.iter().position(|p| p.len() >= len) {
            Some(i) => pinned.swap_remove(i),
            None => PinnedBuffer::new(&self.ctx, len.max(4096))?,
        };
        let args = cuda::CopyRowsArgs {
            device: self.ordinal,
            stream: self.raw(lane),
            src: src.addr,
            src_pitch: pitch,
            dst: host.addr(),
            dst_pitch: width,
            width,
            rows,
        };
        let fetch = Fetch {
            host: Some(host),
            len,
            home: self.pinned.home.clone(),
        };
        // SAFETY: the rows lie in `src` (checked above); the pinned buffer holds `len` bytes,
        // is read only after the lane is waited for, and is never freed while a copy may run
        // (dropped, it goes back to the backend: see `Fetch`).
        unsafe { cuda::copy_rows(&args) }.map_err(during("fetch"))?;
        Ok(fetch)
    }

    fn fetched(&mut self, f: Fetch) -> Vec<u8> {
        f.host.as_ref().map_or_else(Vec::new, |h| h.bytes(f.len))
    }

    fn mark(&mut self, lane: Lane) -> Result<CudaEvent> {
        event(self.stream(lane))
    }

    fn reached(&mut self, mark: &CudaEvent) -> Result<bool> {
        mark.try_is_complete().map_err(driver_err)
    }

    fn status(&self) -> Region {
        Region {
            addr: self.words.ptr(),
            len: 8,
        }
    }

    fn max_error(&self) -> Region {
        Region {
            addr: self.words.ptr() + 8,
            len: 8,
        }
    }

    fn ready_maker(&self) -> ReadyFn {
        let ctx = self.ctx.clone();
        let ordinal = self.ordinal;
        Arc::new(move |stream: u64| {
            let _restore = ContextGuard::save()?;
            ctx.bind_to_thread().map_err(driver_err)?;
            let s = cuda::borrowed_stream(ordinal, stream as usize)?;
            let e = event(&s)?;
            Ok(Box::new(Ready(Some(e))) as Box<dyn std::any::Any + Send>)
        })
    }

    fn done(&mut self) -> Result<Done> {
        let e = Arc::new(event(&self.compute)?);
        let (ctx, ordinal) = (self.ctx.clone(), self.ordinal);
        Ok(Box::new(move |stream: u64| {
            let _restore = ContextGuard::save()?;
            ctx.bind_to_thread().map_err(driver_err)?;
            cuda::borrowed_stream(ordinal, stream as usize)?
                .wait(&e)
                .map_err(driver_err)
        }))
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if self.abandoned {
            // Freeing would wait for a device that may never finish (see `Backend::abandon`).
            self.pool.leak();
            self.pinned.leak();
            for (_, f) in self.uploads.drain(..) {
                std::mem::forget(f);
            }
            for b in self.work.drain(..) {
                std::mem::forget(b);
            }
        } else {
            // SAFETY: dropped once, here, and never used again.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.words) };
        }
    }
}

// SAFETY: the backend's streams, events and buffers belong to one context and are used by one
// thread at a time (the engine's comm thread; `&mut self` on every operation).
unsafe impl Send for CudaBackend {}
// SAFETY: as above; a ready event is recorded on one thread and waited for on another, which
// CUDA allows for events of one context.
unsafe impl Send for Ready {}
// SAFETY: pinned host memory owned by the fetch alone.
unsafe impl Send for Fetch {}
