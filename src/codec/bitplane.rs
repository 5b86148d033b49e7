//! Bit-plane packing of one group of 32 zigzag codes.
//!
//! A group of width `w` is stored as `w` little-endian 32-bit words; bit `j` of word `p` is
//! bit `p` of code `j`. This is the layout a CUDA warp produces with one `__ballot_sync` per
//! plane, and it leaves the high, mostly-zero planes in whole words, which a zstd stage finds.

use crate::codec::format::GROUP;

/// Zigzag-encodes a signed code so small magnitudes of either sign get small unsigned values.
#[inline(always)]
pub fn zigzag(q: i64) -> u64 {
    ((q << 1) ^ (q >> 63)) as u64
}

/// Inverse of [`zigzag`].
#[inline(always)]
pub fn unzigzag(z: u64) -> i64 {
    ((z >> 1) as i64) ^ -((z & 1) as i64)
}

/// Appends the `w` bit planes of 32 codes (each below `2^w`, `w <= 32`).
#[inline]
pub(crate) fn pack32(zz: &[u32; GROUP], w: u32, out: &mut Vec<u8>) {
    for p in 0..w {
        out.extend_from_slice(&plane32(zz, p).to_le_bytes());
    }
}

/// Bit `p` of each of 32 codes, as one word (bit `j` from code `j`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn plane32(zz: &[u32; GROUP], p: u32) -> u32 {
    use std::arch::x86_64::{
        __m128i, _mm_castsi128_ps, _mm_cvtsi32_si128, _mm_loadu_si128, _mm_movemask_ps,
        _mm_sll_epi32,
    };
    // Shift bit `p` of every lane into its sign bit, then gather 4 sign bits per movemask.
    // SSE2 is part of the x86_64 baseline, so these intrinsics are always available.
    let mut word = 0u32;
    // SAFETY: SSE2 is enabled on every x86_64 target; `zz` holds 32 u32s, so the 4 lanes at
    // 4k (k < 8) are in bounds, and `_mm_loadu_si128` has no alignment requirement.
    unsafe {
        let shift = _mm_cvtsi32_si128(31 - p as i32);
        for k in 0..GROUP / 4 {
            let v = _mm_loadu_si128(zz.as_ptr().add(4 * k) as *const __m128i);
            let bits = _mm_movemask_ps(_mm_castsi128_ps(_mm_sll_epi32(v, shift))) as u32;
            word |= bits << (4 * k);
        }
    }
    word
}

/// Bit `p` of each of 32 codes, as one word (bit `j` from code `j`).
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn plane32(zz: &[u32; GROUP], p: u32) -> u32 {
    let mut word = 0u32;
    for (j, &z) in zz.iter().enumerate() {
        word |= ((z >> p) & 1) << j;
    }
    word
}

/// Reads `w` bit planes (`planes.len() == 4 * w`, `w <= 32`) back into 32 codes.
#[inline]
pub(crate) fn unpack32(planes: &[u8], zz: &mut [u32; GROUP]) {
    *zz = [0; GROUP];
    for (p, word) in planes.chunks_exact(4).enumerate() {
        let word = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
        for (j, z) in zz.iter_mut().enumerate() {
            *z |= ((word >> j) & 1) << p;
        }
    }
}

/// As [`pack32`], for codes up to 64 bits wide (sums of codes).
pub(crate) fn pack64(zz: &[u64; GROUP], w: u32, out: &mut Vec<u8>) {
    for p in 0..w {
        let mut word = 0u32;
        for (j, &z) in zz.iter().enumerate() {
            word |= (((z >> p) & 1) as u32) << j;
        }
        out.extend_from_slice(&word.to_le_bytes());
    }
}

/// As [`unpack32`], for widths up to 64.
pub(crate) fn unpack64(planes: &[u8], zz: &mut [u64; GROUP]) {
    *zz = [0; GROUP];
    for (p, word) in planes.chunks_exact(4).enumerate() {
        let word = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
        for (j, z) in zz.iter_mut().enumerate() {
            *z |= (((word >> j) & 1) as u64) << p;
        }
    }
}

/// Bits needed for the largest of some zigzag codes (0 when all are zero).
#[inline(always)]
pub(crate) fn width_of(or_of_codes: u64) -> u32 {
    64 - or_of_codes.leading_zeros()
}
