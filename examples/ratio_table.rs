//! Ratio table on the real gradient vectors (`../shared/data/grads/*.npy`, or the folder given
//! as the first argument): cfc at eps = 0.01, 0.1 and 0.3 x RMS with and without its zstd
//! stage, next to zstd level 1 on the raw bytes and a plain "sign + per-32-value bit width +
//! 1 byte header" packing. Every element is checked against the bound in f64, and one-thread
//! throughput is timed on the same data.
//!
//! Run: `cargo run --release --example ratio_table [-- DIR]`

use cfc::{compress, decompress, Bound, CompressOptions};
use std::time::Instant;

#[path = "shared/grads.rs"]
mod grads;
use grads::{grads_dir_from_args, read_grads, rms};

/// Bytes of the simple packing of ANCHORS.md: per 32 values one header byte, then for each value a
/// sign bit and the group's magnitude width.
fn simple_estimate(x: &[f32], eps: f64) -> usize {
    let step = 2.0 * eps;
    let bits: usize = x
        .chunks(32)
        .map(|g| {
            let m = g
                .iter()
                .map(|&v| ((v as f64) / step).round().abs() as u64)
                .max()
                .unwrap_or(0);
            let w = 64 - m.leading_zeros() as usize;
            8 + 32 * (w + usize::from(w > 0))
        })
        .sum();
    bits.div_ceil(8)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = grads_dir_from_args();
    let data = read_grads(&dir)?;
    let total_in: usize = data.iter().map(|(_, x)| x.len() * 4).sum();
    let zraw: usize = data
        .iter()
        .map(|(_, x)| zstd::bulk::compress(bytemuck::cast_slice(x), 1).map(|z| z.len()))
        .sum::<Result<usize, _>>()?;
    println!(
        "{} vectors, {:.1} MB of float32 from {}",
        data.len(),
        total_in as f64 / 1e6,
        dir.display()
    );
    println!(
        "zstd -1 on the raw bytes: {:.2}x\n",
        total_in as f64 / zraw as f64
    );
    println!("| eps / RMS | cfc | cfc + zstd-1 | simple packing | violations | max err / eps | compress 1T GB/s | decompress 1T GB/s |");
    println!("|---|---|---|---|---|---|---|---|");
    for k in [0.3, 0.1, 0.01] {
        let (mut plain, mut with_z, mut simple, mut violations, mut worst) =
            (0usize, 0usize, 0usize, 0usize, 0f64);
        let (mut tc, mut td) = (0f64, 0f64);
        let mut per_vector = Vec::new();
        for (name, x) in &data {
            let eps = k * rms(x);
            let opts = CompressOptions {
                bound: Bound::Abs(eps),
                threads: 1,
                ..CompressOptions::new(Bound::Abs(eps))
            };
            let t0 = Instant::now();
            let frame = compress(x, &[x.len()], &opts)?;
            tc += t0.elapsed().as_secs_f64();
            let t0 = Instant::now();
            let (h, y) = decompress::<f32>(&frame)?;
            td += t0.elapsed().as_secs_f64();
            for (a, b) in x.iter().zip(&y) {
                let e = (*a as f64 - *b as f64).abs();
                worst = worst.max(e / h.eps);
                violations += usize::from(e.is_nan() || e > h.eps);
            }
            let zframe = compress(
                x,
                &[x.len()],
                &CompressOptions {
                    zstd_level: Some(1),
                    ..opts
                },
            )?;
            plain += frame.len();
            with_z += zframe.len();
            simple += simple_estimate(x, eps);
            per_vector.push(format!(
                "{name} {:.2}/{:.2}",
                (x.len() * 4) as f64 / frame.len() as f64,
                (x.len() * 4) as f64 / zframe.len() as f64
            ));
        }
        let r = |b: usize| total_in as f64 / b as f64;
        println!(
            "| {k} | {:.2}x | {:.2}x | {:.2}x | {violations} | {worst:.4} | {:.2} | {:.2} |",
            r(plain),
            r(with_z),
            r(simple),
            total_in as f64 / tc / 1e9,
            total_in as f64 / td / 1e9
        );
        eprintln!(
            "  per vector at {k} x RMS (cfc / cfc+zstd): {}",
            per_vector.join(", ")
        );
    }
    Ok(())
}
