//! A check that the engine orders its two lanes wherever they share memory.
//!
//! The CPU backend runs every operation at once, on the engine's thread, so a join missing
//! between the lanes does no harm there. On a GPU the lanes are two streams, and the same
//! missing join lets a collective overwrite a buffer that a kernel of the other stream is
//! still reading. [`LaneCheck`] finds such bugs without a GPU: the CPU backend and the host
//! transports report every range of memory each lane reads or writes, and an access that
//! conflicts with an earlier one of the other lane (the same bytes, one of the two a write)
//! is an error unless the lane was ordered after that earlier access, either by
//! [`crate::engine::backend::Backend::join`] or by the host having waited for a mark of the
//! other lane recorded after it (work queued after such a wait starts after that work ended).
//!
//! It is on in the crate's unit tests (`src/engine/tests/`) and wherever `CFC_CHECK_LANES=1`
//! (the Python tests set it).

use crate::engine::backend::Lane;
use crate::engine::job::Region;
use crate::error::{Error, Result};

/// Accesses kept at most; past this the oldest are forgotten (fewer checks, never a false
/// error). The engine reuses its buffers, so far fewer are live in practice.
const KEEP: usize = 1 << 16;

fn index(lane: Lane) -> usize {
    match lane {
        Lane::Compute => 0,
        Lane::Comm => 1,
    }
}

fn other_lane(lane: Lane) -> Lane {
    match lane {
        Lane::Compute => Lane::Comm,
        Lane::Comm => Lane::Compute,
    }
}

fn name(lane: Lane) -> &'static str {
    match lane {
        Lane::Compute => "compute",
        Lane::Comm => "comm",
    }
}

/// One lane's read or write of a range of bytes.
#[derive(Debug, Clone, Copy)]
struct Access {
    start: u64,
    end: u64,
    lane: Lane,
    /// The lane's clock at the access.
    at: u64,
    write: bool,
    what: &'static str,
}

/// The record of accesses and orderings (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct LaneCheck {
    /// Each lane's count of accesses so far.
    clock: [u64; 2],
    /// `after[a][b]`: the clock of lane `b` that lane `a` is ordered after.
    after: [[u64; 2]; 2],
    seen: Vec<Access>,
}

impl LaneCheck {
    /// A check when this build or process asks for one (see the module docs).
    pub(crate) fn wanted() -> Option<LaneCheck> {
        (cfg!(test) || crate::env::check_lanes()).then(LaneCheck::default)
    }

    /// The point a mark recorded now on `lane` stands for.
    pub(crate) fn now(&self, lane: Lane) -> u64 {
        self.clock[index(lane)]
    }

    /// `to` is ordered after everything on `from` so far.
    pub(crate) fn join(&mut self, to: Lane, from: Lane) {
        let (t, f) = (index(to), index(from));
        self.after[t][f] = self.after[t][f].max(self.clock[f]);
    }

    /// The host saw `lane` reach `at`: everything queued from now on, on either lane, follows it.
    pub(crate) fn reached(&mut self, lane: Lane, at: u64) {
        let f = index(lane);
        for a in &mut self.after {
            a[f] = a[f].max(at);
        }
    }

    /// Records that `lane` reads (or, with `write`, writes) `r`, for `what` (named in the
    /// error).
    ///
    /// # Errors
    /// [`Error::LaneOrder`] where an earlier conflicting access of the other lane is not
    /// ordered before this one.
    pub(crate) fn touch(
        &mut self,
        lane: Lane,
        r: Region,
        write: bool,
        what: &'static str,
    ) -> Result<()> {
        if r.len == 0 {
            return Ok(());
        }
        let l = index(lane);
        self.clock[l] += 1;
        let now = Access {
            start: r.addr,
            end: r.addr.saturating_add(r.len),
            lane,
            at: self.clock[l],
            write,
            what,
        };
        let ordered =
            |p: &Access, after: &[[u64; 2]; 2]| p.lane == lane || after[l][index(p.lane)] >= p.at;
        if let Some(p) = self.seen.iter().rev().find(|p| {
            p.end > now.start && p.start < now.end && (p.write || write) && !ordered(p, &self.after)
        }) {
            return Err(Error::LaneOrder(format!(
                "{} {} bytes {:#x}..{:#x} on the {} lane while {} {} bytes {:#x}..{:#x} on the {} lane may still run",
                what,
                if write { "writes" } else { "reads" },
                now.start,
                now.end,
                name(lane),
                p.what,
                if p.write { "writes" } else { "reads" },
                p.start,
                p.end,
                name(p.lane),
            )));
        }
        // Forget what can no longer conflict with anything: an access the other lane is already
        // ordered after (same-lane accesses never conflict), and anything of this range or
        // inside it on this lane that a later conflicting access would conflict with here as
        // well.
        let after = self.after;
        let within = |p: &Access| p.start >= now.start && p.end <= now.end;
        self.seen.retain(|p| {
            let settled = after[index(other_lane(p.lane))][index(p.lane)] >= p.at;
            !(settled || (within(p) && p.lane == lane && (write || !p.write)))
        });
        if self.seen.len() >= KEEP {
            self.seen.drain(..KEEP / 2);
        }
        self.seen.push(now);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(addr: u64, len: u64) -> Region {
        Region { addr, len }
    }

    #[test]
    fn a_write_of_the_other_lane_needs_a_join_or_a_wait() {
        let mut c = LaneCheck::default();
        c.touch(Lane::Compute, r(0, 64), false, "decode").unwrap();
        let e = c
            .touch(Lane::Comm, r(32, 64), true, "all-gather")
            .unwrap_err();
        assert!(e.to_string().contains("all-gather writes"), "{e}");
        assert!(e.to_string().contains("decode reads"), "{e}");
        c.join(Lane::Comm, Lane::Compute);
        c.touch(Lane::Comm, r(32, 64), true, "all-gather").unwrap();
        // The compute lane reading what comm wrote needs an order too: here, a host wait.
        let at = c.now(Lane::Comm);
        assert!(c.touch(Lane::Compute, r(0, 40), false, "decode").is_err());
        c.reached(Lane::Comm, at);
        c.touch(Lane::Compute, r(0, 40), false, "decode").unwrap();
    }

    #[test]
    fn reads_of_both_lanes_and_disjoint_bytes_need_nothing() {
        let mut c = LaneCheck::default();
        c.touch(Lane::Compute, r(0, 64), false, "a").unwrap();
        c.touch(Lane::Comm, r(0, 64), false, "b").unwrap();
        c.touch(Lane::Comm, r(64, 64), true, "c").unwrap();
        c.touch(Lane::Compute, r(128, 8), true, "d").unwrap();
        // Ordering comm after compute does not order compute after comm.
        c.join(Lane::Comm, Lane::Compute);
        c.touch(Lane::Compute, r(0, 8), true, "e").unwrap_err();
    }

    #[test]
    fn forgetting_redundant_accesses_keeps_every_conflict() {
        let mut c = LaneCheck::default();
        c.touch(Lane::Comm, r(0, 16), true, "recv").unwrap();
        // A later read of the same lane over the range must not hide the write.
        c.touch(Lane::Comm, r(0, 64), false, "send").unwrap();
        assert!(c.touch(Lane::Compute, r(8, 4), false, "decode").is_err());
        c.join(Lane::Compute, Lane::Comm);
        // Compute's write covers (and is ordered after) both: comm must now be ordered after it.
        c.touch(Lane::Compute, r(0, 64), true, "stats").unwrap();
        assert!(c.touch(Lane::Comm, r(60, 4), false, "send").is_err());
    }
}
