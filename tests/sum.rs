//! Summable codes: frames quantized with the same step add exactly as integers, and the decoded
//! sum stays within the sum of the bounds of the exact sum (plus the final rounding).

mod common;

use cfc::{
    compress, decompress, sum_frames, Bound, BoundMode, Codec, Codes, CompressOptions, DType, Error,
};
use common::{gen, inf, nans, Dist, Float};
use half::{bf16, f16};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use std::collections::BTreeSet;

/// `k` tensors of `n` values, Laplace-distributed, with NaN/Inf/-0.0 sprinkled in if asked.
fn parts<T: Float>(k: usize, n: usize, seed: u64, specials: bool) -> Vec<Vec<T>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..k)
        .map(|p| {
            let mut x: Vec<T> = gen(Dist::Laplace, n, 1.0, seed.wrapping_add(p as u64));
            if specials && n > 0 {
                for _ in 0..=n / 50 {
                    let i = rng.gen_range(0..n);
                    x[i] = match rng.gen_range(0..4) {
                        0 => nans::<T>()[rng.gen_range(0..4)],
                        1 => inf::<T>(false),
                        2 => inf::<T>(true),
                        _ => T::from_f64(-0.0),
                    };
                }
            }
            x
        })
        .collect()
}

/// Allowed distance of a decoded sum from the exact one beyond the summed bound: half an ulp
/// of the element type for the final rounding (plus half an f32 ulp for the f32 step that
/// 16-bit decoding goes through), and f64 rounding of the codes' arithmetic.
fn rounding_slack<T: Float>(magnitude: f64, abs_sum: f64) -> f64 {
    let mut s = 0.5 * T::ulp(magnitude);
    if T::BITS != 32 {
        s += 0.5 * f32::ulp(magnitude);
    }
    s + abs_sum * 4.0 * f64::EPSILON
}

fn sum_case<T: Float>(
    k: usize,
    n: usize,
    seed: u64,
    eps: f64,
    specials: bool,
    zstd_level: Option<i32>,
) -> Result<(), TestCaseError> {
    let xs = parts::<T>(k, n, seed, specials);
    let opts = CompressOptions {
        bound: Bound::Abs(eps),
        zstd_level,
        threads: 1,
        ..CompressOptions::new(Bound::Abs(eps))
    };
    let frames: Vec<Vec<u8>> = xs
        .iter()
        .map(|x| compress(x, &[n], &opts).expect("compresses"))
        .collect();
    let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_slice()).collect();
    let summed = sum_frames(&refs, zstd_level).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let (h, y) = decompress::<T>(&summed).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let eps_sum: f64 = (0..k).map(|_| eps).sum();
    prop_assert_eq!(h.mode, BoundMode::Sum);
    prop_assert_eq!(h.eps, eps_sum);
    prop_assert_eq!(h.step, 2.0 * eps);
    prop_assert_eq!(h.n, n as u64);

    for i in 0..n {
        let exact: f64 = xs.iter().map(|x| x[i].to_f64()).sum();
        let got = y[i].to_f64();
        if xs.iter().all(|x| x[i].is_finite()) {
            let abs_sum: f64 = xs.iter().map(|x| x[i].to_f64().abs()).sum();
            let tol = eps_sum + rounding_slack::<T>(exact.abs() + eps_sum, abs_sum);
            prop_assert!(
                (got - exact).abs() <= tol,
                "{} k={} i={}: got {} exact {} (err {:e} > {:e})",
                T::name(),
                k,
                i,
                got,
                exact,
                (got - exact).abs(),
                tol
            );
        } else if exact.is_nan() {
            prop_assert!(got.is_nan(), "{} i={}: {} should be NaN", T::name(), i, got);
        } else {
            prop_assert_eq!(got, exact, "{} i={}: infinity lost", T::name(), i);
        }
    }

    // Codes add exactly, as integers; exceptions are the union of the parts'.
    let cs: Vec<Codes> = frames
        .iter()
        .map(|f| Codes::from_frame(f).expect("codes"))
        .collect();
    let s = Codes::sum(&cs).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let exc: BTreeSet<u64> = cs
        .iter()
        .flat_map(|c| c.exceptions.iter().map(|&(i, _)| i))
        .collect();
    prop_assert_eq!(
        s.exceptions.iter().map(|&(i, _)| i).collect::<Vec<_>>(),
        exc.iter().copied().collect::<Vec<_>>()
    );
    for i in 0..n {
        let want: i64 = if exc.contains(&(i as u64)) {
            0
        } else {
            cs.iter().map(|c| c.codes[i]).sum()
        };
        prop_assert_eq!(s.codes[i], want, "code {}", i);
    }
    prop_assert_eq!(s.step, cs[0].step);
    prop_assert_eq!(s.eps, eps_sum);
    // sum_frames is Codes::sum packed; packing is lossless.
    prop_assert_eq!(&Codes::from_frame(&summed).expect("codes"), &s);
    prop_assert_eq!(
        &Codes::from_frame(&s.to_frame(Some(1)).expect("packs")).expect("codes"),
        &s
    );
    Ok(())
}

fn sum_cases() -> ProptestConfig {
    ProptestConfig {
        cases: 500,
        ..ProptestConfig::default()
    }
}

macro_rules! sum_props {
    ($name:ident, $t:ty) => {
        proptest! {
            #![proptest_config(sum_cases())]
            #[test]
            fn $name(
                k in 1usize..=8,
                n in prop_oneof![
                    prop::sample::select(vec![0usize, 1, 31, 32, 33, 1000, 5000]),
                    0usize..2000,
                ],
                seed in any::<u64>(),
                eps in prop::sample::select(vec![1e-4, 1e-3, 1e-2, 0.1, 0.5]),
                specials in any::<bool>(),
                zstd_level in prop::option::of(Just(1)),
            ) {
                sum_case::<$t>(k, n, seed, eps, specials, zstd_level)?;
            }
        }
    };
}

sum_props!(sum_within_summed_bound_f32, f32);
sum_props!(sum_within_summed_bound_bf16, bf16);
sum_props!(sum_within_summed_bound_f16, f16);

fn codes_strategy() -> impl Strategy<Value = Codes> {
    (
        prop::sample::select(vec![DType::F32, DType::BF16, DType::F16]),
        prop::collection::vec(
            prop_oneof![
                4 => -100i64..100,
                1 => any::<i64>(),
                1 => prop::sample::select(vec![i64::MIN, i64::MAX, i64::MIN + 1, -1, 1 << 40]),
            ],
            0..300,
        ),
        prop::collection::vec((any::<prop::sample::Index>(), any::<u32>()), 0..20),
        prop::sample::select(vec![1e-30, 0.5, 3.0]),
    )
        .prop_map(|(dtype, mut codes, exc, step)| {
            let mask = if dtype == DType::F32 {
                u32::MAX
            } else {
                0xffff
            };
            let mut exceptions: Vec<(u64, u32)> = if codes.is_empty() {
                vec![]
            } else {
                exc.iter()
                    .map(|(ix, b)| (ix.index(codes.len()) as u64, b & mask))
                    .collect()
            };
            exceptions.sort_unstable_by_key(|e| e.0);
            exceptions.dedup_by_key(|e| e.0);
            for &(i, _) in &exceptions {
                codes[i as usize] = 0;
            }
            Codes {
                scales: None,
                dtype,
                shape: vec![codes.len() as u64],
                step,
                eps: step / 2.0,
                codes,
                exceptions,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    /// Any codes (up to the full 64-bit range) survive to_frame / from_frame unchanged.
    #[test]
    fn to_frame_from_frame_is_identity(c in codes_strategy(), zstd in prop::option::of(-3i32..4)) {
        let f = c.to_frame(zstd).expect("packs");
        let back = Codes::from_frame(&f).expect("reads back");
        prop_assert_eq!(&back, &c);
        let h = cfc::validate(&f).expect("valid frame");
        prop_assert_eq!(h.mode, BoundMode::Sum);
        prop_assert_eq!(h.n_exceptions, c.exceptions.len() as u64);
    }
}

#[test]
fn codes_of_compressed_frames_round_trip() {
    for (k, dist) in [Dist::Gaussian, Dist::Specials, Dist::AnyBits, Dist::Sparse]
        .into_iter()
        .enumerate()
    {
        let x: Vec<f32> = gen(dist, 3000, 1.0, k as u64);
        for zstd_level in [None, Some(1)] {
            let opts = CompressOptions {
                zstd_level,
                ..CompressOptions::new(Bound::Abs(1e-3))
            };
            let f = compress(&x, &[3, 1000], &opts).expect("ok");
            let c = Codes::from_frame(&f).expect("codes");
            assert_eq!(c.shape, vec![3, 1000]);
            let again = Codes::from_frame(&c.to_frame(zstd_level).expect("packs")).expect("codes");
            assert_eq!(again, c, "{dist:?}");
            // The repacked frame decodes to exactly the original frame's values.
            let (_, y0) = decompress::<f32>(&f).expect("decodes");
            let (_, y1) = decompress::<f32>(&c.to_frame(None).expect("packs")).expect("decodes");
            let b0: Vec<u32> = y0.iter().map(|v| v.to_bits()).collect();
            let b1: Vec<u32> = y1.iter().map(|v| v.to_bits()).collect();
            assert_eq!(b0, b1, "{dist:?}");
        }
    }
}

#[test]
fn nan_and_inf_propagate() {
    let nan = f32::NAN;
    let pinf = f32::INFINITY;
    let ninf = f32::NEG_INFINITY;
    // Enough zeros that the frames are quantized, with the specials at the front.
    let mut a = vec![0.0f32; 200];
    let mut b = vec![0.0f32; 200];
    let mut c = vec![0.0f32; 200];
    let cases: [(f32, f32, f32, f32); 8] = [
        (nan, 1.0, 2.0, nan),
        (pinf, 1.0, 2.0, pinf),
        (ninf, 0.5, 0.0, ninf),
        (pinf, ninf, 0.0, nan),
        (pinf, pinf, 1.0, pinf),
        (ninf, nan, pinf, nan),
        (-0.0, -0.0, -0.0, 0.0),
        (3e38, 3e38, 0.0, pinf), // exceptions (beyond the code range) whose sum overflows
    ];
    for (i, &(p, q, r, _)) in cases.iter().enumerate() {
        a[i] = p;
        b[i] = q;
        c[i] = r;
    }
    let o = CompressOptions::new(Bound::Abs(0.25));
    let fa = compress(&a, &[200], &o).expect("ok");
    let fb = compress(&b, &[200], &o).expect("ok");
    let fc = compress(&c, &[200], &o).expect("ok");
    let s = sum_frames(&[&fa, &fb, &fc], None).expect("sums");
    let (h, y) = decompress::<f32>(&s).expect("decodes");
    assert_eq!(h.eps, 0.75);
    for (i, &(.., want)) in cases.iter().enumerate() {
        if want.is_nan() {
            assert!(y[i].is_nan(), "case {i}: {}", y[i]);
        } else {
            assert_eq!(y[i], want, "case {i}");
        }
    }
    // bfloat16 and float16 alike.
    fn typed<T: Float>() {
        let mut a = vec![T::from_f64(0.0); 100];
        let mut b = a.clone();
        a[0] = inf::<T>(false);
        b[0] = T::from_f64(1.0);
        a[1] = nans::<T>()[1];
        b[2] = inf::<T>(true);
        a[2] = inf::<T>(false);
        let o = CompressOptions::new(Bound::Abs(0.25));
        let fa = compress(&a, &[100], &o).expect("ok");
        let fb = compress(&b, &[100], &o).expect("ok");
        let (_, y) = decompress::<T>(&sum_frames(&[&fa, &fb], None).expect("sums")).expect("ok");
        assert_eq!(
            y[0].to_bits32(),
            inf::<T>(false).to_bits32(),
            "{}",
            T::name()
        );
        assert!(!y[1].is_finite() && y[1].to_f64().is_nan(), "{}", T::name());
        assert!(y[2].to_f64().is_nan(), "{}: inf - inf", T::name());
    }
    typed::<bf16>();
    typed::<f16>();
}

#[test]
fn incompatible_frames_are_refused() {
    let x: Vec<f32> = gen(Dist::Gaussian, 6, 1.0, 1);
    let o = CompressOptions::new(Bound::Abs(0.01));
    let f = compress(&x, &[6], &o).expect("ok");
    let f23 = compress(&x, &[2, 3], &o).expect("ok");
    let f7 = compress(&gen::<f32>(Dist::Gaussian, 7, 1.0, 1), &[7], &o).expect("ok");
    let fstep = compress(&x, &[6], &CompressOptions::new(Bound::Abs(0.02))).expect("ok");
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let fb = compress(&xb, &[6], &o).expect("ok");
    let fh = compress(
        &x.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>(),
        &[6],
        &o,
    )
    .expect("ok");
    let check = |frames: &[&[u8]], what: &str| {
        let r = sum_frames(frames, None);
        assert!(
            matches!(&r, Err(Error::Incompatible { what: w, .. }) if *w == what),
            "{what}: {r:?}"
        );
        let cs: Vec<Codes> = frames
            .iter()
            .map(|f| Codes::from_frame(f).expect("codes"))
            .collect();
        let r = Codes::sum(&cs);
        assert!(
            matches!(&r, Err(Error::Incompatible { what: w, .. }) if *w == what),
            "{what}: {r:?}"
        );
    };
    check(&[&f, &fb], "dtype");
    check(&[&fb, &fh], "dtype");
    check(&[&f, &f, &fh], "dtype");
    check(&[&f, &f23], "shape");
    check(&[&f, &f7], "shape");
    check(&[&f, &fstep], "step");
    check(&[&f, &f, &f, &fstep], "step");
    check(&[], "count");
    // Bounds in Rel mode give different steps for different tensors.
    let r1 = compress(&x, &[6], &CompressOptions::new(Bound::Rel(0.01))).expect("ok");
    let x2: Vec<f32> = x.iter().map(|v| v * 2.0).collect();
    let r2 = compress(&x2, &[6], &CompressOptions::new(Bound::Rel(0.01))).expect("ok");
    check(&[&r1, &r2], "step");
    // The same frames are fine on their own.
    sum_frames(&[&f, &f, &f], None).expect("same step sums");
}

#[test]
fn raw_and_quantized_frames_sum() {
    // At eps 1e-12 the Gaussian tensor is all exceptions and stored raw; the small multiples
    // of 1e-10 are quantized. Both have the same step, so they add.
    let mut noise: Vec<f32> = gen(Dist::Gaussian, 500, 1.0, 4);
    noise[3] = f32::NAN;
    noise[4] = f32::NEG_INFINITY;
    let smooth: Vec<f32> = (0..500).map(|i| (i % 5) as f32 * 1e-10).collect();
    let o = CompressOptions::new(Bound::Abs(1e-12));
    let fr = compress(&noise, &[500], &o).expect("ok");
    let fq = compress(&smooth, &[500], &o).expect("ok");
    assert_eq!(cfc::read_header(&fr).expect("h").codec, Codec::Raw);
    assert_eq!(cfc::read_header(&fq).expect("h").codec, Codec::Quantized);
    let (h, y) = decompress::<f32>(&sum_frames(&[&fr, &fq], None).expect("sums")).expect("ok");
    assert_eq!(h.eps, 2e-12);
    for i in 0..500 {
        let exact = noise[i] as f64 + smooth[i] as f64;
        if exact.is_nan() {
            assert!(y[i].is_nan());
        } else if exact.is_infinite() {
            assert_eq!(y[i] as f64, exact);
        } else {
            let tol = 2e-12 + rounding_slack::<f32>(exact.abs() + 2e-12, exact.abs());
            assert!((y[i] as f64 - exact).abs() <= tol, "i {i}");
        }
    }
}

#[test]
fn sums_of_sums_add_bounds() {
    let xs = parts::<f32>(4, 777, 42, false);
    let o = CompressOptions::new(Bound::Abs(0.05));
    let f: Vec<Vec<u8>> = xs
        .iter()
        .map(|x| compress(x, &[777], &o).expect("ok"))
        .collect();
    let s01 = sum_frames(&[&f[0], &f[1]], None).expect("ok");
    let s23 = sum_frames(&[&f[2], &f[3]], Some(3)).expect("ok");
    let s = sum_frames(&[&s01, &s23], None).expect("ok");
    let all = sum_frames(&[&f[0], &f[1], &f[2], &f[3]], None).expect("ok");
    // Integer addition is associative: the same codes either way.
    assert_eq!(
        Codes::from_frame(&s).expect("codes").codes,
        Codes::from_frame(&all).expect("codes").codes
    );
    let (h, y) = decompress::<f32>(&s).expect("ok");
    assert!((h.eps - 0.2).abs() < 1e-15);
    for i in 0..777 {
        let exact: f64 = xs.iter().map(|x| x[i] as f64).sum();
        let tol = h.eps + rounding_slack::<f32>(exact.abs() + h.eps, 100.0);
        assert!((y[i] as f64 - exact).abs() <= tol, "i {i}");
    }
    // One part: the sum decodes to the part's own values.
    let one = sum_frames(&[&f[0]], None).expect("ok");
    let (_, y1) = decompress::<f32>(&one).expect("ok");
    let (_, y0) = decompress::<f32>(&f[0]).expect("ok");
    assert_eq!(y1, y0);
}

#[test]
fn hand_built_codes_are_checked_before_use() {
    let good = Codes {
        scales: None,
        dtype: DType::F32,
        shape: vec![2, 2],
        step: 0.5,
        eps: 0.25,
        codes: vec![1, -2, 3, 0],
        exceptions: vec![(3, f32::NAN.to_bits())],
    };
    good.check().expect("consistent");
    let cases: Vec<(Codes, &str)> = vec![
        (
            Codes {
                scales: None,
                codes: vec![1, 2, 3],
                ..good.clone()
            },
            "does not hold",
        ),
        (
            Codes {
                scales: None,
                shape: vec![1; 9],
                codes: vec![0],
                exceptions: vec![],
                ..good.clone()
            },
            "dimensions",
        ),
        (
            Codes {
                scales: None,
                step: 0.0,
                ..good.clone()
            },
            "step",
        ),
        (
            Codes {
                scales: None,
                step: f64::NAN,
                ..good.clone()
            },
            "step",
        ),
        (
            Codes {
                scales: None,
                eps: -1.0,
                ..good.clone()
            },
            "eps",
        ),
        (
            Codes {
                scales: None,
                exceptions: vec![(4, 0)],
                ..good.clone()
            },
            "exception index 4",
        ),
        (
            Codes {
                scales: None,
                codes: vec![1, 0, 0, 0],
                exceptions: vec![(2, 0), (1, 0)],
                ..good.clone()
            },
            "exception index 1",
        ),
        (
            Codes {
                scales: None,
                codes: vec![1, 0, 0, 0],
                exceptions: vec![(2, 0), (2, 0)],
                ..good.clone()
            },
            "exception index 2",
        ),
        // A frame could not give these back: bits wider than the element are cut to it, and
        // the code at an exception is 0 there.
        (
            Codes {
                scales: None,
                dtype: DType::BF16,
                exceptions: vec![(3, 0x1_7fc0)],
                ..good.clone()
            },
            "wider than a 16-bit element",
        ),
        (
            Codes {
                scales: None,
                exceptions: vec![(2, 0)],
                ..good.clone()
            },
            "exception 2 has code 3",
        ),
    ];
    for (bad, what) in cases {
        for r in [
            bad.check().map(|_| ()),
            bad.to_frame(None).map(|_| ()),
            Codes::sum(&[good.clone(), bad.clone()]).map(|_| ()),
        ] {
            assert!(
                matches!(&r, Err(Error::InvalidCodes { reason }) if reason.contains(what)),
                "{what}: {r:?}"
            );
        }
    }
}

#[test]
fn an_exception_sum_is_rounded_through_f32_and_a_nan_is_the_quiet_nan() {
    // NaN payloads are the machine's business in IEEE arithmetic: a NaN sum is stored as the
    // dtype's quiet NaN (what the GPU writes too), whatever the parts' payloads and signs.
    let payload = f32::from_bits(0xffc0_1234); // negative, with a payload
    let mut a = vec![0.0f32; 64];
    let b = vec![0.0f32; 64];
    a[3] = payload;
    let o = CompressOptions::new(Bound::Abs(0.25));
    let fa = compress(&a, &[64], &o).expect("ok");
    let fb = compress(&b, &[64], &o).expect("ok");
    let (_, y) = decompress::<f32>(&sum_frames(&[&fa, &fb], None).expect("sums")).expect("ok");
    assert_eq!(y[3].to_bits(), 0x7fc0_0000);
    // bfloat16: 1 + 2^-8 + 2^-24 (exact in f64) would round up to 1 + 2^-7 in one step; the sum
    // takes the decode rule's route, to f32 first (1 + 2^-8: a tie, to even), then to bfloat16
    // (again a tie, to even: 1.0).
    let part = |bits: u32| Codes {
        scales: None,
        dtype: DType::BF16,
        shape: vec![2],
        step: 1.0,
        eps: 0.5,
        codes: vec![0, 1],
        exceptions: vec![(0, bits)],
    };
    let s = Codes::sum(&[part(0x3f80), part(0x3b80), part(0x3380)]).expect("sums");
    assert_eq!(s.exceptions, vec![(0, 0x3f80)]);
    assert_eq!(s.codes, vec![0, 3]);
}
