//! The error-bounded codec on the CPU: the reference every other backend must match bit for bit.
//!
//! Compression of a tensor `x` with bound `eps`:
//! 1. `step = 2 * eps`; each element gets the code `q = round_ties_even(x * (1 / step))`,
//!    computed in `f64`.
//! 2. The encoder decodes `q` exactly as every decoder will ([`crate::element::Element`]) and
//!    keeps it only if the result is within `eps` of `x` (checked in `f64`) and `|q| < 2^31`.
//!    Anything else (NaN, infinities, values too large for a code, the rare value that
//!    rounding would push over the bound) is an *exception*, stored bit-exactly. So the bound
//!    is strict by construction, not "about eps".
//! 3. Codes are zigzag-mapped and packed in groups of 32 with the group's own bit width, as
//!    bit planes ([`crate::bitplane`]); near-zero regions cost one width byte per group.
//! 4. Optionally, the body goes through zstd (storage and CPU transport).
//!
//! Work is split into contiguous ranges of groups, one per thread; each range's output is
//! appended in order, so the bytes never depend on the number of threads.

use crate::bitplane::{pack32, unpack32, unpack64, width_of};
use crate::element::{dequantize, Element};
use crate::error::{try_capacity, Error, FormatError, Result};
use crate::format::{
    checked_shape, BoundMode, Codec, DType, Header, GROUP, MAX_CODE, MAX_ENCODE_WIDTH, MAX_WIDTH,
};
use half::{bf16, f16};
use std::io::Read;

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
}

impl CompressOptions {
    /// Options with the given bound, no zstd stage and automatic threading.
    pub fn new(bound: Bound) -> Self {
        CompressOptions {
            bound,
            zstd_level: None,
            threads: 0,
        }
    }
}

/// Elements per thread below which compression stays on the calling thread.
const MIN_ELEMENTS_PER_THREAD: usize = 1 << 17;

pub(crate) fn thread_count(requested: usize, n: usize) -> usize {
    let by_size = (n / MIN_ELEMENTS_PER_THREAD).max(1);
    let want = if requested == 0 {
        std::thread::available_parallelism().map_or(1, |p| p.get())
    } else {
        requested
    };
    want.min(by_size).max(1)
}

/// Splits `groups` into `parts` contiguous ranges of nearly equal size.
pub(crate) fn split_groups(groups: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    let per = groups.div_ceil(parts.max(1)).max(1);
    (0..groups)
        .step_by(per)
        .map(|s| s..(s + per).min(groups))
        .collect()
}

/// Runs `f` on `threads` contiguous ranges of `0..units` (groups, chunks), a scoped thread
/// each when there are several, and returns the results in range order, so that what is built
/// from them never depends on the thread count.
pub(crate) fn map_ranges<R: Send>(
    units: usize,
    threads: usize,
    f: impl Fn(std::ops::Range<usize>) -> R + Sync,
) -> Vec<R> {
    if threads <= 1 {
        return vec![f(0..units)];
    }
    let f = &f;
    crossbeam_utils::thread::scope(|s| {
        let handles: Vec<_> = split_groups(units, threads)
            .into_iter()
            .map(|r| s.spawn(move |_| f(r)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
    .unwrap_or_else(|p| std::panic::resume_unwind(p))
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

/// What one thread produces for its range of groups.
#[derive(Default)]
struct Part {
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

fn encode_range<T: Element, const FIXED: bool>(data: &[T], first: u64, qz: &Quantizer) -> Part {
    let mut part = Part {
        widths: Vec::with_capacity(data.len().div_ceil(GROUP)),
        planes: Vec::with_capacity(data.len() / 2),
        ..Part::default()
    };
    let mut zz = [0u32; GROUP];
    for (g, chunk) in data.chunks(GROUP).enumerate() {
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
            part.exc_index.push(first + (g * GROUP + j) as u64);
            part.exc_bits.push(chunk[j].to_bits32());
        }
        let w = qz.fixed_bits.unwrap_or_else(|| width_of(acc as u64));
        part.widths.push(w as u8);
        pack32(&zz, w, &mut part.planes);
    }
    part
}

fn encode<T: Element>(data: &[T], first: u64, qz: &Quantizer) -> Part {
    if qz.fixed_bits.is_some() {
        encode_range::<T, true>(data, first, qz)
    } else {
        encode_range::<T, false>(data, first, qz)
    }
}

/// Largest magnitude among the finite elements (0 when there are none).
fn max_finite_abs<T: Element>(data: &[T]) -> f64 {
    data.iter()
        .filter(|x| x.is_finite())
        .map(|x| x.to_f64().abs())
        .fold(0.0, f64::max)
}

/// Checks an absolute bound (given, or derived from `rel`).
pub(crate) fn check_abs_bound(eps: f64, what: &'static str) -> Result<()> {
    let bad = |reason: &str| Error::InvalidBound {
        what,
        reason: format!("{eps:e} {reason}"),
    };
    if eps.is_nan() || eps.is_infinite() {
        return Err(bad("is not finite"));
    }
    if eps <= 0.0 {
        return Err(bad("must be positive"));
    }
    if !(f64::MIN_POSITIVE..=f64::MAX / 4.0).contains(&eps) {
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
            reason: format!("{rel:e} must be positive and finite"),
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

fn quantizer_for<T: Element>(data: &[T], bound: Bound) -> Result<(Quantizer, BoundMode, u8)> {
    match bound {
        Bound::Abs(eps) => Ok((abs_quantizer(eps, "eps")?, BoundMode::Abs, 0)),
        Bound::Rel(rel) => {
            check_rel(rel)?;
            let max = max_finite_abs(data);
            // With no nonzero finite element every bound holds; use `rel` itself as the bound.
            let eps = if max > 0.0 { rel * max } else { rel };
            Ok((abs_quantizer(eps, "rel")?, BoundMode::Rel, 0))
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
    let shape = checked_shape(shape, data.len())?;
    let (qz, mode, bits) = quantizer_for(data, opts.bound)?;
    let n = data.len();
    let groups = n.div_ceil(GROUP);
    let threads = thread_count(opts.threads, n);
    let _span = tracing::debug_span!("compress", dtype = T::DTYPE.name(), n, threads).entered();

    let parts: Vec<Part> = map_ranges(groups, threads, |r| {
        let (lo, hi) = (r.start * GROUP, (r.end * GROUP).min(n));
        encode(&data[lo..hi], lo as u64, &qz)
    });

    let n_exc: usize = parts.iter().map(|p| p.exc_index.len()).sum();
    let planes_len: usize = parts.iter().map(|p| p.planes.len()).sum();
    let index_size = crate::format::index_size_for(n as u64);
    let quant_len = groups + planes_len + n_exc * (index_size + T::DTYPE.size());
    let raw_len = n * T::DTYPE.size();
    let eps = match qz.fixed_bits {
        Some(_) => parts.iter().map(|p| p.max_err).fold(0.0, f64::max),
        None => qz.eps,
    };

    let mut header = Header {
        codec: Codec::Quantized,
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
    };
    // Fixed rate keeps its promised layout; otherwise never store more than the raw bytes.
    let body = if quant_len >= raw_len && qz.fixed_bits.is_none() {
        header.codec = Codec::Raw;
        header.n_exceptions = 0;
        bytemuck::cast_slice::<T, u8>(data).to_vec()
    } else {
        let mut body = Vec::with_capacity(quant_len);
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

/// Applies the optional zstd stage and writes header + body.
pub(crate) fn finish_frame(
    mut header: Header,
    body: Vec<u8>,
    zstd_level: Option<i32>,
) -> Result<Vec<u8>> {
    header.raw_body_len = body.len() as u64;
    let stored = match zstd_level {
        Some(level) => {
            let z = zstd::bulk::compress(&body, level).map_err(Error::Zstd)?;
            if z.len() < body.len() {
                header.zstd = true;
                z
            } else {
                body
            }
        }
        None => body,
    };
    header.body_len = stored.len() as u64;
    let mut out = Vec::with_capacity(header.len() + stored.len());
    header.write(&mut out);
    out.extend_from_slice(&stored);
    Ok(out)
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

/// Raw little-endian bytes as elements of `T`: borrowed when aligned, copied otherwise.
pub(crate) fn elements<T: Element>(bytes: &[u8]) -> Result<std::borrow::Cow<'_, [T]>> {
    if bytes.len() % std::mem::size_of::<T>() != 0 {
        return Err(Error::MisalignedInput {
            len: bytes.len(),
            element_size: std::mem::size_of::<T>(),
        });
    }
    Ok(match bytemuck::try_cast_slice::<u8, T>(bytes) {
        Ok(data) => std::borrow::Cow::Borrowed(data),
        Err(_) => std::borrow::Cow::Owned(bytemuck::pod_collect_to_vec::<u8, T>(bytes)),
    })
}

/// A frame whose body has been checked and, if needed, taken out of its zstd stage.
pub(crate) struct Body<'a> {
    pub header: Header,
    pub raw: std::borrow::Cow<'a, [u8]>,
    /// Where each chunk of a lossless body sits (empty for other codecs).
    pub chunks: Vec<crate::lossless::ChunkRef>,
}

impl<'a> Body<'a> {
    /// Parses a frame, undoes the zstd stage and checks the body's internal lengths, widths
    /// and exception indices. Nothing is indexed before it is checked.
    pub(crate) fn open(frame: &'a [u8]) -> Result<Body<'a>> {
        let (header, stored) = Header::parse(frame)?;
        let raw = if header.zstd {
            std::borrow::Cow::Owned(unzstd(stored, header.raw_body_len)?)
        } else {
            std::borrow::Cow::Borrowed(stored)
        };
        let mut body = Body {
            header,
            raw,
            chunks: Vec::new(),
        };
        match body.header.codec {
            Codec::Quantized => body.check_quantized()?,
            Codec::Lossless => {
                body.chunks =
                    crate::lossless::check_body(&body.raw, body.header.n, body.header.dtype)?
            }
            Codec::Raw if body.header.dtype == DType::Bool => {
                crate::lossless::check_bools(&body.raw)?
            }
            Codec::Raw => {}
        }
        Ok(body)
    }

    fn check_quantized(&self) -> Result<()> {
        let lay = self.header.layout();
        let widths = &self.raw[..lay.groups];
        let mut total: u64 = 0;
        for (g, &w) in widths.iter().enumerate() {
            if w > MAX_WIDTH {
                return Err(FormatError::BadWidth {
                    group: g as u64,
                    width: w,
                }
                .into());
            }
            total += w as u64;
        }
        if total * 4 != lay.planes_len as u64 {
            return Err(FormatError::LengthMismatch {
                part: "bit planes",
                expected: total * 4,
                found: lay.planes_len as u64,
            }
            .into());
        }
        let n = self.header.n;
        let mut prev: Option<u64> = None;
        for (k, i) in self.exception_indices().enumerate() {
            if i >= n || prev.is_some_and(|p| i <= p) {
                return Err(FormatError::BadExceptionIndex {
                    position: k as u64,
                    index: i,
                }
                .into());
            }
            prev = Some(i);
        }
        Ok(())
    }

    pub(crate) fn widths(&self) -> &[u8] {
        &self.raw[..self.header.layout().groups]
    }

    pub(crate) fn planes(&self) -> &[u8] {
        let lay = self.header.layout();
        &self.raw[lay.groups..lay.groups + lay.planes_len]
    }

    /// Exception indices in stored order.
    pub(crate) fn exception_indices(&self) -> impl Iterator<Item = u64> + '_ {
        let lay = self.header.layout();
        let start = lay.groups + lay.planes_len;
        let len = self.header.n_exceptions as usize * lay.index_size;
        self.raw[start..start + len]
            .chunks_exact(lay.index_size)
            .map(|c| {
                let mut a = [0u8; 8];
                a[..c.len()].copy_from_slice(c);
                u64::from_le_bytes(a)
            })
    }

    /// Raw bits of the exception values in stored order.
    pub(crate) fn exception_bits(&self) -> impl Iterator<Item = u32> + '_ {
        let lay = self.header.layout();
        let size = self.header.dtype.size();
        let start =
            lay.groups + lay.planes_len + self.header.n_exceptions as usize * lay.index_size;
        let len = self.header.n_exceptions as usize * size;
        self.raw[start..start + len].chunks_exact(size).map(|c| {
            let mut a = [0u8; 4];
            a[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(a)
        })
    }
}

/// Undoes the zstd stage, producing exactly `raw_len` bytes or an error. The output grows only
/// as zstd really produces data, so a crafted length alone cannot force a large allocation.
fn unzstd(stored: &[u8], raw_len: u64) -> Result<Vec<u8>> {
    let zerr = |e: std::io::Error| Error::from(FormatError::Zstd(e.to_string()));
    // Exactly one zstd frame and nothing after it: a frame has one byte encoding.
    match zstd::zstd_safe::find_frame_compressed_size(stored) {
        Ok(len) if len == stored.len() => {}
        Ok(len) => {
            return Err(FormatError::LengthMismatch {
                part: "zstd frame",
                expected: stored.len() as u64,
                found: len as u64,
            }
            .into())
        }
        Err(code) => {
            return Err(FormatError::Zstd(zstd::zstd_safe::get_error_name(code).to_string()).into())
        }
    }
    // The output is allocated up front only when the announced size is plausible for the stored
    // bytes (bounded by real input, not by the header's claim); a higher ratio (long zero runs)
    // streams, and the vector grows only as zstd really produces data.
    let plausible = (stored.len() as u64)
        .saturating_mul(256)
        .saturating_add(1 << 20);
    // (every allocation here is fallible: the sizes are a hostile frame's to choose)
    if raw_len <= plausible {
        let mut out = try_capacity(raw_len as usize)?;
        // Fails, rather than writing past, if the frame inflates beyond the announced size; the
        // streaming path below then says exactly how the lengths disagree.
        let bulk = zstd::bulk::Decompressor::new()
            .and_then(|mut d| d.decompress_to_buffer(stored, &mut out));
        if bulk.is_ok() && out.len() as u64 == raw_len {
            return Ok(out);
        }
    }
    let dec = zstd::stream::read::Decoder::with_buffer(stored)
        .map_err(zerr)?
        .single_frame();
    let mut out: Vec<u8> = try_capacity(raw_len.min(plausible) as usize)?;
    // One byte more than announced tells "longer than announced" apart from "exact" (none
    // past u64::MAX: no body reaches that length anyway).
    let mut dec = dec.take(raw_len.saturating_add(1));
    // Read in pieces rather than with `read_to_end`, whose growth aborts the process where
    // memory runs out: a valid frame of long zero runs can inflate by a factor of thousands.
    let mut piece = vec![0u8; 1 << 20];
    loop {
        let got = match dec.read(&mut piece) {
            Ok(0) => break,
            Ok(got) => got,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(zerr(e)),
        };
        out.try_reserve(got).map_err(|_| Error::Allocation {
            bytes: out.len() as u64 + got as u64,
        })?;
        out.extend_from_slice(&piece[..got]);
    }
    if out.len() as u64 != raw_len {
        return Err(FormatError::LengthMismatch {
            part: "zstd-decoded body",
            expected: raw_len,
            found: out.len() as u64,
        }
        .into());
    }
    Ok(out)
}

/// Decodes groups `range` of a checked quantized body into `out` (which starts at the
/// range's first element). `planes` starts at the range's first plane.
fn decode_range<T: Element>(widths: &[u8], mut planes: &[u8], step: f64, out: &mut [T]) {
    let mut zz = [0u32; GROUP];
    let mut zz64 = [0u64; GROUP];
    let zero = dequantize::<T>(0, step);
    for (&w, chunk) in widths.iter().zip(out.chunks_mut(GROUP)) {
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
                *o = dequantize(crate::bitplane::unzigzag(z), step);
            }
        }
    }
}

/// Decodes a frame into `out`, which must hold exactly the frame's element count.
pub(crate) fn decode_into<T: Element>(
    body: &Body<'_>,
    out: &mut [T],
    threads: usize,
) -> Result<()> {
    let h = &body.header;
    if T::DTYPE != h.dtype {
        return Err(Error::Incompatible {
            what: "dtype",
            left: h.dtype.name().into(),
            right: T::DTYPE.name().into(),
        });
    }
    if out.len() as u64 != h.n {
        return Err(Error::OutputSize {
            expected: h.decoded_len(),
            got: std::mem::size_of_val(out) as u64,
        });
    }
    match h.codec {
        Codec::Raw => {
            // Lengths were checked by `Header::parse`: raw_body_len == n * size.
            bytemuck::cast_slice_mut::<T, u8>(out).copy_from_slice(&body.raw);
        }
        Codec::Lossless => {
            let w = h.dtype.size();
            crate::lossless::decode_body(
                &body.raw,
                &body.chunks,
                w,
                bytemuck::cast_slice_mut::<T, u8>(out),
                threads,
            );
        }
        Codec::Quantized => {
            let widths = body.widths();
            let planes = body.planes();
            let n = out.len();
            let threads = thread_count(threads, n);
            if threads == 1 {
                decode_range(widths, planes, h.step, out);
            } else {
                let ranges = split_groups(widths.len(), threads);
                // Plane offset of each range: a prefix sum over the (already checked) widths.
                let mut jobs = Vec::with_capacity(ranges.len());
                let mut rest: &mut [T] = out;
                let mut offset = 0usize;
                for r in &ranges {
                    let elems = (r.len() * GROUP).min(rest.len());
                    let (mine, tail) = rest.split_at_mut(elems);
                    rest = tail;
                    let bytes: usize = widths[r.clone()].iter().map(|&w| w as usize * 4).sum();
                    jobs.push((&widths[r.clone()], &planes[offset..offset + bytes], mine));
                    offset += bytes;
                }
                let step = h.step;
                crossbeam_utils::thread::scope(|s| {
                    for (w, p, o) in jobs {
                        s.spawn(move |_| decode_range(w, p, step, o));
                    }
                })
                .unwrap_or_else(|p| std::panic::resume_unwind(p));
            }
            for (i, b) in body.exception_indices().zip(body.exception_bits()) {
                out[i as usize] = T::from_bits32(b);
            }
        }
    }
    Ok(())
}

/// Decompresses a frame into a new vector of `T`, returning the frame's header with it.
///
/// # Errors
/// [`Error::Format`] for a malformed buffer, [`Error::OutputSize`] when `T` is not the
/// frame's dtype.
pub fn decompress<T: Element>(frame: &[u8]) -> Result<(Header, Vec<T>)> {
    let body = Body::open(frame)?;
    let mut out = crate::error::try_filled(body.header.n as usize, T::zeroed())?;
    decode_into(&body, &mut out, 0)?;
    Ok((body.header, out))
}

/// Decompresses a frame into `out`, raw little-endian bytes of the frame's dtype (any alignment).
///
/// # Errors
/// [`Error::Format`] for a malformed buffer, [`Error::OutputSize`] when `out` has the wrong length.
pub fn decompress_into_bytes(frame: &[u8], out: &mut [u8], threads: usize) -> Result<Header> {
    let open = OpenFrame::open(frame)?;
    open.decode_into_bytes(out, threads)?;
    Ok(open.0.header)
}

/// A frame whose header and body have been fully checked (and its zstd stage undone), ready to
/// decode. Lets a caller validate first and allocate the output only for a frame known good.
pub struct OpenFrame<'a>(Body<'a>);

impl<'a> OpenFrame<'a> {
    /// Checks a whole frame, as [`decompress`] does before decoding.
    ///
    /// # Errors
    /// [`Error::Format`] for a malformed buffer.
    pub fn open(frame: &'a [u8]) -> Result<OpenFrame<'a>> {
        Body::open(frame).map(OpenFrame)
    }

    /// The frame's header.
    pub fn header(&self) -> &Header {
        &self.0.header
    }

    /// Decodes into `out`, raw little-endian bytes of the frame's dtype (any alignment).
    ///
    /// # Errors
    /// [`Error::OutputSize`] when `out` does not have exactly the decoded size.
    pub fn decode_into_bytes(&self, out: &mut [u8], threads: usize) -> Result<()> {
        fn go<T: Element>(body: &Body<'_>, out: &mut [u8], threads: usize) -> Result<()> {
            match bytemuck::try_cast_slice_mut::<u8, T>(out) {
                Ok(typed) => decode_into(body, typed, threads),
                Err(_) => {
                    let mut tmp = crate::error::try_filled(body.header.n as usize, T::zeroed())?;
                    decode_into(body, &mut tmp, threads)?;
                    out.copy_from_slice(bytemuck::cast_slice(&tmp));
                    Ok(())
                }
            }
        }
        let h = &self.0.header;
        if out.len() as u64 != h.decoded_len() {
            return Err(Error::OutputSize {
                expected: h.decoded_len(),
                got: out.len() as u64,
            });
        }
        let _span = tracing::debug_span!("decompress", dtype = h.dtype.name(), n = h.n).entered();
        match (h.codec, h.dtype) {
            // Lengths were checked by `Header::parse`: raw_body_len == n * size.
            (Codec::Raw, _) => {
                out.copy_from_slice(&self.0.raw);
                Ok(())
            }
            (Codec::Lossless, d) => {
                crate::lossless::decode_body(&self.0.raw, &self.0.chunks, d.size(), out, threads);
                Ok(())
            }
            (Codec::Quantized, DType::F32) => go::<f32>(&self.0, out, threads),
            (Codec::Quantized, DType::BF16) => go::<bf16>(&self.0, out, threads),
            (Codec::Quantized, DType::F16) => go::<f16>(&self.0, out, threads),
            // `Header::parse` refuses quantized frames of other dtypes.
            (Codec::Quantized, d) => Err(Error::NotQuantizable(d)),
        }
    }
}

/// Exact size of a fixed-rate (`Bound::Bits`) frame of finite data, known before compressing:
/// header, one width byte per group and `bits` planes per group. Each non-finite element adds
/// its index and value.
///
/// # Errors
/// Where no such frame exists: [`Error::InvalidBound`] for `bits` outside 2 to 32,
/// [`Error::ShapeMismatch`] for more than [`crate::format::MAX_NDIM`] dimensions or a size that
/// overflows.
pub fn fixed_rate_size(shape: &[usize], bits: u8) -> Result<u64> {
    check_bits(bits)?;
    let impossible = || Error::ShapeMismatch {
        shape_elements: None,
        elements: 0,
        ndim: shape.len(),
    };
    if shape.len() > crate::format::MAX_NDIM {
        return Err(impossible());
    }
    let n = shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
        .ok_or_else(impossible)?;
    let groups = crate::format::groups_for(n);
    let header = (crate::format::FIXED_HEADER_LEN + 8 * shape.len()) as u64;
    groups
        .checked_mul(1 + 4 * bits as u64)
        .and_then(|b| b.checked_add(header))
        .ok_or_else(impossible)
}

/// Checks a whole frame, header and body (widths, plane lengths, exception indices, the zstd
/// stage), without decoding its values. A frame that passes decodes without error, on the CPU
/// or on a GPU (which trusts what the host checked). A zstd stage is inflated to check the
/// body beneath it, so that body's memory is needed for the while (a frame of long zero runs
/// may inflate a thousandfold: the Python layer's `max_nbytes` caps a frame's claim first).
///
/// # Errors
/// [`Error::Format`] saying what is wrong; [`Error::Allocation`] where an inflated body's
/// memory cannot be had.
pub fn validate(frame: &[u8]) -> Result<Header> {
    Body::open(frame).map(|b| b.header)
}
