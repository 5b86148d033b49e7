//! The codec's promises, tested from outside: the strict bound `|decoded - x| <= header.eps`
//! (checked in `f64`) for every finite element, bit-exact NaN and infinities, identical bytes
//! whatever the thread count, the zstd stage, fixed-rate sizes, relative bounds, the real
//! gradient vectors, and one test for each error the API can return.

mod common;

use cfc::{
    compress, compress_bytes, decompress, decompress_into_bytes, fixed_rate_size, read_header,
    sum_frames, validate, Bound, BoundMode, Codec, Codes, CompressOptions, DType, Error,
    FormatError,
};
use common::{check, check_par, gen, max_finite_abs, natural_scale, Dist, Float, ALL_DISTS};
use half::{bf16, f16};
use proptest::prelude::*;

/// A bound, with absolute bounds given relative to the data's natural scale.
#[derive(Debug, Clone, Copy)]
enum BoundKind {
    Abs(f64),
    Rel(f64),
    Bits(u8),
    Rms(f64, u8),
}

fn bound_strategy() -> impl Strategy<Value = BoundKind> {
    prop_oneof![
        prop::sample::select(vec![1e-7, 1e-4, 1e-2, 0.1, 0.5, 3.0]).prop_map(BoundKind::Abs),
        prop::sample::select(vec![1e-7, 1e-5, 1e-3, 0.01, 0.1, 0.5]).prop_map(BoundKind::Rel),
        (2u8..=32).prop_map(BoundKind::Bits),
        (prop::sample::select(vec![1e-4, 0.05, 0.3, 0.9]), 5u8..=11)
            .prop_map(|(k, b)| BoundKind::Rms(k, b)),
    ]
}

fn len_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![
        prop::sample::select(vec![0usize, 1, 31, 32, 33, 1000, (1 << 16) + 7]),
        0usize..3000,
    ]
}

fn zstd_strategy() -> impl Strategy<Value = Option<i32>> {
    prop_oneof![3 => Just(None), 1 => prop::sample::select(vec![-5, 1, 3]).prop_map(Some)]
}

/// A shape holding `n` elements, of a kind picked by `kind` (scalar, 1-d, 2-d, 3-d, 8-d).
fn shape_for(n: usize, kind: u8, pick: usize) -> Vec<usize> {
    let divisors: Vec<usize> = (1..=n).filter(|d| n % d == 0).collect();
    let div = |k: usize| divisors[k % divisors.len()];
    match kind % 5 {
        _ if n == 0 => match kind % 3 {
            0 => vec![0],
            1 => vec![7, 0],
            _ => vec![3, 0, 2],
        },
        1 if n == 1 => vec![],
        0 | 1 => vec![n],
        2 => {
            let a = div(pick);
            vec![a, n / a]
        }
        3 => {
            let a = div(pick);
            let rest = n / a;
            let rd: Vec<usize> = (1..=rest).filter(|d| rest % d == 0).collect();
            let b = rd[(pick / 7) % rd.len()];
            vec![a, b, rest / b]
        }
        _ => {
            let mut s = vec![1usize; 8];
            s[pick % 8] = n;
            s
        }
    }
}

fn to_bound<T: Float>(bk: BoundKind, dist: Dist, scale: f64) -> Bound {
    match bk {
        BoundKind::Abs(m) => Bound::Abs(natural_scale::<T>(dist, scale) * m),
        BoundKind::Rel(r) => Bound::Rel(r),
        BoundKind::Bits(b) => Bound::Bits(b),
        BoundKind::Rms(k, block_log2) => Bound::Rms { k, block_log2 },
    }
}

/// Compresses and decompresses one case and checks everything the frame promises.
fn roundtrip_case<T: Float>(
    dist: Dist,
    n: usize,
    seed: u64,
    scale: f64,
    bk: BoundKind,
    zstd_level: Option<i32>,
    shape_kind: (u8, usize),
) -> Result<(), TestCaseError> {
    let x = gen::<T>(dist, n, scale, seed);
    let shape = shape_for(n, shape_kind.0, shape_kind.1);
    let bound = to_bound::<T>(bk, dist, scale);
    let opts = CompressOptions {
        zstd_level,
        threads: 1,
        ..CompressOptions::new(bound)
    };
    let frame = compress(&x, &shape, &opts).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let (h, y) = decompress::<T>(&frame).map_err(|e| TestCaseError::fail(e.to_string()))?;

    prop_assert_eq!(h.dtype, T::DTYPE);
    prop_assert_eq!(h.n, n as u64);
    prop_assert_eq!(
        &h.shape,
        &shape.iter().map(|&d| d as u64).collect::<Vec<_>>()
    );
    let c = check(&x, &y, h.eps);
    prop_assert_eq!(
        c.violations,
        0,
        "{} {:?} n={} {:?}: first violation at {:?}: {:?} -> {:?}, eps {}",
        T::name(),
        dist,
        n,
        bound,
        c.first,
        c.first.map(|i| x[i]),
        c.first.map(|i| y[i]),
        h.eps
    );

    let nonfinite = x.iter().filter(|v| !v.is_finite()).count() as u64;
    match bound {
        Bound::Abs(eps) => {
            prop_assert_eq!(h.mode, BoundMode::Abs);
            prop_assert_eq!(h.eps, eps);
            prop_assert_eq!(h.step, 2.0 * eps);
        }
        Bound::Rel(r) => {
            prop_assert_eq!(h.mode, BoundMode::Rel);
            let max = max_finite_abs(&x);
            let expected = if max > 0.0 { r * max } else { r };
            prop_assert_eq!(h.eps, expected, "rel {} max {}", r, max);
        }
        Bound::Rms { k, block_log2 } => {
            prop_assert_eq!(h.mode, BoundMode::Rms);
            prop_assert_eq!(h.step, 2.0 * h.eps);
            prop_assert_eq!(h.block_log2 != 0, h.codec == Codec::Quantized);
            // Each block within its own bound: k times its RMS rounded down to a power of two
            // (at least k 2^-126), and no finer than half that.
            for (b, (xs, ys)) in x
                .chunks(1 << block_log2)
                .zip(y.chunks(1 << block_log2))
                .enumerate()
            {
                let fin: Vec<f64> = xs
                    .iter()
                    .filter(|v| v.is_finite())
                    .map(|v| v.to_f64())
                    .collect();
                let rms = (fin.iter().map(|v| v * v).sum::<f64>() / xs.len() as f64).sqrt();
                if rms == 0.0 {
                    continue;
                }
                let bound = k * 2f64.powi(rms.log2().floor().max(-126.0) as i32);
                prop_assert!(bound <= (k * rms).max(k * 2f64.powi(-126)) * (1.0 + 1e-12));
                let c = check(xs, ys, bound);
                prop_assert_eq!(c.violations, 0, "block {} rms {} bound {}", b, rms, bound);
            }
        }
        Bound::Bits(b) => {
            prop_assert_eq!(h.mode, BoundMode::Bits);
            prop_assert_eq!(h.bits, b);
            prop_assert_eq!(h.codec, Codec::Quantized);
            // The reported bound is the measured one: the largest error, exactly.
            prop_assert_eq!(h.eps, c.max_err);
            prop_assert_eq!(h.n_exceptions, nonfinite, "only NaN/Inf become exceptions");
            if zstd_level.is_none() {
                let fixed = fixed_rate_size(&shape, b).expect("size fits");
                let per_exception = (4 + T::DTYPE.size()) as u64;
                prop_assert_eq!(frame.len() as u64, fixed + nonfinite * per_exception);
            }
        }
    }
    if h.codec == Codec::Quantized {
        prop_assert!(h.n_exceptions >= nonfinite);
    } else {
        prop_assert_eq!(h.n_exceptions, 0);
        prop_assert_eq!(h.raw_body_len, (n * T::DTYPE.size()) as u64);
    }
    if zstd_level.is_none() {
        prop_assert!(!h.zstd);
        prop_assert_eq!(h.body_len, h.raw_body_len);
    } else if h.zstd {
        prop_assert!(h.body_len < h.raw_body_len);
    }
    prop_assert_eq!(frame.len() as u64, h.len() as u64 + h.body_len);

    // The other entry points agree with `decompress` and `compress`.
    prop_assert_eq!(&validate(&frame).expect("valid"), &h);
    prop_assert_eq!(&read_header(&frame).expect("valid"), &h);
    let y_bytes: &[u8] = bytemuck::cast_slice(&y);
    let mut out = vec![0u8; y_bytes.len() + 1];
    let got = decompress_into_bytes(&frame, &mut out[1..], 1).expect("decodes");
    prop_assert_eq!(&got, &h);
    prop_assert!(
        &out[1..] == y_bytes,
        "misaligned decompress_into_bytes differs"
    );
    let x_bytes: &[u8] = bytemuck::cast_slice(&x);
    let mut shifted = vec![0u8; x_bytes.len() + 1];
    shifted[1..].copy_from_slice(x_bytes);
    let again = compress_bytes(&shifted[1..], T::DTYPE, &shape, &opts).expect("compresses");
    prop_assert!(again == frame, "compress_bytes differs from compress");
    if zstd_level.is_some() {
        let plain = compress(
            &x,
            &shape,
            &CompressOptions {
                zstd_level: None,
                ..opts
            },
        )
        .expect("compresses");
        let (hp, yp) = decompress::<T>(&plain).expect("decodes");
        prop_assert_eq!(hp.raw_body_len, h.raw_body_len);
        let same = y
            .iter()
            .zip(&yp)
            .all(|(a, b)| a.to_bits32() == b.to_bits32());
        prop_assert!(same, "zstd stage changed the decoded values");
    }
    Ok(())
}

fn cases() -> ProptestConfig {
    ProptestConfig {
        cases: 1000,
        ..ProptestConfig::default()
    }
}

macro_rules! roundtrip_props {
    ($name:ident, $t:ty) => {
        proptest! {
            #![proptest_config(cases())]
            #[test]
            fn $name(
                dist in prop::sample::select(ALL_DISTS.to_vec()),
                n in len_strategy(),
                seed in any::<u64>(),
                scale in prop::sample::select(vec![1e-6, 1e-3, 1.0, 1e3]),
                bk in bound_strategy(),
                zstd_level in zstd_strategy(),
                shape_kind in (any::<u8>(), any::<usize>()),
            ) {
                roundtrip_case::<$t>(dist, n, seed, scale, bk, zstd_level, shape_kind)?;
            }
        }
    };
}

roundtrip_props!(strict_bound_f32, f32);
roundtrip_props!(strict_bound_bf16, bf16);
roundtrip_props!(strict_bound_f16, f16);

/// Every special value and extreme of a type, in every mode: specials bit-exact, the rest bounded.
fn specials_case<T: Float>() {
    let nan = common::nans::<T>();
    let max = T::from_f64(T::MAX_F64);
    let mut x: Vec<T> = nan.to_vec();
    x.extend([
        common::inf::<T>(false),
        common::inf::<T>(true),
        T::from_f64(-0.0),
        T::from_f64(0.0),
        T::from_f64(1.0),
        T::from_f64(-1.5),
        max,
        T::from_f64(-T::MAX_F64),
        T::from_bits32(1),                        // smallest subnormal
        T::from_bits32(1 | (1 << (T::BITS - 1))), // its negative
    ]);
    // Repeat so that quantizing pays off and the quantized codec is used, not the raw one.
    let mut x: Vec<T> = x.iter().cycle().take(x.len() * 40).copied().collect();
    x.extend(std::iter::repeat_n(T::from_f64(0.25), 2000));
    for bound in [
        Bound::Abs(1e-3),
        Bound::Abs(0.5),
        Bound::Abs(T::MAX_F64 / 8.0),
        Bound::Rel(1e-3),
        Bound::Rel(0.5),
        Bound::Bits(2),
        Bound::Bits(8),
        Bound::Bits(31),
        Bound::Bits(32),
    ] {
        for zstd_level in [None, Some(1)] {
            let opts = CompressOptions {
                zstd_level,
                threads: 1,
                ..CompressOptions::new(bound)
            };
            let frame = compress(&x, &[x.len()], &opts).expect("compresses");
            let (h, y) = decompress::<T>(&frame).expect("decodes");
            let c = check(&x, &y, h.eps);
            assert_eq!(
                c.violations,
                0,
                "{} {bound:?}: first at {:?}",
                T::name(),
                c.first
            );
            for (a, b) in x.iter().zip(&y) {
                if !a.is_finite() {
                    assert_eq!(a.to_bits32(), b.to_bits32(), "{} {bound:?}", T::name());
                }
            }
        }
    }
}

#[test]
fn specials_and_extremes_f32() {
    specials_case::<f32>();
}

#[test]
fn specials_and_extremes_bf16() {
    specials_case::<bf16>();
}

#[test]
fn specials_and_extremes_f16() {
    specials_case::<f16>();
}

#[test]
fn all_special_tensor_decodes_bit_exactly() {
    // Nothing finite at all: every element is an exception (or the frame is raw).
    let x: Vec<f32> = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN]
        .iter()
        .cycle()
        .take(100)
        .copied()
        .collect();
    for bound in [Bound::Abs(0.1), Bound::Rel(0.1), Bound::Bits(4)] {
        let frame = compress(&x, &[100], &CompressOptions::new(bound)).expect("compresses");
        let (_, y) = decompress::<f32>(&frame).expect("decodes");
        let xb: Vec<u32> = x.iter().map(|v| v.to_bits()).collect();
        let yb: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
        assert_eq!(xb, yb, "{bound:?}");
    }
}

#[test]
fn scalar_and_multidim_shapes() {
    let frame = compress(&[3.25f32], &[], &CompressOptions::new(Bound::Abs(0.01))).expect("ok");
    let (h, y) = decompress::<f32>(&frame).expect("decodes");
    assert!(h.shape.is_empty());
    assert_eq!(h.n, 1);
    assert!((y[0] as f64 - 3.25).abs() <= h.eps);

    let x: Vec<f16> = gen(Dist::Gaussian, 2 * 3 * 5 * 7, 1.0, 9);
    for shape in [
        vec![210],
        vec![2, 105],
        vec![2, 3, 5, 7],
        vec![1, 2, 1, 3, 1, 5, 1, 7],
    ] {
        let frame = compress(&x, &shape, &CompressOptions::new(Bound::Rel(0.01))).expect("ok");
        let (h, y) = decompress::<f16>(&frame).expect("decodes");
        let want: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        assert_eq!(h.shape, want);
        assert_eq!(check(&x, &y, h.eps).violations, 0);
    }
    // Empty tensors of several shapes.
    for shape in [vec![0], vec![0, 4], vec![4, 0, 2]] {
        let frame =
            compress::<bf16>(&[], &shape, &CompressOptions::new(Bound::Abs(1.0))).expect("ok");
        let (h, y) = decompress::<bf16>(&frame).expect("decodes");
        assert_eq!(h.n, 0);
        assert!(y.is_empty());
    }
}

#[test]
fn bytes_do_not_depend_on_threads() {
    let n = (1 << 19) + 77; // four parts of at least 2^17 elements each
    let xf: Vec<f32> = gen(Dist::Laplace, n, 1e-3, 1);
    let mut xs: Vec<f32> = gen(Dist::Specials, n, 1.0, 2);
    xs[n - 1] = f32::NAN;
    let xb: Vec<bf16> = gen(Dist::Laplace, n, 1e-3, 3);
    for bound in [Bound::Abs(1e-4), Bound::Rel(1e-3), Bound::Bits(9)] {
        for zstd_level in [None, Some(1)] {
            let frames = |threads: usize| -> Vec<Vec<u8>> {
                let o = CompressOptions {
                    zstd_level,
                    threads,
                    ..CompressOptions::new(bound)
                };
                vec![
                    compress(&xf, &[n], &o).expect("f32"),
                    compress(&xs, &[n], &o).expect("f32 specials"),
                    compress(&xb, &[n], &o).expect("bf16"),
                ]
            };
            let one = frames(1);
            for threads in [2, 4, 0] {
                let other = frames(threads);
                for (k, (a, b)) in one.iter().zip(&other).enumerate() {
                    assert!(
                        a == b,
                        "tensor {k}, {bound:?}, zstd {zstd_level:?}: {threads} threads differ from 1"
                    );
                }
            }
            // Decoding with several threads gives the same bytes too.
            for f in &one {
                let h = read_header(f).expect("header");
                let mut a = vec![0u8; h.decoded_len() as usize];
                let mut b = vec![0u8; h.decoded_len() as usize];
                decompress_into_bytes(f, &mut a, 1).expect("1 thread");
                decompress_into_bytes(f, &mut b, 4).expect("4 threads");
                assert!(a == b, "decoding differs with threads");
            }
            let (h, y) = decompress::<f32>(&one[1]).expect("decodes");
            assert_eq!(check(&xs, &y, h.eps).violations, 0);
        }
    }
}

#[test]
fn zstd_stage_round_trips() {
    let x: Vec<f32> = gen(Dist::Sparse, 50_000, 1.0, 5);
    let plain = compress(&x, &[50_000], &CompressOptions::new(Bound::Abs(1e-3))).expect("ok");
    let (hp, yp) = decompress::<f32>(&plain).expect("decodes");
    for level in [-5, 1, 3, 19] {
        let opts = CompressOptions {
            zstd_level: Some(level),
            ..CompressOptions::new(Bound::Abs(1e-3))
        };
        let frame = compress(&x, &[50_000], &opts).expect("ok");
        let (h, y) = decompress::<f32>(&frame).expect("decodes");
        assert!(h.zstd, "level {level}: sparse data should go through zstd");
        assert!(frame.len() < plain.len(), "level {level}");
        assert_eq!(h.raw_body_len, hp.raw_body_len);
        assert_eq!(h.body_len as usize, frame.len() - h.len());
        // The stored body is a zstd frame of exactly the plain frame's body.
        let body = zstd::bulk::decompress(&frame[h.len()..], 1 << 24).expect("zstd frame");
        assert!(
            body == plain[hp.len()..],
            "level {level}: inner body differs"
        );
        assert!(y == yp, "level {level}");
    }
    // Incompressible bytes: the stage is skipped and the frame is the plain one.
    let noise: Vec<f32> = gen(Dist::AnyBits, 10_000, 1.0, 6);
    let opts = CompressOptions::new(Bound::Abs(1e-30));
    let a = compress(&noise, &[10_000], &opts).expect("ok");
    let b = compress(
        &noise,
        &[10_000],
        &CompressOptions {
            zstd_level: Some(3),
            ..opts
        },
    )
    .expect("ok");
    assert!(a == b, "zstd kept although it did not help");
    assert!(!read_header(&b).expect("header").zstd);
}

#[test]
fn bits_mode_has_fixed_size_and_measured_bound() {
    for bits in 2u8..=32 {
        for (k, dist) in [Dist::Gaussian, Dist::Cauchy, Dist::Zero, Dist::NearMax]
            .into_iter()
            .enumerate()
        {
            let n = 4099;
            let seed = 100 * bits as u64 + k as u64;
            let xs: Vec<f32> = gen(dist, n, 0.5, seed);
            let xh: Vec<f16> = gen(dist, n, 0.5, seed);
            for shape in [vec![n], vec![1, n]] {
                let f =
                    compress(&xs, &shape, &CompressOptions::new(Bound::Bits(bits))).expect("ok");
                assert_eq!(
                    f.len() as u64,
                    fixed_rate_size(&shape, bits).expect("fits"),
                    "f32 bits {bits} {dist:?}"
                );
                let (h, y) = decompress::<f32>(&f).expect("decodes");
                let c = check(&xs, &y, h.eps);
                assert_eq!(c.violations, 0);
                assert_eq!(h.eps, c.max_err, "f32 bits {bits} {dist:?}");
                if dist != Dist::Zero && bits <= 8 {
                    assert!(h.eps > 0.0, "lossy at {bits} bits but eps 0");
                }
                let f =
                    compress(&xh, &shape, &CompressOptions::new(Bound::Bits(bits))).expect("ok");
                assert_eq!(
                    f.len() as u64,
                    fixed_rate_size(&shape, bits).expect("fits"),
                    "f16 bits {bits} {dist:?}"
                );
                let (h, y) = decompress::<f16>(&f).expect("decodes");
                let c = check(&xh, &y, h.eps);
                assert_eq!(c.violations, 0);
                assert_eq!(h.eps, c.max_err);
            }
        }
    }
    // More bits never measure a worse bound on the same data.
    let x: Vec<f32> = gen(Dist::Laplace, 10_000, 1.0, 77);
    let eps: Vec<f64> = (2u8..=24)
        .map(|b| {
            let f = compress(&x, &[10_000], &CompressOptions::new(Bound::Bits(b))).expect("ok");
            read_header(&f).expect("header").eps
        })
        .collect();
    assert!(eps.windows(2).all(|w| w[1] <= w[0]), "{eps:?}");
    assert!(eps[eps.len() - 1] < eps[0] * 1e-4, "{eps:?}");
}

/// Regression: at 32 bits the largest element's scaled value `max * (1 / step)` could land an
/// ulp above 2^31 - 1 and become an exception, making the frame 8 bytes longer than
/// `fixed_rate_size` (found by `strict_bound_f32` on a one-element tensor).
#[test]
fn bits_32_never_makes_the_largest_element_an_exception() {
    fn run<T: Float>(seed: u64) {
        for x in gen::<T>(Dist::AnyBits, 3000, 1.0, seed) {
            if !x.is_finite() {
                continue;
            }
            for shape in [&[][..], &[1][..]] {
                let f = compress(&[x], shape, &CompressOptions::new(Bound::Bits(32))).expect("ok");
                let h = read_header(&f).expect("header");
                assert_eq!(h.n_exceptions, 0, "{} {x:?}", T::name());
                assert_eq!(f.len() as u64, fixed_rate_size(shape, 32).expect("fits"));
            }
        }
    }
    run::<f32>(1);
    run::<bf16>(2);
    run::<f16>(3);
}

#[test]
fn rel_mode_eps_is_rel_times_max() {
    let mut x: Vec<bf16> = gen(Dist::Laplace, 5000, 2.0, 8);
    x[17] = bf16::from_f32(-1232.0); // exactly representable, and the largest magnitude
    x[18] = bf16::INFINITY; // not finite: ignored by the max
    x[19] = bf16::NAN;
    for rel in [1e-6, 1e-3, 0.25] {
        let f = compress(&x, &[5000], &CompressOptions::new(Bound::Rel(rel))).expect("ok");
        let (h, y) = decompress::<bf16>(&f).expect("decodes");
        assert_eq!(h.mode, BoundMode::Rel);
        assert_eq!(h.eps, rel * 1232.0);
        assert_eq!(check(&x, &y, h.eps).violations, 0);
    }
    // No nonzero finite element: the bound is `rel` itself.
    let z = [0.0f32, -0.0, f32::NAN];
    let f = compress(&z, &[3], &CompressOptions::new(Bound::Rel(0.125))).expect("ok");
    assert_eq!(read_header(&f).expect("header").eps, 0.125);
}

/// At least 10^8 elements of several distributions, all three types and several bounds, and
/// not one outside its bound. Ignored in debug builds, where it would take many minutes.
#[test]
#[cfg_attr(debug_assertions, ignore = "run with --release")]
fn bound_holds_over_1e8_elements() {
    const CHUNK: usize = 1 << 22;
    fn run<T: Float>(total: &mut u64, seed: &mut u64) {
        let specials = [
            common::nans::<T>()[0],
            common::nans::<T>()[3],
            common::inf::<T>(false),
            common::inf::<T>(true),
            T::from_f64(-0.0),
        ];
        for dist in [Dist::Gaussian, Dist::Laplace, Dist::Cauchy, Dist::Sparse] {
            *seed += 1;
            let scale = 1e-2;
            let mut x: Vec<T> = gen(dist, CHUNK, scale, *seed);
            // Sprinkle NaN, infinities and -0.0 through every tensor.
            for (k, v) in x.iter_mut().step_by(997).enumerate() {
                *v = specials[k % specials.len()];
            }
            // Tighter bounds make 16-bit tensors raw (codes as wide as the elements).
            let ms = if T::BITS == 32 {
                [1e-4, 1e-2, 0.3]
            } else {
                [0.03, 0.3, 1.0]
            };
            for m in ms {
                let bound = Bound::Abs(scale * m);
                let frame = compress(&x, &[CHUNK], &CompressOptions::new(bound)).expect("ok");
                let (h, y) = decompress::<T>(&frame).expect("decodes");
                assert_eq!(h.codec, Codec::Quantized, "{} {dist:?} {m}", T::name());
                let c = check_par(&x, &y, h.eps);
                assert_eq!(
                    c.violations,
                    0,
                    "{} {dist:?} eps {}: first violation at {:?}",
                    T::name(),
                    h.eps,
                    c.first
                );
                *total += x.len() as u64;
            }
        }
    }
    let mut total = 0u64;
    let mut seed = 1000;
    run::<f32>(&mut total, &mut seed);
    run::<bf16>(&mut total, &mut seed);
    run::<f16>(&mut total, &mut seed);
    assert!(total >= 100_000_000, "only {total} elements checked");
}

/// The real gradient vectors: no violation, and the ratios without zstd stay where they are.
#[test]
fn real_gradients_bound_and_ratio() {
    let grads = common::read_grads();
    assert_eq!(grads.len(), 5, "expected the five gradient vectors");
    let total_in: usize = grads.iter().map(|(_, x)| x.len() * 4).sum();
    for (k, floor) in [(0.01, 4.0), (0.1, 7.5), (0.3, 11.5)] {
        let mut total_out = 0usize;
        for (name, x) in &grads {
            let eps = k * common::rms(x);
            let frame = compress(x, &[x.len()], &CompressOptions::new(Bound::Abs(eps)))
                .expect("compresses");
            let (h, y) = decompress::<f32>(&frame).expect("decodes");
            assert_eq!(h.eps, eps);
            let c = check_par(x, &y, eps);
            assert_eq!(
                c.violations, 0,
                "{name} at {k} x RMS: first at {:?}",
                c.first
            );
            total_out += frame.len();
        }
        let ratio = total_in as f64 / total_out as f64;
        eprintln!("gradients at {k} x RMS: {ratio:.3}x");
        assert!(
            ratio > floor,
            "ratio {ratio:.3} at {k} x RMS, want > {floor}"
        );
    }
}

// ---- Every error variant the API returns ----

#[test]
fn error_invalid_bound() {
    let x = [1.0f32, -2.0, 3.0];
    for eps in [
        0.0,
        -0.0,
        -1.0,
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        1e-320,
        f64::MAX,
    ] {
        let r = compress(&x, &[3], &CompressOptions::new(Bound::Abs(eps)));
        assert!(
            matches!(r, Err(Error::InvalidBound { what: "eps", .. })),
            "eps {eps}: {r:?}"
        );
    }
    for rel in [0.0, -0.5, f64::NAN, f64::INFINITY] {
        let r = compress(&x, &[3], &CompressOptions::new(Bound::Rel(rel)));
        assert!(
            matches!(r, Err(Error::InvalidBound { what: "rel", .. })),
            "rel {rel}: {r:?}"
        );
    }
    // A relative bound whose absolute value underflows f64's normal range.
    let tiny = [f32::from_bits(1)];
    let r = compress(&tiny, &[1], &CompressOptions::new(Bound::Rel(1e-300)));
    assert!(
        matches!(r, Err(Error::InvalidBound { what: "rel", .. })),
        "{r:?}"
    );
    for bits in [0u8, 1, 33, 64, 255] {
        let r = compress(&x, &[3], &CompressOptions::new(Bound::Bits(bits)));
        assert!(
            matches!(r, Err(Error::InvalidBound { what: "bits", .. })),
            "bits {bits}: {r:?}"
        );
        let r = compress::<f16>(&[], &[0], &CompressOptions::new(Bound::Bits(bits)));
        assert!(
            matches!(r, Err(Error::InvalidBound { what: "bits", .. })),
            "bits {bits}"
        );
    }
    let r = compress_bytes(
        &[0u8; 4],
        DType::BF16,
        &[2],
        &CompressOptions::new(Bound::Abs(0.0)),
    );
    assert!(matches!(r, Err(Error::InvalidBound { what: "eps", .. })));
}

#[test]
fn error_shape_mismatch() {
    let x = [0.5f32; 4];
    let o = CompressOptions::new(Bound::Abs(0.1));
    let r = compress(&x, &[3], &o);
    assert!(
        matches!(
            r,
            Err(Error::ShapeMismatch {
                shape_elements: Some(3),
                elements: 4,
                ndim: 1
            })
        ),
        "{r:?}"
    );
    let r = compress(&x, &[], &o);
    assert!(matches!(
        r,
        Err(Error::ShapeMismatch {
            shape_elements: Some(1),
            elements: 4,
            ndim: 0
        })
    ));
    let r = compress(&x, &[2, 2, 0], &o);
    assert!(matches!(
        r,
        Err(Error::ShapeMismatch {
            shape_elements: Some(0),
            ..
        })
    ));
    let r = compress(&x[..1], &[1; 9], &o);
    assert!(matches!(
        r,
        Err(Error::ShapeMismatch {
            shape_elements: None,
            ndim: 9,
            ..
        })
    ));
    let r = compress(&x, &[usize::MAX, 2], &o);
    assert!(matches!(
        r,
        Err(Error::ShapeMismatch {
            shape_elements: None,
            elements: 4,
            ndim: 2
        })
    ));
    let r = compress_bytes(&[0u8; 8], DType::F16, &[3], &o);
    assert!(matches!(
        r,
        Err(Error::ShapeMismatch {
            shape_elements: Some(3),
            elements: 4,
            ..
        })
    ));
    // Eight dimensions are allowed.
    compress(&x, &[1, 1, 1, 1, 1, 1, 2, 2], &o).expect("8 dims are fine");
}

#[test]
fn error_misaligned_input() {
    let o = CompressOptions::new(Bound::Abs(0.1));
    let r = compress_bytes(&[0u8; 7], DType::F32, &[1], &o);
    assert!(
        matches!(
            r,
            Err(Error::MisalignedInput {
                len: 7,
                element_size: 4
            })
        ),
        "{r:?}"
    );
    for dt in [DType::BF16, DType::F16] {
        let r = compress_bytes(&[0u8; 3], dt, &[1], &o);
        assert!(matches!(
            r,
            Err(Error::MisalignedInput {
                len: 3,
                element_size: 2
            })
        ));
    }
}

#[test]
fn error_output_size() {
    let x: Vec<f32> = gen(Dist::Gaussian, 100, 1.0, 3);
    let f = compress(&x, &[100], &CompressOptions::new(Bound::Abs(0.01))).expect("ok");
    for len in [0usize, 399, 401, 200] {
        let mut out = vec![0u8; len];
        let r = decompress_into_bytes(&f, &mut out, 1);
        assert!(
            matches!(r, Err(Error::OutputSize { expected: 400, got }) if got == len as u64),
            "len {len}: {r:?}"
        );
    }
    let mut out = vec![0u8; 400];
    decompress_into_bytes(&f, &mut out, 1).expect("right size works");
}

#[test]
fn error_incompatible() {
    let x: Vec<f32> = gen(Dist::Gaussian, 100, 1.0, 3);
    let f = compress(&x, &[100], &CompressOptions::new(Bound::Abs(0.01))).expect("ok");
    let r = decompress::<bf16>(&f);
    assert!(
        matches!(&r, Err(Error::Incompatible { what: "dtype", left, right }) if left == "float32" && right == "bfloat16"),
        "{r:?}"
    );
    assert!(matches!(
        decompress::<f16>(&f),
        Err(Error::Incompatible { what: "dtype", .. })
    ));
    let xh: Vec<f16> = gen(Dist::Gaussian, 100, 1.0, 3);
    let fh = compress(&xh, &[100], &CompressOptions::new(Bound::Abs(0.01))).expect("ok");
    assert!(matches!(
        decompress::<f32>(&fh),
        Err(Error::Incompatible { what: "dtype", .. })
    ));
    assert!(matches!(
        sum_frames(&[&f, &fh], None),
        Err(Error::Incompatible { what: "dtype", .. })
    ));
    assert!(matches!(
        Codes::sum(&[]),
        Err(Error::Incompatible { what: "count", .. })
    ));
}

#[test]
fn error_code_overflow() {
    let part = |codes: Vec<i64>| Codes {
        scales: None,
        dtype: DType::F32,
        shape: vec![codes.len() as u64],
        step: 1.0,
        eps: 0.5,
        codes,
        exceptions: vec![],
    };
    let a = part(vec![0, 5, i64::MAX, -3]);
    let b = part(vec![1, -5, 1, -3]);
    let r = Codes::sum(&[a.clone(), b.clone()]);
    assert!(matches!(r, Err(Error::CodeOverflow { index: 2 })), "{r:?}");
    let c = part(vec![0, 0, 0, i64::MIN]);
    let r = Codes::sum(&[c.clone(), b.clone()]);
    assert!(matches!(r, Err(Error::CodeOverflow { index: 3 })), "{r:?}");
    // The same through frames: 64-bit codes survive to_frame and overflow when summed.
    let fa = a.to_frame(None).expect("packs");
    let fb = b.to_frame(Some(1)).expect("packs");
    let r = sum_frames(&[&fa, &fb], None);
    assert!(matches!(r, Err(Error::CodeOverflow { index: 2 })), "{r:?}");
    // No overflow when the sum fits.
    let d = part(vec![0, 0, -1, 3]);
    let s = Codes::sum(&[a, d]).expect("fits");
    assert_eq!(s.codes, vec![0, 5, i64::MAX - 1, 0]);
}

#[test]
fn error_format() {
    let x: Vec<f32> = gen(Dist::Gaussian, 100, 1.0, 3);
    let f = compress(&x, &[100], &CompressOptions::new(Bound::Abs(0.01))).expect("ok");
    let r = decompress::<f32>(&f[..10]);
    assert!(
        matches!(
            r,
            Err(Error::Format(FormatError::Truncated {
                part: "header",
                needed: 64,
                available: 10
            }))
        ),
        "{r:?}"
    );
    let mut bad = f.clone();
    bad[0] = b'X';
    assert!(matches!(
        decompress::<f32>(&bad),
        Err(Error::Format(FormatError::BadMagic(m))) if &m == b"XFCF"
    ));
    let mut bad = f.clone();
    bad[4] = 2;
    assert!(matches!(
        validate(&bad),
        Err(Error::Format(FormatError::UnsupportedVersion(2)))
    ));
    let r = Codes::from_frame(&f[..f.len() - 1]);
    assert!(matches!(
        r,
        Err(Error::Format(FormatError::LengthMismatch {
            part: "body",
            ..
        }))
    ));
    let mut out = vec![0u8; 400];
    let r = decompress_into_bytes(&f[..f.len() - 1], &mut out, 1);
    assert!(matches!(r, Err(Error::Format(_))));
    assert!(matches!(read_header(b""), Err(Error::Format(_))));
    // Errors print what was wrong.
    let msg = validate(&bad).expect_err("version 2").to_string();
    assert!(msg.contains("version 2"), "{msg}");
}
