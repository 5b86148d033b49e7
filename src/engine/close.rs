//! A step's close on the comm thread (see `worker.rs`): the stages left run, the closing round
//! (every rank's decoding status, gathered) makes every rank succeed or fail together, the step
//! check runs where the options ask for it (`step_check.rs`), and the mark after the step's
//! last work is published for the caller's stream; and an order (`Engine::order`), which
//! publishes such a mark without closing the step.

use super::backend::{Backend, Lane};
use super::step_check::Timing;
use super::transport::Transport;
use super::worker::Worker;
use crate::error::{decode_status_error, Error, Result};
use std::time::Instant;

impl<B: Backend, T: Transport<B>> Worker<B, T> {
    /// Closes a step (`last`) or flushes one: the stages left, the closing round, the mark
    /// for the caller; publishes the outcome.
    pub(super) fn close(&mut self, last: bool) {
        if !self.open && !last {
            // Nothing since the last close, which published its outcome: this flush is done
            // (a failure raised since then belongs to a later step).
            self.shared.publish_again();
            return;
        }
        self.open = false;
        let mut done = None;
        if !self.failed {
            let t0 = Instant::now();
            let r = self
                .drain()
                .and_then(|()| self.closing_round())
                .and_then(|()| {
                    self.be.join(Lane::Compute, Lane::Comm)?;
                    let handed = std::mem::take(&mut self.step_tensors);
                    self.be.caller_touches(&handed)?;
                    self.be.done()
                });
            match r {
                Ok(d) => done = Some(d),
                Err(e) => self.fail_with(Some(e)),
            }
            self.shared.add_seconds(t0.elapsed().as_secs_f64());
        }
        self.step_tensors.clear();
        if last {
            self.policy.end_step(&self.o);
            if done.is_some() && self.o.checks_steps() {
                if let Err(e) = self.check_step() {
                    self.fail_with(Some(e));
                    done = None;
                }
            }
        }
        self.shared.publish(done.is_some(), done);
    }

    /// The step check at a step's end (see `step_check.rs`): in the steps it times, the
    /// caller's stream is waited for where its step ended (its work included) and the clock
    /// read; at its last, every rank's best times are gathered and every rank takes the same
    /// verdict.
    fn check_step(&mut self) -> Result<()> {
        let steps = self.o.trial_steps();
        let ahead = super::policy::ahead(self.policy.step, self.policy.origin, &self.o);
        let any_compressed = self.policy.any_compressed();
        let origin = self.policy.origin;
        let check = &mut self.policy.check;
        if check.at_step_end(steps, ahead, origin, any_compressed) == Timing::None {
            return Ok(());
        }
        self.wait_step_end()?;
        let now = self.epoch.elapsed().as_secs_f64();
        let Some(mine) = self.policy.check.timed(steps, ahead, now) else {
            return Ok(());
        };
        let all = self
            .tr
            .gather(&mut self.be, &super::step_check::encode(mine))?;
        self.policy.check.decide(&super::step_check::decode(&all)?);
        Ok(())
    }

    /// Waits on the host until the caller's stream has reached the step's end (the mark of
    /// [`Msg::EndStep`]; none: nothing to wait for), as the transport waits for its own marks:
    /// a failure on the board ends the wait, and so does the timeout.
    fn wait_step_end(&mut self) -> Result<()> {
        match self.step_end.take().and_then(|r| self.be.ready_mark(r)) {
            Some(mark) => self.tr.wait(&mut self.be, &mark),
            None => Ok(()),
        }
    }

    /// An order (see `Engine::order`): the stages left run, and the mark after the results
    /// is published for the caller's stream. The step stays open.
    pub(super) fn order(&mut self, at: u64) -> Result<()> {
        let t0 = Instant::now();
        self.drain()?;
        self.be.join(Lane::Compute, Lane::Comm)?;
        let handed = std::mem::take(&mut self.step_tensors);
        self.be.caller_touches(&handed)?;
        let done = self.be.done()?;
        self.shared.note_queued(at, done);
        self.shared.add_seconds(t0.elapsed().as_secs_f64());
        Ok(())
    }

    /// Every rank's decoding status: a frame that failed its check on one rank (each rank
    /// receives its own copy) fails every rank, and none keeps a step another did not.
    fn closing_round(&mut self) -> Result<()> {
        if !self.decoded {
            return Ok(());
        }
        self.decoded = false;
        let w = self.world as u64;
        let statuses = match self.statuses.take() {
            Some(b) => b,
            None => self.be.alloc(8 * w)?,
        };
        let all = crate::engine::backend::Memory::region(&statuses).sub(0, 8 * w)?;
        self.be.join(Lane::Comm, Lane::Compute)?;
        let status = self.be.status();
        self.tr.all_gather(&mut self.be, status, all)?;
        let seen = self.be.fetch(Lane::Comm, all, 8, 8, w)?;
        let max_error = self.be.fetch(Lane::Comm, self.be.max_error(), 8, 8, 1)?;
        let m = self.be.mark(Lane::Comm)?;
        self.tr.wait(&mut self.be, &m)?;
        let seen = self.be.fetched(seen);
        let max_error = self.be.fetched(max_error);
        self.statuses = Some(statuses);
        if let Ok(b) = <[u8; 8]>::try_from(&max_error[..]) {
            self.shared
                .set_max_error(f64::from_bits(u64::from_le_bytes(b)));
        }
        for (j, s) in seen.chunks_exact(8).enumerate() {
            let s = u64::from_le_bytes(s.try_into().unwrap_or([0; 8]));
            if let Some(why) = decode_status_error(s) {
                return Err(Error::PeerFailed {
                    rank: j,
                    reason: format!("rank {j} received a bad frame: {why}"),
                });
            }
        }
        Ok(())
    }
}
