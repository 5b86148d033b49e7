//! Block scales of a compressed job ([`crate::engine::Options::block`]): each block of a
//! bucket's frames gets a step that follows the block's own RMS, the same on every rank so that
//! codes still add exactly.
//!
//! Before a job is quantized, every rank computes each block's exponent (`floor(log2(rms))` of
//! `x + r`, one byte per block, on the device: [`crate::scales::block_exponents`]) for each part
//! the job's frames cover (the whole bucket for an all-gather, each shard for a reduce-scatter),
//! and the exponents are all-gathered with a check word. Each rank takes every block's largest
//! exponent over the ranks, in the same order on every rank, and from it the part's base bound
//! and shifts ([`crate::scales::BlockScales::from_exponents`]); the shifts go back to the device
//! for the encoder. So every element is within `k` times its block's RMS on the rank where that
//! RMS is largest, rounded down to a power of two, and every rank's frame of a part has the
//! same scales.
//!
//! The round costs `ceil(n / block)` bytes per rank and one wait on the host per job: it runs
//! for the job at hand, not a step late, so that a block whose scale jumps (a spike, the first
//! steps of training) is never quantized with a step far too coarse.

use super::backend::{Backend, Lane, Memory};
use super::job::{Job, Region};
use super::options::BoundRule;
use super::rows::round16;
use super::transport::Transport;
use super::worker::Worker;
use super::Sent;
use crate::error::{Error, Result};
use crate::scales::{blocks_for, BlockScales};

/// Bytes before a rank's exponents in the round: its check word, padded to 16.
const ROUND_HEAD: u64 = 16;

/// The scales of one part of a job: its base bound, and where its shifts lie in
/// [`Agreed::shifts`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct PartScales {
    pub eps: f64,
    pub at: u64,
    pub blocks: u64,
}

/// The agreed scales of a job's parts, their shifts in backend memory.
pub(crate) struct Agreed<B: Backend> {
    pub log2: u8,
    pub shifts: B::Buf,
    pub parts: Vec<PartScales>,
}

impl<B: Backend> Agreed<B> {
    /// Part `j`'s shifts, as the encoder takes them.
    pub fn of(&self, j: usize) -> Result<(u8, Region)> {
        let p = self.parts[j];
        Ok((self.log2, self.shifts.region().sub(p.at, p.blocks)?))
    }

    /// The coarsest part's base bound (what the job's accounting reports).
    pub fn eps(&self) -> f64 {
        self.parts.iter().map(|p| p.eps).fold(0.0, f64::max)
    }
}

impl<B: Backend, T: Transport<B>> Worker<B, T> {
    /// Agrees the block scales of `parts` (element ranges) of `job` with the ranks of its
    /// exchange (see the module docs); `None` without block scales.
    pub(super) fn agree_scales(
        &mut self,
        job: &Job,
        parts: &[(u64, u64)],
        check: u64,
        rail: bool,
        sent: &mut Sent,
    ) -> Result<Option<Agreed<B>>> {
        let log2 = self.o.block_log2();
        let k = match (log2, self.o.bound) {
            (0, _) => return Ok(None),
            (_, BoundRule::Rms(k)) => k,
            (_, other) => {
                return Err(Error::InvalidBound {
                    what: "block",
                    reason: format!("block scales take rms=, not {}=", other.name()),
                })
            }
        };
        let counts: Vec<u64> = parts
            .iter()
            .map(|&(_, len)| blocks_for(len, log2))
            .collect();
        let total: u64 = counts.iter().sum();
        let row = ROUND_HEAD + round16(total);
        let w = self.xgroup(rail).1 as u64;
        let mine = self.alloc(row)?;
        let all = self.alloc(w * row)?;
        let (m, a) = (mine.region().sub(0, row)?, all.region().sub(0, w * row)?);
        self.be.put(Lane::Compute, m.sub(0, 8)?, 8, 1, check)?;
        let mut at = ROUND_HEAD;
        for (&(lo, len), &count) in parts.iter().zip(&counts) {
            let r = job.residual.map(|r| r.slice(lo, len));
            self.be
                .exponents(job.data.slice(lo, len), r, log2, m.sub(at, count)?)?;
            at += count;
        }
        self.be.join(Lane::Comm, Lane::Compute)?;
        let (tr, be) = self.xt(rail);
        tr.all_gather(be, m, a)?;
        self.count_all(sent, rail, row);
        let f = self.be.fetch(Lane::Comm, a, row, ROUND_HEAD + total, w)?;
        let mark = self.be.mark(Lane::Comm)?;
        let (tr, be) = self.xt(rail);
        tr.wait(be, &mark)?;
        let bytes = self.be.fetched(f);
        self.be.free(mine);
        self.be.free(all);
        let width = (ROUND_HEAD + total) as usize;
        let mut agreed = vec![0u8; total as usize];
        for (j, r) in bytes.chunks_exact(width).enumerate() {
            let word = u64::from_le_bytes(r[..8].try_into().unwrap_or([0; 8]));
            if word != check {
                return Err(Error::RankMismatch {
                    what: format!("this rank's job has check word {check:#018x}"),
                    theirs: format!(
                        "rank {j} sent the block scales of a job with check word {word:#018x}"
                    ),
                });
            }
            for (a, &e) in agreed.iter_mut().zip(&r[ROUND_HEAD as usize..]) {
                *a = (*a).max(e);
            }
        }
        let mut shifts = Vec::with_capacity(total as usize);
        let mut out = Vec::with_capacity(parts.len());
        let mut at = 0u64;
        for &count in &counts {
            let (eps, s) =
                BlockScales::from_exponents(k, &agreed[at as usize..(at + count) as usize], log2);
            shifts.extend_from_slice(&s.shifts);
            out.push(PartScales {
                eps,
                at,
                blocks: count,
            });
            at += count;
        }
        let buf = self.alloc(round16(total).max(16))?;
        self.be
            .upload(Lane::Compute, buf.region().sub(0, total)?, &shifts)?;
        Ok(Some(Agreed {
            log2,
            shifts: buf,
            parts: out,
        }))
    }
}
