//! Failures: one injected on one rank at every point (an allocation, the device, a corrupt
//! frame, the caller's exception, disagreeing options, a rank that dies or stays silent, a wait
//! that runs out of time) fails every rank at once, in the same step, and lets the caller's
//! memory go only once the engine is done with it.

use super::*;
use crate::engine::transport::local::LocalLinks;
/// The options of the steps failures are injected into: an rms bound, `alg`, and a timeout no
/// test should reach (a failure ends every wait at once).
fn fault_options(alg: Algorithm) -> Options {
    let mut o = options(BoundRule::Rms(0.3));
    o.algorithm = Some(alg);
    o.timeout = Duration::from_secs(60);
    o
}

/// Runs three steps of two buckets on `world` ranks, with `setup` applied to `rank`'s engine
/// first; returns each rank's outcome of each step.
fn with_fault(
    world: usize,
    alg: Algorithm,
    setup: impl Fn(usize, &Engine) + Sync,
) -> Vec<Vec<std::result::Result<(), String>>> {
    let t0 = std::time::Instant::now();
    let out = ranks(world, &fault_options(alg), |rank, e| {
        let n = 8192;
        let (mut r0, mut r1) = (vec![0.0f32; n], vec![0.0f32; n]);
        let mut outcomes = Vec::new();
        for step in 0..3 {
            if step == 1 {
                setup(rank, e);
            }
            let (mut a, mut b) = (grads(rank, step, n), grads(rank, step + 9, n));
            // SAFETY: as in `one_step`.
            let submitted = unsafe {
                e.submit(job(0, &mut a, Some(&mut r0), false), 0)
                    .and_then(|()| {
                        e.submit(
                            Job {
                                key: 1,
                                ..job(1, &mut b, Some(&mut r1), true)
                            },
                            0,
                        )
                    })
            };
            let waited = e.wait(0);
            outcomes.push(submitted.and(waited).map_err(|e| e.to_string()));
        }
        outcomes
    });
    // no rank waited for the timeout
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    out
}

/// Every rank succeeded at step 0 and failed at steps 1 and 2, naming `rank`.
fn failed_everywhere(out: &[Vec<std::result::Result<(), String>>], rank: usize, what: &str) {
    for (r, steps) in out.iter().enumerate() {
        assert!(steps[0].is_ok(), "rank {r}: {:?}", steps[0]);
        for s in &steps[1..] {
            let e = s.as_ref().expect_err("a failed step");
            assert!(
                e.contains(&format!("rank {rank}")) && e.contains(what),
                "rank {r}: {e}"
            );
        }
    }
}

#[test]
fn a_failure_on_one_rank_fails_every_rank_at_once() {
    for world in [2, 3] {
        for alg in [Algorithm::AllGather, Algorithm::ReduceScatter] {
            let out = with_fault(world, alg, |rank, e| {
                if rank == world - 1 {
                    e.inject(Fault::Alloc).unwrap();
                }
            });
            failed_everywhere(&out, world - 1, "could not allocate");
            let out = with_fault(world, alg, |rank, e| {
                if rank == 0 {
                    e.inject(Fault::Device).unwrap();
                }
            });
            failed_everywhere(&out, 0, "injected device failure");
            // An exception in the caller (a hook) on one rank.
            let out = with_fault(world, alg, |rank, e| {
                if rank == 1 {
                    e.fail("ValueError: raised in the hook");
                }
            });
            failed_everywhere(&out, 1, "raised in the hook");
        }
    }
}

/// An exception in the caller in the middle of a step, on one rank: that rank submits no more
/// jobs and goes straight to its wait and its close. Its peers either submit the rest of the
/// step, or wait at the same point. Either way the step fails on every rank (the failure is at
/// the failing rank's next point, its wait, which its peers reach with their next job or their
/// own wait), and no rank waits for the timeout.
#[test]
fn a_caller_that_fails_mid_step_fails_that_step_on_every_rank() {
    for world in [2, 3] {
        for alg in [Algorithm::AllGather, Algorithm::ReduceScatter] {
            for peers_finish in [false, true] {
                let t0 = std::time::Instant::now();
                let out = ranks(world, &fault_options(alg), |rank, e| {
                    let n = 8192;
                    let (mut r0, mut r1) = (vec![0.0f32; n], vec![0.0f32; n]);
                    let mut outcomes = Vec::new();
                    for step in 0..2 {
                        let (mut a, mut b) = (grads(rank, step, n), grads(rank, step + 9, n));
                        // SAFETY: as in `one_step`.
                        let mut r = unsafe { e.submit(job(0, &mut a, Some(&mut r0), false), 0) };
                        if step == 1 && rank == 1 {
                            e.fail("ValueError: raised in the hook");
                        } else if step == 0 || peers_finish {
                            // SAFETY: as above.
                            r = r.and_then(|()| unsafe {
                                e.submit(
                                    Job {
                                        key: 1,
                                        ..job(1, &mut b, Some(&mut r1), true)
                                    },
                                    0,
                                )
                            });
                        }
                        outcomes.push(r.and(e.wait(0)).map_err(|e| e.to_string()));
                    }
                    let closed = e.close().map_err(|e| e.to_string());
                    (outcomes, closed)
                });
                let took = t0.elapsed();
                let case = format!("world {world}, {alg:?}, peers finish: {peers_finish}");
                assert!(took < Duration::from_secs(10), "{case}: {took:?}");
                for (r, (steps, closed)) in out.iter().enumerate() {
                    assert!(steps[0].is_ok(), "{case}, rank {r}: {:?}", steps[0]);
                    let e = steps[1].as_ref().expect_err("step 1 fails");
                    assert!(e.contains("raised in the hook"), "{case}, rank {r}: {e}");
                    assert!(closed.is_ok(), "{case}, rank {r}: {closed:?}");
                }
            }
        }
    }
}

#[test]
fn a_corrupt_frame_fails_every_rank_in_the_same_step() {
    for world in [2, 3] {
        for alg in [Algorithm::AllGather, Algorithm::ReduceScatter] {
            let out = with_fault(world, alg, |rank, e| {
                if rank == 0 {
                    e.inject(Fault::Corrupt).unwrap();
                }
            });
            for (r, steps) in out.iter().enumerate() {
                assert!(steps[0].is_ok());
                let e = steps[1].as_ref().expect_err("step 1 fails");
                assert!(
                    e.contains("frame") || e.contains("sum"),
                    "{world} {alg:?} rank {r}: {e}"
                );
                assert!(steps[2].is_err());
            }
        }
    }
}

#[test]
fn ranks_that_disagree_all_fail() {
    // Options.
    let engines: Vec<Engine> = (0..2)
        .zip(LocalLinks::group(2, Duration::from_secs(10)))
        .map(|(r, l)| {
            let mut o = options(BoundRule::Abs(1e-3));
            o.warmup_steps = r;
            Engine::start(CpuBackend::new(), HostTransport::new(l), o, 0, &[]).unwrap()
        })
        .collect();
    for e in &engines {
        let err = e.wait(0).unwrap_err().to_string();
        assert!(
            err.contains("warm-up 0") && err.contains("warm-up 1"),
            "{err}"
        );
    }
    // Buckets of another size on one rank.
    let o = options(BoundRule::Abs(1e-3));
    let out = ranks(2, &o, |rank, e| {
        let mut x = grads(rank, 0, 1000 + rank * 64);
        // SAFETY: as in `one_step`.
        unsafe { e.submit(job(0, &mut x, None, true), 0) }.unwrap();
        e.wait(0).map_err(|e| e.to_string())
    });
    for o in out {
        let e = o.unwrap_err();
        assert!(e.contains("ranks disagree") && e.contains("1064"), "{e}");
    }
    // Plain exchanges (no frame, no check word): another bucket of the same size, or another
    // size, on one rank fails every rank before anything is reduced.
    let mut o = options(BoundRule::Abs(1e-3));
    o.min_compress_numel = 1 << 40;
    for (fingerprint, extra) in [(2, 0), (1, 64)] {
        let out = ranks(2, &o, |rank, e| {
            let mut x = grads(rank, 0, 1000 + rank * extra);
            let j = Job {
                fingerprint: if rank == 1 { fingerprint } else { 1 },
                ..job(0, &mut x, None, true)
            };
            // SAFETY: as in `one_step`.
            unsafe { e.submit(j, 0) }.unwrap();
            e.wait(0).map_err(|e| e.to_string())
        });
        for o in out {
            let e = o.unwrap_err();
            assert!(
                e.contains("ranks disagree") && e.contains("fingerprint 0x2") == (fingerprint == 2),
                "{e}"
            );
        }
    }
}

#[test]
fn a_rank_that_dies_fails_the_others() {
    let o = options(BoundRule::Abs(1e-3));
    let mut engines = Engine::local_group(2, o).unwrap();
    let dead = engines.pop().unwrap();
    let alive = engines.pop().unwrap();
    let t0 = std::time::Instant::now();
    std::thread::scope(|s| {
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            // Its thread ends without closing: its links go away without a goodbye.
            std::mem::forget(dead.tx.clone());
            drop(dead);
        });
        let mut x = grads(0, 0, 4096);
        // SAFETY: as in `one_step`.
        unsafe { alive.submit(job(0, &mut x, None, true), 0) }.unwrap();
        let e = alive.wait(0).unwrap_err().to_string();
        assert!(e.contains("rank 1"), "{e}");
    });
    assert!(t0.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_silent_peer_is_a_timeout_and_close_is_bounded() {
    let mut o = options(BoundRule::Abs(1e-3));
    o.timeout = Duration::from_millis(500);
    let engines = Engine::local_group(2, o).unwrap();
    let mut x = grads(0, 0, 4096);
    // SAFETY: as in `one_step`.
    unsafe { engines[0].submit(job(0, &mut x, None, true), 0) }.unwrap();
    let t0 = std::time::Instant::now();
    let e = engines[0].wait(0).unwrap_err().to_string();
    assert!(
        e.contains("did not answer") || e.contains("timed out") || e.contains("within"),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
    let t0 = std::time::Instant::now();
    let _ = engines[0].close();
    let _ = engines[1].close();
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn every_outcome_is_remembered_however_many_follow() {
    let shared = Shared::new();
    for _ in 0..200 {
        shared.publish(true, None);
    }
    shared.publish(false, None);
    shared.publish_again();
    shared.publish(false, None);
    let p = shared.progress();
    assert_eq!(p.published, 203);
    assert!(p.succeeded(1) && p.succeeded(200));
    assert!(!p.succeeded(201) && !p.succeeded(202) && !p.succeeded(203));
    drop(p);
    // A failure long ago is still a failure (a bounded list of outcomes forgot it, and a
    // waiter that came late read a success).
    let shared = Shared::new();
    shared.publish(false, None);
    for _ in 0..100 {
        shared.publish_again();
    }
    assert!(!shared.progress().succeeded(1));
}

#[test]
fn a_wait_that_runs_out_of_time_fails_the_engine_and_lets_its_memory_go_only_once_given_up() {
    let mut o = options(BoundRule::Abs(1e-3));
    o.timeout = Duration::from_millis(200);
    let engines = Engine::local_group(1, o).unwrap();
    let e = &engines[0];
    e.inject(Fault::Hang).unwrap();
    let mut x = grads(0, 0, 4096);
    // SAFETY: as in `one_step`; `x` outlives the engine's work (checked with `settled`).
    unsafe { e.submit(job(0, &mut x, None, true), 0) }.unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(!e.settled(), "a job still at work is not settled");
    let t0 = std::time::Instant::now();
    let err = e.wait(0).unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    // The wait failed the engine, whose thread gave the job up: the memory may go now.
    assert!(e.settled());
    assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
    let failure = e.control().failure().expect("a failure on the board");
    assert!(
        failure.reason.contains("did not finish its work"),
        "{}",
        failure.reason
    );
    // SAFETY: as above.
    let refused = unsafe { e.submit(job(0, &mut x, None, true), 0) };
    assert!(refused.is_err());
}
