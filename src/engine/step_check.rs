//! The step check of `Fallback::Auto` for callers whose calls hold the host (`cfc.fsdp`: an
//! FSDP call returns only once its exchange is done, [`crate::engine::Engine::order`]): whole
//! steps timed with the ways the buckets' trial chose and with every bucket plain, and every
//! bucket plain unless the trial's ways are faster.
//!
//! Why: the trial times each bucket's exchange alone, which is what a DDP bucket costs (the
//! hook returns at once and the exchange overlaps the rest of the backward pass). A call that
//! holds the host also holds up the backward kernels queued after it, and a plain call (which
//! `cfc.fsdp` sends through torch's own reduce-scatter, without the engine) does not. Over a
//! fast link the trial could then choose compression for buckets whose exchange alone it made
//! faster while the step got slower. The check measures what the user pays: the step.
//!
//! How: after the trial, `trial_steps` more steps alternate between every bucket plain (even
//! steps of the check) and the trial's ways (odd ones). Each is timed from the end of the step
//! before to its own end, each end waited for on the host where the caller's stream reached it
//! (the mark of `Engine::end_step`, polled at most the timeout; in these steps only), so the
//! time covers forward, backward and optimizer. The statistic is the trial's: each way's best
//! time on each rank, the slowest rank's of each way compared, every rank taking the same
//! verdict from the same gathered times. A new trial (a bucket changed) starts a new check.

use crate::error::{Error, Result};

/// The check's state, as a checkpoint keeps it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepCheckState {
    /// The origin of the trial being checked (the engine's `origin` then), once a step of it
    /// ended.
    pub origin: Option<u64>,
    /// This rank's step times (seconds): `[0]` with every bucket plain, `[1]` with the trial's
    /// ways.
    pub times: [Vec<f64>; 2],
    /// `Some(true)`: the trial's ways stay; `Some(false)`: every bucket goes plain.
    pub verdict: Option<bool>,
}

impl StepCheckState {
    /// Whether every bucket goes plain in the step `ahead` (as in
    /// [`StepCheck::at_step_end`], read after it) of a check of `steps` steps: the check's
    /// plain steps, and every step after a verdict against the trial's ways.
    pub fn all_plain(&self, steps: u64, ahead: i64) -> bool {
        match self.verdict {
            Some(keep) => !keep,
            None => (0..steps as i64).contains(&ahead) && ahead % 2 == 0,
        }
    }
}

/// What the worker does at a step's end, as [`StepCheck::at_step_end`] says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Timing {
    /// Nothing: this step is not one the check times.
    None,
    /// Synchronise the device, read the clock, and give the reading to [`StepCheck::timed`].
    Time,
}

/// See the module docs. `steps` is the options' `trial_steps` (even, half of them each way).
#[derive(Debug, Clone, Default)]
pub(crate) struct StepCheck {
    pub state: StepCheckState,
    /// The clock at the end of the step before a check step.
    last: Option<f64>,
}

impl StepCheck {
    /// At a step's end, on every rank alike. `ahead`: the next step's index past the trial
    /// (negative during the warm-up and the trial: the engine's `step - origin - warmup_steps -
    /// trial_steps - 1`, its step counted past this end; the trial's choice is made at the
    /// first job of the step after it, so the check starts a step later); `origin`: the
    /// engine's; `any_compressed`: whether the trial chose compression for any bucket (if not,
    /// there is nothing to check).
    pub fn at_step_end(
        &mut self,
        steps: u64,
        ahead: i64,
        origin: u64,
        any_compressed: bool,
    ) -> Timing {
        if self.state.origin != Some(origin) {
            self.state = StepCheckState {
                origin: Some(origin),
                ..StepCheckState::default()
            };
            self.last = None;
        }
        if ahead >= 0 && self.state.verdict.is_none() && !any_compressed {
            self.state.verdict = Some(false); // (the trial chose plain for every bucket)
        }
        let ended = ahead - 1; // the step that just ended, counted from the check's first
        if self.state.verdict.is_none() && ahead >= 0 && ended < steps as i64 {
            Timing::Time
        } else {
            Timing::None
        }
    }

    /// The clock (`now`, seconds) at the end of a step [`StepCheck::at_step_end`] asked to
    /// time, with the same `steps` and `ahead`. Returns this rank's best time of each way
    /// (plain, the trial's; NaN where none) once the check's last step has ended: the caller
    /// gathers every rank's and gives them to [`StepCheck::decide`].
    pub fn timed(&mut self, steps: u64, ahead: i64, now: f64) -> Option<[f64; 2]> {
        let ended = ahead - 1;
        if ended >= 0 {
            if let Some(last) = self.last {
                self.state.times[(ended % 2 == 1) as usize].push(now - last);
            }
        }
        self.last = (ahead < steps as i64).then_some(now);
        (ended == steps as i64 - 1).then(|| self.state.times.clone().map(|t| best(&t)))
    }

    /// The verdict from every rank's best times (what [`StepCheck::timed`] gave on each):
    /// the trial's ways stay unless the slowest rank's time with them is not below the
    /// slowest rank's with every bucket plain. A way some rank has no time of (after a resume
    /// within the check) keeps the trial's ways.
    pub fn decide(&mut self, all: &[[f64; 2]]) -> bool {
        let slowest = |i: usize| all.iter().map(|t| t[i]).fold(f64::NEG_INFINITY, max_or_nan);
        let (plain, chosen) = (slowest(0), slowest(1));
        // (a NaN compares as nothing: no verdict against the trial's ways)
        use std::cmp::Ordering::{Equal, Greater};
        let keep = !matches!(chosen.partial_cmp(&plain), Some(Greater | Equal));
        self.state.verdict = Some(keep);
        tracing::info!(
            plain_ms = 1e3 * plain,
            chosen_ms = 1e3 * chosen,
            keep,
            "cfc step check: the slowest rank's best step with the trial's ways and with every \
             bucket plain"
        );
        keep
    }

    /// Replaces the state with a checkpoint's: the interval under way when it was saved is
    /// lost (the next check step is not timed).
    pub fn load(&mut self, state: StepCheckState) {
        self.state = state;
        self.last = None;
    }
}

/// A rank's best times as the gather of [`StepCheck::decide`]'s inputs carries them.
pub(crate) fn encode(mine: [f64; 2]) -> Vec<u8> {
    mine.iter().flat_map(|t| t.to_le_bytes()).collect()
}

/// Every rank's best times from the gathered bytes (what [`encode`] wrote on each).
///
/// # Errors
/// [`Error::RankMismatch`] for a rank that sent anything else.
pub(crate) fn decode(all: &[Vec<u8>]) -> Result<Vec<[f64; 2]>> {
    all.iter()
        .enumerate()
        .map(|(j, b)| match <[u8; 16]>::try_from(&b[..]) {
            Ok(b) => {
                let f = |i: usize| f64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
                Ok([f(0), f(8)])
            }
            Err(_) => Err(Error::RankMismatch {
                what: "this rank sent its step check's two times".into(),
                theirs: format!("rank {j} sent {} bytes", b.len()),
            }),
        })
        .collect()
}

/// The least of `t` (NaN when empty).
fn best(t: &[f64]) -> f64 {
    t.iter().copied().fold(f64::NAN, f64::min)
}

/// The larger of two, NaN if either is.
pub(crate) fn max_or_nan(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drives a check through steps: `ahead` from `first`, a clock advancing by each step's
    /// cost (`plain` in the check's plain steps, `chosen` otherwise); returns the ways of each
    /// step from the check's first (true: every bucket plain), the device synchronisations, and
    /// the best times given to the gather.
    fn run(
        check: &mut StepCheck,
        steps: u64,
        first: i64,
        count: i64,
        costs: (f64, f64),
        any_compressed: bool,
    ) -> (Vec<bool>, usize, Option<[f64; 2]>) {
        let (mut now, mut syncs, mut gathered, mut ways) = (0.0, 0, None, Vec::new());
        for ahead in first..first + count {
            // the step `ahead - 1` runs, then ends
            let plain = check.state.all_plain(steps, ahead - 1);
            if ahead > 0 {
                ways.push(plain);
            }
            now += if plain { costs.0 } else { costs.1 };
            if check.at_step_end(steps, ahead, 7, any_compressed) == Timing::Time {
                syncs += 1;
                if let Some(mine) = check.timed(steps, ahead, now) {
                    gathered = Some(mine);
                    check.decide(&[mine]);
                }
            }
        }
        (ways, syncs, gathered)
    }

    #[test]
    fn the_check_alternates_then_keeps_the_faster_way() {
        for (costs, keep) in [((1.0, 2.0), false), ((2.0, 1.0), true)] {
            let mut check = StepCheck::default();
            let (ways, syncs, gathered) = run(&mut check, 4, -3, 10, costs, true);
            // plain, trial's, plain, trial's, then the verdict's way
            let after = !keep;
            assert_eq!(
                ways,
                vec![true, false, true, false, after, after],
                "{costs:?}"
            );
            // the steps before the check's first and its 4 ends: 5 synchronisations
            assert_eq!(syncs, 5);
            assert_eq!(gathered, Some([costs.0, costs.1]));
            assert_eq!(check.state.verdict, Some(keep));
            assert_eq!(check.state.times, [vec![costs.0; 2], vec![costs.1; 2]]);
        }
    }

    #[test]
    fn the_slowest_rank_decides_with_the_best_times() {
        let mut check = StepCheck::default();
        // rank 1 is slower with the trial's ways: every bucket goes plain
        assert!(!check.decide(&[[1.0, 0.5], [1.0, 1.5]]));
        // equal: plain (compression must pay)
        assert!(!check.decide(&[[1.0, 1.0]]));
        // a rank without a time of one way: the trial's ways stay
        assert!(check.decide(&[[1.0, 2.0], [f64::NAN, 2.0]]));
        assert!(!check.state.all_plain(4, 9), "the trial's ways stay");
    }

    #[test]
    fn a_trial_that_chose_plain_everywhere_is_not_checked() {
        let mut check = StepCheck::default();
        let (ways, syncs, _) = run(&mut check, 4, -1, 4, (1.0, 1.0), false);
        assert_eq!(syncs, 0);
        assert_eq!(check.state.verdict, Some(false));
        assert!(ways.iter().skip(1).all(|&p| p));
    }

    #[test]
    fn times_cross_as_sixteen_bytes_and_anything_else_is_a_mismatch() {
        let all = vec![encode([1.5, f64::NAN]), encode([0.25, 2.0])];
        let got = decode(&all).unwrap();
        assert_eq!(got[1], [0.25, 2.0]);
        assert!(got[0][0] == 1.5 && got[0][1].is_nan());
        let e = decode(&[encode([1.0, 2.0]), vec![0; 8]])
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 1 sent 8 bytes"), "{e}");
    }

    #[test]
    fn a_new_trial_starts_a_new_check_and_a_loaded_one_goes_on() {
        let mut check = StepCheck::default();
        run(&mut check, 4, -3, 10, (1.0, 2.0), true);
        assert_eq!(check.state.verdict, Some(false));
        // another origin: the check starts over
        assert_eq!(check.at_step_end(4, -2, 8, true), Timing::None);
        assert_eq!(check.state.verdict, None);
        assert_eq!(check.state.origin, Some(8));
        // loaded mid-check: the times go on, the interval under way is not timed
        let saved = StepCheckState {
            origin: Some(8),
            times: [vec![3.0], vec![]],
            verdict: None,
        };
        check.load(saved.clone());
        assert_eq!(check.at_step_end(4, 2, 8, true), Timing::Time);
        assert_eq!(check.timed(4, 2, 100.0), None);
        assert_eq!(check.state.times, saved.times);
        assert_eq!(check.at_step_end(4, 3, 8, true), Timing::Time);
        assert_eq!(check.timed(4, 3, 101.0), None);
        assert_eq!(check.state.times, [vec![3.0, 1.0], vec![]]);
        assert_eq!(check.at_step_end(4, 4, 8, true), Timing::Time);
        assert_eq!(check.timed(4, 4, 103.0), Some([1.0, 2.0]));
    }
}
