//! Rows: how a frame travels. Frame sizes depend on the data and collectives want lengths both
//! sides know in advance, so each frame travels in a *row*: a head of [`HEAD`] bytes, then
//! `slot` bytes of the frame, where the slot comes from the bucket's earlier frames
//! ([`Slot`]). The head holds the frame's size, so once the heads are on the host, every
//! rank knows whether a frame outgrew its slot; such a frame's bytes past the slot then go in a
//! second exchange (`tails.rs`; the first exchange of a bucket has a slot of 0: heads only, then
//! the frames). The head also carries
//! the sender's statistics (for the next step's bound) and a check word: ranks whose jobs do not
//! match (another bucket, another step) fail at once instead of reading each other's bytes.
//! With block scales the head is followed by the sender's block exponents, padded to 16 bytes,
//! and the frame comes after them (the next step's scales: `block_scales.rs`).

use crate::error::{Error, Result};
use crate::format::FIXED_HEADER_LEN;

/// Bytes before each frame in a row (a multiple of 16, so that frames stay 16-byte aligned).
pub(crate) const HEAD: u64 = 32;
/// Offsets in a head: the frame's size (u64), the statistics (two f64: sum of squares, largest
/// magnitude) and the check word (u64).
pub(crate) const SIZE_AT: u64 = 0;
pub(crate) const STATS_AT: u64 = 8;
pub(crate) const CHECK_AT: u64 = 24;

/// The smallest frame of one dimension: its header.
pub(crate) const MIN_FRAME: u64 = FIXED_HEADER_LEN as u64 + 8;

/// One head, as read on the host.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Head {
    pub size: u64,
    pub sum_squares: f64,
    pub max_abs: f64,
    pub check: u64,
}

/// The heads of `count` rows fetched as [`HEAD`] bytes each.
pub(crate) fn heads(bytes: &[u8], count: usize) -> Result<Vec<Head>> {
    if bytes.len() != count * HEAD as usize {
        return Err(Error::Transport(format!(
            "internal: {} bytes of heads for {count} rows",
            bytes.len()
        )));
    }
    let word = |h: &[u8], at: u64| {
        let at = at as usize;
        u64::from_le_bytes(h[at..at + 8].try_into().unwrap_or([0; 8]))
    };
    Ok(bytes
        .chunks_exact(HEAD as usize)
        .map(|h| Head {
            size: word(h, SIZE_AT),
            sum_squares: f64::from_bits(word(h, STATS_AT)),
            max_abs: f64::from_bits(word(h, STATS_AT + 8)),
            check: word(h, CHECK_AT),
        })
        .collect())
}

/// Heads fetched with `extra` bytes after each (rows fetched as `HEAD + extra` bytes: the
/// exponents of block scales), and those bytes of each row.
pub(crate) fn split_heads(
    bytes: &[u8],
    count: usize,
    extra: u64,
) -> Result<(Vec<Head>, Vec<&[u8]>)> {
    let width = (HEAD + extra) as usize;
    if bytes.len() != count * width {
        return Err(Error::Transport(format!(
            "internal: {} bytes of heads for {count} rows of {width}",
            bytes.len()
        )));
    }
    let mut heads = Vec::with_capacity(count * HEAD as usize);
    let mut extras = Vec::with_capacity(count);
    for row in bytes.chunks_exact(width) {
        heads.extend_from_slice(&row[..HEAD as usize]);
        extras.push(&row[HEAD as usize..]);
    }
    Ok((self::heads(&heads, count)?, extras))
}

/// Fails unless every head's check word is `check` and its size lies in `MIN_FRAME..=cap`
/// (what `from` the ranks sent: "rank", or "rank ... for its shard").
pub(crate) fn check_heads(heads: &[(usize, Head)], check: u64, cap: u64, what: &str) -> Result<()> {
    for (rank, h) in heads {
        if h.check != check {
            return Err(Error::RankMismatch {
                what: format!("this rank's job has check word {check:#018x}"),
                theirs: format!(
                    "rank {rank} sent {what} with check word {:#018x} (the ranks are not \
                     running the same bucket of the same step)",
                    h.check
                ),
            });
        }
        if h.size < MIN_FRAME || h.size > cap {
            return Err(Error::Transport(format!(
                "rank {rank} sent {what} of {} bytes, where a frame takes {MIN_FRAME} to {cap}",
                h.size
            )));
        }
    }
    Ok(())
}

/// `x` rounded up to a multiple of 16.
pub(crate) fn round16(x: u64) -> u64 {
    x.div_ceil(16) * 16
}

/// A slot: the frame bytes a row of a bucket's next exchange carries, sized from the largest
/// frame of its last one with a margin above it, and that margin.
///
/// Bytes of the margin that a frame does not fill travel for nothing, every step; a frame that
/// outgrows its slot costs a second round for its tail (`tails.rs`), not bytes. So the margin
/// follows the bucket: it doubles (up to a quarter) after an exchange whose frame outgrew its
/// slot, and shrinks by 1/64 (down to 1/64) after each that fit: a bucket whose frames barely
/// change sends little slack, one whose frames swing takes few second rounds. Every rank that
/// sizes a slot sees the same frame sizes, so all of them size it alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot {
    /// Frame bytes (a multiple of 16); 0 before the bucket's first exchange.
    pub bytes: u64,
    /// The margin, in 64ths of the largest frame.
    margin: u64,
}

impl Slot {
    /// Bounds of the margin, in 64ths, and where it starts.
    const MIN: u64 = 1;
    const MAX: u64 = 16;
    const START: u64 = 8;
    /// Bytes above the margin (small frames vary by more than their share).
    const FLOOR: u64 = 256;

    pub fn new() -> Slot {
        Slot {
            bytes: 0,
            margin: Slot::START,
        }
    }

    /// The slot after an exchange whose largest frame took `largest` bytes, at most
    /// `capacity`: its margin above that frame, moved by whether the frame outgrew this slot.
    pub fn follow(&mut self, largest: u64, capacity: u64) {
        if self.bytes > 0 {
            self.margin = if largest > self.bytes {
                (2 * self.margin).min(Slot::MAX)
            } else {
                (self.margin - 1).max(Slot::MIN)
            };
        }
        let bytes = largest + largest * self.margin / 64 + Slot::FLOOR;
        self.bytes = round16(bytes).min(round16(capacity));
    }
}

/// The check word of a job: the engine's job number and the job's key, fingerprint, element
/// count, dtype and kind, mixed (FNV-1a over their bytes).
pub(crate) fn check_word(fields: &[u64]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for f in fields {
        for b in f.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Element ranges of the shards of a bucket of `n` elements over `world` ranks for the
/// reduce-scatter of an all-reduce: contiguous, cut at group boundaries (32 elements), as even
/// as that allows; the first shard is the longest.
pub(crate) fn shards(n: u64, world: usize) -> Vec<(u64, u64)> {
    let group = crate::format::GROUP as u64;
    let groups = n.div_ceil(group);
    let per = groups.div_ceil(world.max(1) as u64) * group;
    (0..world as u64)
        .map(|j| {
            let lo = (j * per).min(n);
            let hi = ((j + 1) * per).min(n);
            (lo, hi - lo)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_stay_aligned_and_within_the_capacity() {
        for (largest, cap) in [(0, 100), (100, 1000), (1000, 1000), (5000, 4100)] {
            let mut s = Slot::new();
            for _ in 0..3 {
                s.follow(largest, cap);
                assert_eq!(s.bytes % 16, 0);
                assert!(s.bytes <= round16(cap));
                assert!(s.bytes >= largest.min(round16(cap)));
            }
        }
    }

    /// Steady frames shrink the margin to its least; a frame that outgrows its slot doubles it.
    #[test]
    fn the_margin_follows_the_frames() {
        let cap = 1 << 30;
        let mut s = Slot::new();
        s.follow(640_000, cap);
        assert_eq!(s.bytes, round16(640_000 + 80_000 + 256)); // an eighth to start
        for _ in 0..20 {
            s.follow(640_000, cap);
        }
        assert_eq!(s.bytes, round16(640_000 + 10_000 + 256)); // a 64th
        s.follow(700_000, cap); // outgrew: 2/64
        assert_eq!(s.bytes, round16(700_000 + 21_875 + 256));
        for size in [800_000, 1_040_000, 1_352_000, 1_757_600] {
            s.follow(size, cap); // outgrew each time: 4, 8, 16, then at most 16 64ths
        }
        assert_eq!(s.bytes, round16(1_757_600 + 439_400 + 256));
    }

    #[test]
    fn shards_cover_the_bucket_at_group_boundaries() {
        for (n, world) in [(0, 3), (1, 4), (100, 3), (10_007, 8), (64, 8)] {
            let s = shards(n, world);
            let mut next = 0;
            for (lo, len) in &s {
                assert_eq!(*lo, next);
                assert!(lo % 32 == 0 || *lo == n);
                next = lo + len;
            }
            assert_eq!(next, n);
            assert!(s.iter().all(|(_, len)| *len <= s[0].1));
        }
    }

    #[test]
    fn heads_that_do_not_match_are_refused() {
        let h = Head {
            size: 100,
            sum_squares: 1.0,
            max_abs: 1.0,
            check: 7,
        };
        assert!(check_heads(&[(0, h)], 7, 200, "a frame").is_ok());
        let e = check_heads(&[(1, h)], 8, 200, "a frame").unwrap_err();
        assert!(matches!(e, Error::RankMismatch { .. }), "{e}");
        let e = check_heads(&[(1, Head { size: 300, ..h })], 7, 200, "a frame").unwrap_err();
        assert!(e.to_string().contains("rank 1"), "{e}");
        assert_ne!(check_word(&[1, 2]), check_word(&[2, 1]));
    }
}
