//! The two ways a compressed bucket moves, written once over the backend and the transport
//! (see `rows.rs` for rows, slots and heads).
//!
//! **All-gather of frames** ([`Algorithm::AllGather`]): every rank compresses its bucket into a
//! row, the rows are all-gathered, and every rank decodes every frame, adds them in rank order
//! and writes the scaled sum over its bucket: the same bits on every rank.
//!
//! **Reduce-scatter of codes** ([`Algorithm::ReduceScatter`], and every reduce-scatter job):
//! every rank compresses each shard of its bucket into a row of its own, with one step shared
//! by all ranks, and sends row `j` to rank `j`. Rank `j` adds the codes of every rank's frame of
//! its shard as integers (an exact sum, packed as one frame: no second quantization) and, for an
//! all-reduce, the sums are all-gathered and every rank decodes each into its shard. A rank sends
//! about `2 (N - 1) / N` times a compressed bucket instead of `N - 1` times. In the exchange of
//! shards each pair of ranks has its own slot: the sender knows its frame's size from its own
//! head and the receiver from the head it received, so a frame that outgrew its slot sends its
//! tail between those two alone (`tails.rs`).
//!
//! Frames decoded where they arrive write their codes by the engine's `coder` (Rice codes take
//! fewer bytes): the all-gather's, and a reduce-scatter job's (FSDP's), which each rank decodes
//! and adds in f32 as the all-gather does. An all-reduce's shards, whose codes are summed on the
//! way, are bit planes.
//!
//! Each rank's rounding error is at most `eps` per element and its residual keeps it, so the
//! average is within `eps` of the exact average, up to the rounding of decoding (in f32, then
//! the bucket's dtype; a bfloat16 or float16 sum of codes is rounded to its dtype before it is
//! scaled).

use super::backend::{Backend, FrameKind, Lane, Memory};
use super::job::{Job, Op, Region};
use super::levels::Outer;
use super::options::Algorithm;
use super::rows::{self, round16, Head, CHECK_AT, HEAD, SIZE_AT, STATS_AT};
use super::tails::{Frames, Pairs};
use super::transport::Transport;
use super::worker::Worker;
use super::{Fault, Sent};
use crate::error::{Error, Result};
use crate::Coder;

/// A job's stage after its launch.
pub(crate) enum Stage<B: Backend> {
    /// All-gather: the heads are on their way; next, resend if needed and decode.
    Gathered(Gather<B>),
    /// Reduce-scatter: the shards' heads are on their way; next, resend pairs and sum.
    Scattered(Scatter<B>),
    /// Reduce-scatter of an all-reduce: the sums' heads are on their way; next, decode.
    Summed(Summed<B>),
}

/// What a job's stages share.
struct Common<B: Backend> {
    job: Job,
    check: u64,
    eps: f64,
    /// Bytes this rank sent so far.
    sent: Sent,
    /// The exchange runs along this rank's rail (two levels; else among every rank).
    rail: bool,
    /// The node part of a two-level job (its last part runs after the decoding).
    outer: Option<Outer<B>>,
}

pub(crate) struct Gather<B: Backend> {
    c: Common<B>,
    /// Bytes before each row's frame: its head, then (with block scales) its sender's
    /// exponents of the bucket, `exps` bytes, padded to 16.
    lead: u64,
    exps: u64,
    cap: u64,
    slot: u64,
    mine: B::Buf,
    recv: B::Buf,
    heads: B::Fetched,
    mark: B::Mark,
}

pub(crate) struct Scatter<B: Backend> {
    c: Common<B>,
    /// Element ranges of the shards (start, length).
    parts: Vec<(u64, u64)>,
    /// Bytes before each row's frame (its head, then with block scales its sender's exponents,
    /// padded to 16: `exps` bytes). An all-reduce's row carries those of the row's shard (the
    /// most any shard has), a reduce-scatter job's those of every shard (see `launch_scatter`).
    lead: u64,
    exps: u64,
    /// Frame capacity of each shard, and the stride of this rank's rows (the first shard's row).
    caps: Vec<u64>,
    stride: u64,
    mine: B::Buf,
    /// Rows received, `rstride` apart.
    recv: B::Buf,
    rstride: u64,
    own_heads: B::Fetched,
    in_heads: B::Fetched,
    mark: B::Mark,
}

pub(crate) struct Summed<B: Backend> {
    c: Common<B>,
    parts: Vec<(u64, u64)>,
    /// Bytes before each sum in its row (its head, then with block scales the largest
    /// exponents of its shard: `exps` bytes, the most any shard has).
    lead: u64,
    exps: u64,
    sum_caps: Vec<u64>,
    sums: B::Buf,
    slot: u64,
    recv: B::Buf,
    heads: B::Fetched,
    mark: B::Mark,
}

impl<B: Backend, T: Transport<B>> Worker<B, T> {
    /// The first stage of a job: the uncompressed collective (done), or the compression and
    /// the first exchange (returns the next stage).
    pub(super) fn launch(&mut self, job: &Job, compress: bool) -> Result<Option<Stage<B>>> {
        let rail = compress && self.on_rail(job);
        if !compress {
            self.plain(job)?;
            return Ok(None);
        }
        if let Some(at) = self.faults.iter().position(|f| *f == Fault::Device) {
            self.faults.remove(at);
            return Err(Error::Cuda(format!(
                "an injected device failure on {}",
                self.be.label()
            )));
        }
        if let Some(at) = self.faults.iter().position(|f| *f == Fault::Hang) {
            self.faults.remove(at);
            loop {
                self.tr.control().check()?;
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
        let mut sent = Sent::default();
        let (job, outer) = if rail {
            match self.node_reduce(job, &mut sent)? {
                Some((j, o)) => (j, Some(o)),
                None => return Ok(None),
            }
        } else {
            (*job, None)
        };
        let job = &job;
        let kind = matches!(job.op, Op::ReduceScatter { .. }) as u64;
        let check = rows::check_word(&[
            self.seq,
            job.key,
            job.fingerprint,
            job.data.numel,
            job.data.dtype as u64,
            kind,
        ]);
        // (with block scales, each part's bound comes from the scales agreed at its launch)
        let eps = if self.o.block == 0 {
            self.eps(job, check, rail)?
        } else {
            0.0
        };
        self.decoded = true;
        if job.residual.is_some() {
            self.bucket(job.key)?.dirty = true;
        }
        let c = Common {
            job: *job,
            check,
            eps,
            sent,
            rail,
            outer,
        };
        // An all-reduce too small for every rank's shard to hold elements goes as an all-gather
        // (a rule of the bucket's size, the same on every rank).
        let (_, w) = self.xgroup(rail);
        let shards_hold_elements = rows::shards(job.data.numel, w).iter().all(|s| s.1 > 0);
        let algorithm = if rail {
            self.rail_algorithm
        } else {
            self.algorithm
        };
        if kind == 1 || (algorithm == Algorithm::ReduceScatter && shards_hold_elements) {
            self.launch_scatter(c).map(|s| Some(Stage::Scattered(s)))
        } else {
            self.launch_gather(c).map(|g| Some(Stage::Gathered(g)))
        }
    }

    /// Runs a deferred stage; returns the one after it, if any.
    pub(super) fn stage(&mut self, s: Stage<B>) -> Result<Option<Stage<B>>> {
        match s {
            Stage::Gathered(g) => self.finish_gather(g).map(|()| None),
            Stage::Scattered(s) => self.sum_shards(s),
            Stage::Summed(s) => self.finish_sums(s).map(|()| None),
        }
    }

    /// Corrupts a frame this rank is about to send, where a fault asks for it.
    fn corrupt(&mut self, frame: Region) -> Result<()> {
        if let Some(at) = self.faults.iter().position(|f| *f == Fault::Corrupt) {
            self.faults.remove(at);
            self.be
                .put(Lane::Compute, frame.sub(0, 8)?, 8, 1, 0x5eed_dead_beef_0bad)?;
        }
        Ok(())
    }

    fn launch_gather(&mut self, mut c: Common<B>) -> Result<Gather<B>> {
        let (x, w) = (c.job.data, self.xgroup(c.rail).1 as u64);
        let parts = [(0, x.numel)];
        let agreed = self.scales_for(&c.job, &parts, c.check, c.rail, &mut c.sent)?;
        let exps: u64 = self.block_counts(&parts).iter().sum();
        let lead = HEAD + round16(exps);
        let cap = self.be.frame_capacity(x.numel, x.dtype);
        let slot = self.bucket(c.job.key)?.slot.bytes.min(cap);
        let mine = self.alloc(lead + cap)?;
        let m = mine.region().sub(0, lead + cap)?;
        self.be
            .put(Lane::Compute, m.sub(CHECK_AT, 8)?, 8, 1, c.check)?;
        if self.o.bound.follows_data() {
            self.be
                .stats(x, c.job.residual, m.sub(STATS_AT, 16)?, 16, 1)?;
        }
        if exps > 0 {
            // (of x + r before the encoder updates r: the next step's scales)
            self.put_exponents(&c.job, &parts, m.sub(HEAD, exps)?)?;
        }
        if let Some(a) = &agreed {
            c.eps = a.eps();
        }
        // (frames that are decoded, not summed: written by the engine's coder)
        self.be.compress(
            x,
            c.job.residual,
            c.eps,
            self.o.coder,
            agreed.as_ref().map(|a| a.of(0)).transpose()?,
            m.sub(lead, cap)?,
            m.sub(SIZE_AT, 8)?,
        )?;
        if let Some(a) = agreed {
            self.be.free(a.shifts);
        }
        self.corrupt(m.sub(lead, cap)?)?;
        self.be.join(Lane::Comm, Lane::Compute)?;
        let row = lead + slot;
        let recv = self.alloc(w * row)?;
        let r = recv.region().sub(0, w * row)?;
        let (tr, be) = self.xt(c.rail);
        tr.all_gather(be, m.sub(0, row)?, r)?;
        self.count_all(&mut c.sent, c.rail, row);
        // (the heads, with the exponents after them)
        let heads = self.be.fetch(Lane::Comm, r, row, HEAD + exps, w)?;
        let mark = self.be.mark(Lane::Comm)?;
        Ok(Gather {
            c,
            lead,
            exps,
            cap,
            slot,
            mine,
            recv,
            heads,
            mark,
        })
    }

    fn finish_gather(&mut self, g: Gather<B>) -> Result<()> {
        let Gather {
            mut c,
            lead,
            exps,
            cap,
            slot,
            mine,
            recv,
            heads,
            mark,
        } = g;
        let (tr, be) = self.xt(c.rail);
        tr.wait(be, &mark)?;
        let (me, w) = self.xgroup(c.rail);
        let fetched = self.be.fetched(heads);
        let (heads, rows_exps) = rows::split_heads(&fetched, w, exps)?;
        let all: Vec<(usize, Head)> = heads.iter().copied().enumerate().collect();
        rows::check_heads(&all, c.check, cap, "a frame")?;
        let size = heads[me].size;
        c.sent.frames += (w as u64 - 1) * size;
        c.sent.slack += (w as u64 - 1) * slot.saturating_sub(size);
        self.note_stats(&c.job, &heads)?;
        if exps > 0 {
            self.note_exponents(c.job.key, &rows_exps)?;
        }
        let largest = heads.iter().map(|h| h.size).max().unwrap_or(0);
        let got = if largest > slot {
            let m = mine.region();
            self.gather_tails(m, lead, size, largest, slot, recv, c.rail, &mut c.sent)?
        } else {
            Frames {
                buf: recv,
                at: lead,
                stride: lead + slot,
            }
        };
        self.be.join(Lane::Compute, Lane::Comm)?;
        let frames = heads
            .iter()
            .enumerate()
            .map(|(j, h)| got.frame(j, h.size))
            .collect::<Result<Vec<_>>>()?;
        let x = c.job.data;
        self.be.decode(
            &frames,
            false,
            x.numel,
            x.dtype,
            FrameKind {
                coder: self.o.coder,
                block_log2: self.o.block_log2(),
            },
            c.job.scale.factor(w),
            x,
        )?;
        self.bucket(c.job.key)?.slot.follow(largest, cap);
        self.be.free(mine);
        self.be.free(got.buf);
        self.finish(c)
    }

    /// A compressed job's end: the node's all-gather of a two-level job, and the accounting.
    fn finish(&mut self, c: Common<B>) -> Result<()> {
        let Common {
            job,
            eps,
            mut sent,
            outer,
            ..
        } = c;
        let whole = outer.as_ref().map_or(job, Outer::job);
        if let Some(o) = outer {
            self.node_gather(o, &mut sent)?;
        }
        let uncompressed = self.ring_bytes(whole.data.bytes(), &whole.op);
        let ring_between = self.ring(uncompressed).between;
        self.shared
            .account(true, sent, uncompressed, ring_between, eps);
        Ok(())
    }

    /// How the frames of a job's exchange of shards are written: a reduce-scatter job's (FSDP's,
    /// decoded where they arrive) with the engine's coder; an all-reduce's, summed on the way,
    /// with bit planes (the device sums no rice frames).
    fn shard_coder(&self, job: &Job) -> Coder {
        match job.op {
            Op::ReduceScatter { .. } => self.o.coder,
            Op::AllReduce => Coder::Planes,
        }
    }

    /// How the reduce-scatter's sums are written: bit planes, with the engine's block scales.
    fn planes(&self) -> FrameKind {
        FrameKind {
            coder: Coder::Planes,
            block_log2: self.o.block_log2(),
        }
    }

    /// The next step's statistics from every rank's heads (added in rank order: the same bits
    /// on every rank).
    fn note_stats(&mut self, job: &Job, heads: &[Head]) -> Result<()> {
        if !self.o.bound.follows_data() {
            return Ok(());
        }
        let sum = heads.iter().fold(0.0f64, |a, h| a + h.sum_squares);
        let max = heads.iter().fold(0.0f64, |a, h| a.max(h.max_abs));
        self.bucket(job.key)?.stats = Some((sum, max));
        Ok(())
    }

    fn launch_scatter(&mut self, mut c: Common<B>) -> Result<Scatter<B>> {
        let x = c.job.data;
        let (me, world) = self.xgroup(c.rail);
        let w = world as u64;
        let parts = match c.job.op {
            Op::AllReduce => rows::shards(x.numel, world),
            Op::ReduceScatter { .. } => {
                let l = x.numel / w;
                (0..w).map(|j| (j * l, l)).collect()
            }
        };
        let caps: Vec<u64> = parts
            .iter()
            .map(|&(_, len)| self.be.frame_capacity(len, x.dtype))
            .collect();
        let agreed = self.scales_for(&c.job, &parts, c.check, c.rail, &mut c.sent)?;
        if let Some(a) = &agreed {
            c.eps = a.eps();
        }
        let counts = self.block_counts(&parts);
        // With block scales, an all-reduce's row carries its sender's exponents of the row's
        // shard: the shard's owner takes their largest and sends it on with the sum, to every
        // rank. A reduce-scatter job has no second round: every rank needs every rank's
        // exponents of every shard for its next step, so every row carries all of its sender's.
        let every = matches!(c.job.op, Op::ReduceScatter { .. }) && !counts.is_empty();
        let exps = if every {
            counts.iter().sum()
        } else {
            counts.iter().copied().max().unwrap_or(0)
        };
        let lead = HEAD + round16(exps);
        let stride = lead + caps.iter().copied().max().unwrap_or(0);
        let mine = self.alloc(w * stride)?;
        let m = mine.region().sub(0, w * stride)?;
        // Every row's head carries the whole bucket's statistics and the check word.
        if self.o.bound.follows_data() {
            self.be.stats(
                x,
                c.job.residual,
                m.sub(STATS_AT, (w - 1) * stride + 16)?,
                stride,
                w,
            )?;
        }
        self.be.put(
            Lane::Compute,
            m.sub(CHECK_AT, (w - 1) * stride + 8)?,
            stride,
            w,
            c.check,
        )?;
        if every {
            // (of x + r before the encoder updates r: the next step's scales; computed once,
            // copied into every row)
            let first = m.sub(HEAD, exps)?;
            self.put_exponents(&c.job, &parts, first)?;
            for j in 1..w {
                self.be
                    .copy(Lane::Compute, first, m.sub(j * stride + HEAD, exps)?)?;
            }
        }
        for (j, &(lo, len)) in parts.iter().enumerate() {
            let row = m.sub(j as u64 * stride, stride)?;
            match counts.get(j) {
                Some(&count) if !every => {
                    // (of x + r before the encoder updates r: the next step's scales)
                    self.put_exponents(&c.job, &parts[j..=j], row.sub(HEAD, count)?)?;
                }
                _ => {}
            }
            let r = c.job.residual.map(|r| r.slice(lo, len));
            let (eps, scales) = match &agreed {
                Some(a) => (a.parts[j].eps, Some(a.of(j)?)),
                None => (c.eps, None),
            };
            self.be.compress(
                x.slice(lo, len),
                r,
                eps,
                self.shard_coder(&c.job),
                scales,
                row.sub(lead, caps[j])?,
                row.sub(SIZE_AT, 8)?,
            )?;
            self.corrupt(row.sub(lead, caps[j])?)?;
        }
        if let Some(a) = agreed {
            self.be.free(a.shifts);
        }
        self.be.join(Lane::Comm, Lane::Compute)?;
        let (send_slots, recv_slots) = self.bucket(c.job.key)?.pair_slots();
        let rstride = lead + recv_slots.iter().copied().max().unwrap_or(0);
        let recv = self.alloc(w * rstride)?;
        let r = recv.region().sub(0, w * rstride)?;
        let mut sends = Vec::with_capacity(world);
        let mut recvs = Vec::with_capacity(world);
        for j in 0..world {
            if j == me {
                sends.push(m.sub(0, 0)?);
                recvs.push(r.sub(0, 0)?);
                continue;
            }
            let out = lead + send_slots[j].min(caps[j]);
            sends.push(m.sub(j as u64 * stride, out)?);
            recvs.push(r.sub(j as u64 * rstride, lead + recv_slots[j])?);
            self.count(&mut c.sent, c.rail, j, out);
        }
        let (tr, be) = self.xt(c.rail);
        tr.exchange(be, &sends, &recvs)?;
        // (the heads, with the exponents after them)
        let own_heads = self.be.fetch(Lane::Comm, m, stride, HEAD + exps, w)?;
        let in_heads = self.be.fetch(Lane::Comm, r, rstride, HEAD + exps, w)?;
        let mark = self.be.mark(Lane::Comm)?;
        Ok(Scatter {
            c,
            parts,
            lead,
            exps,
            caps,
            stride,
            mine,
            recv,
            rstride,
            own_heads,
            in_heads,
            mark,
        })
    }

    /// The exchange of shards has arrived: resend what outgrew its slot (pair by pair), add
    /// this rank's shard's codes, and for an all-reduce send the sum to every rank.
    fn sum_shards(&mut self, s: Scatter<B>) -> Result<Option<Stage<B>>> {
        let Scatter {
            mut c,
            parts,
            lead,
            exps,
            caps,
            stride,
            mine,
            recv,
            rstride,
            own_heads,
            in_heads,
            mark,
        } = s;
        let (me, world) = self.xgroup(c.rail);
        let w = world as u64;
        let (tr, be) = self.xt(c.rail);
        tr.wait(be, &mark)?;
        let own_fetched = self.be.fetched(own_heads);
        let in_fetched = self.be.fetched(in_heads);
        let (own, own_exps) = rows::split_heads(&own_fetched, world, exps)?;
        let (inn, in_exps) = rows::split_heads(&in_fetched, world, exps)?;
        // With block scales: a reduce-scatter job keeps every shard's largest exponents over
        // the ranks for its next step (its own row stands in for the one that never
        // travelled); an all-reduce this shard's, which its sum carries on to every rank.
        let every = matches!(c.job.op, Op::ReduceScatter { .. });
        if every && exps > 0 {
            let rows: Vec<&[u8]> = (0..world)
                .map(|j| if j == me { own_exps[me] } else { in_exps[j] })
                .map(|r| &r[..exps as usize])
                .collect();
            self.note_exponents(c.job.key, &rows)?;
        }
        let shard_exps: Vec<u8> = match self.block_counts(&parts).get(me) {
            Some(_) if every => Vec::new(),
            Some(&count) => (0..world)
                .map(|j| if j == me { own_exps[me] } else { in_exps[j] })
                .fold(vec![0u8; count as usize], |mut a, r| {
                    for (a, &e) in a.iter_mut().zip(r.iter()) {
                        *a = (*a).max(e);
                    }
                    a
                }),
            None => Vec::new(),
        };
        // This rank's own frame of its shard never travelled: its own head stands in.
        let received: Vec<(usize, Head)> = (0..world)
            .map(|j| (j, if j == me { own[me] } else { inn[j] }))
            .collect();
        rows::check_heads(
            &received,
            c.check,
            caps[me],
            "its frame of this rank's shard",
        )?;
        let own_sizes: Vec<(usize, Head)> = own.iter().copied().enumerate().collect();
        for (j, h) in &own_sizes {
            if h.size > caps[*j] {
                return Err(Error::Transport(format!(
                    "this rank's frame of shard {j} holds {} bytes, past its capacity {}",
                    h.size, caps[*j]
                )));
            }
        }
        let heads: Vec<Head> = received.iter().map(|(_, h)| *h).collect();
        self.note_stats(&c.job, &heads)?;
        c.sent.frames += (0..world)
            .filter(|&j| j != me)
            .map(|j| own[j].size)
            .sum::<u64>();
        let (send_slots, recv_slots) = self.bucket(c.job.key)?.pair_slots();
        let slots_out: Vec<u64> = (0..world).map(|j| send_slots[j].min(caps[j])).collect();
        c.sent.slack += (0..world)
            .filter(|&j| j != me)
            .map(|j| slots_out[j].saturating_sub(own[j].size))
            .sum::<u64>();
        let m = mine.region();
        let r = recv.region();
        let mut frames: Vec<Region> = (0..world)
            .map(|j| {
                if j == me {
                    m.sub(j as u64 * stride + lead, own[me].size)
                } else {
                    r.sub(j as u64 * rstride + lead, inn[j].size.min(recv_slots[j]))
                }
            })
            .collect::<Result<_>>()?;
        // Pairs whose frame outgrew its slot: both sides know it from the same head.
        let sizes_out: Vec<u64> = own.iter().map(|h| h.size).collect();
        let sizes_in: Vec<u64> = inn.iter().map(|h| h.size).collect();
        let pairs = Pairs {
            mine: m,
            stride,
            sizes_out: &sizes_out,
            slots_out: &slots_out,
            recv: r,
            rstride,
            sizes_in: &sizes_in,
            slots_in: &recv_slots,
            lead,
        };
        let again = self.exchange_tails(&pairs, &mut frames, c.rail, &mut c.sent)?;
        {
            let b = self.bucket(c.job.key)?;
            for j in (0..world).filter(|&j| j != me) {
                b.send_slots[j].follow(own[j].size, caps[j]);
                b.recv_slots[j].follow(inn[j].size, caps[me]);
            }
        }
        self.be.join(Lane::Compute, Lane::Comm)?;
        let x = c.job.data;
        let (_, len) = parts[me];
        if let (Op::ReduceScatter { out }, Coder::Rice) = (c.job.op, self.shard_coder(&c.job)) {
            // Rice frames are decoded where they arrive and added in f32, in rank order, as the
            // all-gather's are: this rank's shard is all a reduce-scatter job wants.
            let kind = FrameKind {
                coder: Coder::Rice,
                block_log2: self.o.block_log2(),
            };
            let scale = c.job.scale.factor(world);
            self.be
                .decode(&frames, false, len, x.dtype, kind, scale, out)?;
            self.be.free(mine);
            self.be.free(recv);
            if let Some(b) = again {
                self.be.free(b);
            }
            self.finish(c)?;
            return Ok(None);
        }
        let sum_caps: Vec<u64> = parts
            .iter()
            .map(|&(_, l)| self.be.sum_capacity(l, x.dtype))
            .collect();
        // Sized for the largest shard's sum, not this rank's: the all-gather that follows sends
        // rows of one slot (taken from the largest) from every rank, the last shard's included.
        let widest = sum_caps.iter().copied().max().unwrap_or(0);
        // An all-reduce's sums carry their shard's exponents to every rank (a reduce-scatter
        // job's sum is decoded here, its size read from the head right before it).
        let (slead, sexps) = match c.job.op {
            Op::AllReduce => (lead, exps),
            Op::ReduceScatter { .. } => (HEAD, 0),
        };
        let sums = self.alloc(slead + widest)?;
        let sm = sums.region().sub(0, slead + widest)?;
        if sexps > 0 {
            self.be.upload(
                Lane::Compute,
                sm.sub(HEAD, shard_exps.len() as u64)?,
                &shard_exps,
            )?;
        }
        self.be.sum(
            &frames,
            len,
            x.dtype,
            self.o.block_log2(),
            sm.sub(slead, sum_caps[me])?,
            sm.sub(SIZE_AT, 8)?,
        )?;
        self.be.free(mine);
        self.be.free(recv);
        if let Some(b) = again {
            self.be.free(b);
        }
        let scale = c.job.scale.factor(world);
        if let Op::ReduceScatter { out } = c.job.op {
            // This rank's shard is all a reduce-scatter wants: decode it (its size is in its head).
            let frame = [sm.sub(HEAD, sum_caps[me])?];
            self.be
                .decode(&frame, true, len, x.dtype, self.planes(), scale, out)?;
            self.be.free(sums);
            self.finish(c)?;
            return Ok(None);
        }
        self.be
            .put(Lane::Compute, sm.sub(CHECK_AT, 8)?, 8, 1, c.check)?;
        self.be.join(Lane::Comm, Lane::Compute)?;
        let slot = self.bucket(c.job.key)?.slot.bytes.min(widest);
        let row = slead + slot;
        let recv = self.alloc(w * row)?;
        let rr = recv.region().sub(0, w * row)?;
        let (tr, be) = self.xt(c.rail);
        tr.all_gather(be, sm.sub(0, row)?, rr)?;
        self.count_all(&mut c.sent, c.rail, row);
        let heads = self.be.fetch(Lane::Comm, rr, row, HEAD + sexps, w)?;
        let mark = self.be.mark(Lane::Comm)?;
        Ok(Some(Stage::Summed(Summed {
            c,
            parts,
            lead: slead,
            exps: sexps,
            sum_caps,
            sums,
            slot,
            recv,
            heads,
            mark,
        })))
    }

    /// Every rank's sum of its shard has arrived: decode each into its shard of the bucket.
    fn finish_sums(&mut self, s: Summed<B>) -> Result<()> {
        let Summed {
            mut c,
            parts,
            lead,
            exps,
            sum_caps,
            sums,
            slot,
            recv,
            heads,
            mark,
        } = s;
        let world = self.xgroup(c.rail).1;
        let (tr, be) = self.xt(c.rail);
        tr.wait(be, &mark)?;
        let fetched = self.be.fetched(heads);
        let (heads, sums_exps) = rows::split_heads(&fetched, world, exps)?;
        let me = self.xgroup(c.rail).0;
        for (j, h) in heads.iter().enumerate() {
            if h.size == 0 {
                return Err(Error::PeerFailed {
                    rank: j,
                    reason: format!(
                        "rank {j} could not sum the frames of its shard (a frame it received \
                         was not one of these elements, or the frames' steps differ)"
                    ),
                });
            }
            rows::check_heads(&[(j, *h)], c.check, sum_caps[j], "the sum of its shard")?;
        }
        let size = heads[me].size;
        c.sent.frames += (world as u64 - 1) * size;
        c.sent.slack += (world as u64 - 1) * slot.saturating_sub(size);
        if exps > 0 {
            // every shard's largest exponents, shard by shard: the next step's scales
            let counts = self.block_counts(&parts);
            let next: Vec<u8> = sums_exps
                .iter()
                .zip(&counts)
                .flat_map(|(r, &count)| r[..count as usize].iter().copied())
                .collect();
            self.bucket(c.job.key)?.exponents = Some(next);
        }
        let largest = heads.iter().map(|h| h.size).max().unwrap_or(0);
        let got = if largest > slot {
            let s = sums.region();
            self.gather_tails(s, lead, size, largest, slot, recv, c.rail, &mut c.sent)?
        } else {
            Frames {
                buf: recv,
                at: lead,
                stride: lead + slot,
            }
        };
        self.be.join(Lane::Compute, Lane::Comm)?;
        let x = c.job.data;
        let scale = c.job.scale.factor(world);
        for (j, &(lo, len)) in parts.iter().enumerate() {
            let frame = [got.frame(j, heads[j].size)?];
            self.be.decode(
                &frame,
                false,
                len,
                x.dtype,
                self.planes(),
                scale,
                x.slice(lo, len),
            )?;
        }
        let widest = sum_caps.iter().copied().max().unwrap_or(0);
        self.bucket(c.job.key)?.slot.follow(largest, widest);
        self.be.free(sums);
        self.be.free(got.buf);
        self.finish(c)
    }
}
