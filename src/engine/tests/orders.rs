//! Orders (`Engine::order`): each job's result in place at its order, before the step ends,
//! with the bits a wait per job gives; the step's outcome, a failure included, reported at its
//! end on every rank.

use super::*;

/// How a step of [`scatter_steps`] hands its jobs' results on.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Per {
    /// A wait after each job (the step closed and opened again each time), then the step's end.
    Wait,
    /// An order after each job, then the step's end.
    Order,
}

/// What a rank saw: each job's shard as read right after its wait or order, and the steps the
/// engine counted at the end of each step.
type Seen = (Vec<Vec<f32>>, Vec<u64>);

/// Three steps of three reduce-scatter jobs (cfc.fsdp's calls) with residuals on `world`
/// ranks; what each rank saw.
fn scatter_steps(world: usize, o: &Options, per: Per) -> Vec<Seen> {
    let n = 3 * 4096;
    ranks(world, o, |rank, e| {
        let mut residuals: Vec<Vec<f32>> = (0..3).map(|_| vec![0.0f32; n]).collect();
        let (mut shards, mut steps) = (Vec::new(), Vec::new());
        for step in 0..3 {
            for (key, r) in residuals.iter_mut().enumerate() {
                let mut x = grads(rank, 3 * step + key, n);
                let mut shard = vec![0.0f32; n / world];
                let j = scatter_job(key, &mut x, r, &mut shard);
                // SAFETY: `x`, `shard` and the residual live until the wait or order below
                // returns, which on the CPU backend is when the engine is done with them.
                unsafe { e.submit(j, 0) }.unwrap();
                match per {
                    Per::Wait => e.wait(0).unwrap(),
                    Per::Order => e.order(0).unwrap(),
                }
                shards.push(shard);
            }
            e.end_step(0).unwrap();
            steps.push(e.state().unwrap().step);
        }
        (shards, steps)
    })
}

#[test]
fn an_order_gives_each_result_at_once_with_the_bits_of_a_wait() {
    for world in [1, 2, 3] {
        for o in [options(BoundRule::Rms(0.3)), {
            let mut o = options(BoundRule::Rms(0.3));
            o.block = 256;
            o
        }] {
            let waited = scatter_steps(world, &o, Per::Wait);
            let ordered = scatter_steps(world, &o, Per::Order);
            for (rank, ((w, steps_w), (s, steps))) in waited.iter().zip(&ordered).enumerate() {
                assert_eq!(w.len(), 9);
                // bit for bit, each shard as it was at its order (not only at the step's end)
                let bits = |v: &Vec<Vec<f32>>| -> Vec<Vec<u32>> {
                    v.iter()
                        .map(|s| s.iter().map(|x| x.to_bits()).collect())
                        .collect()
                };
                assert_eq!(
                    bits(w),
                    bits(s),
                    "world {world}, rank {rank}, block {}",
                    o.block
                );
                assert!(s.iter().all(|v| v.iter().any(|x| *x != 0.0)));
                // an order does not count a step (a flush does not either): the step's end does
                assert_eq!(steps, &[1, 2, 3], "rank {rank}");
                assert_eq!(steps, steps_w, "rank {rank}");
            }
        }
    }
}

#[test]
fn a_bad_frame_is_reported_at_the_steps_end_on_every_rank() {
    // (the all-gather: frames are checked as they are decoded, on the device, and the ranks'
    // statuses gathered when the step ends; the reduce-scatter checks them on the host)
    let mut o = options(BoundRule::Rms(0.3));
    o.algorithm = Some(Algorithm::AllGather);
    let world = 3;
    let t0 = std::time::Instant::now();
    let out = ranks(world, &o, |rank, e| {
        let n = 8192;
        let mut outcomes = Vec::new();
        let mut r = vec![0.0f32; n];
        for step in 0..3 {
            if step == 1 && rank == 1 {
                e.inject(Fault::Corrupt).unwrap();
            }
            let mut x = grads(rank, step, n);
            // SAFETY: `x` and `r` live until the step's end below.
            let submitted = unsafe { e.submit(job(0, &mut x, Some(&mut r), false), 0) };
            // The order itself succeeds: the decoding status is gathered when the step ends.
            let ordered = submitted.and_then(|()| e.order(0));
            let ended = e.end_step(0);
            outcomes.push((
                ordered.map_err(|e| e.to_string()),
                ended.map_err(|e| e.to_string()),
            ));
        }
        outcomes
    });
    assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
    for (rank, steps) in out.iter().enumerate() {
        assert!(
            steps[0].0.is_ok() && steps[0].1.is_ok(),
            "rank {rank}: {:?}",
            steps[0]
        );
        assert!(steps[1].0.is_ok(), "rank {rank}: {:?}", steps[1]);
        let e = steps[1]
            .1
            .as_ref()
            .expect_err("the step with the bad frame fails");
        assert!(e.contains("bad frame"), "rank {rank}: {e}");
        // from then on the engine refuses: the order says so at once
        let later = steps[2]
            .0
            .as_ref()
            .expect_err("a failed engine refuses orders");
        assert!(later.contains("rank"), "rank {rank}: {later}");
    }
}

#[test]
fn an_order_on_a_failed_engine_returns_its_failure() {
    let mut o = options(BoundRule::Rms(0.3));
    o.timeout = Duration::from_secs(60);
    let world = 2;
    let t0 = std::time::Instant::now();
    let out = ranks(world, &o, |rank, e| {
        let n = 8192;
        let mut x = grads(rank, 0, n);
        if rank == 0 {
            e.inject(Fault::Device).unwrap();
        }
        // SAFETY: `x` lives until the engine has finished or given up (the order or the
        // step's end, below).
        let submitted = unsafe { e.submit(job(0, &mut x, None, false), 0) };
        let ordered = submitted.and_then(|()| e.order(0));
        let ended = e.end_step(0);
        (
            ordered.map_err(|e| e.to_string()),
            ended.map_err(|e| e.to_string()),
        )
    });
    // no rank waited for the timeout
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    for (rank, (ordered, ended)) in out.iter().enumerate() {
        // each rank hears of rank 0's device failure at its order or at the step's end
        let e = ordered
            .as_ref()
            .err()
            .or(ended.as_ref().err())
            .expect("a failure");
        assert!(e.contains("rank 0"), "rank {rank}: {e}");
        assert!(ended.is_err(), "rank {rank}");
    }
}
