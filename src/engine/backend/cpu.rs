//! The reference backend: the CPU codec, run at once on the engine's comm thread, in host
//! memory. It writes the bytes the CUDA backend writes (frames, sums, statistics, decoded
//! values), which is what makes it the reference: the same engine runs on it in CI, and the
//! GPU tests compare the two. Its lane check (`LaneCheck`) finds the joins between the lanes
//! that the engine leaves out, which on a GPU would be races.

use super::lanes::LaneCheck;
use super::{Backend, FrameKind, Lane, Memory};
use crate::codec::{compress, decompress, Bound, CompressOptions};
use crate::element::Element;
use crate::engine::job::{Region, Tensor};
use crate::error::{Error, Result};
use crate::feedback::compress_with_feedback_scaled;
use crate::format::{self, Coder, DType, FIXED_HEADER_LEN};
use half::{bf16, f16};

/// Scratch memory of the CPU backend: 16-byte aligned host memory.
#[derive(Debug)]
pub struct HostBuf(Vec<u128>);

impl Memory for HostBuf {
    fn region(&self) -> Region {
        Region {
            addr: self.0.as_ptr() as u64,
            len: 16 * self.0.len() as u64,
        }
    }
}

/// The CPU backend (see the module docs).
#[derive(Debug)]
pub struct CpuBackend {
    /// Given-back scratch, for reuse.
    pool: Vec<HostBuf>,
    /// The decoding status, then the running maximum of the error left in residuals.
    words: Box<[u64; 2]>,
    /// The lane check, where wanted ([`LaneCheck::wanted`]).
    lanes: Option<LaneCheck>,
}

/// A point on a lane (see `Backend::mark`): the lane's clock in the lane check.
#[derive(Debug, Clone, Copy)]
pub struct HostMark {
    lane: Lane,
    at: u64,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new()
    }
}

impl CpuBackend {
    /// A backend with nothing allocated.
    pub fn new() -> CpuBackend {
        CpuBackend {
            pool: Vec::new(),
            words: Box::new([0; 2]),
            lanes: LaneCheck::wanted(),
        }
    }

    /// Records for the lane check that `lane` reads (or with `write`, writes) `r`.
    pub(crate) fn touch(
        &mut self,
        lane: Lane,
        r: Region,
        write: bool,
        what: &'static str,
    ) -> Result<()> {
        match &mut self.lanes {
            Some(c) => c.touch(lane, r, write, what),
            None => Ok(()),
        }
    }

    /// The host waited for `mark`: later work on either lane follows what came before it.
    pub(crate) fn waited(&mut self, mark: &HostMark) {
        if let Some(c) = &mut self.lanes {
            c.reached(mark.lane, mark.at);
        }
    }
}

/// `x` rounded up to a multiple of 16.
pub(crate) fn round16(x: u64) -> u64 {
    x.div_ceil(16) * 16
}

/// Bytes a frame of `n` elements of `dtype` in one dimension may take, as the CUDA codec
/// counts them (a quantized body is kept only where it is smaller than the raw values).
pub(crate) fn frame_capacity(n: u64, dtype: DType) -> u64 {
    let header = (FIXED_HEADER_LEN + 8) as u64;
    round16(header + (n * dtype.size() as u64).max(format::groups_for(n)))
}

/// Bytes the exact sum of frames of `n` elements of `dtype` may take: widths up to 64 bits and
/// every element possibly an exception, as the CUDA codec counts them.
pub(crate) fn sum_capacity(n: u64, dtype: DType) -> u64 {
    let header = (FIXED_HEADER_LEN + 8) as u64;
    // (a byte per group covers block scales: blocks hold at least a group)
    round16(
        header
            + format::groups_for(n) * (2 + 4 * 64)
            + n * (format::index_size_for(n) as u64 + dtype.size() as u64),
    )
}

/// The bytes of `r`.
///
/// # Safety
/// `r` must be host memory valid for reads of `r.len` bytes for the lifetime `'a`: the engine
/// passes only its own scratch (checked against the buffer by [`Region::sub`]) and the job's
/// tensors (which the submitter vouched for).
unsafe fn bytes<'a>(r: Region) -> &'a [u8] {
    if r.len == 0 {
        return &[];
    }
    // SAFETY: this function's contract.
    unsafe { std::slice::from_raw_parts(r.addr as *const u8, r.len as usize) }
}

/// The bytes of `r`, writable.
///
/// # Safety
/// As [`bytes`], for writes, with no other reference to those bytes alive meanwhile.
unsafe fn bytes_mut<'a>(r: Region) -> &'a mut [u8] {
    if r.len == 0 {
        return &mut [];
    }
    // SAFETY: this function's contract.
    unsafe { std::slice::from_raw_parts_mut(r.addr as *mut u8, r.len as usize) }
}

/// The elements of `t`.
///
/// # Safety
/// As [`bytes`]; `t.addr` aligned to `T`.
unsafe fn elements<'a, T: bytemuck::Pod>(t: Tensor) -> &'a [T] {
    if t.numel == 0 {
        return &[];
    }
    // SAFETY: this function's contract.
    unsafe { std::slice::from_raw_parts(t.addr as *const T, t.numel as usize) }
}

/// The elements of `t`, writable.
///
/// # Safety
/// As [`bytes_mut`]; `t.addr` aligned to `T`.
unsafe fn elements_mut<'a, T: bytemuck::Pod>(t: Tensor) -> &'a mut [T] {
    if t.numel == 0 {
        return &mut [];
    }
    // SAFETY: this function's contract.
    unsafe { std::slice::from_raw_parts_mut(t.addr as *mut T, t.numel as usize) }
}

/// Threads per block and most blocks of the CUDA statistics kernel: the order its sum of
/// squares is added in, which [`stats`] follows so that both give the same bits.
const STATS_BLOCK: u64 = 256;
const STATS_BLOCKS: u64 = 256;

/// The statistics of [`Backend::stats`], added as the CUDA kernel adds them: each thread of
/// each block its elements (a grid-stride loop), then the 32 lanes of each warp by halves, the
/// warps in order, the blocks in order.
fn stats<T: Element>(x: &[T], r: Option<&[f32]>) -> (f64, f64) {
    let n = x.len() as u64;
    let blocks = n.div_ceil(STATS_BLOCK).clamp(1, STATS_BLOCKS);
    let stride = blocks * STATS_BLOCK;
    let value = |i: usize| {
        let v = x[i].to_f64() as f32;
        match r {
            Some(r) => v + r[i],
            None => v,
        }
    };
    let mut total = 0.0f64;
    let mut max = 0.0f64;
    for b in 0..blocks {
        let mut block = 0.0f64;
        for w in 0..STATS_BLOCK / 32 {
            let mut lanes = [0.0f64; 32];
            for (l, lane) in lanes.iter_mut().enumerate() {
                let mut i = b * STATS_BLOCK + w * 32 + l as u64;
                while i < n {
                    let v = value(i as usize);
                    if v.is_finite() {
                        *lane += v as f64 * v as f64;
                        max = max.max(v.abs() as f64);
                    }
                    i += stride;
                }
            }
            let mut o = 16;
            while o > 0 {
                for l in 0..o {
                    lanes[l] += lanes[l + o];
                }
                o /= 2;
            }
            block += lanes[0];
        }
        total += block;
    }
    (total, max)
}

/// Whether `frame` is a frame that [`Backend::decode`] and [`Backend::sum`] take for `n`
/// elements of `dtype` written as `kind` says: quantized (bit planes) or rice as its coder says,
/// with its block scales, or raw; no zstd stage; one dimension of `n`. (Where bit planes are
/// asked for, a frame too short for a header, a width per group and the scales is refused, as
/// the CUDA backend refuses it before reading it.)
fn fits(frame: &[u8], n: u64, dtype: DType, kind: FrameKind) -> bool {
    let codec = match kind.coder {
        Coder::Planes => format::Codec::Quantized,
        Coder::Rice => format::Codec::Rice,
    };
    let least = match kind.coder {
        Coder::Planes if kind.block_log2 != 0 => {
            format::min_frame_len(n, 1) + crate::scales::blocks_for(n, kind.block_log2)
        }
        Coder::Planes => format::min_frame_len(n, 1),
        Coder::Rice => 0,
    };
    frame.len() as u64 >= least
        && crate::read_header(frame).is_ok_and(|h| {
            h.n == n
                && h.dtype == dtype
                && !h.zstd
                && h.shape == [n]
                && ((h.codec == codec && h.block_log2 == kind.block_log2)
                    || h.codec == format::Codec::Raw)
        })
}

/// The exact sum of `parts` (see [`crate::sum_frames`]); with block scales, a sum of raw parts
/// alone (no part has scales, every code is 0) gets zero shifts, as the kernels write it, so
/// that every sum of the exchange has the scales its readers expect.
fn sum_with_scales(parts: &[&[u8]], n: u64, block_log2: u8) -> Result<Vec<u8>> {
    let codes = parts
        .iter()
        .map(|f| crate::Codes::from_frame(f))
        .collect::<Result<Vec<_>>>()?;
    let mut sum = crate::Codes::sum(&codes)?;
    if block_log2 != 0 && sum.scales.is_none() {
        sum.scales = Some(crate::scales::BlockScales {
            log2: block_log2,
            shifts: vec![0; crate::scales::blocks_for(n, block_log2) as usize],
        });
    }
    sum.to_frame(None)
}

/// Decoded frames added in f32, in order, scaled and written (see [`Backend::decode`]).
fn decode_sum<T: Element>(frames: &[&[u8]], scale: f32, out: &mut [T]) -> Result<()> {
    let mut acc: Vec<f32> = Vec::new();
    for (p, f) in frames.iter().enumerate() {
        let (_, values) = decompress::<T>(f)?;
        if p == 0 {
            acc = values.iter().map(|v| v.to_f64() as f32).collect();
        } else {
            for (a, v) in acc.iter_mut().zip(&values) {
                *a += v.to_f64() as f32;
            }
        }
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        let r = if scale == 1.0 { *a } else { *a * scale };
        // A NaN is the dtype's canonical quiet NaN, as the kernel writes it.
        *o = T::from_f32(if r.is_nan() { f32::NAN } else { r });
    }
    Ok(())
}

/// Runs `$body` with `$T` the element type of `$dtype` (one of the three float types).
macro_rules! with_float {
    ($dtype:expr, $T:ident, $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            other => Err(Error::NotQuantizable(other)),
        }
    };
}

impl Backend for CpuBackend {
    type Buf = HostBuf;
    type Mark = HostMark;
    type Ready = ();
    type Fetched = Vec<u8>;

    fn label(&self) -> String {
        "the CPU".into()
    }

    fn alloc(&mut self, len: u64) -> Result<HostBuf> {
        let words = len.div_ceil(16) as usize;
        if let Some(at) = super::best_fit(&self.pool, |b| b.region().len, len) {
            return Ok(self.pool.swap_remove(at));
        }
        let mut v = Vec::new();
        v.try_reserve_exact(words)
            .map_err(|_| Error::Allocation { bytes: len })?;
        v.resize(words, 0u128);
        Ok(HostBuf(v))
    }

    fn free(&mut self, buf: HostBuf) {
        // A few buffers of each bucket's sizes come and go every step: keep them.
        if self.pool.len() < 64 {
            self.pool.push(buf);
        }
    }

    fn begin(&mut self, _ready: ()) -> Result<()> {
        Ok(())
    }

    fn caller_touches(&mut self, tensors: &[Tensor]) -> Result<()> {
        for t in tensors {
            self.touch(Lane::Compute, t.region(), true, "the caller")?;
        }
        Ok(())
    }

    fn join(&mut self, to: Lane, from: Lane) -> Result<()> {
        if let Some(c) = &mut self.lanes {
            c.join(to, from);
        }
        Ok(())
    }

    fn stats(
        &mut self,
        x: Tensor,
        r: Option<Tensor>,
        out: Region,
        pitch: u64,
        count: u64,
    ) -> Result<()> {
        self.touch(Lane::Compute, x.region(), false, "the statistics")?;
        if let Some(r) = r {
            self.touch(Lane::Compute, r.region(), false, "the statistics")?;
        }
        for i in 0..count {
            self.touch(
                Lane::Compute,
                out.sub(i * pitch, 16)?,
                true,
                "the statistics",
            )?;
        }
        // SAFETY: the job's tensors (vouched for by the submitter, checked against each other
        // by `Job::check`).
        let (sum, max) = with_float!(x.dtype, T, unsafe {
            Ok(stats::<T>(elements(x), r.map(|r| elements::<f32>(r))))
        })?;
        for i in 0..count {
            // SAFETY: 16 bytes of the engine's scratch, checked by `sub`.
            let o = unsafe { bytes_mut(out.sub(i * pitch, 16)?) };
            o[..8].copy_from_slice(&sum.to_le_bytes());
            o[8..].copy_from_slice(&max.to_le_bytes());
        }
        Ok(())
    }

    fn exponents(&mut self, x: Tensor, r: Option<Tensor>, log2: u8, out: Region) -> Result<()> {
        self.touch(Lane::Compute, x.region(), false, "block exponents")?;
        if let Some(r) = r {
            self.touch(Lane::Compute, r.region(), false, "block exponents")?;
        }
        self.touch(Lane::Compute, out, true, "block exponents")?;
        // SAFETY: the job's tensors (see `stats`).
        let e = with_float!(x.dtype, T, unsafe {
            Ok(crate::scales::block_exponents::<T>(
                elements(x),
                r.map(|r| elements::<f32>(r)),
                log2,
            ))
        })?;
        if e.len() as u64 != out.len {
            return Err(Error::Transport(format!(
                "internal: {} block exponents into {} bytes",
                e.len(),
                out.len
            )));
        }
        // SAFETY: scratch checked by the caller (`Region::sub`).
        unsafe { bytes_mut(out) }.copy_from_slice(&e);
        Ok(())
    }

    fn upload(&mut self, lane: Lane, dst: Region, src: &[u8]) -> Result<()> {
        self.touch(lane, dst, true, "an upload")?;
        if src.len() as u64 != dst.len {
            return Err(Error::Transport(format!(
                "internal: {} bytes uploaded into {}",
                src.len(),
                dst.len
            )));
        }
        // SAFETY: scratch checked by the caller.
        unsafe { bytes_mut(dst) }.copy_from_slice(src);
        Ok(())
    }

    fn copy(&mut self, lane: Lane, src: Region, dst: Region) -> Result<()> {
        self.touch(lane, src, false, "a copy")?;
        self.touch(lane, dst, true, "a copy")?;
        if src.len != dst.len {
            return Err(Error::Transport(format!(
                "internal: {} bytes copied into {}",
                src.len, dst.len
            )));
        }
        if src.len > 0 {
            // SAFETY: scratch checked by the caller; `ptr::copy` allows overlap all the same.
            unsafe { std::ptr::copy(src.addr as *const u8, dst.addr as *mut u8, src.len as usize) };
        }
        Ok(())
    }

    fn frame_capacity(&self, n: u64, dtype: DType) -> u64 {
        frame_capacity(n, dtype)
    }

    fn compress(
        &mut self,
        x: Tensor,
        r: Option<Tensor>,
        eps: f64,
        coder: Coder,
        scales: Option<(u8, Region)>,
        frame: Region,
        size_at: Region,
    ) -> Result<()> {
        self.touch(Lane::Compute, x.region(), false, "compression")?;
        if let Some(r) = r {
            self.touch(Lane::Compute, r.region(), true, "compression")?;
        }
        let scales = match scales {
            Some((log2, shifts)) => {
                self.touch(Lane::Compute, shifts, false, "compression")?;
                Some(crate::scales::BlockScales {
                    log2,
                    // SAFETY: scratch checked by the caller.
                    shifts: unsafe { bytes(shifts) }.to_vec(),
                })
            }
            None => None,
        };
        self.touch(Lane::Compute, frame, true, "compression")?;
        self.touch(Lane::Compute, size_at.sub(0, 8)?, true, "compression")?;
        let max_error = self.max_error();
        self.touch(Lane::Compute, max_error, true, "compression")?;
        let opts = CompressOptions {
            bound: Bound::Abs(eps),
            zstd_level: None,
            threads: 0,
            coder,
        };
        let shape = [x.numel as usize];
        // SAFETY: the job's tensors (see `stats`); the residual is the job's own float32 memory,
        // which nothing else touches while the engine runs the job.
        let (bytes_out, max_error) = with_float!(x.dtype, T, unsafe {
            let data: &[T] = elements(x);
            match r {
                Some(r) => {
                    let r = elements_mut::<f32>(r);
                    let f = compress_with_feedback_scaled(data, r, &shape, &opts, scales.as_ref())?;
                    let m = r
                        .iter()
                        .filter(|v| v.is_finite())
                        .fold(0.0f64, |m, v| m.max(v.abs() as f64));
                    Ok((f, m))
                }
                None => match &scales {
                    Some(s) => Ok((crate::compress_scaled(data, &shape, &opts, s)?, 0.0)),
                    None => Ok((compress(data, &shape, &opts)?, 0.0)),
                },
            }
        })?;
        let len = bytes_out.len() as u64;
        if len > frame.len {
            return Err(Error::OutputSize {
                expected: len,
                got: frame.len,
            });
        }
        let size_at = size_at.sub(0, 8)?;
        // SAFETY: scratch regions checked against their buffers by the caller (`Region::sub`).
        unsafe {
            bytes_mut(frame.sub(0, len)?).copy_from_slice(&bytes_out);
            bytes_mut(size_at).copy_from_slice(&len.to_le_bytes());
        }
        let m = f64::from_bits(self.words[1]);
        self.words[1] = m.max(max_error).to_bits();
        Ok(())
    }

    fn sum_capacity(&self, n: u64, dtype: DType) -> u64 {
        sum_capacity(n, dtype)
    }

    fn sum(
        &mut self,
        frames: &[Region],
        n: u64,
        dtype: DType,
        block_log2: u8,
        out: Region,
        size_at: Region,
    ) -> Result<()> {
        for f in frames {
            self.touch(Lane::Compute, *f, false, "the sum of frames")?;
        }
        self.touch(Lane::Compute, out, true, "the sum of frames")?;
        self.touch(Lane::Compute, size_at.sub(0, 8)?, true, "the sum of frames")?;
        // SAFETY: scratch regions (rows received by the transport), checked by the caller.
        let parts: Vec<&[u8]> = frames.iter().map(|f| unsafe { bytes(*f) }).collect();
        // A frame that is not one of these elements, or frames that cannot be summed, leave a
        // size of 0, which every rank that receives the sum refuses.
        let kind = FrameKind {
            coder: Coder::Planes,
            block_log2,
        };
        let summed = if parts.iter().all(|f| fits(f, n, dtype, kind)) {
            sum_with_scales(&parts, n, block_log2)
                .ok()
                .filter(|s| s.len() as u64 <= out.len)
        } else {
            None
        };
        let size = summed.as_ref().map_or(0, |s| s.len() as u64);
        // SAFETY: as above.
        unsafe {
            if let Some(s) = &summed {
                bytes_mut(out.sub(0, size)?).copy_from_slice(s);
            }
            bytes_mut(size_at.sub(0, 8)?).copy_from_slice(&size.to_le_bytes());
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)] // (the frames, how to read them, and the output)
    fn decode(
        &mut self,
        frames: &[Region],
        sized: bool,
        n: u64,
        dtype: DType,
        kind: FrameKind,
        scale: f32,
        out: Tensor,
    ) -> Result<()> {
        let status = self.status();
        self.touch(Lane::Compute, status, true, "decoding")?;
        for f in frames {
            if sized {
                let head = Region {
                    addr: f.addr.wrapping_sub(crate::engine::rows::HEAD),
                    len: 8,
                };
                self.touch(Lane::Compute, head, false, "decoding")?;
            }
            self.touch(Lane::Compute, *f, false, "decoding")?;
        }
        self.touch(Lane::Compute, out.region(), true, "decoding")?;
        if self.words[0] != 0 {
            return Ok(()); // an earlier frame was bad: nothing more is decoded
        }
        let mut parts: Vec<&[u8]> = Vec::with_capacity(frames.len());
        for f in frames {
            let f = if sized {
                // The frame's size sits in its row's head, `HEAD` bytes before it.
                let head = Region {
                    addr: f.addr.wrapping_sub(crate::engine::rows::HEAD),
                    len: 8,
                };
                // SAFETY: a frame the engine passes `sized` lies in a row after its head.
                let size = u64::from_le_bytes(unsafe { bytes(head) }.try_into().unwrap_or([0; 8]));
                f.sub(0, size.min(f.len))?
            } else {
                *f
            };
            // SAFETY: as in `sum`.
            parts.push(unsafe { bytes(f) });
        }
        if let Some(bad) = parts.iter().position(|f| !fits(f, n, dtype, kind)) {
            self.words[0] = 1 | ((bad as u64 + 1) << 32);
            return Ok(());
        }
        // SAFETY: the job's output (see `stats`).
        let decoded = with_float!(dtype, T, unsafe {
            decode_sum::<T>(&parts, scale, elements_mut(out))
        });
        if let Err(e) = decoded {
            // A frame whose header fits but whose body does not decode.
            tracing::debug!(error = %e, "a frame failed to decode");
            self.words[0] = 1;
        }
        Ok(())
    }

    fn fold(&mut self, x: Tensor, r: Tensor) -> Result<()> {
        self.touch(Lane::Compute, x.region(), true, "folding a residual")?;
        self.touch(Lane::Compute, r.region(), true, "folding a residual")?;
        // SAFETY: the job's tensors (see `compress`).
        with_float!(x.dtype, T, unsafe {
            let data: &mut [T] = elements_mut(x);
            let r = elements_mut::<f32>(r);
            for (v, e) in data.iter_mut().zip(r.iter_mut()) {
                *v = crate::feedback::compensate(*v, *e).1;
                *e = 0.0;
            }
            Ok(())
        })
    }

    fn put(&mut self, lane: Lane, dst: Region, pitch: u64, count: u64, word: u64) -> Result<()> {
        for i in 0..count {
            self.touch(lane, dst.sub(i * pitch, 8)?, true, "a check word")?;
        }
        for i in 0..count {
            // SAFETY: 8 bytes of the engine's scratch, checked by `sub`.
            unsafe { bytes_mut(dst.sub(i * pitch, 8)?) }.copy_from_slice(&word.to_le_bytes());
        }
        Ok(())
    }

    fn fetch(
        &mut self,
        lane: Lane,
        src: Region,
        pitch: u64,
        width: u64,
        rows: u64,
    ) -> Result<Vec<u8>> {
        for i in 0..rows {
            self.touch(
                lane,
                src.sub(i * pitch, width)?,
                false,
                "a copy to the host",
            )?;
        }
        let mut out = Vec::with_capacity((width * rows) as usize);
        for i in 0..rows {
            // SAFETY: checked by `sub`.
            out.extend_from_slice(unsafe { bytes(src.sub(i * pitch, width)?) });
        }
        Ok(out)
    }

    fn fetched(&mut self, f: Vec<u8>) -> Vec<u8> {
        f
    }

    fn mark(&mut self, lane: Lane) -> Result<HostMark> {
        let at = self.lanes.as_ref().map_or(0, |c| c.now(lane));
        Ok(HostMark { lane, at })
    }

    fn reached(&mut self, mark: &HostMark) -> Result<bool> {
        self.waited(mark);
        Ok(true)
    }

    fn status(&self) -> Region {
        Region {
            addr: self.words.as_ptr() as u64,
            len: 8,
        }
    }

    fn max_error(&self) -> Region {
        Region {
            addr: self.words.as_ptr() as u64 + 8,
            len: 8,
        }
    }

    fn ready_maker(&self) -> crate::engine::ReadyFn {
        std::sync::Arc::new(|_stream| Ok(Box::new(()) as Box<dyn std::any::Any + Send>))
    }

    fn done(&mut self) -> Result<crate::engine::Done> {
        Ok(Box::new(|_stream| Ok(())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics_skip_non_finite_values_and_add_in_the_kernels_order() {
        let x = [1.0f32, -3.0, f32::NAN, 2.0, f32::INFINITY];
        let r = [0.5f32, 0.0, 0.0, 0.0, 0.0];
        let (s, m) = stats(&x, Some(&r));
        assert_eq!(s, 1.5f64 * 1.5 + 9.0 + 4.0);
        assert_eq!(m, 3.0);
        // Past one block's threads, the grid-stride loop and the tree of lanes decide the
        // order: the sum must still be the sum.
        let big: Vec<f32> = (0..100_000).map(|i| (i % 7) as f32).collect();
        let exact: f64 = big.iter().map(|v| (*v as f64) * (*v as f64)).sum();
        assert_eq!(stats(&big, None).0, exact);
    }

    #[test]
    fn capacities_hold_any_frame() {
        for n in [0u64, 1, 31, 32, 1000, 65537] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 * 1e-3).collect();
            let f = compress(&x, &[n as usize], &CompressOptions::new(Bound::Abs(1e-9))).unwrap();
            assert!(f.len() as u64 <= frame_capacity(n, DType::F32), "{n}");
            let s = crate::sum_frames(&[&f, &f], None).unwrap();
            assert!(s.len() as u64 <= sum_capacity(n, DType::F32), "{n}");
        }
    }
}
