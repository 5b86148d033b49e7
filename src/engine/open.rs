//! The ways to open an engine: on the CPU backend over threads of one process or TCP links
//! between processes, on the CUDA backend over NCCL or over host links (see `Engine::start`).

use super::backend::cpu::CpuBackend;
use super::transport::host::HostTransport;
use super::transport::local::LocalLinks;
#[cfg(feature = "cuda")]
use super::{backend, Control};
use super::{transport, Engine, Options};
use crate::error::Result;
#[cfg(feature = "cuda")]
use std::sync::Arc;

impl Engine {
    /// Engines for `world` ranks that are threads of this process, on the CPU backend: one per
    /// rank, to be driven from one thread each.
    ///
    /// # Errors
    /// As `Engine::start`.
    pub fn local_group(world: usize, options: Options) -> Result<Vec<Engine>> {
        Engine::local_nodes(&vec![0; world], options)
    }

    /// As [`Engine::local_group`], rank `r` on node `nodes[r]` (emulated: for tests of the
    /// two-level exchange).
    ///
    /// # Errors
    /// As `Engine::start`.
    pub fn local_nodes(nodes: &[usize], options: Options) -> Result<Vec<Engine>> {
        LocalLinks::group(nodes.len(), options.timeout)
            .into_iter()
            .map(|l| {
                Engine::start(
                    CpuBackend::new(),
                    HostTransport::new(l),
                    options.clone(),
                    0,
                    nodes,
                )
            })
            .collect()
    }

    /// An engine on the CPU backend over links between processes, rank `r` on node `nodes[r]`
    /// (empty: one node).
    ///
    /// # Errors
    /// As `Engine::start`.
    pub fn on_cpu<L: transport::Links + 'static>(
        links: L,
        options: Options,
        token: u64,
        nodes: &[usize],
    ) -> Result<Engine> {
        Engine::start(
            CpuBackend::new(),
            HostTransport::new(links),
            options,
            token,
            nodes,
        )
    }

    /// An engine on the CUDA backend (device `device`) over an NCCL communicator of its own,
    /// whose waits end at the first failure on `control` (fed by `links`, kept open as long as
    /// the engine: TCP links in a star around rank 0 between processes, or the shared board of
    /// ranks that are threads of one process).
    ///
    /// # Errors
    /// As `Engine::start`; CUDA errors.
    #[cfg(feature = "cuda")]
    pub fn on_cuda_nccl(
        device: usize,
        comm: crate::nccl::Communicator,
        control: Arc<Control>,
        links: Option<Box<dyn transport::Links>>,
        options: Options,
        token: u64,
        nodes: &[usize],
    ) -> Result<Engine> {
        let be = backend::cuda::CudaBackend::new(device)?;
        let mut comm = comm;
        comm.set_timeout(options.timeout);
        let tr = transport::nccl::NcclTransport::new(comm, control, links);
        Engine::start(be, tr, options, token, nodes)
    }

    /// An engine on the CUDA backend (device `device`) over host links, through host memory
    /// (ranks that share a GPU, where NCCL refuses them).
    ///
    /// # Errors
    /// As `Engine::start`; CUDA errors.
    #[cfg(feature = "cuda")]
    pub fn on_cuda_links<L: transport::Links + 'static>(
        device: usize,
        links: L,
        options: Options,
        token: u64,
        nodes: &[usize],
    ) -> Result<Engine> {
        let be = backend::cuda::CudaBackend::new(device)?;
        Engine::start(
            be,
            transport::staged::StagedTransport::new(links),
            options,
            token,
            nodes,
        )
    }
}
