//! Helpers shared by the integration tests: test data generators for the three element types,
//! the strict-bound checker, the real gradient vectors (read by `examples/shared/grads.rs`), and
//! hex dumps.

#![allow(dead_code)]

use cfc::Element;
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_distr::{Cauchy, Distribution, Exp, Normal};
use std::path::PathBuf;

/// An element type with what the tests need to know about its bit layout.
pub trait Float: Element + std::fmt::Debug + PartialEq {
    /// Total bits.
    const BITS: u32;
    /// Explicit mantissa bits.
    const MANT: u32;
    /// Exponent of the smallest normal number.
    const MIN_EXP: i32;
    /// Largest finite value.
    const MAX_F64: f64;
    /// Rounds an `f64` to this type (to nearest, ties to even).
    fn from_f64(v: f64) -> Self;
    /// The frame dtype name, for messages.
    fn name() -> &'static str {
        Self::DTYPE.name()
    }
    /// Mask of the bits the type uses.
    fn mask() -> u32 {
        if Self::BITS == 32 {
            u32::MAX
        } else {
            (1u32 << Self::BITS) - 1
        }
    }
    /// Bits of the exponent field.
    fn exp_bits() -> u32 {
        Self::BITS - 1 - Self::MANT
    }
    /// Builds a value from sign, biased exponent and mantissa fields.
    fn from_fields(sign: bool, exp: u32, mant: u32) -> Self {
        let b = ((sign as u32) << (Self::BITS - 1))
            | (exp << Self::MANT)
            | (mant & ((1u32 << Self::MANT) - 1));
        Self::from_bits32(b)
    }
    /// Spacing of representable values at magnitude `m` (subnormal spacing below the normals).
    fn ulp(m: f64) -> f64 {
        let m = m.abs();
        // Exact binade of a normal f64 from its exponent field (every magnitude used here is).
        let e = if m.is_normal() {
            ((m.to_bits() >> 52) & 0x7ff) as i32 - 1023
        } else {
            Self::MIN_EXP
        };
        2f64.powi(e.max(Self::MIN_EXP) - Self::MANT as i32)
    }
}

impl Float for f32 {
    const BITS: u32 = 32;
    const MANT: u32 = 23;
    const MIN_EXP: i32 = -126;
    const MAX_F64: f64 = f32::MAX as f64;
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}

impl Float for bf16 {
    const BITS: u32 = 16;
    const MANT: u32 = 7;
    const MIN_EXP: i32 = -126;
    const MAX_F64: f64 = 3.3895313892515355e38;
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
}

impl Float for f16 {
    const BITS: u32 = 16;
    const MANT: u32 = 10;
    const MIN_EXP: i32 = -14;
    const MAX_F64: f64 = 65504.0;
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
}

/// Shapes of test data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dist {
    /// Normal(0, scale).
    Gaussian,
    /// Laplace(0, scale): gradient-like, heavy-ish tails.
    Laplace,
    /// Cauchy(0, scale): very heavy tails (may overflow a 16-bit type to infinity).
    Cauchy,
    /// All +0.0.
    Zero,
    /// One random value repeated.
    Constant,
    /// 90% zeros, the rest Normal(0, scale).
    Sparse,
    /// Subnormals and the smallest normals of the type, either sign.
    Tiny,
    /// The two largest binades of the type, either sign.
    NearMax,
    /// Normal(0, scale) with NaNs (several payloads, both signs, signalling), +Inf, -Inf, -0.0.
    Specials,
    /// Uniformly random bit patterns: every class of value.
    AnyBits,
}

/// Every distribution, for strategies.
pub const ALL_DISTS: [Dist; 10] = [
    Dist::Gaussian,
    Dist::Laplace,
    Dist::Cauchy,
    Dist::Zero,
    Dist::Constant,
    Dist::Sparse,
    Dist::Tiny,
    Dist::NearMax,
    Dist::Specials,
    Dist::AnyBits,
];

/// A few NaN bit patterns of `T`: quiet, negative quiet, with payload, signalling.
pub fn nans<T: Float>() -> [T; 4] {
    let all = (1u32 << T::exp_bits()) - 1;
    let quiet = 1u32 << (T::MANT - 1);
    [
        T::from_fields(false, all, quiet),
        T::from_fields(true, all, quiet),
        T::from_fields(false, all, quiet | 0x15),
        T::from_fields(false, all, 1),
    ]
}

/// +Inf of `T`.
pub fn inf<T: Float>(negative: bool) -> T {
    T::from_fields(negative, (1u32 << T::exp_bits()) - 1, 0)
}

/// `n` values of `T` drawn from `dist` with the given scale, reproducibly from `seed`.
pub fn gen<T: Float>(dist: Dist, n: usize, scale: f64, seed: u64) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let normal = Normal::new(0.0, scale).expect("valid normal");
    let max_exp = (1u32 << T::exp_bits()) - 2;
    let mant_mask = (1u32 << T::MANT) - 1;
    match dist {
        Dist::Gaussian => (0..n)
            .map(|_| T::from_f64(normal.sample(&mut rng)))
            .collect(),
        Dist::Laplace => {
            // Laplace(0, scale) as the difference of two exponentials of mean `scale`.
            let d = Exp::new(1.0 / scale).expect("valid exponential");
            (0..n)
                .map(|_| T::from_f64(d.sample(&mut rng) - d.sample(&mut rng)))
                .collect()
        }
        Dist::Cauchy => {
            let d = Cauchy::new(0.0, scale).expect("valid cauchy");
            (0..n).map(|_| T::from_f64(d.sample(&mut rng))).collect()
        }
        Dist::Zero => vec![T::from_f64(0.0); n],
        Dist::Constant => {
            let c = T::from_f64(normal.sample(&mut rng) * 10.0);
            vec![c; n]
        }
        Dist::Sparse => (0..n)
            .map(|_| {
                if rng.gen_bool(0.9) {
                    T::from_f64(0.0)
                } else {
                    T::from_f64(normal.sample(&mut rng))
                }
            })
            .collect(),
        Dist::Tiny => (0..n)
            .map(|_| {
                T::from_fields(
                    rng.gen(),
                    rng.gen_range(0..=1),
                    rng.gen::<u32>() & mant_mask,
                )
            })
            .collect(),
        Dist::NearMax => (0..n)
            .map(|_| {
                T::from_fields(
                    rng.gen(),
                    rng.gen_range(max_exp - 1..=max_exp),
                    rng.gen::<u32>() & mant_mask,
                )
            })
            .collect(),
        Dist::Specials => {
            let nan = nans::<T>();
            (0..n)
                .map(|_| match rng.gen_range(0..10) {
                    0 => nan[rng.gen_range(0..nan.len())],
                    1 => inf::<T>(false),
                    2 => inf::<T>(true),
                    3 => T::from_f64(-0.0),
                    _ => T::from_f64(normal.sample(&mut rng)),
                })
                .collect()
        }
        Dist::AnyBits => (0..n)
            .map(|_| T::from_bits32(rng.gen::<u32>() & T::mask()))
            .collect(),
    }
}

/// The magnitude an absolute bound should be measured against for data from `dist`.
pub fn natural_scale<T: Float>(dist: Dist, scale: f64) -> f64 {
    match dist {
        Dist::NearMax => T::MAX_F64,
        Dist::Tiny => 2f64.powi(T::MIN_EXP),
        Dist::AnyBits => 1.0,
        _ => scale,
    }
}

/// Outcome of checking a decoded tensor against its original.
#[derive(Debug, Default, Clone, Copy)]
pub struct Check {
    /// Finite elements decoded farther than `eps`, plus non-finite ones not decoded bit-exactly.
    pub violations: u64,
    /// Largest `|decoded - original|` over finite elements, in `f64`.
    pub max_err: f64,
    /// First violating index.
    pub first: Option<usize>,
}

/// Checks the strict bound: every finite element within `eps` (in `f64`), every NaN and
/// infinity bit-exact.
pub fn check<T: Float>(x: &[T], y: &[T], eps: f64) -> Check {
    assert_eq!(x.len(), y.len(), "decoded length differs");
    let mut c = Check::default();
    for (i, (&a, &b)) in x.iter().zip(y).enumerate() {
        let bad = if a.is_finite() {
            let e = (b.to_f64() - a.to_f64()).abs();
            if e > c.max_err {
                c.max_err = e;
            }
            // A NaN error (a NaN decoded for a finite value) is a violation too.
            e.is_nan() || e > eps
        } else {
            a.to_bits32() != b.to_bits32()
        };
        if bad {
            c.violations += 1;
            c.first.get_or_insert(i);
        }
    }
    c
}

/// As [`check`], split over the available cores (for the large tests).
pub fn check_par<T: Float>(x: &[T], y: &[T], eps: f64) -> Check {
    assert_eq!(x.len(), y.len(), "decoded length differs");
    let threads = std::thread::available_parallelism().map_or(1, |p| p.get());
    let per = x.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        let hs: Vec<_> = x
            .chunks(per)
            .zip(y.chunks(per))
            .enumerate()
            .map(|(k, (a, b))| {
                s.spawn(move || {
                    let mut c = check(a, b, eps);
                    c.first = c.first.map(|i| i + k * per);
                    c
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("checker thread"))
            .fold(Check::default(), |acc, c| Check {
                violations: acc.violations + c.violations,
                max_err: acc.max_err.max(c.max_err),
                first: acc.first.or(c.first),
            })
    })
}

/// Largest finite magnitude, as the codec's Rel and Bits modes measure it.
pub fn max_finite_abs<T: Float>(x: &[T]) -> f64 {
    x.iter()
        .filter(|v| v.is_finite())
        .map(|v| v.to_f64().abs())
        .fold(0.0, f64::max)
}

/// Lower-case hex of a buffer, for failure messages.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Folder of the real gradient vectors: `$CFC_GRADS_DIR`, else `../shared/data/grads`.
pub fn grads_dir() -> PathBuf {
    match std::env::var_os("CFC_GRADS_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/data/grads")),
    }
}

#[path = "../../examples/shared/grads.rs"]
mod grads;
#[allow(unused_imports)] // not every test crate uses it
pub use grads::rms;

/// Every `.npy` file of [`grads_dir`], sorted by name, as `(stem, values)`.
pub fn read_grads() -> Vec<(String, Vec<f32>)> {
    grads::read_grads(&grads_dir()).unwrap_or_else(|e| panic!("{e}; set CFC_GRADS_DIR"))
}
