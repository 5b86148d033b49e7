//! Collectives of host bytes over [`Links`], and the transport of the CPU backend built on
//! them. Each rank sends its own messages (a full mesh): what a rank sends is what a ring
//! would, `2 (N - 1) / N` of a buffer for a plain all-reduce.

use super::group::GroupLinks;
use super::{Links, Transport};
use crate::element::Element;
use crate::engine::backend::cpu::{CpuBackend, HostMark};
use crate::engine::backend::Lane;
use crate::engine::control::Control;
use crate::engine::job::{Region, Tensor};
use crate::error::{Error, Result};
use crate::format::DType;
use half::{bf16, f16};
use std::sync::Arc;

/// The message from `peer`, which must hold `into.len()` bytes (both sides agreed on it).
fn recv_exact<L: Links + ?Sized>(l: &mut L, peer: usize, into: &mut [u8]) -> Result<()> {
    let got = l.recv(peer)?;
    if got.len() != into.len() {
        return Err(Error::Transport(format!(
            "rank {peer} sent {} bytes where {} were agreed (the ranks' collectives no longer \
             match)",
            got.len(),
            into.len()
        )));
    }
    into.copy_from_slice(&got);
    Ok(())
}

/// `send` from every rank into `recv`, in rank order.
pub(crate) fn all_gather<L: Links + ?Sized>(l: &mut L, send: &[u8], recv: &mut [u8]) -> Result<()> {
    let (rank, world, len) = (l.rank(), l.world(), send.len());
    if recv.len() != world * len {
        return Err(Error::Transport(format!(
            "internal: an all-gather of {len} bytes into {}",
            recv.len()
        )));
    }
    l.expect(len);
    for peer in (0..world).filter(|&p| p != rank) {
        l.send(peer, send)?;
    }
    recv[rank * len..(rank + 1) * len].copy_from_slice(send);
    for peer in (0..world).filter(|&p| p != rank) {
        recv_exact(l, peer, &mut recv[peer * len..(peer + 1) * len])?;
    }
    Ok(())
}

/// `sends[j]` to rank `j`, `recvs[j]` from it (empty ones skipped, this rank's own copied).
pub(crate) fn exchange<L: Links + ?Sized>(
    l: &mut L,
    sends: &[&[u8]],
    recvs: &mut [&mut [u8]],
) -> Result<()> {
    let (rank, world) = (l.rank(), l.world());
    if sends.len() != world || recvs.len() != world {
        return Err(Error::Transport(format!(
            "internal: an exchange of {} and {} parts among {world} ranks",
            sends.len(),
            recvs.len()
        )));
    }
    l.expect(recvs.iter().map(|r| r.len()).max().unwrap_or(0));
    for (peer, s) in sends.iter().enumerate() {
        if peer != rank && !s.is_empty() {
            l.send(peer, s)?;
        }
    }
    if recvs[rank].len() != sends[rank].len() {
        return Err(Error::Transport(
            "internal: this rank's own part changes length".into(),
        ));
    }
    recvs[rank].copy_from_slice(sends[rank]);
    for (peer, r) in recvs.iter_mut().enumerate() {
        if peer != rank && !r.is_empty() {
            recv_exact(l, peer, r)?;
        }
    }
    Ok(())
}

/// Every rank's `mine`, in rank order. (At most [`super::MESSAGE_FLOOR`] bytes, which every
/// link admits: `Engine::gather` refuses more, the engine's own rounds are smaller.)
pub(crate) fn gather<L: Links + ?Sized>(l: &mut L, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
    let (rank, world) = (l.rank(), l.world());
    for peer in (0..world).filter(|&p| p != rank) {
        l.send(peer, mine)?;
    }
    (0..world)
        .map(|peer| {
            if peer == rank {
                Ok(mine.to_vec())
            } else {
                l.recv(peer)
            }
        })
        .collect()
}

/// Elements `shard(n, world, j)` of `n`: contiguous, as even as can be.
fn shard(n: usize, world: usize, j: usize) -> std::ops::Range<usize> {
    let per = n.div_ceil(world.max(1));
    (j * per).min(n)..((j + 1) * per).min(n)
}

/// `out = scale * sum(parts)`: each element added in f32 in part order, then scaled (skipped
/// for 1) and rounded to `T`.
fn reduce<T: Element + bytemuck::Pod>(parts: &[&[u8]], scale: f32, out: &mut [u8]) {
    let n = out.len() / std::mem::size_of::<T>();
    let value = |p: &[u8], i: usize| -> f32 {
        let v: T = bytemuck::pod_read_unaligned(
            &p[i * std::mem::size_of::<T>()..][..std::mem::size_of::<T>()],
        );
        v.to_f64() as f32
    };
    for i in 0..n {
        let mut acc = value(parts[0], i);
        for p in &parts[1..] {
            acc += value(p, i);
        }
        let v = T::from_f32(if scale == 1.0 { acc } else { acc * scale });
        out[i * std::mem::size_of::<T>()..][..std::mem::size_of::<T>()]
            .copy_from_slice(bytemuck::bytes_of(&v));
    }
}

fn reduce_dtype(dtype: DType, parts: &[&[u8]], scale: f32, out: &mut [u8]) -> Result<()> {
    match dtype {
        DType::F32 => reduce::<f32>(parts, scale, out),
        DType::BF16 => reduce::<bf16>(parts, scale, out),
        DType::F16 => reduce::<f16>(parts, scale, out),
        other => return Err(Error::NotQuantizable(other)),
    }
    Ok(())
}

/// The plain reduce-scatter: `data` holds `world` shards (rank-major); this rank's shard,
/// summed over the ranks in rank order and scaled, goes to `out`.
pub(crate) fn reduce_scatter<L: Links + ?Sized>(
    l: &mut L,
    data: &[u8],
    out: &mut [u8],
    dtype: DType,
    scale: f32,
) -> Result<()> {
    let (rank, world) = (l.rank(), l.world());
    let len = out.len();
    if data.len() != world * len {
        return Err(Error::Transport(format!(
            "internal: a reduce-scatter of {} bytes into {len}",
            data.len()
        )));
    }
    l.expect(len);
    for peer in (0..world).filter(|&p| p != rank) {
        l.send(peer, &data[peer * len..(peer + 1) * len])?;
    }
    let mut got = vec![Vec::new(); world];
    for (peer, g) in got.iter_mut().enumerate() {
        if peer != rank {
            *g = l.recv(peer)?;
            if g.len() != len {
                return Err(Error::Transport(format!(
                    "rank {peer} sent {} bytes of a shard of {len}",
                    g.len()
                )));
            }
        }
    }
    let parts: Vec<&[u8]> = (0..world)
        .map(|j| {
            if j == rank {
                &data[rank * len..(rank + 1) * len]
            } else {
                &got[j][..]
            }
        })
        .collect();
    reduce_dtype(dtype, &parts, scale, out)
}

/// The plain all-reduce of `data` in place: a reduce-scatter of element shards (summed in rank
/// order), then an all-gather of the sums.
pub(crate) fn all_reduce<L: Links + ?Sized>(
    l: &mut L,
    data: &mut [u8],
    dtype: DType,
    scale: f32,
) -> Result<()> {
    let (rank, world, size) = (l.rank(), l.world(), dtype.size());
    let n = data.len() / size;
    let bytes = |j: usize| {
        let s = shard(n, world, j);
        s.start * size..s.end * size
    };
    l.expect(bytes(0).len()); // (the first shard is the longest)
    for peer in (0..world).filter(|&p| p != rank) {
        l.send(peer, &data[bytes(peer)])?;
    }
    let mine = bytes(rank);
    let mut got = vec![Vec::new(); world];
    for (peer, g) in got.iter_mut().enumerate() {
        if peer != rank {
            *g = l.recv(peer)?;
            if g.len() != mine.len() {
                return Err(Error::Transport(format!(
                    "rank {peer} sent {} bytes of a shard of {}",
                    g.len(),
                    mine.len()
                )));
            }
        }
    }
    let own = data[mine.clone()].to_vec();
    let parts: Vec<&[u8]> = (0..world)
        .map(|j| if j == rank { &own[..] } else { &got[j][..] })
        .collect();
    reduce_dtype(dtype, &parts, scale, &mut data[mine.clone()])?;
    for peer in (0..world).filter(|&p| p != rank) {
        l.send(peer, &data[mine.clone()])?;
    }
    for peer in (0..world).filter(|&p| p != rank) {
        let range = bytes(peer);
        recv_exact(l, peer, &mut data[range])?;
    }
    Ok(())
}

/// The transport of the CPU backend: host collectives over [`Links`], run at once.
pub struct HostTransport<L: Links> {
    links: GroupLinks<L>,
}

impl<L: Links> std::fmt::Debug for HostTransport<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTransport")
            .field("rank", &self.links.rank())
            .field("world", &self.links.world())
            .finish()
    }
}

impl<L: Links> HostTransport<L> {
    /// A transport over `links`.
    pub fn new(links: L) -> HostTransport<L> {
        HostTransport {
            links: GroupLinks::whole(links),
        }
    }
}

/// The bytes of a region of host memory.
///
/// # Safety
/// `r` must be host memory valid for `r.len` bytes while the slice lives (the engine's scratch
/// or a job's tensor), and not aliased mutably meanwhile.
unsafe fn host<'a>(r: Region) -> &'a [u8] {
    if r.len == 0 {
        return &[];
    }
    // SAFETY: this function's contract.
    unsafe { std::slice::from_raw_parts(r.addr as *const u8, r.len as usize) }
}

/// [`host`], writable.
///
/// # Safety
/// As [`host`], with no other reference to those bytes alive.
unsafe fn host_mut<'a>(r: Region) -> &'a mut [u8] {
    if r.len == 0 {
        return &mut [];
    }
    // SAFETY: this function's contract.
    unsafe { std::slice::from_raw_parts_mut(r.addr as *mut u8, r.len as usize) }
}

impl<L: Links> Transport<CpuBackend> for HostTransport<L> {
    fn rank(&self) -> usize {
        self.links.rank()
    }

    fn world(&self) -> usize {
        self.links.world()
    }

    fn control(&self) -> &Arc<Control> {
        self.links.control()
    }

    fn all_gather(&mut self, be: &mut CpuBackend, send: Region, recv: Region) -> Result<()> {
        be.touch(Lane::Comm, send, false, "the all-gather")?;
        be.touch(Lane::Comm, recv, true, "the all-gather")?;
        // SAFETY: the engine's scratch (regions it checked), in disjoint buffers.
        let (send, recv) = unsafe { (host(send), host_mut(recv)) };
        all_gather(&mut self.links, send, recv)
    }

    fn exchange(&mut self, be: &mut CpuBackend, sends: &[Region], recvs: &[Region]) -> Result<()> {
        for r in sends {
            be.touch(Lane::Comm, *r, false, "the exchange")?;
        }
        for r in recvs {
            be.touch(Lane::Comm, *r, true, "the exchange")?;
        }
        // SAFETY: as above: the send rows and the receive rows lie in different buffers, and
        // the receive rows do not overlap each other.
        let sends: Vec<&[u8]> = sends.iter().map(|r| unsafe { host(*r) }).collect();
        // SAFETY: as above.
        let mut recvs: Vec<&mut [u8]> = recvs.iter().map(|r| unsafe { host_mut(*r) }).collect();
        exchange(&mut self.links, &sends, &mut recvs)
    }

    fn all_reduce(&mut self, be: &mut CpuBackend, data: Tensor, scale: f32) -> Result<()> {
        be.touch(Lane::Comm, data.region(), true, "the plain all-reduce")?;
        // SAFETY: the job's tensor, vouched for by the submitter.
        let bytes = unsafe { host_mut(data.region()) };
        all_reduce(&mut self.links, bytes, data.dtype, scale)
    }

    fn reduce_scatter(
        &mut self,
        be: &mut CpuBackend,
        data: Tensor,
        out: Tensor,
        scale: f32,
    ) -> Result<()> {
        be.touch(Lane::Comm, data.region(), false, "the plain reduce-scatter")?;
        be.touch(Lane::Comm, out.region(), true, "the plain reduce-scatter")?;
        // SAFETY: the job's tensors, vouched for by the submitter (the output apart from the
        // input: `Engine::submit` refuses an overlap).
        let (src, dst) = unsafe { (host(data.region()), host_mut(out.region())) };
        reduce_scatter(&mut self.links, src, dst, data.dtype, scale)
    }

    fn gather(&mut self, _be: &mut CpuBackend, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        gather(&mut self.links, mine)
    }

    fn wait(&mut self, be: &mut CpuBackend, mark: &HostMark) -> Result<()> {
        // The CPU backend's work is done when its call returns: nothing to wait for (and a
        // failure raised since belongs to later work). The lane check learns of the wait.
        be.waited(mark);
        Ok(())
    }

    fn abort(&mut self) {}

    fn group(&mut self, _be: &mut CpuBackend, members: &[usize], _color: usize) -> Result<Self> {
        Ok(HostTransport {
            links: self.links.group(members)?,
        })
    }
}

impl<L: Links> Drop for HostTransport<L> {
    fn drop(&mut self) {
        self.links.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::transport::local::LocalLinks;
    use std::time::Duration;

    #[test]
    fn host_collectives_over_threads() {
        let links = LocalLinks::group(3, Duration::from_secs(10));
        let out: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = links
                .into_iter()
                .map(|mut l| {
                    s.spawn(move || {
                        let r = l.rank();
                        let mut all = vec![0u8; 6];
                        all_gather(&mut l, &[r as u8, 10 + r as u8], &mut all).unwrap();
                        let mut x: Vec<f32> = (0..7).map(|i| (i + r) as f32).collect();
                        all_reduce(&mut l, bytemuck::cast_slice_mut(&mut x), DType::F32, 0.5)
                            .unwrap();
                        let got = gather(&mut l, &vec![r as u8; r]).unwrap();
                        (all, x, got)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (all, x, got) in out {
            assert_eq!(all, [0, 10, 1, 11, 2, 12]);
            let want: Vec<f32> = (0..7).map(|i| (3 * i + 3) as f32 * 0.5).collect();
            assert_eq!(x, want);
            assert_eq!(got, vec![vec![], vec![1], vec![2, 2]]);
        }
    }
}
