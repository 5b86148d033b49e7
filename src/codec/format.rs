//! The cfc frame: a self-describing, versioned container for one compressed tensor.
//!
//! `docs/FORMAT.md` is the normative description; this module is its implementation. Every
//! field is little-endian. Parsing treats the buffer as hostile: each length, count and width
//! is checked, with checked arithmetic, before anything is allocated or indexed.

use crate::error::{Error, FormatError, Result};

/// Elements per chunk of a lossless body (the last chunk may be shorter).
pub const CHUNK: usize = 4096;
/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"CFCF";
/// The format version this crate writes and reads.
pub const VERSION: u8 = 1;
/// Size of the fixed part of the header; `8 * ndim` bytes of dimensions follow it.
pub const FIXED_HEADER_LEN: usize = 64;
/// Most dimensions a frame may describe.
pub const MAX_NDIM: usize = 8;
/// Values per group; each group has its own bit width.
pub const GROUP: usize = 32;
/// `log2(GROUP)`, as stored in the header.
pub const GROUP_LOG2: u8 = 5;
/// Widest group allowed in a frame. The encoder writes at most 32 bits (codes fit in `i32`);
/// sums of codes may need more, up to the full 64-bit zigzag range.
pub const MAX_WIDTH: u8 = 64;
/// Widest group the encoder produces from tensor data.
pub const MAX_ENCODE_WIDTH: u8 = 32;
/// Largest code magnitude the encoder produces (so zigzag codes fit in 32 bits).
pub const MAX_CODE: f64 = 2_147_483_647.0;

const FLAG_ZSTD: u8 = 1;
/// The body starts with block scales (docs/FORMAT.md, "Block scales").
const FLAG_SCALES: u8 = 2;

/// Element type of a tensor.
///
/// The three float types can be quantized ([`DType::is_quantizable`]); every type can be
/// stored losslessly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// bfloat16 (8 exponent bits, 7 mantissa bits).
    BF16,
    /// IEEE binary16.
    F16,
    /// IEEE binary64 (lossless only).
    F64,
    /// Unsigned 8-bit integers (lossless only).
    U8,
    /// Signed 8-bit integers (lossless only).
    I8,
    /// Signed 16-bit integers (lossless only).
    I16,
    /// Signed 32-bit integers (lossless only).
    I32,
    /// Signed 64-bit integers (lossless only).
    I64,
    /// Booleans, one byte each (lossless only).
    Bool,
}

/// Every dtype, in the order of their codes (see [`DType::ALL`]).
const DTYPES: [DType; 10] = [
    DType::F32,
    DType::BF16,
    DType::F16,
    DType::F64,
    DType::U8,
    DType::I8,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::Bool,
];

impl DType {
    /// Every dtype, in the order of their codes in a frame header.
    pub const ALL: [DType; 10] = DTYPES;

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 | DType::I16 => 2,
            DType::U8 | DType::I8 | DType::Bool => 1,
        }
    }

    /// Whether the error-bounded (quantized) codec takes this type: float32, bfloat16, float16.
    pub fn is_quantizable(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F16)
    }

    /// The conventional name (`float32`, `bfloat16`, `int64`, `bool` ...), as torch prints it.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            DType::F64 => "float64",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::Bool => "bool",
        }
    }

    /// Parses a name as printed by [`DType::name`], or a common alias (`f32`, `bf16`, `f16`, `half`).
    pub fn from_name(name: &str) -> Option<DType> {
        match name {
            "float32" | "f32" | "float" => Some(DType::F32),
            "bfloat16" | "bf16" => Some(DType::BF16),
            "float16" | "f16" | "half" => Some(DType::F16),
            "f64" | "double" => Some(DType::F64),
            "u8" => Some(DType::U8),
            "i8" => Some(DType::I8),
            "i16" | "short" => Some(DType::I16),
            "i32" | "int" => Some(DType::I32),
            "i64" | "long" => Some(DType::I64),
            _ => DTYPES.iter().copied().find(|d| d.name() == name),
        }
    }

    /// The dtype's code in a frame header.
    pub(crate) fn code(self) -> u8 {
        DTYPES.iter().position(|&d| d == self).expect("listed") as u8
    }

    pub(crate) fn from_code(c: u8) -> Option<DType> {
        DTYPES.get(c as usize).copied()
    }
}

/// How a frame's body stores the elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// Quantized codes in bit-plane groups, plus exactly stored exceptions.
    Quantized,
    /// The elements' raw bytes (chosen when quantizing would not make the frame smaller).
    Raw,
    /// Chunks stored exactly by invariant bit packing or zero-value compression.
    Lossless,
    /// Quantized codes, Rice-coded in blocks of 1024 (closer to the codes' entropy than bit
    /// planes), plus exactly stored exceptions.
    Rice,
}

impl Codec {
    /// Whether the body holds quantized codes (bit planes or Rice-coded).
    pub fn is_quantized(self) -> bool {
        matches!(self, Codec::Quantized | Codec::Rice)
    }
}

/// How a compressor writes a quantized body's codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Coder {
    /// Bit planes of each group's width (codec 0): what every backend reads and writes.
    #[default]
    Planes,
    /// Rice codes in blocks of 1024 (codec 3): fewer bytes, read and written on the CPU.
    Rice,
}

impl Coder {
    /// Lower-case name (`planes`, `rice`).
    pub fn name(self) -> &'static str {
        match self {
            Coder::Planes => "planes",
            Coder::Rice => "rice",
        }
    }

    /// Parses [`Coder::name`].
    pub fn from_name(name: &str) -> Option<Coder> {
        [Coder::Planes, Coder::Rice]
            .into_iter()
            .find(|c| c.name() == name)
    }
}

impl Codec {
    fn code(self) -> u8 {
        match self {
            Codec::Quantized => 0,
            Codec::Raw => 1,
            Codec::Lossless => 2,
            Codec::Rice => 3,
        }
    }
}

/// How the quantization step of a frame was chosen. Informational: decoding ignores it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoundMode {
    /// An absolute bound given by the caller.
    Abs,
    /// A bound relative to the tensor's largest finite magnitude.
    Rel,
    /// A fixed number of bits per value; the bound is measured and reported.
    Bits,
    /// The element-wise sum of several frames.
    Sum,
    /// No loss: every bit pattern comes back (`eps` is 0).
    Lossless,
    /// Each block's bound is a fraction of its own RMS, rounded down to a power of two (the
    /// frame has block scales).
    Rms,
}

impl BoundMode {
    /// Lower-case name (`abs`, `rel`, `bits`, `sum`, `lossless`, `rms`).
    pub fn name(self) -> &'static str {
        match self {
            BoundMode::Abs => "abs",
            BoundMode::Rel => "rel",
            BoundMode::Bits => "bits",
            BoundMode::Sum => "sum",
            BoundMode::Lossless => "lossless",
            BoundMode::Rms => "rms",
        }
    }
    /// The mode's number in frames, and in the kernels' parameters.
    pub(crate) fn code(self) -> u8 {
        match self {
            BoundMode::Abs => 0,
            BoundMode::Rel => 1,
            BoundMode::Bits => 2,
            BoundMode::Sum => 3,
            BoundMode::Lossless => 4,
            BoundMode::Rms => 5,
        }
    }
    fn from_code(c: u8) -> Option<BoundMode> {
        match c {
            0 => Some(BoundMode::Abs),
            1 => Some(BoundMode::Rel),
            2 => Some(BoundMode::Bits),
            3 => Some(BoundMode::Sum),
            4 => Some(BoundMode::Lossless),
            5 => Some(BoundMode::Rms),
            _ => None,
        }
    }
}

/// The parsed header of a frame.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    /// How the body stores elements.
    pub codec: Codec,
    /// Element type of the tensor.
    pub dtype: DType,
    /// Whether the body went through zstd.
    pub zstd: bool,
    /// How the step was chosen.
    pub mode: BoundMode,
    /// Fixed bit width (bits mode), else 0.
    pub bits: u8,
    /// Number of elements.
    pub n: u64,
    /// Quantization step: element `i` decodes to `code[i] * step`.
    pub step: f64,
    /// Guaranteed bound on `|decoded - original|` for every finite element (0 = exact).
    pub eps: f64,
    /// Number of exactly stored elements.
    pub n_exceptions: u64,
    /// Bytes of body stored after the header.
    pub body_len: u64,
    /// Bytes of body once the zstd stage is undone.
    pub raw_body_len: u64,
    /// Dimensions; their product is `n`.
    pub shape: Vec<u64>,
    /// Block scales: `log2` of the elements per block (5 to 24), 0 for none. With scales the
    /// body starts with a shift per block ([`crate::codec::scales`]), and `step` and `eps` are
    /// the coarsest block's.
    pub block_log2: u8,
}

/// Where each part of a quantized body sits, derived from the header alone.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BodyLayout {
    /// Number of groups (`ceil(n / GROUP)`).
    pub groups: usize,
    /// Bytes of block scales at the body's start (a byte per block; 0 without scales).
    pub scales_len: usize,
    /// Bytes before the codes' data, after the scales: the width table (a byte per group) or
    /// the rice block heads (8 bytes per block).
    pub table_len: usize,
    /// Bytes of the codes' data: bit planes, or the rice blocks' data.
    pub planes_len: usize,
    /// Size of one exception index (4 when `n <= 2^32`, else 8).
    pub index_size: usize,
}

/// Number of groups for `n` elements.
pub fn groups_for(n: u64) -> u64 {
    n.div_ceil(GROUP as u64)
}

/// The fewest bytes a quantized or raw frame of `n` elements in `ndim` dimensions without a zstd
/// stage takes (the frames the GPU reads and writes): its header and a width byte per group (a
/// raw frame's `n` values take at least as many; a zstd stage may take fewer). Shorter
/// sizes are refused before anything reads the frame, on the host alike whichever way its
/// decoding is queued, so that ranks that read the same sizes stop at the same bucket.
pub fn min_frame_len(n: u64, ndim: usize) -> u64 {
    (FIXED_HEADER_LEN + 8 * ndim) as u64 + groups_for(n)
}

/// Number of lossless chunks for `n` elements.
fn groups_for_chunks(n: u64) -> u64 {
    n.div_ceil(CHUNK as u64)
}

/// Size in bytes of one exception index for a tensor of `n` elements.
pub(crate) fn index_size_for(n: u64) -> usize {
    if n <= 1u64 << 32 {
        4
    } else {
        8
    }
}

/// Checks a shape against an element count and returns it as `u64`s.
pub fn checked_shape(shape: &[usize], n: usize) -> Result<Vec<u64>> {
    let bad = |prod| Error::ShapeMismatch {
        shape_elements: prod,
        elements: n as u64,
        ndim: shape.len(),
    };
    if shape.len() > MAX_NDIM {
        return Err(bad(None));
    }
    let prod = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
        .ok_or_else(|| bad(None))?;
    if prod != n as u64 {
        return Err(bad(Some(prod)));
    }
    Ok(shape.iter().map(|&d| d as u64).collect())
}

fn truncated(part: &'static str, needed: u64, available: u64) -> Error {
    FormatError::Truncated {
        part,
        needed,
        available,
    }
    .into()
}

pub(crate) fn bad_field(field: &'static str, value: impl ToString) -> Error {
    FormatError::BadField {
        field,
        value: value.to_string(),
    }
    .into()
}

pub(crate) fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

impl Header {
    /// Bytes this header takes when written.
    pub fn len(&self) -> usize {
        FIXED_HEADER_LEN + 8 * self.shape.len()
    }

    /// Headers are never empty; provided for symmetry with `len`.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Bytes the decoded tensor takes.
    pub fn decoded_len(&self) -> u64 {
        // Cannot overflow: `parse` and the encoders check n * size against the body.
        self.n * self.dtype.size() as u64
    }

    /// Appends the header to `out`.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(self.codec.code());
        out.push(self.dtype.code());
        out.push(
            if self.zstd { FLAG_ZSTD } else { 0 }
                | if self.block_log2 != 0 { FLAG_SCALES } else { 0 },
        );
        out.push(self.mode.code());
        out.push(self.shape.len() as u8);
        out.push(GROUP_LOG2);
        out.push(self.bits);
        out.push(self.block_log2);
        out.extend_from_slice(&[0u8; 3]);
        out.extend_from_slice(&self.n.to_le_bytes());
        out.extend_from_slice(&self.step.to_le_bytes());
        out.extend_from_slice(&self.eps.to_le_bytes());
        out.extend_from_slice(&self.n_exceptions.to_le_bytes());
        out.extend_from_slice(&self.body_len.to_le_bytes());
        out.extend_from_slice(&self.raw_body_len.to_le_bytes());
        for d in &self.shape {
            out.extend_from_slice(&d.to_le_bytes());
        }
    }

    /// Parses and validates a frame's header; returns it with the stored body.
    ///
    /// Everything that can be checked without reading the body is checked here: magic,
    /// version, enumerations, reserved bytes, shape against element count, step and bound,
    /// and that the body lengths agree with each other and with the buffer (to the byte).
    pub fn parse(buf: &[u8]) -> Result<(Header, &[u8])> {
        if buf.len() < FIXED_HEADER_LEN {
            return Err(truncated(
                "header",
                FIXED_HEADER_LEN as u64,
                buf.len() as u64,
            ));
        }
        let magic: [u8; 4] = [buf[0], buf[1], buf[2], buf[3]];
        if magic != MAGIC {
            return Err(FormatError::BadMagic(magic).into());
        }
        if buf[4] != VERSION {
            return Err(FormatError::UnsupportedVersion(buf[4]).into());
        }
        let codec = match buf[5] {
            0 => Codec::Quantized,
            1 => Codec::Raw,
            2 => Codec::Lossless,
            3 => Codec::Rice,
            c => return Err(bad_field("codec", c)),
        };
        let dtype = DType::from_code(buf[6]).ok_or_else(|| bad_field("dtype", buf[6]))?;
        if codec.is_quantized() && !dtype.is_quantizable() {
            return Err(bad_field(
                "codec",
                format!("quantized codes of {}", dtype.name()),
            ));
        }
        let flags = buf[7];
        if flags & !(FLAG_ZSTD | FLAG_SCALES) != 0 {
            return Err(bad_field("flags", format!("{flags:#04x}")));
        }
        let mode = BoundMode::from_code(buf[8]).ok_or_else(|| bad_field("mode", buf[8]))?;
        // Lossless frames say so in their mode; raw frames of integers can only be lossless.
        let lossless_mode = match codec {
            Codec::Lossless => true,
            Codec::Quantized | Codec::Rice => false,
            Codec::Raw => !dtype.is_quantizable() || mode == BoundMode::Lossless,
        };
        if (mode == BoundMode::Lossless) != lossless_mode {
            return Err(bad_field("mode", mode.name()));
        }
        let ndim = buf[9] as usize;
        if ndim > MAX_NDIM {
            return Err(bad_field("ndim", ndim));
        }
        if buf[10] != GROUP_LOG2 {
            return Err(bad_field("group size (log2)", buf[10]));
        }
        let bits = buf[11];
        // A fixed width of 2 to 32 in mode bits (what the encoder takes), 0 in the others.
        let bits_ok = match mode {
            // (a fixed rate's layout is bit planes)
            BoundMode::Bits => (2..=MAX_ENCODE_WIDTH).contains(&bits) && codec != Codec::Rice,
            _ => bits == 0,
        };
        if !bits_ok {
            return Err(bad_field("bits", bits));
        }
        // Block scales: quantized codes whose step is a bound's (not a fixed rate's).
        let block_log2 = buf[12];
        if flags & FLAG_SCALES != 0 {
            let scalable = codec.is_quantized()
                && matches!(
                    mode,
                    BoundMode::Abs | BoundMode::Rel | BoundMode::Sum | BoundMode::Rms
                );
            if !scalable {
                return Err(bad_field(
                    "flags",
                    format!("block scales in a {codec:?} frame of mode {}", mode.name()),
                ));
            }
            crate::codec::scales::check_log2(block_log2)
                .map_err(|_| bad_field("block size (log2)", block_log2))?;
        } else if (mode == BoundMode::Rms && codec != Codec::Raw) || block_log2 != 0 {
            return Err(bad_field(
                "block scales",
                format!(
                    "mode {}, block size 2^{block_log2}, no scales flag",
                    mode.name()
                ),
            ));
        }
        if buf[13..16] != [0u8; 3] {
            return Err(bad_field(
                "reserved bytes",
                format!("{:02x?}", &buf[13..16]),
            ));
        }
        let n = u64_at(buf, 16);
        let step = f64::from_le_bytes(u64_at(buf, 24).to_le_bytes());
        let eps = f64::from_le_bytes(u64_at(buf, 32).to_le_bytes());
        let n_exceptions = u64_at(buf, 40);
        let body_len = u64_at(buf, 48);
        let raw_body_len = u64_at(buf, 56);
        let header_len = FIXED_HEADER_LEN + 8 * ndim;
        if buf.len() < header_len {
            return Err(truncated("shape", header_len as u64, buf.len() as u64));
        }
        let shape: Vec<u64> = (0..ndim)
            .map(|i| u64_at(buf, FIXED_HEADER_LEN + 8 * i))
            .collect();
        let prod = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        if prod != Some(n) {
            return Err(bad_field(
                "shape",
                format!("{shape:?} does not hold {n} elements"),
            ));
        }
        if !(step.is_finite() && step > 0.0) {
            return Err(bad_field("step", step));
        }
        if !(eps.is_finite() && eps >= 0.0) || (mode == BoundMode::Lossless && eps != 0.0) {
            return Err(bad_field("eps", eps));
        }
        if mode == BoundMode::Lossless && (step != 1.0 || n_exceptions != 0) {
            return Err(bad_field(
                "lossless header",
                format!("step {step}, {n_exceptions} exceptions"),
            ));
        }
        let body = &buf[header_len..];
        if body_len != body.len() as u64 {
            return Err(FormatError::LengthMismatch {
                part: "body",
                expected: body_len,
                found: body.len() as u64,
            }
            .into());
        }
        let zstd = flags & FLAG_ZSTD != 0;
        if !zstd && raw_body_len != body_len {
            return Err(FormatError::LengthMismatch {
                part: "raw body",
                expected: body_len,
                found: raw_body_len,
            }
            .into());
        }
        let header = Header {
            codec,
            dtype,
            zstd,
            mode,
            bits,
            n,
            step,
            eps,
            n_exceptions,
            body_len,
            raw_body_len,
            shape,
            block_log2,
        };
        header.check_raw_body_len()?;
        // An empty tensor's other dimensions are bounded by nothing above (elsewhere the
        // lengths bound n): each must still be a size that tensor libraries can index (a
        // signed 64-bit integer).
        if header.shape.iter().any(|&d| d > i64::MAX as u64) {
            return Err(bad_field(
                "shape",
                format!("{:?} has a dimension above 2^63 - 1", header.shape),
            ));
        }
        Ok((header, body))
    }

    /// Checks that `raw_body_len` is possible for this header, before any zstd stage is
    /// undone (so a crafted length cannot make us allocate or inflate more than the format
    /// allows), and exactly right for raw frames.
    fn check_raw_body_len(&self) -> Result<()> {
        let size = self.dtype.size() as u64;
        let overflow = || bad_field("element count", self.n);
        match self.codec {
            Codec::Raw => {
                if self.n_exceptions != 0 {
                    return Err(bad_field("exception count", self.n_exceptions));
                }
                let expected = self.n.checked_mul(size).ok_or_else(overflow)?;
                if self.raw_body_len != expected {
                    return Err(FormatError::LengthMismatch {
                        part: "raw body",
                        expected,
                        found: self.raw_body_len,
                    }
                    .into());
                }
            }
            Codec::Lossless => {
                // A chunk table entry per chunk, and less than the elements' bytes (the encoder
                // writes a raw frame otherwise), so that inflating a zstd stage never goes past
                // what the tensor itself takes.
                let chunks = groups_for_chunks(self.n);
                let min = chunks.checked_mul(4).ok_or_else(overflow)?;
                let raw = self.n.checked_mul(size).ok_or_else(overflow)?;
                if self.raw_body_len < min || self.raw_body_len >= raw {
                    return Err(FormatError::LengthMismatch {
                        part: "raw body",
                        expected: min,
                        found: self.raw_body_len,
                    }
                    .into());
                }
            }
            Codec::Quantized | Codec::Rice => {
                if self.n_exceptions > self.n {
                    return Err(bad_field("exception count", self.n_exceptions));
                }
                let exc = self
                    .n_exceptions
                    .checked_mul(index_size_for(self.n) as u64 + size)
                    .ok_or_else(overflow)?;
                // The table before the data, and the most data it can describe.
                let (table, max_planes) = if self.codec == Codec::Rice {
                    let blocks = crate::codec::rice::blocks_for(self.n);
                    (
                        blocks.checked_mul(crate::codec::rice::HEAD_BYTES as u64),
                        blocks.checked_mul(crate::codec::rice::MAX_BLOCK_WORDS * 4),
                    )
                } else {
                    let groups = groups_for(self.n);
                    (Some(groups), groups.checked_mul(MAX_WIDTH as u64 * 4))
                };
                let table = table.ok_or_else(overflow)?;
                let max_planes = max_planes.ok_or_else(overflow)?;
                let min = table
                    .checked_add(exc)
                    .and_then(|m| m.checked_add(self.scales_len()))
                    .ok_or_else(overflow)?;
                let max = min.checked_add(max_planes).ok_or_else(overflow)?;
                if self.raw_body_len < min || self.raw_body_len > max {
                    return Err(FormatError::LengthMismatch {
                        part: "raw body",
                        expected: min,
                        found: self.raw_body_len,
                    }
                    .into());
                }
            }
        }
        Ok(())
    }

    /// Bytes of block scales at the body's start (0 without scales).
    pub fn scales_len(&self) -> u64 {
        if self.block_log2 == 0 {
            0
        } else {
            crate::codec::scales::blocks_for(self.n, self.block_log2)
        }
    }

    /// Layout of a quantized or rice body (valid after `parse`).
    pub(crate) fn layout(&self) -> BodyLayout {
        let groups = groups_for(self.n) as usize;
        let index_size = index_size_for(self.n);
        let exc = self.n_exceptions as usize * (index_size + self.dtype.size());
        let table_len = match self.codec {
            Codec::Rice => {
                crate::codec::rice::blocks_for(self.n) as usize * crate::codec::rice::HEAD_BYTES
            }
            _ => groups,
        };
        let scales_len = self.scales_len() as usize;
        BodyLayout {
            groups,
            scales_len,
            table_len,
            planes_len: self.raw_body_len as usize - scales_len - table_len - exc,
            index_size,
        }
    }
}

/// Reads a frame's header only: cheap, for inspecting a buffer.
pub fn read_header(buf: &[u8]) -> Result<Header> {
    Header::parse(buf).map(|(h, _)| h)
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
