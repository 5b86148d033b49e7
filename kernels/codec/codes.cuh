#pragma once
// Codes, bit planes, chunks and tiles: the helpers the encoder, the decoder and the sums share.
#include "codec.cuh"

// ---- quantization ------------------------------------------------------------------------

// 1.5 * 2^52: (t + MAGIC) - MAGIC is rint(t) for |t| < 2^51, with the integer in the low bits
// of t + MAGIC. The same trick as the CPU reference, cheaper than rint + conversions on the GPU
// (needs --fmad=false, so that x * inv + MAGIC is never contracted).
#define CFC_ROUND_MAGIC 6755399441055744.0

// rint(t) as a double, and its low 32 bits as an integer (valid for |t| <= 2^31 - 1).
__device__ __forceinline__ double round_scaled(double t, i64* q) {
    double shifted = t + CFC_ROUND_MAGIC;
    *q = (i64)(int)(u32)__double2loint(shifted);
    return shifted - CFC_ROUND_MAGIC;
}

// The quantize rule of docs/FORMAT.md for a value x64 (as f64): t = x64 / step (as x64 * inv_step),
// its rounded code q, and the value q decodes to.
template <class D>
__device__ __forceinline__ typename D::T quantize(double x64, const CfcParams* p, double* t, i64* q) {
    *t = x64 * p->inv_step;
    double qf = round_scaled(*t, q);
    return D::from_f32(__double2float_rn(qf * p->step));
}

// The value zigzag code z (< 2^32, so |q| < 2^31) decodes to: cfc_dequantize's rule, with
// (double)q exact through the same magic constant as the encoder instead of a conversion.
template <class D>
__device__ __forceinline__ typename D::T decode_zigzag32(u32 z, double step) {
    const i64 q = (int)(z >> 1) ^ -(int)(z & 1);
    const double qf = __longlong_as_double(__double_as_longlong(CFC_ROUND_MAGIC) + q) - CFC_ROUND_MAGIC;
    return D::from_f32(__double2float_rn(qf * step));
}

// One value's zigzag code (0 for an exception) and whether it is an exception. `f` is the value
// as float32 (exact for every dtype). FIXED (fixed rate): any finite error is accepted, and the
// error goes to *err_out for the frame's max error.
template <class D, bool FIXED>
__device__ __forceinline__ u32 encode_value(float f, const CfcParams& p, bool* exc, double* err_out) {
    double x64 = (double)f, t;
    i64 q;
    double dec = D::to_f64(quantize<D>(x64, &p, &t, &q));
    double err = fabs(dec - x64);
    bool ok = fabs(t) <= CFC_MAX_CODE && (FIXED ? (err <= 1.7976931348623157e308) : (err <= p.eps));
    *exc = !ok;
    if (FIXED) *err_out = ok ? err : 0.0;
    int q32 = (int)q;  // |q| <= 2^31 - 1 when ok, so the zigzag code fits 32 bits
    return ok ? ((u32)q32 << 1) ^ (u32)(q32 >> 31) : 0u;
}

// ---- float32 codes in float32 arithmetic ----------------------------------------------------
// For a float32 input in the bounded modes (not fixed rate), encode_value's f64 rule can be
// replaced by a few float32 operations wherever they provably give the same code, and the
// bound test is then implied. With t32 = RN32(f * inv32), inv32 = RN32(inv_step) (RN = round
// to nearest, ties to even), r = rint(t32) and d = |t32 - r| (exact), the value is "sure" when
//     d < RN32(0.5 - 2^-22 - |t32| 2^-20)                              (one fused multiply-add)
// and then:
// - code: t32 is within |t32| 2^-22 + 2^-149 of the reference's t = RN64(f * inv_step), so t is
//   within less than 1/2 of r: rint(t) = r, never a tie, and |t| < 2^19 is in range;
// - bound: f / step is within |t32| 2^-22.9 of t32, so |f - r step| <= step (0.5 - 2^-22 + 2^-26
//   - |t32| 2^-20.6), and the decoded value, r * step rounded to f64 then to f32, is within
//   |r| step 2^-23.9 of r step; together |dec - f| < eps (1 - 2^-22) + 2^-150 < eps. So the
//   value is no exception and its code is zigzag(r).
// NaN, infinities, |t32| >= 2^19 and values within the margin are not sure (about one in 10^7
// of the gradient vectors at 0.1 x RMS); a group with any of them is coded by encode_value
// (code_group_f64). The route is off where inv_step or eps lies outside [2^-100, 2^100], where the
// relative bounds above would not hold. bfloat16 and float16 keep encode_value: their decoded
// values are rounded to the dtype, so the bound test is not implied there.
__device__ __forceinline__ bool f32_route_on(const CfcParams& p) {
    return !p.error && p.inv_step >= 0x1p-100 && p.inv_step <= 0x1p100 && p.eps >= 0x1p-100 && p.eps <= 0x1p100;
}

// 1.5 * 2^23: (t + M) - M is rint(t) for |t| < 2^22, and the bits of t + M minus those of M
// are that integer.
#define CFC_ROUND_MAGIC_F32 12582912.0f

// The zigzag code of f by the float32 route, and whether it is sure (see above).
__device__ __forceinline__ u32 f32_code(float f, float inv, bool* sure) {
    const float t = f * inv;
    const float s = t + CFC_ROUND_MAGIC_F32;
    const float r = s - CFC_ROUND_MAGIC_F32;
    const int q = __float_as_int(s) - __float_as_int(CFC_ROUND_MAGIC_F32);
    *sure = fabsf(t - r) < __fmaf_rn(fabsf(t), -0x1p-20f, 0.5f - 0x1p-22f);  // false for NaN
    return ((u32)q << 1) ^ (u32)(q >> 31);
}

// ---- bit planes --------------------------------------------------------------------------
// A group's planes are the transpose of its 32 codes seen as a 32 x w bit matrix. One thread
// builds them a byte of every code at a time ("slice" s: bits 8s to 8s + 7), with bit-matrix
// transposes instead of a shift and a mask per bit.

// Transpose of an 8 x 8 bit matrix held as byte r = row r, bit c = column c: three rounds of
// swapping the off-diagonal 1 x 1, 2 x 2 and 4 x 4 blocks.
__device__ __forceinline__ u64 transpose_bits_8x8(u64 x) {
    u64 t;
    t = (x ^ (x >> 7)) & 0x00AA00AA00AA00AAull;
    x ^= t ^ (t << 7);
    t = (x ^ (x >> 14)) & 0x0000CCCC0000CCCCull;
    x ^= t ^ (t << 14);
    t = (x ^ (x >> 28)) & 0x00000000F0F0F0F0ull;
    x ^= t ^ (t << 28);
    return x;
}

// Transpose of a 4 x 4 byte matrix (rows r0..r3, byte c = column c): c[k] = column k.
__device__ __forceinline__ void transpose_bytes_4x4(u32 r0, u32 r1, u32 r2, u32 r3, u32* c) {
    u32 t0 = __byte_perm(r0, r1, 0x6240), t1 = __byte_perm(r0, r1, 0x7351);
    u32 t2 = __byte_perm(r2, r3, 0x6240), t3 = __byte_perm(r2, r3, 0x7351);
    c[0] = __byte_perm(t0, t2, 0x5410);
    c[1] = __byte_perm(t1, t3, 0x5410);
    c[2] = __byte_perm(t0, t2, 0x7632);
    c[3] = __byte_perm(t1, t3, 0x7632);
}

// Planes 8s..8s+7 of 32 codes, from `w`: byte p of w[m] is byte s of code 4m + p. Bit j of
// plane[b] is bit 8s + b of code j. Codes 8q..8q+7 form an 8 x 8 bit matrix (rows: codes),
// whose transpose has plane b's byte q as its row b; the 4 x 4 byte transposes then put each
// plane's four bytes together.
__device__ __forceinline__ void slice_planes(const u32* w, u32* plane) {
    u32 lo[4], hi[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        u64 t = transpose_bits_8x8((u64)w[2 * q] | ((u64)w[2 * q + 1] << 32));
        lo[q] = (u32)t;
        hi[q] = (u32)(t >> 32);
    }
    transpose_bytes_4x4(lo[0], lo[1], lo[2], lo[3], plane);
    transpose_bytes_4x4(hi[0], hi[1], hi[2], hi[3], plane + 4);
}

// Code `i` of a group of width `w` (up to 64) whose planes are at `planes`, one bit at a time
// (frames of summed codes, whose widths can pass 32; coded frames' widths never do).
__device__ __forceinline__ i64 code_at(const u32* planes, u32 w, u32 i) {
    u64 z = 0;
    for (u32 b = 0; b < w; ++b) z |= (u64)((planes[b] >> i) & 1u) << b;
    return (i64)(z >> 1) ^ -(i64)(z & 1);
}

// This lane's code in a group of width `w` (up to 64): code `lane`.
__device__ __forceinline__ i64 lane_code(const u32* planes, u32 w) { return code_at(planes, w, threadIdx.x & 31); }

// The zigzag codes 8k .. 8k + 7 of a group of width w <= 32 whose planes are at `planes`, into
// z[0..8), a byte of every code at a time: byte k of planes 8s .. 8s + 7 is an 8 x 8 bit
// matrix (row b: bit 8s + b of the 8 codes) whose transpose holds code i's byte s as its row i.
// The inverse of slice_planes, for 8 codes.
__device__ __forceinline__ void unslice_codes(const u32* planes, u32 w, u32 k, u32* z) {
    const u32 sel = k | (k + 4) << 4;  // byte k of the first and of the second word
#pragma unroll
    for (u32 i = 0; i < 8; ++i) z[i] = 0;
#pragma unroll
    for (u32 s = 0; s < 4; ++s) {
        if (8 * s >= w) break;
        u32 p[8];
#pragma unroll
        for (u32 b = 0; b < 8; ++b) p[b] = 8 * s + b < w ? planes[8 * s + b] : 0u;
        const u32 lo = __byte_perm(__byte_perm(p[0], p[1], sel), __byte_perm(p[2], p[3], sel), 0x5410);
        const u32 hi = __byte_perm(__byte_perm(p[4], p[5], sel), __byte_perm(p[6], p[7], sel), 0x5410);
        const u64 t = transpose_bits_8x8((u64)lo | ((u64)hi << 32));
        const u32 tl = (u32)t, th = (u32)(t >> 32);
        // Byte i of t into byte s of z[i] (the other bytes of z[i] kept).
#pragma unroll
        for (u32 i = 0; i < 8; ++i) {
            const u32 from = 4 + (i % 4);  // byte i % 4 of the second operand
            const u32 keep = 0x3210u & ~(0xfu << (4 * s));
            z[i] = __byte_perm(z[i], i < 4 ? tl : th, keep | from << (4 * s));
        }
    }
}

// ---- chunks and tiles ------------------------------------------------------------------
// A chunk is CHUNK_GROUPS consecutive groups (256 values); a compress tile is 8 wc chunks (wc 1
// or 4), one block of the encoder (a thread per group) and of the packer (8 warps taking wc
// chunks each); the decoder's tiles are always TILE_CHUNKS; a span is SPAN_TILES tiles. Where a
// chunk's planes go in the frame depends on every chunk before it, so each block writes its
// chunks' offsets within the tile and the tile's totals; the last block to finish in a span turns its tiles'
// totals into prefix sums within the span, and the last span to finish does the same over the
// spans. The next kernel adds the three levels. No block ever waits for another.
// Workspace layout (src/cuda/ mirrors it, see tile_layout):
//   0   CfcParams (48 bytes)   64  frame size (u64)   72  raw flag (u32)   80  spans done (u32)
//   96  totals: plane words, exceptions (u64 each)
//   112 span_done[spans] (u32)                    -- bytes 0 to 112 + 4 spans are zeroed per call
//   then, 16-aligned: tile_words, tile_excs [tiles] and span_words, span_excs [spans] (u64):
//   totals, then exclusive prefix sums; chunk_info[chunks] (uint4: words and exceptions before
//   the chunk in its tile, and the chunk's own); then (compress) excmask[groups] (u32) and the
//   staged planes (room for 256 u32 per chunk; each tile's planes back to back in its room);
//   then, with error feedback, cvals[32 groups] (f32: 32 per group) and gw[groups] (u8).
#define CHUNK_GROUPS 8
#define CHUNK_VALUES 256
#define WARP_CHUNKS 4   // at most: the host picks 1 (small inputs: more blocks) or 4
#define TILE_CHUNKS 32  // TILE_THREADS / 32 warps x WARP_CHUNKS: one lane of warp 0 per chunk
#define TILE_THREADS 256
#define SPAN_TILES 16
#define WS_DONE 80
#define WS_TOTALS 96
#define WS_SPANS 112
#define GW_KEPT 0x80u  // in gw: the group's compensated values are in cvals

struct Tiles {
    u32* done;
    u64* totals;
    u32* span_done;
    u64* tile_words;
    u64* tile_excs;
    u64* span_words;
    u64* span_excs;
    uint4* chunk_info;
    u32* excmask;
    u32* stage;
    float* cvals;  // with error feedback: compensated values, where kept (GW_KEPT)
    u8* gw;        // with error feedback: each group's width, | GW_KEPT where its c are kept
    u64 groups, chunks, tiles, spans;
    u32 tile_chunks;
};

__device__ __forceinline__ Tiles tiles_at(u8* ws, u64 n, u32 tile_chunks) {
    Tiles s;
    s.tile_chunks = tile_chunks;
    s.groups = (n + CFC_GROUP - 1) / CFC_GROUP;
    s.chunks = (s.groups + CHUNK_GROUPS - 1) / CHUNK_GROUPS;
    s.tiles = max((s.chunks + tile_chunks - 1) / tile_chunks, 1ull);
    s.spans = (s.tiles + SPAN_TILES - 1) / SPAN_TILES;
    s.done = (u32*)(ws + WS_DONE);
    s.totals = (u64*)(ws + WS_TOTALS);
    s.span_done = (u32*)(ws + WS_SPANS);
    s.tile_words = (u64*)(ws + ((WS_SPANS + 4 * s.spans + 15) & ~15ull));
    s.tile_excs = s.tile_words + s.tiles;
    s.span_words = s.tile_excs + s.tiles;
    s.span_excs = s.span_words + s.spans;
    s.chunk_info = (uint4*)(s.span_excs + s.spans);  // 16-aligned: 16 (tiles + spans) bytes on
    s.excmask = (u32*)(s.chunk_info + s.chunks);
    s.stage = s.excmask + s.groups;
    s.cvals = (float*)(s.stage + s.chunks * CHUNK_VALUES);
    s.gw = (u8*)(s.cvals + s.groups * CFC_GROUP);
    return s;
}

// Exclusive scan, in place, of the `len` pairs a[], b[] by one warp (contiguous runs per lane);
// returns the totals in every lane. Reads through L2: the values were written by other blocks.
// This runs at the very end of a pass, by the last block only, so its L2 round trips add
// straight to the pass's time: each lane reads its run SCAN_BATCH entries at a time, all in
// flight together, and keeps them for the writes when the run fits one batch (up to 32 x
// SCAN_BATCH = 256 spans: 128 MB of float32 for the encoder).
#define SCAN_BATCH 8

// Entries k0 .. k0 + SCAN_BATCH - 1 of a[] and b[] (0 at or past hi), all loads in flight at once.
__device__ __forceinline__ void load_scan_batch(const u64* a, const u64* b, u64 k0, u64 hi, u64* va, u64* vb) {
#pragma unroll
    for (u32 u = 0; u < SCAN_BATCH; ++u) {
        va[u] = k0 + u < hi ? __ldcg(&a[k0 + u]) : 0;
        vb[u] = k0 + u < hi ? __ldcg(&b[k0 + u]) : 0;
    }
}

__device__ void warp_scan_pairs(u64* a, u64* b, u64 len, u64* ta, u64* tb) {
    u32 lane = threadIdx.x & 31;
    u64 per = (len + 31) / 32, lo = min(lane * per, len), hi = min(lo + per, len);
    u64 sa = 0, sb = 0, va[SCAN_BATCH], vb[SCAN_BATCH];
    for (u64 k0 = lo; k0 < hi; k0 += SCAN_BATCH) {
        load_scan_batch(a, b, k0, hi, va, vb);
#pragma unroll
        for (u32 u = 0; u < SCAN_BATCH; ++u) {
            sa += va[u];
            sb += vb[u];
        }
    }
    u64 ia = cfc_lane_prefix_sum(sa), ib = cfc_lane_prefix_sum(sb);
    *ta = __shfl_sync(CFC_FULL_MASK, ia, 31);
    *tb = __shfl_sync(CFC_FULL_MASK, ib, 31);
    u64 ea = ia - sa, eb = ib - sb;
    const bool kept = per <= SCAN_BATCH;  // va, vb still hold this lane's whole run
    for (u64 k0 = lo; k0 < hi; k0 += SCAN_BATCH) {
        if (!kept) load_scan_batch(a, b, k0, hi, va, vb);
#pragma unroll
        for (u32 u = 0; u < SCAN_BATCH; ++u) {
            if (k0 + u < hi) {
                a[k0 + u] = ea;
                b[k0 + u] = eb;
            }
            ea += va[u];
            eb += vb[u];
        }
    }
}

// Each block's warp 0 calls this with its chunks' (words, exceptions), one per lane: writes the
// chunks' offsets within the tile and the tile's totals, then takes part in the span and grand
// scans when it is the last of its span (or of all spans) to get here.
__device__ void tile_totals(const Tiles& s, u64 tile, u32 cw, u32 ce) {
    u32 lane = threadIdx.x & 31;
    const u32 tc = s.tile_chunks;
    // Inclusive sums over the tile's chunks (lanes past tc hold nothing that is used).
    u32 iw = cfc_lane_prefix_sum(cw, tc), ie = cfc_lane_prefix_sum(ce, tc);
    u64 ch = tile * tc + lane;
    if (lane < tc && ch < s.chunks) s.chunk_info[ch] = make_uint4(iw - cw, ie - ce, cw, ce);
    u32 tw = __shfl_sync(CFC_FULL_MASK, iw, tc - 1), te = __shfl_sync(CFC_FULL_MASK, ie, tc - 1);
    u64 span = tile / SPAN_TILES;
    u64 first = span * SPAN_TILES, in_span = min(s.tiles - first, (u64)SPAN_TILES);
    u32 last = 0;
    if (lane == 0) {
        s.tile_words[tile] = tw;
        s.tile_excs[tile] = te;
        __threadfence();  // the totals are visible before this block counts as done
        last = atomicAdd(&s.span_done[span], 1u) == in_span - 1;
    }
    if (!__shfl_sync(CFC_FULL_MASK, last, 0)) return;
    __threadfence();
    u64 sw, se;
    warp_scan_pairs(s.tile_words + first, s.tile_excs + first, in_span, &sw, &se);
    if (lane == 0) {
        s.span_words[span] = sw;
        s.span_excs[span] = se;
        __threadfence();
        last = atomicAdd(s.done, 1u) == s.spans - 1;
    }
    if (!__shfl_sync(CFC_FULL_MASK, last, 0)) return;
    __threadfence();
    warp_scan_pairs(s.span_words, s.span_excs, s.spans, &sw, &se);
    if (lane == 0) {
        s.totals[0] = sw;
        s.totals[1] = se;
    }
}

// Values of chunk `ch` that exist: CHUNK_VALUES, fewer in the last chunk, 0 past the end.
__device__ __forceinline__ u32 chunk_values(u64 n, u64 ch) {
    u64 e0 = ch * CHUNK_VALUES;
    return e0 >= n ? 0 : (u32)min(n - e0, (u64)CHUNK_VALUES);
}

// Plane words and exceptions before tile `t` (after tile_totals has run for every tile).
__device__ __forceinline__ u64 words_before(const Tiles& s, u64 t) {
    return s.span_words[t / SPAN_TILES] + s.tile_words[t];
}
__device__ __forceinline__ u64 excs_before(const Tiles& s, u64 t) {
    return s.span_excs[t / SPAN_TILES] + s.tile_excs[t];
}

// Aligned word k of the copy of staged words to bytes [pb, end) of the frame (a0 = pb rounded
// down to 4, sh = pb - a0): made of staged words k - 1 (prev) and k (cur). A word that the copy
// covers only in part (at either end, shared with the neighbouring copies) is written byte by
// byte, only its bytes in [pb, end).
__device__ __forceinline__ void put_word(u8* pb, const u8* end, u32 sh, u32 k, u32 prev, u32 cur) {
    u8* a = pb - sh + 4 * k;
    if ((sh == 0 || k > 0) && a + 4 <= end) {
        *(u32*)a = sh == 0 ? cur : __funnelshift_r(prev, cur, 8 * (4 - sh));
    } else {
        for (u32 bi = 0; bi < 4; ++bi) {
            if (a + bi < pb || a + bi >= end) continue;
            u32 o = (u32)(a + bi - pb);  // byte o of the staged words: in prev or cur
            u32 word = (o >> 2) == k ? cur : prev;
            a[bi] = (u8)(word >> (8 * (o & 3)));
        }
    }
}

// The aligned words that a copy of `nw` staged words to bytes [pb, pb + 4 nw) covers, writing
// nothing at or past `limit`: sets *end and *sh (see put_word) and returns their count.
__device__ __forceinline__ u32 copy_words_span(u8* pb, u32 nw, const u8* limit, const u8** end, u32* sh) {
    *end = pb + 4 * (u64)nw;
    if (*end > limit) *end = limit;
    if (pb >= *end) return 0;
    *sh = (u32)((u64)pb & 3);
    return (u32)(((u64)(*end - (pb - *sh)) + 3) / 4);
}

// Copies `nw` staged words to bytes [pb, pb + 4 nw) of the frame (pb at any alignment), writing
// nothing at or past `limit`. Called by one warp; `first_round` is each lane's staged[lane] (0
// at or past nw), loaded by the caller ahead of time; the previous word comes from the
// neighbouring lane.
__device__ __forceinline__ void put_words(u8* pb, const u32* staged, u32 nw, const u8* limit,
                                          u32 first_round) {
    const u32 lane = threadIdx.x & 31;
    const u8* end;
    u32 sh;
    const u32 count = copy_words_span(pb, nw, limit, &end, &sh);
    u32 carry = 0;  // staged word k - 1 for lane 0
    for (u32 base = 0; base < count; base += 32) {
        u32 k = base + lane;
        u32 cur = base == 0 ? first_round : k < nw ? staged[k] : 0;
        u32 prev = __shfl_up_sync(CFC_FULL_MASK, cur, 1);
        if (lane == 0) prev = carry;
        carry = __shfl_sync(CFC_FULL_MASK, cur, 31);
        if (k < count) put_word(pb, end, sh, k, prev, cur);
    }
}

// The same, by a whole block, each thread loading both words it needs; the caller has loaded
// the first round's (staged[threadIdx.x] and the word before it, 0 where there is none) ahead
// of time.
__device__ __forceinline__ void put_words_block(u8* pb, const u32* staged, u32 nw, const u8* limit, u32 cur0,
                                                u32 prev0) {
    const u8* end;
    u32 sh;
    const u32 count = copy_words_span(pb, nw, limit, &end, &sh);
    for (u32 k = threadIdx.x; k < count; k += blockDim.x) {
        u32 cur = k == threadIdx.x ? cur0 : k < nw ? staged[k] : 0;
        u32 prev = k == threadIdx.x ? prev0 : staged[k - 1];
        put_word(pb, end, sh, k, prev, cur);
    }
}
