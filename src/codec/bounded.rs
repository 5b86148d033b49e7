//! The error-bounded codec on the CPU: the reference every other backend must match bit for bit.
//!
//! Compression of a tensor `x` with bound `eps`:
//! 1. `step = 2 * eps`; each element gets the code `q = round_ties_even(x * (1 / step))`,
//!    computed in `f64`.
//! 2. The encoder decodes `q` exactly as every decoder will ([`crate::codec::element::Element`]) and
//!    keeps it only if the result is within `eps` of `x` (checked in `f64`) and `|q| < 2^31`.
//!    Anything else (NaN, infinities, values too large for a code, the rare value that
//!    rounding would push over the bound) is an *exception*, stored bit-exactly. So the bound
//!    is strict by construction, not "about eps".
//! 3. Codes are zigzag-mapped and packed in groups of 32 with the group's own bit width, as
//!    bit planes ([`crate::codec::bitplane`]); near-zero regions cost one width byte per group.
//! 4. Optionally, the body goes through zstd (storage and CPU transport).
//!
//! Work is split into contiguous ranges of groups, one per thread; each range's output is
//! appended in order, so the bytes never depend on the number of threads.

use crate::codec::bitplane::{pack32, unpack32, unpack64, width_of};
use crate::codec::element::{dequantize, elements, Element};
use crate::codec::format::{
    checked_shape, finish_frame, BoundMode, Codec, Coder, DType, Header, GROUP, MAX_CODE,
    MAX_ENCODE_WIDTH,
};
use crate::codec::parallel::{map_ranges, thread_count};
use crate::codec::rice;
use crate::codec::scales::{self, halvings, BlockScales, Steps};
use crate::error::{Error, Result};
use half::{bf16, f16};

/// How the error bound of a compression is set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Bound {
    /// Every finite element comes back within this absolute distance.
    Abs(f64),
    /// The absolute bound is this fraction of the largest finite magnitude in the tensor.
    Rel(f64),
    /// Fixed rate: every group is stored with this many bits per value (2 to 32), so the size
    /// is known before compressing; the bound this achieves is measured and written in the frame.
    Bits(u8),
    /// Block scales: each block of `2^block_log2` elements is bounded by `k` times its own RMS
    /// rounded down to a power of two ([`crate::codec::scales`]). `k` is below 1.
    Rms {
        /// The fraction of each block's RMS.
        k: f64,
        /// Elements per block, as a power of two (5 to 24).
        block_log2: u8,
    },
}

/// Options of [`compress`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CompressOptions {
    /// The error bound.
    pub bound: Bound,
    /// Run the body through zstd at this level (1 is fast; up to 22). `None` skips the stage.
    pub zstd_level: Option<i32>,
    /// Threads to use; 0 picks one per available core for large tensors.
    pub threads: usize,
    /// How the codes are written: bit planes (the default, what the GPU reads and writes) or
    /// Rice codes (closer to the codes' entropy; not at a fixed rate).
    pub coder: Coder,
}

impl CompressOptions {
    /// Options with the given bound, no zstd stage and automatic threading.
    pub fn new(bound: Bound) -> Self {
        CompressOptions {
            bound,
            zstd_level: None,
            threads: 0,
            coder: Coder::Planes,
        }
    }
}

/// The parameters every element is quantized with.
#[derive(Debug, Clone, Copy)]
struct Quantizer {
    step: f64,
    inv_step: f64,
    eps: f64,
    /// Fixed rate: pack every group at this width and measure the error instead of bounding it.
    fixed_bits: Option<u32>,
}

impl Quantizer {
    /// The quantizer of a block `shift` halvings finer (exact: powers of two).
    fn halved(&self, shift: u8) -> Quantizer {
        let step = self.step * halvings(shift);
        Quantizer {
            step,
            inv_step: 1.0 / step,
            eps: self.eps * halvings(shift),
            fixed_bits: None,
        }
    }
}

/// The quantizer of each group: one, or its block's.
#[derive(Clone, Copy)]
struct Quantizers<'a> {
    base: Quantizer,
    scales: Option<&'a BlockScales>,
}

impl Quantizers<'_> {
    /// The quantizer of the group starting at element `first`.
    #[inline(always)]
    fn at(&self, first: u64) -> Quantizer {
        match self.scales {
            None => self.base,
            Some(s) => self.base.halved(s.shifts[(first >> s.log2) as usize]),
        }
    }
}

/// What one thread produces for its range of groups (or of rice blocks).
#[derive(Default)]
struct Part {
    /// The width table's bytes, or the rice block heads.
    widths: Vec<u8>,
    planes: Vec<u8>,
    exc_index: Vec<u64>,
    exc_bits: Vec<u32>,
    max_err: f64,
}

/// `1.5 * 2^52`: adding it to an `f64` of magnitude below `2^51` rounds to an integer, ties
/// to even (the default rounding mode), and leaves that integer in the low mantissa bits.
/// Exactly `rint` on that range, without a libm call, and the same on every backend.
const ROUND_MAGIC: f64 = 6_755_399_441_055_744.0;

/// Quantizes one group (`chunk`, up to 32 values starting at element `first`) into `zz` (0 past
/// its end and at exceptions), records its exceptions (and, at a fixed rate, its largest error)
/// in `part`, and returns the OR of its zigzag codes.
#[inline(always)]
fn code_group<T: Element, const FIXED: bool>(
    chunk: &[T],
    first: u64,
    qz: &Quantizer,
    zz: &mut [u32; GROUP],
    part: &mut Part,
) -> u32 {
    {
        // Branch-free over the group: every element gets a code and a keep/except verdict.
        let mut acc = 0u32;
        let mut rejected = 0u32;
        let mut max_err = 0f64;
        for (j, (&x, z)) in chunk.iter().zip(zz.iter_mut()).enumerate() {
            let x64 = x.to_f64();
            let t = x64 * qz.inv_step;
            let shifted = t + ROUND_MAGIC;
            let q = shifted.to_bits() as u32 as i32 as i64; // valid when |t| <= MAX_CODE
            let qf = shifted - ROUND_MAGIC;
            let decoded = T::from_f32((qf * qz.step) as f32).to_f64();
            let err = (decoded - x64).abs();
            let in_range = t.abs() <= MAX_CODE; // false for NaN
            let ok = in_range
                && if FIXED {
                    err.is_finite()
                } else {
                    err <= qz.eps
                };
            if FIXED && ok {
                max_err = max_err.max(err);
            }
            let zq = (((q << 1) ^ (q >> 63)) as u32) & 0u32.wrapping_sub(ok as u32);
            *z = zq;
            acc |= zq;
            rejected |= (!ok as u32) << j;
        }
        zz[chunk.len()..].fill(0);
        if FIXED {
            part.max_err = part.max_err.max(max_err);
        }
        while rejected != 0 {
            let j = rejected.trailing_zeros() as usize;
            rejected &= rejected - 1;
            part.exc_index.push(first + j as u64);
            part.exc_bits.push(chunk[j].to_bits32());
        }
        acc
    }
}

fn encode_range<T: Element, const FIXED: bool>(
    data: &[T],
    first: u64,
    qzs: &Quantizers<'_>,
) -> Part {
    let mut part = Part {
        widths: Vec::with_capacity(data.len().div_ceil(GROUP)),
        planes: Vec::with_capacity(data.len() / 2),
        ..Part::default()
    };
    let mut zz = [0u32; GROUP];
    for (g, chunk) in data.chunks(GROUP).enumerate() {
        let at = first + (g * GROUP) as u64;
        let qz = &qzs.at(at);
        let acc = code_group::<T, FIXED>(chunk, at, qz, &mut zz, &mut part);
        let w = qz.fixed_bits.unwrap_or_else(|| width_of(acc as u64));
        part.widths.push(w as u8);
        pack32(&zz, w, &mut part.planes);
    }
    part
}

/// [`encode_range`] for a rice body: `data` starts at a block's first element.
fn encode_rice_range<T: Element>(data: &[T], first: u64, qzs: &Quantizers<'_>) -> Part {
    let mut part = Part {
        widths: Vec::with_capacity(data.len().div_ceil(rice::BLOCK) * rice::HEAD_BYTES),
        planes: Vec::with_capacity(data.len() / 2),
        ..Part::default()
    };
    let mut zz = [0u32; GROUP];
    let mut block = [0u64; rice::BLOCK];
    for (b, values) in data.chunks(rice::BLOCK).enumerate() {
        block.fill(0);
        for (g, chunk) in values.chunks(GROUP).enumerate() {
            let at = first + (b * rice::BLOCK + g * GROUP) as u64;
            code_group::<T, false>(chunk, at, &qzs.at(at), &mut zz, &mut part);
            for (o, &z) in block[g * GROUP..(g + 1) * GROUP].iter_mut().zip(&zz) {
                *o = z as u64;
            }
        }
        rice::encode_block(&block, &mut part.widths, &mut part.planes);
    }
    part
}

fn encode<T: Element>(data: &[T], first: u64, qzs: &Quantizers<'_>, coder: Coder) -> Part {
    match (coder, qzs.base.fixed_bits.is_some()) {
        (_, true) => encode_range::<T, true>(data, first, qzs),
        (Coder::Planes, false) => encode_range::<T, false>(data, first, qzs),
        (Coder::Rice, false) => encode_rice_range::<T>(data, first, qzs),
    }
}

/// Largest magnitude among the finite elements (0 when there are none).
fn max_finite_abs<T: Element>(data: &[T]) -> f64 {
    data.iter()
        .filter(|x| x.is_finite())
        .map(|x| x.to_f64().abs())
        .fold(0.0, f64::max)
}

/// The smallest absolute bound the codec takes: the smallest normal f64. (The one definition of
/// the range: the engine's options and the Python package, through `cfc._native.EPS_RANGE`,
/// read these two.)
pub const MIN_EPS: f64 = f64::MIN_POSITIVE;
/// The largest absolute bound the codec takes: a quarter of the largest f64, so that a step of
/// `2 eps` and its sums stay finite.
pub const MAX_EPS: f64 = f64::MAX / 4.0;

/// Checks an absolute bound (given, or derived from `rel`).
pub(crate) fn check_abs_bound(eps: f64, what: &'static str) -> Result<()> {
    let bad = |reason: &str| Error::InvalidBound {
        what,
        reason: format!("{eps:?} {reason}"),
    };
    if eps.is_nan() || eps.is_infinite() {
        return Err(bad("is not finite"));
    }
    if eps <= 0.0 {
        return Err(bad("must be positive"));
    }
    if !(MIN_EPS..=MAX_EPS).contains(&eps) {
        return Err(bad("is outside the usable range of f64"));
    }
    Ok(())
}

/// Checks a relative bound (the fraction of the largest magnitude).
pub(crate) fn check_rel(rel: f64) -> Result<()> {
    if rel.is_finite() && rel > 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidBound {
            what: "rel",
            reason: format!("{rel:?} must be positive and finite"),
        })
    }
}

/// Checks a fixed-rate width.
pub(crate) fn check_bits(bits: u8) -> Result<()> {
    if !(2..=MAX_ENCODE_WIDTH).contains(&bits) {
        return Err(Error::InvalidBound {
            what: "bits",
            reason: format!("{bits} is not between 2 and {MAX_ENCODE_WIDTH}"),
        });
    }
    Ok(())
}

/// Checks a user-given absolute bound and derives the quantizer from it.
fn abs_quantizer(eps: f64, what: &'static str) -> Result<Quantizer> {
    check_abs_bound(eps, what)?;
    let step = 2.0 * eps;
    Ok(Quantizer {
        step,
        inv_step: 1.0 / step,
        eps,
        fixed_bits: None,
    })
}

/// Checks a per-block fraction of the RMS.
pub(crate) fn check_rms(k: f64) -> Result<()> {
    if k.is_finite() && k > 0.0 && k < 1.0 {
        Ok(())
    } else {
        Err(Error::InvalidBound {
            what: "rms",
            reason: format!("{k:?} must be above 0 and below 1"),
        })
    }
}

/// The quantizer of a bound, the frame's mode and fixed width, and block scales where the
/// bound has them.
type Chosen = (Quantizer, BoundMode, u8, Option<BlockScales>);

fn quantizer_for<T: Element>(data: &[T], bound: Bound) -> Result<Chosen> {
    match bound {
        Bound::Abs(eps) => Ok((abs_quantizer(eps, "eps")?, BoundMode::Abs, 0, None)),
        Bound::Rms { k, block_log2 } => {
            check_rms(k)?;
            scales::check_log2(block_log2)?;
            let exponents = scales::block_exponents(data, None, block_log2);
            let (eps, s) = BlockScales::from_exponents(k, &exponents, block_log2);
            Ok((abs_quantizer(eps, "rms")?, BoundMode::Rms, 0, Some(s)))
        }
        Bound::Rel(rel) => {
            check_rel(rel)?;
            let max = max_finite_abs(data);
            // With no nonzero finite element every bound holds; use `rel` itself as the bound.
            let eps = if max > 0.0 { rel * max } else { rel };
            Ok((abs_quantizer(eps, "rel")?, BoundMode::Rel, 0, None))
        }
        Bound::Bits(bits) => {
            check_bits(bits)?;
            let max = max_finite_abs(data);
            // Codes in [-qmax, qmax] have zigzag values below 2^bits.
            let qmax = ((1u64 << (bits - 1)) - 1) as f64;
            let step = if max > 0.0 { max / qmax } else { 1.0 };
            let mut step = if step.is_normal() {
                step
            } else {
                f64::MIN_POSITIVE
            };
            // `max / qmax` is rounded. At 32 bits qmax is the largest code, 2^31 - 1, and the
            // largest element's `max * (1 / step)` can land an ulp above it: it would become
            // an exception and break the promised size. Nudge the step up until it cannot
            // (never taken below 32 bits, where qmax is far from the code range's edge).
            while max * (1.0 / step) > MAX_CODE {
                step = f64::from_bits(step.to_bits() + 1);
            }
            Ok((
                Quantizer {
                    step,
                    inv_step: 1.0 / step,
                    eps: step / 2.0,
                    fixed_bits: Some(bits as u32),
                },
                BoundMode::Bits,
                bits,
                None,
            ))
        }
    }
}

/// Compresses a tensor into a cfc frame.
///
/// `shape` must hold `data.len()` elements (an empty shape means a scalar). Every finite
/// element decodes within the frame's `eps` of its value; NaN and infinities decode bit-exactly.
///
/// # Errors
/// [`Error::InvalidBound`] for an unusable bound, [`Error::ShapeMismatch`] for a bad shape,
/// [`Error::Zstd`] if the zstd stage fails.
pub fn compress<T: Element>(
    data: &[T],
    shape: &[usize],
    opts: &CompressOptions,
) -> Result<Vec<u8>> {
    compress_with(data, shape, opts, None)
}

/// [`compress`] with block scales given: block `b` is quantized with the step of the bound
/// `Bound::Abs(eps)` halved `scales.shifts[b]` times (the distributed engine's scales, agreed
/// by every rank so that codes add exactly).
///
/// # Errors
/// As [`compress`]; [`Error::InvalidBound`] for a bound other than `Bound::Abs`;
/// [`Error::InvalidCodes`] for scales that do not fit the tensor or the step.
pub fn compress_scaled<T: Element>(
    data: &[T],
    shape: &[usize],
    opts: &CompressOptions,
    scales: &BlockScales,
) -> Result<Vec<u8>> {
    if !matches!(opts.bound, Bound::Abs(_)) {
        return Err(Error::InvalidBound {
            what: "bound",
            reason: "given block scales take an absolute bound (eps)".into(),
        });
    }
    compress_with(data, shape, opts, Some(scales))
}

fn compress_with<T: Element>(
    data: &[T],
    shape: &[usize],
    opts: &CompressOptions,
    given: Option<&BlockScales>,
) -> Result<Vec<u8>> {
    let shape = checked_shape(shape, data.len())?;
    if opts.coder == Coder::Rice && matches!(opts.bound, Bound::Bits(_)) {
        return Err(rice::fixed_rate_error());
    }
    let (qz, mode, bits, chosen) = quantizer_for(data, opts.bound)?;
    let scales = given.or(chosen.as_ref());
    if let Some(s) = scales {
        s.check(data.len() as u64, qz.step)?;
    }
    let qzs = Quantizers { base: qz, scales };
    let n = data.len();
    // Threads take whole groups, or whole blocks of a rice body.
    let unit = match opts.coder {
        Coder::Planes => GROUP,
        Coder::Rice => rice::BLOCK,
    };
    let threads = thread_count(opts.threads, n);
    let _span = tracing::debug_span!("compress", dtype = T::DTYPE.name(), n, threads).entered();

    let parts: Vec<Part> = map_ranges(n.div_ceil(unit), threads, |r| {
        let (lo, hi) = (r.start * unit, (r.end * unit).min(n));
        encode(&data[lo..hi], lo as u64, &qzs, opts.coder)
    });

    let n_exc: usize = parts.iter().map(|p| p.exc_index.len()).sum();
    let table_len: usize = parts.iter().map(|p| p.widths.len()).sum();
    let planes_len: usize = parts.iter().map(|p| p.planes.len()).sum();
    let index_size = crate::codec::format::index_size_for(n as u64);
    let scales_len = scales.map_or(0, |s| s.shifts.len());
    let quant_len = scales_len + table_len + planes_len + n_exc * (index_size + T::DTYPE.size());
    let raw_len = n * T::DTYPE.size();
    let eps = match qz.fixed_bits {
        Some(_) => parts.iter().map(|p| p.max_err).fold(0.0, f64::max),
        None => qz.eps,
    };

    let mut header = Header {
        codec: match opts.coder {
            Coder::Planes => Codec::Quantized,
            Coder::Rice => Codec::Rice,
        },
        dtype: T::DTYPE,
        zstd: false,
        mode,
        bits,
        n: n as u64,
        step: qz.step,
        eps,
        n_exceptions: n_exc as u64,
        body_len: 0,
        raw_body_len: 0,
        shape,
        block_log2: scales.map_or(0, |s| s.log2),
    };
    // Fixed rate keeps its promised layout; otherwise never store more than the raw bytes.
    let body = if quant_len >= raw_len && qz.fixed_bits.is_none() {
        header.codec = Codec::Raw;
        header.n_exceptions = 0;
        header.block_log2 = 0;
        bytemuck::cast_slice::<T, u8>(data).to_vec()
    } else {
        let mut body = Vec::with_capacity(quant_len);
        if let Some(s) = scales {
            body.extend_from_slice(&s.shifts);
        }
        for p in &parts {
            body.extend_from_slice(&p.widths);
        }
        for p in &parts {
            body.extend_from_slice(&p.planes);
        }
        for p in &parts {
            for &i in &p.exc_index {
                if index_size == 4 {
                    body.extend_from_slice(&(i as u32).to_le_bytes());
                } else {
                    body.extend_from_slice(&i.to_le_bytes());
                }
            }
        }
        for p in &parts {
            for &b in &p.exc_bits {
                body.extend_from_slice(&b.to_le_bytes()[..T::DTYPE.size()]);
            }
        }
        body
    };
    tracing::debug!(
        codec = ?header.codec,
        exceptions = header.n_exceptions,
        body = body.len(),
        "quantized"
    );
    finish_frame(header, body, opts.zstd_level)
}

/// Compresses a tensor given as raw little-endian bytes of `dtype` (any alignment).
///
/// # Errors
/// As [`compress`], plus [`Error::MisalignedInput`] when `bytes` is not a whole number of elements.
pub fn compress_bytes(
    bytes: &[u8],
    dtype: DType,
    shape: &[usize],
    opts: &CompressOptions,
) -> Result<Vec<u8>> {
    match dtype {
        DType::F32 => compress(&elements::<f32>(bytes)?, shape, opts),
        DType::BF16 => compress(&elements::<bf16>(bytes)?, shape, opts),
        DType::F16 => compress(&elements::<f16>(bytes)?, shape, opts),
        other => Err(Error::NotQuantizable(other)),
    }
}

/// Decodes a range of groups of a checked quantized body, from group `first`, into `out`
/// (which starts at the range's first element). `planes` starts at the range's first plane.
pub(crate) fn decode_range<T: Element>(
    widths: &[u8],
    mut planes: &[u8],
    steps: Steps<'_>,
    first: usize,
    out: &mut [T],
) {
    let mut zz = [0u32; GROUP];
    let mut zz64 = [0u64; GROUP];
    for (g, (&w, chunk)) in widths.iter().zip(out.chunks_mut(GROUP)).enumerate() {
        let step = steps.of_group(first + g);
        let zero = dequantize::<T>(0, step);
        let nbytes = w as usize * 4;
        let (mine, rest) = planes.split_at(nbytes);
        planes = rest;
        if w == 0 {
            chunk.fill(zero);
        } else if w as u32 <= 32 {
            unpack32(mine, &mut zz);
            for (o, &z) in chunk.iter_mut().zip(zz.iter()) {
                let q = ((z >> 1) as i64) ^ -((z & 1) as i64);
                *o = dequantize(q, step);
            }
        } else {
            unpack64(mine, &mut zz64);
            for (o, &z) in chunk.iter_mut().zip(zz64.iter()) {
                *o = dequantize(crate::codec::bitplane::unzigzag(z), step);
            }
        }
    }
}

/// Exact size of a fixed-rate (`Bound::Bits`) frame of finite data, known before compressing:
/// header, one width byte per group and `bits` planes per group. Each non-finite element adds
/// its index and value.
///
/// # Errors
/// Where no such frame exists: [`Error::InvalidBound`] for `bits` outside 2 to 32,
/// [`Error::ShapeMismatch`] for more than [`crate::codec::format::MAX_NDIM`] dimensions or a size that
/// overflows.
pub fn fixed_rate_size(shape: &[usize], bits: u8) -> Result<u64> {
    check_bits(bits)?;
    let impossible = || Error::ShapeMismatch {
        shape_elements: None,
        elements: 0,
        ndim: shape.len(),
    };
    if shape.len() > crate::codec::format::MAX_NDIM {
        return Err(impossible());
    }
    let n = shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
        .ok_or_else(impossible)?;
    let groups = crate::codec::format::groups_for(n);
    let header = (crate::codec::format::FIXED_HEADER_LEN + 8 * shape.len()) as u64;
    groups
        .checked_mul(1 + 4 * bits as u64)
        .and_then(|b| b.checked_add(header))
        .ok_or_else(impossible)
}
