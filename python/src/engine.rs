//! The engine of `cfc._native` (`cfc::engine`): one per `CfcState` or `AllReducer`, opened by
//! `cfc._engine` once the ranks have exchanged their link addresses.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::sync::{Arc, Mutex};

use crate::engine_state;
use crate::error::{to_py, CfcError};
use crate::tensor::{self, Place};
use cfc::engine::topology::node_indices;
use cfc::engine::transport::tcp::{Credentials, Listener as TcpListener, Reach, Shape, TcpLinks};
use cfc::engine::{
    Algorithm, BoundRule, Engine as CoreEngine, Fallback, Fault, FsdpOptions, Job, Op, Options,
    Scale, Tensor, Topology,
};

/// A bound TCP port for the engine's links: made first, its addresses published to the other
/// ranks, then handed to `Engine`.
#[pyclass(module = "cfc._native")]
pub struct Listener {
    inner: Mutex<Option<TcpListener>>,
}

#[pymethods]
impl Listener {
    /// Binds a port: on `CFC_LINK_ADDR` when set, else on the loopback address where every
    /// rank runs on this host (`one_host`), else on the address that reaches `MASTER_ADDR`.
    #[new]
    #[pyo3(signature = (one_host))]
    fn new(one_host: bool) -> PyResult<Self> {
        let reach = if one_host {
            Reach::OneHost
        } else {
            Reach::Network
        };
        Ok(Listener {
            inner: Mutex::new(Some(TcpListener::bind(reach).map_err(to_py)?)),
        })
    }

    /// The addresses the other ranks may reach this one at, best first.
    fn addresses(&self) -> PyResult<Vec<String>> {
        let held = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        held.as_ref()
            .map(|l| l.addresses())
            .ok_or_else(|| CfcError::new_err("this listener was given to an engine"))
    }
}

/// A tensor as the core takes it (read and checked by `tensor::at`).
fn core_tensor(m: tensor::Memory) -> Tensor {
    Tensor {
        addr: m.addr,
        numel: m.numel,
        dtype: m.dtype,
    }
}

/// The engine's options from the Python package's (already checked there; checked again by the
/// core).
#[allow(clippy::too_many_arguments)]
fn options(
    bound_kind: &str,
    bound: f64,
    error_feedback: bool,
    algorithm: Option<&str>,
    fallback: &str,
    trial_steps: u32,
    warmup_steps: u32,
    min_compress_numel: u64,
    timeout: f64,
    topology: &str,
    coder: &str,
    block: u64,
    fsdp: Option<(u8, bool)>,
) -> PyResult<Options> {
    let bound = match bound_kind {
        "eps" => BoundRule::Abs(bound),
        "rms" => BoundRule::Rms(bound),
        "rel" => BoundRule::Rel(bound),
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown bound kind {other:?}"
            )))
        }
    };
    let algorithm = match algorithm {
        None => None,
        Some("all-gather") => Some(Algorithm::AllGather),
        Some("reduce-scatter") => Some(Algorithm::ReduceScatter),
        Some(other) => {
            return Err(PyValueError::new_err(format!(
                "unknown algorithm {other:?}"
            )))
        }
    };
    let fallback = match fallback {
        "never" => Fallback::Never,
        "always" => Fallback::Always,
        "auto" => Fallback::Auto { trial_steps },
        other => return Err(PyValueError::new_err(format!("unknown fallback {other:?}"))),
    };
    let o = Options {
        bound,
        error_feedback,
        algorithm,
        fallback,
        warmup_steps,
        min_compress_numel,
        timeout: cfc::engine::options::timeout_from_seconds(timeout).map_err(to_py)?,
        topology: Topology::from_name(topology)
            .map_err(|e| PyValueError::new_err(e.to_string()))?,
        coder: cfc::Coder::from_name(coder)
            .ok_or_else(|| PyValueError::new_err(format!("unknown coder {coder:?}")))?,
        block,
        fsdp: fsdp.map(|(residual_bits, step_check)| FsdpOptions {
            residual_bits,
            step_check,
        }),
    };
    o.check().map_err(to_py)?;
    Ok(o)
}

/// One rank's engine: see `cfc::engine`. Made on every rank of a group together.
#[pyclass(module = "cfc._native", weakref)]
pub struct Engine {
    inner: Mutex<Option<Arc<CoreEngine>>>,
    world: usize,
    rank: usize,
    /// Where the engine's tensors live: the host, or its CUDA device.
    place: Place,
}

impl Engine {
    fn live(&self) -> PyResult<Arc<CoreEngine>> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| CfcError::new_err("this engine was closed"))
    }
}

#[pymethods]
impl Engine {
    /// Links this rank with the others and starts its engine; waits for the links, at most
    /// `timeout` seconds, and runs the agreement round with `agree_token`.
    ///
    /// Args:
    ///     listener: this rank's `Listener` (taken).
    ///     addresses: every rank's published addresses, by rank.
    ///     rank, world: this rank and the number of ranks.
    ///     secret: the engine's secret (16 to 64 random bytes, the same on every rank): its
    ///         links admit only peers that prove it.
    ///     engine: the engine's number, the same on every rank.
    ///     device: the CUDA device for a CUDA engine, or None for a CPU engine.
    ///     nccl_id: with a device, the NCCL unique id (hex) every rank joins; None to move the
    ///         device's bytes over the TCP links instead (ranks sharing one GPU).
    ///     bound_kind ("eps", "rel" or "rms"), bound (its value), error_feedback, algorithm,
    ///         fallback, trial_steps, warmup_steps, min_compress_numel, timeout: the options,
    ///         named as `cfc.ddp.options.Options` names them (see `cfc.CfcState`).
    ///     agree_token: what every rank must agree on besides the options.
    ///     nodes: each rank's node name (e.g. its host name); None: one node. With
    ///         `topology`, it chooses the flat or the two-level exchange.
    ///     coder: how frames decoded where they arrive (the all-gather's, reduce-scatter jobs')
    ///         write their codes ("planes" or "rice").
    ///     block: elements per block of block scales (with rms), 0 for none.
    ///     fsdp: for cfc.fsdp's calls, (the bits of their residuals, 32 or 4; whether
    ///         fallback="auto"'s trial is checked over whole steps): agreed between ranks.
    ///         None: not cfc.fsdp's.
    #[new]
    #[pyo3(signature = (listener, addresses, rank, world, secret, engine, *, device=None, nccl_id=None, bound_kind, bound, error_feedback, algorithm, fallback, trial_steps, warmup_steps, min_compress_numel, timeout, topology="auto", coder="planes", block=0, fsdp=None, nodes=None, agree_token=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        listener: &Listener,
        addresses: Vec<Vec<String>>,
        rank: usize,
        world: usize,
        secret: &[u8],
        engine: u64,
        device: Option<usize>,
        nccl_id: Option<String>,
        bound_kind: &str,
        bound: f64,
        error_feedback: bool,
        algorithm: Option<&str>,
        fallback: &str,
        trial_steps: u32,
        warmup_steps: u32,
        min_compress_numel: u64,
        timeout: f64,
        topology: &str,
        coder: &str,
        block: u64,
        fsdp: Option<(u8, bool)>,
        nodes: Option<Vec<String>>,
        agree_token: u64,
    ) -> PyResult<Self> {
        let o = options(
            bound_kind,
            bound,
            error_feedback,
            algorithm,
            fallback,
            trial_steps,
            warmup_steps,
            min_compress_numel,
            timeout,
            topology,
            coder,
            block,
            fsdp,
        )?;
        let nodes = nodes.map_or_else(Vec::new, |n| node_indices(&n));
        if !nodes.is_empty() && nodes.len() != world {
            return Err(PyValueError::new_err(format!(
                "{} node names for {world} ranks",
                nodes.len()
            )));
        }
        let cred = Credentials::new(secret, engine).map_err(to_py)?;
        let l = listener
            .inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| CfcError::new_err("this listener was given to an engine already"))?;
        let engine = py
            .detach(move || -> cfc::Result<CoreEngine> {
                let t = o.timeout;
                match (device, nccl_id) {
                    (None, _) => {
                        let links =
                            TcpLinks::connect(l, rank, world, &addresses, &cred, Shape::Mesh, t)?;
                        CoreEngine::on_cpu(links, o, agree_token, &nodes)
                    }
                    (Some(d), None) => {
                        let links =
                            TcpLinks::connect(l, rank, world, &addresses, &cred, Shape::Mesh, t)?;
                        CoreEngine::on_cuda_links(d, links, o, agree_token, &nodes)
                    }
                    (Some(d), Some(id)) => {
                        let links =
                            TcpLinks::connect(l, rank, world, &addresses, &cred, Shape::Star, t)?;
                        let id = cfc::nccl::UniqueId::from_hex(&id)?;
                        let comm = cfc::nccl::Communicator::with_timeout(d, &id, rank, world, t)?;
                        let control = cfc::engine::transport::Links::control(&links).clone();
                        CoreEngine::on_cuda_nccl(
                            d,
                            comm,
                            control,
                            Some(Box::new(links)),
                            o,
                            agree_token,
                            &nodes,
                        )
                    }
                }
            })
            .map_err(to_py)?;
        Ok(Engine {
            inner: Mutex::new(Some(Arc::new(engine))),
            world,
            rank,
            place: device.map_or(Place::Host, Place::Cuda),
        })
    }

    /// Where this rank runs the two-level exchange: (nodes, ranks per node, its node, its
    /// index there); None where the exchange is flat.
    #[getter]
    fn levels(&self) -> PyResult<Option<(usize, usize, usize, usize)>> {
        Ok(self
            .live()?
            .levels()
            .map(|l| (l.nodes(), l.per_node(), l.node_index, l.local)))
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    #[getter]
    fn world(&self) -> usize {
        self.world
    }

    /// Hands one bucket to the engine and returns at once (see `cfc::engine::Engine::submit`).
    ///
    /// Args:
    ///     key, fingerprint: the bucket's identity from step to step, and what it holds.
    ///     data: the values (a contiguous tensor on the engine's device), reduced in place (an
    ///         all-reduce) or read (a reduce-scatter, with `out`).
    ///     residual: float32 residuals of `data`'s size, or None.
    ///     out: this rank's shard of a reduce-scatter (`data`'s dtype), or None.
    ///     scale: what the sum is multiplied by; None: 1 / world (an average).
    ///     last: the bucket ends a step.
    ///     fresh: the residual holds values not sent yet.
    ///     stream: the `torch.cuda.Stream` that `data` (and the others) are written on; None
    ///         on the CPU.
    ///
    /// Each tensor is checked here (contiguous, of a dtype cfc knows, on the engine's device)
    /// and by the engine (sizes, alignment, overlap). The caller keeps every tensor alive and
    /// untouched until `wait` returns.
    #[pyo3(signature = (key, fingerprint, data, residual, out, scale, last, fresh, stream))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        key: u64,
        fingerprint: u64,
        data: &Bound<'_, PyAny>,
        residual: Option<&Bound<'_, PyAny>>,
        out: Option<&Bound<'_, PyAny>>,
        scale: Option<f32>,
        last: bool,
        fresh: bool,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let engine = self.live()?;
        let place = self.place;
        let data = core_tensor(tensor::at(data, place, "data")?);
        let residual = residual
            .map(|r| tensor::at(r, place, "the residual").map(core_tensor))
            .transpose()?;
        let out = out
            .map(|o| tensor::at(o, place, "out").map(core_tensor))
            .transpose()?;
        let stream = tensor::stream_at(stream, place)?;
        let job = Job {
            key,
            fingerprint,
            data,
            residual,
            op: match out {
                None => Op::AllReduce,
                Some(out) => Op::ReduceScatter { out },
            },
            scale: scale.map_or(Scale::Average, Scale::Times),
            last,
            fresh_residual: fresh,
        };
        // SAFETY: the Python package passes tensors of this engine's device that it keeps
        // alive and leaves untouched until `wait` returns (this method's contract, stated to its
        // one caller, `cfc._engine`).
        unsafe { engine.submit(job, stream) }.map_err(to_py)
    }

    /// Waits until every bucket submitted is done and the step closed, then orders `stream`
    /// (a `torch.cuda.Stream`; None on the CPU) after the results; raises the failure of any
    /// rank.
    #[pyo3(signature = (stream=None))]
    fn wait(&self, py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let engine = self.live()?;
        let stream = tensor::stream_at(stream, self.place)?;
        py.detach(|| engine.wait(stream)).map_err(to_py)
    }

    /// Waits until every job submitted so far is exchanged and its decoding queued, then orders
    /// `stream` after the results, without closing the step (see `cfc::engine::Engine::order`);
    /// raises the failure of any rank seen so far. The step's outcome comes with `end_step` or
    /// `wait`.
    #[pyo3(signature = (stream=None))]
    fn order(&self, py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let engine = self.live()?;
        let stream = tensor::stream_at(stream, self.place)?;
        py.detach(|| engine.order(stream)).map_err(to_py)
    }

    /// Closes the step without a job of its own (see `cfc::engine::Engine::end_step`), which
    /// ends on `stream` (a `torch.cuda.Stream`; None on the CPU); raises the failure of any
    /// rank.
    #[pyo3(signature = (stream=None))]
    fn end_step(&self, py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let engine = self.live()?;
        let stream = tensor::stream_at(stream, self.place)?;
        py.detach(|| engine.end_step(stream)).map_err(to_py)
    }

    /// Fails this rank with `reason` (an exception of the caller's): every rank's next wait
    /// raises it.
    fn fail(&self, py: Python<'_>, reason: &str) -> PyResult<()> {
        let engine = self.live()?;
        let reason = reason.to_string();
        // (telling the peers writes to their links: without the GIL)
        py.detach(|| engine.fail(&reason));
        Ok(())
    }

    /// Whether the engine is done with the memory of every job submitted before the latest
    /// wait (see `cfc::engine::Engine::settled`): False after a wait that ran out of time while
    /// the engine was still at work, whose tensors must then be kept alive.
    fn settled(&self) -> PyResult<bool> {
        Ok(self.live()?.settled())
    }

    /// Checks again, with every rank, the options and `token` (after a checkpoint was loaded).
    fn agree(&self, py: Python<'_>, token: u64) -> PyResult<()> {
        let engine = self.live()?;
        py.detach(|| engine.agree(token)).map_err(to_py)
    }

    /// Every rank's `mine` (a few bytes), in rank order, on every rank: a round of the
    /// engine's links that a failure anywhere ends (see `Engine::gather`).
    fn gather<'py>(&self, py: Python<'py>, mine: Vec<u8>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let engine = self.live()?;
        let all = py.detach(|| engine.gather(&mine)).map_err(to_py)?;
        Ok(all.iter().map(|b| PyBytes::new(py, b)).collect())
    }

    /// What the engine has done so far.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.live()?.stats();
        let d = PyDict::new(py);
        d.set_item("compressed_buckets", s.compressed)?;
        d.set_item("plain_buckets", s.plain)?;
        d.set_item("bytes_sent", s.bytes_sent)?;
        d.set_item("bytes_uncompressed", s.bytes_uncompressed)?;
        d.set_item("resends", s.resends)?;
        d.set_item("frame_bytes", s.frame_bytes)?;
        d.set_item("slack_bytes", s.slack_bytes)?;
        d.set_item("inside_node", s.inside_node)?;
        d.set_item("between_nodes", s.between_nodes)?;
        d.set_item("uncompressed_between_nodes", s.uncompressed_between_nodes)?;
        d.set_item("eps", s.eps)?;
        d.set_item("max_error", s.max_error)?;
        d.set_item("seconds", s.seconds)?;
        Ok(d)
    }

    /// Forgets every bucket (after those submitted): the warm-up and the trial start again.
    fn reset(&self) -> PyResult<()> {
        self.live()?.reset().map_err(to_py)
    }

    /// The ways of the next step (read after a step's end): (whether every bucket goes plain,
    /// the keys the trial chose plain). See `cfc::engine::Engine::ways`.
    fn ways(&self, py: Python<'_>) -> PyResult<(bool, Vec<u64>)> {
        let engine = self.live()?;
        py.detach(|| engine.ways()).map_err(to_py)
    }

    /// The engine's state for a checkpoint: {"step", "origin", "buckets": [ {key, fingerprint,
    /// numel, stats, decision, trial_plain, trial_compressed, exponents (bytes or None)} ],
    /// "levels", "step_check": {origin, times: [plain, the trial's ways], verdict} or None}.
    fn state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let engine = self.live()?;
        let s = py.detach(|| engine.state()).map_err(to_py)?;
        engine_state::write(py, &s)
    }

    /// Replaces the engine's state with `state` (as `state` wrote it; every field checked
    /// first: `ValueError` naming a bad one).
    fn load_state(&self, py: Python<'_>, state: &Bound<'_, PyAny>) -> PyResult<()> {
        let s = engine_state::read(state)?;
        let engine = self.live()?;
        py.detach(|| engine.load_state(s)).map_err(to_py)
    }

    /// Makes a fault happen at this rank's next compressed bucket, for tests of failure
    /// handling: "corrupt" (the frame it sends), "alloc" (its next allocation), "device" (a
    /// device error), "hang" (it never finishes, as a device or link that never answers).
    fn inject(&self, fault: &str) -> PyResult<()> {
        let f = match fault {
            "corrupt" => Fault::Corrupt,
            "alloc" => Fault::Alloc,
            "device" => Fault::Device,
            "hang" => Fault::Hang,
            other => return Err(PyValueError::new_err(format!("unknown fault {other:?}"))),
        };
        self.live()?.inject(f).map_err(to_py)
    }

    /// Finishes the buckets submitted, then stops the engine and closes its links (waiting at
    /// most as long as `wait`; a failure was raised by `wait` already, not again here). Closing
    /// again does nothing.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let engine = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        match engine {
            Some(e) => py.detach(|| e.close()).map_err(to_py),
            None => Ok(()),
        }
    }

    /// Stops the engine without waiting for it, as letting go of it does: its thread ends on
    /// its own, and `settle_dropped_engines` waits for that (for a process about to exit).
    /// Later calls raise, as after `close`.
    fn stop(&self) {
        drop(self.inner.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
}

/// Waits at most `seconds` for the threads of engines stopped or let go of without `close` to
/// end (for a process about to exit: one that exits while such a thread still finalizes NCCL
/// or frees device memory can crash); returns how many still run.
#[pyfunction]
fn settle_dropped_engines(py: Python<'_>, seconds: f64) -> PyResult<usize> {
    if !(seconds.is_finite() && seconds >= 0.0) {
        return Err(PyValueError::new_err(format!(
            "seconds must be a finite number >= 0, got {seconds}"
        )));
    }
    let limit = std::time::Duration::from_secs_f64(seconds.min(86_400.0));
    Ok(py.detach(|| cfc::engine::settle_dropped(limit)))
}

/// `CFC_TIMEOUT` in seconds, or None where it is not set (`cfc::env::timeout`, the one reader
/// of the variable): ValueError for a malformed value.
#[pyfunction]
fn env_timeout() -> PyResult<Option<f64>> {
    cfc::env::timeout()
        .map(|t| t.map(|d| d.as_secs_f64()))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// `CFC_NODE`, or None (`cfc::env::node`).
#[pyfunction]
fn env_node() -> Option<String> {
    cfc::env::node()
}

/// Adds the engine's classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Listener>()?;
    // (the one definition of these limits: cfc::engine::options, the codec's bound check and
    // block scales)
    m.add(
        "TIMEOUT_RANGE",
        (
            cfc::engine::options::MIN_TIMEOUT.as_secs_f64(),
            cfc::engine::options::MAX_TIMEOUT.as_secs_f64(),
        ),
    )?;
    m.add("EPS_RANGE", (cfc::MIN_EPS, cfc::MAX_EPS))?;
    m.add(
        "BLOCK_RANGE",
        (
            1u64 << cfc::scales::MIN_BLOCK_LOG2,
            1u64 << cfc::scales::MAX_BLOCK_LOG2,
        ),
    )?;
    m.add_class::<Engine>()?;
    m.add_function(wrap_pyfunction!(engine_state::parse_engine_state, m)?)?;
    m.add_function(wrap_pyfunction!(settle_dropped_engines, m)?)?;
    m.add_function(wrap_pyfunction!(env_timeout, m)?)?;
    m.add_function(wrap_pyfunction!(env_node, m)?)?;
    Ok(())
}
