//! The two-level exchange's parts of the comm thread (see `topology.rs` for the plan): the
//! node and rail groups, the plain reduce-scatter inside the node before a compressed job and
//! the all-gather after it, and which group each exchange runs in.
//!
//! A compressed all-reduce over two levels is the compressed exchange (`exchange.rs`) of one
//! job, this rank's shard of its node's sum, among the ranks of its rail; the plain parts run
//! inside the node around it. Reduce-scatter jobs (FSDP's), float16 buckets (whose node sums
//! could overflow) and plain jobs run among every rank. A bfloat16 node sum is rounded to
//! bfloat16 before it is compressed (error feedback does not see that rounding).
//!
//! Error feedback: the rank compresses its shard of the node's *sum* (the step is the bound
//! times the ranks per node for a fixed bound, so that the average is within the bound as in
//! the flat exchange), and the shard's part of its residual keeps what was not sent, in units
//! of that sum. A residual that may hold values elsewhere (loaded from a checkpoint of another
//! topology, or carried over) is first folded into the data, so that the node's sum sends it.

use super::backend::{Backend, Lane, Memory};
use super::job::{Job, Op, Scale, Tensor};
use super::transport::Transport;
use super::worker::Worker;
use super::Sent;
use crate::error::{Error, Result};

/// The node part of a two-level job, kept until the rail's exchange has decoded the shard.
pub(crate) struct Outer<B: Backend> {
    /// The bucket's job.
    job: Job,
    /// This rank's shard of the node's sum: the rail job's data.
    shard: B::Buf,
    /// Elements per shard (the node's ranks' shards make the bucket's first `per * ranks per
    /// node` elements; the rest, fewer than the ranks per node, went plain among every rank).
    per: u64,
}

/// The groups of a two-level exchange, opened at the engine's first agreement round.
pub(crate) struct Groups<T> {
    pub node: T,
    pub rail: T,
}

impl<B: Backend, T: Transport<B>> Worker<B, T> {
    /// Opens the node and rail groups (every rank at the same point: after the agreement
    /// round, which checked that every rank sees the same nodes).
    pub(super) fn open_groups(&mut self) -> Result<()> {
        let Some(l) = self.levels.clone() else {
            return Ok(());
        };
        if self.groups.is_some() {
            return Ok(());
        }
        let node = self.tr.group(&mut self.be, &l.node, l.node_index)?;
        let rail = self.tr.group(&mut self.be, &l.rail, l.local)?;
        self.rail_algorithm = self.o.algorithm_for(l.nodes());
        self.groups = Some(Groups { node, rail });
        Ok(())
    }

    /// Whether a job's compressed exchange runs along the rail: an all-reduce, two levels, not
    /// float16 (a node's sum of float16 gradients overflows from 65504 / G; bfloat16's range is
    /// float32's).
    pub(super) fn on_rail(&self, job: &Job) -> bool {
        self.groups.is_some()
            && matches!(job.op, Op::AllReduce)
            && job.data.dtype != crate::format::DType::F16
    }

    /// The transport of the group a compressed exchange runs in, with the backend.
    pub(super) fn xt(&mut self, rail: bool) -> (&mut T, &mut B) {
        match (&mut self.groups, rail) {
            (Some(g), true) => (&mut g.rail, &mut self.be),
            _ => (&mut self.tr, &mut self.be),
        }
    }

    /// This rank and the number of ranks of that group.
    pub(super) fn xgroup(&self, rail: bool) -> (usize, usize) {
        match (&self.groups, rail) {
            (Some(g), true) => (g.rail.rank(), g.rail.world()),
            _ => (self.rank, self.world),
        }
    }

    /// Counts `bytes` sent to rank `j` of that group: between nodes or inside this one.
    pub(super) fn count(&self, sent: &mut Sent, rail: bool, j: usize, bytes: u64) {
        let other = rail || self.node_of.get(j) != self.node_of.get(self.rank);
        if other {
            sent.between += bytes;
        } else {
            sent.inside += bytes;
        }
    }

    /// Counts `bytes` sent to every other rank of that group.
    pub(super) fn count_all(&self, sent: &mut Sent, rail: bool, bytes: u64) {
        let (me, w) = self.xgroup(rail);
        for j in (0..w).filter(|&j| j != me) {
            self.count(sent, rail, j, bytes);
        }
    }

    /// A plain ring collective of `bytes` among every rank: its bytes out of this rank's node
    /// are this rank's `1 / ranks per node` share of `bytes` where there are several nodes.
    pub(super) fn ring(&self, bytes: u64) -> Sent {
        let here = self.node_of.get(self.rank);
        let per_node = self.node_of.iter().filter(|n| Some(*n) == here).count() as u64;
        if self.node_of.iter().all(|n| Some(n) == here) {
            return Sent {
                inside: bytes,
                ..Sent::default()
            };
        }
        let between = bytes / per_node.max(1);
        Sent {
            inside: bytes - between,
            between,
            ..Sent::default()
        }
    }

    /// The first part of a two-level job: this rank's shard of its node's sum (the bucket's
    /// tail, fewer elements than the ranks per node, is reduced plain among every rank).
    /// Returns the rail's job and what the last part needs; `None` where the bucket has fewer
    /// elements than the node has ranks (it then went plain, whole).
    pub(super) fn node_reduce(
        &mut self,
        job: &Job,
        sent: &mut Sent,
    ) -> Result<Option<(Job, Outer<B>)>> {
        let (g, l) = match &self.groups {
            Some(gr) => (gr.node.world() as u64, gr.node.rank() as u64),
            None => return Err(Error::Transport("internal: no node group".into())),
        };
        let x = job.data;
        let per = x.numel / g;
        if per == 0 {
            self.plain(job)?;
            return Ok(None);
        }
        if let Some(r) = job.residual {
            let b = self.bucket(job.key)?;
            if b.spread {
                b.spread = false;
                self.be.fold(x, r)?;
            }
        }
        let size = x.dtype.size() as u64;
        let shard = self.alloc(per * size)?;
        let s = Tensor {
            addr: shard.region().addr,
            numel: per,
            dtype: x.dtype,
        };
        self.be.join(Lane::Comm, Lane::Compute)?;
        if let Some(gr) = &mut self.groups {
            gr.node
                .reduce_scatter(&mut self.be, x.slice(0, per * g), s, 1.0)?;
        }
        sent.inside += (g - 1) * per * size;
        let tail = x.numel - per * g;
        if tail > 0 {
            let scale = job.scale.factor(self.world);
            self.tr
                .all_reduce(&mut self.be, x.slice(per * g, tail), scale)?;
            let r = self.ring(self.ring_bytes(tail * size, &Op::AllReduce));
            sent.inside += r.inside;
            sent.between += r.between;
        }
        self.be.join(Lane::Compute, Lane::Comm)?;
        let rail_job = Job {
            data: s,
            residual: job.residual.map(|r| r.slice(l * per, per)),
            scale: Scale::Times(job.scale.factor(self.world)),
            ..*job
        };
        Ok(Some((
            rail_job,
            Outer {
                job: *job,
                shard,
                per,
            },
        )))
    }

    /// The last part of a two-level job, once the rail's exchange has decoded the shard (on the
    /// compute lane): the all-gather of the node's shards into the bucket.
    pub(super) fn node_gather(&mut self, o: Outer<B>, sent: &mut Sent) -> Result<()> {
        let Some(gr) = &mut self.groups else {
            return Err(Error::Transport("internal: no node group".into()));
        };
        let g = gr.node.world() as u64;
        let x = o.job.data;
        let bytes = o.per * x.dtype.size() as u64;
        self.be.join(Lane::Comm, Lane::Compute)?;
        let send = o.shard.region().sub(0, bytes)?;
        let recv = x.slice(0, o.per * g).region();
        gr.node.all_gather(&mut self.be, send, recv)?;
        sent.inside += (g - 1) * bytes;
        self.be.join(Lane::Compute, Lane::Comm)?;
        self.be.free(o.shard);
        Ok(())
    }

    /// The bytes this rank sends in a plain ring collective of `bytes` among every rank: an
    /// all-reduce's `2 (W - 1) / W` of them, a reduce-scatter's half of that.
    pub(super) fn ring_bytes(&self, bytes: u64, op: &Op) -> u64 {
        let w = self.world as u64;
        let scatter = (w - 1) * bytes.div_ceil(w);
        match op {
            Op::AllReduce => 2 * scatter,
            Op::ReduceScatter { .. } => scatter,
        }
    }
}

impl<B: Backend> Outer<B> {
    /// The bucket's job (what the accounting compares the bytes with).
    pub(super) fn job(&self) -> Job {
        self.job
    }
}
