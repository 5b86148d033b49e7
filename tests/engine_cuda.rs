//! The engine on the GPU: the CUDA backend writes the CPU backend's bits (frames, sums,
//! statistics, averages, residuals) through the whole engine, over NCCL (one GPU per rank) and
//! over host links (ranks sharing one GPU); failures on one GPU rank reach every rank through
//! the failure board, well within the timeout.
//!
//! They are ignored by a plain `cargo test` (a machine without a GPU shows them as ignored, not
//! as passed): the GPU machine runs them with `--include-ignored` and `CFC_REQUIRE_GPU=1`, under
//! which a missing GPU or NCCL fails them. Run elsewhere with `--include-ignored` alone, they
//! return early, printing why.
#![cfg(feature = "cuda")]

use cfc::engine::transport::local::LocalLinks;
use cfc::engine::transport::Links;
use cfc::engine::{Algorithm, BoundRule, Engine, Fallback, Fault, Job, Op, Options, Scale, Tensor};
use cfc::nccl::{Communicator, UniqueId};
use cfc::{Coder, DType};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod gpu_common;
use gpu_common::{bytes_of, gpus, grads, nccl, on_cuda_ranks};

/// What one rank ends with after `steps` steps of two buckets (an all-reduce and a
/// reduce-scatter): every step's results and residuals, as bytes.
type Outcome = Vec<Vec<u8>>;

/// Runs the steps on one rank's engine, its memory on the host (`stream` None) or on the GPU.
fn drive(
    e: &Engine,
    rank: usize,
    dtype: DType,
    n: usize,
    steps: usize,
    stream: Option<&Arc<CudaStream>>,
) -> Outcome {
    let world = e.world();
    let size = dtype.size();
    let mut out = Vec::new();
    match stream {
        None => {
            let mut r0 = vec![0f32; n];
            let mut r1 = vec![0f32; n];
            for step in 0..steps {
                let mut a = bytes_of(&grads(rank, step, n), dtype);
                let b_in = bytes_of(&grads(rank, step + 7, n), dtype);
                let mut shard = vec![0u8; n / world * size];
                let t = |v: &mut [u8], numel: usize, d: DType| Tensor {
                    addr: v.as_mut_ptr() as u64,
                    numel: numel as u64,
                    dtype: d,
                };
                let mut b = b_in.clone();
                let jobs = [
                    Job {
                        key: 0,
                        fingerprint: 1,
                        data: t(&mut a, n, dtype),
                        residual: Some(t(bytemuck::cast_slice_mut(&mut r0), n, DType::F32)),
                        op: Op::AllReduce,
                        scale: Scale::Average,
                        last: false,
                        fresh_residual: false,
                    },
                    Job {
                        key: 1,
                        fingerprint: 2,
                        data: t(&mut b, n, dtype),
                        residual: Some(t(bytemuck::cast_slice_mut(&mut r1), n, DType::F32)),
                        op: Op::ReduceScatter {
                            out: t(&mut shard, n / world, dtype),
                        },
                        scale: Scale::Sum,
                        last: true,
                        fresh_residual: false,
                    },
                ];
                for j in jobs {
                    // SAFETY: everything lives until the wait.
                    unsafe { e.submit(j, 0) }.unwrap();
                }
                e.wait(0).unwrap();
                out.extend([
                    a,
                    shard,
                    bytemuck::cast_slice(&r0).to_vec(),
                    bytemuck::cast_slice(&r1).to_vec(),
                ]);
            }
        }
        Some(s) => {
            let mut r0 = s.alloc_zeros::<u8>(4 * n).unwrap();
            let mut r1 = s.alloc_zeros::<u8>(4 * n).unwrap();
            let cu = s.cu_stream() as u64;
            for step in 0..steps {
                let a: CudaSlice<u8> = s
                    .clone_htod(&bytes_of(&grads(rank, step, n), dtype))
                    .unwrap();
                let b: CudaSlice<u8> = s
                    .clone_htod(&bytes_of(&grads(rank, step + 7, n), dtype))
                    .unwrap();
                let shard = s.alloc_zeros::<u8>(n / world * size).unwrap();
                let p = |d: &CudaSlice<u8>| d.device_ptr(s).0;
                let t = |addr: u64, numel: usize, d: DType| Tensor {
                    addr,
                    numel: numel as u64,
                    dtype: d,
                };
                let jobs = [
                    Job {
                        key: 0,
                        fingerprint: 1,
                        data: t(p(&a), n, dtype),
                        residual: Some(t(p(&r0), n, DType::F32)),
                        op: Op::AllReduce,
                        scale: Scale::Average,
                        last: false,
                        fresh_residual: false,
                    },
                    Job {
                        key: 1,
                        fingerprint: 2,
                        data: t(p(&b), n, dtype),
                        residual: Some(t(p(&r1), n, DType::F32)),
                        op: Op::ReduceScatter {
                            out: t(p(&shard), n / world, dtype),
                        },
                        scale: Scale::Sum,
                        last: true,
                        fresh_residual: false,
                    },
                ];
                for j in jobs {
                    // SAFETY: the buffers live on this rank's device until the stream is synced.
                    unsafe { e.submit(j, cu) }.unwrap();
                }
                e.wait(cu).unwrap();
                s.synchronize().unwrap();
                out.extend([
                    s.clone_dtoh(&a).unwrap(),
                    s.clone_dtoh(&shard).unwrap(),
                    s.clone_dtoh(&r0).unwrap(),
                    s.clone_dtoh(&r1).unwrap(),
                ]);
                let _ = (&mut r0, &mut r1);
            }
        }
    }
    out
}

fn options(bound: BoundRule, algorithm: Algorithm) -> Options {
    let mut o = Options::new(bound);
    o.algorithm = Some(algorithm);
    o.min_compress_numel = 1;
    o.timeout = Duration::from_secs(60);
    o
}

/// The CPU engine's outcome on every rank.
fn on_cpu(world: usize, o: &Options, dtype: DType, n: usize, steps: usize) -> Vec<Outcome> {
    let engines = Engine::local_group(world, o.clone()).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = engines
            .iter()
            .enumerate()
            .map(|(r, e)| s.spawn(move || drive(e, r, dtype, n, steps, None)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The CUDA engine's outcome on every rank: over NCCL with a GPU each (`shared` false), or
/// over host links with every rank on GPU 0.
fn on_gpu(
    world: usize,
    shared: bool,
    o: &Options,
    dtype: DType,
    n: usize,
    steps: usize,
) -> Vec<Outcome> {
    on_cuda_ranks(world, shared, o, |rank, device, e| {
        let stream = cfc::cuda::context(device).unwrap().new_stream().unwrap();
        drive(e, rank, dtype, n, steps, Some(&stream))
    })
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the GPU machine (scripts/gpu_run.sh)"]
fn the_cuda_engine_writes_the_bits_of_the_cpu_engine() {
    let g = gpus();
    if g == 0 || !nccl() {
        return;
    }
    let n = 3 * 40_000 + 96; // three shards of whole groups, a last group not full
    let mut cases = vec![(1, false), (2, true), (3, true)];
    if g >= 2 {
        cases.push((2, false));
    }
    if g >= 4 {
        // one GPU per rank over NCCL at 4 ranks (the reduce-scatter's default from 3 ranks)
        cases.push((4, false));
    }
    for (world, shared) in cases {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for (bound, alg, coder, block) in [
                (
                    BoundRule::Rms(0.3),
                    Algorithm::ReduceScatter,
                    Coder::Planes,
                    0,
                ),
                (BoundRule::Abs(2e-4), Algorithm::AllGather, Coder::Planes, 0),
                (BoundRule::Rel(0.01), Algorithm::AllGather, Coder::Planes, 0),
                (BoundRule::Rms(0.3), Algorithm::AllGather, Coder::Rice, 0),
                // block scales: both exchanges, small and large blocks
                (
                    BoundRule::Rms(0.3),
                    Algorithm::ReduceScatter,
                    Coder::Planes,
                    256,
                ),
                (BoundRule::Rms(0.1), Algorithm::AllGather, Coder::Planes, 32),
                (
                    BoundRule::Rms(0.05),
                    Algorithm::ReduceScatter,
                    Coder::Planes,
                    4096,
                ),
                // rice frames with block scales (the all-gather's): blocks within a rice
                // block and across several, scales that leave the heads unaligned
                (BoundRule::Rms(0.3), Algorithm::AllGather, Coder::Rice, 256),
                (BoundRule::Rms(0.1), Algorithm::AllGather, Coder::Rice, 4096),
                // (the reduce-scatter job's frames rice, decoded where they arrive)
                (
                    BoundRule::Rms(0.3),
                    Algorithm::ReduceScatter,
                    Coder::Rice,
                    256,
                ),
            ] {
                let n = n - n % world;
                let mut o = options(bound, alg);
                o.coder = coder;
                o.block = block;
                let cpu = on_cpu(world, &o, dtype, n, 3);
                let gpu = on_gpu(world, shared, &o, dtype, n, 3);
                for rank in 0..world {
                    for (k, (c, d)) in cpu[rank].iter().zip(&gpu[rank]).enumerate() {
                        assert!(c == d, "world {world} shared {shared} {dtype:?} {bound:?} {alg:?} {coder:?} block {block} rank {rank}: output {k} differs");
                    }
                }
            }
        }
    }
}

/// Two steps on every GPU rank, with `setup` run on `rank`'s engine before the second; each
/// rank's outcome of each step.
fn gpu_fault(world: usize, setup: impl Fn(usize, &Engine) + Sync) -> Vec<Vec<Result<(), String>>> {
    let mut o = options(BoundRule::Rms(0.3), Algorithm::for_world(world));
    o.timeout = Duration::from_secs(120);
    let links = LocalLinks::group(world, o.timeout);
    let id = UniqueId::new().unwrap();
    let t0 = Instant::now();
    let out = std::thread::scope(|s| {
        let hs: Vec<_> = links
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let (o, id, setup) = (o.clone(), &id, &setup);
                s.spawn(move || {
                    let comm = Communicator::new(rank, id, rank, world).unwrap();
                    let control = l.control().clone();
                    let e = Engine::on_cuda_nccl(rank, comm, control, Some(Box::new(l)), o, 0, &[])
                        .unwrap();
                    let stream = cfc::cuda::context(rank).unwrap().new_stream().unwrap();
                    let cu = stream.cu_stream() as u64;
                    let n = 1 << 20;
                    let x: CudaSlice<u8> = stream
                        .clone_htod(&bytes_of(&grads(rank, 0, n), DType::F32))
                        .unwrap();
                    let r = stream.alloc_zeros::<u8>(4 * n).unwrap();
                    let mut outcomes = Vec::new();
                    for step in 0..3 {
                        if step == 1 {
                            setup(rank, &e);
                        }
                        let job = Job {
                            key: 0,
                            fingerprint: 1,
                            data: Tensor {
                                addr: x.device_ptr(&stream).0,
                                numel: n as u64,
                                dtype: DType::F32,
                            },
                            residual: Some(Tensor {
                                addr: r.device_ptr(&stream).0,
                                numel: n as u64,
                                dtype: DType::F32,
                            }),
                            op: Op::AllReduce,
                            scale: Scale::Average,
                            last: true,
                            fresh_residual: false,
                        };
                        // SAFETY: the buffers live until the stream is synced below.
                        let r = unsafe { e.submit(job, cu) }.and_then(|()| e.wait(cu));
                        stream.synchronize().unwrap();
                        outcomes.push(r.map_err(|e| e.to_string()));
                    }
                    outcomes
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "a rank waited for the timeout: {:?}",
        t0.elapsed()
    );
    out
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the GPU machine (scripts/gpu_run.sh)"]
fn a_failure_on_one_gpu_rank_fails_every_rank_at_once() {
    let g = gpus();
    if g < 2 || !nccl() {
        eprintln!("skipped: the failure tests over NCCL need 2 GPUs");
        return;
    }
    for (fault, what) in [
        (Some(Fault::Alloc), "could not allocate"),
        (Some(Fault::Device), "injected device failure"),
        (Some(Fault::Corrupt), "frame"),
        (None, "raised in the caller"),
    ] {
        for world in if g >= 4 { vec![2, 4] } else { vec![2] } {
            let out = gpu_fault(world, |rank, e| {
                if rank == 1 {
                    match fault {
                        Some(f) => e.inject(f).unwrap(),
                        None => e.fail("raised in the caller"),
                    }
                }
            });
            for (rank, steps) in out.iter().enumerate() {
                assert!(steps[0].is_ok(), "{what}: rank {rank}: {:?}", steps[0]);
                for s in &steps[1..] {
                    let e = s.as_ref().expect_err("a failed step");
                    assert!(
                        e.contains("rank 1") || e.contains("rank 0"),
                        "{what}: rank {rank}: {e}"
                    );
                    assert!(e.contains(what), "{what}: world {world}, rank {rank}: {e}");
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the GPU machine (scripts/gpu_run.sh)"]
fn a_plain_fallback_is_ncclallreduce() {
    let g = gpus();
    if g == 0 || !nccl() {
        return;
    }
    let world = g.min(2);
    let mut o = options(BoundRule::Abs(1e-3), Algorithm::AllGather);
    o.fallback = Fallback::Always;
    let gpu = on_gpu(world, false, &o, DType::F32, 4096, 1);
    for out in &gpu {
        let y: Vec<f32> = out[0]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        for (i, v) in y.iter().enumerate() {
            let want: f32 = (0..world).map(|k| grads(k, 0, 4096)[i]).sum::<f32>() / world as f32;
            assert!(
                (v - want).abs() <= 1e-6 * want.abs().max(1e-3),
                "{i}: {v} {want}"
            );
        }
    }
}
