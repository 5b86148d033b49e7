//! The step check (`engine/step_check.rs`) of an engine whose calls hold the host (cfc.fsdp's):
//! after the trial, a plain step and a step of the trial's ways, timed whole; the slowest rank's
//! best times decide, alike on every rank; the state goes into checkpoints.

use super::*;
use crate::engine::options::FsdpOptions;
use crate::engine::{BucketState, StepCheckState};

const N: usize = 3 * 4096; // (rows of whole elements at 1, 2 and 3 ranks)
const KEYS: u64 = 2;

/// Options of cfc.fsdp's reduce-scatters with `fallback="auto"`: no warm-up, a trial of two
/// steps, the step check on.
fn checked_options() -> Options {
    let mut o = options(BoundRule::Rms(0.3));
    o.warmup_steps = 0;
    o.fallback = Fallback::Auto { trial_steps: 2 };
    o.fsdp = Some(FsdpOptions {
        residual_bits: 32,
        step_check: true,
    });
    o
}

/// A state at step 2, past the trial (which chose to compress every bucket): the step check
/// times steps 3 (every bucket plain) and 4 (the trial's ways), from the end of step 2.
fn after_the_trial() -> EngineState {
    EngineState {
        step: 2,
        origin: 0,
        buckets: (0..KEYS)
            .map(|key| BucketState {
                key,
                fingerprint: 1,
                numel: N as u64,
                stats: None,
                decision: Some(true),
                trial_plain: vec![2.0],
                trial_compressed: vec![1.0],
                exponents: None,
            })
            .collect(),
        levels: None,
        step_check: Some(StepCheckState {
            origin: Some(0),
            ..StepCheckState::default()
        }),
    }
}

/// Steps 2 to 5 on every rank from [`after_the_trial`]: see [`steps`].
fn run(world: usize, cost: impl Fn(usize, bool) -> u64 + Sync) -> Vec<(Vec<bool>, EngineState)> {
    steps(world, after_the_trial(), 4, cost)
}

/// `count` steps on every rank from `state`, as cfc.fsdp runs them: each step asks the engine
/// its ways first and sends the buckets to go plain itself (here: not at all), each other
/// bucket through the engine (a reduce-scatter, ordered); `cost(rank, all_plain)` is slept in
/// each step besides. Returns each rank's ways of the steps (every bucket plain?) and its state
/// at the end.
fn steps(
    world: usize,
    state: EngineState,
    count: usize,
    cost: impl Fn(usize, bool) -> u64 + Sync,
) -> Vec<(Vec<bool>, EngineState)> {
    let o = checked_options();
    ranks(world, &o, |rank, e| {
        e.load_state(state.clone()).unwrap();
        let first = state.step as usize;
        let mut residuals: Vec<Vec<f32>> = (0..KEYS).map(|_| vec![0.0f32; N]).collect();
        let mut ways = Vec::new();
        for step in first..first + count {
            let (all_plain, plain) = e.ways().unwrap();
            assert!(plain.is_empty(), "the trial chose to compress every bucket");
            ways.push(all_plain);
            if !all_plain {
                for (key, r) in residuals.iter_mut().enumerate() {
                    let mut x = grads(rank, step, N);
                    let mut shard = vec![0.0f32; N / world];
                    let j = scatter_job(key, &mut x, r, &mut shard);
                    // SAFETY: `x`, `shard` and the residual live until the order returns, when
                    // the CPU backend is done with them.
                    unsafe { e.submit(j, 0) }.unwrap();
                    e.order(0).unwrap();
                }
            }
            std::thread::sleep(Duration::from_millis(cost(rank, all_plain)));
            e.end_step(0).unwrap();
        }
        (ways, e.state().unwrap())
    })
}

#[test]
fn the_check_sends_every_bucket_plain_when_the_trials_ways_make_the_step_slower() {
    // the trial's ways cost 60 ms more on the last rank only: the slowest rank decides
    for world in [1, 2, 3] {
        let seen = run(world, |rank, all_plain| {
            if !all_plain && rank == world - 1 {
                60
            } else {
                0
            }
        });
        for (rank, (ways, state)) in seen.iter().enumerate() {
            // step 2: the trial's ways; 3: plain; 4: the trial's ways; 5: the verdict's
            assert_eq!(
                ways,
                &[false, true, false, true],
                "world {world}, rank {rank}"
            );
            let check = state.step_check.as_ref().unwrap();
            assert_eq!(check.verdict, Some(false), "world {world}, rank {rank}");
            assert_eq!((check.times[0].len(), check.times[1].len()), (1, 1));
            assert_eq!(state.step, 6);
        }
    }
}

#[test]
fn the_check_keeps_the_trials_ways_when_they_make_the_step_faster() {
    for world in [1, 2] {
        let seen = run(world, |_, all_plain| if all_plain { 60 } else { 0 });
        for (rank, (ways, state)) in seen.iter().enumerate() {
            assert_eq!(
                ways,
                &[false, true, false, false],
                "world {world}, rank {rank}"
            );
            let check = state.step_check.as_ref().unwrap();
            assert_eq!(check.verdict, Some(true));
            // (this rank's times: the plain step's, then the trial's ways')
            assert!(check.times[0][0] > check.times[1][0] + 0.03, "{check:?}");
        }
    }
}

#[test]
fn a_run_resumed_at_the_checks_plain_step_goes_on_with_the_check() {
    // Saved at the end of step 2: the resumed run's first step sends every bucket plain, so
    // its buckets are known only from the checkpoint when that step ends; the check goes on
    // (the plain step is not timed: no interval began in this run), and keeps the trial's ways.
    let mut state = after_the_trial();
    state.step = 3;
    for (rank, (ways, state)) in steps(2, state, 3, |_, _| 0).iter().enumerate() {
        assert_eq!(ways, &[true, false, false], "rank {rank}");
        let check = state.step_check.as_ref().unwrap();
        assert_eq!(check.verdict, Some(true), "rank {rank}: {check:?}");
        assert!(check.times[0].is_empty() && check.times[1].len() == 1);
    }
}

#[test]
fn engines_without_the_check_time_nothing_and_checkpoint_none() {
    let mut o = checked_options();
    for fsdp in [
        None,
        Some(FsdpOptions {
            residual_bits: 32,
            step_check: false,
        }),
    ] {
        o.fsdp = fsdp;
        let states = ranks(2, &o, |_, e| {
            e.load_state(after_the_trial()).unwrap();
            for _ in 0..4 {
                assert!(!e.ways().unwrap().0);
                e.end_step(0).unwrap();
            }
            e.state().unwrap()
        });
        assert!(states.iter().all(|s| s.step_check.is_none()));
    }
}
