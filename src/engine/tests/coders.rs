//! The engine's coders: frames of all-gather exchanges written with Rice codes decode to the bits
//! bit planes give, in fewer bytes; so do reduce-scatter jobs' (FSDP's) frames, decoded where they
//! arrive; an all-reduce's shards, summed on the way, stay bit planes; ranks that write their
//! codes differently are refused.

use super::*;
use crate::Coder;

/// Each step's result and residual, on each rank.
type Seen = Vec<Vec<(Vec<f32>, Vec<f32>)>>;

/// Three steps of an all-reduce with residuals on every rank (`nodes[r]`: rank r's node); what
/// each rank saw, and rank 0's statistics.
fn steps(nodes: &[usize], o: &Options, n: usize) -> (Seen, Stats) {
    let out = on_nodes(nodes, o, |rank, e| {
        let mut r = vec![0.0f32; n];
        let mut seen = Vec::new();
        for step in 0..3 {
            let mut x = grads(rank, step, n);
            // SAFETY: `x` and `r` live until the wait below returns.
            unsafe { e.submit(job(0, &mut x, Some(&mut r), true), 0) }.unwrap();
            e.wait(0).unwrap();
            seen.push((x, r.clone()));
        }
        (seen, e.stats())
    });
    let stats = out[0].1.clone();
    (out.into_iter().map(|(s, _)| s).collect(), stats)
}

#[test]
fn rice_frames_give_the_bits_of_bit_planes_in_fewer_bytes() {
    let n = 50_000;
    for (nodes, algorithm) in [
        (vec![0, 0], None),
        (vec![0, 0, 0], Some(Algorithm::AllGather)),
        (vec![0, 0, 1, 1], None), // two levels: the rail's all-gather between 2 nodes
    ] {
        let mut o = options(BoundRule::Rms(0.3));
        o.algorithm = algorithm;
        let (planes, sp) = steps(&nodes, &o, n);
        o.coder = Coder::Rice;
        let (rice, sr) = steps(&nodes, &o, n);
        assert_eq!(planes, rice, "{nodes:?} {algorithm:?}");
        // (between nodes where there are two: inside them the bytes go plain)
        let two_nodes = nodes.iter().any(|&m| m != nodes[0]);
        let sent = |s: &Stats| {
            if two_nodes {
                s.between_nodes
            } else {
                s.bytes_sent
            }
        };
        assert!(
            (sent(&sr) as f64) < 0.95 * sent(&sp) as f64,
            "{nodes:?}: rice {} bytes, planes {}",
            sent(&sr),
            sent(&sp)
        );
        assert_eq!(sr.compressed, sp.compressed);
    }
}

/// Reduce-scatter jobs with rice frames send fewer bytes than with bit planes; each rank's
/// residuals are the same bits (the same codes), and its shard the same average to within f32
/// rounding (rice frames are decoded and added in f32, bit planes' codes summed exactly).
#[test]
fn reduce_scatter_jobs_send_rice_frames() {
    let (n, world) = (60_000, 3);
    let run = |coder: Coder| {
        let mut o = options(BoundRule::Rms(0.3));
        o.block = 256;
        o.coder = coder;
        ranks(world, &o, |rank, e| {
            let mut r = vec![0.0f32; n];
            let mut shard = vec![0.0f32; n / world];
            for step in 0..3 {
                let mut x = grads(rank, step, n);
                // SAFETY: `x`, `r` and `shard` live until the wait below returns.
                unsafe { e.submit(scatter_job(0, &mut x, &mut r, &mut shard), 0) }.unwrap();
                e.wait(0).unwrap();
            }
            (shard, r, e.stats())
        })
    };
    let (planes, rice) = (run(Coder::Planes), run(Coder::Rice));
    for (rank, (p, r)) in planes.iter().zip(&rice).enumerate() {
        assert_eq!(p.1, r.1, "rank {rank}: residuals");
        for (a, b) in p.0.iter().zip(&r.0) {
            assert!(
                (a - b).abs() <= 1e-6 * a.abs().max(1e-3),
                "rank {rank}: {a} and {b}"
            );
        }
        assert!(
            (r.2.bytes_sent as f64) < 0.9 * p.2.bytes_sent as f64,
            "rank {rank}: rice {} bytes, planes {}",
            r.2.bytes_sent,
            p.2.bytes_sent
        );
    }
}

#[test]
fn an_all_reduce_over_the_reduce_scatter_keeps_bit_planes() {
    let n = 50_000;
    let mut o = options(BoundRule::Rms(0.3));
    o.algorithm = Some(Algorithm::ReduceScatter);
    let (planes, sp) = steps(&[0, 0, 0], &o, n);
    o.coder = Coder::Rice;
    let (rice, sr) = steps(&[0, 0, 0], &o, n);
    assert_eq!(planes, rice);
    assert_eq!(sp.bytes_sent, sr.bytes_sent);
}

#[test]
fn ranks_with_different_coders_are_refused() {
    let o = options(BoundRule::Abs(1e-3));
    let mut rice = o.clone();
    rice.coder = Coder::Rice;
    every_rank_fails(
        vec![(o, vec![]), (rice, vec![])],
        &["coder rice", "coder planes"],
    );
}
