//! What a caller hands the engine: a bucket of memory to reduce, and how.

use crate::error::{Error, Result};
use crate::format::DType;

/// The most elements a job may hold: 2^48, far past any device's memory (the CUDA codec's
/// limit, below which no size the engine computes wraps around).
pub const MAX_NUMEL: u64 = 1 << 48;

/// Elements in the caller's memory: an address on the engine's device (host memory for a CPU
/// engine), an element count and a dtype. The memory is contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tensor {
    /// Address of the first element, aligned to the element size.
    pub addr: u64,
    /// Element count.
    pub numel: u64,
    /// Element type.
    pub dtype: DType,
}

impl Tensor {
    /// Its size in bytes.
    pub fn bytes(&self) -> u64 {
        self.numel * self.dtype.size() as u64
    }

    /// Elements `start..start + len` (within this tensor: the caller checks).
    pub(crate) fn slice(&self, start: u64, len: u64) -> Tensor {
        debug_assert!(start + len <= self.numel);
        Tensor {
            addr: self.addr + start * self.dtype.size() as u64,
            numel: len,
            dtype: self.dtype,
        }
    }

    /// Its bytes as a region.
    pub(crate) fn region(&self) -> Region {
        Region {
            addr: self.addr,
            len: self.bytes(),
        }
    }
}

/// A byte range of memory the engine works on: part of its own scratch, or of a job's tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Address of the first byte.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
}

impl Region {
    /// Bytes `offset..offset + len` of this region.
    ///
    /// # Errors
    /// [`Error::Transport`] (an internal error) for a range past its end: the engine computes
    /// every offset it uses, and this is where a mistake in them stops before memory is touched.
    pub fn sub(&self, offset: u64, len: u64) -> Result<Region> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(Region {
                addr: self.addr + offset,
                len,
            }),
            _ => Err(Error::Transport(format!(
                "internal: bytes {offset}..+{len} of a region of {}",
                self.len
            ))),
        }
    }
}

/// How the reduced values are scaled before they are written.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scale {
    /// The sum.
    Sum,
    /// The sum divided by the number of ranks (multiplied by `1 / world` rounded to f32, as
    /// PyTorch's `div_` does on the GPU).
    Average,
    /// The sum multiplied by this factor.
    Times(f32),
}

impl Scale {
    /// The factor among `world` ranks.
    pub(crate) fn factor(self, world: usize) -> f32 {
        match self {
            Scale::Sum => 1.0,
            Scale::Average => 1.0 / world.max(1) as f32,
            Scale::Times(f) => f,
        }
    }
}

/// What a job computes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Op {
    /// Every rank's `data` reduced into every rank's `data`, in place.
    AllReduce,
    /// `data` holds one shard per rank, rank-major (`world` shards of `data.numel / world`
    /// elements); this rank's shard, reduced over every rank, is written to `out` (of the
    /// shard's length and the data's dtype).
    ReduceScatter {
        /// Where this rank's reduced shard goes.
        out: Tensor,
    },
}

/// One bucket to reduce.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Job {
    /// The bucket's identity from step to step (its slots, statistics and choices are kept
    /// under it): e.g. DDP's bucket index.
    pub key: u64,
    /// What the bucket holds (e.g. a hash of its parameters): when it changes, what was kept
    /// under `key` is forgotten.
    pub fingerprint: u64,
    /// The values (float32, bfloat16 or float16).
    pub data: Tensor,
    /// Error feedback: float32 residuals, one per element of `data`, updated in place (what
    /// this rank's quantization dropped, carried into the bucket's next job).
    pub residual: Option<Tensor>,
    /// All-reduce or reduce-scatter.
    pub op: Op,
    /// How the reduced values are scaled.
    pub scale: Scale,
    /// The job ends a step: the engine closes the step after it (a last small round in which
    /// every rank says whether it decoded everything), and counts it for the warm-up and the
    /// trial.
    pub last: bool,
    /// The residual holds values no exchange has sent yet (loaded from a checkpoint, or
    /// carried over from another bucket): an uncompressed exchange sends them along.
    pub fresh_residual: bool,
}

impl Job {
    /// Checks the job against the engine's `world` and options.
    ///
    /// # Errors
    /// [`Error::NotQuantizable`] for a dtype other than float32, bfloat16 and float16;
    /// [`Error::ShapeMismatch`] for a residual of another length (or not float32), a
    /// reduce-scatter whose data does not divide into `world` shards or whose output is not
    /// one shard; [`Error::MisalignedInput`] for an address not aligned to its element.
    pub(crate) fn check(&self, world: usize, feedback: bool) -> Result<()> {
        if !self.data.dtype.is_quantizable() {
            return Err(Error::NotQuantizable(self.data.dtype));
        }
        if self.data.numel > MAX_NUMEL {
            // (past it the sizes of frames and rows could wrap around)
            return Err(Error::ShapeMismatch {
                shape_elements: Some(MAX_NUMEL),
                elements: self.data.numel,
                ndim: 1,
            });
        }
        let aligned = |t: &Tensor| {
            let size = t.dtype.size() as u64;
            if t.addr % size != 0 {
                return Err(Error::MisalignedInput {
                    len: t.addr as usize % 4096,
                    element_size: size as usize,
                });
            }
            Ok(())
        };
        aligned(&self.data)?;
        if let Some(r) = &self.residual {
            if r.dtype != DType::F32 || r.numel != self.data.numel {
                return Err(Error::ShapeMismatch {
                    shape_elements: Some(r.numel),
                    elements: self.data.numel,
                    ndim: 1,
                });
            }
            aligned(r)?;
            if !feedback {
                return Err(Error::Transport(
                    "a residual was given to an engine without error feedback".into(),
                ));
            }
        }
        if let Op::ReduceScatter { out } = &self.op {
            let w = world.max(1) as u64;
            if self.data.numel % w != 0
                || out.numel != self.data.numel / w
                || out.dtype != self.data.dtype
            {
                return Err(Error::ShapeMismatch {
                    shape_elements: Some(out.numel * w),
                    elements: self.data.numel,
                    ndim: 1,
                });
            }
            aligned(out)?;
        }
        if let Scale::Times(f) = self.scale {
            if !f.is_finite() {
                return Err(Error::Transport(format!("the scale {f} is not finite")));
            }
        }
        Ok(())
    }
}
