//! Tails: the bytes of a frame past its slot. A frame that outgrew its slot (every rank sees it,
//! in the heads) is not sent again whole: only its bytes past the slot travel, in a second
//! exchange, and the receiver puts the frame together (its slot's part from the first exchange,
//! then its tail) before it decodes or sums it. Outgrowing a slot so costs a round, not the
//! slot's bytes twice; the first exchange of a bucket (a slot of 0: heads only) sends its frames
//! this way too.

use super::backend::{Backend, Lane, Memory};
use super::job::Region;
use super::rows::round16;
use super::transport::Transport;
use super::worker::Worker;
use super::Sent;
use crate::error::Result;

/// Frames held in one buffer: frame `j` starts at `at + j * stride`.
pub(crate) struct Frames<B: Backend> {
    pub buf: B::Buf,
    pub at: u64,
    pub stride: u64,
}

impl<B: Backend> Frames<B> {
    /// Frame `j`, of `size` bytes.
    pub fn frame(&self, j: usize, size: u64) -> Result<Region> {
        self.buf
            .region()
            .sub(self.at + j as u64 * self.stride, size)
    }
}

/// What one pair exchange of tails needs to know about one side of each pair: the frames'
/// sizes (from the heads) and the slots they were sent in.
pub(crate) struct Pairs<'a> {
    /// This rank's rows: row `j` (for rank `j`) at `j * stride`, its frame `lead` bytes in.
    pub mine: Region,
    pub stride: u64,
    /// This rank's frame for each rank, and the slot it went in.
    pub sizes_out: &'a [u64],
    pub slots_out: &'a [u64],
    /// The rows received: rank `j`'s at `j * rstride`, its frame `lead` bytes in.
    pub recv: Region,
    pub rstride: u64,
    /// Each rank's frame for this rank, and the slot it came in.
    pub sizes_in: &'a [u64],
    pub slots_in: &'a [u64],
    pub lead: u64,
}

impl<B: Backend, T: Transport<B>> Worker<B, T> {
    /// The all-gather's rows of `lead + slot` bytes (`first`) held a frame larger than `slot`
    /// (`largest`): every rank sends its row's bytes from `lead + slot` to `lead +
    /// round16(largest)` (the same length from every rank, so past its own frame where that is
    /// shorter), and each frame is put together in a new buffer. `mine` is this rank's row, with
    /// a frame of `size` bytes. Returns where the frames are now.
    #[allow(clippy::too_many_arguments)] // (the two rounds' shapes, and where the bytes count)
    pub(super) fn gather_tails(
        &mut self,
        mine: Region,
        lead: u64,
        size: u64,
        largest: u64,
        slot: u64,
        first: B::Buf,
        rail: bool,
        sent: &mut Sent,
    ) -> Result<Frames<B>> {
        let w = self.xgroup(rail).1 as u64;
        let stride = round16(largest);
        let tail = stride - slot; // (slots are multiples of 16 and `largest > slot`)
        let tails = self.alloc_for_comm(w * tail)?;
        let t = tails.region().sub(0, w * tail)?;
        let (tr, be) = self.xt(rail);
        tr.all_gather(be, mine.sub(lead + slot, tail)?, t)?;
        self.count_all(sent, rail, tail);
        sent.slack += (w - 1) * (tail - size.saturating_sub(slot));
        if slot == 0 {
            // (the first exchange of a bucket: heads only, then the frames, whole)
            self.be.free(first);
            return Ok(Frames {
                buf: tails,
                at: 0,
                stride: tail,
            });
        }
        self.shared.resend();
        let whole = self.alloc_for_comm(w * stride)?;
        let (f, wr) = (first.region(), whole.region());
        for j in 0..w {
            let row = j * (lead + slot);
            self.be.copy(
                Lane::Comm,
                f.sub(row + lead, slot)?,
                wr.sub(j * stride, slot)?,
            )?;
            self.be.copy(
                Lane::Comm,
                t.sub(j * tail, tail)?,
                wr.sub(j * stride + slot, tail)?,
            )?;
        }
        self.be.free(first);
        self.be.free(tails);
        Ok(Frames {
            buf: whole,
            at: 0,
            stride,
        })
    }

    /// The exchange of shards' rows held frames larger than their slots: each such frame's
    /// bytes past its slot go between its two ranks alone, and the receiver puts the frame
    /// together in a new buffer. Returns that buffer (if anything outgrew a slot) and writes
    /// where each received frame now is into `frames`.
    pub(super) fn exchange_tails(
        &mut self,
        p: &Pairs,
        frames: &mut [Region],
        rail: bool,
        sent: &mut Sent,
    ) -> Result<Option<B::Buf>> {
        let (me, world) = self.xgroup(rail);
        let out: Vec<usize> = (0..world)
            .filter(|&j| j != me && p.sizes_out[j] > p.slots_out[j])
            .collect();
        let inn: Vec<usize> = (0..world)
            .filter(|&j| j != me && p.sizes_in[j] > p.slots_in[j])
            .collect();
        if out.is_empty() && inn.is_empty() {
            return Ok(None);
        }
        let total: u64 = inn.iter().map(|&j| round16(p.sizes_in[j])).sum();
        let buf = self.alloc_for_comm(total.max(16))?;
        let b = buf.region();
        let mut sends = vec![p.mine.sub(0, 0)?; world];
        let mut recvs = vec![b.sub(0, 0)?; world];
        for &j in &out {
            let (slot, size) = (p.slots_out[j], p.sizes_out[j]);
            sends[j] = p
                .mine
                .sub(j as u64 * p.stride + p.lead + slot, size - slot)?;
            self.count(sent, rail, j, size - slot);
        }
        let mut at = 0;
        for &j in &inn {
            let (slot, size) = (p.slots_in[j], p.sizes_in[j]);
            if slot > 0 {
                let part = p.recv.sub(j as u64 * p.rstride + p.lead, slot)?;
                self.be.copy(Lane::Comm, part, b.sub(at, slot)?)?;
            }
            recvs[j] = b.sub(at + slot, size - slot)?;
            frames[j] = b.sub(at, size)?;
            at += round16(size);
        }
        let (tr, be) = self.xt(rail);
        tr.exchange(be, &sends, &recvs)?;
        if p.slots_out.iter().chain(p.slots_in).any(|&s| s > 0) {
            self.shared.resend(); // (with no slot yet, sending the heads first is the plan)
        }
        Ok(Some(buf))
    }
}
