//! Throughput of the CPU codec (GB/s of uncompressed input), one thread and all threads,
//! on gradient-like data (Laplace-distributed, heavy-tailed) at eps = 0.1 x RMS.

// criterion's macros generate undocumented items.
#![allow(missing_docs)]

use cfc::{compress, decompress, Bound, CompressOptions};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::Rng;
use rand::SeedableRng;
use rand_distr::{Distribution, Exp};

fn gradient_like(n: usize) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    // Laplace: an exponential magnitude with a random sign.
    let d = Exp::new(1e4f64).expect("valid rate");
    (0..n)
        .map(|_| {
            let m = d.sample(&mut rng) as f32;
            if rng.gen::<bool>() {
                m
            } else {
                -m
            }
        })
        .collect()
}

fn rms(x: &[f32]) -> f64 {
    (x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / x.len() as f64).sqrt()
}

fn bench(c: &mut Criterion) {
    let n = 16 << 20; // 64 MB of float32
    let x = gradient_like(n);
    let eps = 0.1 * rms(&x);
    let mut g = c.benchmark_group("codec_f32_64MB");
    g.throughput(Throughput::Bytes((n * 4) as u64));
    g.sample_size(10);
    for threads in [1usize, 0] {
        let label = if threads == 1 {
            "1 thread"
        } else {
            "all threads"
        };
        let opts = CompressOptions {
            bound: Bound::Abs(eps),
            threads,
            ..CompressOptions::new(Bound::Abs(eps))
        };
        g.bench_with_input(BenchmarkId::new("compress", label), &opts, |b, o| {
            b.iter(|| compress(&x, &[n], o).expect("compress"))
        });
        let frame = compress(&x, &[n], &opts).expect("compress");
        let mut out = vec![0u8; n * 4];
        g.bench_with_input(BenchmarkId::new("decompress", label), &threads, |b, &t| {
            b.iter(|| cfc::decompress_into_bytes(&frame, &mut out, t).expect("decompress"))
        });
    }
    let frame = compress(&x, &[n], &CompressOptions::new(Bound::Abs(eps))).expect("compress");
    g.bench_function("decompress_alloc", |b| {
        b.iter(|| decompress::<f32>(&frame).expect("decompress"))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
