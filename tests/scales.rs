//! Block scales (docs/FORMAT.md, "Block scales"): each block's step follows its own RMS, frames
//! record the steps, and codes of frames with the same scales add exactly.

use cfc::scales::{block_exponents, BlockScales, NO_EXPONENT};
use cfc::{
    compress, compress_scaled, compress_with_feedback, decompress, read_header, sum_frames, Bound,
    BoundMode, Codec, Coder, Codes, CompressOptions,
};

/// Values whose scale changes by orders of magnitude from block to block, as a gradient
/// bucket's parameters do.
fn uneven(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
            let scale = 10f64.powi(-(((i / 700) % 6) as i32));
            (u * scale) as f32
        })
        .collect()
}

fn rms(x: &[f32]) -> f64 {
    (x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64).sqrt()
}

fn opts(bound: Bound) -> CompressOptions {
    CompressOptions {
        threads: 1,
        ..CompressOptions::new(bound)
    }
}

#[test]
fn every_block_keeps_its_own_relative_precision() {
    let x = uneven(20_000, 1);
    let k = 0.3;
    let frame = compress(&x, &[x.len()], &opts(Bound::Rms { k, block_log2: 8 })).unwrap();
    let h = read_header(&frame).unwrap();
    assert_eq!(
        (h.mode, h.codec, h.block_log2),
        (BoundMode::Rms, Codec::Quantized, 8)
    );
    let (_, y) = decompress::<f32>(&frame).unwrap();
    let mut worst = 0f64;
    for (xs, ys) in x.chunks(256).zip(y.chunks(256)) {
        let r = rms(xs);
        let err = xs
            .iter()
            .zip(ys)
            .map(|(&a, &b)| (a as f64 - b as f64).abs())
            .fold(0.0, f64::max);
        assert!(err <= k * r, "error {err} above {k} x rms {r}");
        worst = worst.max(err / r);
    }
    // The bound is used: the worst block comes near k times its RMS, not far below it.
    assert!(worst > k / 4.0, "worst relative error {worst}");
    // One bound for the whole tensor would give the quiet blocks nothing but zeros.
    let whole = compress(&x, &[x.len()], &opts(Bound::Abs(k * rms(&x)))).unwrap();
    let (_, z) = decompress::<f32>(&whole).unwrap();
    let quiet = &x[5 * 700..6 * 700];
    assert!(z[5 * 700..6 * 700].iter().all(|&v| v == 0.0));
    assert!(y[5 * 700..6 * 700]
        .iter()
        .zip(quiet)
        .any(|(&v, &q)| v != 0.0 && v.signum() == q.signum()));
}

#[test]
fn given_scales_give_the_bytes_of_the_same_blocks_bound() {
    // An `rms` frame is the frame of its own scales given: the engine's path and the codec's
    // own write the same bytes.
    let x = uneven(5_000, 2);
    for coder in [Coder::Planes, Coder::Rice] {
        for log2 in [5u8, 8, 10, 12] {
            let o = CompressOptions {
                coder,
                ..opts(Bound::Rms {
                    k: 0.1,
                    block_log2: log2,
                })
            };
            let frame = compress(&x, &[x.len()], &o).unwrap();
            let exps = block_exponents(&x, None, log2);
            let (eps, s) = BlockScales::from_exponents(0.1, &exps, log2);
            let o = CompressOptions {
                coder,
                ..opts(Bound::Abs(eps))
            };
            let given = compress_scaled(&x, &[x.len()], &o, &s).unwrap();
            // (only the mode differs: abs where the scales were given)
            assert_eq!(given[8], BoundMode::Abs as u8);
            assert_eq!(frame[..8], given[..8]);
            assert_eq!(frame[9..], given[9..], "{coder:?} block 2^{log2}");
        }
    }
}

#[test]
fn rice_and_planes_decode_alike_and_threads_change_no_byte() {
    let x = uneven(70_000, 3);
    let b = Bound::Rms {
        k: 0.05,
        block_log2: 9,
    };
    let planes = compress(&x, &[x.len()], &opts(b)).unwrap();
    let rice = compress(
        &x,
        &[x.len()],
        &CompressOptions {
            coder: Coder::Rice,
            ..opts(b)
        },
    )
    .unwrap();
    assert_eq!(
        decompress::<f32>(&planes).unwrap().1,
        decompress::<f32>(&rice).unwrap().1
    );
    for coder in [Coder::Planes, Coder::Rice] {
        let one = compress(&x, &[x.len()], &CompressOptions { coder, ..opts(b) }).unwrap();
        let many = compress(
            &x,
            &[x.len()],
            &CompressOptions {
                coder,
                threads: 4,
                ..opts(b)
            },
        )
        .unwrap();
        assert_eq!(one, many);
    }
}

#[test]
fn frames_with_the_same_scales_add_exactly_and_others_are_refused() {
    let (a, b) = (uneven(3_000, 4), uneven(3_000, 5));
    let exps: Vec<u8> = block_exponents(&a, None, 8)
        .iter()
        .zip(block_exponents(&b, None, 8))
        .map(|(&p, q)| p.max(q))
        .collect();
    let (eps, s) = BlockScales::from_exponents(0.2, &exps, 8);
    let o = opts(Bound::Abs(eps));
    let fa = compress_scaled(&a, &[a.len()], &o, &s).unwrap();
    let fb = compress_scaled(&b, &[b.len()], &o, &s).unwrap();
    let (ca, cb) = (
        Codes::from_frame(&fa).unwrap(),
        Codes::from_frame(&fb).unwrap(),
    );
    assert_eq!(ca.scales.as_ref(), Some(&s));
    let sum = sum_frames(&[&fa, &fb], None).unwrap();
    let cs = Codes::from_frame(&sum).unwrap();
    assert_eq!(cs.scales.as_ref(), Some(&s));
    assert_eq!(read_header(&sum).unwrap().block_log2, 8);
    for i in 0..a.len() {
        assert_eq!(cs.codes[i], ca.codes[i] + cb.codes[i]);
    }
    let (_, y) = decompress::<f32>(&sum).unwrap();
    for (blk, ((ys, xa), xb)) in y
        .chunks(256)
        .zip(a.chunks(256))
        .zip(b.chunks(256))
        .enumerate()
    {
        let eps_b = eps * 2f64.powi(-(s.shifts[blk] as i32));
        for ((&v, &p), &q) in ys.iter().zip(xa).zip(xb) {
            let err = (v as f64 - (p as f64 + q as f64)).abs();
            assert!(
                err <= 2.0 * eps_b * (1.0 + 1e-6),
                "block {blk}: {err} > 2 x {eps_b}"
            );
        }
    }
    // Scales differ in one block: no sum.
    let mut other = s.clone();
    other.shifts[3] += 1;
    let own = compress_scaled(&b, &[b.len()], &o, &other).unwrap();
    let err = sum_frames(&[&fa, &own], None).unwrap_err().to_string();
    assert!(err.contains("block scales"), "{err}");
    // With and without scales: no sum either.
    let plain = compress(&b, &[b.len()], &o).unwrap();
    let err = sum_frames(&[&fa, &plain], None).unwrap_err().to_string();
    assert!(err.contains("block scales"), "{err}");
}

#[test]
fn error_feedback_carries_what_each_block_rounds_away() {
    let x = uneven(4_096, 6);
    let mut r = vec![0f32; x.len()];
    let mut sent = vec![0f64; x.len()];
    let b = Bound::Rms {
        k: 0.3,
        block_log2: 8,
    };
    for _ in 0..20 {
        let f = compress_with_feedback(&x, &mut r, &[x.len()], &opts(b)).unwrap();
        let (_, y) = decompress::<f32>(&f).unwrap();
        for (s, v) in sent.iter_mut().zip(y) {
            *s += v as f64;
        }
    }
    // What was sent over 20 steps is 20 x, up to the last residual.
    for ((&s, &v), &res) in sent.iter().zip(&x).zip(&r) {
        let want = 20.0 * v as f64;
        assert!(
            (s + res as f64 - want).abs() <= 1e-5 * want.abs().max(1e-3),
            "{s} {res} {want}"
        );
    }
}

#[test]
fn zeros_and_bad_scales() {
    // All zeros: no exponent anywhere, the frame is still valid and exact.
    let z = vec![0f32; 1000];
    let f = compress(
        &z,
        &[1000],
        &opts(Bound::Rms {
            k: 0.3,
            block_log2: 6,
        }),
    )
    .unwrap();
    assert_eq!(decompress::<f32>(&f).unwrap().1, z);
    assert_eq!(block_exponents(&z, None, 6), vec![NO_EXPONENT; 16]);
    // Bounds and block sizes out of range.
    for (k, log2) in [(0.0, 8u8), (1.0, 8), (f64::NAN, 8), (0.3, 4), (0.3, 25)] {
        assert!(compress(
            &z,
            &[1000],
            &opts(Bound::Rms {
                k,
                block_log2: log2
            })
        )
        .is_err());
    }
    // Given scales of the wrong length, too deep for the step, or with another bound.
    let x = uneven(1000, 7);
    let short = BlockScales {
        log2: 8,
        shifts: vec![0; 3],
    };
    assert!(compress_scaled(&x, &[1000], &opts(Bound::Abs(0.1)), &short).is_err());
    let deep = BlockScales {
        log2: 8,
        shifts: vec![255; 4],
    };
    assert!(compress_scaled(&x, &[1000], &opts(Bound::Abs(1e-300)), &deep).is_err());
    let fine = BlockScales {
        log2: 8,
        shifts: vec![1; 4],
    };
    assert!(compress_scaled(&x, &[1000], &opts(Bound::Rel(0.1)), &fine).is_err());
    // Fixed rate has no block scales.
    assert!(compress(&x, &[1000], &opts(Bound::Bits(8))).is_ok());
}
