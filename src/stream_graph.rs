//! A stretch of work on a stream, recorded once as a CUDA graph and replayed: one submission
//! where the stretch makes several (kernel launches, memsets, copies).
//!
//! Why: on a thread beside PyTorch's autograd thread, each submission to the driver costs
//! 10-25 us and slows the autograd thread's own launches (`docs/perf-notes.md`, "Four driver
//! calls fewer per compressed bucket"). [`Replay::run`] records what a closure queues on a
//! stream (stream capture, in thread-local mode: other threads' CUDA calls are not affected),
//! updates the executable graph it keeps from the last call with the new arguments
//! (`cuGraphExecUpdate`, which succeeds as long as the same kernels, memsets and copies were
//! queued in the same order), and launches it. A new executable graph is made only when the
//! work's shape changes.
//!
//! Recording queues nothing: if the closure fails, or the capture does, nothing of it has run,
//! and [`Replay::run`] returns the error; the caller may then run the closure directly.
//!
//! Recording is itself driver calls: on one H100 beside a backward pass, a bucket's decoding
//! recorded and replayed this way took about 20 us less host time, its compression no less that
//! showed ("Each bucket's compression and decoding as a CUDA graph" in the perf notes). So
//! [`Replay::run_keyed`] skips the recording where the caller can say that the work is the same
//! as last time (a key of its arguments: addresses and sizes, with the values that change from
//! call to call read from device memory by the work itself), and launches the graph as it is:
//! one driver call for the whole stretch.

use crate::cuda::driver_err;
use crate::error::{Error, Result};
use cudarc::driver::sys;

/// An executable graph, destroyed with this value.
#[derive(Debug)]
struct Exec(sys::CUgraphExec);

impl Drop for Exec {
    fn drop(&mut self) {
        // SAFETY: made by `cuGraphInstantiateWithFlags` and owned here; a launched graph may be
        // destroyed while it runs (the driver keeps what the launch needs).
        unsafe { sys::cuGraphExecDestroy(self.0) };
    }
}

/// A recorded graph, destroyed with this value.
struct Graph(sys::CUgraph);

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: made by `cuStreamEndCapture` and owned here.
        unsafe { sys::cuGraphDestroy(self.0) };
    }
}

/// The work of one call site (say, one bucket's compression), replayed from call to call.
#[derive(Debug, Default)]
pub struct Replay {
    exec: Option<Exec>,
    /// The key of the work the executable graph holds ([`Replay::run_keyed`]), if any.
    key: Option<Vec<u64>>,
    /// Executable graphs made so far (instantiations are costly: a shape that changes every
    /// call should not be replayed).
    pub instantiated: u64,
    /// Launches of the executable graph as it was, without recording ([`Replay::run_keyed`]).
    pub reused: u64,
}

// SAFETY: the executable graph is a driver handle, usable from any thread of the process (the
// exchange that holds it is used by one thread at a time).
unsafe impl Send for Replay {}

impl Replay {
    /// Records what `work` queues on `stream` and launches it there as one graph (see the
    /// module's doc). `work` must queue only kernels, memsets and copies on `stream` (no event
    /// waits on other streams, no synchronisation, no allocation).
    ///
    /// # Safety
    /// `stream` must be a live stream of the thread's current context, not being captured;
    /// what `work` queues must be valid to run when the graph runs, right after this call
    /// (the same contract as queuing it directly).
    ///
    /// # Errors
    /// `work`'s error, or [`Error::Cuda`] for a capture, update, instantiation or launch that
    /// failed. Nothing of `work` has run then.
    pub unsafe fn run(
        &mut self,
        stream: sys::CUstream,
        work: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        self.key = None;
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: the stream is live and not capturing (this function's contract).
        unsafe { sys::cuStreamBeginCapture_v2(stream, mode) }
            .result()
            .map_err(driver_err)?;
        let done = work();
        let mut raw: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the capture begun above, on this thread; it must end whatever `work` did.
        let ended = unsafe { sys::cuStreamEndCapture(stream, &mut raw) }.result();
        let graph = (!raw.is_null()).then_some(Graph(raw));
        done?;
        ended.map_err(|e| Error::Cuda(format!("a recorded stretch of work: {e:?}")))?;
        let graph = graph.ok_or_else(|| Error::Cuda("stream capture gave no graph".into()))?;
        let updated = match &self.exec {
            Some(exec) => {
                // SAFETY: a zeroed out-struct of plain data for the driver to fill.
                let mut info: sys::CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
                // SAFETY: both handles are live; the update changes only the executable
                // graph's arguments, or nothing when it fails.
                unsafe { sys::cuGraphExecUpdate_v2(exec.0, graph.0, &mut info) }
                    .result()
                    .is_ok()
            }
            None => false,
        };
        if !updated {
            self.exec = None;
            let mut exec: sys::CUgraphExec = std::ptr::null_mut();
            // SAFETY: the graph is live; the executable graph is owned by `Exec` from here.
            unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph.0, 0) }
                .result()
                .map_err(driver_err)?;
            self.exec = Some(Exec(exec));
            self.instantiated += 1;
        }
        let exec = self.exec.as_ref().expect("made above");
        // SAFETY: a live executable graph and stream of the same context.
        unsafe { sys::cuGraphLaunch(exec.0, stream) }
            .result()
            .map_err(driver_err)
    }

    /// As [`Replay::run`], but where `key` is the key of the last call that recorded, the
    /// executable graph is launched as it is, without calling `work`: one driver call.
    ///
    /// # Safety
    /// As [`Replay::run`]; and `key` must determine what `work` queues: two calls with the same
    /// key would queue the same kernels, memsets and copies with the same arguments (values
    /// that differ between them are read from memory by the work when it runs).
    ///
    /// # Errors
    /// As [`Replay::run`]; a launch that failed leaves no key, so the next call records.
    pub unsafe fn run_keyed(
        &mut self,
        stream: sys::CUstream,
        key: &[u64],
        work: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        if let (Some(exec), Some(kept)) = (&self.exec, &self.key) {
            if kept.as_slice() == key {
                // SAFETY: a live executable graph and stream of the same context; what it
                // queues is what `work` would (this function's contract).
                let launched = unsafe { sys::cuGraphLaunch(exec.0, stream) }.result();
                if let Err(e) = launched {
                    self.key = None;
                    return Err(driver_err(e));
                }
                self.reused += 1;
                return Ok(());
            }
        }
        // SAFETY: this function's contract.
        unsafe { self.run(stream, work) }?;
        self.key = Some(key.to_vec());
        Ok(())
    }
}
