//! Block scales of a compressed job ([`crate::engine::Options::block`]): each block of a
//! bucket's frames gets a step that follows the block's own RMS, the same on every rank so that
//! codes still add exactly.
//!
//! Every rank computes each block's exponent (`floor(log2(rms))` of `x + r`, one byte per block,
//! on the device: [`crate::scales::block_exponents`]) for each part the job's frames cover (the
//! whole bucket for an all-gather, each shard for a reduce-scatter). Each block's largest
//! exponent over the ranks, taken in the same order on every rank, gives the part's base bound
//! and shifts ([`crate::scales::BlockScales::from_exponents`]); the shifts go to the device for
//! the encoder. So every element is within `k` times its block's RMS on the rank where that RMS
//! is largest, rounded down to a power of two, and every rank's frame of a part has the same
//! scales.
//!
//! The exponents travel a step ahead, in the rows of the exchange (as the statistics of a
//! bucket-wide bound do: `rows.rs`), so that agreeing them costs no wait of its own: a job is
//! quantized with the exponents of its bucket's previous step, and sends its own for the next.
//! In the all-gather every row carries its sender's exponents of the whole bucket; in an
//! all-reduce's reduce-scatter each row carries those of the shard it holds, and the shard's
//! owner takes their largest and sends them on with the sum of the shard. A reduce-scatter job
//! (FSDP's), which has no second round, sends all of its exponents in every row (a byte per
//! block per peer), so that every rank sees every rank's. At a bucket's first compressed step,
//! and where its parts changed, they are agreed in a round of their own before the job is
//! quantized: an all-gather of a byte per block, and a wait on the host.

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
    /// The blocks of each part (element ranges) of a job with block scales (empty without).
    pub(super) fn block_counts(&self, parts: &[(u64, u64)]) -> Vec<u64> {
        match self.o.block_log2() {
            0 => Vec::new(),
            log2 => parts
                .iter()
                .map(|&(_, len)| blocks_for(len, log2))
                .collect(),
        }
    }

    /// The block scales of a job's parts: from the exponents its bucket's last exchange
    /// brought (every rank's, carried in the rows), or, at a bucket's first compressed step
    /// (or after its layout changed), agreed in a round of their own; `None` without block
    /// scales.
    pub(super) fn scales_for(
        &mut self,
        job: &Job,
        parts: &[(u64, u64)],
        check: u64,
        rail: bool,
        sent: &mut Sent,
    ) -> Result<Option<Agreed<B>>> {
        let counts = self.block_counts(parts);
        if counts.is_empty() {
            return Ok(None);
        }
        let total: u64 = counts.iter().sum();
        let lagged = self.bucket(job.key)?.exponents.take();
        let agreed = match lagged {
            Some(e) if e.len() as u64 == total => e,
            _ => self.agree_round(job, parts, &counts, check, rail, sent)?,
        };
        self.upload_scales(&agreed, &counts).map(Some)
    }

    /// Queues this rank's exponents of each part of `job`, one after the other, into `out`.
    pub(super) fn put_exponents(
        &mut self,
        job: &Job,
        parts: &[(u64, u64)],
        out: Region,
    ) -> Result<()> {
        let log2 = self.o.block_log2();
        let mut at = 0;
        for (&(lo, len), count) in parts.iter().zip(self.block_counts(parts)) {
            let r = job.residual.map(|r| r.slice(lo, len));
            self.be
                .exponents(job.data.slice(lo, len), r, log2, out.sub(at, count)?)?;
            at += count;
        }
        Ok(())
    }

    /// Keeps, for the bucket's next step, each block's largest exponent over `rows` (every
    /// rank's exponents, in rank order: the same on every rank).
    pub(super) fn note_exponents(&mut self, key: u64, rows: &[&[u8]]) -> Result<()> {
        let mut agreed = rows.first().map_or_else(Vec::new, |r| r.to_vec());
        for r in &rows[1.min(rows.len())..] {
            for (a, &e) in agreed.iter_mut().zip(r.iter()) {
                *a = (*a).max(e);
            }
        }
        self.bucket(key)?.exponents = Some(agreed);
        Ok(())
    }

    /// Scales from agreed exponents (`counts` blocks per part, one after the other), their
    /// shifts uploaded for the encoder.
    fn upload_scales(&mut self, agreed: &[u8], counts: &[u64]) -> Result<Agreed<B>> {
        let (log2, k) = match self.o.bound {
            BoundRule::Rms(k) => (self.o.block_log2(), k),
            other => {
                return Err(Error::InvalidBound {
                    what: "block",
                    reason: format!("block scales take rms=, not {}=", other.name()),
                })
            }
        };
        let total: u64 = counts.iter().sum();
        let mut shifts = Vec::with_capacity(total as usize);
        let mut parts = Vec::with_capacity(counts.len());
        let mut at = 0u64;
        for &count in counts {
            let (eps, s) =
                BlockScales::from_exponents(k, &agreed[at as usize..(at + count) as usize], log2);
            shifts.extend_from_slice(&s.shifts);
            parts.push(PartScales {
                eps,
                at,
                blocks: count,
            });
            at += count;
        }
        let buf = self.alloc(round16(total).max(16))?;
        self.be
            .upload(Lane::Compute, buf.region().sub(0, total)?, &shifts)?;
        Ok(Agreed {
            log2,
            shifts: buf,
            parts,
        })
    }

    /// Every rank's exponents of `job`'s parts now, in a round of their own (a check word and
    /// a byte per block from every rank); each block's largest.
    fn agree_round(
        &mut self,
        job: &Job,
        parts: &[(u64, u64)],
        counts: &[u64],
        check: u64,
        rail: bool,
        sent: &mut Sent,
    ) -> Result<Vec<u8>> {
        let total: u64 = counts.iter().sum();
        let row = ROUND_HEAD + round16(total);
        let rows = self.round(row, 0, check, rail, "sent the block scales of", |w, m| {
            w.put_exponents(job, parts, m.sub(ROUND_HEAD, total)?)
        })?;
        self.count_all(sent, rail, row);
        let mut agreed = vec![0u8; total as usize];
        for r in &rows {
            for (a, &e) in agreed.iter_mut().zip(&r[ROUND_HEAD as usize..]) {
                *a = (*a).max(e);
            }
        }
        Ok(agreed)
    }
}
