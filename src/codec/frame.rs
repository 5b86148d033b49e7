//! Reading frames of every codec: a frame is parsed and its body checked whole
//! ([`Body::open`]) before anything is decoded, then decoded by the codec its header names
//! (quantized: [`crate::codec::bounded`]; lossless: [`crate::codec::lossless`]; raw).

use crate::codec::bounded::decode_range;
use crate::codec::element::{dequantize, Element};
use crate::codec::format::{Codec, DType, Header, GROUP, MAX_WIDTH};
use crate::codec::lossless;
use crate::codec::parallel::{split_groups, thread_count};
use crate::codec::rice;
use crate::codec::scales::{BlockScales, Steps};
use crate::error::{try_capacity, Error, FormatError, Result};
use half::{bf16, f16};
use std::io::Read;

/// A frame whose body has been checked and, if needed, taken out of its zstd stage.
pub(crate) struct Body<'a> {
    pub header: Header,
    pub raw: std::borrow::Cow<'a, [u8]>,
    /// Where each chunk of a lossless body sits (empty for other codecs).
    pub chunks: Vec<lossless::ChunkRef>,
    /// The blocks of a rice body (empty for other codecs).
    pub blocks: rice::Blocks,
    /// The block scales of a frame that has them.
    pub scales: Option<BlockScales>,
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
            blocks: rice::Blocks::default(),
            scales: None,
        };
        match body.header.codec {
            Codec::Quantized | Codec::Rice => body.check_quantized()?,
            Codec::Lossless => {
                body.chunks = lossless::check_body(&body.raw, body.header.n, body.header.dtype)?
            }
            Codec::Raw if body.header.dtype == DType::Bool => lossless::check_bools(&body.raw)?,
            Codec::Raw => {}
        }
        Ok(body)
    }

    fn check_quantized(&mut self) -> Result<()> {
        let lay = self.header.layout();
        if self.header.block_log2 != 0 {
            let scales = BlockScales {
                log2: self.header.block_log2,
                shifts: self.raw[..lay.scales_len].to_vec(),
            };
            scales.check(self.header.n, self.header.step)?;
            self.scales = Some(scales);
        }
        if self.header.codec == Codec::Rice {
            let heads = &self.raw[lay.scales_len..lay.scales_len + lay.table_len];
            self.blocks = rice::check(heads, self.planes())?;
        } else {
            self.check_widths()?;
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

    fn check_widths(&self) -> Result<()> {
        let widths = self.widths();
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
        let planes_len = self.header.layout().planes_len as u64;
        if total * 4 != planes_len {
            return Err(FormatError::LengthMismatch {
                part: "bit planes",
                expected: total * 4,
                found: planes_len,
            }
            .into());
        }
        Ok(())
    }

    /// The width table of a bit-plane body.
    pub(crate) fn widths(&self) -> &[u8] {
        let lay = self.header.layout();
        &self.raw[lay.scales_len..lay.scales_len + lay.groups]
    }

    /// The steps of the codes: the header's, or each block's.
    pub(crate) fn steps(&self) -> Steps<'_> {
        Steps::new(self.header.step, self.scales.as_ref())
    }

    /// The codes' data: bit planes, or the rice blocks' data.
    pub(crate) fn planes(&self) -> &[u8] {
        let lay = self.header.layout();
        let start = lay.scales_len + lay.table_len;
        &self.raw[start..start + lay.planes_len]
    }

    /// Exception indices in stored order.
    pub(crate) fn exception_indices(&self) -> impl Iterator<Item = u64> + '_ {
        let lay = self.header.layout();
        let start = lay.scales_len + lay.table_len + lay.planes_len;
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
        let start = lay.scales_len
            + lay.table_len
            + lay.planes_len
            + self.header.n_exceptions as usize * lay.index_size;
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
            lossless::decode_body(
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
            let steps = body.steps();
            if threads == 1 {
                decode_range(widths, planes, steps, 0, out);
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
                    jobs.push((
                        &widths[r.clone()],
                        &planes[offset..offset + bytes],
                        r.start,
                        mine,
                    ));
                    offset += bytes;
                }
                crossbeam_utils::thread::scope(|s| {
                    for (w, p, first, o) in jobs {
                        s.spawn(move |_| decode_range(w, p, steps, first, o));
                    }
                })
                .unwrap_or_else(|p| std::panic::resume_unwind(p));
            }
            for (i, b) in body.exception_indices().zip(body.exception_bits()) {
                out[i as usize] = T::from_bits32(b);
            }
        }
        Codec::Rice => {
            let threads = thread_count(threads, out.len());
            decode_rice(body, out, threads);
            for (i, b) in body.exception_indices().zip(body.exception_bits()) {
                out[i as usize] = T::from_bits32(b);
            }
        }
    }
    Ok(())
}

/// Decodes a checked rice body's codes into `out`, blocks split over `threads`.
fn decode_rice<T: Element>(body: &Body<'_>, out: &mut [T], threads: usize) {
    let steps = body.steps();
    let data = body.planes();
    let blocks = &body.blocks;
    let go = |first: usize, out: &mut [T]| {
        let mut zz = [0u64; rice::BLOCK];
        for (b, chunk) in out.chunks_mut(rice::BLOCK).enumerate() {
            let b = first + b;
            rice::decode_block(blocks.heads[b], &data[blocks.starts[b]..], &mut zz);
            let groups = chunk.chunks_mut(GROUP).zip(zz.chunks(GROUP));
            for (g, (out, zz)) in groups.enumerate() {
                let step = steps.of_group(b * (rice::BLOCK / GROUP) + g);
                for (o, &z) in out.iter_mut().zip(zz) {
                    *o = dequantize(crate::codec::bitplane::unzigzag(z), step);
                }
            }
        }
    };
    let count = blocks.heads.len();
    let per = count.div_ceil(threads.max(1)).max(1);
    if threads <= 1 || count <= 1 {
        return go(0, out);
    }
    crossbeam_utils::thread::scope(|s| {
        for (i, part) in out.chunks_mut(per * rice::BLOCK).enumerate() {
            let go = &go;
            s.spawn(move |_| go(i * per, part));
        }
    })
    .unwrap_or_else(|p| std::panic::resume_unwind(p));
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
                lossless::decode_body(&self.0.raw, &self.0.chunks, d.size(), out, threads);
                Ok(())
            }
            (_, DType::F32) => go::<f32>(&self.0, out, threads),
            (_, DType::BF16) => go::<bf16>(&self.0, out, threads),
            (_, DType::F16) => go::<f16>(&self.0, out, threads),
            // `Header::parse` refuses quantized and rice frames of other dtypes.
            (_, d) => Err(Error::NotQuantizable(d)),
        }
    }
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
