//! What every rank of an engine must agree on, and its encoding for the agreement round.

use crate::engine::topology::Topology;
use crate::error::{Error, Result};
use crate::Coder;
use std::time::Duration;

/// How each rank's quantization step is set. Every rank quantizes with the same step, so that
/// integer codes add exactly.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BoundRule {
    /// A fixed absolute bound `eps` per element.
    Abs(f64),
    /// `k` times the root mean square of the bucket's finite values (gradient plus residual,
    /// over every rank) at the bucket's previous exchange; at its first, of this exchange
    /// (which then waits for one small round).
    Rms(f64),
    /// `r` times the largest finite magnitude (over every rank) at the bucket's previous
    /// exchange, as [`BoundRule::Rms`] does; below 1.
    Rel(f64),
}

impl BoundRule {
    /// The kind's name, as options and messages spell it.
    pub fn name(&self) -> &'static str {
        match self {
            BoundRule::Abs(_) => "eps",
            BoundRule::Rms(_) => "rms",
            BoundRule::Rel(_) => "rel",
        }
    }

    /// The kind's code in the agreement round and in checkpoints: the one place the bound
    /// kinds are numbered.
    pub fn code(&self) -> u8 {
        match self {
            BoundRule::Abs(_) => 0,
            BoundRule::Rms(_) => 1,
            BoundRule::Rel(_) => 2,
        }
    }

    /// Its value (`eps`, `k` or `r`).
    pub fn value(&self) -> f64 {
        match *self {
            BoundRule::Abs(v) | BoundRule::Rms(v) | BoundRule::Rel(v) => v,
        }
    }

    /// Whether the step follows the data (and so is measured at every exchange).
    pub(crate) fn follows_data(&self) -> bool {
        !matches!(self, BoundRule::Abs(_))
    }

    /// The absolute bound for a bucket of `n` elements on each of `world` ranks whose
    /// statistics over all ranks are `sum_squares` and `max_abs`. Where they give no positive
    /// finite bound (all zeros, an overflow), any positive one will do: 1e-30.
    pub(crate) fn eps(&self, sum_squares: f64, max_abs: f64, n: u64, world: usize) -> f64 {
        let eps = match *self {
            BoundRule::Abs(e) => return e,
            BoundRule::Rms(k) => k * (sum_squares / (n.max(1) as f64 * world.max(1) as f64)).sqrt(),
            BoundRule::Rel(r) => r * max_abs,
        };
        if eps.is_finite() && eps >= MIN_EPS {
            eps.min(MAX_EPS)
        } else {
            1e-30
        }
    }
}

pub(crate) use crate::codec::bounded::{MAX_EPS, MIN_EPS};

/// How a compressed bucket moves between the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// Every rank's frame to every rank, each decoding all of them: one exchange of `N - 1`
    /// times the compressed size per rank.
    AllGather,
    /// Each rank owns a shard: it receives every rank's frame of its shard, sums their codes
    /// exactly and sends the sum on to every rank; about `2 (N - 1) / N` times the compressed
    /// size per rank, in two exchanges.
    ReduceScatter,
}

impl Algorithm {
    /// The name options and messages use.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::AllGather => "all-gather",
            Algorithm::ReduceScatter => "reduce-scatter",
        }
    }

    /// The algorithm for `world` ranks when none is chosen: the all-gather up to 2 ranks (8%
    /// fewer bytes there, one exchange), the reduce-scatter from 3.
    pub fn for_world(world: usize) -> Algorithm {
        if world <= 2 {
            Algorithm::AllGather
        } else {
            Algorithm::ReduceScatter
        }
    }
}

/// When a bucket goes out uncompressed, through the transport's own all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// Always compress (after the warm-up).
    Never,
    /// Never compress: e.g. to compare, or where compression cannot pay.
    Always,
    /// Time both ways for `trial_steps` steps after the warm-up (alternating, compressed
    /// first), then keep for each bucket the way whose slowest rank's best time was lower.
    Auto {
        /// Steps of the trial, half of them of each way (an even number, at least 2).
        trial_steps: u32,
    },
}

/// The longest timeout an engine takes (the waits that allow for twice it stay finite).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(30 * 86_400);
/// The shortest timeout an engine takes: below it, a busy host's scheduling alone fails waits.
pub const MIN_TIMEOUT: Duration = Duration::from_millis(100);

/// A timeout of `seconds`, checked: the one place the range of timeouts is enforced.
///
/// # Errors
/// [`Error::Transport`] outside [`MIN_TIMEOUT`]..=[`MAX_TIMEOUT`] (NaN included).
pub fn timeout_from_seconds(seconds: f64) -> Result<Duration> {
    let range = MIN_TIMEOUT.as_secs_f64()..=MAX_TIMEOUT.as_secs_f64();
    if !range.contains(&seconds) {
        return Err(Error::Transport(format!(
            "the timeout must lie between {} s and {} days, got {seconds} s",
            MIN_TIMEOUT.as_secs_f64(),
            MAX_TIMEOUT.as_secs() / 86_400
        )));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// The options of an engine. Every rank must give the same ones (checked when the engine
/// starts: ranks that differ all get [`Error::RankMismatch`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// The quantization step.
    pub bound: BoundRule,
    /// Whether jobs carry error-feedback residuals.
    pub error_feedback: bool,
    /// The exchange; `None`: [`Algorithm::for_world`].
    pub algorithm: Option<Algorithm>,
    /// When to send buckets uncompressed.
    pub fallback: Fallback,
    /// Steps (counted by jobs marked `last`) sent uncompressed first, residuals untouched:
    /// DDP rebuilds its buckets after its first step.
    pub warmup_steps: u32,
    /// Buckets with fewer elements always go uncompressed (compressing them costs more than
    /// the bytes it saves).
    pub min_compress_numel: u64,
    /// How long any wait for a peer may last before the engine fails.
    pub timeout: Duration,
    /// Flat, or plain inside nodes and compressed between them (see `engine/topology.rs`).
    pub topology: Topology,
    /// How frames that are decoded where they arrive write their codes (bit planes or Rice
    /// codes): the all-gather's, and reduce-scatter jobs' (FSDP's). An all-reduce's shards,
    /// summed on the way, stay bit planes.
    pub coder: Coder,
    /// Block scales: with [`BoundRule::Rms`], each block of this many elements (a power of two,
    /// 32 to 2^24) of a bucket gets its own step, `k` times the block's RMS (the largest rank's,
    /// rounded down to a power of two) at the bucket's last exchange, whose rows carry it; at a
    /// bucket's first compressed step, agreed in a round of its own (see
    /// `engine/block_scales.rs`). 0: one step per bucket, from its RMS at its last exchange.
    pub block: u64,
    /// The options of `cfc.fsdp`'s calls, for an engine that runs them (`None` for DDP's
    /// buckets and `AllReducer`'s).
    pub fsdp: Option<FsdpOptions>,
}

/// The options of `cfc.fsdp`'s calls. `cfc.fsdp` applies them; the engine agrees them between
/// ranks with the others (ranks that keep residuals differently would resume differently) and
/// names them in its errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsdpOptions {
    /// Bits per value of the residuals kept between calls: 32 (float32) or 4 (packed).
    pub residual_bits: u8,
    /// With [`Fallback::Auto`], the trial's ways are checked over whole steps (see
    /// `engine/step_check.rs`): the reduce-scatters' engine, not the replicas'.
    pub step_check: bool,
}

impl Options {
    /// Options with `bound`, error feedback, the algorithm chosen by rank count, no fallback,
    /// no warm-up, buckets from 16384 elements, a timeout of 300 s, the topology chosen by the
    /// nodes.
    pub fn new(bound: BoundRule) -> Options {
        Options {
            bound,
            error_feedback: true,
            algorithm: None,
            fallback: Fallback::Never,
            warmup_steps: 0,
            min_compress_numel: 16384,
            timeout: Duration::from_secs(300),
            topology: Topology::Auto,
            coder: Coder::Planes,
            block: 0,
            fsdp: None,
        }
    }

    /// `log2` of [`Options::block`] (0 without block scales).
    pub fn block_log2(&self) -> u8 {
        if self.block == 0 {
            0
        } else {
            self.block.trailing_zeros() as u8
        }
    }

    /// Checks every value.
    ///
    /// # Errors
    /// [`Error::InvalidBound`] for a bound that is not positive and finite, a `rel` of 1 or
    /// more, an `eps` outside what the codec takes; [`Error::Transport`] for an odd or short
    /// trial, or a timeout outside [`MIN_TIMEOUT`]..=[`MAX_TIMEOUT`].
    pub fn check(&self) -> Result<()> {
        let v = self.bound.value();
        if !(v.is_finite() && v > 0.0) {
            return Err(Error::InvalidBound {
                what: self.bound.name(),
                reason: format!("must be positive and finite, got {v}"),
            });
        }
        match self.bound {
            BoundRule::Rel(r) if r >= 1.0 => {
                return Err(Error::InvalidBound {
                    what: "rel",
                    reason: format!("must be below 1 (every value would round to 0), got {r}"),
                })
            }
            BoundRule::Abs(e) if !(MIN_EPS..=MAX_EPS).contains(&e) => {
                return Err(Error::InvalidBound {
                    what: "eps",
                    reason: format!("must lie between {MIN_EPS:e} and {MAX_EPS:e}, got {e}"),
                })
            }
            _ => {}
        }
        if self.block != 0 {
            let (lo, hi) = (
                1u64 << crate::scales::MIN_BLOCK_LOG2,
                1u64 << crate::scales::MAX_BLOCK_LOG2,
            );
            if !matches!(self.bound, BoundRule::Rms(k) if k < 1.0) {
                return Err(Error::InvalidBound {
                    what: "block",
                    reason: format!(
                        "block scales follow each block's RMS: they take rms= below 1, not {}={}",
                        self.bound.name(),
                        self.bound.value()
                    ),
                });
            }
            if !self.block.is_power_of_two() || !(lo..=hi).contains(&self.block) {
                return Err(Error::InvalidBound {
                    what: "block",
                    reason: format!(
                        "must be a power of two from {lo} to {hi} (or 0 for none), got {}",
                        self.block
                    ),
                });
            }
        }
        if let Fallback::Auto { trial_steps } = self.fallback {
            if trial_steps < 2 || trial_steps % 2 == 1 {
                return Err(Error::Transport(format!(
                    "the trial takes an even number of steps, at least 2; got {trial_steps}"
                )));
            }
        }
        if let Some(f) = self.fsdp {
            if f.residual_bits != 32 && f.residual_bits != 4 {
                return Err(Error::Transport(format!(
                    "residual_bits must be 32 or 4, got {}",
                    f.residual_bits
                )));
            }
        }
        timeout_from_seconds(self.timeout.as_secs_f64())?;
        Ok(())
    }

    /// The algorithm the engine runs among `world` ranks.
    pub fn algorithm_for(&self, world: usize) -> Algorithm {
        self.algorithm.unwrap_or(Algorithm::for_world(world))
    }

    /// Whether the trial's ways are checked over whole steps (`engine/step_check.rs`).
    pub(crate) fn checks_steps(&self) -> bool {
        self.trial_steps() > 0 && self.fsdp.is_some_and(|f| f.step_check)
    }

    /// Steps of the trial (0 without [`Fallback::Auto`]).
    pub(crate) fn trial_steps(&self) -> u64 {
        match self.fallback {
            Fallback::Auto { trial_steps } => trial_steps as u64,
            _ => 0,
        }
    }
}

/// Bytes of [`descriptor`]'s output.
pub(crate) const DESCRIPTOR_LEN: usize = 64;
/// The descriptor's version: bumped whenever its layout changes.
const DESCRIPTOR_VERSION: u8 = 5;

/// What every rank sends in the agreement round: the options that order or size the
/// collectives, the world, and `token` (the caller's: e.g. which checkpoint it resumed from).
/// The timeout is left out: ranks may wait for different times. `nodes` is a hash of the ranks'
/// nodes (ranks that see them differently would build different groups).
/// `two_level`: whether this rank plans the two-level exchange (ranks whose NCCL can split and
/// ranks whose cannot would otherwise wait for each other).
pub(crate) fn descriptor(
    o: &Options,
    world: usize,
    token: u64,
    nodes: u64,
    two_level: bool,
) -> Vec<u8> {
    let mut d = Vec::with_capacity(DESCRIPTOR_LEN);
    d.push(DESCRIPTOR_VERSION);
    d.push(o.bound.code());
    d.push(o.error_feedback as u8);
    d.push(match o.algorithm {
        None => 0,
        Some(Algorithm::AllGather) => 1,
        Some(Algorithm::ReduceScatter) => 2,
    });
    let (fallback, trial) = match o.fallback {
        Fallback::Never => (0u8, 0u32),
        Fallback::Always => (1, 0),
        Fallback::Auto { trial_steps } => (2, trial_steps),
    };
    d.push(fallback);
    d.push(o.topology.code());
    d.push(two_level as u8);
    d.push(match o.coder {
        Coder::Planes => 0,
        Coder::Rice => 1,
    });
    d.extend_from_slice(&o.bound.value().to_le_bytes());
    d.extend_from_slice(&trial.to_le_bytes());
    d.extend_from_slice(&o.warmup_steps.to_le_bytes());
    d.extend_from_slice(&o.min_compress_numel.to_le_bytes());
    d.extend_from_slice(&(world as u64).to_le_bytes());
    d.extend_from_slice(&token.to_le_bytes());
    d.extend_from_slice(&nodes.to_le_bytes());
    d.push(o.block_log2());
    match o.fsdp {
        None => d.extend_from_slice(&[0, 0]),
        Some(f) => d.extend_from_slice(&[1 | (f.step_check as u8) << 1, f.residual_bits]),
    }
    d.extend_from_slice(&[0u8; 5]);
    debug_assert_eq!(d.len(), DESCRIPTOR_LEN);
    d
}

/// A descriptor in words, for error messages. It came from a peer: nothing in it is trusted.
pub(crate) fn describe(d: &[u8]) -> String {
    let u32_at = |o: usize| {
        d.get(o..o + 4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
    };
    let u64_at = |o: usize| {
        d.get(o..o + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    if d.len() != DESCRIPTOR_LEN || d[0] != DESCRIPTOR_VERSION {
        return format!("a descriptor of {} bytes this version cannot read", d.len());
    }
    let bound = ["eps", "rms", "rel"].get(d[1] as usize).unwrap_or(&"?");
    let algorithm = ["by rank count", "all-gather", "reduce-scatter"]
        .get(d[3] as usize)
        .unwrap_or(&"?");
    let fallback = match d[4] {
        0 => "never".to_string(),
        1 => "always".to_string(),
        2 => format!("auto ({} trial steps)", u32_at(16).unwrap_or(0)),
        _ => "?".to_string(),
    };
    let topology = ["auto", "flat", "two-level"]
        .get(d[5] as usize)
        .unwrap_or(&"?");
    let planned = if d[6] != 0 { "two levels" } else { "flat" };
    let coder = ["planes", "rice"].get(d[7] as usize).unwrap_or(&"?");
    let block = match d[56] {
        0 => "none".to_string(),
        b if b < 64 => format!("{}", 1u64 << b),
        b => format!("2^{b}?"),
    };
    let fsdp = match d[57] {
        0 => "no".to_string(),
        f => format!(
            "{}-bit residuals, step check {}",
            d[58],
            if f & 2 != 0 { "on" } else { "off" }
        ),
    };
    format!(
        "{bound}={:e}, error feedback {}, algorithm {algorithm}, fallback {fallback}, \
         warm-up {} steps, min_compress_numel {}, {} ranks, token {:#x}, topology \
         {topology} ({planned}), nodes {:#x}, coder {coder}, block {block}, fsdp {fsdp}",
        f64::from_bits(u64_at(8).unwrap_or(0)),
        if d[2] != 0 { "on" } else { "off" },
        u32_at(20).unwrap_or(0),
        u64_at(24).unwrap_or(0),
        u64_at(32).unwrap_or(0),
        u64_at(40).unwrap_or(0),
        u64_at(48).unwrap_or(0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_say_what_differs_and_distrust_peers() {
        let mut o = Options::new(BoundRule::Rms(0.3));
        o.fallback = Fallback::Auto { trial_steps: 4 };
        let d = descriptor(&o, 4, 7, 0, false);
        assert_eq!(d.len(), DESCRIPTOR_LEN);
        let said = describe(&d);
        assert!(said.contains("rms=3e-1"), "{said}");
        assert!(said.contains("auto (4 trial steps)"), "{said}");
        assert!(said.contains("4 ranks"), "{said}");
        assert!(said.contains("topology auto"), "{said}");
        assert!(describe(&d[..5]).contains("5 bytes"));
        let mut bad = d.clone();
        bad[1] = 9;
        assert!(describe(&bad).starts_with("?="));
        o.warmup_steps = 1;
        assert_ne!(descriptor(&o, 4, 7, 0, false), d);
        assert_ne!(
            descriptor(&o, 4, 7, 1, false),
            descriptor(&o, 4, 7, 0, false)
        );
        assert_ne!(
            descriptor(&o, 4, 7, 0, true),
            descriptor(&o, 4, 7, 0, false)
        );
        o.warmup_steps = 0;
        o.topology = Topology::Flat;
        assert!(describe(&descriptor(&o, 4, 7, 0, false)).contains("topology flat (flat)"));
        let planes = descriptor(&o, 4, 7, 0, false);
        o.coder = Coder::Rice;
        let rice = descriptor(&o, 4, 7, 0, false);
        assert_ne!(
            planes, rice,
            "ranks that write their codes differently must disagree"
        );
        assert!(
            describe(&rice).ends_with("coder rice, block none, fsdp no"),
            "{}",
            describe(&rice)
        );
        o.block = 256;
        let blocks = descriptor(&o, 4, 7, 0, false);
        assert_ne!(blocks, rice, "ranks with other block scales must disagree");
        assert!(
            describe(&blocks).ends_with("block 256, fsdp no"),
            "{}",
            describe(&blocks)
        );
        // cfc.fsdp's options: each of them set apart ranks
        let mut seen = vec![blocks];
        for (residual_bits, step_check) in [(32, false), (4, false), (4, true)] {
            o.fsdp = Some(FsdpOptions {
                residual_bits,
                step_check,
            });
            let d = descriptor(&o, 4, 7, 0, false);
            assert!(!seen.contains(&d), "{residual_bits} {step_check}");
            seen.push(d);
        }
        assert!(
            describe(&seen[3]).ends_with("fsdp 4-bit residuals, step check on"),
            "{}",
            describe(&seen[3])
        );
    }

    #[test]
    fn options_are_checked() {
        assert!(Options::new(BoundRule::Rel(1.0)).check().is_err());
        assert!(Options::new(BoundRule::Abs(0.0)).check().is_err());
        assert!(Options::new(BoundRule::Rms(f64::NAN)).check().is_err());
        let mut o = Options::new(BoundRule::Abs(1e-3));
        o.fallback = Fallback::Auto { trial_steps: 3 };
        assert!(o.check().is_err());
        o.fallback = Fallback::Auto { trial_steps: 2 };
        assert!(o.check().is_ok());
        o.fsdp = Some(FsdpOptions {
            residual_bits: 8,
            step_check: false,
        });
        assert!(o.check().unwrap_err().to_string().contains("residual_bits"));
        o.fsdp = None;
        // a timeout whose double would overflow a wait is refused, not a panic later
        o.timeout = Duration::from_secs(u64::MAX / 2);
        assert!(o.check().unwrap_err().to_string().contains("30 days"));
        o.timeout = MAX_TIMEOUT;
        assert!(o.check().is_ok());
        o.timeout = Duration::from_nanos(1);
        assert!(o.check().unwrap_err().to_string().contains("0.1 s"));
        o.timeout = MAX_TIMEOUT;
        // block scales: rms only, a power of two from 32 to 2^24
        o.block = 256;
        assert!(o.check().unwrap_err().to_string().contains("rms="));
        o.bound = BoundRule::Rms(0.3);
        assert!(o.check().is_ok());
        for bad in [16u64, 100, 1 << 25] {
            o.block = bad;
            assert!(o.check().is_err(), "{bad}");
        }
        o.bound = BoundRule::Rms(1.5);
        o.block = 256;
        assert!(o.check().is_err());
        assert!(timeout_from_seconds(f64::NAN).is_err());
        assert!(timeout_from_seconds(1e12).is_err());
        assert_eq!(
            timeout_from_seconds(2.5).unwrap(),
            Duration::from_millis(2500)
        );
    }

    #[test]
    fn bounds_from_statistics_are_usable() {
        let rms = BoundRule::Rms(0.5);
        // 4 elements on each of 2 ranks, all 2.0: sum of squares 32, RMS 2.
        assert_eq!(rms.eps(32.0, 2.0, 4, 2), 1.0);
        assert_eq!(rms.eps(0.0, 0.0, 4, 2), 1e-30);
        assert_eq!(rms.eps(f64::INFINITY, 0.0, 4, 2), 1e-30);
        assert_eq!(BoundRule::Rel(0.1).eps(0.0, 3.0, 4, 2), 0.30000000000000004);
        assert_eq!(BoundRule::Abs(0.25).eps(1.0, 1.0, 1, 1), 0.25);
    }
}
