//! Block scales in the engine (`Options::block`): every rank's frames share each block's step,
//! agreed from the largest rank's block RMS, so the results are the codec's own with those
//! scales, bit for bit; quiet blocks keep their precision; ranks that differ are refused.

use super::*;
use crate::feedback::compress_with_feedback_scaled;
use crate::scales::{block_exponents, BlockScales};

/// Gradient-like values whose scale drops by 10x every 700 elements, over 6 decades.
fn uneven(rank: usize, step: usize, n: usize) -> Vec<f32> {
    grads(rank, step, n)
        .into_iter()
        .enumerate()
        .map(|(i, v)| v * 10f32.powi(-(((i / 700) % 6) as i32)))
        .collect()
}

fn block_options(k: f64, block: u64, algorithm: Option<Algorithm>) -> Options {
    let mut o = options(BoundRule::Rms(k));
    o.block = block;
    o.algorithm = algorithm;
    o
}

/// A rank's result at every step, and its final residual.
type Seen = (Vec<Vec<f32>>, Vec<f32>);

/// `steps` all-reduces of `uneven` on every rank with residuals: each rank's results and final
/// residual, and rank 0's statistics.
fn run(nodes: &[usize], o: &Options, n: usize, steps: usize) -> (Vec<Seen>, Stats) {
    let out = on_nodes(nodes, o, |rank, e| {
        let mut r = vec![0.0f32; n];
        let mut seen = Vec::new();
        for step in 0..steps {
            let mut x = uneven(rank, step, n);
            // SAFETY: `x` and `r` live until the wait below returns.
            unsafe { e.submit(job(0, &mut x, Some(&mut r), true), 0) }.unwrap();
            e.wait(0).unwrap();
            seen.push(x);
        }
        ((seen, r), e.stats())
    });
    let stats = out[0].1.clone();
    (out.into_iter().map(|(s, _)| s).collect(), stats)
}

/// `steps` reduce-scatter jobs (FSDP's: `n` elements in, this rank's `n / world` out) of
/// `uneven` on every rank with residuals: each rank's shards, and its final residual.
fn run_scatter_jobs(world: usize, o: &Options, n: usize, steps: usize) -> Vec<Seen> {
    on_nodes(&vec![0; world], o, |rank, e| {
        let mut r = vec![0.0f32; n];
        let mut seen = Vec::new();
        for step in 0..steps {
            let mut x = uneven(rank, step, n);
            let mut shard = vec![0.0f32; n / world];
            let j = Job {
                op: Op::ReduceScatter {
                    out: tensor(&mut shard, DType::F32),
                },
                ..job(0, &mut x, Some(&mut r), true)
            };
            // SAFETY: `x`, `shard` and `r` live until the wait below returns.
            unsafe { e.submit(j, 0) }.unwrap();
            e.wait(0).unwrap();
            seen.push(shard);
        }
        (seen, r)
    })
}

/// How a job's frames split a bucket.
#[derive(Clone, Copy, PartialEq)]
enum Parts {
    /// One frame of the whole bucket per rank (all-gather).
    Whole,
    /// An all-reduce's shards (`rows::shards`), summed exactly.
    Shards,
    /// A reduce-scatter job's `world` equal rows, summed exactly (bit planes).
    Rows,
    /// A reduce-scatter job's rows as rice frames: decoded, added in f32 in rank order.
    RiceRows,
}

/// What the engine must give, from the codec alone: per part (the whole bucket, or each shard),
/// every rank's exponents of `x + r`, their largest, the scales from it (at the first step those
/// of the step itself, then those of the step before: they travel a step ahead), every rank's
/// frame with error feedback, and the frames decoded (all-gather: added in f32 in rank order) or
/// summed exactly (reduce-scatter), times 1/world.
fn reference(
    world: usize,
    n: usize,
    k: f64,
    log2: u8,
    steps: usize,
    split: Parts,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let l = (n / world) as u64;
    let parts = match split {
        Parts::Whole => vec![(0, n as u64)],
        Parts::Shards => rows::shards(n as u64, world),
        Parts::Rows | Parts::RiceRows => (0..world as u64).map(|j| (j * l, l)).collect(),
    };
    let mut residuals = vec![vec![0.0f32; n]; world];
    let mut before: Vec<Vec<u8>> = Vec::new();
    let mut results = Vec::new();
    for step in 0..steps {
        let xs: Vec<Vec<f32>> = (0..world).map(|r| uneven(r, step, n)).collect();
        let mut out = vec![0.0f32; n];
        let mut now = Vec::new();
        for (p, &(lo, len)) in parts.iter().enumerate() {
            let (lo, len) = (lo as usize, len as usize);
            let mut top = vec![0u8; len.div_ceil(1 << log2)];
            for rank in 0..world {
                let e = block_exponents(
                    &xs[rank][lo..lo + len],
                    Some(&residuals[rank][lo..lo + len]),
                    log2,
                );
                for (t, e) in top.iter_mut().zip(e) {
                    *t = (*t).max(e);
                }
            }
            let used = if step == 0 { &top } else { &before[p] };
            let (eps, s) = BlockScales::from_exponents(k, used, log2);
            now.push(top);
            let mut opts = CompressOptions::new(Bound::Abs(eps));
            if split == Parts::RiceRows {
                opts.coder = crate::Coder::Rice;
            }
            let frames: Vec<Vec<u8>> = (0..world)
                .map(|rank| {
                    let r = &mut residuals[rank][lo..lo + len];
                    compress_with_feedback_scaled(
                        &xs[rank][lo..lo + len],
                        r,
                        &[len],
                        &opts,
                        Some(&s),
                    )
                    .unwrap()
                })
                .collect();
            let scale = 1.0 / world as f32;
            if matches!(split, Parts::Shards | Parts::Rows) {
                let fs: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
                let (_, v) = decompress::<f32>(&crate::sum_frames(&fs, None).unwrap()).unwrap();
                for (o, v) in out[lo..lo + len].iter_mut().zip(v) {
                    *o = v * scale;
                }
            } else {
                let mut acc = vec![0.0f32; len];
                for (rank, f) in frames.iter().enumerate() {
                    let (_, v) = decompress::<f32>(f).unwrap();
                    for (a, v) in acc.iter_mut().zip(v) {
                        *a = if rank == 0 { v } else { *a + v };
                    }
                }
                for (o, a) in out[lo..lo + len].iter_mut().zip(acc) {
                    *o = a * scale;
                }
            }
        }
        results.push(out);
        before = now;
    }
    (results, residuals)
}

#[test]
fn block_scales_give_the_codecs_bits_on_every_rank() {
    let n = 9_000;
    for (world, algorithm, shards) in [
        (2, None, false),
        (3, Some(Algorithm::AllGather), false),
        (3, None, true),
        (4, Some(Algorithm::ReduceScatter), true),
    ] {
        for (k, block) in [(0.3, 256u64), (0.05, 32), (0.1, 4096)] {
            let o = block_options(k, block, algorithm);
            let (seen, _) = run(&vec![0; world], &o, n, 3);
            let log2 = block.trailing_zeros() as u8;
            let split = if shards { Parts::Shards } else { Parts::Whole };
            let (want, residuals) = reference(world, n, k, log2, 3, split);
            for (rank, (results, r)) in seen.iter().enumerate() {
                assert!(
                    results == &want,
                    "{world} ranks, shards {shards}, k {k}, block {block}: rank {rank}"
                );
                assert!(r == &residuals[rank], "residual of rank {rank}");
            }
        }
    }
}

/// Reduce-scatter jobs (FSDP's) agree their scales a step ahead too: every row carries its
/// sender's exponents of every shard, so every rank holds every shard's largest for the next
/// step. Their bits are the codec's with scales one step late (the reference), which a round
/// per job (scales of the job's own step) would not give; with rice frames, those of the rice
/// frames decoded and added in f32 (the residuals are the same whichever the coder).
#[test]
fn reduce_scatter_jobs_carry_every_shards_exponents_a_step_ahead() {
    let n = 9_000;
    for world in [2, 3] {
        for (k, block, rice) in [
            (0.3, 256u64, false),
            (0.1, 32, false),
            (0.3, 256, true),
            (0.1, 4096, true),
        ] {
            let mut o = block_options(k, block, None);
            if rice {
                o.coder = crate::Coder::Rice;
            }
            let seen = run_scatter_jobs(world, &o, n, 3);
            let log2 = block.trailing_zeros() as u8;
            let split = if rice { Parts::RiceRows } else { Parts::Rows };
            let (want, residuals) = reference(world, n, k, log2, 3, split);
            let l = n / world;
            for (rank, (shards, r)) in seen.iter().enumerate() {
                for (step, shard) in shards.iter().enumerate() {
                    assert!(
                        shard[..] == want[step][rank * l..(rank + 1) * l],
                        "{world} ranks, k {k}, block {block}, rice {rice}: rank {rank}, step {step}"
                    );
                }
                assert!(r == &residuals[rank], "residual of rank {rank}");
            }
        }
    }
}

#[test]
fn quiet_blocks_keep_their_precision() {
    let n = 4_200;
    let k = 0.3;
    let exact: Vec<f64> = (0..n)
        .map(|i| (uneven(0, 0, n)[i] as f64 + uneven(1, 0, n)[i] as f64) / 2.0)
        .collect();
    let (with, _) = run(&[0, 0], &block_options(k, 256, None), n, 1);
    let (without, _) = run(&[0, 0], &options(BoundRule::Rms(k)), n, 1);
    let quiet = 5 * 700..6 * 700; // values 1e5 times smaller than the first 700
    assert!(without[0].0[0][quiet.clone()].iter().all(|&v| v == 0.0));
    // With block scales every block is within k times its largest rank's RMS.
    for (b, chunk) in with[0].0[0].chunks(256).enumerate() {
        let lo = b * 256;
        let rms = |rank: usize| {
            let x = &uneven(rank, 0, n)[lo..lo + chunk.len()];
            (x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64).sqrt()
        };
        let bound = k * rms(0).max(rms(1));
        for (i, &v) in chunk.iter().enumerate() {
            let err = (v as f64 - exact[lo + i]).abs();
            assert!(
                err <= bound * (1.0 + 1e-6),
                "element {}: {err} > {bound}",
                lo + i
            );
        }
    }
    assert!(with[0].0[0][quiet].iter().any(|&v| v != 0.0));
}

#[test]
fn two_levels_agree_the_scales_of_the_nodes_sums_along_each_rail() {
    let n = 6_000;
    let k = 0.2;
    let (seen, stats) = run(&[0, 0, 1, 1], &block_options(k, 128, None), n, 2);
    assert!(stats.compressed > 0 && stats.between_nodes > 0);
    // Every rank ends with the same bits; each element is within the nodes' bounds: per node,
    // k times the block's RMS of that node's sum (the largest node's), over 4 ranks. Blocks
    // count from the start of each rank's shard of the node's sum (n / 2 elements each).
    for s in &seen[1..] {
        assert!(s.0 == seen[0].0);
    }
    let step = 0;
    let x: Vec<Vec<f32>> = (0..4).map(|r| uneven(r, step, n)).collect();
    let node_sum = |node: usize, i: usize| x[2 * node][i] as f64 + x[2 * node + 1][i] as f64;
    let shards = seen[0].0[step].chunks(n / 2).enumerate();
    let blocks = shards.flat_map(|(s, shard)| {
        shard
            .chunks(128)
            .enumerate()
            .map(move |(b, chunk)| (s * (n / 2) + b * 128, chunk))
    });
    for (lo, chunk) in blocks {
        let rms = |node: usize| {
            let s: f64 = (lo..lo + chunk.len())
                .map(|i| node_sum(node, i).powi(2))
                .sum();
            (s / chunk.len() as f64).sqrt()
        };
        let bound = 2.0 * k * rms(0).max(rms(1)) / 4.0;
        for (i, &v) in chunk.iter().enumerate() {
            let exact = (node_sum(0, lo + i) + node_sum(1, lo + i)) / 4.0;
            let err = (v as f64 - exact).abs();
            assert!(
                err <= bound * (1.0 + 1e-5) + 1e-12,
                "element {}: {err} > {bound}",
                lo + i
            );
        }
    }
}

#[test]
fn the_round_is_counted_and_ranks_with_other_blocks_are_refused() {
    let n = 20_000;
    let (_, with) = run(&[0, 0], &block_options(0.3, 256, None), n, 1);
    let (_, without) = run(&[0, 0], &options(BoundRule::Rms(0.3)), n, 1);
    // (the round: a check word and a byte per block, padded)
    let round = 16 + crate::engine::rows::round16(n.div_ceil(256) as u64);
    assert!(with.bytes_sent >= round, "{} bytes", with.bytes_sent);
    assert_ne!(with.bytes_sent, without.bytes_sent);

    let o = block_options(0.3, 256, None);
    let mut other = o.clone();
    other.block = 512;
    every_rank_fails(
        vec![(o, vec![]), (other, vec![])],
        &["block 256", "block 512"],
    );
}

#[test]
fn block_scales_take_an_rms_bound() {
    let mut o = options(BoundRule::Abs(1e-3));
    o.block = 256;
    assert!(Engine::local_nodes(&[0, 0], o).is_err());
}
