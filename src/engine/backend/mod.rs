//! The device seam of the engine: where the codec runs and where its scratch memory lives.
//!
//! Two backends write the same bytes: [`cpu::CpuBackend`], the reference (the CPU codec, run
//! at once on the comm thread), and `cuda::CudaBackend` (the CUDA kernels, queued on two
//! streams of the engine's own). The engine calls them with addresses: its own scratch
//! (`Backend::alloc`) and the job's tensors, which [`crate::engine::Engine::submit`]'s caller
//! vouched for. Ranges of scratch are checked before use ([`Region::sub`]).
//!
//! Work goes on two lanes: *compute* (the codec) and *comm* (the transport's collectives).
//! On the GPU they are two streams, so that one bucket's exchange overlaps the next one's
//! compression; `Backend::join` orders one after the other. A scratch buffer given back with
//! `Backend::free` may be handed out again at once: every later use of it is queued after a
//! join from the lane that last used it (see `worker.rs`).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub(crate) mod lanes;

use crate::engine::job::{Region, Tensor};
use crate::error::Result;
use crate::format::{Coder, DType};

/// Which given-back buffer of `pool` to hand out for `len` bytes: the smallest that holds them.
/// Both backends choose alike, so that the CPU tests reuse buffers as the GPU does (and the
/// CPU backend's lane check sees the same reuse).
pub(crate) fn best_fit<T>(pool: &[T], size: impl Fn(&T) -> u64, len: u64) -> Option<usize> {
    pool.iter()
        .enumerate()
        .filter(|(_, b)| size(b) >= len)
        .min_by_key(|(_, b)| size(b))
        .map(|(i, _)| i)
}

/// How the frames a decoding reads were written: their coder, and their block scales (`log2` of
/// the elements per block, 0 for none). A quantized frame that is not so written is refused
/// (raw frames are taken whatever was asked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FrameKind {
    pub coder: Coder,
    pub block_log2: u8,
}

/// A lane of work (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lane {
    /// The codec: compression, sums, decoding.
    Compute,
    /// The transport's collectives.
    Comm,
}

/// Memory of a backend.
pub(crate) trait Memory {
    /// The whole buffer as a region.
    fn region(&self) -> Region;
}

/// Where the codec runs. See the module docs.
pub(crate) trait Backend: Send + 'static {
    /// Scratch memory.
    type Buf: Memory + Send;
    /// A point on a lane, waited for by [`crate::engine::transport::Transport::wait`].
    type Mark: Send;
    /// What a caller's submission leaves for the engine to wait for before it reads the job's
    /// tensors (an event on the caller's CUDA stream; nothing on the CPU).
    type Ready: Send;
    /// Bytes copied to the host by [`Backend::fetch`], readable once the lane was waited for.
    type Fetched: Send;

    /// A description of the device, for messages.
    fn label(&self) -> String;

    /// Scratch of at least `len` bytes (16-byte aligned), contents undefined.
    ///
    /// # Errors
    /// [`crate::Error::Allocation`] or a device error.
    fn alloc(&mut self, len: u64) -> Result<Self::Buf>;

    /// Gives scratch back for later `Backend::alloc`s (see the module docs).
    fn free(&mut self, buf: Self::Buf);

    /// The device may never finish its queued work (a collective whose peer is gone, not
    /// ended by the transport's abort): from now on memory is leaked rather than freed, since
    /// freeing device memory waits for the device.
    fn abandon(&mut self) {}

    /// Orders the compute lane after the caller's submission of a job.
    ///
    /// # Errors
    /// Device errors.
    fn begin(&mut self, ready: Self::Ready) -> Result<()>;

    /// The caller's use of a job's tensors, for checks only: after [`Backend::begin`] (the
    /// caller wrote them before it submitted the job) and before [`Backend::done`] (the caller
    /// uses them once the step is done), each as a write on the compute lane, the one lane the
    /// caller's stream is ordered with. Nothing on a GPU; the CPU backend's lane check records
    /// them, so that a comm-lane use of a tensor without a join from the compute lane first, or
    /// a step that ends without a join from the comm lane, is found.
    ///
    /// # Errors
    /// The lane check's (see `lanes.rs`).
    fn caller_touches(&mut self, _tensors: &[Tensor]) -> Result<()> {
        Ok(())
    }

    /// The caller's work before `ready` (recorded on its stream) as a mark of this backend,
    /// which the transport waits for as for its own (bounded: the step check's wait at a step's
    /// end, `engine/step_check.rs`); None: nothing to wait for (the CPU's work is done when
    /// queued).
    fn ready_mark(&mut self, _ready: Self::Ready) -> Option<Self::Mark> {
        None
    }

    /// Orders `to` after everything queued on `from` so far.
    ///
    /// # Errors
    /// Device errors.
    fn join(&mut self, to: Lane, from: Lane) -> Result<()>;

    /// Queues on the compute lane the statistics of `x + r` (`r`: float32 residuals, or none),
    /// non-finite values counting as 0: the sum of squares (f64) and the largest magnitude
    /// (f64), written as 16 bytes at the start of `out` and again every `pitch` bytes, `count`
    /// times (into the head of every row of a bucket). The sum is added in an order that depends
    /// on the element count only, the same on every backend, so the bits are too.
    ///
    /// # Errors
    /// Device errors; [`crate::Error::Transport`] for copies past `out`.
    fn stats(
        &mut self,
        x: Tensor,
        r: Option<Tensor>,
        out: Region,
        pitch: u64,
        count: u64,
    ) -> Result<()>;

    /// Queues on the compute lane each block's exponent byte of `x + r` (blocks of `2^log2`
    /// elements; [`crate::scales::block_exponents`], bit for bit) into `out`, one byte per block.
    ///
    /// # Errors
    /// Device errors; [`crate::Error::Transport`] for an `out` of another length.
    fn exponents(&mut self, x: Tensor, r: Option<Tensor>, log2: u8, out: Region) -> Result<()>;

    /// Queues on `lane` the copy of `bytes` (host memory, copied before this returns) into
    /// `dst`, which has their length.
    ///
    /// # Errors
    /// Device errors; [`crate::Error::Transport`] for a `dst` of another length.
    fn upload(&mut self, lane: Lane, dst: Region, bytes: &[u8]) -> Result<()>;

    /// Queues on `lane` the copy of `src` into `dst` (scratch of the same length that does not
    /// overlap it).
    ///
    /// # Errors
    /// Device errors; [`crate::Error::Transport`] for regions of different lengths.
    fn copy(&mut self, lane: Lane, src: Region, dst: Region) -> Result<()>;

    /// Bytes a frame of `n` elements of `dtype` may take (a multiple of 16).
    fn frame_capacity(&self, n: u64, dtype: DType) -> u64;

    /// Queues on the compute lane the frame of `x + r` within `eps` (with error feedback: `r`
    /// updated in place) into `frame` (at least [`Backend::frame_capacity`] bytes), its codes
    /// written by `coder`, its size as a u64 into the 8 bytes of `size_at`. With `scales`
    /// (`log2` of the block size, and a shift per block in the backend's memory), block `b`'s
    /// step is `2 eps` halved `shift[b]` times (a frame with block scales). With a residual,
    /// the largest error it leaves raises the backend's running maximum ([`Backend::max_error`]).
    ///
    /// # Errors
    /// The codec's errors; device errors.
    #[allow(clippy::too_many_arguments)] // (the input, how to code it, and the output)
    fn compress(
        &mut self,
        x: Tensor,
        r: Option<Tensor>,
        eps: f64,
        coder: Coder,
        scales: Option<(u8, Region)>,
        frame: Region,
        size_at: Region,
    ) -> Result<()>;

    /// Bytes the exact sum of frames of `n` elements of `dtype` may take (a multiple of 16).
    fn sum_capacity(&self, n: u64, dtype: DType) -> u64;

    /// Queues on the compute lane the exact sum of `frames` (codes added as integers, in order;
    /// bit planes, with block scales of `2^block_log2` elements where that is not 0) into `out`
    /// (at least [`Backend::sum_capacity`] bytes), its size into `size_at` (0 where the frames
    /// could not be summed: the peers then refuse it alike).
    ///
    /// # Errors
    /// Device errors (not a frame's: those show as a size of 0).
    #[allow(clippy::too_many_arguments)] // (the frames, how to read them, and the output)
    fn sum(
        &mut self,
        frames: &[Region],
        n: u64,
        dtype: DType,
        block_log2: u8,
        out: Region,
        size_at: Region,
    ) -> Result<()>;

    /// Queues on the compute lane `out = scale * (v_0 + v_1 + ...)`, where `v_p` is the decoded
    /// frame `p` (of its region's length, or with `sized` of the length in the row head
    /// [`crate::engine::rows`] places before it, at most its region's) widened to f32, the sum running in f32 in frame order and the product (skipped
    /// when `scale` is 1) rounded to f32 and then to `out`'s dtype, a NaN as the dtype's
    /// canonical quiet NaN (its payload is not kept). Frames are written as `kind` says (or
    /// raw); a frame that is not what its header says, or not of that kind, sets the decoding status
    /// ([`Backend::status`]) and nothing is written, then or later, until the status is
    /// cleared. (Rice frames come unsized: `sized` is for sums, which are bit planes.)
    ///
    /// # Errors
    /// Device errors (not a frame's: see above).
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
    ) -> Result<()>;

    /// Queues on the compute lane `x = dtype(x + r), r = 0` (error feedback for a bucket sent
    /// uncompressed).
    ///
    /// # Errors
    /// Device errors.
    fn fold(&mut self, x: Tensor, r: Tensor) -> Result<()>;

    /// Queues on `lane` the writing of the u64 `word` (little endian) at the start of `dst` and
    /// again every `pitch` bytes, `count` times (a check word into the head of every row).
    ///
    /// # Errors
    /// Device errors; [`crate::Error::Transport`] for words past `dst`.
    fn put(&mut self, lane: Lane, dst: Region, pitch: u64, count: u64, word: u64) -> Result<()>;

    /// Queues on `lane` a copy to the host of `rows` rows of `width` bytes, `pitch` bytes apart,
    /// from the start of `src`. Readable with [`Backend::fetched`] once a mark of the lane
    /// recorded after it was waited for.
    ///
    /// # Errors
    /// Device errors; [`crate::Error::Transport`] for rows past `src`.
    fn fetch(
        &mut self,
        lane: Lane,
        src: Region,
        pitch: u64,
        width: u64,
        rows: u64,
    ) -> Result<Self::Fetched>;

    /// The bytes of a fetch (see [`Backend::fetch`]); the fetch's memory goes back to the
    /// backend.
    fn fetched(&mut self, f: Self::Fetched) -> Vec<u8>;

    /// A mark after everything queued on `lane` so far.
    ///
    /// # Errors
    /// Device errors.
    fn mark(&mut self, lane: Lane) -> Result<Self::Mark>;

    /// Whether the work before `mark` is done (a query: it never waits).
    ///
    /// # Errors
    /// Device errors.
    fn reached(&mut self, mark: &Self::Mark) -> Result<bool>;

    /// The 8 bytes of the decoding status: 0 while every frame decoded so far was sound, else
    /// error bits (u32) and the index + 1 of the first bad frame (u32).
    fn status(&self) -> Region;

    /// The largest error left in a residual so far (f64 bits, in 8 bytes of the backend's
    /// memory), raised by [`Backend::compress`].
    fn max_error(&self) -> Region;

    /// What records, on a caller's stream (a `CUstream`), the point the engine waits for before
    /// it reads a job's tensors. Called once, when the engine starts, from then on on the
    /// submitting threads.
    fn ready_maker(&self) -> crate::engine::ReadyFn;

    /// A mark after everything queued on the compute lane, as what a caller's stream waits on
    /// (see [`crate::engine::Engine::wait`]).
    ///
    /// # Errors
    /// Device errors.
    fn done(&mut self) -> Result<crate::engine::Done>;
}
