//! The lossless codec: invariant bit packing and zero-value compression, chosen per chunk.
//!
//! Elements are handled as unsigned words of their width (1, 2, 4 or 8 bytes), so every bit
//! pattern comes back exactly, NaN payloads and `-0.0` included, for float and integer dtypes
//! alike. The body is cut into chunks of [`CHUNK`] elements; each chunk is stored by whichever
//! of four methods makes it smallest (`docs/FORMAT.md`, "Body of a lossless frame"):
//!
//! - **raw**: the words as they are;
//! - **pack** (invariant bit packing): the bits that are the same in (nearly) all words of the
//!   chunk are stored once; only the `k` varying bits are stored per word, back to back, so a
//!   group of 32 words takes `k` 32-bit words (a GPU lane finds its word's bits at bit `j k`
//!   of its group with one funnel shift); words that break the invariant bits are stored
//!   whole as exceptions;
//! - **sparse** (zero-value compression): one bit per word saying whether it is nonzero, then
//!   the nonzero words;
//! - **sparse + pack**: the same bitmask, then the nonzero words in the pack layout.
//!
//! Chunks are independent, so work is split into contiguous ranges of chunks, one per thread,
//! and the bytes never depend on the number of threads.

use crate::codec::format::{
    bad_field, checked_shape, finish_frame, u64_at, BoundMode, Codec, DType, Header, GROUP,
};
use crate::codec::parallel::{map_ranges, split_groups, thread_count};
use crate::error::{Error, FormatError, Result};

pub use crate::codec::format::CHUNK;
/// Bytes of a pack header: exception count (u16), reserved (u16), mask (u64), base (u64).
const PACK_HEADER: usize = 20;
/// Bits of a chunk-table entry that hold the payload length; the method sits above them.
const LEN_BITS: u32 = 28;

/// How one chunk is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Method {
    Raw = 0,
    Pack = 1,
    Sparse = 2,
    SparsePack = 3,
}

impl Method {
    fn from_code(c: u32) -> Option<Method> {
        match c {
            0 => Some(Method::Raw),
            1 => Some(Method::Pack),
            2 => Some(Method::Sparse),
            3 => Some(Method::SparsePack),
            _ => None,
        }
    }
}

/// Options of [`compress_lossless_bytes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LosslessOptions {
    /// Run the body through zstd at this level (1 is fast; up to 22). `None` skips the stage.
    pub zstd_level: Option<i32>,
    /// Threads to use; 0 picks one per available core for large tensors.
    pub threads: usize,
}

fn pad4(n: usize) -> usize {
    n.div_ceil(4) * 4
}

/// All bits of a word of `w` bytes.
fn full_mask(w: usize) -> u64 {
    if w == 8 {
        u64::MAX
    } else {
        (1u64 << (8 * w)) - 1
    }
}

fn load_words(bytes: &[u8], w: usize, out: &mut Vec<u64>) {
    out.clear();
    match w {
        1 => out.extend(bytes.iter().map(|&b| b as u64)),
        2 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]) as u64),
        ),
        4 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u64),
        ),
        _ => out.extend(bytes.chunks_exact(8).map(|c| {
            let mut a = [0u8; 8];
            a.copy_from_slice(c);
            u64::from_le_bytes(a)
        })),
    }
}

fn push_word(out: &mut Vec<u8>, v: u64, w: usize) {
    out.extend_from_slice(&v.to_le_bytes()[..w]);
}

fn pad_to4(out: &mut Vec<u8>, start: usize) {
    let len = out.len() - start;
    out.resize(start + pad4(len), 0);
}

/// What pack stores for a run of words: the varying bits, the invariant bits' value and the
/// words that break them.
struct PackPlan {
    mask: u64,
    base: u64,
    exceptions: Vec<u16>,
}

impl PackPlan {
    fn size(&self, m: usize, w: usize) -> usize {
        pack_size(m, w, self.mask.count_ones() as usize, self.exceptions.len())
    }
}

fn pack_size(m: usize, w: usize, k: usize, x: usize) -> usize {
    PACK_HEADER + 4 * m.div_ceil(GROUP) * k + pad4(2 * x) + pad4(w * x)
}

/// Chooses what to pack for `words` (at most [`CHUNK`] of them, `w` bytes each).
///
/// The base is the bitwise majority. Bits are ranked by how many words disagree with the base
/// there (most first; ties: the higher bit first). Making the `k` highest-ranked bits vary
/// leaves as exceptions exactly the words that disagree with the base on a lower-ranked bit,
/// so one pass over the words (for each, the largest rank index among the bits where it
/// disagrees, from per-byte tables) gives the exception count of every `k`; the smallest
/// layout wins (ties: the smaller `k`).
fn plan_pack(words: &[u64], w: usize) -> PackPlan {
    let m = words.len();
    let bits = 8 * w;
    // Ones per bit, from a histogram of each byte position's values (one increment per byte).
    let mut bytes = vec![[0u32; 256]; w];
    for &e in words {
        for (p, h) in bytes.iter_mut().enumerate() {
            h[((e >> (8 * p)) & 0xff) as usize] += 1;
        }
    }
    let mut ones = [0u32; 64];
    for (p, h) in bytes.iter().enumerate() {
        for (v, &count) in h.iter().enumerate() {
            for i in 0..8 {
                ones[8 * p + i] += count * ((v >> i) & 1) as u32;
            }
        }
    }
    let mut base = 0u64;
    let mut disagree = [0u32; 64];
    for b in 0..bits {
        let c = ones[b];
        if 2 * c as usize > m {
            base |= 1 << b;
            disagree[b] = m as u32 - c;
        } else {
            disagree[b] = c;
        }
    }
    // Bits where some word disagrees, most disagreement first.
    let mut order: Vec<usize> = (0..bits).filter(|&b| disagree[b] > 0).collect();
    order.sort_by(|&a, &b| disagree[b].cmp(&disagree[a]).then(b.cmp(&a)));
    let mut rank = [0u8; 64];
    for (r, &b) in order.iter().enumerate() {
        rank[b] = r as u8;
    }
    // tables[p][v]: 1 + the largest rank index among the set bits of byte value v at byte p
    // (0: no bit set).
    let mut tables = vec![[0u8; 256]; w];
    for (p, t) in tables.iter_mut().enumerate() {
        for (v, slot) in t.iter_mut().enumerate().skip(1) {
            *slot = (0..8)
                .filter(|i| v >> i & 1 == 1)
                .map(|i| rank[8 * p + i] + 1)
                .max()
                .unwrap_or(0);
        }
    }
    // hist[r]: words whose largest rank index of disagreement is r - 1 (r = 0: equal to base).
    let mut hist = [0u32; 65];
    for &e in words {
        let d = e ^ base;
        let mut r = 0u8;
        for (p, t) in tables.iter().enumerate() {
            r = r.max(t[((d >> (8 * p)) & 0xff) as usize]);
        }
        hist[r as usize] += 1;
    }
    // Exceptions when the top k ranks vary: words that disagree at a rank index >= k.
    let mut x: usize = hist[1..].iter().map(|&h| h as usize).sum();
    let mut best = (pack_size(m, w, 0, x), 0usize);
    for (k, &h) in hist.iter().enumerate().take(order.len() + 1).skip(1) {
        x -= h as usize;
        let size = pack_size(m, w, k, x);
        if size < best.0 {
            best = (size, k);
        }
    }
    let k = best.1;
    let mask = order[..k].iter().fold(0u64, |acc, &b| acc | 1 << b);
    let base = base & !mask;
    let exceptions = words
        .iter()
        .enumerate()
        .filter(|(_, &e)| (e ^ base) & !mask != 0)
        .map(|(i, _)| i as u16)
        .collect();
    PackPlan {
        mask,
        base,
        exceptions,
    }
}

/// Gathers the bits of `v` selected by `mask` into the low bits (a software `pext`).
#[inline]
fn extract(v: u64, mut mask: u64) -> u64 {
    let mut out = 0u64;
    let mut i = 0;
    while mask != 0 {
        let b = mask.trailing_zeros();
        out |= ((v >> b) & 1) << i;
        i += 1;
        mask &= mask - 1;
    }
    out
}

/// Scatters the low bits of `v` to the positions of `mask` (a software `pdep`).
#[inline]
fn deposit(v: u64, mut mask: u64) -> u64 {
    let mut out = 0u64;
    let mut i = 0;
    while mask != 0 {
        let b = mask.trailing_zeros();
        out |= ((v >> i) & 1) << b;
        i += 1;
        mask &= mask - 1;
    }
    out
}

/// `extract` (or `deposit`) for one fixed mask, byte by byte: `t[p][v]` is the result for
/// byte value `v` at byte `p` of the input, so a word takes one lookup per byte.
struct ByteTables(Vec<[u64; 256]>);

impl ByteTables {
    /// `f` must be OR-linear (`f(a | b) = f(a) | f(b)`, as extract and deposit are): it is
    /// asked about the 8 single bits of each byte only.
    fn new(bytes: usize, f: impl Fn(u64) -> u64) -> ByteTables {
        let mut t = vec![[0u64; 256]; bytes];
        for (p, table) in t.iter_mut().enumerate() {
            let single: [u64; 8] = std::array::from_fn(|i| f(1u64 << (8 * p + i)));
            for v in 1..256usize {
                // Built from the lowest set bit up: v = (v & (v - 1)) + lowest bit.
                table[v] = table[v & (v - 1)] | single[v.trailing_zeros() as usize];
            }
        }
        ByteTables(t)
    }

    #[inline(always)]
    fn apply(&self, v: u64) -> u64 {
        self.0
            .iter()
            .enumerate()
            .fold(0, |acc, (p, t)| acc | t[((v >> (8 * p)) & 0xff) as usize])
    }
}

fn write_pack(words: &[u64], w: usize, plan: &PackPlan, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&(plan.exceptions.len() as u16).to_le_bytes());
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&plan.mask.to_le_bytes());
    out.extend_from_slice(&plan.base.to_le_bytes());
    let k = plan.mask.count_ones();
    if k > 0 {
        let ext = ByteTables::new(w, |bit| extract(bit, plan.mask));
        let k = k as usize;
        for group in words.chunks(GROUP) {
            // Word j's k varying bits at bits j k .. j k + k of the group's 32 k bits.
            let mut stream = [0u32; 64 + 2];
            for (j, &e) in group.iter().enumerate() {
                let (idx, shift) = (j * k / 32, j * k % 32);
                let v = (ext.apply(e) as u128) << shift;
                stream[idx] |= v as u32;
                stream[idx + 1] |= (v >> 32) as u32;
                stream[idx + 2] |= (v >> 64) as u32;
            }
            for s in &stream[..k] {
                out.extend_from_slice(&s.to_le_bytes());
            }
        }
    }
    let exc = out.len();
    for &i in &plan.exceptions {
        out.extend_from_slice(&i.to_le_bytes());
    }
    pad_to4(out, exc);
    let vals = out.len();
    for &i in &plan.exceptions {
        push_word(out, words[i as usize], w);
    }
    pad_to4(out, vals);
    debug_assert_eq!(out.len() - start, plan.size(words.len(), w));
}

fn write_bitmask(words: &[u64], out: &mut Vec<u8>) {
    for group in words.chunks(GROUP) {
        let bits = group
            .iter()
            .enumerate()
            .fold(0u32, |acc, (j, &e)| acc | ((e != 0) as u32) << j);
        out.extend_from_slice(&bits.to_le_bytes());
    }
}

/// Encodes one chunk, appending its payload to `out`; returns the chunk-table entry.
fn encode_chunk(words: &[u64], w: usize, nonzero: &mut Vec<u64>, out: &mut Vec<u8>) -> u32 {
    let m = words.len();
    let start = out.len();
    let raw = pad4(m * w);
    let pack = plan_pack(words, w);
    let mut best = (raw, Method::Raw);
    if pack.size(m, w) < best.0 {
        best = (pack.size(m, w), Method::Pack);
    }
    nonzero.clear();
    nonzero.extend(words.iter().copied().filter(|&e| e != 0));
    let bitmask = 4 * m.div_ceil(GROUP);
    let mut sparse_pack = None;
    if nonzero.len() < m {
        let sparse = bitmask + pad4(nonzero.len() * w);
        if sparse < best.0 {
            best = (sparse, Method::Sparse);
        }
        let plan = plan_pack(nonzero, w);
        let size = bitmask + plan.size(nonzero.len(), w);
        if size < best.0 {
            best = (size, Method::SparsePack);
        }
        sparse_pack = Some(plan);
    }
    match best.1 {
        Method::Raw => {
            for &e in words {
                push_word(out, e, w);
            }
            pad_to4(out, start);
        }
        Method::Pack => write_pack(words, w, &pack, out),
        Method::Sparse => {
            write_bitmask(words, out);
            let vals = out.len();
            for &e in nonzero.iter() {
                push_word(out, e, w);
            }
            pad_to4(out, vals);
        }
        Method::SparsePack => {
            write_bitmask(words, out);
            let plan = sparse_pack.as_ref().expect("planned above");
            write_pack(nonzero, w, plan, out);
        }
    }
    let len = out.len() - start;
    debug_assert_eq!(len, best.0);
    ((best.1 as u32) << LEN_BITS) | len as u32
}

/// Encodes chunks of `bytes` (whole chunks, except possibly the last): the table entries and
/// the payloads.
fn encode_range(bytes: &[u8], w: usize) -> (Vec<u32>, Vec<u8>) {
    let mut table = Vec::with_capacity(bytes.len().div_ceil(CHUNK * w));
    let mut out = Vec::with_capacity(bytes.len() / 2);
    let mut words = Vec::with_capacity(CHUNK);
    let mut nonzero = Vec::with_capacity(CHUNK);
    for chunk in bytes.chunks(CHUNK * w) {
        load_words(chunk, w, &mut words);
        table.push(encode_chunk(&words, w, &mut nonzero, &mut out));
    }
    (table, out)
}

/// Compresses a tensor of any dtype, given as raw little-endian bytes, without loss.
///
/// Every bit pattern decodes exactly (for `bool`, the two a bool has: 0 and 1). The frame is
/// never larger than a raw frame of the same tensor: when the lossless body would not be
/// smaller than the raw bytes, a raw frame is written instead (codec `raw`, mode `lossless`).
///
/// # Errors
/// [`Error::MisalignedInput`] when `bytes` is not a whole number of elements,
/// [`Error::ShapeMismatch`] for a bad shape, [`Error::InvalidBool`] for a `bool` element that
/// is neither 0 nor 1, [`Error::Zstd`] if the zstd stage fails.
pub fn compress_lossless_bytes(
    bytes: &[u8],
    dtype: DType,
    shape: &[usize],
    opts: &LosslessOptions,
) -> Result<Vec<u8>> {
    let w = dtype.size();
    if bytes.len() % w != 0 {
        return Err(Error::MisalignedInput {
            len: bytes.len(),
            element_size: w,
        });
    }
    let n = bytes.len() / w;
    let shape = checked_shape(shape, n)?;
    if dtype == DType::Bool {
        if let Some(index) = bytes.iter().position(|&b| b > 1) {
            return Err(Error::InvalidBool {
                index: index as u64,
                byte: bytes[index],
            });
        }
    }
    let chunks = n.div_ceil(CHUNK);
    let threads = thread_count(opts.threads, n);
    let _span =
        tracing::debug_span!("compress_lossless", dtype = dtype.name(), n, threads).entered();
    let parts: Vec<(Vec<u32>, Vec<u8>)> = map_ranges(chunks, threads, |r| {
        let (lo, hi) = (r.start * CHUNK * w, (r.end * CHUNK * w).min(bytes.len()));
        encode_range(&bytes[lo..hi], w)
    });
    let payload: usize = parts.iter().map(|p| p.1.len()).sum();
    let mut header = Header {
        codec: Codec::Lossless,
        dtype,
        zstd: false,
        mode: BoundMode::Lossless,
        bits: 0,
        n: n as u64,
        step: 1.0,
        eps: 0.0,
        n_exceptions: 0,
        body_len: 0,
        raw_body_len: 0,
        shape,
        block_log2: 0,
    };
    let body = if 4 * chunks + payload >= bytes.len() {
        header.codec = Codec::Raw;
        bytes.to_vec()
    } else {
        let mut body = Vec::with_capacity(4 * chunks + payload);
        for p in &parts {
            for e in &p.0 {
                body.extend_from_slice(&e.to_le_bytes());
            }
        }
        for p in &parts {
            body.extend_from_slice(&p.1);
        }
        body
    };
    tracing::debug!(codec = ?header.codec, body = body.len(), "lossless");
    finish_frame(header, body, opts.zstd_level)
}

/// One chunk of a lossless body, located and checked.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChunkRef {
    pub method: Method,
    /// Offset of the payload in the raw body.
    pub offset: usize,
    pub len: usize,
    /// Elements in the chunk.
    pub m: usize,
}

fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

fn length_mismatch(part: &'static str, expected: usize, found: usize) -> Error {
    FormatError::LengthMismatch {
        part,
        expected: expected as u64,
        found: found as u64,
    }
    .into()
}

/// Checks that every byte of `bytes`, elements of a `bool` tensor, is 0 or 1: torch and numpy
/// give a bool of any other byte no meaning (such a tensor compares and sums inconsistently),
/// and the encoder never writes one.
pub(crate) fn check_bools(bytes: &[u8]) -> Result<()> {
    match bytes.iter().find(|&&b| b > 1) {
        Some(b) => Err(bad_field("bool element", format!("byte {b}, not 0 or 1"))),
        None => Ok(()),
    }
}

/// Checks a pack block of `m` words (its whole payload is `p`): header fields, length,
/// exception indices and zero padding; for `bools`, that every word it decodes to is 0 or 1.
fn check_pack(p: &[u8], m: usize, w: usize, bools: bool) -> Result<()> {
    if p.len() < PACK_HEADER {
        return Err(length_mismatch("pack block", PACK_HEADER, p.len()));
    }
    let x = u16_at(p, 0) as usize;
    if u16_at(p, 2) != 0 {
        return Err(bad_field("pack reserved bytes", u16_at(p, 2)));
    }
    let mask = u64_at(p, 4);
    let base = u64_at(p, 12);
    if mask & !full_mask(w) != 0 {
        return Err(bad_field("pack mask", format!("{mask:#x}")));
    }
    if base & !full_mask(w) != 0 || base & mask != 0 {
        return Err(bad_field("pack base", format!("{base:#x}")));
    }
    if bools && (mask | base) > 1 {
        // Every word is `base | deposit(field, mask)`: bits above bit 0 would make it above 1.
        return Err(bad_field(
            "bool element",
            format!("pack mask {mask:#x} or base {base:#x} past bit 0"),
        ));
    }
    if x > m {
        return Err(bad_field("pack exception count", x));
    }
    let k = mask.count_ones() as usize;
    let expected = pack_size(m, w, k, x);
    if p.len() != expected {
        return Err(length_mismatch("pack block", expected, p.len()));
    }
    // The fields of the missing words of a partial last group are zero (one encoding per
    // chunk).
    let tail = m % GROUP;
    if tail != 0 && k != 0 {
        let last = PACK_HEADER + 4 * (m / GROUP) * k;
        for q in 0..k {
            let word = u32_at(p, last + 4 * q) as u64;
            // Bits of this word at or past bit tail * k of the group's stream must be clear.
            let from = (tail * k).saturating_sub(32 * q);
            let unused = if from >= 32 {
                0
            } else {
                (u32::MAX as u64) << from & u32::MAX as u64
            };
            if word & unused != 0 {
                return Err(bad_field("pack fields", "bits set past the last word"));
            }
        }
    }
    let idx = PACK_HEADER + 4 * m.div_ceil(GROUP) * k;
    let mut prev: Option<u16> = None;
    for j in 0..x {
        let i = u16_at(p, idx + 2 * j);
        if i as usize >= m || prev.is_some_and(|q| i <= q) {
            return Err(FormatError::BadExceptionIndex {
                position: j as u64,
                index: i as u64,
            }
            .into());
        }
        prev = Some(i);
    }
    let vals = idx + pad4(2 * x);
    if p[idx + 2 * x..vals].iter().any(|&b| b != 0) || p[vals + w * x..].iter().any(|&b| b != 0) {
        return Err(bad_field("padding", "nonzero"));
    }
    if bools {
        check_bools(&p[vals..vals + x])?;
    }
    Ok(())
}

/// Checks the bitmask of a sparse chunk (bits past `m` must be 0); returns the nonzero count.
fn check_bitmask(p: &[u8], m: usize) -> Result<usize> {
    let g = m.div_ceil(GROUP);
    if p.len() < 4 * g {
        return Err(length_mismatch("sparse bitmask", 4 * g, p.len()));
    }
    let mut nnz = 0usize;
    for i in 0..g {
        let word = u32_at(p, 4 * i);
        let lanes = (m - GROUP * i).min(GROUP);
        if lanes < GROUP && word >> lanes != 0 {
            return Err(bad_field(
                "sparse bitmask",
                "bits set past the last element",
            ));
        }
        nnz += word.count_ones() as usize;
    }
    Ok(nnz)
}

/// Locates and checks every chunk of a lossless body of `n` elements of `dtype`.
pub(crate) fn check_body(raw: &[u8], n: u64, dtype: DType) -> Result<Vec<ChunkRef>> {
    let w = dtype.size();
    let bools = dtype == DType::Bool;
    let n = usize::try_from(n).map_err(|_| bad_field("element count", n))?;
    let chunks = n.div_ceil(CHUNK);
    let table_len = chunks
        .checked_mul(4)
        .filter(|&t| t <= raw.len())
        .ok_or_else(|| length_mismatch("chunk table", chunks.saturating_mul(4), raw.len()))?;
    let mut refs = Vec::with_capacity(chunks);
    let mut offset = table_len;
    for c in 0..chunks {
        let entry = u32_at(raw, 4 * c);
        let method = Method::from_code(entry >> LEN_BITS)
            .ok_or_else(|| bad_field("chunk method", entry >> LEN_BITS))?;
        let len = (entry & ((1 << LEN_BITS) - 1)) as usize;
        let m = (n - c * CHUNK).min(CHUNK);
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= raw.len())
            .ok_or_else(|| length_mismatch("chunk payloads", offset + len, raw.len()))?;
        let p = &raw[offset..end];
        match method {
            Method::Raw => {
                if len != pad4(m * w) {
                    return Err(length_mismatch("raw chunk", pad4(m * w), len));
                }
                if p[m * w..].iter().any(|&b| b != 0) {
                    return Err(bad_field("padding", "nonzero"));
                }
                if bools {
                    check_bools(&p[..m])?;
                }
            }
            Method::Pack => check_pack(p, m, w, bools)?,
            Method::Sparse => {
                let nnz = check_bitmask(p, m)?;
                let bm = 4 * m.div_ceil(GROUP);
                if len != bm + pad4(nnz * w) {
                    return Err(length_mismatch("sparse chunk", bm + pad4(nnz * w), len));
                }
                if p[bm + nnz * w..].iter().any(|&b| b != 0) {
                    return Err(bad_field("padding", "nonzero"));
                }
                if bools {
                    check_bools(&p[bm..bm + nnz])?;
                }
            }
            Method::SparsePack => {
                let nnz = check_bitmask(p, m)?;
                check_pack(&p[4 * m.div_ceil(GROUP)..], nnz, w, bools)?;
            }
        }
        refs.push(ChunkRef {
            method,
            offset,
            len,
            m,
        });
        offset = end;
    }
    if offset != raw.len() {
        return Err(length_mismatch("lossless body", offset, raw.len()));
    }
    Ok(refs)
}

/// Decodes a checked pack block of `m` words into `out`.
fn decode_pack(p: &[u8], m: usize, w: usize, out: &mut [u64]) {
    let x = u16_at(p, 0) as usize;
    let mask = u64_at(p, 4);
    let base = u64_at(p, 12);
    let k = mask.count_ones() as usize;
    let planes = &p[PACK_HEADER..PACK_HEADER + 4 * m.div_ceil(GROUP) * k];
    if k == 0 {
        out[..m].fill(base);
    } else {
        let dep = ByteTables::new(k.div_ceil(8), |bit| deposit(bit, mask));
        let low = if k == 64 { u64::MAX } else { (1u64 << k) - 1 };
        for (group, mine) in out[..m].chunks_mut(GROUP).zip(planes.chunks_exact(4 * k)) {
            let mut stream = [0u32; 64 + 2];
            for (s, b) in stream.iter_mut().zip(mine.chunks_exact(4)) {
                *s = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            for (j, o) in group.iter_mut().enumerate() {
                let (idx, shift) = (j * k / 32, j * k % 32);
                let window = stream[idx] as u128
                    | (stream[idx + 1] as u128) << 32
                    | (stream[idx + 2] as u128) << 64;
                *o = base | dep.apply((window >> shift) as u64 & low);
            }
        }
    }
    let idx = PACK_HEADER + planes.len();
    let vals = idx + pad4(2 * x);
    for j in 0..x {
        let i = u16_at(p, idx + 2 * j) as usize;
        let mut a = [0u8; 8];
        a[..w].copy_from_slice(&p[vals + w * j..vals + w * (j + 1)]);
        out[i] = u64::from_le_bytes(a);
    }
}

/// Decodes one checked chunk into `out` (exactly `m * w` bytes).
fn decode_chunk(raw: &[u8], c: &ChunkRef, w: usize, words: &mut Vec<u64>, out: &mut [u8]) {
    let p = &raw[c.offset..c.offset + c.len];
    let m = c.m;
    match c.method {
        Method::Raw => {
            out.copy_from_slice(&p[..m * w]);
            return;
        }
        Method::Pack => {
            words.resize(m, 0);
            decode_pack(p, m, w, words);
        }
        Method::Sparse | Method::SparsePack => {
            let bm = 4 * m.div_ceil(GROUP);
            let nnz: usize = (0..m.div_ceil(GROUP))
                .map(|i| u32_at(p, 4 * i).count_ones() as usize)
                .sum();
            let mut vals = vec![0u64; nnz];
            if c.method == Method::Sparse {
                load_words(&p[bm..bm + nnz * w], w, &mut vals);
            } else {
                decode_pack(&p[bm..], nnz, w, &mut vals);
            }
            words.clear();
            words.resize(m, 0);
            let mut next = vals.iter();
            for (i, o) in words.iter_mut().enumerate() {
                if u32_at(p, 4 * (i / GROUP)) >> (i % GROUP) & 1 == 1 {
                    *o = *next.next().expect("bitmask counted");
                }
            }
        }
    }
    for (o, &e) in out.chunks_exact_mut(w).zip(words.iter()) {
        o.copy_from_slice(&e.to_le_bytes()[..w]);
    }
}

/// Decodes a checked lossless body into `out` (`n * w` bytes).
pub(crate) fn decode_body(
    raw: &[u8],
    chunks: &[ChunkRef],
    w: usize,
    out: &mut [u8],
    threads: usize,
) {
    let n = out.len() / w;
    let threads = thread_count(threads, n);
    let run = |refs: &[ChunkRef], out: &mut [u8]| {
        let mut words = Vec::with_capacity(CHUNK);
        for (c, o) in refs.iter().zip(out.chunks_mut(CHUNK * w)) {
            decode_chunk(raw, c, w, &mut words, o);
        }
    };
    if threads == 1 {
        run(chunks, out);
        return;
    }
    let ranges = split_groups(chunks.len(), threads);
    crossbeam_utils::thread::scope(|s| {
        let mut rest: &mut [u8] = out;
        for r in ranges {
            let bytes = (r.len() * CHUNK * w).min(rest.len());
            let (mine, tail) = rest.split_at_mut(bytes);
            rest = tail;
            let refs = &chunks[r];
            let run = &run;
            s.spawn(move |_| run(refs, mine));
        }
    })
    .unwrap_or_else(|p| std::panic::resume_unwind(p));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extract_and_deposit_are_inverse() {
        let mask = 0b1011_0110_0000_1001u64;
        for v in [0u64, 1, 0xffff, 0x1234, 0xdead_beef] {
            let e = extract(v, mask);
            assert!(e < 1 << mask.count_ones());
            assert_eq!(deposit(e, mask), v & mask);
        }
    }

    #[test]
    fn plan_finds_invariant_bits_and_exceptions() {
        // 4096 words sharing their top byte, one word with a different top byte.
        let mut words: Vec<u64> = (0..4096u64).map(|i| 0x3c00 | (i * 37 % 256)).collect();
        words[100] = 0xff00;
        let plan = plan_pack(&words, 2);
        assert_eq!(plan.mask, 0x00ff);
        assert_eq!(plan.base, 0x3c00);
        assert_eq!(plan.exceptions, vec![100]);
    }
}
