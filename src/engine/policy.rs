//! What the engine keeps per bucket, and the policy that decides how each bucket goes: the
//! warm-up, the trial of `Fallback::Auto`, and the choice it leads to.
//!
//! Everything here is a function of the jobs submitted (their order, keys, fingerprints, sizes)
//! and of what every rank received alike (heads, trial times gathered from every rank), so every
//! rank takes the same decisions without talking about them.

use crate::engine::options::{Fallback, Options};
use crate::engine::rows::Slot;
use crate::engine::step_check::{StepCheck, StepCheckState};
use crate::format::DType;
use std::collections::HashMap;

/// What the engine keeps per bucket key.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Bucket {
    /// The job's fingerprint, element count, dtype and kind (0 all-reduce, 1 reduce-scatter):
    /// a job under the same key that differs in any starts the bucket afresh.
    pub identity: (u64, u64, DType, u8),
    /// Every rank's sum of squares and largest magnitude at the last exchange (the next
    /// step's bound), once measured.
    pub stats: Option<(f64, f64)>,
    /// The slot of each row of the bucket's all-gather (of frames, or of summed shards).
    pub slot: Slot,
    /// The slots of what this rank sends to each rank, and receives from each, in the
    /// exchange of shards.
    pub send_slots: Vec<Slot>,
    pub recv_slots: Vec<Slot>,
    /// The residual may hold what no exchange has sent yet.
    pub dirty: bool,
    /// The residual may hold values outside this rank's shard of a two-level exchange.
    pub spread: bool,
    /// Block scales: each block's largest exponent over the ranks at the last exchange (the
    /// next step's scales; see `block_scales.rs`), once known.
    pub exponents: Option<Vec<u8>>,
    /// The trial's times of each way (seconds, this rank's).
    pub trial_plain: Vec<f64>,
    pub trial_compressed: Vec<f64>,
    /// The trial's choice: compress?
    pub decision: Option<bool>,
}

impl Bucket {
    /// The frame bytes of the slots of the exchange of shards: what this rank sends to each
    /// rank, and receives from each.
    pub fn pair_slots(&self) -> (Vec<u64>, Vec<u64>) {
        let bytes = |s: &[Slot]| s.iter().map(|s| s.bytes).collect();
        (bytes(&self.send_slots), bytes(&self.recv_slots))
    }

    pub fn new(identity: (u64, u64, DType, u8), world: usize) -> Bucket {
        Bucket {
            identity,
            stats: None,
            slot: Slot::new(),
            send_slots: vec![Slot::new(); world],
            recv_slots: vec![Slot::new(); world],
            dirty: false,
            spread: true,
            exponents: None,
            trial_plain: Vec::new(),
            trial_compressed: Vec::new(),
            decision: None,
        }
    }
}

/// What a resumed run needs of a bucket to repeat the bits of the run it resumes: the
/// statistics its next bound comes from (and with block scales its blocks' exponents), and the
/// trial's times and choice.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketState {
    /// The job key.
    pub key: u64,
    /// The job's fingerprint.
    pub fingerprint: u64,
    /// Its element count.
    pub numel: u64,
    /// Every rank's sum of squares and largest magnitude at its last exchange.
    pub stats: Option<(f64, f64)>,
    /// The trial's choice (compress?), once made.
    pub decision: Option<bool>,
    /// This rank's trial times of the plain way (seconds).
    pub trial_plain: Vec<f64>,
    /// This rank's trial times of the compressed way (seconds).
    pub trial_compressed: Vec<f64>,
    /// Block scales: each block's largest exponent over the ranks at the last exchange (the
    /// next step's scales), once known.
    pub exponents: Option<Vec<u8>>,
}

/// An engine's state for a checkpoint (see [`crate::engine::Engine::state`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineState {
    /// Steps closed so far.
    pub step: u64,
    /// The step the warm-up and trial count from.
    pub origin: u64,
    /// Per bucket.
    pub buckets: Vec<BucketState>,
    /// The two-level exchange the statistics were taken in (nodes, ranks per node); `None`:
    /// flat. Loaded into another, the statistics are measured again (they are of other data:
    /// a node's sums of a shard, or whole buckets); the residuals carry over as they are.
    pub levels: Option<(u64, u64)>,
    /// The step check of the trial's ways (`engine/step_check.rs`), where the options ask for
    /// one.
    pub step_check: Option<StepCheckState>,
}

/// The next step's index past the trial, after `step` steps closed since `origin` (negative
/// during the warm-up and the trial; see `StepCheck::at_step_end`).
pub(crate) fn ahead(step: u64, origin: u64, o: &Options) -> i64 {
    step as i64 - origin as i64 - o.warmup_steps as i64 - o.trial_steps() as i64 - 1
}

/// Where a step stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Warmup,
    Trial,
    Run,
}

/// Steps and buckets; see the module docs.
#[derive(Debug)]
pub(crate) struct Policy {
    pub step: u64,
    pub origin: u64,
    pub buckets: HashMap<u64, Bucket>,
    /// Loaded states waiting for their bucket's first job (placed if its identity matches).
    pub loaded: HashMap<u64, BucketState>,
    /// A bucket changed in the run phase of a trial: the trial starts again at the next step.
    pub retrial: bool,
    /// The step check (used where the options ask for one).
    pub check: StepCheck,
}

impl Policy {
    pub fn new() -> Policy {
        Policy {
            step: 0,
            origin: 0,
            buckets: HashMap::new(),
            loaded: HashMap::new(),
            retrial: false,
            check: StepCheck::default(),
        }
    }

    pub fn phase(&self, o: &Options) -> Phase {
        let age = self.step.saturating_sub(self.origin);
        if age < o.warmup_steps as u64 {
            Phase::Warmup
        } else if age < o.warmup_steps as u64 + o.trial_steps() {
            Phase::Trial
        } else {
            Phase::Run
        }
    }

    /// The bucket of `key` for a job of `identity`, made (or made afresh) as needed.
    pub fn bucket(
        &mut self,
        key: u64,
        identity: (u64, u64, DType, u8),
        o: &Options,
        world: usize,
    ) -> &mut Bucket {
        let fresh = self
            .buckets
            .get(&key)
            .is_none_or(|b| b.identity != identity);
        if fresh {
            let mut b = Bucket::new(identity, world);
            if let Some(s) = self.loaded.remove(&key) {
                if (s.fingerprint, s.numel) == (identity.0, identity.1) {
                    b.stats = s.stats;
                    b.decision = s.decision;
                    b.trial_plain = s.trial_plain;
                    b.trial_compressed = s.trial_compressed;
                    b.exponents = s.exponents;
                }
            }
            // A bucket that changes once the trial has chosen has no choice of its own: the
            // trial runs again, for every bucket, from the next step.
            if matches!(o.fallback, Fallback::Auto { .. })
                && self.phase(o) == Phase::Run
                && b.decision.is_none()
                && identity.1 >= o.min_compress_numel
            {
                self.retrial = true;
            }
            self.buckets.insert(key, b);
        }
        self.buckets.get_mut(&key).expect("inserted above")
    }

    /// Whether a bucket of `numel` elements is compressed this step (None: as the trial chose,
    /// which may still have to be decided).
    pub fn compress(&self, o: &Options, numel: u64) -> Option<bool> {
        if numel < o.min_compress_numel || o.fallback == Fallback::Always {
            return Some(false);
        }
        match self.phase(o) {
            Phase::Warmup => Some(false),
            // plain first: the first compressed step also sizes the slots
            Phase::Trial => Some(
                (self
                    .step
                    .saturating_sub(self.origin + o.warmup_steps as u64))
                    % 2
                    == 1,
            ),
            Phase::Run if o.trial_steps() > 0 => None,
            Phase::Run => Some(true),
        }
    }

    /// Whether the trial's times are waiting to be decided.
    pub fn undecided(&self) -> bool {
        self.buckets.values().any(|b| {
            b.decision.is_none() && !(b.trial_plain.is_empty() && b.trial_compressed.is_empty())
        })
    }

    /// Whether the trial chose to compress any bucket (loaded ones not placed yet included:
    /// a resumed run whose buckets all went plain since has them only there).
    pub fn any_compressed(&self) -> bool {
        let placed = self.buckets.values().map(|b| b.decision);
        let loaded = self.loaded.values().map(|b| b.decision);
        placed.chain(loaded).any(|d| d == Some(true))
    }

    /// Keys with trial times, in order, and this rank's best time of each way (NaN: none).
    pub fn trial_times(&self) -> Vec<(u64, f64, f64)> {
        let best = |v: &Vec<f64>| v.iter().copied().fold(f64::NAN, f64::min);
        let mut t: Vec<(u64, f64, f64)> = self
            .buckets
            .iter()
            .filter(|(_, b)| {
                b.decision.is_none() && !(b.trial_plain.is_empty() && b.trial_compressed.is_empty())
            })
            .map(|(k, b)| (*k, best(&b.trial_plain), best(&b.trial_compressed)))
            .collect();
        t.sort_by_key(|e| e.0);
        t
    }

    /// At the close of a step.
    pub fn end_step(&mut self, o: &Options) {
        self.step += 1;
        if self.retrial {
            self.retrial = false;
            self.origin = self.step.saturating_sub(o.warmup_steps as u64);
            for b in self.buckets.values_mut() {
                b.decision = None;
                b.trial_plain.clear();
                b.trial_compressed.clear();
            }
        }
    }

    /// Everything kept per bucket, and the step check, for a checkpoint (`o`: whether the
    /// options run a step check).
    pub fn state(&self, o: &Options) -> EngineState {
        let mut buckets: Vec<BucketState> = self
            .buckets
            .iter()
            .map(|(k, b)| BucketState {
                key: *k,
                fingerprint: b.identity.0,
                numel: b.identity.1,
                stats: b.stats,
                decision: b.decision,
                trial_plain: b.trial_plain.clone(),
                trial_compressed: b.trial_compressed.clone(),
                exponents: b.exponents.clone(),
            })
            .collect();
        // Loaded states not placed yet are still this run's.
        buckets.extend(self.loaded.values().cloned());
        buckets.sort_by_key(|b| b.key);
        EngineState {
            step: self.step,
            origin: self.origin,
            buckets,
            levels: None,
            step_check: o.checks_steps().then(|| self.check.state.clone()),
        }
    }

    /// The next step's ways (see `Engine::ways`): whether every bucket goes plain (the step
    /// check's plain steps, and every step after its verdict against the trial's ways), and the
    /// keys the trial chose plain (loaded buckets not placed yet included), read in place.
    pub fn ways(&self, o: &Options) -> (bool, Vec<u64>) {
        let all_plain = o.checks_steps()
            && self.check.state.origin == Some(self.origin)
            && self
                .check
                .state
                .all_plain(o.trial_steps(), ahead(self.step, self.origin, o));
        let mut plain: Vec<u64> = self
            .buckets
            .iter()
            .filter(|(_, b)| b.decision == Some(false))
            .map(|(k, _)| *k)
            .chain(
                self.loaded
                    .values()
                    .filter(|b| b.decision == Some(false))
                    .map(|b| b.key),
            )
            .collect();
        plain.sort_unstable();
        (all_plain, plain)
    }

    /// Replaces everything with `state` (each bucket placed at its first job).
    pub fn load(&mut self, state: EngineState) {
        self.step = state.step;
        self.origin = state.origin;
        self.buckets.clear();
        self.retrial = false;
        self.check.load(state.step_check.unwrap_or_default());
        self.loaded = state.buckets.into_iter().map(|b| (b.key, b)).collect();
    }

    /// Forgets every bucket: the warm-up and the trial start again from this step.
    pub fn reset(&mut self) {
        self.buckets.clear();
        self.loaded.clear();
        self.retrial = false;
        self.origin = self.step;
    }
}

/// The trial's choice for each bucket from every rank's times (`all[rank]` is what
/// [`Policy::trial_times`] gave there): compress where the slowest rank's best compressed time
/// beat its best plain time, and where a way was never timed, compress.
pub(crate) fn decide(all: &[Vec<(u64, f64, f64)>]) -> Vec<(u64, bool)> {
    let Some(first) = all.first() else {
        return Vec::new();
    };
    first
        .iter()
        .enumerate()
        .map(|(i, &(key, _, _))| {
            let slowest = |pick: fn(&(u64, f64, f64)) -> f64| {
                all.iter().map(|t| t.get(i).map_or(f64::NAN, pick)).fold(
                    f64::NEG_INFINITY,
                    |a, b| {
                        if b.is_nan() || a.is_nan() {
                            f64::NAN
                        } else {
                            a.max(b)
                        }
                    },
                )
            };
            let plain = slowest(|e| e.1);
            let compressed = slowest(|e| e.2);
            let compress = plain.is_nan() || compressed.is_nan() || compressed < plain;
            (key, compress)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::options::BoundRule;

    #[test]
    fn phases_follow_the_steps() {
        let mut o = Options::new(BoundRule::Rms(0.3));
        o.warmup_steps = 1;
        o.fallback = Fallback::Auto { trial_steps: 2 };
        let mut p = Policy::new();
        let plan: Vec<_> = (0..5)
            .map(|_| {
                let c = p.compress(&o, 1 << 20);
                p.end_step(&o);
                c
            })
            .collect();
        assert_eq!(plan, [Some(false), Some(false), Some(true), None, None]);
        assert_eq!(p.compress(&o, 10), Some(false)); // below min_compress_numel
    }

    #[test]
    fn the_slowest_rank_decides() {
        let a = vec![(1, 1.0, 2.0), (2, 3.0, 1.0)];
        let b = vec![(1, 1.0, 0.5), (2, 3.0, 4.0)];
        assert_eq!(decide(&[a.clone(), b]), vec![(1, false), (2, false)]);
        assert_eq!(decide(&[a.clone(), a]), vec![(1, false), (2, true)]);
        assert_eq!(decide(&[vec![(3, f64::NAN, 1.0)]]), vec![(3, true)]);
    }

    #[test]
    fn a_bucket_that_changes_after_the_choice_restarts_the_trial() {
        let mut o = Options::new(BoundRule::Rms(0.3));
        o.fallback = Fallback::Auto { trial_steps: 2 };
        let mut p = Policy::new();
        p.bucket(0, (1, 1 << 20, DType::F32, 0), &o, 2).decision = Some(false);
        p.step = 5;
        p.bucket(0, (1, 1 << 20, DType::F32, 0), &o, 2);
        assert!(!p.retrial);
        p.bucket(0, (2, 1 << 20, DType::F32, 0), &o, 2);
        assert!(p.retrial);
        p.end_step(&o);
        assert_eq!(p.phase(&o), Phase::Trial);
    }
}
