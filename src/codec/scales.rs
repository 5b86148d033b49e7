//! Block scales: a step per block of `2^log2` elements (docs/FORMAT.md, "Block scales").
//!
//! A frame with block scales quantizes block `b` with `step * 2^-shift[b]` and bounds it by
//! `eps * 2^-shift[b]`: the header's step and bound are the coarsest, and each block's are that
//! many halvings finer. Why: one step for a whole tensor (or a whole gradient bucket) is coarse
//! for the blocks whose values are small next to the tensor's RMS: they round mostly to zero and
//! rare spikes. A step that follows each block's own RMS keeps every block at the same relative
//! precision. Powers of two keep everything exact: `step * 2^-s` and `1 / (step * 2^-s)` are
//! the same numbers on every backend, and codes of frames with the same scales add exactly.
//!
//! A block's *exponent* is `floor(log2(rms))` of its values, kept as a byte `E + 127` clamped
//! to 1..=254, with 0 for a block without a nonzero finite value ([`block_exponents`]); the
//! distributed engine agrees each block's exponent across ranks (the largest) from these bytes.
//! [`BlockScales::from_exponents`] turns exponents into a frame's base bound and shifts.

use crate::codec::element::Element;
use crate::codec::format::{bad_field, GROUP_LOG2};
use crate::error::{Error, Result};

/// Smallest block (`log2`): a group of 32.
pub const MIN_BLOCK_LOG2: u8 = GROUP_LOG2;
/// Largest block (`log2`): 2^24 elements.
pub const MAX_BLOCK_LOG2: u8 = 24;
/// The exponent byte of a block without a nonzero finite value.
pub const NO_EXPONENT: u8 = 0;

/// The step of every block of a frame, relative to the header's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockScales {
    /// Elements per block, as a power of two (5 to 24).
    pub log2: u8,
    /// Block `b`'s step is the header's times `2^-shifts[b]`; one per block, the last block
    /// possibly shorter.
    pub shifts: Vec<u8>,
}

/// `2^-s` exactly, for `s` up to 255.
#[inline(always)]
pub fn halvings(s: u8) -> f64 {
    f64::from_bits((1023 - s as u64) << 52)
}

/// `2^s` exactly, for `s` up to 255.
#[inline(always)]
pub fn doublings(s: u8) -> f64 {
    f64::from_bits((1023 + s as u64) << 52)
}

/// Blocks of `2^log2` elements that `n` elements take.
pub fn blocks_for(n: u64, log2: u8) -> u64 {
    n.div_ceil(1u64 << log2)
}

/// Checks a block size (`log2`).
pub fn check_log2(log2: u8) -> Result<()> {
    if (MIN_BLOCK_LOG2..=MAX_BLOCK_LOG2).contains(&log2) {
        Ok(())
    } else {
        Err(Error::InvalidBound {
            what: "block",
            reason: format!(
                "2^{log2} elements is not a power of two from {} to {}",
                1u64 << MIN_BLOCK_LOG2,
                1u64 << MAX_BLOCK_LOG2
            ),
        })
    }
}

/// The sum of squares of a block's finite values, in `f64`, added in the order every backend
/// uses: lane `j` of 32 adds elements `j, j + 32, j + 64, ...` in turn, then the 32 partial sums
/// are folded by halves (lane `j` adds lane `j + o` for `o` = 16, 8, 4, 2, 1), as one CUDA warp
/// does with shuffles. Non-finite values count 0; `residual` (error feedback) is added in `f32`
/// first, as the compensated values are.
pub fn block_sum_squares<T: Element>(x: &[T], residual: Option<&[f32]>) -> f64 {
    let mut lanes = [0f64; 32];
    for (i, &v) in x.iter().enumerate() {
        let mut f = v.to_f64() as f32;
        if let Some(r) = residual {
            f += r[i];
        }
        if f.is_finite() {
            lanes[i & 31] += f as f64 * f as f64;
        }
    }
    let mut o = 16;
    while o > 0 {
        for j in 0..o {
            lanes[j] += lanes[j + o];
        }
        o >>= 1;
    }
    lanes[0]
}

/// The exponent byte of a block whose values have sum of squares `sum` over `count` elements:
/// `floor(log2(sqrt(sum / count))) + 127`, clamped to 1..=254; [`NO_EXPONENT`] where the sum is
/// 0 (or not a number). Exact: `floor(log2(sqrt(v))) = floor(floor(log2(v)) / 2)`.
pub fn exponent_byte(sum: f64, count: u64) -> u8 {
    let v = sum / count.max(1) as f64;
    if v.is_nan() || v <= 0.0 {
        return NO_EXPONENT;
    }
    if v.is_infinite() {
        return 254;
    }
    let e2 = log2_floor(v);
    (e2.div_euclid(2) + 127).clamp(1, 254) as u8
}

/// `floor(log2(v))` of a positive finite `f64`, subnormals included.
fn log2_floor(v: f64) -> i64 {
    let bits = v.to_bits();
    let e = ((bits >> 52) & 0x7ff) as i64;
    if e == 0 {
        // subnormal: 2^-1074 times the mantissa
        -1074 + 63 - (bits & ((1 << 52) - 1)).leading_zeros() as i64
    } else {
        e - 1023
    }
}

/// Each block's exponent byte (see [`exponent_byte`]) of `x` (plus `residual`).
pub fn block_exponents<T: Element>(x: &[T], residual: Option<&[f32]>, log2: u8) -> Vec<u8> {
    let size = 1usize << log2;
    x.chunks(size)
        .enumerate()
        .map(|(b, chunk)| {
            let r = residual.map(|r| &r[b * size..b * size + chunk.len()]);
            exponent_byte(block_sum_squares(chunk, r), chunk.len() as u64)
        })
        .collect()
}

impl BlockScales {
    /// The base bound and the shifts for blocks whose bound is `k` times `2^E` (their exponent,
    /// [`exponent_byte`]): the header's bound is `k * 2^Emax` over the blocks, and block `b` is
    /// `Emax - E_b` halvings finer. A block without an exponent takes the base step (its values
    /// are zeros, or error feedback carries them).
    pub fn from_exponents(k: f64, exponents: &[u8], log2: u8) -> (f64, BlockScales) {
        let top = exponents
            .iter()
            .copied()
            .max()
            .unwrap_or(NO_EXPONENT)
            .max(1);
        let eps = k * doublings(top - 1) * halvings(126);
        let shifts = exponents
            .iter()
            .map(|&e| if e == NO_EXPONENT { 0 } else { top - e })
            .collect();
        (eps, BlockScales { log2, shifts })
    }

    /// Checks the scales against a frame of `n` elements with base `step`: one shift per block,
    /// each leaving the block's step a normal number.
    pub fn check(&self, n: u64, step: f64) -> Result<()> {
        check_log2(self.log2).map_err(|_| bad_field("block size (log2)", self.log2))?;
        let blocks = blocks_for(n, self.log2);
        if self.shifts.len() as u64 != blocks {
            return Err(Error::InvalidCodes {
                reason: format!("{} block shifts for {blocks} blocks", self.shifts.len()),
            });
        }
        let most = self.shifts.iter().copied().max().unwrap_or(0);
        check_shift(step, most)
    }

    /// The step of block `b`.
    #[inline(always)]
    pub fn step(&self, step: f64, b: usize) -> f64 {
        step * halvings(self.shifts[b])
    }
}

/// Checks that `step * 2^-shift` is a normal number (a reader's check of every shift).
pub(crate) fn check_shift(step: f64, shift: u8) -> Result<()> {
    if (step * halvings(shift)).is_normal() {
        Ok(())
    } else {
        Err(bad_field(
            "block shift",
            format!("{shift} halvings of step {step:e} leave no normal number"),
        ))
    }
}

/// The steps of a range of groups: the header's, or each group's block's.
#[derive(Clone, Copy)]
pub(crate) struct Steps<'a> {
    pub step: f64,
    /// Each block's shift and `log2(block / GROUP)`; `None`: one step.
    pub blocks: Option<(&'a [u8], u32)>,
}

impl<'a> Steps<'a> {
    pub fn new(step: f64, scales: Option<&'a BlockScales>) -> Steps<'a> {
        Steps {
            step,
            blocks: scales.map(|s| (&s.shifts[..], (s.log2 - GROUP_LOG2) as u32)),
        }
    }

    /// The step of group `g` (counted from the frame's first element).
    #[inline(always)]
    pub fn of_group(&self, g: usize) -> f64 {
        match self.blocks {
            None => self.step,
            Some((shifts, per)) => self.step * halvings(shifts[g >> per]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn powers_of_two_are_exact() {
        assert_eq!(halvings(0), 1.0);
        assert_eq!(halvings(3), 0.125);
        assert_eq!(doublings(10), 1024.0);
        assert_eq!(halvings(255), 2f64.powi(-255));
        // the inverse of a step halved is the inverse doubled, bit for bit
        let step = 0.3f64;
        for s in [1u8, 7, 100, 200] {
            assert_eq!(1.0 / (step * halvings(s)), (1.0 / step) * doublings(s));
        }
    }

    #[test]
    fn exponents_round_the_rms_down_to_a_power_of_two() {
        // rms exactly 1, just below 1, 2^-20 and 3 * 2^-20
        assert_eq!(exponent_byte(4.0, 4), 127);
        assert_eq!(exponent_byte(3.999, 4), 126);
        let tiny = 2f64.powi(-40);
        assert_eq!(exponent_byte(tiny * 8.0, 8), 107);
        assert_eq!(exponent_byte(9.0 * tiny * 8.0, 8), 108);
        assert_eq!(exponent_byte(0.0, 8), NO_EXPONENT);
        assert_eq!(exponent_byte(f64::NAN, 8), NO_EXPONENT);
        assert_eq!(exponent_byte(f64::MIN_POSITIVE / 4.0, 1), 1);
        assert_eq!(exponent_byte(1e300, 1), 254);
        assert_eq!(log2_floor(f64::from_bits(1)), -1074);
        for v in [0.75f64, 1.0, 1.5, 1e-10, 3e20] {
            let rms = v.sqrt();
            let e = exponent_byte(v, 1) as i32 - 127;
            assert!(2f64.powi(e) <= rms && rms < 2f64.powi(e + 1), "{v}");
        }
    }

    #[test]
    fn sums_skip_non_finite_values_and_add_the_residual_first() {
        let x = [3.0f32, f32::NAN, 4.0, f32::INFINITY];
        assert_eq!(block_sum_squares(&x, None), 25.0);
        let r = [1.0f32, 0.0, -4.0, 0.0];
        assert_eq!(block_sum_squares(&x, Some(&r)), 16.0);
        // 1000 values, in the lanes' order
        let y: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
        let plain: f64 = y.iter().map(|&v| v as f64 * v as f64).sum();
        assert!((block_sum_squares(&y, None) - plain).abs() < 1e-9 * plain);
    }

    #[test]
    fn scales_follow_each_block() {
        let (eps, s) = BlockScales::from_exponents(0.5, &[127, 120, NO_EXPONENT, 127], 8);
        assert_eq!(eps, 0.5);
        assert_eq!(s.shifts, vec![0, 7, 0, 0]);
        assert!(s.check(1000, 1.0).is_ok());
        assert!(s.check(1025, 1.0).is_err());
        let deep = BlockScales {
            log2: 5,
            shifts: vec![250],
        };
        assert!(deep.check(32, 1e-300).is_err());
        assert!(deep.check(32, 1.0).is_ok());
        assert!(BlockScales {
            log2: 4,
            shifts: vec![0]
        }
        .check(16, 1.0)
        .is_err());
    }
}
