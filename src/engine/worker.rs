//! The comm thread: one per engine, taking messages first in first out, so that every rank
//! issues the same collectives in the same order whatever the timing.
//!
//! Each job runs in stages. Its first stage (the *launch*) queues the compression and the
//! exchange and returns; the stages after it wait for what the exchange brought (frame sizes,
//! on the host), so each runs only after the next job's launch ([`DEPTH`]), or when the step
//! closes: the next bucket is on the wire while this thread waits. Which stage runs when depends
//! on the order of the jobs only.
//!
//! A step closes at a job marked `last` (or a flush): the stages left run, then a closing round
//! (every rank's decoding status, gathered) makes every rank succeed or fail together, and a
//! mark after the step's last work is published for the caller's stream to wait on
//! (`close.rs`).
//!
//! Scratch given back after a stage may be handed out again at once: a stage gives back its
//! buffers only after queuing its last use of them, on the compute lane after a join from the
//! comm lane, and every later use of scratch on the comm lane follows a join from the compute
//! lane issued after it was handed out (each exchange waits for its own compression; a resend,
//! which has no compression before it, joins first: `Worker::alloc_for_comm`). Without that
//! join, a resend's rows could land in a buffer whose decoding, on the compute lane, was still
//! reading it.
//!
//! On a failure (of this rank, or raised by a peer on the board), the thread aborts the
//! transport (so that queued collectives give up and the device drains), raises the failure on
//! the board (which tells the peers), and from then on refuses every job: the caller's wait
//! reports the failure, on every rank.

use super::backend::{Backend, Lane};
use super::control::Failure;
use super::job::{Job, Op, Region, Tensor};
use super::options::{Algorithm, BoundRule, Options};
use super::policy::{decide, EngineState, Phase, Policy};
use super::transport::Transport;
use super::{Fault, Msg, Shared};
use crate::error::{Error, Result};
use crate::format::DType;
use crossbeam_channel::{Receiver, RecvTimeoutError};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// Jobs launched after a job before its next stage runs.
pub(crate) const DEPTH: u64 = 1;

/// A job's stage after its launch (see the module docs); defined in `exchange.rs`.
pub(super) use super::exchange::Stage;

/// The comm thread's state.
pub(crate) struct Worker<B: Backend, T: Transport<B>> {
    pub(super) be: B,
    pub(super) tr: T,
    pub(super) o: Options,
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) algorithm: Algorithm,
    /// The algorithm along a rail (two levels).
    pub(super) rail_algorithm: Algorithm,
    /// Each rank's node (empty: one node).
    pub(super) node_of: Vec<usize>,
    /// This rank's place in the two-level exchange (`None`: flat), and its groups once open.
    pub(super) levels: Option<super::topology::Levels>,
    pub(super) groups: Option<super::levels::Groups<T>>,
    pub(super) policy: Policy,
    /// Jobs taken so far (the same number on every rank at the same job).
    pub(super) seq: u64,
    /// Points taken so far (see `Msg::is_point`; the failure board's clock).
    point: u64,
    launched: u64,
    deferred: VecDeque<(u64, Stage<B>)>,
    /// A compressed job ran since the last closing round.
    pub(super) decoded: bool,
    /// A job came since the last close.
    pub(super) open: bool,
    pub(super) shared: Arc<Shared>,
    rx: Receiver<Msg>,
    pub(super) failed: bool,
    pub(super) faults: Vec<Fault>,
    /// Every rank's decoding status, received in the closing round.
    pub(super) statuses: Option<B::Buf>,
    /// The tensors of the step's jobs, handed back to the caller at its close.
    pub(super) step_tensors: Vec<Tensor>,
    /// The step check's clock starts here.
    pub(super) epoch: Instant,
    /// Where the caller's stream stood at the step's end ([`Msg::EndStep`]), until its close.
    pub(super) step_end: Option<B::Ready>,
}

impl<B: Backend, T: Transport<B>> Worker<B, T> {
    pub(crate) fn new(
        be: B,
        tr: T,
        o: Options,
        shared: Arc<Shared>,
        rx: Receiver<Msg>,
        nodes: &[usize],
        levels: Option<super::topology::Levels>,
    ) -> Self {
        let (rank, world) = (tr.rank(), tr.world());
        Worker {
            algorithm: o.algorithm_for(world),
            rail_algorithm: o.algorithm_for(world),
            node_of: nodes.to_vec(),
            levels,
            groups: None,
            be,
            tr,
            o,
            rank,
            world,
            policy: Policy::new(),
            seq: 0,
            point: 0,
            launched: 0,
            deferred: VecDeque::new(),
            decoded: false,
            open: false,
            shared,
            rx,
            failed: false,
            faults: Vec::new(),
            statuses: None,
            step_tensors: Vec::new(),
            step_end: None,
            epoch: Instant::now(),
        }
    }

    /// What the thread raises if it panics (a bug): a failure of this rank.
    pub(crate) fn fallback_failure(&self) -> Failure {
        Failure {
            rank: self.rank,
            reason: "internal: the engine's thread panicked (a bug in cfc)".into(),
            at: 0,
        }
    }

    /// The failure board.
    pub(crate) fn control(&self) -> Arc<super::control::Control> {
        self.tr.control().clone()
    }

    /// What the thread shares with the handle.
    pub(crate) fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    /// The thread's loop, until a stop message (or the engine's handle is gone).
    pub(crate) fn run(mut self) {
        loop {
            if !self.failed && self.tr.control().due().is_some() {
                // A failure raised elsewhere while this thread was idle: give up now, so that
                // nothing of this rank's stays queued for peers that are gone.
                self.fail_with(None);
            }
            let msg = match self.rx.recv_timeout(super::transport::BOARD_POLL * 2) {
                Ok(m) => m,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => break,
            };
            if msg.is_point() {
                self.point += 1;
                self.tr.control().set_now(self.point);
                if !self.failed && self.tr.control().due().is_some() {
                    // This rank's caller failed before this point (`Engine::fail`), or a peer
                    // did: give up here, as every rank does at this same point.
                    self.fail_with(None);
                }
            }
            match msg {
                Msg::Job(job, ready) => {
                    let last = job.last;
                    self.open = true;
                    if !self.failed {
                        let r = match ready.downcast::<B::Ready>() {
                            Ok(ready) => self.job(job, *ready),
                            Err(_) => Err(Error::Transport(
                                "internal: a job of another backend".into(),
                            )),
                        };
                        if let Err(e) = r {
                            self.fail_with(Some(e));
                        }
                    }
                    if last {
                        self.close(true);
                    }
                }
                Msg::Order(at) => {
                    if self.failed {
                        // (its failure is on the board: the order's wait reads it)
                        self.shared.note_failure(self.tr.control().failure());
                    } else if let Err(e) = self.order(at) {
                        self.fail_with(Some(e));
                    }
                }
                Msg::Flush => self.close(false),
                Msg::EndStep(mark) => {
                    match mark.downcast::<B::Ready>() {
                        Ok(m) => self.step_end = Some(*m),
                        Err(_) if !self.failed => self.fail_with(Some(Error::Transport(
                            "internal: a step's end of another backend".into(),
                        ))),
                        Err(_) => {}
                    }
                    self.close(true);
                    self.step_end = None;
                }
                Msg::Agree(token) => {
                    if !self.failed {
                        if let Err(e) = self.agree(token) {
                            self.fail_with(Some(e));
                        }
                    }
                    self.shared.publish(!self.failed, None);
                }
                Msg::Gather(mine, reply) => {
                    if !self.failed {
                        match self.tr.gather(&mut self.be, &mine) {
                            Ok(all) => {
                                let _ = reply.send(all);
                            }
                            Err(e) => self.fail_with(Some(e)),
                        }
                    }
                    self.shared.publish(!self.failed, None);
                }
                Msg::Reset => {
                    self.close(false);
                    self.policy.reset();
                }
                Msg::State(reply) => {
                    let mut state = self.policy.state(&self.o);
                    state.levels = self.layout();
                    let _ = reply.send(state);
                }
                Msg::Ways(reply) => {
                    let _ = reply.send(self.policy.ways(&self.o));
                }
                Msg::Load(state, reply) => {
                    self.load(state);
                    let _ = reply.send(());
                }
                Msg::Inject(f) => self.faults.push(f),
                Msg::Stop => {
                    self.close(false);
                    break;
                }
            }
        }
    }

    fn load(&mut self, mut state: EngineState) {
        // Along rails the statistics are each rail's own: a resumed run may put other ranks on
        // a rail (another node map of the same shape), whose steps must agree again.
        if state.levels != self.layout() || self.levels.is_some() {
            for b in &mut state.buckets {
                b.stats = None;
                b.exponents = None;
            }
        }
        self.policy.load(state);
    }

    /// The two-level exchange's shape (nodes, ranks per node); `None`: flat.
    fn layout(&self) -> Option<(u64, u64)> {
        self.levels
            .as_ref()
            .map(|l| (l.nodes() as u64, l.per_node() as u64))
    }

    /// The agreement round: every rank's options, world and token, compared on every rank.
    /// At the first, the two-level groups open once every rank is known to see the same nodes.
    fn agree(&mut self, token: u64) -> Result<()> {
        let nodes = super::topology::nodes_word(&self.node_of);
        let mine =
            super::options::descriptor(&self.o, self.world, token, nodes, self.levels.is_some());
        let all = self.tr.gather(&mut self.be, &mine)?;
        if let Some((j, theirs)) = all.iter().enumerate().find(|(_, d)| **d != all[0]) {
            return Err(Error::RankMismatch {
                what: format!("rank 0 has {}", super::options::describe(&all[0])),
                theirs: format!("rank {j} has {}", super::options::describe(theirs)),
            });
        }
        self.open_groups()
    }

    /// One job: its launch, then the stages of earlier jobs now due.
    fn job(&mut self, job: Job, ready: B::Ready) -> Result<()> {
        self.seq += 1;
        let t0 = Instant::now();
        self.be.begin(ready)?;
        let mut mine = vec![job.data];
        mine.extend(job.residual);
        if let Op::ReduceScatter { out } = job.op {
            mine.push(out);
        }
        self.be.caller_touches(&mine)?;
        self.step_tensors.extend(mine);
        let n = job.data.numel;
        let kind = matches!(job.op, Op::ReduceScatter { .. }) as u8;
        let identity = (job.fingerprint, n, job.data.dtype, kind);
        let o = self.o.clone();
        let (_, world) = self.xgroup(self.on_rail(&job));
        let phase = self.policy.phase(&o);
        // Every rank is in the same phase at the same job (the steps count alike), so that
        // this round is taken everywhere or nowhere.
        if phase == Phase::Warmup || self.policy.step == self.policy.origin {
            self.agree_on_job(job.key, identity)?;
        }
        self.policy.bucket(job.key, identity, &o, world);
        if job.fresh_residual && job.residual.is_some() {
            let b = self.bucket(job.key)?;
            b.dirty = true;
            b.spread = true;
        }
        if n == 0 {
            return Ok(()); // every rank has nothing to send: nothing moves
        }
        let mut compress = self.policy.compress(&o, n);
        if compress.is_none() && self.policy.undecided() {
            self.decide()?;
        }
        let compress = compress.get_or_insert_with(|| {
            self.policy
                .buckets
                .get(&job.key)
                .and_then(|b| b.decision)
                .unwrap_or(true)
        });
        let timed = phase == Phase::Trial && n >= o.min_compress_numel;
        if timed {
            // The trial times each bucket's exchange alone: everything before it finishes,
            // untimed, and the ranks line up first (their backward passes reach a bucket at
            // different times, which would count against whichever way this step tries).
            if !*compress {
                self.fold_if_dirty(&job)?;
            }
            self.drain()?;
            let m = self.be.mark(Lane::Compute)?;
            self.tr.wait(&mut self.be, &m)?;
            self.tr.gather(&mut self.be, &[])?;
            let started = Instant::now();
            if let Some(stage) = self.launch(&job, *compress)? {
                self.deferred.push_back((self.launched, stage));
            }
            self.drain()?;
            self.be.join(Lane::Compute, Lane::Comm)?;
            let m = self.be.mark(Lane::Compute)?;
            self.tr.wait(&mut self.be, &m)?;
            let seconds = started.elapsed().as_secs_f64();
            let b = self.bucket(job.key)?;
            if *compress {
                b.trial_compressed.push(seconds);
            } else {
                b.trial_plain.push(seconds);
            }
        } else {
            let stage = self.launch(&job, *compress)?;
            self.launched += 1;
            self.run_due()?;
            if let Some(s) = stage {
                self.deferred.push_back((self.launched, s));
            }
        }
        self.shared.add_seconds(t0.elapsed().as_secs_f64());
        Ok(())
    }

    /// In the warm-up (and in the first step where there is none), every job: every rank must
    /// be at the same bucket (its key, what it holds, its size, dtype and kind), or the
    /// collectives that follow would not match. A compressed exchange checks every frame's
    /// check word, but a plain one has no header: ranks that disagree would reduce unrelated
    /// tensors or, with different sizes, stall. Checked where a run begins (different models
    /// or data on the ranks), not on every step, which would cost a round per plain job.
    fn agree_on_job(&mut self, key: u64, identity: (u64, u64, DType, u8)) -> Result<()> {
        let (fingerprint, n, dtype, kind) = identity;
        let word = dtype.code() as u64 | (kind as u64) << 8;
        let mine: Vec<u8> = [key, fingerprint, n, word]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let all = self.tr.gather(&mut self.be, &mine)?;
        let describe = |d: &[u8]| {
            let at = |i: usize| {
                d.get(8 * i..8 * i + 8)
                    .and_then(|b| b.try_into().ok())
                    .map_or(0, u64::from_le_bytes)
            };
            let what = match at(3) >> 8 {
                0 => "all-reduce",
                1 => "reduce-scatter",
                _ => "",
            };
            match DType::from_code(at(3) as u8) {
                Some(dtype) if d.len() == 32 && !what.is_empty() => format!(
                    "bucket {} ({what} of {} {} elements, fingerprint {:#x})",
                    at(0),
                    at(2),
                    dtype.name(),
                    at(1)
                ),
                // (its message was of another round: that rank is at another job)
                _ => "not a job's description (that rank is at another point of its work)"
                    .to_string(),
            }
        };
        match all.iter().enumerate().find(|(_, d)| **d != all[0]) {
            Some((j, theirs)) => Err(Error::RankMismatch {
                what: format!("rank 0's job {} is {}", self.seq, describe(&all[0])),
                theirs: format!("rank {j}'s is {}", describe(theirs)),
            }),
            None => Ok(()),
        }
    }

    pub(super) fn bucket(&mut self, key: u64) -> Result<&mut super::policy::Bucket> {
        self.policy
            .buckets
            .get_mut(&key)
            .ok_or_else(|| Error::Transport(format!("internal: no bucket {key}")))
    }

    /// The trial's choice for every timed bucket, from every rank's times.
    fn decide(&mut self) -> Result<()> {
        let mine = self.policy.trial_times();
        let mut bytes = Vec::with_capacity(24 * mine.len());
        for (k, p, c) in &mine {
            bytes.extend_from_slice(&k.to_le_bytes());
            bytes.extend_from_slice(&p.to_le_bytes());
            bytes.extend_from_slice(&c.to_le_bytes());
        }
        let all = self.tr.gather(&mut self.be, &bytes)?;
        let mut tables = Vec::with_capacity(all.len());
        for (j, b) in all.iter().enumerate() {
            let t: Vec<(u64, f64, f64)> = b
                .chunks_exact(24)
                .map(|c| {
                    let w = |i: usize| u64::from_le_bytes(c[i..i + 8].try_into().unwrap_or([0; 8]));
                    (w(0), f64::from_bits(w(8)), f64::from_bits(w(16)))
                })
                .collect();
            let keys: Vec<u64> = t.iter().map(|e| e.0).collect();
            let own: Vec<u64> = mine.iter().map(|e| e.0).collect();
            if b.len() % 24 != 0 || keys != own {
                return Err(Error::RankMismatch {
                    what: format!("this rank timed buckets {own:?}"),
                    theirs: format!("rank {j} timed buckets {keys:?}"),
                });
            }
            tables.push(t);
        }
        for (key, compress) in decide(&tables) {
            if let Some(b) = self.policy.buckets.get_mut(&key) {
                b.decision = Some(compress);
            }
        }
        tracing::info!(rank = self.rank, decisions = ?self.policy.buckets.iter().map(|(k, b)| (*k, b.decision)).collect::<Vec<_>>(), "cfc trial decided");
        Ok(())
    }

    /// Runs the deferred stages that are due (see the module docs).
    fn run_due(&mut self) -> Result<()> {
        while let Some((due, _)) = self.deferred.front() {
            if due + DEPTH > self.launched {
                break;
            }
            let Some((_, stage)) = self.deferred.pop_front() else {
                break;
            };
            if let Some(next) = self.stage(stage)? {
                self.deferred.push_front((self.launched, next));
            }
        }
        Ok(())
    }

    /// Runs every deferred stage, in order.
    pub(super) fn drain(&mut self) -> Result<()> {
        while let Some((_, stage)) = self.deferred.pop_front() {
            if let Some(next) = self.stage(stage)? {
                self.deferred.push_front((0, next));
            }
        }
        Ok(())
    }

    /// Fails this rank: raises `e` on the board (telling the peers) unless a failure is there
    /// already, aborts the transport and lets the device drain; every later job is refused.
    pub(super) fn fail_with(&mut self, e: Option<Error>) {
        if let Some(e) = e {
            // A peer's failure seen in a wait is on the board already; anything else began here.
            let failure = match e {
                Error::PeerFailed { rank, reason } => Failure {
                    rank,
                    reason,
                    at: self.point,
                },
                other => Failure {
                    rank: self.rank,
                    reason: other.to_string(),
                    at: self.point,
                },
            };
            let own = failure.rank == self.rank;
            self.tr.control().raise(failure, own);
        }
        if self.failed {
            return;
        }
        self.failed = true;
        // The stages left hold scratch that queued work may still use: abort first, so that
        // collectives waiting on a peer give up, then let the device drain, then let go.
        let stages = std::mem::take(&mut self.deferred);
        self.tr.abort();
        if let Some(g) = &mut self.groups {
            // (their collectives wait on peers too: a node's reduce-scatter, a rail's exchange)
            g.node.abort();
            g.rail.abort();
        }
        // Let the device finish what it has (the aborted collectives return): the caller may
        // free the job's memory once it hears of the failure.
        let t0 = Instant::now();
        let drained = match self
            .be
            .join(Lane::Compute, Lane::Comm)
            .and_then(|()| self.be.mark(Lane::Compute))
        {
            Ok(m) => loop {
                match self.be.reached(&m) {
                    Ok(true) => break true,
                    Err(_) => break false,
                    Ok(false) if t0.elapsed() >= self.o.timeout => break false,
                    Ok(false) => std::thread::sleep(std::time::Duration::from_millis(1)),
                }
            },
            Err(_) => false,
        };
        if drained {
            drop(stages);
        } else {
            // The device may never finish: leak its memory rather than wait to free it.
            tracing::error!(
                rank = self.rank,
                "the device did not drain after the failure; the engine's scratch is leaked"
            );
            self.be.abandon();
            std::mem::forget(stages);
            self.shared.note_stranded();
        }
        self.shared.note_failure(self.tr.control().failure());
    }

    /// Folds a bucket's residual into its data where it may hold what was not sent yet (an
    /// uncompressed exchange then sends it along).
    pub(super) fn fold_if_dirty(&mut self, job: &Job) -> Result<()> {
        if let Some(r) = job.residual {
            let b = self.bucket(job.key)?;
            if b.dirty {
                b.dirty = false;
                self.be.fold(job.data, r)?;
            }
        }
        Ok(())
    }

    /// The uncompressed way: the transport's own collective (after the residual, if it holds
    /// anything unsent).
    pub(super) fn plain(&mut self, job: &Job) -> Result<()> {
        self.fold_if_dirty(job)?;
        self.be.join(Lane::Comm, Lane::Compute)?;
        let scale = job.scale.factor(self.world);
        match job.op {
            Op::AllReduce => self.tr.all_reduce(&mut self.be, job.data, scale)?,
            Op::ReduceScatter { out } => {
                self.tr.reduce_scatter(&mut self.be, job.data, out, scale)?
            }
        }
        let sent = self.ring_bytes(job.data.bytes(), &job.op);
        self.be.join(Lane::Compute, Lane::Comm)?;
        let ring = self.ring(sent);
        self.shared.account(false, ring, sent, ring.between, 0.0);
        Ok(())
    }

    /// The bound of this step for a bucket: fixed, or from its statistics at its last exchange
    /// (measured now, in a round of its own, at its first). Along a rail, a fixed bound is
    /// multiplied by the ranks per node (the shard holds the node's sum: see `levels.rs`); a
    /// bound from statistics follows the node's sums by itself.
    pub(super) fn eps(&mut self, job: &Job, check: u64, rail: bool) -> Result<f64> {
        let bound = self.o.bound;
        if let BoundRule::Abs(e) = bound {
            let g = match (&self.levels, rail) {
                (Some(l), true) => l.per_node() as f64,
                _ => 1.0,
            };
            return Ok(e * g);
        }
        let n = job.data.numel;
        let stats = match self.bucket(job.key)?.stats {
            Some(s) => s,
            None => {
                let s = self.measure(job, check, rail)?;
                self.bucket(job.key)?.stats = Some(s);
                s
            }
        };
        // (every rank's statistics are of its whole bucket, or shard: `n` elements each)
        Ok(bound.eps(stats.0, stats.1, n, self.xgroup(rail).1))
    }

    /// Every rank's statistics of a bucket now (a round of 24 bytes per rank of the group).
    fn measure(&mut self, job: &Job, check: u64, rail: bool) -> Result<(f64, f64)> {
        let rows = self.round(24, 16, check, rail, "measured", |w, m| {
            w.be.stats(job.data, job.residual, m.sub(0, 16)?, 16, 1)
        })?;
        let (mut sum, mut max) = (0.0f64, 0.0f64);
        for r in &rows {
            let word = |i: usize| u64::from_le_bytes(r[i..i + 8].try_into().unwrap_or([0; 8]));
            sum += f64::from_bits(word(0));
            max = max.max(f64::from_bits(word(8)));
        }
        Ok((sum, max))
    }

    /// A round of its own among the ranks of a job's exchange: each rank's `row` bytes (queued
    /// into its row by `fill`, on the compute lane) with the job's check word at `check_at`,
    /// all-gathered and waited for on the host. Returns every rank's row, in rank order, once
    /// every check word is this rank's (`did` says what a rank that differs did, for the error).
    pub(super) fn round(
        &mut self,
        row: u64,
        check_at: u64,
        check: u64,
        rail: bool,
        did: &str,
        fill: impl FnOnce(&mut Self, Region) -> Result<()>,
    ) -> Result<Vec<Vec<u8>>> {
        let w = self.xgroup(rail).1 as u64;
        let mine = self.alloc(row)?;
        let all = self.alloc(row * w)?;
        let (m, a) = (region(&mine).sub(0, row)?, region(&all).sub(0, row * w)?);
        fill(self, m)?;
        self.be
            .put(Lane::Compute, m.sub(check_at, 8)?, 8, 1, check)?;
        self.be.join(Lane::Comm, Lane::Compute)?;
        let (tr, be) = self.xt(rail);
        tr.all_gather(be, m, a)?;
        let f = self.be.fetch(Lane::Comm, a, row, row, w)?;
        let mark = self.be.mark(Lane::Comm)?;
        let (tr, be) = self.xt(rail);
        tr.wait(be, &mark)?;
        let bytes = self.be.fetched(f);
        self.be.free(mine);
        self.be.free(all);
        let at = check_at as usize;
        let mut rows = Vec::with_capacity(w as usize);
        for (j, r) in bytes.chunks_exact(row as usize).enumerate() {
            let word = u64::from_le_bytes(r[at..at + 8].try_into().unwrap_or([0; 8]));
            if word != check {
                return Err(Error::RankMismatch {
                    what: format!("this rank's job has check word {check:#018x}"),
                    theirs: format!("rank {j} {did} a job with check word {word:#018x}"),
                });
            }
            rows.push(r.to_vec());
        }
        Ok(rows)
    }

    /// Scratch that the comm lane writes next, where no join from the compute lane comes
    /// between (a resend): the buffer may have been given back by a stage whose decoding, on the
    /// compute lane, still reads it, so the comm lane first waits for the compute lane.
    pub(super) fn alloc_for_comm(&mut self, len: u64) -> Result<B::Buf> {
        let buf = self.alloc(len)?;
        self.be.join(Lane::Comm, Lane::Compute)?;
        Ok(buf)
    }

    /// Scratch from the backend (or the injected allocation failure).
    pub(super) fn alloc(&mut self, len: u64) -> Result<B::Buf> {
        if let Some(at) = self.faults.iter().position(|f| *f == Fault::Alloc) {
            self.faults.remove(at);
            return Err(Error::Allocation { bytes: len });
        }
        self.be.alloc(len)
    }
}

/// A buffer's whole region.
pub(super) fn region<M: crate::engine::backend::Memory>(m: &M) -> Region {
    m.region()
}
