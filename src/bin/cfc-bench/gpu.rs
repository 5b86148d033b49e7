//! `cfc-bench --gpu N`: plain NCCL against cfc's engine on the GPU, one thread per local GPU.
//!
//! Every rank's input is the bench's data tiled from its own offset (as on the CPU). For each
//! size it times, each method with engines of its own (one NCCL communicator each):
//!
//! * `nccl-fp32`: the engine's uncompressed all-reduce (`ncclAllReduce`, average) of the float32
//!   buffer;
//! * `nccl-bf16`: the same of a bfloat16 copy (the cast is not timed);
//! * `cfc@B`: the engine with eps = B x the data's RMS and error feedback, the algorithm chosen
//!   by rank count;
//! * `cfc-auto@B`: the same with `fallback` auto: the engine times both ways on its first calls
//!   (3 of each, not timed here) and keeps the faster, which the table names.
//!
//! Each timed call starts from the same input (copied in, not timed) after every rank's thread
//! has met at a barrier, and ends when the rank's stream is done (the result is on the device).
//! The time of a call is the slowest rank's; the table gives the median. The first call of
//! each method is not timed (NCCL's and NVRTC's set-up; for cfc the first exchange, which sizes
//! the slots): it is the one whose error is checked, against the exact average of the inputs
//! computed on the host, with zero residuals. "call" is the median time until the engine's
//! `wait` returned to the caller, before the decoding on the GPU is done.
//!
//! NCCL picks its transport as usual: over NVLink between GPUs of one host, or over TCP with
//! `NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket` (what `scripts/gpu_setup.sh` calls
//! `$SOCK`), the stand-in for a network.

use super::{label, rank_input, ring_bytes, Args};
use cfc::engine::transport::local::LocalLinks;
use cfc::engine::transport::Links;
use cfc::engine::{BoundRule, Engine, Fallback, Job, Op, Options, Scale, Tensor};
use cfc::nccl::{Communicator, UniqueId};
use cfc::DType;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::io::{IsTerminal, Write};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

struct Row {
    size: usize,
    method: String,
    seconds: f64,
    call_seconds: Option<f64>,
    bytes_sent: u64,
    max_err_over_eps: Option<f64>,
}

/// One method's per-rank results: per-call seconds (and until the wait returned), bytes sent
/// per call, largest error of the first call over eps (rank 0 only), and for `cfc-auto` whether
/// the engine chose to compress.
type Timing = (Vec<f64>, Vec<f64>, u64, Option<f64>, Option<bool>);

enum Method {
    Plain(DType),
    /// The bound (x RMS), and whether with the trial of `fallback` auto.
    Cfc(f64, bool),
}

/// Timed calls of each way in `cfc-auto`'s trial.
const TRIALS: u32 = 3;

fn name(m: &Method) -> String {
    match m {
        Method::Plain(DType::F32) => "nccl-fp32".into(),
        Method::Plain(_) => "nccl-bf16".into(),
        Method::Cfc(b, false) => format!("cfc@{b}"),
        Method::Cfc(b, true) => format!("cfc-auto@{b}"),
    }
}

fn options(m: &Method, rms: f64) -> Options {
    let mut o = Options::new(BoundRule::Abs(1.0));
    o.min_compress_numel = 0;
    match m {
        Method::Plain(_) => o.fallback = Fallback::Always,
        Method::Cfc(b, auto) => {
            o.bound = BoundRule::Abs(b * rms);
            if *auto {
                o.fallback = Fallback::Auto {
                    trial_steps: 2 * TRIALS,
                };
            }
        }
    }
    o
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

fn ptr(d: &CudaSlice<u8>, s: &Arc<CudaStream>) -> u64 {
    d.device_ptr(s).0
}

/// Times one method at one size on this rank. Rank 0 also checks the first cfc call's error.
#[allow(clippy::too_many_arguments)]
fn one_size(
    engine: &Engine,
    stream: &Arc<CudaStream>,
    barrier: &Barrier,
    m: &Method,
    x: &[f32],
    exact: Option<&[f64]>,
    rms: f64,
    iters: usize,
    chunk_numel: usize,
) -> Result<Timing, String> {
    let n = x.len();
    let dtype = match m {
        Method::Plain(d) => *d,
        Method::Cfc(..) => DType::F32,
    };
    let bytes: Vec<u8> = match dtype {
        DType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        _ => x
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
    };
    let pristine = stream.clone_htod(&bytes).map_err(err)?;
    let mut work = stream.alloc_zeros::<u8>(bytes.len()).map_err(err)?;
    let residual = stream.alloc_zeros::<u8>(4 * n).map_err(err)?;
    drop(bytes);
    // Each size starts afresh: zero residuals, and the warm-up and trial again.
    engine.reset().map_err(err)?;
    let cu = stream.cu_stream() as u64;
    let (mut times, mut calls, mut sent, mut max_err) = (Vec::new(), Vec::new(), 0, None);
    // Untimed: the first call (set-up; its error is checked), and cfc-auto's trial.
    let untimed = match m {
        Method::Cfc(_, true) => 2 * TRIALS as usize + 1,
        _ => 1,
    };
    let size = dtype.size() as u64;
    let cfc = matches!(m, Method::Cfc(..));
    for i in 0..iters + untimed {
        stream.memcpy_dtod(&pristine, &mut work).map_err(err)?;
        stream.synchronize().map_err(err)?;
        let before = engine.stats().bytes_sent;
        barrier.wait();
        let t0 = Instant::now();
        let data = ptr(&work, stream);
        let res = ptr(&residual, stream);
        let chunks = n.div_ceil(chunk_numel).max(1);
        for c in 0..chunks {
            let lo = (c * chunk_numel) as u64;
            let len = (chunk_numel as u64).min(n as u64 - lo);
            let job = Job {
                key: c as u64,
                fingerprint: n as u64,
                data: Tensor {
                    addr: data + lo * size,
                    numel: len,
                    dtype,
                },
                residual: cfc.then_some(Tensor {
                    addr: res + 4 * lo,
                    numel: len,
                    dtype: DType::F32,
                }),
                op: Op::AllReduce,
                scale: Scale::Average,
                last: c + 1 == chunks,
                fresh_residual: false,
            };
            // SAFETY: `work` and `residual` hold `n` elements on this rank's device, read and
            // written by nothing else until the stream has passed the wait below.
            unsafe { engine.submit(job, cu) }.map_err(err)?;
        }
        engine.wait(cu).map_err(err)?;
        let returned = t0.elapsed().as_secs_f64();
        stream.synchronize().map_err(err)?;
        let dt = t0.elapsed().as_secs_f64();
        sent = engine.stats().bytes_sent - before;
        if i == 0 {
            if let (Method::Cfc(b, _), Some(exact)) = (m, exact) {
                let y: Vec<u8> = stream.clone_dtoh(&work).map_err(err)?;
                let eps = b * rms;
                max_err = Some(
                    y.chunks_exact(4)
                        .zip(exact)
                        .map(|(c, &e)| {
                            (f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64 - e).abs() / eps
                        })
                        .fold(0.0, f64::max),
                );
            }
        } else if i >= untimed {
            times.push(dt);
            calls.push(returned);
        }
    }
    let chosen = match m {
        Method::Cfc(_, true) => engine
            .state()
            .map_err(err)?
            .buckets
            .first()
            .and_then(|b| b.decision),
        _ => None,
    };
    Ok((times, calls, sent, max_err, chosen))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the GPU benchmark and prints its table (and JSON with `--json`).
pub fn run(args: &Args, base: &[f32], rms: f64, source: &str) -> Result<(), String> {
    let world = args.gpus;
    let have = cfc::cuda::device_count();
    if have < world {
        return Err(format!(
            "--gpu {world}: only {have} CUDA devices are visible"
        ));
    }
    let nccl = cfc::nccl::library().map_err(err)?;
    let (major, minor, patch) = nccl.version().map_err(err)?;
    let mut methods = vec![Method::Plain(DType::F32), Method::Plain(DType::BF16)];
    methods.extend(args.bounds.iter().map(|&b| Method::Cfc(b, false)));
    methods.extend(args.bounds.iter().map(|&b| Method::Cfc(b, true)));
    // An NCCL communicator per method (each engine has its own), and a failure board shared
    // by the threads of each method's engines.
    let ids = methods
        .iter()
        .map(|_| UniqueId::new().map_err(err))
        .collect::<Result<Vec<_>, _>>()?;
    let mut links: Vec<Vec<Option<LocalLinks>>> = (0..world).map(|_| Vec::new()).collect();
    for _ in &methods {
        for (rank, l) in LocalLinks::group(world, Duration::from_secs(300))
            .into_iter()
            .enumerate()
        {
            links[rank].push(Some(l));
        }
    }
    let barrier = Barrier::new(world);
    let total = args.sizes.len();
    let show = std::io::stderr().is_terminal();
    let progress = Mutex::new(0usize);
    let per_rank: Vec<Result<Vec<Vec<Timing>>, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = links
            .into_iter()
            .enumerate()
            .map(|(rank, mut links)| {
                let (barrier, methods, ids, progress) = (&barrier, &methods, &ids, &progress);
                s.spawn(move || -> Result<Vec<Vec<Timing>>, String> {
                    // A rank that fails would leave the others at the barrier: end the process.
                    let fail = |e: String| -> ! {
                        eprintln!("cfc-bench: rank {rank}: {e}");
                        std::process::exit(1)
                    };
                    let ctx = cfc::cuda::context(rank).unwrap_or_else(|e| fail(err(e)));
                    let stream = ctx.new_stream().unwrap_or_else(|e| fail(err(e)));
                    let engines: Vec<Engine> = methods
                        .iter()
                        .zip(ids)
                        .zip(links.iter_mut())
                        .map(|((m, id), l)| {
                            let l = l.take().unwrap_or_else(|| fail("no links".into()));
                            let comm = Communicator::new(rank, id, rank, world)
                                .unwrap_or_else(|e| fail(err(e)));
                            let control = l.control().clone();
                            Engine::on_cuda_nccl(
                                rank,
                                comm,
                                control,
                                Some(Box::new(l)),
                                options(m, rms),
                                0,
                                &[],
                            )
                            .unwrap_or_else(|e| fail(err(e)))
                        })
                        .collect();
                    let mut all = Vec::new();
                    for &size in &args.sizes {
                        let n = size / 4;
                        let x = rank_input(base, rank, n);
                        let exact: Option<Vec<f64>> = (rank == 0).then(|| {
                            let inputs: Vec<Vec<f32>> =
                                (0..world).map(|r| rank_input(base, r, n)).collect();
                            (0..n)
                                .map(|i| {
                                    inputs.iter().map(|v| v[i] as f64).sum::<f64>() / world as f64
                                })
                                .collect()
                        });
                        let mut per_method = Vec::new();
                        for (m, e) in methods.iter().zip(&engines) {
                            let t = one_size(
                                e,
                                &stream,
                                barrier,
                                m,
                                &x,
                                exact.as_deref(),
                                rms,
                                args.iters,
                                args.chunk_numel,
                            )
                            .unwrap_or_else(|e| fail(e));
                            per_method.push(t);
                        }
                        all.push(per_method);
                        if rank == 0 && show {
                            let mut done = progress.lock().unwrap_or_else(|p| p.into_inner());
                            *done += 1;
                            let filled = 30 * *done / total;
                            eprint!(
                                "\r[{}{}] {}/{total} {}",
                                "#".repeat(filled),
                                ".".repeat(30 - filled),
                                *done,
                                label(size)
                            );
                            if *done == total {
                                eprintln!();
                            }
                        }
                    }
                    for e in &engines {
                        let _ = e.close();
                    }
                    Ok(all)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a rank panicked".into())))
            .collect()
    });
    let per_rank = per_rank.into_iter().collect::<Result<Vec<_>, _>>()?;
    let mut rows = Vec::new();
    for (si, &size) in args.sizes.iter().enumerate() {
        for (mi, m) in methods.iter().enumerate() {
            let runs: Vec<&Timing> = per_rank.iter().map(|r| &r[si][mi]).collect();
            let slowest = (0..args.iters)
                .map(|i| runs.iter().map(|r| r.0[i]).fold(0.0, f64::max))
                .collect();
            let call = (!runs[0].1.is_empty()).then(|| {
                median(
                    (0..args.iters)
                        .map(|i| runs.iter().map(|r| r.1[i]).fold(0.0, f64::max))
                        .collect(),
                )
            });
            let ring = ring_bytes(size as u64, world);
            let plain_bytes = match m {
                Method::Plain(DType::F32) => ring,
                Method::Plain(_) => ring / 2,
                Method::Cfc(..) => runs[0].2,
            };
            let chose = match runs[0].4 {
                Some(true) => " (compressed)",
                Some(false) => " (plain)",
                None => "",
            };
            rows.push(Row {
                size,
                method: format!("{}{chose}", name(m)),
                seconds: median(slowest),
                call_seconds: call,
                bytes_sent: plain_bytes,
                max_err_over_eps: runs[0].3,
            });
        }
    }
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| "-".into());
    println!(
        "all-reduce (average) on {world} GPUs over NCCL {major}.{minor}.{patch} \
         (NCCL_P2P_DISABLE={} NCCL_SHM_DISABLE={} NCCL_NET={}); medians of {}, the slowest \
         rank's; cfc jobs of {} elements; data: {source}, RMS {rms:.3e}",
        env("NCCL_P2P_DISABLE"),
        env("NCCL_SHM_DISABLE"),
        env("NCCL_NET"),
        args.iters,
        args.chunk_numel
    );
    println!(
        "| size | method | time ms | algbw GB/s | busbw GB/s | vs fp32 | vs bf16 | bytes vs ring fp32 | max err / eps | call returns ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let bus = 2.0 * (world as f64 - 1.0) / world as f64;
    for r in &rows {
        let base_of = |m: &str| {
            rows.iter()
                .find(|p| p.size == r.size && p.method == m)
                .map_or(r.seconds, |p| p.seconds)
        };
        let ring = ring_bytes(r.size as u64, world);
        let algbw = r.size as f64 / r.seconds / 1e9;
        println!(
            "| {} | {} | {:.3} | {algbw:.1} | {:.1} | {:.2}x | {:.2}x | {} | {} | {} |",
            label(r.size),
            r.method,
            r.seconds * 1e3,
            algbw * bus,
            base_of("nccl-fp32") / r.seconds,
            base_of("nccl-bf16") / r.seconds,
            if ring == 0 {
                "-".into()
            } else {
                format!("{:.2}x fewer", ring as f64 / r.bytes_sent.max(1) as f64)
            },
            r.max_err_over_eps
                .map_or("-".to_string(), |e| format!("{e:.3}")),
            r.call_seconds
                .map_or("-".to_string(), |c| format!("{:.3}", c * 1e3)),
        );
    }
    if let Some(path) = &args.json {
        let body: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"gpus\": {world}, \"size\": {}, \"method\": \"{}\", \"seconds\": {:e}, \
                     \"call_seconds\": {}, \"bytes_sent\": {}, \"max_err_over_eps\": {}}}",
                    r.size,
                    r.method,
                    r.seconds,
                    r.call_seconds.map_or("null".into(), |c| format!("{c:e}")),
                    r.bytes_sent,
                    r.max_err_over_eps
                        .map_or("null".into(), |e| format!("{e:e}"))
                )
            })
            .collect();
        let text = format!(
            "{{\"iters\": {}, \"rms\": {rms:e}, \"nccl\": \"{major}.{minor}.{patch}\", \
             \"rows\": [\n{}\n]}}\n",
            args.iters,
            body.join(",\n")
        );
        std::fs::File::create(path)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        if let Some(png) = &args.png {
            super::draw_png(path, png)?;
        }
    }
    Ok(())
}
