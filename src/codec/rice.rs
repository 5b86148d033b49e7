//! Rice-coded codes: the body of a `rice` frame (codec 3, docs/FORMAT.md "Body of a rice frame").
//!
//! Bit planes (codec 0) spend a group's full width on each of its 32 codes, so a group with one
//! large code pays for it 32 times, and every group pays its width byte. Near the entropy of the
//! codes, a code costs about what its own magnitude needs. Here each block of 1024 codes has one
//! parameter `k`: a code's low `k` bits go in bit planes (the layout one ballot per plane makes
//! on a GPU), the rest of it, `h = z >> k`, in unary (`h` zeros, then a one), back to back in
//! one bit stream per block. Groups whose codes are all 0 cost one bit of the block's head.
//!
//! The choice of `k` is part of the format (every backend writes the same bytes): the smallest
//! `k` at or above `k_min` that minimizes `32 c k + sum(z >> k)` over the block's `c` coded
//! groups, where `k_min` keeps every `h` at most [`MAX_QUOTIENT`]. That cost falls and then rises
//! with `k` (its steps never decrease), so walking up from `k_min` while it still falls finds it.

use crate::codec::bitplane::pack64;
use crate::codec::format::{bad_field, GROUP};
use crate::error::{Error, FormatError, Result};

/// Values per block: 32 groups of 32, one `k` and one head each.
pub(crate) const BLOCK: usize = 1024;
/// Groups per block (bit `g` of a head's mask is group `g` of the block).
pub(crate) const BLOCK_GROUPS: usize = BLOCK / GROUP;
/// Bytes of one block head (u64).
pub(crate) const HEAD_BYTES: usize = 8;
/// Bits of the largest unary part a code may have, and that part: `k` is raised until every
/// `z >> k` is at most [`MAX_QUOTIENT`].
const QUOTIENT_BITS: u32 = 5;
pub(crate) const MAX_QUOTIENT: u64 = (1 << QUOTIENT_BITS) - 1;
/// Most words one block's bit stream can take: 1024 ones and 1024 x 31 zeros.
pub(crate) const MAX_UNARY_WORDS: u64 = (BLOCK as u64 * (MAX_QUOTIENT + 1)).div_ceil(32);
/// Most words one block's data can take: 32 groups of 63 planes, and its bit stream.
pub(crate) const MAX_BLOCK_WORDS: u64 = BLOCK_GROUPS as u64 * 63 + MAX_UNARY_WORDS;

/// Number of blocks for `n` elements.
pub(crate) fn blocks_for(n: u64) -> u64 {
    n.div_ceil(BLOCK as u64)
}

/// A block head: which groups are coded, their `k`, and the words of the unary stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Head {
    pub mask: u32,
    pub k: u32,
    pub unary_words: u32,
}

impl Head {
    fn to_bits(self) -> u64 {
        self.mask as u64 | (self.k as u64) << 32 | (self.unary_words as u64) << 48
    }

    /// Reads and checks one head (`block` names it in errors).
    fn from_bits(bits: u64, block: u64) -> Result<Head> {
        let head = Head {
            mask: bits as u32,
            k: ((bits >> 32) & 0x3f) as u32,
            unary_words: (bits >> 48) as u32,
        };
        let reserved = (bits >> 38) & 0x3ff;
        let ok = reserved == 0
            && head.unary_words as u64 <= MAX_UNARY_WORDS
            && (head.mask != 0 || head.to_bits() == 0);
        if !ok {
            return Err(bad_field(
                "rice block head",
                format!("block {block}: {bits:#018x}"),
            ));
        }
        Ok(head)
    }

    /// Words of the block's data: `k` planes per coded group, then the unary stream.
    pub(crate) fn words(self) -> u64 {
        self.k as u64 * self.mask.count_ones() as u64 + self.unary_words as u64
    }
}

/// The `k` of a block whose coded groups' codes are `coded` (see the module's rule).
fn choose_k(coded: &[u64], max: u64) -> u32 {
    let bits = 64 - max.leading_zeros();
    let mut k = bits.saturating_sub(QUOTIENT_BITS);
    // cost(k + 1) - cost(k) = len - sum((z >> k) - (z >> (k + 1))); stop where it is >= 0.
    while k < 63 {
        let gain: u64 = coded.iter().map(|&z| (z >> k) - (z >> (k + 1))).sum();
        if gain <= coded.len() as u64 {
            break;
        }
        k += 1;
    }
    k
}

/// Appends one block: its head to `heads` and its data to `words` (little-endian u32). `zz` holds
/// the block's zigzag codes, 0 past the end of the tensor and at exceptions.
pub(crate) fn encode_block(zz: &[u64; BLOCK], heads: &mut Vec<u8>, words: &mut Vec<u8>) {
    let mut mask = 0u32;
    let mut max = 0u64;
    for (g, group) in zz.chunks_exact(GROUP).enumerate() {
        let or = group.iter().fold(0u64, |a, &z| a | z);
        mask |= ((or != 0) as u32) << g;
        max = max.max(group.iter().copied().max().unwrap_or(0));
    }
    if mask == 0 {
        heads.extend_from_slice(&0u64.to_le_bytes());
        return;
    }
    let mut coded = [0u64; BLOCK];
    let mut len = 0;
    for g in (0..BLOCK_GROUPS).filter(|g| mask >> g & 1 == 1) {
        coded[len..len + GROUP].copy_from_slice(&zz[g * GROUP..(g + 1) * GROUP]);
        len += GROUP;
    }
    let coded = &coded[..len];
    let k = choose_k(coded, max);
    for group in coded.chunks_exact(GROUP) {
        let group: &[u64; GROUP] = group.try_into().unwrap_or(&[0; GROUP]);
        pack64(group, k, words);
    }
    // The unary stream: h zeros then a one per code, bit i of the stream in bit i % 32 of word i / 32.
    let mut stream = [0u32; MAX_UNARY_WORDS as usize];
    let mut at = 0u64;
    for &z in coded {
        at += z >> k;
        stream[(at / 32) as usize] |= 1 << (at % 32);
        at += 1;
    }
    let unary_words = at.div_ceil(32) as u32;
    for w in &stream[..unary_words as usize] {
        words.extend_from_slice(&w.to_le_bytes());
    }
    let head = Head {
        mask,
        k,
        unary_words,
    };
    heads.extend_from_slice(&head.to_bits().to_le_bytes());
}

/// Where a checked rice body's parts lie: each block's head and the byte offset of its data
/// (from the start of the data), for `blocks + 1` entries (the last is the data's length).
#[derive(Default)]
pub(crate) struct Blocks {
    pub heads: Vec<Head>,
    pub starts: Vec<usize>,
}

fn word(data: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([
        data[4 * i],
        data[4 * i + 1],
        data[4 * i + 2],
        data[4 * i + 3],
    ])
}

/// Checks a rice body's heads and bit streams against its data of `data_len` bytes (`heads`:
/// the `8 * blocks` head bytes; `data` the data that follows them). Every unary stream must hold
/// one stop bit per coded value, no quotient above [`MAX_QUOTIENT`], nothing after its last stop
/// bit, and be no longer than its last stop bit needs: exactly what the encoder writes.
pub(crate) fn check(heads: &[u8], data: &[u8]) -> Result<Blocks> {
    let count = heads.len() / HEAD_BYTES;
    let mut out = Blocks {
        heads: crate::error::try_capacity(count)?,
        starts: crate::error::try_capacity(count + 1)?,
    };
    let mut at = 0u64; // words so far
    let data_words = (data.len() / 4) as u64;
    for (b, h) in heads.chunks_exact(HEAD_BYTES).enumerate() {
        let head = Head::from_bits(u64::from_le_bytes(h.try_into().unwrap_or([0; 8])), b as u64)?;
        out.starts.push(4 * at as usize);
        let end = at + head.words();
        if end > data_words {
            return Err(FormatError::Truncated {
                part: "rice block data",
                needed: 4 * end,
                available: data.len() as u64,
            }
            .into());
        }
        let first = (at + head.words() - head.unary_words as u64) as usize;
        check_unary(data, first, head, b as u64)?;
        out.heads.push(head);
        at = end;
    }
    out.starts.push(4 * at as usize);
    if 4 * at != data.len() as u64 {
        return Err(FormatError::LengthMismatch {
            part: "rice block data",
            expected: 4 * at,
            found: data.len() as u64,
        }
        .into());
    }
    Ok(out)
}

/// Checks one block's unary stream (`first`: its first word in `data`).
fn check_unary(data: &[u8], first: usize, head: Head, block: u64) -> Result<()> {
    let wanted = 32 * head.mask.count_ones() as u64;
    let bad = |what: String| {
        Err(bad_field(
            "rice unary stream",
            format!("block {block}: {what}"),
        ))
    };
    let mut ones = 0u64;
    let mut last_one = 0u64; // one past the last stop bit
    for i in 0..head.unary_words as usize {
        let mut w = word(data, first + i);
        while w != 0 {
            let pos = 32 * i as u64 + w.trailing_zeros() as u64;
            if ones == wanted {
                return bad(format!("more than {wanted} stop bits"));
            }
            if pos - last_one > MAX_QUOTIENT {
                return bad(format!(
                    "a quotient of {} (at most {MAX_QUOTIENT})",
                    pos - last_one
                ));
            }
            ones += 1;
            last_one = pos + 1;
            w &= w - 1;
        }
    }
    if ones != wanted {
        return bad(format!("{ones} stop bits for {wanted} codes"));
    }
    if last_one.div_ceil(32) != head.unary_words as u64 {
        return bad(format!(
            "{} words where {} hold it",
            head.unary_words,
            last_one.div_ceil(32)
        ));
    }
    Ok(())
}

/// Decodes block `head`'s zigzag codes into `zz` (0 in groups it does not code). `data` starts at
/// the block's data, which [`check`] has checked.
pub(crate) fn decode_block(head: Head, data: &[u8], zz: &mut [u64; BLOCK]) {
    zz.fill(0);
    if head.mask == 0 {
        return;
    }
    let k = head.k as usize;
    let mut plane = 0usize;
    for g in (0..BLOCK_GROUPS).filter(|g| head.mask >> g & 1 == 1) {
        let group = &mut zz[g * GROUP..(g + 1) * GROUP];
        for p in 0..k {
            let w = word(data, plane + p);
            for (j, z) in group.iter_mut().enumerate() {
                *z |= (((w >> j) & 1) as u64) << p;
            }
        }
        plane += k;
    }
    // The unary stream: code after code, in the coded groups' order.
    let mut groups = (0..BLOCK_GROUPS).filter(|g| head.mask >> g & 1 == 1);
    let mut g = groups.next().unwrap_or(0);
    let mut j = 0usize;
    let mut last_one = 0u64;
    for i in 0..head.unary_words as usize {
        let mut w = word(data, plane + i);
        while w != 0 {
            let pos = 32 * i as u64 + w.trailing_zeros() as u64;
            zz[g * GROUP + j] |= (pos - last_one) << k;
            last_one = pos + 1;
            w &= w - 1;
            j += 1;
            if j == GROUP {
                j = 0;
                g = groups.next().unwrap_or(g);
            }
        }
    }
}

/// The error a rice frame gets where only bit planes can go (fixed rate).
pub(crate) fn fixed_rate_error() -> Error {
    Error::InvalidBound {
        what: "bits",
        reason: "a fixed rate is written as bit planes (coder \"planes\"); \
                 coder \"rice\" takes eps or rel"
            .into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(zz: &[u64; BLOCK]) -> (Head, usize) {
        let (mut heads, mut words) = (Vec::new(), Vec::new());
        encode_block(zz, &mut heads, &mut words);
        let blocks = check(&heads, &words).expect("the encoder's block checks");
        let mut back = [0u64; BLOCK];
        decode_block(blocks.heads[0], &words, &mut back);
        assert_eq!(&back[..], &zz[..]);
        (blocks.heads[0], words.len())
    }

    #[test]
    fn blocks_round_trip() {
        let mut zz = [0u64; BLOCK];
        assert_eq!(
            roundtrip(&zz),
            (
                Head {
                    mask: 0,
                    k: 0,
                    unary_words: 0
                },
                0
            )
        );
        zz[40] = 1;
        let (h, len) = roundtrip(&zz);
        // One coded group (group 1) at k = 0: 32 stop bits and one zero before code 8's.
        assert_eq!((h.mask, h.k, h.unary_words, len), (2, 0, 2, 8));
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for (i, z) in zz.iter_mut().enumerate() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *z = if i % 97 == 0 { x } else { x % 40 };
        }
        let (h, _) = roundtrip(&zz);
        assert_eq!(h.mask, u32::MAX);
        assert!(
            h.k >= 59,
            "k_min keeps the quotients of 64-bit codes at most 31"
        );
        zz.iter_mut().for_each(|z| *z %= 40);
        let (h, _) = roundtrip(&zz);
        assert!((3..=5).contains(&h.k), "k {} for codes below 40", h.k);
    }

    #[test]
    fn k_is_the_first_minimum_of_the_cost() {
        let mut x = 7u64;
        for scale in [1u64, 3, 17, 300, 1 << 20] {
            let coded: Vec<u64> = (0..BLOCK)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (x >> 33) % (scale + 1)
                })
                .collect();
            let max = *coded.iter().max().unwrap();
            let k = choose_k(&coded, max);
            let cost = |k: u32| 32 * k as u64 * 32 + coded.iter().map(|&z| z >> k).sum::<u64>();
            let kmin = (64 - max.leading_zeros()).saturating_sub(5);
            let best = (kmin..64).min_by_key(|&k| (cost(k), k)).unwrap();
            assert_eq!(k, best, "scale {scale}");
            assert!(coded.iter().all(|&z| z >> k <= MAX_QUOTIENT));
        }
    }

    #[test]
    fn malformed_streams_are_refused() {
        let mut zz = [0u64; BLOCK];
        zz.iter_mut()
            .enumerate()
            .for_each(|(i, z)| *z = (i % 7) as u64);
        let (mut heads, mut words) = (Vec::new(), Vec::new());
        encode_block(&zz, &mut heads, &mut words);
        let refused = |heads: &[u8], words: &[u8]| check(heads, words).is_err();
        assert!(!refused(&heads, &words));
        // A word short, a word over, a stop bit lost or added, a reserved bit, a mask without k.
        assert!(refused(&heads, &words[..words.len() - 4]));
        assert!(refused(&heads, &[&words[..], &[0, 0, 0, 0]].concat()));
        // Any one bit of the unary stream flipped: a stop bit lost or added.
        let head = Head::from_bits(u64::from_le_bytes(heads[..8].try_into().unwrap()), 0).unwrap();
        let unary = words.len() - 4 * head.unary_words as usize;
        for bit in [0, 1, 7, 31, 32 * head.unary_words as usize - 1] {
            let mut w = words.clone();
            w[unary + bit / 8] ^= 1 << (bit % 8);
            assert!(refused(&heads, &w), "bit {bit}");
        }
        let mut h = heads.clone();
        h[4] |= 0x40; // bit 38
        assert!(refused(&h, &words));
        assert!(refused(&(1u64 << 32).to_le_bytes(), &[]));
        // A quotient of 32: 32 zeros before the first of 32 stop bits.
        let head = Head {
            mask: 1,
            k: 0,
            unary_words: 2,
        }
        .to_bits()
        .to_le_bytes();
        let stream = [0u8, 0, 0, 0, 0xff, 0xff, 0xff, 0xff];
        let err = check(&head, &stream)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("quotient of 32"), "{err}");
    }
}
