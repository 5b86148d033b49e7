//! What `Stats::frame_bytes` and `Stats::slack_bytes` count: the frames themselves, once per
//! peer they went to, and the slot bytes frames did not fill (with tails' padding); both parts
//! of `bytes_sent`, whose rest is the rows' heads.

use super::*;
use crate::engine::rows::{Slot, HEAD};

/// Each step's change of (bytes sent, frame bytes, slack bytes, resends) on every rank, over
/// [`growing_steps`] (its third step's frames outgrow their slots).
fn per_step(world: usize, o: &Options, n: usize) -> Vec<Vec<(u64, u64, u64, u64)>> {
    growing_steps(world, o, n)
        .into_iter()
        .map(|steps| {
            steps
                .iter()
                .map(|(b, a)| {
                    (
                        a.bytes_sent - b.bytes_sent,
                        a.frame_bytes - b.frame_bytes,
                        a.slack_bytes - b.slack_bytes,
                        a.resends - b.resends,
                    )
                })
                .collect()
        })
        .collect()
}

/// Past the first step (whose bound is agreed in a round of its own), a step sends its frames,
/// their slack and one head per row and peer, nothing more: a frame that outgrew its slot sends
/// only its tail again (sending it whole would send its head and its slot's bytes twice).
#[test]
fn a_step_sends_frames_slack_and_one_head_per_row() {
    let n = 50_000;
    for world in [2, 3] {
        for algorithm in [Algorithm::AllGather, Algorithm::ReduceScatter] {
            let mut o = options(BoundRule::Rms(0.3));
            o.algorithm = Some(algorithm);
            let out = per_step(world, &o, n);
            // rows with heads: one per peer, and for a reduce-scatter the sums' rows too
            let rounds = match algorithm {
                Algorithm::AllGather => 1,
                Algorithm::ReduceScatter => 2,
            };
            let heads = rounds * (world as u64 - 1) * HEAD;
            for (rank, steps) in out.iter().enumerate() {
                for (step, &(sent, frames, slack, _)) in steps.iter().enumerate().skip(1) {
                    let at = format!("{world} ranks, {algorithm:?}, rank {rank}, step {step}");
                    assert!(frames > 0, "{at}: {steps:?}");
                    assert_eq!(sent, frames + slack + heads, "{at}: {steps:?}");
                }
            }
            // (the premise: step 2's frames outgrew their slots somewhere)
            assert!(out.iter().any(|s| s[2].3 > 0), "{out:?}");
        }
    }
}

/// With a fixed bound, an all-gather of 2 ranks sends each step this rank's frame, exactly as
/// the codec writes it with error feedback, to its one peer.
#[test]
fn frame_bytes_are_the_codecs_frames() {
    let n = 50_000;
    let eps = 2e-4;
    let mut o = options(BoundRule::Abs(eps));
    o.algorithm = Some(Algorithm::AllGather);
    let out = per_step(2, &o, n);
    for (rank, steps) in out.iter().enumerate() {
        let mut r = vec![0.0f32; n];
        for (step, &(_, frames, _, _)) in steps.iter().enumerate() {
            let x = growing(rank, step, n);
            let frame =
                compress_with_feedback(&x, &mut r, &[n], &CompressOptions::new(Bound::Abs(eps)))
                    .unwrap();
            assert_eq!(frames, frame.len() as u64, "rank {rank}, step {step}");
        }
    }
}

/// An all-gather's slot is sized from the largest frame of the step before ([`Slot`]); a frame
/// that fits leaves the rest of it as slack, sent to each peer.
#[test]
fn slack_is_what_frames_leave_of_their_slot() {
    let n = 50_000;
    let mut o = options(BoundRule::Abs(2e-4));
    o.algorithm = Some(Algorithm::AllGather);
    let out = per_step(2, &o, n);
    // (with 2 ranks, each rank's frame bytes are its frame's size: it has one peer)
    let largest = out.iter().map(|s| s[0].1).max().unwrap();
    let cap = crate::engine::backend::cpu::frame_capacity(n as u64, DType::F32);
    for (rank, steps) in out.iter().enumerate() {
        let (_, frames, slack, resends) = steps[1];
        assert_eq!(resends, 0, "rank {rank}: {steps:?}");
        let mut slot = Slot::new();
        slot.follow(largest, cap);
        assert_eq!(slack, slot.bytes - frames, "rank {rank}: {steps:?}");
    }
}
