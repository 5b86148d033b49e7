//! The transport of the CUDA backend over [`Links`]: each collective copies the device bytes to
//! the host, moves them with the host collectives, and copies the result back. For ranks that
//! share one GPU (NCCL refuses two ranks on one device) and for tests; slow, and synchronous on
//! the comm lane.

use super::group::GroupLinks;
use super::{host, Links, Transport};
use crate::cuda::driver_err;
use crate::engine::backend::cuda::CudaBackend;
use crate::engine::control::Control;
use crate::engine::job::{Region, Tensor};
use crate::error::Result;
use cudarc::driver::{result, CudaEvent};
use std::sync::Arc;

/// See the module docs.
pub struct StagedTransport<L: Links> {
    links: GroupLinks<L>,
}

impl<L: Links> std::fmt::Debug for StagedTransport<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedTransport")
            .field("rank", &self.links.rank())
            .field("world", &self.links.world())
            .finish()
    }
}

impl<L: Links> StagedTransport<L> {
    /// A transport over `links`.
    pub fn new(links: L) -> StagedTransport<L> {
        StagedTransport {
            links: GroupLinks::whole(links),
        }
    }
}

/// The bytes of `r` (device memory), copied on the comm lane after what was queued on it, and
/// waited for. (The driver's synchronous copies go on the legacy stream, which the engine's
/// streams do not wait for: every copy here is queued on the comm lane instead.)
fn down(be: &CudaBackend, r: Region) -> Result<Vec<u8>> {
    let s = be.comm_stream();
    let mut v = vec![0u8; r.len as usize];
    if r.len > 0 {
        // SAFETY: a region the engine checked (its scratch or a job's tensor); `v` outlives the
        // copy (waited for below).
        unsafe { result::memcpy_dtoh_async(&mut v, r.addr, s.cu_stream()) }.map_err(driver_err)?;
    }
    s.synchronize().map_err(driver_err)?;
    Ok(v)
}

/// `bytes` into `r` (device memory), copied on the comm lane and waited for.
fn up(be: &CudaBackend, r: Region, bytes: &[u8]) -> Result<()> {
    let s = be.comm_stream();
    if !bytes.is_empty() {
        let bytes = &bytes[..bytes.len().min(r.len as usize)];
        // SAFETY: as in `down`, for writes of at most `r.len` bytes; `bytes` outlives the copy.
        unsafe { result::memcpy_htod_async(r.addr, bytes, s.cu_stream()) }.map_err(driver_err)?;
    }
    s.synchronize().map_err(driver_err)
}

impl<L: Links> Transport<CudaBackend> for StagedTransport<L> {
    fn rank(&self) -> usize {
        self.links.rank()
    }

    fn world(&self) -> usize {
        self.links.world()
    }

    fn control(&self) -> &Arc<Control> {
        self.links.control()
    }

    fn all_gather(&mut self, be: &mut CudaBackend, send: Region, recv: Region) -> Result<()> {
        let mine = down(be, send)?;
        let mut all = vec![0u8; recv.len as usize];
        host::all_gather(&mut self.links, &mine, &mut all)?;
        up(be, recv, &all)
    }

    fn exchange(&mut self, be: &mut CudaBackend, sends: &[Region], recvs: &[Region]) -> Result<()> {
        let out: Vec<Vec<u8>> = sends.iter().map(|r| down(be, *r)).collect::<Result<_>>()?;
        let mut into: Vec<Vec<u8>> = recvs.iter().map(|r| vec![0u8; r.len as usize]).collect();
        {
            let s: Vec<&[u8]> = out.iter().map(|v| &v[..]).collect();
            let mut r: Vec<&mut [u8]> = into.iter_mut().map(|v| &mut v[..]).collect();
            host::exchange(&mut self.links, &s, &mut r)?;
        }
        for (r, bytes) in recvs.iter().zip(&into) {
            up(be, *r, bytes)?;
        }
        Ok(())
    }

    fn all_reduce(&mut self, be: &mut CudaBackend, data: Tensor, scale: f32) -> Result<()> {
        let mut bytes = down(be, data.region())?;
        host::all_reduce(&mut self.links, &mut bytes, data.dtype, scale)?;
        up(be, data.region(), &bytes)
    }

    fn reduce_scatter(
        &mut self,
        be: &mut CudaBackend,
        data: Tensor,
        out: Tensor,
        scale: f32,
    ) -> Result<()> {
        let bytes = down(be, data.region())?;
        let mut shard = vec![0u8; out.bytes() as usize];
        host::reduce_scatter(&mut self.links, &bytes, &mut shard, data.dtype, scale)?;
        up(be, out.region(), &shard)
    }

    fn gather(&mut self, _be: &mut CudaBackend, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        host::gather(&mut self.links, mine)
    }

    fn wait(&mut self, _be: &mut CudaBackend, mark: &CudaEvent) -> Result<()> {
        // The collectives above are synchronous; the compute lane's work is polled, with the
        // board between polls.
        loop {
            if mark.try_is_complete().map_err(driver_err)? {
                return Ok(());
            }
            self.links.control().check()?;
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }

    fn abort(&mut self) {}

    fn group(&mut self, _be: &mut CudaBackend, members: &[usize], _color: usize) -> Result<Self> {
        Ok(StagedTransport {
            links: self.links.group(members)?,
        })
    }
}

impl<L: Links> Drop for StagedTransport<L> {
    fn drop(&mut self) {
        self.links.close();
    }
}
