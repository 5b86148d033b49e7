//! The compressed all-reduce, written once over a [`Transport`].
//!
//! Every rank quantizes its (error-compensated) buffer once, with a step all ranks agree on;
//! the integer codes of each shard are summed exactly on the shard's owner (reduce-scatter) and
//! repacked losslessly; the summed shards are then gathered by everyone (all-gather). Each rank
//! sends about `2 (N - 1) / N` times its compressed size, like a ring all-reduce of raw data,
//! and the only loss of a step is each rank's own rounding, which its residual carries into
//! the next step.
//!
//! The all-gather variant ([`Algorithm::AllGather`]) sends each rank's whole frame to every
//! other rank, which sums all of them: one round instead of two and no repacking, but `N - 1`
//! times the compressed size on the wire, and every rank decodes every frame whole. Both give
//! the same bits. `cfc-bench` times both: with 2 ranks the all-gather sends about 8% fewer
//! bytes, but over the in-process transport the reduce-scatter was faster at every size and
//! rank count measured, so it is the default.
//!
//! Ranks that disagree on the buffer or the options get [`Error::RankMismatch`] on every rank
//! (checked before any data moves). A rank that refuses its own input (a bad dtype or residual)
//! still takes part in that agreement round, with its error in place of its options, so its
//! peers get [`Error::PeerRefused`] rather than waiting for it (and it returns its error once
//! the round is over, or has failed); a peer that stops answering becomes [`Error::Timeout`].
//! A call that fails on one rank after the agreement (a malformed frame from a peer, memory
//! running out) still takes part in the rounds that follow, with a failure in place of its
//! frame, so that its peers get [`Error::PeerFailed`] at once rather than waiting for a round
//! it would not join. A last round of a few bytes, after every rank has decoded its result,
//! says whether each succeeded: a frame damaged on its way to one rank fails every rank, and no
//! rank keeps a step that another did not.

use crate::codec::{compress, decompress, Bound, CompressOptions};
use crate::element::Element;
use crate::error::{Error, Result};
use crate::feedback::compress_with_feedback;
use crate::format::GROUP;
use crate::sum::Codes;
use std::time::Duration;

/// Moves bytes between the ranks of a group. Every rank must call the same operations in the
/// same order (as with any collective library).
pub trait Transport {
    /// This rank's index, `0..world()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world(&self) -> usize;
    /// Sends `parts[j]` to rank `j` (this rank's own part included) and returns what each rank
    /// sent to this one, indexed by sender.
    ///
    /// # Errors
    /// [`Error::Timeout`] when a peer does not answer in time, [`Error::Transport`] when a peer
    /// is gone or the link fails.
    fn all_to_all(&mut self, parts: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>>;

    /// Every rank's `data`, indexed by rank.
    ///
    /// # Errors
    /// As [`Transport::all_to_all`].
    fn all_gather(&mut self, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let parts = vec![data; self.world()];
        self.all_to_all(parts)
    }
}

/// How the compressed codes travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// Shards of codes summed on their owners, then gathered: about `2 (N - 1) / N` times the
    /// compressed size per rank, in two rounds.
    ReduceScatter,
    /// Every rank's whole frame to every rank, summed everywhere: `N - 1` times the compressed
    /// size per rank, in one round.
    AllGather,
}

/// Options of [`allreduce`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AllReduceOptions {
    /// The bound each rank's contribution is quantized with: `Abs(eps)`, or `Rel(r)` for
    /// `eps = r * max|x|` over all ranks. (Fixed rate cannot share one step and is refused.)
    pub bound: Bound,
    /// Divide the sum by the number of ranks.
    pub average: bool,
    /// Run each frame through zstd before it is sent (CPU transports).
    pub zstd_level: Option<i32>,
    /// The exchange; `None`: [`Algorithm::ReduceScatter`].
    pub algorithm: Option<Algorithm>,
}

/// What [`allreduce`] returns besides the values.
#[derive(Debug, Clone, PartialEq)]
pub struct AllReduceReport {
    /// The bound each rank's contribution was quantized with.
    pub eps: f64,
    /// Bound on `|result - exact|`: `N * eps` for a sum, `eps` for an average (plus one rounding
    /// of the result to the element type).
    pub bound: f64,
    /// Bytes this rank sent (to other ranks).
    pub bytes_sent: u64,
    /// Bytes the same exchange would send uncompressed with a ring all-reduce.
    pub bytes_uncompressed: u64,
}

/// Bytes each rank sends in a ring all-reduce of `nbytes` over `world` ranks: what every
/// compressed all-reduce is compared with.
pub fn ring_bytes(nbytes: u64, world: usize) -> u64 {
    let world = world.max(1) as u64;
    2 * (world - 1) * nbytes.div_ceil(world)
}

/// The options and buffer every rank must agree on, as sent in the agreement round.
fn descriptor<T: Element>(
    n: usize,
    opts: &AllReduceOptions,
    algorithm: Algorithm,
    feedback: bool,
) -> Vec<u8> {
    let (kind, value) = match opts.bound {
        Bound::Abs(e) => (0u8, e),
        Bound::Rel(r) => (1, r),
        Bound::Bits(b) => (2, b as f64),
    };
    let mut d = Vec::with_capacity(32);
    d.extend_from_slice(&(n as u64).to_le_bytes());
    d.push(T::DTYPE.size() as u8);
    // `T: Element` is one of the three float types.
    d.push(match T::DTYPE {
        crate::DType::F32 => 0,
        crate::DType::BF16 => 1,
        _ => 2,
    });
    d.push(kind);
    d.push(opts.average as u8);
    d.push(feedback as u8);
    d.extend_from_slice(&value.to_le_bytes());
    d.extend_from_slice(&opts.zstd_level.unwrap_or(0).to_le_bytes());
    d.push(algorithm as u8);
    debug_assert_eq!(d.len(), DESCRIPTOR_LEN);
    d
}

/// Starts what a rank sends in the agreement round when it refuses its input, followed by its
/// error message. A descriptor is [`DESCRIPTOR_LEN`] bytes; a refusal never is.
const REFUSAL: &[u8] = b"cfc: refused: ";
/// Bytes of [`descriptor`]'s output.
const DESCRIPTOR_LEN: usize = 26;
/// The most bytes of an error message a refusal carries.
const REFUSAL_MESSAGE_MAX: usize = 512;

/// What a refusing rank sends: [`REFUSAL`], then `reason` (cut to a character boundary), never
/// [`DESCRIPTOR_LEN`] bytes in all.
fn refusal(reason: &str) -> Vec<u8> {
    let mut d = REFUSAL.to_vec();
    d.extend_from_slice(cut_message(reason).as_bytes());
    if d.len() == DESCRIPTOR_LEN {
        d.push(b'.');
    }
    d
}

/// Starts what a rank sends in a data round in place of its frame when the call failed on it
/// after the agreement round, followed by the rank where the failure began (8 bytes, little
/// endian) and its error message. A frame starts with the format's magic, never with this.
const FAILURE: &[u8] = b"cfc: failed: ";

/// What a rank sends for a failure that began on rank `origin` with `reason`.
fn failure(origin: usize, reason: &str) -> Vec<u8> {
    let mut d = FAILURE.to_vec();
    d.extend_from_slice(&(origin as u64).to_le_bytes());
    d.extend_from_slice(cut_message(reason).as_bytes());
    d
}

/// `reason`'s first [`REFUSAL_MESSAGE_MAX`] bytes at most, cut to a character boundary: what
/// a refusal or a failure carries of an error message.
fn cut_message(reason: &str) -> &str {
    let mut cut = reason.len().min(REFUSAL_MESSAGE_MAX);
    while !reason.is_char_boundary(cut) {
        cut -= 1;
    }
    &reason[..cut]
}

/// The first failure among what the ranks sent, as (the rank where it began, its message).
/// The rank came from a peer: one past the group is reported as the sender.
fn first_failure(parts: &[Vec<u8>]) -> Option<(usize, String)> {
    parts.iter().enumerate().find_map(|(sender, d)| {
        let rest = d.strip_prefix(FAILURE)?;
        let (origin, reason) = rest.split_at_checked(8)?;
        let origin = u64::from_le_bytes(origin.try_into().ok()?);
        let origin = usize::try_from(origin)
            .ok()
            .filter(|&o| o < parts.len())
            .unwrap_or(sender);
        Some((origin, String::from_utf8_lossy(reason).into_owned()))
    })
}

/// The message of a peer's refusal, if `d` is one.
fn refused(d: &[u8]) -> Option<String> {
    (d.len() != DESCRIPTOR_LEN && d.starts_with(REFUSAL))
        .then(|| String::from_utf8_lossy(&d[REFUSAL.len()..]).into_owned())
}

/// The agreement round: every rank sends its descriptor (or, where `mine` is an error, a
/// refusal) and sees everyone's, so that all ranks fail alike. A refusing rank returns its own
/// error; the others [`Error::PeerRefused`], or [`Error::RankMismatch`] where descriptors differ.
fn agree<X: Transport + ?Sized>(transport: &mut X, mine: Result<Vec<u8>>) -> Result<()> {
    let mine = mine.map_err(|e| refused_with(transport, e))?;
    let all = transport.all_gather(mine)?;
    if let Some((rank, reason)) = all
        .iter()
        .enumerate()
        .find_map(|(j, d)| refused(d).map(|r| (j, r)))
    {
        return Err(Error::PeerRefused { rank, reason });
    }
    if let Some((peer, theirs)) = all.iter().enumerate().find(|(_, d)| **d != all[0]) {
        return Err(Error::RankMismatch {
            what: format!("rank 0 has {}", describe(&all[0])),
            theirs: format!("rank {peer} has {}", describe(theirs)),
        });
    }
    Ok(())
}

/// Takes part in the agreement round of an [`allreduce`] that this rank cannot run (its input
/// or options were refused before they reached [`allreduce`], e.g. by a binding's parsing,
/// for `reason`), so that its peers get [`Error::PeerRefused`] instead of waiting for it.
/// A failure of the round itself is not reported: the caller raises its own error.
pub fn refuse<X: Transport + ?Sized>(transport: &mut X, reason: &str) {
    let _ = transport.all_gather(refusal(reason));
}

/// [`refuse`] for `error`, which it returns.
fn refused_with<X: Transport + ?Sized>(transport: &mut X, error: Error) -> Error {
    refuse(transport, &error.to_string());
    error
}

/// A descriptor in words, for error messages. It came from a peer: nothing in it is trusted.
fn describe(d: &[u8]) -> String {
    let u64_at = |o: usize| {
        d.get(o..o + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    let byte = |o: usize| d.get(o).copied();
    match (
        u64_at(0),
        byte(9),
        byte(10),
        byte(11),
        byte(12),
        u64_at(13),
        byte(25),
    ) {
        (Some(n), Some(dt), Some(kind), Some(avg), Some(fb), Some(value), Some(alg)) => {
            let dtype = ["float32", "bfloat16", "float16"]
                .get(dt as usize)
                .unwrap_or(&"?");
            let bound = ["eps", "rel", "bits"].get(kind as usize).unwrap_or(&"?");
            let algorithm = ["reduce-scatter", "all-gather"]
                .get(alg as usize)
                .unwrap_or(&"?");
            format!(
                "{n} x {dtype}, {bound}={:e}, average={}, feedback={}, {algorithm}",
                f64::from_bits(value),
                avg != 0,
                fb != 0
            )
        }
        _ => format!("a malformed descriptor of {} bytes", d.len()),
    }
}

/// Shard `j` of `n` elements over `world` ranks: contiguous ranges cut at group boundaries.
fn shard(n: usize, world: usize, j: usize) -> std::ops::Range<usize> {
    let groups = n.div_ceil(GROUP);
    let per = groups.div_ceil(world.max(1));
    let lo = (j * per * GROUP).min(n);
    let hi = ((j + 1) * per * GROUP).min(n);
    lo..hi
}

/// Sums (or averages) `data` over all ranks of `transport`, compressed.
///
/// With `residual` (float32, one per element, zero at the first step), the error feedback of
/// [`compress_with_feedback`] is applied: what this rank's quantization drops is carried into its
/// next call, so that over many steps nothing is lost.
///
/// The residual is written only when the call succeeds: a call that fails (a peer gone, a bad
/// frame from a peer) leaves it as it was, so the error feedback a step dropped is not lost.
///
/// # Errors
/// [`Error::RankMismatch`] when ranks disagree on length, dtype or options, and
/// [`Error::PeerRefused`] when a rank refused its input (on every rank);
/// [`Error::PeerFailed`] on the others when the call failed on one rank after that (a frame
/// damaged on its way to it, memory running out), which returns its own error;
/// [`Error::InvalidBound`] for a bad bound; transport errors ([`Error::Timeout`],
/// [`Error::Transport`]); [`Error::ShapeMismatch`] for a residual of the wrong length.
pub fn allreduce<T: Element, X: Transport + ?Sized>(
    transport: &mut X,
    data: &[T],
    residual: Option<&mut [f32]>,
    opts: &AllReduceOptions,
) -> Result<(Vec<T>, AllReduceReport)> {
    let n = data.len();
    // 1. Agreement: everyone sees everyone's descriptor (or refusal), so everyone fails alike.
    let algorithm = opts.algorithm.unwrap_or(Algorithm::ReduceScatter);
    // The residual is worked on in a copy, put back once everything arrived and decoded; the
    // copy is made before the round, so that a rank without the memory refuses there.
    let describe_mine = || descriptor::<T>(n, opts, algorithm, residual.is_some());
    let (mine, scratch) = match residual.as_deref() {
        Some(r) if r.len() != n => (
            Err(Error::ShapeMismatch {
                shape_elements: Some(r.len() as u64),
                elements: n as u64,
                ndim: 1,
            }),
            None,
        ),
        Some(r) => match crate::error::try_capacity::<f32>(n) {
            Ok(mut copy) => {
                copy.extend_from_slice(r);
                (Ok(describe_mine()), Some(copy))
            }
            Err(e) => (Err(e), None),
        },
        None => (Ok(describe_mine()), None),
    };
    agree(transport, mine)?;
    match (residual, scratch) {
        (Some(r), Some(mut copy)) => {
            let done = agreed(transport, data, Some(&mut copy), opts, algorithm)?;
            r.copy_from_slice(&copy);
            Ok(done)
        }
        // (a residual always has its copy here: the round refused it otherwise)
        (r, _) => agreed(transport, data, r, opts, algorithm),
    }
}

/// Steps 2-6 of [`allreduce`], once every rank has agreed.
fn agreed<T: Element, X: Transport + ?Sized>(
    transport: &mut X,
    data: &[T],
    residual: Option<&mut [f32]>,
    opts: &AllReduceOptions,
    algorithm: Algorithm,
) -> Result<(Vec<T>, AllReduceReport)> {
    let (world, n) = (transport.world(), data.len());
    // 2. One step for everyone.
    let eps = match opts.bound {
        Bound::Abs(e) => e,
        Bound::Rel(rel) => {
            let local = crate::feedback::max_abs_compensated(data, residual.as_deref());
            let maxes = transport.all_gather(local.to_le_bytes().to_vec())?;
            let mut max = 0.0f64;
            for (peer, m) in maxes.iter().enumerate() {
                let bytes: [u8; 8] = m.as_slice().try_into().map_err(|_| {
                    Error::Transport(format!(
                        "rank {peer} sent {} bytes for its maximum",
                        m.len()
                    ))
                })?;
                max = max.max(f64::from_le_bytes(bytes));
            }
            if max > 0.0 {
                rel * max
            } else {
                rel
            }
        }
        Bound::Bits(_) => {
            return Err(Error::InvalidBound {
                what: "bits",
                reason: "a fixed rate cannot give every rank the same step; use eps or rel".into(),
            })
        }
    };
    let copts = CompressOptions {
        bound: Bound::Abs(eps),
        zstd_level: opts.zstd_level,
        threads: 0,
    };
    // An average is divided as the sum is decoded, with one rounding to `T` (see
    // `decode_summed`).
    let divisor = if opts.average { world as f64 } else { 1.0 };
    let (out, sent) = match algorithm {
        Algorithm::ReduceScatter => {
            reduce_scatter(transport, data, residual, opts, &copts, divisor)?
        }
        Algorithm::AllGather => all_gather(transport, data, residual, &copts, divisor)?,
    };
    let size = std::mem::size_of::<T>() as u64;
    let report = AllReduceReport {
        eps,
        bound: if opts.average {
            eps
        } else {
            eps * world as f64
        },
        bytes_sent: sent,
        bytes_uncompressed: ring_bytes(n as u64 * size, world),
    };
    Ok((out, report))
}

/// One frame of `data` with the shared step, through the residual when there is one.
fn quantize<T: Element>(
    data: &[T],
    residual: Option<&mut [f32]>,
    copts: &CompressOptions,
) -> Result<Vec<u8>> {
    match residual {
        Some(r) => compress_with_feedback(data, r, &[data.len()], copts),
        None => compress(data, &[data.len()], copts),
    }
}

/// The exact sum of the codes of frames received from the ranks (each checked as it is read),
/// its exceptions divided by `divisor` (see [`decode_summed`]).
fn sum_codes(frames: &[Vec<u8>], divisor: f64) -> Result<Codes> {
    let parts = frames
        .iter()
        .map(|f| Codes::from_frame(f))
        .collect::<Result<Vec<_>>>()?;
    Codes::sum_dividing_exceptions(&parts, divisor)
}

/// Appends the values of a summed frame of [`sum_codes`] to `out`, its codes divided by
/// `divisor` (the number of ranks for an average, else 1), and returns how many there were.
/// Each code's value `code * step` and its quotient are taken in f64 and rounded as the decode
/// rule rounds (to f32, then to `T`), and [`sum_codes`] divided the exceptions' totals before
/// rounding them: so an average is rounded to `T` once, never its sum first (an fp16 sum past
/// 65504 would be infinite, and a bf16 average over a world that is not a power of two would be
/// rounded twice). Such a frame is only ever read here: its exceptions hold averages.
fn decode_summed<T: Element>(frame: &[u8], divisor: f64, out: &mut Vec<T>) -> Result<u64> {
    if divisor == 1.0 {
        let (header, values) = decompress::<T>(frame)?;
        out.extend(values);
        return Ok(header.n);
    }
    let summed = Codes::from_frame(frame)?;
    if summed.dtype != T::DTYPE {
        return Err(Error::Incompatible {
            what: "dtype",
            left: T::DTYPE.name().into(),
            right: summed.dtype.name().into(),
        });
    }
    let start = out.len();
    out.try_reserve(summed.codes.len())
        .map_err(|_| Error::Allocation {
            bytes: (summed.codes.len() as u64).saturating_mul(std::mem::size_of::<T>() as u64),
        })?;
    let step = summed.step;
    out.extend(
        summed
            .codes
            .iter()
            .map(|&q| T::from_f32((q as f64 * step / divisor) as f32)),
    );
    for &(i, bits) in &summed.exceptions {
        // (`Codes::from_frame` checked every index against the element count)
        if let Some(v) = out.get_mut(start + i as usize) {
            *v = T::from_bits32(bits);
        }
    }
    Ok(summed.codes.len() as u64)
}

/// Steps 3-6 of [`allreduce`] as a reduce-scatter of codes and an all-gather of the sums.
/// Returns the sum and the bytes this rank sent.
fn reduce_scatter<T: Element, X: Transport + ?Sized>(
    transport: &mut X,
    data: &[T],
    mut residual: Option<&mut [f32]>,
    opts: &AllReduceOptions,
    copts: &CompressOptions,
    divisor: f64,
) -> Result<(Vec<T>, u64)> {
    let (world, rank, n) = (transport.world(), transport.rank(), data.len());
    // 3. Quantize once, shard by shard, and send shard j to rank j. From here on a failure
    // on this rank is sent in place of what it owes, and returned once the rounds are over.
    let mut failed_here: Option<Error> = None;
    let mut frames = Vec::with_capacity(world);
    for j in 0..world {
        let s = shard(n, world, j);
        let r = residual.as_deref_mut().map(|r| &mut r[s.clone()]);
        match quantize(&data[s], r, copts) {
            Ok(f) => frames.push(f),
            Err(e) => {
                frames = vec![failure(rank, &e.to_string()); world];
                failed_here = Some(e);
                break;
            }
        }
    }
    let mut sent: u64 = frames
        .iter()
        .enumerate()
        .filter(|(j, _)| *j != rank)
        .map(|(_, f)| f.len() as u64)
        .sum();
    let received = transport.all_to_all(frames)?;
    // 4. Sum this rank's shard exactly, as integer codes, and repack it losslessly (or pass
    // on a failure: this rank's own, or the first a peer sent).
    let summed = match (&failed_here, first_failure(&received)) {
        (Some(e), _) => failure(rank, &e.to_string()),
        (None, Some((origin, reason))) => failure(origin, &reason),
        (None, None) => {
            match sum_codes(&received, divisor).and_then(|c| c.to_frame(opts.zstd_level)) {
                Ok(frame) => frame,
                Err(e) => {
                    let sent_instead = failure(rank, &e.to_string());
                    failed_here = Some(e);
                    sent_instead
                }
            }
        }
    };
    // 5. Everyone gathers every summed shard and decodes.
    let summed_len = summed.len() as u64;
    let shards = transport.all_gather(summed)?;
    if let Some(e) = failed_here {
        return Err(e);
    }
    if let Some((rank, reason)) = first_failure(&shards) {
        return Err(Error::PeerFailed { rank, reason });
    }
    sent += summed_len * (world as u64 - 1);
    let decoded = (|| {
        let mut out = crate::error::try_capacity(n)?;
        for (j, frame) in shards.iter().enumerate() {
            let got = decode_summed(frame, divisor, &mut out)?;
            if got != shard(n, world, j).len() as u64 {
                return Err(Error::Transport(format!(
                    "rank {j} returned {got} elements for its shard of {}",
                    shard(n, world, j).len()
                )));
            }
        }
        Ok(out)
    })();
    let out = all_decoded(transport, decoded)?;
    Ok((out, sent))
}

/// What a rank sends in the closing round when it decoded its result (never empty: a transport
/// may not carry empty messages).
const DECODED: &[u8] = b"ok";

/// Step 6 of [`allreduce`], the closing round: every rank says whether it decoded its result
/// ([`DECODED`], or a failure), so that all ranks succeed or fail together: a frame
/// damaged on its way to one rank alone (each rank receives its own copy) fails every rank,
/// and none keeps the step. Returns this rank's result, its own error, or
/// [`Error::PeerFailed`].
fn all_decoded<T, X: Transport + ?Sized>(transport: &mut X, decoded: Result<T>) -> Result<T> {
    let rank = transport.rank();
    let status = match &decoded {
        Ok(_) => DECODED.to_vec(),
        Err(e) => failure(rank, &e.to_string()),
    };
    let statuses = transport.all_gather(status)?;
    let value = decoded?;
    if let Some((rank, reason)) = first_failure(&statuses) {
        return Err(Error::PeerFailed { rank, reason });
    }
    if let Some(j) = statuses.iter().position(|d| d != DECODED) {
        return Err(Error::Transport(format!(
            "rank {j} sent {} bytes for its status",
            statuses[j].len()
        )));
    }
    Ok(value)
}

/// Steps 3-6 of [`allreduce`] as an all-gather of whole frames, summed by every rank (in rank
/// order, exactly, as integer codes). Returns the sum and the bytes this rank sent.
fn all_gather<T: Element, X: Transport + ?Sized>(
    transport: &mut X,
    data: &[T],
    residual: Option<&mut [f32]>,
    copts: &CompressOptions,
    divisor: f64,
) -> Result<(Vec<T>, u64)> {
    let (world, rank, n) = (transport.world(), transport.rank(), data.len());
    // A failure to quantize is sent in place of the frame, so that no peer keeps the step.
    let (frame, failed_here) = match quantize(data, residual, copts) {
        Ok(frame) => (frame, None),
        Err(e) => (failure(rank, &e.to_string()), Some(e)),
    };
    let sent = frame.len() as u64 * (world as u64 - 1);
    let frames = transport.all_gather(frame)?;
    if let Some(e) = failed_here {
        return Err(e);
    }
    if let Some((rank, reason)) = first_failure(&frames) {
        return Err(Error::PeerFailed { rank, reason });
    }
    // (each rank received its own copy of the frames: one damaged on its way to one rank
    // fails that rank alone, which the closing round tells the others)
    let decoded = (|| {
        let summed = sum_codes(&frames, divisor)?.to_frame(None)?;
        let mut values = crate::error::try_capacity(n)?;
        let got = decode_summed(&summed, divisor, &mut values)?;
        if got != n as u64 {
            return Err(Error::Transport(format!(
                "the ranks' frames hold {got} elements, this rank's buffer {n}"
            )));
        }
        Ok(values)
    })();
    let values = all_decoded(transport, decoded)?;
    Ok((values, sent))
}

/// [`allreduce`] over raw little-endian bytes of `dtype` (any alignment) and a float32 residual
/// given as bytes (4-byte aligned, updated in place); returns the result's bytes.
///
/// # Errors
/// As [`allreduce`], plus [`Error::MisalignedInput`] for bytes that are not whole elements or a
/// residual that is not whole, aligned float32 values, and [`Error::NotQuantizable`] for a
/// dtype other than the three float types (refused in the agreement round, as in [`allreduce`]).
pub fn allreduce_bytes<X: Transport + ?Sized>(
    transport: &mut X,
    bytes: &[u8],
    dtype: crate::DType,
    residual: Option<&mut [u8]>,
    opts: &AllReduceOptions,
) -> Result<(Vec<u8>, AllReduceReport)> {
    use crate::codec::elements;
    use half::{bf16, f16};
    let residual = match residual.map(crate::feedback::residual_f32).transpose() {
        Ok(r) => r,
        Err(e) => return Err(refused_with(transport, e)),
    };
    fn go<T: Element, X: Transport + ?Sized>(
        t: &mut X,
        bytes: &[u8],
        residual: Option<&mut [f32]>,
        opts: &AllReduceOptions,
    ) -> Result<(Vec<u8>, AllReduceReport)> {
        let data = match elements::<T>(bytes) {
            Ok(d) => d,
            Err(e) => return Err(refused_with(t, e)),
        };
        let (values, report) = allreduce(t, &data, residual, opts)?;
        Ok((bytemuck::cast_slice(&values).to_vec(), report))
    }
    match dtype {
        crate::DType::F32 => go::<f32, X>(transport, bytes, residual, opts),
        crate::DType::BF16 => go::<bf16, X>(transport, bytes, residual, opts),
        crate::DType::F16 => go::<f16, X>(transport, bytes, residual, opts),
        other => Err(refused_with(transport, Error::NotQuantizable(other))),
    }
}

/// The in-process transport: ranks are threads of one process, linked by crossbeam channels.
/// For tests, examples and the CPU benchmark; it runs the very algorithm the NCCL transport runs.
pub struct InProcess {
    rank: usize,
    to: Vec<crossbeam_channel::Sender<Vec<u8>>>,
    from: Vec<crossbeam_channel::Receiver<Vec<u8>>>,
    timeout: Duration,
}

impl InProcess {
    /// Endpoints for `world` ranks (hand one to each thread). A receive that waits longer than
    /// `timeout` fails with [`Error::Timeout`].
    pub fn group(world: usize, timeout: Duration) -> Vec<InProcess> {
        // channels[a][b]: messages from rank a to rank b.
        let channels: Vec<Vec<_>> = (0..world)
            .map(|_| (0..world).map(|_| crossbeam_channel::unbounded()).collect())
            .collect();
        (0..world)
            .map(|rank| InProcess {
                rank,
                to: (0..world).map(|b| channels[rank][b].0.clone()).collect(),
                from: (0..world).map(|a| channels[a][rank].1.clone()).collect(),
                timeout,
            })
            .collect()
    }
}

impl Transport for InProcess {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.to.len()
    }

    fn all_to_all(&mut self, parts: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        if parts.len() != self.to.len() {
            return Err(Error::Transport(format!(
                "{} parts for {} ranks",
                parts.len(),
                self.to.len()
            )));
        }
        for (peer, (tx, part)) in self.to.iter().zip(parts).enumerate() {
            tx.send(part)
                .map_err(|_| Error::Transport(format!("rank {peer} is gone")))?;
        }
        self.from
            .iter()
            .enumerate()
            .map(|(peer, rx)| {
                rx.recv_timeout(self.timeout).map_err(|e| match e {
                    crossbeam_channel::RecvTimeoutError::Timeout => Error::Timeout {
                        peer,
                        seconds: self.timeout.as_secs_f64(),
                    },
                    crossbeam_channel::RecvTimeoutError::Disconnected => {
                        Error::Transport(format!("rank {peer} is gone"))
                    }
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_from_peers_are_not_trusted() {
        assert_eq!(describe(&[1, 2, 3]), "a malformed descriptor of 3 bytes");
        let d = descriptor::<f32>(
            1000,
            &AllReduceOptions {
                bound: Bound::Rel(0.5),
                average: true,
                zstd_level: None,
                algorithm: None,
            },
            Algorithm::AllGather,
            true,
        );
        assert_eq!(
            describe(&d),
            "1000 x float32, rel=5e-1, average=true, feedback=true, all-gather"
        );
        let mut bad = d.clone();
        bad[9] = 200;
        assert!(describe(&bad).contains("? x") || describe(&bad).contains("x ?"));
    }

    #[test]
    fn a_refusal_is_never_taken_for_a_descriptor_nor_one_for_a_refusal() {
        for reason in [
            "",
            "x",
            &"x".repeat(DESCRIPTOR_LEN - REFUSAL.len()),
            &"é".repeat(400),
        ] {
            let r = refusal(reason);
            assert_ne!(r.len(), DESCRIPTOR_LEN, "{reason:?}");
            let back = refused(&r).expect("a refusal");
            // (the message cut to its limit, or given one more byte to keep off 26 in all)
            let cut = back.strip_suffix('.').unwrap_or(&back);
            assert!(
                reason.starts_with(cut) && cut.len() <= REFUSAL_MESSAGE_MAX,
                "{reason:?}"
            );
        }
        let mut d = descriptor::<f32>(
            1000,
            &AllReduceOptions {
                bound: Bound::Abs(1e-3),
                average: false,
                zstd_level: None,
                algorithm: None,
            },
            Algorithm::ReduceScatter,
            false,
        );
        assert_eq!(d.len(), DESCRIPTOR_LEN);
        assert!(refused(&d).is_none());
        d[..REFUSAL.len()].copy_from_slice(REFUSAL); // even one that begins like a refusal
        assert!(refused(&d).is_none());
    }

    #[test]
    fn shards_cover_the_buffer_at_group_boundaries() {
        for (n, world) in [(0, 3), (1, 4), (100, 3), (10_007, 8), (64, 8)] {
            let mut next = 0;
            for j in 0..world {
                let s = shard(n, world, j);
                assert_eq!(s.start, next);
                assert!(s.start % GROUP == 0 || s.start == n);
                next = s.end;
            }
            assert_eq!(next, n);
        }
    }
}
