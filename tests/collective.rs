//! The compressed all-reduce over the in-process transport, 1 to 8 ranks: results within the
//! documented bound of the exact sum, identical on every rank, and identical between the
//! reduce-scatter and all-gather variants; error feedback; ranks that disagree or stop answering
//! get errors, not hangs.

use cfc::collective::{allreduce, Algorithm, AllReduceOptions, InProcess, Transport};
use cfc::{Bound, Error};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use std::time::Duration;

/// Runs `f` on `world` threads, one per rank, and returns their results by rank.
fn run<R: Send>(world: usize, timeout: Duration, f: impl Fn(&mut InProcess) -> R + Sync) -> Vec<R> {
    let endpoints = InProcess::group(world, timeout);
    std::thread::scope(|s| {
        let handles: Vec<_> = endpoints
            .into_iter()
            .map(|mut t| {
                let f = &f;
                s.spawn(move || f(&mut t))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank panicked"))
            .collect()
    })
}

/// Rank `r`'s gradient-like data at step `step` (Laplace, scale 1e-3).
fn data(r: usize, step: usize, n: usize) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64((r * 1000 + step) as u64);
    (0..n)
        .map(|_| {
            let u: f64 = rng.gen_range(1e-12..1.0);
            let m = -u.ln() * 1e-3;
            (if rng.gen::<bool>() { m } else { -m }) as f32
        })
        .collect()
}

fn opts(bound: Bound, average: bool) -> AllReduceOptions {
    AllReduceOptions {
        bound,
        average,
        zstd_level: None,
        algorithm: None,
    }
}

const BOTH: [Algorithm; 2] = [Algorithm::ReduceScatter, Algorithm::AllGather];

#[test]
fn sum_and_average_are_within_the_bound_for_1_to_8_ranks() {
    let n = 10_007;
    for (world, algorithm) in (1..=8).flat_map(|w| BOTH.map(|a| (w, a))) {
        for (bound, average) in [
            (Bound::Abs(1e-4), false),
            (Bound::Abs(1e-4), true),
            (Bound::Rel(0.01), false),
        ] {
            let o = AllReduceOptions {
                algorithm: Some(algorithm),
                ..opts(bound, average)
            };
            let results = run(world, Duration::from_secs(20), |t| {
                let x = data(t.rank(), 0, n);
                allreduce(t, &x, None, &o).expect("allreduce")
            });
            let inputs: Vec<Vec<f32>> = (0..world).map(|r| data(r, 0, n)).collect();
            let exact: Vec<f64> = (0..n)
                .map(|i| inputs.iter().map(|x| x[i] as f64).sum::<f64>())
                .collect();
            let (first, report) = &results[0];
            for (other, _) in &results[1..] {
                assert!(
                    first
                        .iter()
                        .zip(other)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "ranks differ"
                );
            }
            let scale = if average { world as f64 } else { 1.0 };
            let worst = first
                .iter()
                .zip(&exact)
                .map(|(&y, &e)| {
                    let e = e / scale;
                    (y as f64 - e).abs() - f32::EPSILON as f64 * e.abs() // the final f32 rounding
                })
                .fold(0.0, f64::max);
            assert!(
                worst <= report.bound,
                "world {world} {algorithm:?} {bound:?} avg {average}: {worst} > {}",
                report.bound
            );
            assert_eq!(
                report.bound,
                if average {
                    report.eps
                } else {
                    report.eps * world as f64
                }
            );
        }
    }
}

#[test]
fn error_feedback_makes_the_running_sum_converge() {
    let (n, world, steps, eps) = (4096, 4, 40, 2e-4);
    let drift = |feedback: bool| {
        let results = run(world, Duration::from_secs(20), |t| {
            let mut residual = vec![0f32; n];
            let mut sum = vec![0f64; n];
            for step in 0..steps {
                let x = data(t.rank(), step, n);
                let r = feedback.then_some(residual.as_mut_slice());
                let (y, _) = allreduce(t, &x, r, &opts(Bound::Abs(eps), false)).expect("allreduce");
                for (s, v) in sum.iter_mut().zip(y) {
                    *s += v as f64;
                }
            }
            sum
        });
        let mut exact = vec![0f64; n];
        for r in 0..world {
            for s in 0..steps {
                for (e, v) in exact.iter_mut().zip(data(r, s, n)) {
                    *e += v as f64;
                }
            }
        }
        results[0]
            .iter()
            .zip(&exact)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max)
    };
    let with = drift(true);
    let without = drift(false);
    // With feedback the running sum is off by at most what the residuals hold now: N x eps.
    assert!(with <= world as f64 * eps * 1.05, "with feedback: {with}");
    assert!(
        without > 2.0 * with,
        "without feedback {without} vs with {with}"
    );
}

#[test]
fn ranks_that_disagree_all_get_an_error() {
    for case in 0..3 {
        let results = run(3, Duration::from_secs(5), |t| {
            let (n, eps, average) = match (case, t.rank()) {
                (0, 2) => (999, 1e-3, false),  // a different length
                (1, 1) => (1000, 2e-3, false), // a different bound
                (2, 0) => (1000, 1e-3, true),  // sum against average
                _ => (1000, 1e-3, false),
            };
            allreduce(t, &vec![0.5f32; n], None, &opts(Bound::Abs(eps), average))
        });
        for r in results {
            assert!(
                matches!(r, Err(Error::RankMismatch { .. })),
                "case {case}: {r:?}"
            );
        }
    }
}

#[test]
fn a_rank_that_refuses_its_input_fails_every_rank_at_once() {
    // The peers would otherwise wait in the agreement round for the timeout (60 s here).
    let t0 = std::time::Instant::now();
    for case in 0..2 {
        let results = run(3, Duration::from_secs(60), |t| {
            let x = vec![0.5f32; 1000];
            if t.rank() == 1 {
                return match case {
                    // a residual of the wrong length, refused by `allreduce` itself
                    0 => allreduce(
                        t,
                        &x,
                        Some(&mut vec![0.0; 999]),
                        &opts(Bound::Abs(1e-3), false),
                    ),
                    // a dtype that cannot be quantized, refused by `allreduce_bytes`
                    _ => cfc::collective::allreduce_bytes(
                        t,
                        &[0u8; 4000],
                        cfc::DType::I32,
                        None,
                        &opts(Bound::Abs(1e-3), false),
                    )
                    .map(|(_, report)| (Vec::new(), report)),
                }
                .map(|_| ());
            }
            allreduce(t, &x, None, &opts(Bound::Abs(1e-3), false)).map(|_| ())
        });
        for (rank, r) in results.iter().enumerate() {
            match (rank, case) {
                (1, 0) => assert!(matches!(r, Err(Error::ShapeMismatch { .. })), "{r:?}"),
                (1, _) => assert!(matches!(r, Err(Error::NotQuantizable(_))), "{r:?}"),
                _ => assert!(
                    matches!(r, Err(Error::PeerRefused { rank: 1, reason }) if !reason.is_empty()),
                    "case {case}, rank {rank}: {r:?}"
                ),
            }
        }
    }
    assert!(t0.elapsed() < Duration::from_secs(20));
}

/// A transport that passes messages through at world size 1 and fails its `fail_at`-th call.
struct FailingAt {
    calls: usize,
    fail_at: usize,
}

impl Transport for FailingAt {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_to_all(&mut self, parts: Vec<Vec<u8>>) -> cfc::Result<Vec<Vec<u8>>> {
        self.calls += 1;
        if self.calls == self.fail_at {
            return Err(Error::Transport("the link broke".into()));
        }
        Ok(parts)
    }
}

#[test]
fn a_call_that_fails_leaves_the_residual_as_it_was() {
    let x = data(0, 0, 5000);
    for algorithm in [Algorithm::ReduceScatter, Algorithm::AllGather] {
        let o = AllReduceOptions {
            algorithm: Some(algorithm),
            ..opts(Bound::Abs(1e-3), false)
        };
        // Calls: 1 the agreement, 2 the frames, 3 (reduce-scatter) the summed shards, and
        // last the closing round.
        let rounds = if algorithm == Algorithm::ReduceScatter {
            4
        } else {
            3
        };
        for fail_at in 2..=rounds {
            let mut residual = vec![1e-4f32; 5000];
            let mut t = FailingAt { calls: 0, fail_at };
            let r = allreduce(&mut t, &x, Some(&mut residual), &o);
            assert!(matches!(r, Err(Error::Transport(_))), "{r:?}");
            assert!(
                residual.iter().all(|&v| v == 1e-4),
                "{algorithm:?}, call {fail_at}"
            );
        }
        // And one that succeeds writes it.
        let mut residual = vec![1e-4f32; 5000];
        let mut t = FailingAt {
            calls: 0,
            fail_at: 0,
        };
        allreduce(&mut t, &x, Some(&mut residual), &o).unwrap();
        assert!(residual.iter().any(|&v| v != 1e-4));
    }
}

#[test]
fn a_peer_that_never_comes_is_a_timeout_not_a_hang() {
    let t0 = std::time::Instant::now();
    let results = run(3, Duration::from_millis(300), |t| {
        if t.rank() == 2 {
            std::thread::sleep(Duration::from_millis(900)); // never joins the collective
            return Ok(());
        }
        allreduce(t, &[1.0f32; 64], None, &opts(Bound::Abs(1e-3), false)).map(|_| ())
    });
    assert!(
        matches!(results[0], Err(Error::Timeout { peer: 2, .. })),
        "{:?}",
        results[0]
    );
    assert!(
        matches!(results[1], Err(Error::Timeout { peer: 2, .. })),
        "{:?}",
        results[1]
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn non_finite_values_reach_every_rank() {
    let results = run(4, Duration::from_secs(5), |t| {
        let mut x = vec![0.25f32; 100];
        if t.rank() == 1 {
            x[7] = f32::NAN;
            x[8] = f32::INFINITY;
        }
        allreduce(t, &x, None, &opts(Bound::Abs(1e-3), true))
            .expect("allreduce")
            .0
    });
    for y in results {
        assert!(y[7].is_nan() && y[8] == f32::INFINITY && (y[0] - 0.25).abs() <= 1e-3);
    }
}

#[test]
fn bf16_buffers_reduce_too() {
    let results = run(2, Duration::from_secs(5), |t| {
        let x: Vec<bf16> = data(t.rank(), 3, 1000)
            .iter()
            .map(|&v| bf16::from_f32(v))
            .collect();
        allreduce(t, &x, None, &opts(Bound::Abs(1e-4), false)).expect("allreduce")
    });
    let (y, report) = &results[0];
    let (a, b) = (data(0, 3, 1000), data(1, 3, 1000));
    for i in 0..1000 {
        let exact = bf16::from_f32(a[i]).to_f64() + bf16::from_f32(b[i]).to_f64();
        let slack = exact.abs() * 2f64.powi(-8); // bf16's final rounding
        assert!((y[i].to_f64() - exact).abs() <= report.bound + slack);
    }
}

#[test]
fn an_average_is_rounded_to_the_element_type_once() {
    // fp16: 40000 on each rank sums past 65504; the average must not go through that sum.
    for world in [2, 3, 5] {
        for algorithm in BOTH {
            let o = AllReduceOptions {
                algorithm: Some(algorithm),
                ..opts(Bound::Abs(1e-3), true)
            };
            let results = run(world, Duration::from_secs(10), |t| {
                allreduce(t, &[f16::from_f32(40000.0); 300], None, &o)
                    .expect("allreduce")
                    .0
            });
            for y in results {
                assert!(
                    y.iter().all(|v| v.to_f32() == 40000.0),
                    "world {world} {algorithm:?}: {:?}",
                    &y[..3]
                );
            }
        }
    }
    // bf16 with large ulps, worlds that are not powers of two: within eps of the exact average
    // plus one rounding to bf16 (half an ulp) and the f32 step before it.
    let n = 4000;
    let input = |r: usize| -> Vec<bf16> {
        data(r, 9, n)
            .iter()
            .map(|&v| bf16::from_f32(1.0 + 3000.0 * v.abs()))
            .collect()
    };
    for world in [3, 5, 6, 7] {
        for algorithm in BOTH {
            let o = AllReduceOptions {
                algorithm: Some(algorithm),
                ..opts(Bound::Abs(1e-3), true)
            };
            let results = run(world, Duration::from_secs(10), |t| {
                allreduce(t, &input(t.rank()), None, &o).expect("allreduce")
            });
            let inputs: Vec<Vec<bf16>> = (0..world).map(input).collect();
            let (y, report) = &results[0];
            for i in 0..n {
                let exact = inputs.iter().map(|x| x[i].to_f64()).sum::<f64>() / world as f64;
                let half_ulp = y[i].to_f64().abs() * 2f64.powi(-8);
                let err = (y[i].to_f64() - exact).abs();
                assert!(
                    err <= report.bound + half_ulp * (1.0 + 2f64.powi(-15)),
                    "world {world} {algorithm:?} element {i}: {} vs exact {exact}",
                    y[i]
                );
            }
        }
    }
}

/// An in-process endpoint that truncates what it sends to one peer in one call.
struct Truncating {
    inner: InProcess,
    call: usize,
    at_call: usize,
    to: usize,
}

impl Transport for Truncating {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn all_to_all(&mut self, mut parts: Vec<Vec<u8>>) -> cfc::Result<Vec<Vec<u8>>> {
        self.call += 1;
        if self.call == self.at_call {
            parts[self.to].truncate(20);
        }
        self.inner.all_to_all(parts)
    }
}

#[test]
fn a_failure_on_one_rank_mid_call_fails_every_rank_at_once() {
    // Rank 0 sends rank 1 a broken frame: with the reduce-scatter its shard (call 2), which
    // rank 1 cannot sum, or the summed shard it owns (call 3), which rank 1 cannot decode;
    // with the all-gather its frame (call 2). Rank 1's peers must hear so instead of waiting
    // for it until the timeout, or keeping a step that rank 1 did not.
    let t0 = std::time::Instant::now();
    for (algorithm, at_call) in [
        (Algorithm::ReduceScatter, 2),
        (Algorithm::ReduceScatter, 3),
        (Algorithm::AllGather, 2),
    ] {
        let o = AllReduceOptions {
            algorithm: Some(algorithm),
            ..opts(Bound::Abs(1e-4), true)
        };
        let endpoints = InProcess::group(3, Duration::from_secs(20));
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = endpoints
                .into_iter()
                .map(|inner| {
                    let o = &o;
                    s.spawn(move || {
                        let rank = inner.rank();
                        let mut t = Truncating {
                            inner,
                            call: 0,
                            at_call: if rank == 0 { at_call } else { 0 },
                            to: 1,
                        };
                        let x = data(rank, 0, 5000);
                        let mut residual = vec![1e-5f32; 5000];
                        let r = allreduce(&mut t, &x, Some(&mut residual), o).map(|_| ());
                        // and the ranks go on together
                        let next = allreduce(&mut t, &x, None, o).map(|_| ());
                        (r, residual.iter().all(|&v| v == 1e-5), next)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let case = format!("{algorithm:?}, call {at_call}");
        for (rank, (r, kept, next)) in results.iter().enumerate() {
            assert!(kept, "{case}: rank {rank} changed its residual");
            assert!(next.is_ok(), "{case}: rank {rank}'s next call: {next:?}");
            if rank == 1 {
                assert!(matches!(r, Err(Error::Format(_))), "{case}: {r:?}");
            } else {
                assert!(
                    matches!(r, Err(Error::PeerFailed { rank: 1, reason }) if reason.contains("malformed")),
                    "{case}, rank {rank}: {r:?}"
                );
            }
        }
    }
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

#[test]
fn compressed_traffic_is_several_times_smaller_than_a_ring_all_reduce() {
    let results = run(4, Duration::from_secs(10), |t| {
        // Laplace with scale 1e-3 has RMS sqrt(2) x 1e-3: eps = 0.3 x RMS, the same on every rank.
        let x = data(t.rank(), 0, 1 << 16);
        let eps = 0.3 * 2f64.sqrt() * 1e-3;
        allreduce(t, &x, None, &opts(Bound::Abs(eps), false))
            .expect("allreduce")
            .1
    });
    for report in results {
        let ratio = report.bytes_uncompressed as f64 / report.bytes_sent as f64;
        assert!(ratio > 5.0, "only {ratio:.2}x fewer bytes");
    }
}

#[test]
fn fixed_rate_is_refused_for_a_collective() {
    let results = run(2, Duration::from_secs(5), |t| {
        allreduce(t, &[1.0f32; 10], None, &opts(Bound::Bits(8), false))
    });
    for r in results {
        assert!(
            matches!(r, Err(Error::InvalidBound { what: "bits", .. })),
            "{r:?}"
        );
    }
}

#[test]
fn a_peer_that_leaves_is_a_transport_error() {
    let results = run(3, Duration::from_secs(5), |t| {
        if t.rank() == 2 {
            return Ok(()); // drops its endpoint: its channels close
        }
        std::thread::sleep(Duration::from_millis(100));
        allreduce(t, &[1.0f32; 64], None, &opts(Bound::Abs(1e-3), false)).map(|_| ())
    });
    for r in &results[..2] {
        // Whichever peer it notices first (rank 2, or a rank that already failed and left).
        assert!(
            matches!(r, Err(Error::Transport(m)) if m.contains("is gone")),
            "{r:?}"
        );
    }
}

#[test]
fn both_algorithms_give_the_same_bits_and_residuals() {
    let n = 20_000;
    for world in 1..=8 {
        let mut by_algorithm = Vec::new();
        for algorithm in BOTH {
            let o = AllReduceOptions {
                algorithm: Some(algorithm),
                ..opts(Bound::Abs(3e-4), true)
            };
            by_algorithm.push(run(world, Duration::from_secs(20), |t| {
                let mut residual = vec![0f32; n];
                let mut out = Vec::new();
                for step in 0..3 {
                    let x = data(t.rank(), step, n);
                    let (y, report) = allreduce(t, &x, Some(&mut residual), &o).expect("allreduce");
                    out.push((y, report.bytes_sent));
                }
                (out, residual)
            }));
        }
        let (rs, ag) = (&by_algorithm[0], &by_algorithm[1]);
        for rank in 0..world {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for step in 0..3 {
                assert_eq!(
                    bits(&rs[rank].0[step].0),
                    bits(&ag[rank].0[step].0),
                    "world {world} step {step}"
                );
            }
            assert_eq!(
                bits(&rs[rank].1),
                bits(&ag[rank].1),
                "residuals, world {world}"
            );
            // the all-gather sends every frame to every peer: more bytes from 3 ranks on
            let (rs_bytes, ag_bytes) = (rs[rank].0[2].1, ag[rank].0[2].1);
            if world >= 4 {
                assert!(
                    ag_bytes > rs_bytes,
                    "world {world}: {ag_bytes} <= {rs_bytes}"
                );
            }
        }
    }
}

#[test]
fn ranks_that_disagree_on_the_algorithm_all_get_an_error() {
    let results = run(2, Duration::from_secs(20), |t| {
        let o = AllReduceOptions {
            algorithm: Some(BOTH[t.rank()]),
            ..opts(Bound::Abs(1e-4), false)
        };
        allreduce(t, &data(t.rank(), 0, 1000), None, &o)
    });
    for r in results {
        match r {
            Err(Error::RankMismatch { what, theirs }) => {
                assert!(
                    what.contains("reduce-scatter") && theirs.contains("all-gather"),
                    "{what} / {theirs}"
                );
            }
            other => panic!("expected a rank mismatch, got {other:?}"),
        }
    }
}
