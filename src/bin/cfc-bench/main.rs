//! `cfc-bench`: cfc's compressed all-reduce against an uncompressed one, on the CPU.
//!
//! Ranks are threads of this process, each with an engine ([`cfc::engine::Engine`]) on the CPU
//! backend, linked by channels, so it runs on any machine. For each number of ranks and size it
//! times, on the same data:
//!
//! * `plain`: the engine's uncompressed all-reduce (`fallback` always: a reduce-scatter of
//!   float32 shards, then an all-gather of the averages, what a ring all-reduce sends);
//! * `cfc-rs@B` and `cfc-ag@B`: the engine with eps = B x RMS of the data, error feedback on,
//!   as a reduce-scatter of codes and as an all-gather of frames;
//! * with `--nodes N` (the ranks split into N emulated nodes, in rank order), also `cfc-2l@B`:
//!   the two-level exchange (plain inside each node, compressed between nodes), and a column of
//!   the bytes that leave each node per call (for `plain`, a ring's share).
//!
//! It prints median times (the slowest rank's), the bytes each rank sent against a ring
//! all-reduce of float32, and the largest error of a first call (zero residuals) over the
//! bound. The codec of each rank uses every core (as a training process would), while the
//! plain sum runs on the rank's thread: on a machine with fewer cores than ranks the times
//! mostly measure CPU contention.
//!
//! With `--gpu N` (a build with the `cuda` feature) it drives N local GPUs instead, a thread
//! each, with the engine on the CUDA backend over NCCL: plain `ncclAllReduce` of float32 and of
//! bfloat16 against cfc (see `gpu.rs`). `torchrun --nproc_per_node=N -m
//! cfc.bench` (the Python package) compares the same through PyTorch.
//!
//! Run: `cargo run --release --bin cfc-bench -- [--ranks 2,4,8] [--sizes 1M,4M,16M]
//! [--bounds 0.3,0.1] [--iters 5] [--nodes N] [--grads DIR] [--json FILE] [--png FILE]`, or with
//! the GPUs
//! `cargo run --release --features cuda --bin cfc-bench -- --gpu 2 [--chunk-numel 67108864] ...`
//!
//! `--png` draws the JSON's algbw against size with `python3 -m cfc.bench --plot` (the Python
//! package and matplotlib; `CFC_PYTHON` names another interpreter): one plotting code for both
//! benchmarks. Without `--json`, the JSON goes next to the PNG.

use cfc::engine::{
    Algorithm, BoundRule, Engine, Fallback, Job, Op, Options, Scale, Tensor, Topology,
};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Barrier;
use std::time::Instant;

#[cfg(feature = "cuda")]
mod gpu;
#[path = "../../../examples/shared/grads.rs"]
mod grads;

const USAGE: &str = "usage: cfc-bench [--ranks 2,4,8] [--sizes 1M,4M,16M] [--bounds 0.3,0.1] \
[--iters 5] [--nodes N] [--grads DIR] [--json FILE] [--png FILE] [--gpu N [--chunk-numel 67108864]]
Compressed all-reduce against an uncompressed one over threads (CPU engines linked by
channels), or with --gpu N over NCCL on N local GPUs, a thread each (a build with the cuda
feature). --nodes N splits the CPU ranks into N emulated nodes and adds cfc's two-level exchange.";

struct Args {
    ranks: Vec<usize>,
    sizes: Vec<usize>,
    bounds: Vec<f64>,
    iters: usize,
    grads: Option<PathBuf>,
    json: Option<PathBuf>,
    /// Where to draw the JSON's figures (through `python3 -m cfc.bench --plot`).
    png: Option<PathBuf>,
    /// GPUs to drive over NCCL (0: the CPU benchmark).
    gpus: usize,
    /// Elements per job of the GPU all-reduce (a tensor is cut into jobs of this many).
    chunk_numel: usize,
    /// Emulated nodes the CPU ranks are split into (1: one node).
    nodes: usize,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim().to_ascii_uppercase();
    let t = t.strip_suffix('B').unwrap_or(&t);
    let (num, scale) = match t.chars().last() {
        Some('K') => (&t[..t.len() - 1], 1usize << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    let v: f64 = num.parse().map_err(|_| format!("bad size {s:?}"))?;
    let bytes = (v * scale as f64) as usize;
    if bytes < 4 {
        return Err(format!("size {s:?} holds no float32"));
    }
    Ok(bytes)
}

fn list<T>(s: &str, f: impl Fn(&str) -> Result<T, String>) -> Result<Vec<T>, String> {
    s.split(',')
        .filter(|x| !x.trim().is_empty())
        .map(f)
        .collect()
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        ranks: vec![2, 4, 8],
        sizes: vec![1 << 20, 4 << 20, 16 << 20],
        bounds: vec![0.3, 0.1],
        iters: 5,
        grads: None,
        json: None,
        png: None,
        gpus: 0,
        chunk_numel: 1 << 26,
        nodes: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--ranks" => {
                a.ranks = list(&value, |x| {
                    x.trim()
                        .parse()
                        .ok()
                        .filter(|&r: &usize| (1..=64).contains(&r))
                        .ok_or(format!("bad rank count {x:?} (1 to 64)"))
                })?
            }
            "--sizes" => a.sizes = list(&value, parse_size)?,
            "--bounds" => {
                a.bounds = list(&value, |x| {
                    x.trim()
                        .parse()
                        .ok()
                        .filter(|b: &f64| *b > 0.0 && b.is_finite())
                        .ok_or(format!("bad bound {x:?}"))
                })?
            }
            "--iters" => {
                a.iters = value
                    .parse()
                    .ok()
                    .filter(|&i| i > 0)
                    .ok_or("--iters needs a positive number")?
            }
            "--grads" => a.grads = Some(value.into()),
            "--json" => a.json = Some(value.into()),
            "--png" => a.png = Some(value.into()),
            "--gpu" => {
                a.gpus = value
                    .parse()
                    .ok()
                    .filter(|&g| (1..=64).contains(&g))
                    .ok_or("--gpu needs a GPU count (1 to 64)")?
            }
            "--nodes" => {
                a.nodes = value
                    .parse()
                    .ok()
                    .filter(|&n| (1..=64).contains(&n))
                    .ok_or("--nodes needs a node count (1 to 64)")?
            }
            "--chunk-numel" => {
                a.chunk_numel = value
                    .parse::<usize>()
                    .ok()
                    .filter(|&m| m > 0)
                    .ok_or("--chunk-numel needs a positive element count")?
            }
            other => return Err(format!("unknown option {other}\n{USAGE}")),
        }
    }
    if a.json.is_none() {
        a.json = a.png.as_ref().map(|p| p.with_extension("json"));
    }
    if let Some(r) = a.ranks.iter().find(|&&r| r % a.nodes != 0) {
        return Err(format!("{r} ranks do not split into {} nodes", a.nodes));
    }
    Ok(a)
}

/// Draws `png` from the JSON at `json` with the Python package's plotting code.
fn draw_png(json: &std::path::Path, png: &std::path::Path) -> Result<(), String> {
    let python = std::env::var("CFC_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = std::process::Command::new(&python)
        .args(["-m", "cfc.bench", "--plot"])
        .arg(json)
        .arg("--png")
        .arg(png)
        .output()
        .map_err(|e| {
            format!(
                "cannot draw {}: {python} did not start ({e})",
                png.display()
            )
        })?;
    let why = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() || !png.is_file() {
        return Err(format!(
            "cannot draw {} with `{python} -m cfc.bench --plot` (it needs the cfc Python package \
             and matplotlib; the figures are in {}): {}",
            png.display(),
            json.display(),
            why.trim()
        ));
    }
    Ok(())
}

/// The data every rank tiles: the gradient vectors, each scaled to their median RMS (one bound
/// suits them all), concatenated; or Laplace noise. Returns it and its RMS.
fn base_data(dir: Option<&PathBuf>) -> Result<(Vec<f32>, f64, String), String> {
    let default = PathBuf::from("../shared/data/grads");
    let dir = dir.cloned().or_else(|| default.is_dir().then_some(default));
    let rms = |v: &[f32]| {
        (v.iter().map(|&x| x as f64 * x as f64).sum::<f64>() / v.len().max(1) as f64).sqrt()
    };
    match dir {
        Some(d) => {
            let vectors = grads::read_grads(&d)?;
            if vectors.is_empty() {
                return Err(format!("no .npy files in {}", d.display()));
            }
            let mut each: Vec<f64> = vectors.iter().map(|(_, v)| rms(v)).collect();
            let scales = each.clone();
            each.sort_by(f64::total_cmp);
            let target = each[each.len() / 2];
            let mut all = Vec::new();
            for ((_, v), r) in vectors.iter().zip(scales) {
                let k = if r > 0.0 { (target / r) as f32 } else { 1.0 };
                all.extend(v.iter().map(|&x| x * k));
            }
            Ok((all, target, d.display().to_string()))
        }
        None => {
            // Laplace(0, 1e-4) from a fixed xorshift stream: heavy-tailed like gradients
            let mut s = 0x9E37_79B9_7F4A_7C15u64;
            let v: Vec<f32> = (0..1 << 22)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    let u = ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
                    let m = -(1.0 - u).max(1e-300).ln() * 1e-4;
                    (if s & 1 == 0 { m } else { -m }) as f32
                })
                .collect();
            let r = rms(&v);
            Ok((v, r, "random (Laplace)".into()))
        }
    }
}

fn rank_input(base: &[f32], rank: usize, n: usize) -> Vec<f32> {
    let start = (rank * 1_000_003) % base.len();
    base.iter().cycle().skip(start).take(n).copied().collect()
}

struct Row {
    ranks: usize,
    size: usize,
    method: String,
    seconds: f64,
    bytes_sent: u64,
    ring_bytes: u64,
    /// Bytes out of each node per call (every rank's to other nodes, over the nodes).
    node_out: u64,
    max_err_over_eps: Option<f64>,
}

/// A method: `None` is plain (the uncompressed all-reduce), else the bound, the algorithm and
/// the topology.
type Method = Option<(f64, Algorithm, Topology)>;

/// Bytes each rank sends in a ring all-reduce of `bytes` over `world` ranks.
pub(crate) fn ring_bytes(bytes: u64, world: usize) -> u64 {
    let w = world.max(1) as u64;
    2 * (w - 1) * bytes.div_ceil(w)
}

/// Engine options for a method: `None` is plain (the uncompressed all-reduce), else the bound
/// and the algorithm; error feedback on, no warm-up, every size compressed.
pub(crate) fn method_options(bound: Option<(f64, Algorithm)>) -> Options {
    let mut o = Options::new(BoundRule::Abs(1.0));
    o.min_compress_numel = 0;
    match bound {
        None => o.fallback = Fallback::Always,
        Some((eps, algorithm)) => {
            o.bound = BoundRule::Abs(eps);
            o.algorithm = Some(algorithm);
        }
    }
    o
}

/// Rank `r`'s node when `world` ranks make `nodes` nodes, in rank order.
fn node_map(world: usize, nodes: usize) -> Vec<usize> {
    let per = (world / nodes.max(1)).max(1);
    (0..world).map(|r| r / per).collect()
}

/// Times `method` on `world` threads on `nodes` emulated nodes: returns (median of the slowest
/// rank's seconds, rank 0's bytes sent per call, bytes out of each node per call, largest error
/// of the first call over eps).
fn measure(
    world: usize,
    nodes: usize,
    base: &[f32],
    n: usize,
    iters: usize,
    method: Method,
    exact: &[f64],
) -> (f64, u64, u64, Option<f64>) {
    let cfc = method.map(|(eps, algorithm, _)| (eps, algorithm));
    let mut o = method_options(cfc);
    o.topology = method.map_or(Topology::Flat, |m| m.2);
    let engines = Engine::local_nodes(&node_map(world, nodes), o).expect("engines");
    let barrier = Barrier::new(world);
    let per_rank: Vec<(Vec<f64>, u64, u64, f64)> = std::thread::scope(|s| {
        let handles: Vec<_> = engines
            .iter()
            .map(|e| {
                let barrier = &barrier;
                s.spawn(move || {
                    let x = rank_input(base, e.rank(), n);
                    let mut y = x.clone();
                    let mut residual = vec![0f32; n];
                    let (mut times, mut sent, mut out, mut err) = (Vec::new(), 0, 0, 0.0f64);
                    for i in 0..=iters {
                        // call 0: the error check (zero residual) and the warm-up
                        y.copy_from_slice(&x);
                        let before = e.stats();
                        barrier.wait();
                        let t0 = Instant::now();
                        let job = Job {
                            key: 0,
                            fingerprint: 0,
                            data: Tensor {
                                addr: y.as_mut_ptr() as u64,
                                numel: n as u64,
                                dtype: cfc::DType::F32,
                            },
                            residual: cfc.map(|_| Tensor {
                                addr: residual.as_mut_ptr() as u64,
                                numel: n as u64,
                                dtype: cfc::DType::F32,
                            }),
                            op: Op::AllReduce,
                            scale: Scale::Average,
                            last: true,
                            fresh_residual: false,
                        };
                        // SAFETY: `y` and `residual` live, untouched, until the wait returns.
                        unsafe { e.submit(job, 0) }.expect("submit");
                        e.wait(0).expect("cfc all-reduce");
                        let dt = t0.elapsed().as_secs_f64();
                        let after = e.stats();
                        sent = after.bytes_sent - before.bytes_sent;
                        out = after.between_nodes - before.between_nodes;
                        if i == 0 {
                            if let Some((eps, _)) = cfc {
                                err = y
                                    .iter()
                                    .zip(exact)
                                    .map(|(&a, &e)| (a as f64 - e).abs() / eps)
                                    .fold(0.0, f64::max);
                            }
                        } else {
                            times.push(dt);
                        }
                    }
                    (times, sent, out, err)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    });
    let mut slowest: Vec<f64> = (0..iters)
        .map(|i| per_rank.iter().map(|r| r.0[i]).fold(0.0, f64::max))
        .collect();
    slowest.sort_by(f64::total_cmp);
    let err = per_rank.iter().map(|r| r.3).fold(0.0, f64::max);
    let out = per_rank.iter().map(|r| r.2).sum::<u64>() / nodes.max(1) as u64;
    (slowest[iters / 2], per_rank[0].1, out, cfc.map(|_| err))
}

fn label(bytes: usize) -> String {
    for (unit, s) in [("GB", 1usize << 30), ("MB", 1 << 20), ("KB", 1 << 10)] {
        if bytes >= s && bytes % s == 0 {
            return format!("{}{unit}", bytes / s);
        }
    }
    format!("{bytes}B")
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("cfc-bench: {e}");
            std::process::exit(2);
        }
    };
    let (base, rms, source) = match base_data(args.grads.as_ref()) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("cfc-bench: {e}");
            std::process::exit(2);
        }
    };
    if args.gpus > 0 {
        #[cfg(feature = "cuda")]
        let outcome = gpu::run(&args, &base, rms, &source);
        #[cfg(not(feature = "cuda"))]
        let outcome: Result<(), String> = Err("this cfc-bench was built without the cuda \
            feature: cargo build --release --features cuda --bin cfc-bench"
            .into());
        if let Err(e) = outcome {
            eprintln!("cfc-bench: {e}");
            std::process::exit(1);
        }
        return;
    }
    let mut methods: Vec<(String, Method)> = vec![("plain".into(), None)];
    for &b in &args.bounds {
        for (tag, algorithm) in [
            ("rs", Algorithm::ReduceScatter),
            ("ag", Algorithm::AllGather),
        ] {
            methods.push((
                format!("cfc-{tag}@{b}"),
                Some((b * rms, algorithm, Topology::Flat)),
            ));
        }
        if args.nodes > 1 {
            // (the algorithm of the rails: cfc's choice by their rank count)
            let rails = Algorithm::for_world(args.nodes);
            methods.push((
                format!("cfc-2l@{b}"),
                Some((b * rms, rails, Topology::TwoLevel)),
            ));
        }
    }
    let total = args.ranks.len() * args.sizes.len() * methods.len();
    let show = std::io::stderr().is_terminal();
    let mut done = 0;
    let mut rows = Vec::new();
    for &world in &args.ranks {
        for &size in &args.sizes {
            let n = size / 4;
            let inputs: Vec<Vec<f32>> = (0..world).map(|r| rank_input(&base, r, n)).collect();
            let exact: Vec<f64> = (0..n)
                .map(|i| inputs.iter().map(|x| x[i] as f64).sum::<f64>() / world as f64)
                .collect();
            drop(inputs);
            let ring_bytes = ring_bytes(size as u64, world);
            for (name, o) in &methods {
                let (seconds, sent, out, err) =
                    measure(world, args.nodes, &base, n, args.iters, *o, &exact);
                rows.push(Row {
                    ranks: world,
                    size,
                    method: name.clone(),
                    seconds,
                    bytes_sent: if o.is_some() { sent } else { ring_bytes },
                    ring_bytes,
                    node_out: out,
                    max_err_over_eps: err,
                });
                done += 1;
                if show {
                    let filled = 30 * done / total;
                    eprint!(
                        "\r[{}{}] {done}/{total} {world} ranks {} {name:<12}",
                        "#".repeat(filled),
                        ".".repeat(30 - filled),
                        label(size)
                    );
                    if done == total {
                        eprintln!();
                    }
                }
            }
        }
    }
    println!(
        "all-reduce (average) over threads (CPU engines linked by channels, {} cores); {} \
         emulated node(s); medians of {}; data: {source}, RMS {rms:.3e}; time: lower is better",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        args.nodes,
        args.iters
    );
    println!(
        "| ranks | size | method | time ms | vs plain | bytes sent vs ring | MB out of each node \
         | max err / eps |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let plain = rows
            .iter()
            .find(|p| p.ranks == r.ranks && p.size == r.size && p.method == "plain")
            .map_or(r.seconds, |p| p.seconds);
        let fewer = if r.ring_bytes == 0 || r.method == "plain" {
            "-".to_string() // one rank sends nothing; plain is the ring itself
        } else {
            format!(
                "{:.2}x fewer",
                r.ring_bytes as f64 / r.bytes_sent.max(1) as f64
            )
        };
        println!(
            "| {} | {} | {} | {:.2} | {:.2}x | {fewer} | {:.3} | {} |",
            r.ranks,
            label(r.size),
            r.method,
            r.seconds * 1e3,
            plain / r.seconds,
            r.node_out as f64 / 1e6,
            r.max_err_over_eps
                .map_or("-".to_string(), |e| format!("{e:.3}"))
        );
    }
    if let Some(path) = &args.json {
        let body: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"ranks\": {}, \"size\": {}, \"method\": \"{}\", \"seconds\": {:e}, \
                     \"bytes_sent\": {}, \"ring_bytes\": {}, \"node_out_bytes\": {}, \
                     \"max_err_over_eps\": {}}}",
                    r.ranks,
                    r.size,
                    r.method,
                    r.seconds,
                    r.bytes_sent,
                    r.ring_bytes,
                    r.node_out,
                    r.max_err_over_eps
                        .map_or("null".into(), |e| format!("{e:e}"))
                )
            })
            .collect();
        let text = format!(
            "{{\"iters\": {}, \"rms\": {rms:e}, \"rows\": [\n{}\n]}}\n",
            args.iters,
            body.join(",\n")
        );
        if let Err(e) = std::fs::File::create(path).and_then(|mut f| f.write_all(text.as_bytes())) {
            eprintln!("cfc-bench: cannot write {}: {e}", path.display());
            std::process::exit(1);
        }
        if let Some(png) = &args.png {
            if let Err(e) = draw_png(path, png) {
                eprintln!("cfc-bench: {e}");
                std::process::exit(1);
            }
        }
    }
}
