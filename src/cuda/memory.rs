//! Memory that cfc allocates itself: device buffers and pinned host buffers.
//!
//! Only the engine's CUDA backend and transports use them, for scratch that belongs to no
//! caller. The codec in [`crate::cuda`] never allocates: it works in
//! the caller's memory.

use crate::cuda::driver_err;
use crate::error::{Error, Result};
use cudarc::driver::{result, CudaContext};
use std::sync::Arc;

/// `len` bytes of device memory in `ctx`, freed on drop.
pub(crate) struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ptr: u64,
    len: usize,
}

impl DeviceBuffer {
    /// Allocates `len` bytes (none for 0: the address is then 0).
    pub(crate) fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<DeviceBuffer> {
        ctx.bind_to_thread().map_err(driver_err)?;
        let ptr = if len == 0 {
            0
        } else {
            // SAFETY: the context is current on this thread; the memory is freed once, on drop.
            unsafe { result::malloc_sync(len) }.map_err(|e| {
                Error::Cuda(format!(
                    "could not allocate {len} bytes on the device: {e:?}"
                ))
            })?
        };
        Ok(DeviceBuffer {
            ctx: ctx.clone(),
            ptr,
            len,
        })
    }

    /// Allocates `len` bytes, zeroed (waits for the zeroing).
    pub(crate) fn zeroed(ctx: &Arc<CudaContext>, len: usize) -> Result<DeviceBuffer> {
        let buf = DeviceBuffer::new(ctx, len)?;
        if len > 0 {
            // SAFETY: `len` bytes of device memory just allocated in this context (current).
            unsafe { result::memset_d8_sync(buf.ptr, 0, len) }.map_err(driver_err)?;
        }
        Ok(buf)
    }

    /// The device address.
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Its size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        // SAFETY: `ptr` came from `malloc_sync` in this context and is freed exactly once;
        // `cuMemFree` waits for work that may still use it.
        let freed = self
            .ctx
            .bind_to_thread()
            .and_then(|()| unsafe { result::free_sync(self.ptr) });
        if let Err(e) = freed {
            tracing::warn!(error = ?e, bytes = self.len, "could not free device memory");
        }
    }
}

/// `len` bytes of page-locked host memory (so that a copy from the device is queued, not
/// waited for), freed on drop.
pub(crate) struct PinnedBuffer {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain host memory owned by this value alone; the raw pointer is only
// read through `&self` / written through `&mut self`.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` bytes (at least one), zeroed.
    pub(crate) fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<PinnedBuffer> {
        ctx.bind_to_thread().map_err(driver_err)?;
        let len = len.max(1);
        // SAFETY: the context is current; the memory is freed once, on drop.
        let ptr = unsafe { result::malloc_host(len, 0) }.map_err(driver_err)? as *mut u8;
        // SAFETY: `ptr` points to `len` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(PinnedBuffer {
            ctx: ctx.clone(),
            ptr,
            len,
        })
    }

    /// The host address, as the driver's copies take it.
    pub(crate) fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// Its size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Writes `src` at its start (at most its size), for a copy to the device queued after.
    pub(crate) fn write(&mut self, src: &[u8]) {
        let len = src.len().min(self.len);
        // SAFETY: `len` bytes of this allocation, owned by `&mut self`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr, len) };
    }

    /// A copy of its first `len` bytes (at most its size), as the device last wrote them (the
    /// caller has waited for the copies that wrote them).
    pub(crate) fn bytes(&self, len: usize) -> Vec<u8> {
        let len = len.min(self.len);
        // SAFETY: `len` bytes of this allocation, initialised (zeroed at allocation).
        unsafe { std::slice::from_raw_parts(self.ptr, len) }.to_vec()
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `malloc_host` and is freed exactly once.
        let freed = self
            .ctx
            .bind_to_thread()
            .and_then(|()| unsafe { result::free_host(self.ptr as *mut std::ffi::c_void) });
        if let Err(e) = freed {
            tracing::warn!(error = ?e, "could not free pinned memory");
        }
    }
}
