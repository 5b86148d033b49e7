//! The gate a caller's CUDA stream waits at for jobs the engine has not finished yet
//! ([`crate::engine::Engine::order`]): a 64-bit count in page-locked host memory that the
//! device reads and writes. The engine's comm thread queues, after a job's last work on its own
//! stream, a write that raises the count to the job's number; the caller's stream waits, on the
//! device, until the count reaches that number. So a caller (an FSDP reduce-scatter) returns as
//! soon as its job is handed over, and what it queues after runs once the result is there,
//! without a thread of the caller's ever waiting for it.
//!
//! A stream that waits at the gate waits for the engine: when the engine fails, it opens the
//! gate for good ([`Gate::open`]: the count to `u64::MAX`, written by the host), but only once
//! its device has drained, so that what the caller queued after the wait never runs while the
//! engine's kernels still use the caller's memory. A device that never drains keeps the gate
//! shut: the host still hears of the failure (the next wait raises it).
//!
//! The count's memory is never freed: a stream may still read it after the engine is gone
//! (one page per engine).

use crate::cuda::{driver_err, ContextGuard};
use crate::error::Result;
use cudarc::driver::{sys, CudaContext, CudaStream};
use std::sync::Arc;

/// See the module docs.
pub(crate) struct Gate {
    ctx: Arc<CudaContext>,
    /// The count, as the host writes it.
    host: *mut u64,
    /// The count, as the device reads and writes it.
    dev: sys::CUdeviceptr,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate").field("dev", &self.dev).finish()
    }
}

// SAFETY: the count is plain page-locked memory that lives as long as the process (never
// freed); the host only ever stores to it (a volatile write), the device reads and writes it.
unsafe impl Send for Gate {}
// SAFETY: as above; `open` is a single aligned 8-byte store.
unsafe impl Sync for Gate {}

impl Gate {
    /// A gate on the device of `ctx` (its primary context, current on the calling thread), at
    /// count 0; `None` where the device cannot wait on 64-bit values in a stream (callers then
    /// wait on the host).
    ///
    /// # Errors
    /// Device errors.
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<Option<Gate>> {
        let can = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS)
            .map_err(driver_err)?;
        if can == 0 {
            tracing::info!(
                "cfc: this device cannot wait on values in a stream; FSDP calls wait on the host"
            );
            return Ok(None);
        }
        ctx.bind_to_thread().map_err(driver_err)?;
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: the context is current; `p` receives 8 bytes of page-locked memory, never
        // freed (see the module docs).
        unsafe { sys::cuMemHostAlloc(&mut p, 8, flags) }
            .result()
            .map_err(driver_err)?;
        let host = p as *mut u64;
        // SAFETY: 8 writable bytes just allocated, aligned (a page).
        unsafe { std::ptr::write_volatile(host, 0) };
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `p` is mapped memory of this context (DEVICEMAP).
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, p, 0) }
            .result()
            .map_err(driver_err)?;
        Ok(Some(Gate {
            ctx: ctx.clone(),
            host,
            dev,
        }))
    }

    /// Queues on `stream` (a `CUstream` of the device's primary context; the engine's own
    /// streams do not block on the legacy default stream, so 0 is one too) a wait until the
    /// count is at least `at`.
    ///
    /// # Errors
    /// Device errors.
    pub(crate) fn hold(&self, stream: u64, at: u64) -> Result<()> {
        let _restore = ContextGuard::save()?;
        self.ctx.bind_to_thread().map_err(driver_err)?;
        // SAFETY: `dev` is the device address of the count (8 bytes, never freed); `stream`
        // is a stream of this context, as the caller vouches.
        unsafe {
            sys::cuStreamWaitValue64_v2(
                stream as sys::CUstream,
                self.dev,
                at,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        }
        .result()
        .map_err(driver_err)
    }

    /// Queues on `stream` (one of the engine's) the raising of the count to `to`, after what
    /// is queued there before it.
    ///
    /// # Errors
    /// Device errors.
    pub(crate) fn raise_on(&self, stream: &CudaStream, to: u64) -> Result<()> {
        // SAFETY: as in `hold`; the stream is the engine's own, of this context.
        unsafe {
            sys::cuStreamWriteValue64_v2(
                stream.cu_stream(),
                self.dev,
                to,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        }
        .result()
        .map_err(driver_err)
    }

    /// Opens the gate for good: every wait, queued or to come, passes (see the module docs for
    /// when this is safe).
    pub(crate) fn open(&self) {
        // SAFETY: 8 aligned bytes of page-locked memory that are never freed.
        unsafe { std::ptr::write_volatile(self.host, u64::MAX) };
    }
}
