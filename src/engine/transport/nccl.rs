//! The transport of the CUDA backend over an NCCL communicator of the engine's own, on the comm
//! lane's stream. Its waits poll the stream and NCCL's asynchronous error, and look at the
//! failure board between polls: the board is fed by TCP links beside NCCL (a star around rank
//! 0, see [`super::tcp`]), so that a rank whose process died is seen at once even over NVLink,
//! where NCCL would wait for its timeout. On a failure the communicator is aborted: its kernels
//! stop and the streams drain.

use super::Transport;
use crate::cuda::memory::DeviceBuffer;
use crate::engine::backend::cuda::CudaBackend;
use crate::engine::control::Control;
use crate::engine::job::{Region, Tensor};
use crate::error::{Error, Result};
use crate::nccl::Communicator;
use cudarc::driver::{result, CudaEvent};
use std::sync::Arc;

/// See the module docs.
pub struct NcclTransport {
    comm: Communicator,
    control: Arc<Control>,
    /// What feeds the board (kept open for the engine's life); `None` where the board is shared
    /// by ranks that are threads of one process.
    _links: Option<Box<dyn super::Links>>,
    /// Device memory for small host messages.
    small: Option<DeviceBuffer>,
    /// Smaller ones it replaced, freed with the transport: freeing device memory mid-run would
    /// wait for the whole device, every stream of the process's included.
    outgrown: Vec<DeviceBuffer>,
}

impl std::fmt::Debug for NcclTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclTransport")
            .field("rank", &self.comm.rank())
            .field("world", &self.comm.world())
            .finish()
    }
}

impl NcclTransport {
    /// A transport over `comm`, whose failures come from `control` (fed by `links`, kept open
    /// as long as the transport).
    pub fn new(
        mut comm: Communicator,
        control: Arc<Control>,
        links: Option<Box<dyn super::Links>>,
    ) -> NcclTransport {
        comm.set_interrupt(control.clone());
        NcclTransport {
            comm,
            control,
            _links: links,
            small: None,
            outgrown: Vec::new(),
        }
    }

    fn stream(be: &CudaBackend) -> cudarc::driver::sys::CUstream {
        be.comm_stream().cu_stream()
    }

    /// The scale as NCCL's reduction: a sum, or an average (`1 / world`).
    fn average(&self, scale: f32) -> Result<bool> {
        let w = self.comm.world();
        if scale == 1.0 {
            Ok(false)
        } else if scale == 1.0 / w as f32 {
            Ok(true)
        } else {
            Err(Error::Transport(format!(
                "an uncompressed reduction over NCCL scales by 1 or 1/{w}, not {scale}"
            )))
        }
    }
}

impl Transport<CudaBackend> for NcclTransport {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world()
    }

    fn control(&self) -> &Arc<Control> {
        &self.control
    }

    fn all_gather(&mut self, be: &mut CudaBackend, send: Region, recv: Region) -> Result<()> {
        if recv.len != send.len * self.comm.world() as u64 {
            return Err(Error::Transport(format!(
                "internal: an all-gather of {} bytes into {}",
                send.len, recv.len
            )));
        }
        // SAFETY: the engine's scratch (checked regions), live until the stream passed the
        // collective (the engine frees scratch only after later work on its lanes).
        unsafe {
            self.comm
                .all_gather(send.addr, recv.addr, send.len as usize, Self::stream(be))
        }
    }

    fn exchange(&mut self, be: &mut CudaBackend, sends: &[Region], recvs: &[Region]) -> Result<()> {
        let s: Vec<(u64, usize)> = sends.iter().map(|r| (r.addr, r.len as usize)).collect();
        let r: Vec<(u64, usize)> = recvs.iter().map(|r| (r.addr, r.len as usize)).collect();
        // SAFETY: as in `all_gather`; every peer queues the matching sends and receives (the
        // engine runs one schedule on every rank).
        unsafe { self.comm.send_recv(&s, &r, Self::stream(be)) }
    }

    fn all_reduce(&mut self, be: &mut CudaBackend, data: Tensor, scale: f32) -> Result<()> {
        let average = self.average(scale)?;
        // SAFETY: the job's tensor, vouched for by the submitter.
        unsafe {
            self.comm.all_reduce(
                data.addr,
                data.addr,
                data.numel as usize,
                data.dtype,
                average,
                Self::stream(be),
            )
        }
    }

    fn reduce_scatter(
        &mut self,
        be: &mut CudaBackend,
        data: Tensor,
        out: Tensor,
        scale: f32,
    ) -> Result<()> {
        let average = self.average(scale)?;
        // SAFETY: the job's tensors, vouched for by the submitter (apart: checked at submit).
        unsafe {
            self.comm.reduce_scatter(
                data.addr,
                out.addr,
                out.numel as usize,
                data.dtype,
                average,
                Self::stream(be),
            )
        }
    }

    fn gather(&mut self, be: &mut CudaBackend, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let w = self.comm.world();
        // Every rank's length, then every rank's bytes padded to the longest.
        let lens = self.gather_fixed(be, &(mine.len() as u64).to_le_bytes())?;
        let lens: Vec<usize> = lens
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as usize)
            .collect();
        let longest = lens.iter().copied().max().unwrap_or(0);
        if longest > 1 << 26 {
            return Err(Error::Transport(format!(
                "a peer sent {longest} bytes for a small message: the ranks' collectives are \
                 out of step (do they all submit the same jobs?)"
            )));
        }
        let mut padded = mine.to_vec();
        padded.resize(longest, 0);
        let all = self.gather_fixed(be, &padded)?;
        Ok((0..w)
            .map(|j| all[j * longest..j * longest + lens[j]].to_vec())
            .collect())
    }

    fn wait(&mut self, _be: &mut CudaBackend, mark: &CudaEvent) -> Result<()> {
        self.comm.wait_event(mark)
    }

    fn abort(&mut self) {
        self.comm.abort_now();
    }

    fn can_group(&self) -> bool {
        self.comm.can_split()
    }

    fn group(&mut self, _be: &mut CudaBackend, members: &[usize], color: usize) -> Result<Self> {
        let me = self.comm.rank();
        let rank = members.iter().position(|&r| r == me).ok_or_else(|| {
            Error::Transport(format!(
                "internal: rank {me} is not in the group {members:?}"
            ))
        })?;
        let comm = self.comm.split(color, rank, members.len())?;
        Ok(NcclTransport::new(comm, self.control.clone(), None))
    }
}

impl NcclTransport {
    /// Every rank's `mine` (all of one length), gathered through the device; waits.
    fn gather_fixed(&mut self, be: &mut CudaBackend, mine: &[u8]) -> Result<Vec<u8>> {
        let w = self.comm.world();
        let len = mine.len().max(1);
        let need = len * (w + 1);
        if self.small.as_ref().is_none_or(|b| b.len() < need) {
            let bigger = DeviceBuffer::new(be.context(), need.next_power_of_two())?;
            self.outgrown.extend(self.small.replace(bigger));
        }
        let buf = self.small.as_ref().map_or(0, |b| b.ptr());
        let stream = be.comm_stream().clone();
        let mut padded = mine.to_vec();
        padded.resize(len, 0);
        // SAFETY: `small` holds `need` bytes; the host bytes outlive the copy (the stream is
        // waited for before this returns).
        unsafe {
            result::memcpy_htod_async(buf, &padded, stream.cu_stream())
                .map_err(crate::cuda::driver_err)?;
            self.comm
                .all_gather(buf, buf + len as u64, len, stream.cu_stream())?;
        }
        self.comm.wait(&stream)?;
        let mut out = vec![0u8; len * w];
        // SAFETY: the stream is idle (waited above); `out` has room for every row.
        unsafe { result::memcpy_dtoh_sync(&mut out, buf + len as u64) }
            .map_err(crate::cuda::driver_err)?;
        if mine.is_empty() {
            // (one byte per rank went, for a message of none)
            return Ok(Vec::new());
        }
        Ok(out)
    }
}
