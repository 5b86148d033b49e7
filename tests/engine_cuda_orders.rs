//! Orders on the GPU (`Engine::order`, cfc.fsdp's calls): what the caller's stream queues
//! right after an order reads the job's result, bit for bit the CPU engine's, before the step
//! ends; on an engine that fails, the caller's stream goes on and the step's end reports the
//! failure on every rank.
//!
//! Ignored by a plain `cargo test`; the GPU machine runs them with `--include-ignored` and
//! `CFC_REQUIRE_GPU=1` (see `engine_cuda.rs`).
#![cfg(feature = "cuda")]

use cfc::engine::{Algorithm, BoundRule, Engine, Fault, Job, Op, Options, Scale, Tensor};
use cfc::DType;
use cudarc::driver::{CudaSlice, DevicePtr};
use std::time::{Duration, Instant};

mod gpu_common;
use gpu_common::{bytes_of, gpus, grads, nccl, on_cuda_ranks};

/// Keys (FSDP groups) per step.
const KEYS: usize = 3;

/// What a rank saw: every job's shard, as a copy queued right after its order read it, and
/// each step's outcome (its end).
type Seen = (Vec<Vec<u8>>, Vec<Result<(), String>>);

fn job(key: usize, data: u64, residual: u64, out: u64, n: usize, world: usize) -> Job {
    let t = |addr: u64, numel: usize| Tensor {
        addr,
        numel: numel as u64,
        dtype: DType::F32,
    };
    Job {
        key: key as u64,
        fingerprint: 1,
        data: t(data, n),
        residual: Some(t(residual, n)),
        op: Op::ReduceScatter {
            out: t(out, n / world),
        },
        scale: Scale::Average,
        last: false,
        fresh_residual: false,
    }
}

/// `steps` steps of [`KEYS`] reduce-scatter jobs on the CPU engine, each job followed by an
/// order.
fn on_cpu(e: &Engine, rank: usize, n: usize, steps: usize) -> Seen {
    let world = e.world();
    let mut rs: Vec<Vec<f32>> = (0..KEYS).map(|_| vec![0f32; n]).collect();
    let (mut shards, mut ends) = (Vec::new(), Vec::new());
    for step in 0..steps {
        for (key, r) in rs.iter_mut().enumerate() {
            let mut x = grads(rank, KEYS * step + key, n);
            let mut shard = vec![0f32; n / world];
            let j = job(
                key,
                x.as_mut_ptr() as u64,
                r.as_mut_ptr() as u64,
                shard.as_mut_ptr() as u64,
                n,
                world,
            );
            // SAFETY: on the CPU the order returns once the engine is done with them.
            unsafe { e.submit(j, 0) }.unwrap();
            e.order(0).unwrap();
            shards.push(bytemuck::cast_slice(&shard).to_vec());
        }
        ends.push(e.end_step(0).map_err(|e| e.to_string()));
    }
    (shards, ends)
}

/// As [`on_cpu`], on the GPU: each shard is copied to the host by a copy queued on the
/// caller's stream right after the order (no wait on the host between them); `fault` is
/// injected before step 1 on the rank it names.
fn on_gpu(
    e: &Engine,
    device: usize,
    rank: usize,
    n: usize,
    steps: usize,
    fault: Option<(usize, Fault)>,
) -> Seen {
    let world = e.world();
    let s = cfc::cuda::context(device).unwrap().new_stream().unwrap();
    let cu = s.cu_stream() as u64;
    let rs: Vec<CudaSlice<u8>> = (0..KEYS)
        .map(|_| s.alloc_zeros::<u8>(4 * n).unwrap())
        .collect();
    let (mut shards, mut ends) = (Vec::new(), Vec::new());
    for step in 0..steps {
        if let Some((r, f)) = fault {
            if step == 1 && r == rank {
                e.inject(f).unwrap();
            }
        }
        // (the step's tensors live until its end, when the engine is done with them)
        let mut live = Vec::new();
        let mut copies = Vec::new();
        for (key, r) in rs.iter().enumerate() {
            let x: CudaSlice<u8> = s
                .clone_htod(&bytes_of(&grads(rank, KEYS * step + key, n), DType::F32))
                .unwrap();
            let shard = s.alloc_zeros::<u8>(4 * n / world).unwrap();
            let p = |d: &CudaSlice<u8>| d.device_ptr(&s).0;
            let j = job(key, p(&x), p(r), p(&shard), n, world);
            // SAFETY: the buffers live until the step ends and the stream is synced.
            let ordered = unsafe { e.submit(j, cu) }.and_then(|()| e.order(cu));
            if ordered.is_ok() {
                // queued on the caller's stream right after the order
                let mut host = s.alloc_zeros::<u8>(4 * n / world).unwrap();
                s.memcpy_dtod(&shard, &mut host).unwrap();
                copies.push(host);
            }
            live.push((x, shard));
        }
        let end = e.end_step(cu);
        // (the stream of a failed engine goes on: this returns)
        s.synchronize().unwrap();
        for c in &copies {
            shards.push(s.clone_dtoh(c).unwrap());
        }
        ends.push(end.map_err(|e| e.to_string()));
        drop(live);
    }
    (shards, ends)
}

/// Runs `world` ranks on the GPU: over NCCL with a GPU each, or (`shared`) over host links
/// on GPU 0.
fn ranks_on_gpu(
    world: usize,
    shared: bool,
    o: &Options,
    n: usize,
    steps: usize,
    fault: Option<(usize, Fault)>,
) -> Vec<Seen> {
    on_cuda_ranks(world, shared, o, |rank, device, e| {
        on_gpu(e, device, rank, n, steps, fault)
    })
}

fn options(block: u64) -> Options {
    let mut o = Options::new(BoundRule::Rms(0.1));
    o.algorithm = Some(Algorithm::ReduceScatter);
    o.block = block;
    o.min_compress_numel = 1;
    o.timeout = Duration::from_secs(60);
    o
}

fn cases() -> Vec<(usize, bool)> {
    let g = gpus();
    if g == 0 || !nccl() {
        return vec![];
    }
    let mut cases = vec![(1, false), (2, true)];
    if g >= 2 {
        cases.push((2, false));
    }
    cases
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the GPU machine (scripts/gpu_run.sh)"]
fn what_the_stream_queues_after_an_order_reads_the_cpu_engines_bits() {
    // (large enough that the exchange takes far longer than queuing a copy: a stream not
    // ordered after the results would copy the shards before them)
    let n = 3 << 20;
    for (world, shared) in cases() {
        for block in [0, 256] {
            let o = options(block);
            let engines = Engine::local_group(world, o.clone()).unwrap();
            let cpu: Vec<Seen> = std::thread::scope(|sc| {
                let hs: Vec<_> = engines
                    .iter()
                    .enumerate()
                    .map(|(r, e)| sc.spawn(move || on_cpu(e, r, n, 3)))
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let gpu = ranks_on_gpu(world, shared, &o, n, 3, None);
            for rank in 0..world {
                assert!(gpu[rank].1.iter().all(|e| e.is_ok()), "{:?}", gpu[rank].1);
                assert_eq!(cpu[rank].0.len(), 3 * KEYS);
                for (k, (c, g)) in cpu[rank].0.iter().zip(&gpu[rank].0).enumerate() {
                    assert!(c == g, "world {world} shared {shared} block {block} rank {rank}: shard {k} differs");
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the GPU machine (scripts/gpu_run.sh)"]
fn the_stream_of_a_failed_engine_goes_on_and_the_step_reports_it() {
    let t0 = Instant::now();
    for (world, shared) in cases() {
        if world < 2 {
            continue;
        }
        for fault in [Fault::Device, Fault::Corrupt] {
            let seen = ranks_on_gpu(world, shared, &options(256), 1 << 20, 3, Some((1, fault)));
            for (rank, (_, ends)) in seen.iter().enumerate() {
                assert!(ends[0].is_ok(), "{fault:?} rank {rank}: {:?}", ends[0]);
                for e in &ends[1..] {
                    let e = e.as_ref().expect_err("a failed step");
                    // (a bad frame is named by the rank that received it)
                    assert!(
                        e.contains("rank 1") || e.contains("rank 0"),
                        "{fault:?} rank {rank}: {e}"
                    );
                }
            }
        }
    }
    // no stream waited for the timeout
    assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
}
