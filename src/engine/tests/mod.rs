//! The engine's state machine on the CPU backend, with ranks as threads: exchanges against a
//! reference computed with the codec directly, bounds, slots and resends, the warm-up and the
//! trial, checkpoints; failures injected on one rank at every point are in `failures.rs`.

use super::*;
use crate::codec::{decompress, Bound, CompressOptions};
use crate::engine::backend::cpu::CpuBackend;
use crate::engine::transport::host::HostTransport;
use crate::engine::transport::tcp::Shape;
use crate::feedback::compress_with_feedback;
use crate::format::DType;
use std::time::Duration;

/// Runs `f(rank, engine)` on a thread per rank of a local group of `world` engines.
fn ranks<R: Send>(world: usize, o: &Options, f: impl Fn(usize, &Engine) -> R + Sync) -> Vec<R> {
    on_nodes(&vec![0; world], o, f)
}

/// Runs `f(rank, engine)` on a thread per rank, rank `r` on node `nodes[r]`.
fn on_nodes<R: Send>(
    nodes: &[usize],
    o: &Options,
    f: impl Fn(usize, &Engine) -> R + Sync,
) -> Vec<R> {
    let engines = Engine::local_nodes(nodes, o.clone()).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = engines
            .iter()
            .enumerate()
            .map(|(r, e)| {
                let f = &f;
                s.spawn(move || f(r, e))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Starts one engine per rank with that rank's options and node map, and checks that every
/// rank's wait fails with a message holding each of `says`.
fn every_rank_fails(ranks: Vec<(Options, Vec<usize>)>, says: &[&str]) {
    let timeout = ranks
        .first()
        .map_or(Duration::from_secs(20), |r| r.0.timeout);
    let links = crate::engine::transport::local::LocalLinks::group(ranks.len(), timeout);
    let engines: Vec<Engine> = links
        .into_iter()
        .zip(ranks)
        .map(|(l, (o, nodes))| {
            Engine::start(CpuBackend::new(), HostTransport::new(l), o, 0, &nodes)
        })
        .collect::<Result<_>>()
        .unwrap();
    std::thread::scope(|s| {
        for e in &engines {
            s.spawn(move || {
                let err = e.wait(0).unwrap_err().to_string();
                assert!(says.iter().all(|w| err.contains(w)), "{err}");
            });
        }
    });
}

fn tensor<T>(v: &mut [T], dtype: DType) -> Tensor {
    Tensor {
        addr: v.as_mut_ptr() as u64,
        numel: v.len() as u64,
        dtype,
    }
}

/// Gradient-like values of a rank at a step.
fn grads(rank: usize, step: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let t = (i * 7919 + rank * 104_729 + step * 15_485_863) % 100_003;
            ((t as f32 / 100_003.0) - 0.5) * 1e-2 * (1.0 + (i % 13) as f32)
        })
        .collect()
}

fn job(key: u64, data: &mut [f32], r: Option<&mut [f32]>, last: bool) -> Job {
    Job {
        key,
        fingerprint: 1,
        data: tensor(data, DType::F32),
        residual: r.map(|r| tensor(r, DType::F32)),
        op: Op::AllReduce,
        scale: Scale::Average,
        last,
        fresh_residual: false,
    }
}

/// A reduce-scatter job (cfc.fsdp's call) of `x` into `shard`, with the residual `r`.
fn scatter_job(key: usize, x: &mut [f32], r: &mut [f32], shard: &mut [f32]) -> Job {
    Job {
        residual: Some(tensor(r, DType::F32)),
        op: Op::ReduceScatter {
            out: tensor(shard, DType::F32),
        },
        ..job(key as u64, x, None, false)
    }
}

fn options(bound: BoundRule) -> Options {
    let mut o = Options::new(bound);
    o.min_compress_numel = 1;
    o.timeout = Duration::from_secs(20);
    o
}

/// One all-reduce of every rank's `grads(rank, 0, n)`, with residuals; returns each rank's
/// result and residual.
fn one_step(world: usize, o: &Options, n: usize) -> Vec<(Vec<f32>, Vec<f32>)> {
    ranks(world, o, |rank, e| {
        let mut x = grads(rank, 0, n);
        let mut r = vec![0.0f32; n];
        // SAFETY: `x` and `r` live until the wait below returns.
        unsafe { e.submit(job(0, &mut x, Some(&mut r), true), 0) }.unwrap();
        e.wait(0).unwrap();
        (x, r)
    })
}

/// What the all-gather gives: every rank's frame (with error feedback) decoded, added in f32
/// in rank order, times 1/world.
fn gather_reference(world: usize, n: usize, eps: f64) -> Vec<f32> {
    let opts = CompressOptions::new(Bound::Abs(eps));
    let mut acc = vec![0.0f32; n];
    for rank in 0..world {
        let mut r = vec![0.0f32; n];
        let f = compress_with_feedback(&grads(rank, 0, n), &mut r, &[n], &opts).unwrap();
        let (_, v) = decompress::<f32>(&f).unwrap();
        for (a, v) in acc.iter_mut().zip(v) {
            *a = if rank == 0 { v } else { *a + v };
        }
    }
    let scale = 1.0 / world as f32;
    acc.iter().map(|a| a * scale).collect()
}

/// What the reduce-scatter gives: per shard, the exact sum of every rank's frame of it,
/// decoded, times 1/world.
fn scatter_reference(world: usize, n: usize, eps: f64) -> Vec<f32> {
    let opts = CompressOptions::new(Bound::Abs(eps));
    let mut out = Vec::new();
    for (lo, len) in rows::shards(n as u64, world) {
        let (lo, len) = (lo as usize, len as usize);
        let frames: Vec<Vec<u8>> = (0..world)
            .map(|rank| {
                let mut r = vec![0.0f32; len];
                compress_with_feedback(&grads(rank, 0, n)[lo..lo + len], &mut r, &[len], &opts)
                    .unwrap()
            })
            .collect();
        let parts: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
        let (_, v) = decompress::<f32>(&crate::sum_frames(&parts, None).unwrap()).unwrap();
        out.extend(v.iter().map(|v| v * (1.0 / world as f32)));
    }
    out
}

#[test]
fn both_exchanges_give_the_reference_bits_on_every_rank() {
    let n = 10_000;
    let eps = 1e-4;
    for world in [1, 2, 3, 4] {
        for algorithm in [Algorithm::AllGather, Algorithm::ReduceScatter] {
            let mut o = options(BoundRule::Abs(eps));
            o.algorithm = Some(algorithm);
            let got = one_step(world, &o, n);
            let want = match algorithm {
                Algorithm::AllGather => gather_reference(world, n, eps),
                Algorithm::ReduceScatter => scatter_reference(world, n, eps),
            };
            for (rank, (x, r)) in got.iter().enumerate() {
                assert_eq!(x, &want, "world {world}, {algorithm:?}, rank {rank}");
                // what this rank's rounding dropped is in its residual, within the bound
                assert!(r.iter().all(|e| e.abs() as f64 <= eps * 1.0001));
            }
            // and the average is within the bound of the exact average
            let exact: Vec<f64> = (0..n)
                .map(|i| (0..world).map(|k| grads(k, 0, n)[i] as f64).sum::<f64>() / world as f64)
                .collect();
            let worst = got[0]
                .0
                .iter()
                .zip(&exact)
                .map(|(a, b)| (*a as f64 - b).abs())
                .fold(0.0, f64::max);
            assert!(
                worst <= eps * 1.001 + 1e-6,
                "world {world} {algorithm:?}: {worst}"
            );
        }
    }
}

#[test]
fn half_precision_buckets_and_a_reduce_scatter_job() {
    use half::{bf16, f16};
    let world = 3;
    let o = options(BoundRule::Rms(0.1));
    let n = 3 * 4096;
    let out = ranks(world, &o, |rank, e| {
        let mut b: Vec<bf16> = grads(rank, 0, n)
            .iter()
            .map(|v| bf16::from_f32(*v))
            .collect();
        let mut h: Vec<f16> = grads(rank, 1, n)
            .iter()
            .map(|v| f16::from_f32(*v))
            .collect();
        let mut x = grads(rank, 2, n);
        let mut shard = vec![0.0f32; n / world];
        let mut r = vec![0.0f32; n];
        // SAFETY: everything lives until the wait.
        unsafe {
            e.submit(
                Job {
                    data: tensor(&mut b, DType::BF16),
                    ..job(0, &mut [], None, false)
                },
                0,
            )
            .unwrap();
            e.submit(
                Job {
                    key: 1,
                    data: tensor(&mut h, DType::F16),
                    ..job(1, &mut [], None, false)
                },
                0,
            )
            .unwrap();
            e.submit(
                Job {
                    key: 2,
                    residual: Some(tensor(&mut r, DType::F32)),
                    op: Op::ReduceScatter {
                        out: tensor(&mut shard, DType::F32),
                    },
                    scale: Scale::Sum,
                    ..job(2, &mut x, None, true)
                },
                0,
            )
            .unwrap();
        }
        e.wait(0).unwrap();
        let s = e.stats();
        (b, h, shard, s)
    });
    for (rank, (b, h, shard, s)) in out.iter().enumerate() {
        assert_eq!(b, &out[0].0, "rank {rank}");
        assert_eq!(h, &out[0].1, "rank {rank}");
        assert_eq!(s.compressed, 3);
        let eps = s.eps;
        // the reduce-scatter's shard is the sum of every rank's shard, within world * eps
        let l = n / world;
        for (i, v) in shard.iter().enumerate() {
            let exact: f64 = (0..world)
                .map(|k| grads(k, 2, n)[rank * l + i] as f64)
                .sum();
            assert!(
                (*v as f64 - exact).abs() <= world as f64 * eps * 1.001,
                "{i}"
            );
        }
        let exact_b: Vec<f64> = (0..n)
            .map(|i| {
                (0..world)
                    .map(|k| bf16::from_f32(grads(k, 0, n)[i]).to_f64())
                    .sum::<f64>()
                    / 3.0
            })
            .collect();
        for (v, x) in b.iter().zip(&exact_b) {
            // the bound, plus bf16's roundings of the sum and of the average
            assert!((v.to_f64() - x).abs() <= eps + 2.0 * x.abs() / 128.0 + 1e-9);
        }
    }
}

/// The gradients of [`growing_steps`]' step `step` on `rank`: `grads`, 4x larger at step 2.
fn growing(rank: usize, step: usize, n: usize) -> Vec<f32> {
    let k = if step == 2 { 4.0 } else { 1.0 };
    grads(rank, step, n).iter().map(|v| v * k).collect()
}

/// Each rank's statistics before and after each of 4 all-reduces with residuals of
/// [`growing`]: step 2's gradients are 4x larger, so its frames outgrow the slots sized at
/// step 1.
fn growing_steps(world: usize, o: &Options, n: usize) -> Vec<Vec<(Stats, Stats)>> {
    ranks(world, o, |rank, e| {
        let mut r = vec![0.0f32; n];
        (0..4)
            .map(|step| {
                let mut x = growing(rank, step, n);
                let before = e.stats();
                // SAFETY: as in `one_step`.
                unsafe { e.submit(job(0, &mut x, Some(&mut r), true), 0) }.unwrap();
                e.wait(0).unwrap();
                (before, e.stats())
            })
            .collect()
    })
}

#[test]
fn an_rms_bound_follows_the_previous_step_and_slots_grow_with_the_frames() {
    let o = options(BoundRule::Rms(0.3));
    let out: Vec<_> = growing_steps(2, &o, 50_000)
        .into_iter()
        .map(|steps| {
            let eps: Vec<f64> = steps.iter().map(|(_, a)| a.eps).collect();
            let sent: Vec<(u64, u64)> = steps
                .iter()
                .map(|(b, a)| (a.bytes_sent - b.bytes_sent, a.resends - b.resends))
                .collect();
            (eps, sent)
        })
        .collect();
    let (eps, sent) = &out[0];
    assert_eq!(out[0], out[1]);
    // the first step's bound came from its own RMS, the next from the step before: close
    assert!((eps[1] / eps[0] - 1.0).abs() < 0.2, "{eps:?}");
    // the first exchange sends the heads, then the frames; the second fits its slot
    assert_eq!(sent[0].1, 0);
    assert_eq!(sent[1].1, 0);
    // 4x larger values take more bits than the slot held: their tails went in a second round
    assert_eq!(sent[2].1, 1, "{sent:?}");
}

/// The reduce-scatter of codes when the last shard is much shorter than the others (an element
/// count that does not divide into the ranks): every rank's row of the sums' all-gather is one
/// slot, sized from the largest shard, so the short shard's rank must hold that much too, from
/// the second step on, when the slot comes from the step before.
#[test]
fn a_short_last_shard_takes_the_slot_of_the_largest() {
    let world = 4;
    let g = crate::format::GROUP;
    let n = 3 * 4 * g + 5; // shards of 4 groups, 4, 4 and 5 elements
    let mut o = options(BoundRule::Rms(0.3));
    o.algorithm = Some(Algorithm::ReduceScatter);
    let out = ranks(world, &o, |rank, e| {
        let mut r = vec![0.0f32; n];
        let mut x = Vec::new();
        for step in 0..3 {
            x = grads(rank, step, n);
            // SAFETY: `x` and `r` live until the wait below returns.
            unsafe { e.submit(job(0, &mut x, Some(&mut r), true), 0) }
                .map_err(|e| format!("step {step}: {e}"))?;
            e.wait(0).map_err(|e| format!("step {step}: {e}"))?;
        }
        Ok::<_, String>(x)
    });
    let out: Vec<Vec<f32>> = out
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.unwrap_or_else(|e| panic!("rank {rank}: {e}")))
        .collect();
    assert!(out.iter().all(|x| x == &out[0]));
}

/// A step of a large bucket, then a small one whose frames outgrow their slot: the small one's
/// resend reuses the large one's buffers, which the comm lane may write only after the compute
/// lane's decoding of the large one (on a GPU, two streams). The CPU backend's lane check
/// fails the step where that order is missing.
#[test]
fn a_resend_after_a_larger_bucket_waits_for_its_decoding() {
    let (big, small) = (60_000, 6_000);
    for world in [2, 3] {
        for algorithm in [Algorithm::AllGather, Algorithm::ReduceScatter] {
            let mut o = options(BoundRule::Rms(0.3));
            o.algorithm = Some(algorithm);
            let out = ranks(world, &o, |rank, e| {
                let (mut ra, mut rb) = (vec![0.0f32; big], vec![0.0f32; small]);
                let mut resends = 0;
                for step in 0..3 {
                    let mut a = grads(rank, step, big);
                    // the small bucket's values grow 8x at step 2: more bits than its slot held
                    let k = if step == 2 { 8.0 } else { 1.0 };
                    let mut b: Vec<f32> =
                        grads(rank + 7, step, small).iter().map(|v| v * k).collect();
                    // SAFETY: the tensors live until the wait below returns.
                    unsafe {
                        e.submit(job(0, &mut a, Some(&mut ra), false), 0)?;
                        e.submit(job(1, &mut b, Some(&mut rb), true), 0)?;
                    }
                    e.wait(0)?;
                    resends = e.stats().resends;
                    if step == 2 {
                        return Ok((a, b, resends));
                    }
                }
                unreachable!("{resends}")
            });
            let out: Vec<_> = out
                .into_iter()
                .map(|r: Result<_>| {
                    r.unwrap_or_else(|e| panic!("world {world}, {algorithm:?}: {e}"))
                })
                .collect();
            assert!(out[0].2 >= 1, "world {world}, {algorithm:?}: no resend");
            assert!(out.iter().all(|o| o.0 == out[0].0 && o.1 == out[0].1));
        }
    }
}

/// Steps that end after their jobs (FSDP2's way: each job waited for alone, the step ended
/// when the backward pass ends): a wait does not count a step, `end_step` does, and the
/// warm-up and the trial count those steps, alike on every rank.
#[test]
fn steps_ended_apart_from_their_jobs_drive_the_warmup_and_the_trial() {
    let mut o = options(BoundRule::Rms(0.3));
    o.warmup_steps = 1;
    o.fallback = Fallback::Auto { trial_steps: 2 };
    let n = 20_000;
    let out = ranks(2, &o, |rank, e| {
        let mut per_step = Vec::new();
        for step in 0..5 {
            let before = e.stats();
            for key in 0..3u64 {
                let mut x = grads(rank + key as usize, step, n);
                // SAFETY: `x` lives until the wait below returns.
                unsafe { e.submit(job(key, &mut x, None, false), 0) }.unwrap();
                e.wait(0).unwrap();
            }
            e.end_step(0).unwrap();
            let after = e.stats();
            per_step.push((
                after.plain - before.plain,
                after.compressed - before.compressed,
            ));
        }
        (per_step, e.state().unwrap())
    });
    let decisions = |s: &EngineState| s.buckets.iter().map(|b| b.decision).collect::<Vec<_>>();
    assert_eq!(out[0].0, out[1].0);
    assert_eq!(decisions(&out[0].1), decisions(&out[1].1));
    let (per_step, state) = &out[0];
    assert_eq!(
        per_step[0],
        (3, 0),
        "the warm-up step goes plain: {per_step:?}"
    );
    // the trial: each bucket one way in one step and the other way in the next
    assert_eq!(per_step[1].0 + per_step[2].0, 3, "{per_step:?}");
    assert_eq!(per_step[1].1 + per_step[2].1, 3, "{per_step:?}");
    assert_eq!(state.step, 5);
    assert!(
        state.buckets.iter().all(|b| b.decision.is_some()),
        "{state:?}"
    );
}

#[test]
fn the_warmup_and_the_trial_choose_alike_on_every_rank() {
    let world = 3;
    let n = 20_000;
    let mut o = options(BoundRule::Rms(0.3));
    o.warmup_steps = 1;
    o.fallback = Fallback::Auto { trial_steps: 2 };
    let out = ranks(world, &o, |rank, e| {
        let mut r0 = vec![0.0f32; n];
        let mut r1 = vec![0.0f32; 100];
        let mut plan = Vec::new();
        for step in 0..5 {
            let mut x = grads(rank, step, n);
            let mut small = grads(rank, step, 100);
            let before = e.stats();
            // SAFETY: as in `one_step`.
            unsafe {
                e.submit(job(0, &mut x, Some(&mut r0), false), 0).unwrap();
                e.submit(
                    Job {
                        key: 1,
                        ..job(1, &mut small, Some(&mut r1), true)
                    },
                    0,
                )
                .unwrap();
            }
            e.wait(0).unwrap();
            let after = e.stats();
            plan.push((
                after.compressed - before.compressed,
                after.plain - before.plain,
            ));
        }
        (plan, e.state().unwrap())
    });
    let (plan, state) = &out[0];
    // warm-up: plain; trial: plain, then compressed (the small bucket too: min_compress_numel 1)
    assert_eq!(plan[0], (0, 2));
    assert_eq!(plan[1], (0, 2));
    assert_eq!(plan[2], (2, 0));
    let decisions: Vec<_> = state.buckets.iter().map(|b| b.decision).collect();
    assert!(decisions.iter().all(|d| d.is_some()), "{decisions:?}");
    for (p, s) in &out {
        assert_eq!(p, plan);
        assert_eq!(
            s.buckets.iter().map(|b| b.decision).collect::<Vec<_>>(),
            decisions
        );
    }
    assert_eq!(state.step, 5);
}

#[test]
fn a_fallback_of_always_sends_the_exact_average() {
    let mut o = options(BoundRule::Abs(1e-3));
    o.fallback = Fallback::Always;
    let world = 3;
    let n = 1001;
    let out = ranks(world, &o, |rank, e| {
        let mut x = grads(rank, 0, n);
        let mut r: Vec<f32> = (0..n).map(|i| if i == 5 { 0.25 } else { 0.0 }).collect();
        let j = Job {
            fresh_residual: true,
            ..job(0, &mut x, Some(&mut r), true)
        };
        // SAFETY: as in `one_step`.
        unsafe { e.submit(j, 0) }.unwrap();
        e.wait(0).unwrap();
        (x, r, e.stats())
    });
    for (x, r, s) in &out {
        assert_eq!(s.plain, 1);
        assert!(r.iter().all(|v| *v == 0.0), "the residual went along");
        for (i, v) in x.iter().enumerate() {
            let want = (0..world)
                .map(|k| grads(k, 0, n)[i] + if i == 5 { 0.25 } else { 0.0 })
                .fold(0.0f32, |a, b| a + b)
                / 3.0;
            assert!((v - want).abs() <= 1e-6, "{i}");
        }
    }
}

#[test]
fn a_gather_gives_every_rank_every_ranks_bytes_and_ends_with_a_peers_failure() {
    let o = options(BoundRule::Rms(0.3));
    let world = 3;
    let out = ranks(world, &o, |rank, e| {
        let mine = vec![rank as u8; 8 + rank];
        let all = e.gather(&mine).unwrap();
        // Rank 2 fails before the second round; the others must not wait for it.
        if rank == 2 {
            e.fail("ValueError: raised before the gather");
            return (all, None);
        }
        let t0 = std::time::Instant::now();
        let second = e.gather(&mine);
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "waited for the timeout"
        );
        (all, Some(second.map(|_| ()).map_err(|e| e.to_string())))
    });
    for (rank, (all, second)) in out.iter().enumerate() {
        let want: Vec<Vec<u8>> = (0..world).map(|j| vec![j as u8; 8 + j]).collect();
        assert_eq!(all, &want, "rank {rank}");
        if let Some(second) = second {
            let e = second.as_ref().unwrap_err();
            assert!(
                e.contains("rank 2") && e.contains("raised before the gather"),
                "{e}"
            );
        }
    }
}

#[test]
fn a_resumed_run_repeats_the_bits_of_the_uninterrupted_one() {
    // (one step per bucket, and block scales, whose exponents travel a step ahead)
    for block in [0, 256] {
        resumed_run_repeats_the_bits(block);
    }
}

fn resumed_run_repeats_the_bits(block: u64) {
    let world = 2;
    let n = 20_000;
    let mut o = options(BoundRule::Rms(0.3));
    // (block scales: every step compressed, so that the scales at the resume matter)
    o.fallback = if block == 0 {
        Fallback::Auto { trial_steps: 2 }
    } else {
        Fallback::Never
    };
    o.block = block;
    let steps = |e: &Engine, rank: usize, r: &mut Vec<f32>, range: std::ops::Range<usize>| {
        let mut outs = Vec::new();
        for step in range {
            // (a scale that changes from step to step: each step's scales differ)
            let k = (1 << (step % 3)) as f32;
            let mut x: Vec<f32> = grads(rank, step, n).iter().map(|v| v * k).collect();
            // SAFETY: as in `one_step`.
            unsafe { e.submit(job(0, &mut x, Some(r), true), 0) }.unwrap();
            e.wait(0).unwrap();
            outs.push(x);
        }
        outs
    };
    // The checkpoint is taken from the uninterrupted run itself: the trial's choice comes from
    // measured times, which two runs need not share.
    let straight = ranks(world, &o, |rank, e| {
        let mut r = vec![0.0f32; n];
        steps(e, rank, &mut r, 0..3);
        let saved = (e.state().unwrap(), r.clone());
        (saved, steps(e, rank, &mut r, 3..6))
    });
    let resumed = ranks(world, &o, |rank, e| {
        let (state, r) = &straight[rank].0;
        e.load_state(state.clone()).unwrap();
        let mut r = r.clone();
        steps(e, rank, &mut r, 3..6)
    });
    for rank in 0..world {
        assert_eq!(
            straight[rank].1, resumed[rank],
            "block {block}, rank {rank}"
        );
    }
}

#[test]
fn a_checkpoint_whose_warmup_began_after_its_step_is_refused() {
    let o = options(BoundRule::Abs(1e-3));
    let engines = Engine::local_group(1, o).unwrap();
    let mut state = engines[0].state().unwrap();
    state.step = 3;
    state.origin = 5;
    let e = engines[0].load_state(state).unwrap_err().to_string();
    assert!(e.contains("past its step 3"), "{e}");
}

/// One all-reduce of every rank's `grads(rank, 0, n)`, with residuals, on `world` engines of
/// this process linked over TCP on loopback, rank `r` on node `nodes[r]` (empty: one node);
/// returns each rank's result and whether it ran two levels.
fn one_step_over_tcp(
    world: usize,
    nodes: &[usize],
    o: &Options,
    n: usize,
) -> Vec<(Vec<f32>, bool)> {
    let links = crate::engine::transport::tcp::tests::loopback(world, Shape::Mesh);
    std::thread::scope(|s| {
        let hs: Vec<_> = links
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                s.spawn(move || {
                    let e = Engine::on_cpu(l, o.clone(), 0, nodes).unwrap();
                    let mut x = grads(rank, 0, n);
                    let mut r = vec![0.0f32; n];
                    // SAFETY: `x` and `r` live until the wait below returns.
                    unsafe { e.submit(job(0, &mut x, Some(&mut r), true), 0) }.unwrap();
                    e.wait(0).unwrap();
                    let two_levels = e.levels().is_some();
                    e.close().unwrap();
                    (x, two_levels)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn processes_linked_over_tcp_run_the_same_exchange() {
    let n = 5000;
    let want = scatter_reference(3, n, 1e-4);
    for (x, _) in one_step_over_tcp(3, &[], &options(BoundRule::Abs(1e-4)), n) {
        assert_eq!(x, want);
    }
}

/// An engine dropped without `close` does not wait for its thread, which stops on its own and
/// is joined by `settle_dropped` (what a process about to exit calls).
#[test]
fn a_dropped_engine_stops_its_thread_and_settle_dropped_joins_it() {
    let o = options(BoundRule::Abs(1e-4));
    let engines = Engine::local_group(2, o).unwrap();
    let ids: Vec<_> = engines
        .iter()
        .map(|e| {
            let held = e.thread.lock().unwrap();
            held.as_ref().map(|h| h.thread().id()).unwrap()
        })
        .collect();
    let t0 = std::time::Instant::now();
    drop(engines);
    assert!(t0.elapsed() < Duration::from_secs(1), "a drop waited");
    let running = |ids: &[std::thread::ThreadId]| {
        DROPPED
            .lock()
            .unwrap()
            .iter()
            .filter(|h| ids.contains(&h.thread().id()))
            .count()
    };
    // (other tests drop engines at the same time: only these two are looked for)
    let t0 = std::time::Instant::now();
    while running(&ids) > 0 && t0.elapsed() < Duration::from_secs(30) {
        settle_dropped(Duration::from_millis(100));
    }
    assert_eq!(running(&ids), 0, "the threads of dropped engines still run");
}

mod accounting;
mod blocks;
mod coders;
mod failures;
mod levels;
mod orders;
mod step_checks;
