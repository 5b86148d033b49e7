//! The one error type of the cfc core.

use std::fmt;

/// Every way a cfc operation can fail.
///
/// Variants carry the offending values so that a message says what was wrong, not only that
/// something was.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// An error bound argument is unusable (NaN, infinite, zero, negative, out of range), or
    /// the bound was given more than once or not at all.
    InvalidBound {
        /// Which argument (`eps`, `rel`, `bits`).
        what: &'static str,
        /// Why it was refused.
        reason: String,
    },
    /// A shape does not match the number of elements given, or has too many dimensions.
    ShapeMismatch {
        /// Elements implied by the shape (or `None` when the product overflows).
        shape_elements: Option<u64>,
        /// Elements actually given.
        elements: u64,
        /// Dimensions of the shape.
        ndim: usize,
    },
    /// An input byte buffer does not hold a whole number of elements of its dtype.
    MisalignedInput {
        /// Length of the buffer in bytes.
        len: usize,
        /// Size of one element in bytes.
        element_size: usize,
    },
    /// An output buffer has the wrong size for the frame being decoded.
    OutputSize {
        /// Bytes the frame decodes to.
        expected: u64,
        /// Bytes the caller provided.
        got: u64,
    },
    /// A compressed buffer is malformed: truncated, corrupted, crafted or from a newer version.
    Format(FormatError),
    /// Frames that were asked to be combined do not share dtype, shape or quantization step.
    Incompatible {
        /// What differs.
        what: &'static str,
        /// The first frame's value.
        left: String,
        /// The other frame's value.
        right: String,
    },
    /// A hand-built [`crate::Codes`] is inconsistent (code count against shape, exception
    /// indices, step or bound).
    InvalidCodes {
        /// What is wrong.
        reason: String,
    },
    /// An element of a `bool` tensor given to the lossless codec is a byte other than 0 or 1
    /// (a bool of such a byte has no meaning in torch or numpy, and no frame may hold one).
    InvalidBool {
        /// Index of the first such element.
        index: u64,
        /// Its byte.
        byte: u8,
    },
    /// Summing codes overflowed 64-bit integers.
    CodeOverflow {
        /// Index of the element whose sum overflowed.
        index: u64,
    },
    /// No usable CUDA: the driver or NVRTC library is missing, no device is present, or CUDA's
    /// headers cannot be found for compiling the kernels.
    CudaUnavailable(String),
    /// A CUDA driver call failed (the driver's error name and message).
    Cuda(String),
    /// NVRTC could not compile cfc's kernels; carries the options and the compiler log.
    Nvrtc {
        /// The compiler's log.
        log: String,
    },
    /// Ranks of a collective disagree on the buffer or the options.
    RankMismatch {
        /// What the first rank has.
        what: String,
        /// What a disagreeing rank has.
        theirs: String,
    },
    /// A peer refused its own input to a collective (a bad dtype, bound or residual, seen
    /// before anything moved) and told the others so in the agreement round.
    PeerRefused {
        /// The rank that refused.
        rank: usize,
        /// Its error, as it reported it.
        reason: String,
    },
    /// A collective failed on a peer after every rank had agreed to run it (a malformed frame
    /// it received, memory running out), and that peer told the others so in the next round.
    PeerFailed {
        /// The rank where the failure began.
        rank: usize,
        /// Its error, as it reported it.
        reason: String,
    },
    /// A peer did not answer in time.
    Timeout {
        /// The rank waited for.
        peer: usize,
        /// How long we waited.
        seconds: f64,
    },
    /// The transport of a collective failed (a peer is gone, a link broke).
    Transport(String),
    /// The NCCL library cannot be loaded (where it was looked for, and why each failed).
    NcclUnavailable(String),
    /// An NCCL call failed, or an NCCL collective made no progress within its timeout (the
    /// communicator is then aborted); carries NCCL's own message.
    Nccl(String),
    /// The zstd stage failed while compressing.
    Zstd(std::io::Error),
    /// The error-bounded codec was asked to quantize a dtype other than float32, bfloat16 or
    /// float16 (every dtype can be compressed losslessly).
    NotQuantizable(crate::format::DType),
    /// Memory for a frame's decoded values, or for its body past a zstd stage, could not be
    /// had: a valid frame can describe far more than it holds bytes (a tensor of zeros, zstd),
    /// so the size is the frame's claim, refused here rather than aborting the process.
    Allocation {
        /// Bytes asked for.
        bytes: u64,
    },
    /// The engine touched memory on one lane before ordering that lane after another lane's
    /// use of the same bytes: on a GPU the two could run at once. Raised by the CPU backend's
    /// lane check (on in tests), which finds such a bug of cfc's without a GPU.
    LaneOrder(String),
}

/// What a device decoding's status reports, if anything: its 8 bytes read as a little-endian
/// u64, the error bits (low half) and the bad frame's index + 1 (high half; 0: not known). The
/// CUDA decoders write it (`kernels/codec/decode_sum.cu`); the engine and the Python package
/// both report it with this message.
pub fn decode_status_error(status: u64) -> Option<String> {
    let (bits, which) = (status as u32, (status >> 32) as u32);
    if bits == 0 {
        return None;
    }
    let frame = match which {
        0 => "a frame".to_string(),
        i => format!("frame {}", i - 1),
    };
    Some(format!(
        "{frame} of a decoding was not a frame of the elements decoded, laid out as its header \
         says within its size (checked on the device; error bits {bits:#x}): nothing was decoded \
         from then on"
    ))
}

/// An empty vector with room for `n` values, or [`Error::Allocation`] where the memory cannot
/// be had (`Vec::with_capacity` would abort the process).
pub(crate) fn try_capacity<T>(n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::Allocation {
        bytes: (n as u64).saturating_mul(std::mem::size_of::<T>() as u64),
    })?;
    Ok(v)
}

/// `n` copies of `value`, or [`Error::Allocation`] (see [`try_capacity`]).
pub(crate) fn try_filled<T: Clone>(n: usize, value: T) -> Result<Vec<T>> {
    let mut v = try_capacity(n)?;
    v.resize(n, value);
    Ok(v)
}

/// What exactly is wrong with a compressed buffer.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum FormatError {
    /// The buffer ends before a part that its header announces.
    Truncated {
        /// What was being read.
        part: &'static str,
        /// Bytes that part needs.
        needed: u64,
        /// Bytes available.
        available: u64,
    },
    /// The buffer does not start with the cfc magic bytes.
    BadMagic([u8; 4]),
    /// The frame was written by a newer (or unknown) version of the format.
    UnsupportedVersion(u8),
    /// A header field holds a value the format does not allow.
    BadField {
        /// The field's name.
        field: &'static str,
        /// The value found.
        value: String,
    },
    /// Lengths in the frame disagree with each other or with the buffer.
    LengthMismatch {
        /// What was checked.
        part: &'static str,
        /// Bytes expected from the other fields.
        expected: u64,
        /// Bytes found.
        found: u64,
    },
    /// A group's bit width is larger than the format allows.
    BadWidth {
        /// Index of the group.
        group: u64,
        /// The width found.
        width: u8,
    },
    /// Exception indices are out of range or not strictly increasing.
    BadExceptionIndex {
        /// Position in the exception list.
        position: u64,
        /// The index found there.
        index: u64,
    },
    /// The zstd stage of the body could not be decoded.
    Zstd(String),
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidBound { what, reason } => write!(f, "invalid {what}: {reason}"),
            Error::ShapeMismatch {
                shape_elements,
                elements,
                ndim,
            } => match shape_elements {
                Some(s) => write!(
                    f,
                    "shape with {ndim} dimensions holds {s} elements, but {elements} were given"
                ),
                None => write!(f, "shape with {ndim} dimensions overflows or has too many dimensions (at most {})", crate::format::MAX_NDIM),
            },
            Error::MisalignedInput { len, element_size } => write!(
                f,
                "input of {len} bytes is not a whole number of {element_size}-byte elements"
            ),
            Error::OutputSize { expected, got } => write!(
                f,
                "output buffer has {got} bytes but the frame decodes to {expected} bytes"
            ),
            Error::Format(e) => write!(f, "malformed cfc buffer: {e}"),
            Error::Incompatible { what, left, right } => {
                write!(f, "frames differ in {what}: {left} vs {right}")
            }
            Error::InvalidCodes { reason } => write!(f, "invalid codes: {reason}"),
            Error::InvalidBool { index, byte } => write!(
                f,
                "element {index} of the bool tensor is the byte {byte}; a bool must be 0 or 1"
            ),
            Error::CodeOverflow { index } => {
                write!(f, "sum of codes overflows 64 bits at element {index}")
            }
            Error::Zstd(e) => write!(f, "zstd stage failed: {e}"),
            Error::Allocation { bytes } => write!(
                f,
                "could not allocate {bytes} bytes for what the frame describes (its values, or its body past a zstd stage)"
            ),
            Error::LaneOrder(what) => write!(f, "lanes out of order (a bug of cfc's): {what}"),
            Error::RankMismatch { what, theirs } => {
                write!(f, "ranks disagree: {what}, but {theirs}")
            }
            Error::PeerRefused { rank, reason } => {
                write!(f, "rank {rank} refused its input: {reason}")
            }
            Error::PeerFailed { rank, reason } => {
                write!(f, "the call failed on rank {rank}: {reason}")
            }
            Error::Timeout { peer, seconds } => {
                write!(f, "rank {peer} did not answer within {seconds} s")
            }
            Error::Transport(e) => write!(f, "transport failed: {e}"),
            Error::NcclUnavailable(why) => write!(f, "NCCL is not available: {why}"),
            Error::Nccl(e) => write!(f, "NCCL: {e}"),
            Error::CudaUnavailable(why) => write!(f, "CUDA is not available: {why}"),
            Error::Cuda(e) => write!(f, "CUDA error: {e}"),
            Error::Nvrtc { log } => write!(f, "NVRTC failed to compile cfc's kernels: {log}"),
            Error::NotQuantizable(d) => write!(
                f,
                "{} cannot be quantized: the error-bounded codec takes float32, bfloat16 and \
                 float16 (every dtype can be compressed losslessly)",
                d.name()
            ),
        }
    }
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FormatError::Truncated {
                part,
                needed,
                available,
            } => write!(
                f,
                "truncated {part}: needs {needed} bytes, {available} available"
            ),
            FormatError::BadMagic(m) => write!(f, "bad magic {m:02x?} (expected \"CFCF\")"),
            FormatError::UnsupportedVersion(v) => write!(
                f,
                "format version {v} is not supported (this cfc reads version {})",
                crate::format::VERSION
            ),
            FormatError::BadField { field, value } => write!(f, "bad {field}: {value}"),
            FormatError::LengthMismatch {
                part,
                expected,
                found,
            } => write!(f, "{part} is {found} bytes, expected {expected}"),
            FormatError::BadWidth { group, width } => write!(
                f,
                "group {group} has bit width {width} (at most {})",
                crate::format::MAX_WIDTH
            ),
            FormatError::BadExceptionIndex { position, index } => write!(
                f,
                "exception {position} has index {index}, out of range or not increasing"
            ),
            FormatError::Zstd(e) => write!(f, "zstd body: {e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Zstd(e) => Some(e),
            Error::Format(e) => Some(e),
            _ => None,
        }
    }
}

impl std::error::Error for FormatError {}

impl From<FormatError> for Error {
    fn from(e: FormatError) -> Self {
        Error::Format(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_that_cannot_be_had_is_an_error_not_an_abort() {
        assert_eq!(try_filled(3, 7u8).unwrap(), vec![7, 7, 7]);
        let e = try_filled(usize::MAX / 4, 0i64).unwrap_err();
        assert!(matches!(e, Error::Allocation { .. }), "{e:?}");
        assert!(e.to_string().contains("could not allocate"), "{e}");
    }
}
