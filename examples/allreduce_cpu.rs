//! The compressed all-reduce on the CPU: ranks are threads linked by the in-process transport
//! (the algorithm the NCCL transport will run). Each rank contributes a different one of the
//! real gradient vectors (`../shared/data/grads`, or the folder given as the first argument);
//! for 2, 4 and 8 ranks and eps = 0.3 / 0.1 x (median RMS of the vectors) this prints the bytes
//! each rank sends against
//! a ring all-reduce of the raw float32, the largest error against the documented bound, and
//! the wall time of one call next to an uncompressed all-gather-and-sum over the same transport.
//!
//! Run: `cargo run --release --example allreduce_cpu [-- DIR]`

use cfc::collective::{allreduce, AllReduceOptions, InProcess, Transport};
use cfc::Bound;
use std::time::{Duration, Instant};

#[path = "shared/grads.rs"]
mod grads;
use grads::{grads_dir_from_args, read_grads, rms};

fn main() {
    let grads: Vec<Vec<f32>> = read_grads(&grads_dir_from_args())
        .expect("gradient vectors")
        .into_iter()
        .map(|(_, g)| g)
        .collect();
    let n = grads[0].len();
    // One eps for all ranks: a multiple of the median of the vectors' own RMS (the pooled RMS
    // would be dominated by the heavy-tailed vector and flatter the ratio).
    let mut rmss: Vec<f64> = grads.iter().map(|g| rms(g)).collect();
    rmss.sort_by(f64::total_cmp);
    let rms = rmss[rmss.len() / 2];
    println!(
        "{} vectors of {n} float32; median RMS {rms:.3e}; rank r sends vector r mod {}",
        grads.len(),
        grads.len()
    );
    println!("| ranks | eps / RMS | bytes sent vs ring | max err / bound | cfc ms | plain ms |");
    println!("|---|---|---|---|---|---|");
    for world in [2usize, 4, 8] {
        let input = |r: usize| &grads[r % grads.len()];
        let exact: Vec<f64> = (0..n)
            .map(|i| (0..world).map(|r| input(r)[i] as f64).sum())
            .collect();
        for k in [0.3, 0.1] {
            let opts = AllReduceOptions {
                bound: Bound::Abs(k * rms),
                average: false,
                zstd_level: None,
            };
            let endpoints = InProcess::group(world, Duration::from_secs(60));
            let results: Vec<_> = std::thread::scope(|s| {
                let hs: Vec<_> = endpoints
                    .into_iter()
                    .map(|mut t| {
                        s.spawn(move || {
                            let x = input(t.rank());
                            allreduce(&mut t, x, None, &opts).expect("warm-up");
                            let t0 = Instant::now();
                            let (y, report) = allreduce(&mut t, x, None, &opts).expect("allreduce");
                            let cfc_ms = t0.elapsed().as_secs_f64() * 1e3;
                            // The uncompressed baseline over the same transport: gather, then sum.
                            let t0 = Instant::now();
                            let all = t
                                .all_gather(bytemuck::cast_slice(x).to_vec())
                                .expect("gather");
                            let mut sum = vec![0f32; x.len()];
                            for part in &all {
                                for (s, c) in sum.iter_mut().zip(part.chunks_exact(4)) {
                                    *s += f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                                }
                            }
                            let plain_ms = t0.elapsed().as_secs_f64() * 1e3;
                            (y, report, cfc_ms, plain_ms)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().expect("rank")).collect()
            });
            let (y, report, cfc_ms, plain_ms) = &results[0];
            let worst = y
                .iter()
                .zip(&exact)
                .map(|(&a, &e)| (a as f64 - e).abs() / report.bound)
                .fold(0.0, f64::max);
            println!(
                "| {world} | {k} | {:.2}x fewer | {worst:.4} | {cfc_ms:.1} | {plain_ms:.1} |",
                report.bytes_uncompressed as f64 / report.bytes_sent as f64
            );
        }
    }
}
