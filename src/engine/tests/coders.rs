//! The engine's coders: frames of all-gather exchanges written with Rice codes decode to the bits
//! bit planes give, in fewer bytes; the reduce-scatter's frames stay bit planes; ranks that write
//! their codes differently are refused.

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

#[test]
fn the_reduce_scatter_keeps_bit_planes() {
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
