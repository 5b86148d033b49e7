//! What `Stats::frame_bytes` and `Stats::outgrown_bytes` count: the frames themselves, once per
//! peer they went to, and the slots their frames outgrew (those frames went again); both parts
//! of `bytes_sent`.

use super::*;

/// Each step's change of (bytes sent, frame bytes, outgrown bytes, resends) on every rank, over
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
                        a.outgrown_bytes - b.outgrown_bytes,
                        a.resends - b.resends,
                    )
                })
                .collect()
        })
        .collect()
}

#[test]
fn frame_and_outgrown_bytes_are_parts_of_the_bytes_sent() {
    let n = 50_000;
    for world in [2, 3] {
        for algorithm in [Algorithm::AllGather, Algorithm::ReduceScatter] {
            let mut o = options(BoundRule::Rms(0.3));
            o.algorithm = Some(algorithm);
            let out = per_step(world, &o, n);
            for (rank, steps) in out.iter().enumerate() {
                for (step, &(sent, frames, outgrown, resends)) in steps.iter().enumerate() {
                    let at = format!("{world} ranks, {algorithm:?}, rank {rank}, step {step}");
                    assert!(frames > 0 && frames + outgrown < sent, "{at}: {steps:?}");
                    assert_eq!(outgrown > 0, resends > 0, "{at}: {steps:?}");
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
