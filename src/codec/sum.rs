//! Summable codes: the integer view of a frame.
//!
//! Frames quantized with the same step hold integer codes that add exactly: the sum of the
//! codes, decoded once, is within the sum of the bounds of the sum of the originals (plus one
//! final rounding to the element type). The compressed all-reduce builds on this: each rank
//! quantizes once, the codes are summed as integers and repacked losslessly with a few more
//! bits, and no second quantization error is ever added.

use crate::codec::bitplane::{pack64, unzigzag, width_of, zigzag};
use crate::codec::element::{dequantize, Element};
use crate::codec::format::finish_frame;
use crate::codec::format::{read_header, BoundMode, Codec, Coder, DType, Header, GROUP};
use crate::codec::frame::Body;
use crate::codec::rice;
use crate::codec::scales::BlockScales;
use crate::error::{Error, Result};
use half::{bf16, f16};

/// The integer codes of a frame, with its exactly stored exceptions.
///
/// Element `i` decodes to `codes[i] * step` (see [`Element`]) unless `i` is an exception, in
/// which case it decodes to the exception's stored bits. Codes at exception positions are 0.
#[derive(Debug, Clone, PartialEq)]
pub struct Codes {
    /// Element type.
    pub dtype: DType,
    /// Dimensions.
    pub shape: Vec<u64>,
    /// Quantization step shared by every code (the coarsest block's, with block scales).
    pub step: f64,
    /// Bound on `|decoded - original|` for finite elements (the coarsest block's).
    pub eps: f64,
    /// Block scales: each block's step is `step` halved its shift's times.
    pub scales: Option<BlockScales>,
    /// One code per element.
    pub codes: Vec<i64>,
    /// `(index, raw bits)` of exactly stored elements, by increasing index.
    pub exceptions: Vec<(u64, u32)>,
}

impl Codes {
    /// Reads the codes of a frame. A raw-codec frame yields zero codes and every element as an
    /// exception.
    ///
    /// # Errors
    /// [`Error::Format`] for a malformed frame.
    pub fn from_frame(frame: &[u8]) -> Result<Codes> {
        let body = Body::open(frame)?;
        let h = &body.header;
        if !h.dtype.is_quantizable() {
            return Err(Error::NotQuantizable(h.dtype));
        }
        let n = h.n as usize;
        let mut codes = crate::error::try_filled(n, 0i64)?;
        let exceptions: Vec<(u64, u32)> = match h.codec {
            Codec::Raw | Codec::Lossless => {
                let size = h.dtype.size();
                let mut raw = std::borrow::Cow::Borrowed(&body.raw[..]);
                if h.codec == Codec::Lossless {
                    let mut bytes = crate::error::try_filled(n.saturating_mul(size), 0u8)?;
                    crate::codec::lossless::decode_body(
                        &body.raw,
                        &body.chunks,
                        size,
                        &mut bytes,
                        0,
                    );
                    raw = std::borrow::Cow::Owned(bytes);
                }
                let mut all = crate::error::try_capacity(n)?;
                all.extend(raw.chunks_exact(size).enumerate().map(|(i, c)| {
                    let mut a = [0u8; 4];
                    a[..size].copy_from_slice(c);
                    (i as u64, u32::from_le_bytes(a))
                }));
                all
            }
            Codec::Quantized | Codec::Rice => {
                if h.codec == Codec::Rice {
                    let (data, blocks) = (body.planes(), &body.blocks);
                    let mut zz = [0u64; rice::BLOCK];
                    for (b, out) in codes.chunks_mut(rice::BLOCK).enumerate() {
                        rice::decode_block(blocks.heads[b], &data[blocks.starts[b]..], &mut zz);
                        for (o, &z) in out.iter_mut().zip(zz.iter()) {
                            *o = unzigzag(z);
                        }
                    }
                } else {
                    let mut planes = body.planes();
                    let mut zz = [0u64; GROUP];
                    for (&w, out) in body.widths().iter().zip(codes.chunks_mut(GROUP)) {
                        let (mine, rest) = planes.split_at(w as usize * 4);
                        planes = rest;
                        crate::codec::bitplane::unpack64(mine, &mut zz);
                        for (o, &z) in out.iter_mut().zip(zz.iter()) {
                            *o = unzigzag(z);
                        }
                    }
                }
                let exc: Vec<(u64, u32)> = body
                    .exception_indices()
                    .zip(body.exception_bits())
                    .collect();
                for &(i, _) in &exc {
                    codes[i as usize] = 0;
                }
                exc
            }
        };
        Ok(Codes {
            dtype: h.dtype,
            shape: h.shape.clone(),
            step: h.step,
            eps: h.eps,
            scales: body.scales.clone(),
            codes,
            exceptions,
        })
    }

    /// Checks that the fields agree with each other: what a frame guarantees, and what
    /// [`Codes::sum`] and [`Codes::to_frame`] rely on for values built by hand.
    ///
    /// # Errors
    /// [`Error::InvalidCodes`] saying what is inconsistent.
    pub fn check(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::InvalidCodes { reason });
        if !self.dtype.is_quantizable() {
            return Err(Error::NotQuantizable(self.dtype));
        }
        if self.shape.len() > crate::codec::format::MAX_NDIM {
            return bad(format!(
                "{} dimensions (at most {})",
                self.shape.len(),
                crate::codec::format::MAX_NDIM
            ));
        }
        let n = self.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        if n != Some(self.codes.len() as u64) {
            return bad(format!(
                "shape {:?} does not hold {} codes",
                self.shape,
                self.codes.len()
            ));
        }
        if !(self.step.is_finite() && self.step > 0.0) {
            return bad(format!("step {:e} must be positive and finite", self.step));
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return bad(format!(
                "eps {:e} must be finite and not negative",
                self.eps
            ));
        }
        if let Some(s) = &self.scales {
            s.check(self.codes.len() as u64, self.step)
                .map_err(|e| Error::InvalidCodes {
                    reason: e.to_string(),
                })?;
        }
        // Bits wider than the element would be cut to it in the frame, and a code at an
        // exception would be dropped there (the frame's code is 0): either way the frame would
        // not give these codes back.
        let width = 8 * self.dtype.size() as u32;
        let mut prev: Option<u64> = None;
        for &(i, b) in &self.exceptions {
            if i >= self.codes.len() as u64 || prev.is_some_and(|p| i <= p) {
                return bad(format!(
                    "exception index {i} out of range or not increasing"
                ));
            }
            if width < 32 && b >> width != 0 {
                return bad(format!(
                    "exception {i} holds bits {b:#x}, wider than a {}-bit element",
                    width
                ));
            }
            if self.codes[i as usize] != 0 {
                return bad(format!(
                    "exception {i} has code {} (codes at exceptions are 0)",
                    self.codes[i as usize]
                ));
            }
            prev = Some(i);
        }
        Ok(())
    }

    /// Packs the codes into a frame, losslessly: [`Codes::from_frame`] gives them back unchanged.
    ///
    /// # Errors
    /// [`Error::InvalidCodes`] for inconsistent fields; [`Error::Zstd`] if the zstd stage fails.
    pub fn to_frame(&self, zstd_level: Option<i32>) -> Result<Vec<u8>> {
        self.to_frame_as(Coder::Planes, zstd_level)
    }

    /// [`Codes::to_frame`], with the codes written by `coder` (bit planes, or Rice codes).
    ///
    /// # Errors
    /// As [`Codes::to_frame`].
    pub fn to_frame_as(&self, coder: Coder, zstd_level: Option<i32>) -> Result<Vec<u8>> {
        self.check()?;
        let n = self.codes.len();
        let groups = n.div_ceil(GROUP);
        let index_size = crate::codec::format::index_size_for(n as u64);
        let mut body = Vec::with_capacity(groups * 5);
        if let Some(s) = &self.scales {
            body.extend_from_slice(&s.shifts);
        }
        let mut planes = Vec::new();
        match coder {
            Coder::Planes => {
                let mut zz = [0u64; GROUP];
                for chunk in self.codes.chunks(GROUP) {
                    let mut acc = 0u64;
                    for (z, &q) in zz.iter_mut().zip(chunk) {
                        *z = zigzag(q);
                        acc |= *z;
                    }
                    zz[chunk.len()..].fill(0);
                    let w = width_of(acc);
                    body.push(w as u8);
                    pack64(&zz, w, &mut planes);
                }
            }
            Coder::Rice => {
                let mut zz = [0u64; rice::BLOCK];
                for chunk in self.codes.chunks(rice::BLOCK) {
                    for (z, &q) in zz.iter_mut().zip(chunk) {
                        *z = zigzag(q);
                    }
                    zz[chunk.len()..].fill(0);
                    rice::encode_block(&zz, &mut body, &mut planes);
                }
            }
        }
        body.extend_from_slice(&planes);
        for &(i, _) in &self.exceptions {
            body.extend_from_slice(&i.to_le_bytes()[..index_size]);
        }
        for &(_, b) in &self.exceptions {
            body.extend_from_slice(&b.to_le_bytes()[..self.dtype.size()]);
        }
        let header = Header {
            codec: match coder {
                Coder::Planes => Codec::Quantized,
                Coder::Rice => Codec::Rice,
            },
            dtype: self.dtype,
            zstd: false,
            mode: BoundMode::Sum,
            bits: 0,
            n: n as u64,
            step: self.step,
            eps: self.eps,
            n_exceptions: self.exceptions.len() as u64,
            body_len: 0,
            raw_body_len: 0,
            shape: self.shape.clone(),
            block_log2: self.scales.as_ref().map_or(0, |s| s.log2),
        };
        finish_frame(header, body, zstd_level)
    }

    /// The value element `i` decodes to, as `f64`.
    fn value(&self, i: usize, exception_bits: Option<u32>) -> f64 {
        fn v<T: Element>(code: i64, step: f64, bits: Option<u32>) -> f64 {
            match bits {
                Some(b) => T::from_bits32(b).to_f64(),
                None => dequantize::<T>(code, step).to_f64(),
            }
        }
        let step = match &self.scales {
            Some(s) => s.step(self.step, i >> s.log2),
            None => self.step,
        };
        match self.dtype {
            DType::F32 => v::<f32>(self.codes[i], step, exception_bits),
            DType::BF16 => v::<bf16>(self.codes[i], step, exception_bits),
            DType::F16 => v::<f16>(self.codes[i], step, exception_bits),
            // `Codes::check` refuses every other dtype before values are read.
            _ => f64::NAN,
        }
    }

    /// Element-wise sum of several code sets quantized with the same step.
    ///
    /// Codes add as integers, exactly. Where any part holds an exception, the result holds an
    /// exception whose value is the `f64` sum of every part's decoded value there (in part
    /// order), rounded to `f32` and then to the element type: NaN and infinities propagate as
    /// IEEE arithmetic says, a NaN being stored as the quiet NaN of the element type. The result's
    /// `eps` is the sum of the parts' bounds.
    ///
    /// # Errors
    /// [`Error::Incompatible`] when dtype, shape or step differ; [`Error::InvalidCodes`] for
    /// an inconsistent part; [`Error::CodeOverflow`] if a sum leaves the 64-bit range.
    pub fn sum(parts: &[Codes]) -> Result<Codes> {
        Codes::sum_dividing_exceptions(parts, 1.0)
    }

    /// [`Codes::sum`], with each exception's `f64` total divided by `divisor` before it is
    /// rounded: the sums of an average, whose codes the reader divides as it decodes them in
    /// `f64` (see `collective::decode_summed`), so that no value is rounded to the element type
    /// before it is divided (an fp16 total past 65504 would be infinite there).
    pub(crate) fn sum_dividing_exceptions(parts: &[Codes], divisor: f64) -> Result<Codes> {
        for p in parts {
            p.check()?;
        }
        let first = parts.first().ok_or(Error::Incompatible {
            what: "count",
            left: "at least one frame".into(),
            right: "none".into(),
        })?;
        for p in &parts[1..] {
            if p.dtype != first.dtype {
                return Err(Error::Incompatible {
                    what: "dtype",
                    left: first.dtype.name().into(),
                    right: p.dtype.name().into(),
                });
            }
            if p.shape != first.shape {
                return Err(Error::Incompatible {
                    what: "shape",
                    left: format!("{:?}", first.shape),
                    right: format!("{:?}", p.shape),
                });
            }
            if p.step.to_bits() != first.step.to_bits() {
                return Err(Error::Incompatible {
                    what: "step",
                    left: format!("{:e}", first.step),
                    right: format!("{:e}", p.step),
                });
            }
        }
        // Block scales: the parts that have them must have the same; a part without them fits
        // only where all its codes are 0 (a raw frame's: its values are all stored).
        let scales = parts.iter().find_map(|p| p.scales.as_ref());
        if let Some(s) = scales {
            let describe = |s: Option<&BlockScales>| match s {
                None => "no block scales, and nonzero codes".to_string(),
                Some(s) => format!(
                    "blocks of 2^{} with shifts {:?}...",
                    s.log2,
                    &s.shifts[..s.shifts.len().min(4)]
                ),
            };
            for p in parts {
                let fits = match &p.scales {
                    Some(ps) => ps == s,
                    None => p.codes.iter().all(|&c| c == 0),
                };
                if !fits {
                    return Err(Error::Incompatible {
                        what: "block scales",
                        left: describe(Some(s)),
                        right: describe(p.scales.as_ref()),
                    });
                }
            }
        }
        let scales = scales.cloned();
        let mut codes = first.codes.clone();
        for p in &parts[1..] {
            for (i, (a, &b)) in codes.iter_mut().zip(&p.codes).enumerate() {
                *a = a
                    .checked_add(b)
                    .ok_or(Error::CodeOverflow { index: i as u64 })?;
            }
        }
        // Positions that are an exception in any part, in increasing order.
        let mut positions: Vec<u64> = parts
            .iter()
            .flat_map(|p| p.exceptions.iter().map(|&(i, _)| i))
            .collect();
        positions.sort_unstable();
        positions.dedup();
        let mut cursors = vec![0usize; parts.len()];
        let mut exceptions = Vec::with_capacity(positions.len());
        for &i in &positions {
            let mut total = 0.0f64;
            for (p, cur) in parts.iter().zip(cursors.iter_mut()) {
                let bits = match p.exceptions.get(*cur) {
                    Some(&(j, b)) if j == i => {
                        *cur += 1;
                        Some(b)
                    }
                    _ => None,
                };
                total += p.value(i as usize, bits);
            }
            let total = total / divisor;
            let bits = match first.dtype {
                DType::F32 => sum_bits::<f32>(total),
                DType::BF16 => sum_bits::<bf16>(total),
                DType::F16 => sum_bits::<f16>(total),
                // `Codes::check` refused every other dtype above.
                _ => f32::NAN.to_bits(),
            };
            codes[i as usize] = 0;
            exceptions.push((i, bits));
        }
        let eps = parts.iter().map(|p| p.eps).sum();
        Ok(Codes {
            dtype: first.dtype,
            shape: first.shape.clone(),
            step: first.step,
            eps,
            scales,
            codes,
            exceptions,
        })
    }
}

/// The bits an exception of a sum stores for the `f64` total of the parts' values: the total
/// rounded to `f32`, then to the element type (the roundings of the decode rule, which the GPU
/// makes alike); a NaN total is stored as the quiet NaN `f32::NAN` converted, since IEEE
/// arithmetic leaves a NaN's payload to the machine.
fn sum_bits<T: Element>(total: f64) -> u32 {
    let f = if total.is_nan() {
        f32::NAN
    } else {
        total as f32
    };
    T::from_f32(f).to_bits32()
}

/// Sums frames quantized with the same step into one frame (see [`Codes::sum`]), written by
/// the first frame's coder: Rice codes if it is a rice frame, bit planes otherwise.
///
/// # Errors
/// As [`Codes::from_frame`] and [`Codes::sum`].
pub fn sum_frames(frames: &[&[u8]], zstd_level: Option<i32>) -> Result<Vec<u8>> {
    let parts = frames
        .iter()
        .map(|f| Codes::from_frame(f))
        .collect::<Result<Vec<_>>>()?;
    let coder = match frames.first().map(|f| read_header(f)) {
        Some(Ok(h)) if h.codec == Codec::Rice => Coder::Rice,
        _ => Coder::Planes,
    };
    Codes::sum(&parts)?.to_frame_as(coder, zstd_level)
}
