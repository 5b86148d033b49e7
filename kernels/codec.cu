// The error-bounded codec on the GPU. Produces the bytes of the CPU reference (src/codec.rs,
// docs/FORMAT.md) without any host synchronization: every size stays on the device.
//
// Work is cut into chunks of 8 groups (256 values), 32 chunks to a tile (one encoder block).
// Where a chunk's planes go depends on the sizes of every chunk before it, so each direction
// takes two passes: one that sizes the chunks (and, compressing, quantizes and stages their
// planes), whose last block scans the tiles' totals, and one that moves the planes.
//
// Compress: [max_abs] (rel/bits modes) -> encode_groups (quantize, widths, staged bit planes,
// sizes, new residuals) -> pack_chunks (header, raw-or-quantized decision, planes and exceptions
// in place, or raw bytes and the residuals they leave). Decompress: decode_offsets ->
// decode_chunks -> scatter_exceptions.
#include "common.cuh"

#define DEFINE_FOR_DTYPES(MACRO) MACRO(f32, F32) MACRO(bf16, BF16) MACRO(f16, F16)

// ---- bound parameters ----

// Largest of every thread's `v` (non-negative), into *target (f64 bits) with one atomic per block.
__device__ __forceinline__ void block_max_to(u64* target, double v) {
    __shared__ double warp_max[32];
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_down_sync(CFC_FULL_MASK, v, o));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        double m = 0.0;
        for (u32 w = 0; w < (blockDim.x + 31) / 32; ++w) m = fmax(m, warp_max[w]);
        if (m > 0.0) atomicMax(target, (u64)__double_as_longlong(m));
    }
}

// -------------------------------------------------------------------

// Largest finite magnitude of the values to compress: x, or with error feedback dtype(x + r).
template <class D>
__device__ void max_abs(const typename D::T* x, u64 n, CfcParams* p, const float* residual) {
    double m = 0.0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        typename D::T xi = x[i];
        if (residual) xi = cfc_sent_value<D>(xi, cfc_compensate(D::to_f32(xi), residual[i]));
        double v = fabs(D::to_f64(xi));
        if (v <= 1.7976931348623157e308) m = fmax(m, v);  // finite only (NaN fails the test)
    }
    block_max_to(&p->max_abs_bits, m);
}

#define MAX_ABS(name, D) \
    extern "C" __global__ void cfc_codec_max_abs_##name(const D::T* x, u64 n, CfcParams* p,        \
                                                        const float* residual) {                   \
        max_abs<D>(x, n, p, residual);                                                             \
    }
DEFINE_FOR_DTYPES(MAX_ABS)

// Error feedback ahead of an uncompressed send (the GPU all-reduce falling back to NCCL's own
// all-reduce): x = dtype(x + r) and r = 0, so what earlier compressed calls dropped goes out
// with this one. The rounding of x + r to a 16-bit dtype is not kept: a plain send of that
// dtype rounds the same way, and keeping it would cost this pass on every later plain call.
template <class D>
__device__ void fold_residual(typename D::T* x, u64 n, float* residual) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        typename D::T xi = x[i];
        x[i] = cfc_sent_value<D>(xi, cfc_compensate(D::to_f32(xi), residual[i]));
        residual[i] = 0.0f;
    }
}

#define FOLD_RESIDUAL(name, D)                                                                     \
    extern "C" __global__ void cfc_codec_fold_residual_##name(D::T* x, u64 n, float* residual) {   \
        fold_residual<D>(x, n, residual);                                                          \
    }
DEFINE_FOR_DTYPES(FOLD_RESIDUAL)

// ---- statistics of a bucket (the engine's rms and rel bounds) ----

// The statistics of a bucket for the engine's bounds (its rms and rel rules): the sum of squares
// of the finite values float32(x) + r (as PyTorch computes x.float() + r; r may be null),
// non-finite ones counting 0, in f64, and their largest magnitude. One pair of partials per
// block, [sum, max], the block's threads added in a fixed order; the caller launches a number of
// blocks that depends on n only, and stats_total adds the partials in block order, so the same
// input gives the same bits on any GPU (and in the CPU reference, which adds in this order: a
// resumed run then takes the bound the uninterrupted one took).
template <class D>
__device__ void stats(const typename D::T* x, u64 n, const float* residual, double* partials) {
    __shared__ double warp_sum[32];
    __shared__ double warp_max[32];
    double s = 0.0, m = 0.0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float v = D::to_f32(x[i]);
        if (residual) v += residual[i];
        if (isfinite(v)) {
            s += (double)v * (double)v;
            m = fmax(m, (double)fabsf(v));
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        s += __shfl_down_sync(CFC_FULL_MASK, s, o);
        m = fmax(m, __shfl_down_sync(CFC_FULL_MASK, m, o));
    }
    if ((threadIdx.x & 31) == 0) {
        warp_sum[threadIdx.x >> 5] = s;
        warp_max[threadIdx.x >> 5] = m;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0, mm = 0.0;
        for (u32 w = 0; w < (blockDim.x + 31) / 32; ++w) {
            t += warp_sum[w];
            mm = fmax(mm, warp_max[w]);
        }
        partials[2 * blockIdx.x] = t;
        partials[2 * blockIdx.x + 1] = mm;
    }
}

#define STATS(name, D)                                                                             \
    extern "C" __global__ void cfc_codec_stats_##name(const D::T* x, u64 n, const float* residual,  \
                                                      double* partials) {                          \
        stats<D>(x, n, residual, partials);                                                        \
    }
DEFINE_FOR_DTYPES(STATS)

// The partials of stats added in block order (the sums) and folded (the maxima), written as
// [sum, max] at out and again every `pitch` bytes, `copies` times (the head of every row a
// bucket sends). One thread: there are at most a few hundred partials.
extern "C" __global__ void cfc_codec_stats_total(const double* partials, u32 count, u8* out, u64 pitch,
                                                 u32 copies) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double t = 0.0, m = 0.0;
    for (u32 b = 0; b < count; ++b) {
        t += partials[2 * b];
        m = fmax(m, partials[2 * b + 1]);
    }
    for (u32 c = 0; c < copies; ++c) {
        double* o = (double*)(out + (u64)c * pitch);
        o[0] = t;
        o[1] = m;
    }
}


// The quantization parameters of mode 0 abs (value = eps), 1 rel (value = rel) or 2 bits
// (value = bits), from the largest finite magnitude `max`. Mirrors quantizer_for() in
// src/codec.rs; error 1 = the resulting eps is unusable. Every block of the encoder computes
// them itself (they are a pure function of the arguments), so no kernel has to run first.
__device__ __forceinline__ CfcParams make_params(u32 mode, double value, double max) {
    CfcParams p;
    p.max_abs_bits = p.max_err_bits = 0;
    p.error = p.pad = 0;
    if (mode == 2) {
        u32 bits = (u32)value;
        double qmax = (double)((1ull << (bits - 1)) - 1);
        double step = max > 0.0 ? max / qmax : 1.0;
        if (!(step >= 2.2250738585072014e-308 && step <= 1.7976931348623157e308)) step = 2.2250738585072014e-308;
        while (max * (1.0 / step) > CFC_MAX_CODE) step = __longlong_as_double(__double_as_longlong(step) + 1);
        p.step = step;
        p.inv_step = 1.0 / step;
        p.eps = step / 2.0;
        return p;
    }
    double eps = mode == 1 ? (max > 0.0 ? value * max : value) : value;
    if (!(eps >= 2.2250738585072014e-308 && eps <= 1.7976931348623157e308 / 4.0)) {
        p.error = 1;
        eps = 1.0;
    }
    p.step = 2.0 * eps;
    p.inv_step = 1.0 / p.step;
    p.eps = eps;
    return p;
}

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
// Workspace layout (src/cuda.rs mirrors it, see tile_layout):
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

// ---- encode ----------------------------------------------------------------------------

// One thread's group: its 32 values in `row` (shared memory) are replaced by their codes; the
// OR of the codes, the exception mask, the codes' low bytes as slice_planes wants them and, at
// fixed rate, the largest error.
template <class D, bool FIXED>
__device__ __forceinline__ void code_group(u32* row, const CfcParams& P, u32* acc, u32* excm, u32* w8,
                                           double* max_err) {
#pragma unroll
    for (int j = 0; j < CFC_GROUP; ++j) {
        bool exc;
        double err;
        u32 z = encode_value<D, FIXED>(__uint_as_float(row[j]), P, &exc, &err);
        if (FIXED) *max_err = fmax(*max_err, err);
        *acc |= z;
        *excm |= (u32)exc << j;
        row[j] = z;  // for the planes past the first 8, rarely needed
        const int m = j / 4, b = j % 4;
        w8[m] = b == 0 ? z : __byte_perm(w8[m], z, b == 1 ? 0x3240 : b == 2 ? 0x3410 : 0x4210);
    }
}

// code_group for float32 in the bounded modes, by the float32 route: no value is an exception.
// The codes are not written back to the row (the slices past the first recompute them from
// the values, see encode_groups). Returns false when it was unsure of any value: the caller
// then codes the group, whose values are still in the row, by the f64 rule.
__device__ __forceinline__ bool code_group_f32(const u32* row, float inv, u32* acc, u32* w8) {
    bool all_sure = true;
#pragma unroll
    for (int j = 0; j < CFC_GROUP; ++j) {
        bool sure;
        const u32 z = f32_code(__uint_as_float(row[j]), inv, &sure);
        all_sure = all_sure && sure;
        *acc |= z;
        const int m = j / 4, b = j % 4;
        w8[m] = b == 0 ? z : __byte_perm(w8[m], z, b == 1 ? 0x3240 : b == 2 ? 0x3410 : 0x4210);
    }
    return all_sure;
}

// Stages the COUNT values v[0..COUNT) as float32 into s_row[0..COUNT); with error feedback (r,
// their residuals, not null) the values sent for x + r, and the compensated values x + r into
// c_row[0..COUNT).
template <class D, int COUNT>
__device__ __forceinline__ void stage_values(const typename D::T* v, const float* r, float* s_row, float* c_row) {
#pragma unroll
    for (int c = 0; c < COUNT; ++c) {
        typename D::T x = v[c];
        if (r) {
            float comp = cfc_compensate(D::to_f32(x), r[c]);
            x = cfc_sent_value<D>(x, comp);
            c_row[c] = comp;
        }
        s_row[c] = D::to_f32(x);
    }
}

// With error feedback, after a group is coded: its new residuals, c - (what the frame decodes
// to), replace the codes (or values) in `row`; `crow` holds the compensated values c. Returns
// whether pass 2 could fail to rebuild some c as decoded + residual (an exception, whose value
// is not decoded, or a subtraction that was not exact), in which case the caller keeps the
// group's c in the workspace. Pass 2 needs c only for the raw bytes of a frame that falls back
// to raw, and for exceptions' values.
template <class D>
__device__ __noinline__ bool group_residuals(u32* row, const float* crow, bool codes_in_row, float inv32,
                                             double step, u32 excm) {
    bool keep = excm != 0;
#pragma unroll 4
    for (int j = 0; j < CFC_GROUP; ++j) {
        bool sure;
        const u32 z = codes_in_row ? row[j] : f32_code(__uint_as_float(row[j]), inv32, &sure);
        const float c = crow[j];
        float d;
        if ((excm >> j) & 1u) {
            d = D::to_f32(D::from_f32(c));  // sent as it is (c is not finite where x was not)
        } else {
            d = D::to_f32(decode_zigzag32<D>(z, step));
        }
        const float rn = cfc_new_residual(c, d);
        keep = keep || __float_as_uint(d + rn) != __float_as_uint(c);
        row[j] = __float_as_uint(rn);
    }
    return keep;
}

// What coding a group by the f64 rule yields besides its codes (left in the row).
struct GroupCoded {
    u32 acc, excm;
    double max_err;
};

// code_group, out of line, for what is rare with float32 input: fixed rate, a group the float32
// route was unsure of (it leaves the values in the row), a bound outside the route's range.
// Keeping these out of the encoder's body keeps that body small, which matters for small
// inputs, where every SM runs it once from a cold instruction cache. The caller gathers the
// codes' low bytes from the row.
template <class D>
__device__ __noinline__ GroupCoded code_group_f64(u32* row, double step, double inv_step, double eps, u32 fixed) {
    CfcParams P;
    P.step = step;
    P.inv_step = inv_step;
    P.eps = eps;
    GroupCoded r = {0u, 0u, 0.0};
    u32 w8[8];  // not used: the caller gathers them
    if (fixed)
        code_group<D, true>(row, P, &r.acc, &r.excm, w8, &r.max_err);
    else
        code_group<D, false>(row, P, &r.acc, &r.excm, w8, &r.max_err);
    return r;
}

// Pass 1, a thread per group (a tile of 8 wc chunks is a block of 64 wc threads): the tile's
// values are staged in shared memory (with error feedback the values sent for x + r, and x + r
// itself in a second row; zeros past the end, which code to 0), then each thread quantizes its
// group once, writes its width to the frame, stages its bit planes right after those of the
// groups before it in the tile, and its exceptions in excmask; with error feedback it also
// works out the new residuals, which the block writes back in the order it read them (the
// residual is read and written once, here). Then the tile's sizes (tile_totals). A group's 32
// values are a row of 33 floats in shared memory, so that both the coalesced staging and each
// thread's walk along its row are free of bank conflicts.
#define STAGE_ROW 33
// Where value i of a tile sits in the shared-memory rows: row i / 32, column i % 32.
__device__ __forceinline__ u32 stage_at(u32 i) { return (i / CFC_GROUP) * STAGE_ROW + i % CFC_GROUP; }
template <class D>
__device__ void encode_groups(const typename D::T* __restrict__ x, u64 n, u32 mode, double value,
                              u32 fixed, u8* body, u8* ws, float* __restrict__ residual,
                              const double* value_at) {
    // A bound read from device memory when the kernel runs (value_at), not fixed at the launch:
    // work recorded once as a CUDA graph is then replayed with each step's bound.
    if (value_at) value = *value_at;
    extern __shared__ float s_vals[];  // blockDim.x rows of STAGE_ROW (twice that with a residual)
    __shared__ u32 s_cw[TILE_CHUNKS], s_ce[TILE_CHUNKS], s_cwo[32];
    CfcParams* pp = (CfcParams*)ws;
    const u32 threads = blockDim.x, tid = threadIdx.x;
    const Tiles ts = tiles_at(ws, n, threads / CHUNK_GROUPS);
    CfcParams P = make_params(mode, value, __longlong_as_double((i64)pp->max_abs_bits));
    if (blockIdx.x == 0 && tid == 0) {  // for pass 2 and the host
        pp->step = P.step;
        pp->inv_step = P.inv_step;
        pp->eps = P.eps;
        pp->error = P.error;
    }
    // An unusable bound (rel) is reported on the host; the residual must then stay as it was.
    if (P.error) residual = nullptr;
    const u64 first = (u64)blockIdx.x * threads * CFC_GROUP;  // the tile's first value
    const u32 tile_values = threads * CFC_GROUP;
    const u32 have = first >= n ? 0 : (u32)min(n - first, (u64)tile_values);
    const typename D::T* xt = x + first;
    float* rt = residual ? residual + first : nullptr;
    float* s_comp = s_vals + threads * STAGE_ROW;  // with a residual: the compensated values
    // 16-byte loads (V values each) where the whole tile exists and the pointers allow it.
    constexpr u32 V = 16 / sizeof(typename D::T);
    const bool whole = have == tile_values && (u64)xt % 16 == 0 && (u64)rt % 16 == 0;
    if (whole) {
#pragma unroll 4
        for (u32 k = 0; k < CFC_GROUP / V; ++k) {
            const u32 i0 = (k * threads + tid) * V;  // V values of one row
            const u32 at = stage_at(i0);
            uint4 raw = ((const uint4*)xt)[k * threads + tid];
            float4 r4[V / 4];
            if (rt)
#pragma unroll
                for (u32 c = 0; c < V / 4; ++c) r4[c] = ((const float4*)(rt + i0))[c];
            stage_values<D, V>((const typename D::T*)&raw, rt ? (const float*)r4 : nullptr, s_vals + at, s_comp + at);
        }
    } else {  // one value at a time; zeros past the end (they code to 0, with no exception)
#pragma unroll 4
        for (u32 k = 0; k < CFC_GROUP; ++k) {
            const u32 i = k * threads + tid;
            const u32 at = stage_at(i);
            if (i < have)
                stage_values<D, 1>(xt + i, rt ? rt + i : nullptr, s_vals + at, s_comp + at);
            else if (rt)
                s_vals[at] = s_comp[at] = 0.0f;
            else
                s_vals[at] = 0.0f;
        }
    }
    __syncthreads();
    const u64 g = (u64)blockIdx.x * threads + tid;  // this thread's group
    u32* row = (u32*)s_vals + tid * STAGE_ROW;      // its values, then its codes
    u32 acc = 0, excm = 0, w8[8];  // w8: the low bytes of the codes (see slice_planes)
    double max_err = 0.0;
    // The row holds the codes after code_group; after code_group_f32 it still holds the values.
    // (Whether the route is on is the same for the whole launch; only a group it is unsure of
    // takes another branch.)
    bool codes_in_row = true;
    const float inv32 = __double2float_rn(P.inv_step);
    if (D::SIZE == 4 && !fixed && f32_route_on(P) && code_group_f32(row, inv32, &acc, w8)) {
        codes_in_row = false;  // float32 (the only 4-byte dtype), every value sure
    } else if (D::SIZE == 4 || fixed) {
        const GroupCoded c = code_group_f64<D>(row, P.step, P.inv_step, P.eps, fixed);
        acc = c.acc;
        excm = c.excm;
        max_err = c.max_err;
#pragma unroll
        for (int m = 0; m < 8; ++m)  // byte 0 of codes 4m .. 4m + 3
            w8[m] = __byte_perm(__byte_perm(row[4 * m], row[4 * m + 1], 0x40),
                                __byte_perm(row[4 * m + 2], row[4 * m + 3], 0x40), 0x5410);
    } else {
        code_group<D, false>(row, P, &acc, &excm, w8, &max_err);  // bfloat16, float16
    }
    const bool exists = g < ts.groups;
    const u32 w = !exists ? 0 : fixed ? fixed : 32 - __clz(acc);
    // The 8 lanes of a chunk: where this group's planes start in the slot, the chunk's totals.
    const u32 iw = cfc_lane_prefix_sum(w, CHUNK_GROUPS);
    const u32 ie = cfc_lane_prefix_sum((u32)__popc(excm), CHUNK_GROUPS);
    const u32 cw = __shfl_sync(CFC_FULL_MASK, iw, CHUNK_GROUPS - 1, CHUNK_GROUPS);
    const u32 ce = __shfl_sync(CFC_FULL_MASK, ie, CHUNK_GROUPS - 1, CHUNK_GROUPS);
    if (exists) {
        body[g] = (u8)w;
        if (ce) ts.excmask[g] = excm;
    }
    if (tid % CHUNK_GROUPS == CHUNK_GROUPS - 1) {
        s_cw[tid / CHUNK_GROUPS] = cw;
        s_ce[tid / CHUNK_GROUPS] = ce;
    }
    __syncthreads();
    if (tid < 32) {  // where each chunk's planes start among the tile's
        u32 v = tid < ts.tile_chunks ? s_cw[tid] : 0;
        s_cwo[tid] = cfc_lane_prefix_sum(v) - v;
    }
    __syncthreads();
    // The tile's planes are staged back to back, so that pass 2 moves them in one piece.
    u32* slot = ts.stage + (u64)blockIdx.x * ts.tile_chunks * (CHUNK_GROUPS * 32) +
                s_cwo[tid / CHUNK_GROUPS] + (iw - w);
    for (u32 s = 0; 8 * s < w; ++s) {
        if (s > 0) {  // byte s of every code, from the row
            if (!codes_in_row) {  // the float32 route left the values there: code them again
#pragma unroll
                for (int j = 0; j < CFC_GROUP; ++j) {
                    bool sure;  // (it was, the first time)
                    row[j] = f32_code(__uint_as_float(row[j]), inv32, &sure);
                }
                codes_in_row = true;
            }
            const u32 sel = s | (s + 4) << 4;
#pragma unroll
            for (int m = 0; m < 8; ++m)
                w8[m] = __byte_perm(__byte_perm(row[4 * m], row[4 * m + 1], sel),
                                    __byte_perm(row[4 * m + 2], row[4 * m + 3], sel), 0x5410);
        }
        u32 plane[8];
        slice_planes(w8, plane);
#pragma unroll
        for (u32 b = 0; b < 8; ++b)
            if (8 * s + b < w) slot[8 * s + b] = plane[b];
    }
    if (rt) {  // the new residuals, into the row; c kept where pass 2 may need it
        const bool keep = group_residuals<D>(row, s_comp + tid * STAGE_ROW, codes_in_row, inv32, P.step, excm);
        if (exists) {
            ts.gw[g] = (u8)(w | (keep ? GW_KEPT : 0u));
            if (keep)
                for (u32 j = 0; j < CFC_GROUP; ++j) ts.cvals[g * CFC_GROUP + j] = s_comp[tid * STAGE_ROW + j];
        }
    }
    if (fixed) block_max_to(&pp->max_err_bits, max_err);  // holds a __syncthreads
    __syncthreads();
    if (rt) {  // written back as they were read
        if (whole) {
#pragma unroll 4
            for (u32 k = 0; k < CFC_GROUP / 4; ++k) {
                const u32 i0 = (k * threads + tid) * 4;
                const float* at = s_vals + stage_at(i0);
                ((float4*)rt)[k * threads + tid] = make_float4(at[0], at[1], at[2], at[3]);
            }
        } else {
#pragma unroll 4
            for (u32 k = 0; k < CFC_GROUP; ++k) {
                const u32 i = k * threads + tid;
                if (i < have) rt[i] = s_vals[stage_at(i)];
            }
        }
    }
    if (tid < 32) {
        bool in = tid < ts.tile_chunks;
        tile_totals(ts, blockIdx.x, in ? s_cw[tid] : 0, in ? s_ce[tid] : 0);
    }
}

#define ENCODE_GROUPS(name, D)                                                                     \
    extern "C" __global__ __launch_bounds__(TILE_THREADS, 4) void cfc_codec_encode_groups_##name(  \
            const D::T* x, u64 n, u32 mode, double value, u32 fixed, u8* body, u8* ws,             \
            float* residual, const double* value_at) {                                             \
        encode_groups<D>(x, n, mode, value, fixed, body, ws, residual, value_at);                  \
    }
DEFINE_FOR_DTYPES(ENCODE_GROUPS)

// pack_chunks' work for chunk `ch` of a frame that falls back to raw, with error feedback (rare;
// run from a loop of its own, so that the common loop keeps its registers): each compensated
// value c is rebuilt as decoded + residual from the staged planes (pass 1 checked that this
// gives c back exactly) or read where pass 1 kept it; then the value sent for it as raw bytes,
// and the residual a raw frame leaves. `words_in_tile`: the chunk's first staged plane word
// among its tile's.
template <class D>
__device__ __forceinline__ void raw_chunk_with_feedback(const typename D::T* x, const Tiles& ts, u64 ch,
                                                        u32 words_in_tile, u32 have, u8* body, float* residual,
                                                        double step, bool typed) {
    const u32 lane = threadIdx.x & 31;
    const u64 g0 = ch * CHUNK_GROUPS, e0 = ch * CHUNK_VALUES;
    // Lane u < 8: group u's width, whether its c are kept, where its planes start.
    const u32 gw_l = lane < CHUNK_GROUPS && g0 + lane < ts.groups ? ts.gw[g0 + lane] : 0;
    const u32 wl = gw_l & ~GW_KEPT, inc = cfc_lane_prefix_sum(wl, CHUNK_GROUPS);
    const u32* planes_l = ts.stage + (ch / ts.tile_chunks) * ts.tile_chunks * (CHUNK_GROUPS * 32) + words_in_tile + inc - wl;
    for (u32 u = 0; u < CHUNK_GROUPS; ++u) {
        const u32 gwu = __shfl_sync(CFC_FULL_MASK, gw_l, u);
        const u32* planes = (const u32*)__shfl_sync(CFC_FULL_MASK, (u64)planes_l, u);
        const u32 j = u * CFC_GROUP + lane;
        if (j >= have) continue;
        float c;
        if (gwu & GW_KEPT) {
            c = ts.cvals[e0 + j];
        } else {
            const i64 q = code_at(planes, gwu, lane);
            c = D::to_f32(cfc_dequantize<D>(q, step)) + residual[e0 + j];
        }
        const typename D::T v = cfc_sent_value<D>(x[e0 + j], c);
        residual[e0 + j] = cfc_new_residual(c, D::to_f32(v));
        if (typed)
            ((typename D::T*)body)[e0 + j] = v;
        else
            cfc_store_le(body + (e0 + j) * D::SIZE, D::bits(v), D::SIZE);
    }
}

// Pass 2, with the tiles of pass 1 (a tile per block, its 8 warps taking wc chunks each): block 0
// writes the header and the frame size (also to size_to unless null: the head of a row that an
// exchange sends, without a copy queued after this kernel); then, as the totals decide (the CPU
// reference's rule), either the elements' raw bytes, or the tile's staged planes (by the whole
// block) and each chunk's exceptions in their places. With error feedback pass 1 has written the residuals a
// quantized frame leaves, and kept the compensated values c of groups with exceptions (whose
// values are sent as they are); only a frame that falls back to raw rewrites the residuals,
// each c being rebuilt as decoded + residual from the staged planes, or read where kept.
template <class D>
__device__ void pack_chunks(const typename D::T* __restrict__ x, u64 n, u32 dtype, u32 mode, u32 fixed,
                            u32 ndim, const Dims& dims, u8* __restrict__ out, u8* __restrict__ ws,
                            float* __restrict__ residual, u32 wc, u64* size_to, u64* max_to) {
    const CfcParams* pp = (const CfcParams*)ws;
    float* const residual_in = residual;  // (`residual` is cleared below where it must stay)
    const Tiles ts = tiles_at(ws, n, (TILE_THREADS / 32) * wc);
    const u32 size = D::SIZE;
    const u64 groups = ts.groups;
    const u64 header_len = 64 + 8 * (u64)ndim;
    u8* body = out + header_len;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // This warp's chunks (those of encode_groups' threads 8 k to 8 k + 7 for chunk k).
    const u64 ch0 = (u64)blockIdx.x * ts.tile_chunks + warp * wc;
    const u64 tile = blockIdx.x;
    const u64 tile_ch0 = tile * ts.tile_chunks;
    const bool tile_in = tile_ch0 < ts.chunks;
    // Every load the tile's copy of planes needs is issued here, together, before any of them
    // decides anything: the totals and parameters, the tile's sizes and offset, and its first
    // staged words (which lie in the tile's room whatever the totals say; past its planes they
    // are not used). Blocks are short, so one round trip instead of three matters. (The
    // chunks' own entries are read only where a chunk needs more than its planes.)
    const u32* staged = ts.stage + tile_ch0 * (CHUNK_GROUPS * 32);
    const u32 room = tile_in ? (u32)(min(tile_ch0 + ts.tile_chunks, ts.chunks) - tile_ch0) * CHUNK_VALUES : 0;
    const u32 k0 = threadIdx.x;
    const u32 cur0 = k0 < room ? staged[k0] : 0, prev0 = k0 > 0 && k0 <= room ? staged[k0 - 1] : 0;
    const uint4 last = tile_in ? ts.chunk_info[min(tile_ch0 + ts.tile_chunks, ts.chunks) - 1] : make_uint4(0, 0, 0, 0);
    const u64 tile_wb = tile_in ? words_before(ts, tile) : 0;
    const u64 nwords = ts.totals[0], n_exc = ts.totals[1];
    CfcParams P;
    P.step = pp->step;
    P.inv_step = pp->inv_step;
    P.eps = pp->eps;
    const u64 max_err_bits = pp->max_err_bits;
    if (pp->error) residual = nullptr;  // as in pass 1: leave the residual untouched
    const u64 idx_size = n <= (1ull << 32) ? 4 : 8;
    const u64 quant_len = groups + 4 * nwords + n_exc * (idx_size + size);
    const bool raw = !fixed && quant_len >= n * size;
    if (!raw && tile_in) {  // the tile's planes, staged back to back, in one piece
        // The output has room for a body smaller than the raw bytes (fixed rate excepted).
        const u8* limit = fixed ? (const u8*)~0ull : body + n * size;
        put_words_block(body + groups + 4 * tile_wb, staged, last.x + last.z, limit, cur0, prev0);
    }
    // Then, chunk by chunk, what the tile has besides planes: raw bytes (and residuals), exceptions.
    const bool typed = ((u64)body % size) == 0;  // raw bytes can be stored as elements
    if (raw && residual)  // (on its own, so that the loop below keeps its registers)
        for (u32 k = 0; k < wc && ch0 + k < ts.chunks; ++k)
            raw_chunk_with_feedback<D>(x, ts, ch0 + k, ts.chunk_info[ch0 + k].x, chunk_values(n, ch0 + k), body,
                                       residual, P.step, typed);
    const bool any = ch0 < ts.chunks && (raw || last.y + last.w) && !(raw && residual);
    const u64 eb = any ? excs_before(ts, tile) : 0;
    uint4 info[WARP_CHUNKS];  // x, y: words and exceptions before the chunk in its tile; z, w: own
#pragma unroll
    for (int k = 0; k < WARP_CHUNKS; ++k) {
        bool in = any && k < wc && ch0 + k < ts.chunks;
        info[k] = in ? ts.chunk_info[ch0 + k] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (u32 k = 0; k < WARP_CHUNKS; ++k) {  // unrolled: info[k] stays in registers
        const u64 ch = ch0 + k;
        if (!any || k >= wc || ch >= ts.chunks) break;  // the same for the whole warp
        const u64 e0 = ch * CHUNK_VALUES;
        const u32 have = chunk_values(n, ch);
        if (!(raw || info[k].w)) continue;
        // Each group's first exception slot: lane u < 8 holds group u's mask and slot.
        u32 mask_l = 0;
        u64 first_l = 0;
        if (!raw) {
            u64 g = ch * CHUNK_GROUPS + lane;
            mask_l = lane < CHUNK_GROUPS && g < groups ? ts.excmask[g] : 0;
            u32 inc = cfc_lane_prefix_sum((u32)__popc(mask_l), CHUNK_GROUPS);
            first_l = eb + info[k].y + inc - __popc(mask_l);
        }
        u8* idx = body + groups + 4 * nwords;
        u8* val = idx + n_exc * idx_size;
        const typename D::T* xc = x + e0;
        float* rc = residual ? residual + e0 : nullptr;
#pragma unroll 2
        for (int u = 0; u < CHUNK_GROUPS; ++u) {
            u32 mask = __shfl_sync(CFC_FULL_MASK, mask_l, u);
            u64 first = __shfl_sync(CFC_FULL_MASK, first_l, u);
            u32 j = u * CFC_GROUP + lane;
            bool is_exc = (mask >> lane) & 1u;
            if (j >= have || !(raw || is_exc)) continue;
            typename D::T v = xc[j];
            if (rc) v = cfc_sent_value<D>(v, ts.cvals[e0 + j]);  // an exception's c is kept
            if (raw) {
                if (typed)
                    ((typename D::T*)body)[e0 + j] = v;
                else
                    cfc_store_le(body + (e0 + j) * size, D::bits(v), size);
            } else if (is_exc) {
                u64 q = first + __popc(mask & ((1u << lane) - 1u));
                cfc_store_le(idx + q * idx_size, e0 + j, (int)idx_size);
                cfc_store_le(val + q * size, D::bits(v), size);
            }
        }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        u64 blen = raw ? n * size : quant_len;
        u64 eps = fixed ? max_err_bits : (u64)__double_as_longlong(P.eps);
        cfc_write_header(out, raw ? 1 : 0, dtype, mode, fixed, n, (u64)__double_as_longlong(P.step), eps,
                         raw ? 0 : n_exc, blen, ndim, dims);
        // An unusable bound (coded with eps 1, reported by the error word) leaves no frame that
        // a reader on the device would take: the sums and decoders that may read it before the
        // host waits check the magic, as the host's readers do.
        if (pp->error) out[0] = 0;
        *(u64*)(ws + 64) = header_len + blen;
        *(u32*)(ws + 72) = raw ? 1u : 0u;
        if (size_to) *size_to = header_len + blen;
    }
    // Error feedback's running maximum (cfc_hook's largest error sent): the largest finite
    // |residual| of this block's chunks raises *max_to unless null, here rather than in a kernel
    // of its own after this one. The residuals are final: pass 1 wrote a quantized frame's, and
    // only this warp writes its chunks' in this pass (a raw frame's; the sync orders its lanes).
    if (max_to && residual_in) {  // the same for the whole block: every thread reaches the sync
        __syncwarp();
        double m = 0.0;
        for (u32 k = 0; k < wc && ch0 + k < ts.chunks; ++k) {
            const float* rc = residual_in + (ch0 + k) * CHUNK_VALUES;
            const u32 have = chunk_values(n, ch0 + k);
            for (u32 j = lane; j < have; j += 32) {
                const float v = fabsf(rc[j]);
                if (v <= 3.402823466e38f) m = fmax(m, (double)v);  // finite only (NaN fails the test)
            }
        }
        block_max_to(max_to, m);
    }
}

#define PACK_CHUNKS(name, D)                                                                       \
    extern "C" __global__ void cfc_codec_pack_chunks_##name(const D::T* x, u64 n, u32 dtype,       \
            u32 mode, u32 fixed, u32 ndim, Dims dims, u8* out, u8* ws, float* residual, u32 wc,    \
            u64* size_to, u64* max_to) {                                                           \
        pack_chunks<D>(x, n, dtype, mode, fixed, ndim, dims, out, ws, residual, wc, size_to,       \
                       max_to);                                                                    \
    }
DEFINE_FOR_DTYPES(PACK_CHUNKS)

// ---- decode ------------------------------------------------------------------------------
// The frame was checked on the host (Header::parse and the body checks of src/codec.rs), or was
// written by the kernels above. Kernels read step, codec and exception count from the frame's
// own header on the device, so a frame that never left the GPU decodes without a host copy.

#define HDR_CODEC 5
#define HDR_STEP 24
#define HDR_NEXC 40

// The aligned word at `a` (4-aligned), keeping only its bytes below `end` (the rest read as 0):
// nothing at or past `end` is read.
__device__ __forceinline__ u32 load_word_before(const u8* a, const u8* end) {
    if (a + 4 <= end) return *(const u32*)a;
    u32 v = 0;
    for (u32 bi = 0; bi < 4 && a + bi < end; ++bi) v |= (u32)a[bi] << (8 * bi);
    return v;
}

// Pass 1 of decoding, one span (512 chunks) per block, two chunks per thread: each
// chunk's plane words from its widths, their offsets within the tile, the tiles' offsets
// within the span, the span's total; the last span to finish scans the spans. Leaves what the
// encoder's pass 1 leaves, except that the exception counts (which the decoder does not need)
// count the widths past MAX_DECODE_WIDTH instead: totals[1] is 0 for a frame cfc wrote, and
// check_frames refuses any other (its planes would not fit the decoders' staging).
#define MAX_DECODE_WIDTH 64
__device__ void decode_offsets(const u8* frame, u64 header_len, u64 n, u8* ws) {
    __shared__ u32 s_warp[TILE_THREADS / 32];
    __shared__ u32 s_wide;
    if (frame[HDR_CODEC] != 0) return;  // raw: every element's place is known
    const Tiles ts = tiles_at(ws, n, TILE_CHUNKS);
    const u8* body = frame + header_len;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 c0 = (u64)blockIdx.x * SPAN_TILES * TILE_CHUNKS + 2 * threadIdx.x;
    if (threadIdx.x == 0) s_wide = 0;
    u32 w0 = 0, w1 = 0, wide = 0;
#pragma unroll
    for (u32 k = 0; k < CHUNK_GROUPS; ++k) {
        u64 g = c0 * CHUNK_GROUPS + k;
        u32 a = g < ts.groups ? body[g] : 0, b = g + CHUNK_GROUPS < ts.groups ? body[g + CHUNK_GROUPS] : 0;
        w0 += a;
        w1 += b;
        wide += (a > MAX_DECODE_WIDTH) + (b > MAX_DECODE_WIDTH);
    }
    __syncthreads();  // s_wide is set
    if (wide) atomicAdd(&s_wide, wide);
    // A tile is TPT threads: scan within it, then over the warp's tiles, then over the warps.
    const u32 TPT = TILE_CHUNKS / 2;
    u32 pair = w0 + w1, in_tile = cfc_lane_prefix_sum(pair, TPT);
    u32 tile_total = __shfl_sync(CFC_FULL_MASK, in_tile, lane | (TPT - 1));
    if (c0 < ts.chunks) ts.chunk_info[c0] = make_uint4(in_tile - pair, 0, w0, 0);
    if (c0 + 1 < ts.chunks) ts.chunk_info[c0 + 1] = make_uint4(in_tile - pair + w0, 0, w1, 0);
    u32 in_warp = cfc_lane_prefix_sum(lane % TPT == TPT - 1 ? tile_total : 0u);
    if (lane == 31) s_warp[warp] = in_warp;
    __syncthreads();
    u32 before = 0, span_total = 0;
    for (u32 k = 0; k < TILE_THREADS / 32; ++k) {
        before += k < warp ? s_warp[k] : 0;
        span_total += s_warp[k];
    }
    u64 tile = (u64)blockIdx.x * SPAN_TILES + threadIdx.x / TPT;
    if (lane % TPT == TPT - 1 && tile < ts.tiles) {
        ts.tile_words[tile] = before + in_warp - tile_total;
        ts.tile_excs[tile] = 0;
    }
    if (warp != 0) return;
    u32 last = 0;
    if (lane == 0) {
        ts.span_words[blockIdx.x] = span_total;
        ts.span_excs[blockIdx.x] = s_wide;  // the __syncthreads above follows every atomicAdd
        __threadfence();  // the span's total is visible before it counts as done
        last = atomicAdd(ts.done, 1u) == ts.spans - 1;
    }
    if (!__shfl_sync(CFC_FULL_MASK, last, 0)) return;
    __threadfence();
    u64 sw, se;
    warp_scan_pairs(ts.span_words, ts.span_excs, ts.spans, &sw, &se);
    if (lane == 0) {
        ts.totals[0] = sw;
        ts.totals[1] = se;
    }
}

extern "C" __global__ void cfc_codec_decode_offsets(const u8* frame, u64 header_len, u64 n, u8* ws) {
    decode_offsets(frame, header_len, n, ws);
}

// One warp copies chunk `ch`'s planes (decode_offsets has run), realigned, to `st` (up to 64
// words per group). Lane u < 8 gets group u's width in *wl and, in *inc, the plane words up to
// and including that group (so group u's planes are st[inc - wl, inc)).
__device__ __forceinline__ void stage_chunk_planes(const u8* body, const Tiles& ts, u64 ch, u32* st, u32* wl,
                                                   u32* inc) {
    const u32 lane = threadIdx.x & 31;
    *wl = lane < CHUNK_GROUPS && ch * CHUNK_GROUPS + lane < ts.groups ? body[ch * CHUNK_GROUPS + lane] : 0;
    *inc = cfc_lane_prefix_sum(*wl, CHUNK_GROUPS);
    const u32 nw = __shfl_sync(CFC_FULL_MASK, *inc, CHUNK_GROUPS - 1);
    const uint4 info = ts.chunk_info[ch];
    const u8* pb = body + ts.groups + 4 * (words_before(ts, ch / TILE_CHUNKS) + info.x);
    const u8* end = pb + 4 * (u64)nw;
    const u32 sh = (u32)((u64)pb & 3);
    const u8* a0 = pb - sh;  // still inside the frame: the widths come before
    for (u32 k = lane; k < nw; k += 32) {
        u32 lo = *(const u32*)(a0 + 4 * k);
        st[k] = sh == 0 ? lo : __funnelshift_r(lo, load_word_before(a0 + 4 * k + 4, end), 8 * sh);
    }
    __syncwarp();
}

// Up to 8 decoded values v[0..cnt) to dst: 16-byte stores where all 8 exist and dst allows.
template <class D>
__device__ __forceinline__ void store_8(typename D::T* dst, const typename D::T* v, u32 cnt) {
    if (cnt == 8 && (u64)dst % 16 == 0) {
        u32 b[8];
#pragma unroll
        for (u32 i = 0; i < 8; ++i) b[i] = D::bits(v[i]);
        if (D::SIZE == 4) {
            ((uint4*)dst)[0] = make_uint4(b[0], b[1], b[2], b[3]);
            ((uint4*)dst)[1] = make_uint4(b[4], b[5], b[6], b[7]);
        } else {
            *(uint4*)dst = make_uint4(b[0] | b[1] << 16, b[2] | b[3] << 16, b[4] | b[5] << 16, b[6] | b[7] << 16);
        }
        return;
    }
#pragma unroll
    for (u32 i = 0; i < 8; ++i)
        if (i < cnt) dst[i] = v[i];
}

// Pass 2, one chunk per warp: the chunk's planes copied, realigned, to the warp's part of
// shared memory; then 4 lanes per group, each rebuilding 8 consecutive codes a byte at a time
// (unslice_codes) and writing their values together. Widths past 32 (frames of summed codes,
// up to 64 bits) take one bit at a time. Raw frames: the elements are copied.
template <class D>
__device__ void decode_chunks(const u8* frame, u64 header_len, u64 n, u8* ws, typename D::T* __restrict__ out) {
    __shared__ u32 stage[TILE_THREADS / 32][CHUNK_GROUPS * 64];  // a part per warp
    const Tiles ts = tiles_at(ws, n, TILE_CHUNKS);
    const u8* body = frame + header_len;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 ch = (u64)blockIdx.x * (TILE_THREADS / 32) + warp;  // a chunk per warp
    if (ch >= ts.chunks) return;
    const u64 e0 = ch * CHUNK_VALUES;
    const u32 have = chunk_values(n, ch);
    typename D::T* oc = out + e0;
    if (frame[HDR_CODEC] != 0) {
        bool typed = ((u64)body % D::SIZE) == 0;
        for (u32 j = lane; j < have; j += 32)
            oc[j] = typed ? ((const typename D::T*)body)[e0 + j]
                          : D::from_bits((u32)cfc_load_le(body + (e0 + j) * D::SIZE, D::SIZE));
        return;
    }
    u32 wl, inc;
    const u32* st = stage[warp];
    stage_chunk_planes(body, ts, ch, stage[warp], &wl, &inc);
    const double step = __longlong_as_double((i64)cfc_load_le(frame + HDR_STEP, 8));
    const u32 u = lane / 4, k = lane % 4;  // this lane: codes 8k .. 8k + 7 of group u
    const u32 w = __shfl_sync(CFC_FULL_MASK, wl, u);
    const u32* planes = st + __shfl_sync(CFC_FULL_MASK, inc - wl, u);
    const u32 j0 = u * CFC_GROUP + 8 * k;  // the first of them in the chunk
    typename D::T v[8];
    if (w <= 32) {
        u32 z[8];
        unslice_codes(planes, w, k, z);
#pragma unroll
        for (u32 i = 0; i < 8; ++i) v[i] = decode_zigzag32<D>(z[i], step);
    } else {  // sums of codes: up to 64 bits
#pragma unroll
        for (u32 i = 0; i < 8; ++i) v[i] = D::from_f32(__double2float_rn((double)code_at(planes, w, 8 * k + i) * step));
    }
    store_8<D>(oc + j0, v, j0 >= have ? 0 : min(have - j0, 8u));
}

#define DECODE_CHUNKS(name, D)                                                                     \
    extern "C" __global__ void cfc_codec_decode_chunks_##name(const u8* frame, u64 header_len,     \
            u64 n, u8* ws, D::T* out) {                                                            \
        decode_chunks<D>(frame, header_len, n, ws, out);                                           \
    }
DEFINE_FOR_DTYPES(DECODE_CHUNKS)

// After decode_chunks (which wrote code 0's value there): every exception's stored bits.
template <class D>
__device__ void scatter_exceptions(const u8* frame, u64 header_len, u64 n, u64 groups, const u64* nwords,
                                   typename D::T* out) {
    u64 n_exc = frame[HDR_CODEC] == 0 ? cfc_load_le(frame + HDR_NEXC, 8) : 0;
    if (n_exc == 0) return;
    u64 idx_size = n <= (1ull << 32) ? 4 : 8;
    const u8* idx = frame + header_len + groups + 4 * *nwords;
    const u8* val = idx + n_exc * idx_size;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n_exc; k += (u64)gridDim.x * blockDim.x) {
        u64 i = cfc_load_le(idx + k * idx_size, (int)idx_size);
        if (i < n) out[i] = D::from_bits((u32)cfc_load_le(val + k * D::SIZE, D::SIZE));
    }
}

#define SCATTER(name, D)                                                                           \
    extern "C" __global__ void cfc_codec_scatter_exceptions_##name(const u8* frame, u64 header_len, \
            u64 n, u64 groups, const u64* nwords, D::T* out) {                                     \
        scatter_exceptions<D>(frame, header_len, n, groups, nwords, out);                          \
    }
DEFINE_FOR_DTYPES(SCATTER)

// ---- sums of frames ----------------------------------------------------------------------
// The device side of src/sum.rs (Codes::sum, then Codes::to_frame without zstd), for frames of
// one dtype and length, checked on the host or written by the kernels above. sum_offsets finds
// where every part's chunks lie (decode_offsets, a part per grid row, each in its own region of
// the workspace); sum_chunks then takes a chunk of the sum per warp and, part after part in
// order, adds the part's codes into registers (0 where the part holds an exception, which its
// sorted exception list tells), and writes the sum's widths, codes (`acc`, i64) and exception
// mask, and the chunk's sizes (tile_totals). Where any part holds an exception, sum_values adds
// every part's decoded value there in f64, in part order, and keeps the bits the sum stores
// (`value_bits`). sum_pack writes the frame, as the encoder's pass 2 does. The workspace's
// CfcParams carry the step (the first part's), eps (the parts' eps added in order) and the
// error bits below; a frame with an error gets size 0.
#define HDR_EPS 32
#define SUM_STEPS_DIFFER 1u
#define SUM_OVERFLOW 2u
#define SUM_BAD_FRAME 4u  // set by check_frames: the sum's kernels then add nothing
#define SUM_EPS_OVERFLOW 8u  // the parts' eps add up past the largest f64 (the CPU refuses it too)

// The bits a sum's exception stores for the f64 total of the parts' values there (sum_bits in
// src/sum.rs): rounded to f32, then to the dtype; NaN as the quiet NaN, whatever its payload.
template <class D>
__device__ __forceinline__ u32 sum_value_bits(double total) {
    float f = isnan(total) ? __int_as_float(0x7fc00000) : __double2float_rn(total);
    return D::bits(D::from_f32(f));
}

// Addresses of up to 8 parts' frames (`count`), from the launch's arguments into `table` (a
// Dims is eight u64 passed by value): the sum's kernels read the frames through the table.
extern "C" __global__ void cfc_codec_sum_table(u64* table, Dims batch, u32 count) {
    if (threadIdx.x < count) table[threadIdx.x] = batch.d[threadIdx.x];
}

// Each frame's length in the table (after the addresses) lowered to the u64 `back` bytes before
// the frame, where that is smaller (a row's head, as cfc's exchanges lay frames out): for work
// recorded once as a CUDA graph and replayed with each step's lengths. The table's own value is
// the room the frame lies in, so a head that says more is never read past.
extern "C" __global__ void cfc_codec_sum_lens(u64* table, u32 parts, u64 back) {
    for (u32 j = threadIdx.x; j < parts; j += blockDim.x) {
        const u64 head = *(const u64*)(table[j] - back);
        if (head < table[parts + j]) table[parts + j] = head;
    }
}

// Every part's chunk offsets: part blockIdx.y's frame, in its region of `stride` bytes at `parts`.
extern "C" __global__ void cfc_codec_sum_offsets(const u64* frames, u64 header_len, u64 n, u8* parts, u64 stride) {
    decode_offsets((const u8*)frames[blockIdx.y], header_len, n, parts + blockIdx.y * stride);
}

// ---- checks of frames from elsewhere ------------------------------------------------------
// The kernels that add frames (sum_chunks, sum_values, decode_sum) read what a frame's header,
// widths and exception list say, trusting them: frames that another rank sent are checked
// here first, on the device (the host sees only their sizes), and nothing is added if one
// fails. A frame whose bytes were corrupted on the way, or written by something other than
// cfc's codec, then ends in a reported error, never in a read past its end.
#define HDR_N 16
#define HDR_BODY_LEN 48
#define HDR_RAW_BODY_LEN 56

__device__ __forceinline__ void report_bad_frame(u32* status, u32 bit, u32 part) {
    atomicOr(&status[0], bit);
    atomicCAS(&status[1], 0u, part + 1);  // the first bad frame found, counted from 1
}

// Whether the header fields that the CPU's read_header checks and the length checks below do
// not cover are as it requires: a known bound mode that fits the codec, bits only in bits mode
// (2 to 32), reserved bytes zero, dimensions below 2^63 that multiply to n without overflow, a finite
// positive step and a finite eps >= 0 (step 1 and eps 0 in lossless mode), no exceptions in a
// raw frame. A step of NaN or infinity would otherwise reach the output as values. With
// `match_dims`, each dimension must also be the caller's (a sum writes its frame with the
// caller's shape, and the CPU refuses frames of another shape); without, any that multiply to n.
__device__ __forceinline__ bool header_fields_ok(const u8* f, u64 n, u32 ndim, const Dims& dims, bool match_dims,
                                                 bool raw) {
    const u8 mode = f[8], bits = f[11];
    bool ok = mode <= 4 && !(mode == 4 && !raw) && (mode == 2 ? bits >= 2 && bits <= 32 : bits == 0) &&
              (f[12] | f[13] | f[14] | f[15]) == 0;
    u64 prod = 1;
    for (u32 i = 0; i < ndim; i++) {
        const u64 d = cfc_load_le(f + 64 + 8 * i, 8);
        ok &= (d == 0 || __umul64hi(prod, d) == 0) && (d >> 63) == 0 && (!match_dims || d == dims.d[i]);
        prod *= d;
    }
    const double step = __longlong_as_double((long long)cfc_load_le(f + HDR_STEP, 8));
    const double eps = __longlong_as_double((long long)cfc_load_le(f + HDR_EPS, 8));
    ok &= prod == n && isfinite(step) && step > 0.0 && isfinite(eps) && eps >= 0.0;
    if (mode == 4) ok &= step == 1.0 && eps == 0.0;
    if (raw) ok &= cfc_load_le(f + HDR_NEXC, 8) == 0;
    return ok;
}

// Whether frame p = blockIdx.y (at table[p], with table[parts + p] bytes readable there, its
// chunk offsets in its region after sum_offsets) is a quantized or raw frame without a zstd
// stage of n elements of `dtype` (`size` bytes each) in `ndim` dimensions, with a header the
// CPU would read (header_fields_ok; dimensions `dims` if `match_dims`), whose widths are at most MAX_DECODE_WIDTH and whose
// widths, planes and exceptions fill its body exactly, within its bytes, with exception
// indices increasing and below n. One that is not sets `bit` in status[0] and its index + 1 in
// status[1] (if none is there yet). Every block of row p checks the header; the blocks share
// out the exception list.
extern "C" __global__ void cfc_codec_check_frames(const u64* table, u32 parts, u64 header_len, u64 n, u32 dtype,
                                                  u32 size, u32 ndim, Dims dims, u32 match_dims, u8* regions,
                                                  u64 stride, u32* status, u32 bit) {
    const u32 p = blockIdx.y;
    const u8* f = (const u8*)table[p];
    const u64 len = table[parts + p];
    const u64 groups = (n + CFC_GROUP - 1) / CFC_GROUP, idx_size = n <= (1ull << 32) ? 4 : 8;
    bool ok = len >= header_len && f[0] == 'C' && f[1] == 'F' && f[2] == 'C' && f[3] == 'F' && f[4] == 1 &&
              f[5] <= 1 && f[6] == dtype && f[7] == 0 && f[9] == ndim && f[10] == 5;
    u64 blen = 0, n_exc = 0, nwords = 0;
    if (ok) {
        blen = cfc_load_le(f + HDR_BODY_LEN, 8);
        ok = cfc_load_le(f + HDR_N, 8) == n && cfc_load_le(f + HDR_RAW_BODY_LEN, 8) == blen && blen <= len - header_len;
    }
    const bool raw = f[5] == 1;
    ok = ok && header_fields_ok(f, n, ndim, dims, match_dims != 0, raw);
    if (ok && raw) {
        ok = blen == n * size;
    } else if (ok) {
        const Tiles ts = tiles_at(regions + p * stride, n, TILE_CHUNKS);
        n_exc = cfc_load_le(f + HDR_NEXC, 8);
        nwords = ts.totals[0];
        ok = ts.totals[1] == 0 && n_exc <= n && blen == groups + 4 * nwords + n_exc * (idx_size + size);
    }
    if (!ok) {
        if (threadIdx.x == 0) report_bad_frame(status, bit, p);
        return;
    }
    if (raw || n_exc == 0) return;
    const u8* idx = f + header_len + groups + 4 * nwords;
    bool in_order = true;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n_exc; k += (u64)gridDim.x * blockDim.x) {
        const u64 i = cfc_load_le(idx + k * idx_size, (int)idx_size);
        in_order &= i < n && (k + 1 == n_exc || cfc_load_le(idx + (k + 1) * idx_size, (int)idx_size) > i);
    }
    if (!in_order) report_bad_frame(status, bit, p);
}

// First k in [0, count) whose exception index is >= i (count if none): exception indices are
// strictly increasing (checked on the host, or written so by the encoder).
__device__ __forceinline__ u64 exception_at_or_after(const u8* idx, u64 idx_size, u64 count, u64 i) {
    u64 lo = 0, hi = count;
    while (lo < hi) {
        u64 mid = (lo + hi) / 2;
        if (cfc_load_le(idx + mid * idx_size, (int)idx_size) < i) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// One part's view of chunk `ch` for this warp: the codes of the lanes' elements (group u in
// q[u]), and in *exc bit u whether the part stores that element as an exception (raw parts:
// all), with the stored bits in exc_bits[u]. Stages the planes in `st` (the warp's shared memory)
// and uses `s_mask` (8 words of the warp's shared memory).
template <class D>
__device__ __forceinline__ void part_chunk(const u8* frame, u64 header_len, u64 n, u8* ws, u64 ch, u32 have,
                                           u32* st, u32* s_mask, i64* q, u32* exc, u32* exc_bits,
                                           bool want_bits) {
    const u32 lane = threadIdx.x & 31;
    const u8* body = frame + header_len;
    const u64 e0 = ch * CHUNK_VALUES;
    *exc = 0;
    if (frame[HDR_CODEC] != 0) {  // raw: every element stored as it is
#pragma unroll
        for (int u = 0; u < CHUNK_GROUPS; ++u) {
            u32 j = u * CFC_GROUP + lane;
            q[u] = 0;
            if (j < have) {
                *exc |= 1u << u;
                if (want_bits) exc_bits[u] = (u32)cfc_load_le(body + (e0 + j) * D::SIZE, D::SIZE);
            }
        }
        return;
    }
    const Tiles ts = tiles_at(ws, n, TILE_CHUNKS);
    u32 wl, inc;
    stage_chunk_planes(body, ts, ch, st, &wl, &inc);
#pragma unroll
    for (int u = 0; u < CHUNK_GROUPS; ++u) {
        q[u] = lane_code(st + __shfl_sync(CFC_FULL_MASK, inc - wl, u), __shfl_sync(CFC_FULL_MASK, wl, u));
        // Past the last element, a group's codes are padding, which the format leaves free and
        // the CPU's sum never reads: 0 here, so that they neither overflow nor reach the sum.
        if (u * CFC_GROUP + lane >= have) q[u] = 0;
    }
    const u64 n_exc = cfc_load_le(frame + HDR_NEXC, 8);
    if (n_exc == 0) return;
    // The part's exceptions in this chunk: a run of its sorted list, marked in s_mask.
    const u64 idx_size = n <= (1ull << 32) ? 4 : 8;
    const u64 groups = ts.groups;
    u64 nwords = 0;  // the part's plane words: the last chunk's offset and size
    {
        const uint4 last = ts.chunk_info[ts.chunks - 1];
        nwords = words_before(ts, (ts.chunks - 1) / TILE_CHUNKS) + last.x + last.z;
    }
    const u8* idx = body + groups + 4 * nwords;
    const u8* val = idx + n_exc * idx_size;
    if (lane < CHUNK_GROUPS) s_mask[lane] = 0;
    __syncwarp();
    const u64 k0 = exception_at_or_after(idx, idx_size, n_exc, e0);
    for (u64 k = k0 + lane; k < n_exc; k += 32) {
        u64 i = cfc_load_le(idx + k * idx_size, (int)idx_size);
        if (i >= e0 + have) break;
        atomicOr(&s_mask[(i - e0) / CFC_GROUP], 1u << ((i - e0) % CFC_GROUP));
    }
    __syncwarp();
#pragma unroll
    for (int u = 0; u < CHUNK_GROUPS; ++u) {
        if (!((s_mask[u] >> lane) & 1u)) continue;
        *exc |= 1u << u;
        q[u] = 0;
        if (want_bits) {
            u64 k = exception_at_or_after(idx, idx_size, n_exc, e0 + u * CFC_GROUP + lane);
            exc_bits[u] = (u32)cfc_load_le(val + k * D::SIZE, D::SIZE);
        }
    }
    __syncwarp();  // s_mask is reused by the next part
}

// One part's decoded values of this lane's elements of chunk `ch` (group u in v[u]), what
// decompress gives: the stored bits where the part holds an exception, else its code times its
// step (part_chunk's staging and s_mask use).
template <class D>
__device__ __forceinline__ void part_values(const u8* frame, u64 header_len, u64 n, u8* ws, u64 ch, u32 have,
                                            u32* st, u32* s_mask, typename D::T* v) {
    const double step = __longlong_as_double((i64)cfc_load_le(frame + HDR_STEP, 8));
    i64 q[CHUNK_GROUPS];
    u32 exc, exc_bits[CHUNK_GROUPS];
    part_chunk<D>(frame, header_len, n, ws, ch, have, st, s_mask, q, &exc, exc_bits, true);
#pragma unroll
    for (int u = 0; u < CHUNK_GROUPS; ++u)
        v[u] = (exc >> u) & 1u ? D::from_bits(exc_bits[u]) : cfc_dequantize<D>(q[u], step);
}

// The sum, a chunk per warp in tiles of 8 chunks (pass 1 of packing it; see above).
template <class D>
__device__ void sum_chunks(const u64* frames, u32 parts, u64 header_len, u64 n, u8* part_ws, u64 stride,
                           i64* acc, u32* union_mask, u8* body, u8* ws) {
    __shared__ u32 stage[TILE_THREADS / 32][CHUNK_GROUPS * 64];  // a part per warp
    __shared__ u32 s_masks[TILE_THREADS / 32][CHUNK_GROUPS];
    __shared__ u32 s_cw[TILE_THREADS / 32], s_ce[TILE_THREADS / 32];
    CfcParams* pp = (CfcParams*)ws;
    if (pp->error & SUM_BAD_FRAME) return;  // the whole block
    const Tiles ts = tiles_at(ws, n, TILE_THREADS / 32);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (blockIdx.x == 0 && threadIdx.x == 0) {  // the header fields every part must agree on
        const u64 step = cfc_load_le((const u8*)frames[0] + HDR_STEP, 8);
        double eps = 0.0;
        u32 err = 0;
        for (u32 p = 0; p < parts; ++p) {
            const u8* f = (const u8*)frames[p];
            if (cfc_load_le(f + HDR_STEP, 8) != step) err |= SUM_STEPS_DIFFER;
            eps += __longlong_as_double((i64)cfc_load_le(f + HDR_EPS, 8));
        }
        if (!isfinite(eps)) err |= SUM_EPS_OVERFLOW;
        pp->step = __longlong_as_double((i64)step);
        pp->eps = eps;
        atomicOr(&pp->error, err);
    }
    const u64 ch = (u64)blockIdx.x * ts.tile_chunks + warp;
    const u32 have = chunk_values(n, ch);  // 0 for the warps past the end
    const u32 have_groups = (have + CFC_GROUP - 1) / CFC_GROUP;
    u32 cw = 0, ce = 0;
    if (have) {
        const u64 e0 = ch * CHUNK_VALUES;
        i64 sum[CHUNK_GROUPS], q[CHUNK_GROUPS];
        u32 exc_bits[CHUNK_GROUPS];  // unused: no bits asked for
        u32 any_exc = 0;  // bit u: some part stores this lane's element of group u as an exception
        bool overflow = false;
#pragma unroll
        for (int u = 0; u < CHUNK_GROUPS; ++u) sum[u] = 0;
        for (u32 p = 0; p < parts; ++p) {
            u32 exc;
            part_chunk<D>((const u8*)frames[p], header_len, n, part_ws + p * stride, ch, have, stage[warp],
                          s_masks[warp], q, &exc, exc_bits, false);
            any_exc |= exc;
#pragma unroll
            for (int u = 0; u < CHUNK_GROUPS; ++u) {
                i64 s = (i64)((u64)sum[u] + (u64)q[u]);
                overflow |= ((sum[u] ^ s) & (q[u] ^ s)) < 0;  // both operands' sign differs from the sum's
                sum[u] = s;
            }
        }
        if (__any_sync(CFC_FULL_MASK, overflow) && lane == 0) atomicOr(&pp->error, SUM_OVERFLOW);
        u32 mine = 0, my_mask = 0;
#pragma unroll
        for (int u = 0; u < CHUNK_GROUPS; ++u) {
            const u32 j = u * CFC_GROUP + lane;
            const bool is_exc = (any_exc >> u) & 1u;
            const u32 mask = __ballot_sync(CFC_FULL_MASK, is_exc);
            const u64 z = j < have && !is_exc ? ((u64)sum[u] << 1) ^ (u64)(sum[u] >> 63) : 0;
            const u32 hi = __reduce_or_sync(CFC_FULL_MASK, (u32)(z >> 32));
            const u32 lo = __reduce_or_sync(CFC_FULL_MASK, (u32)z);
            const u32 w = hi ? 64 - __clz(hi) : 32 - __clz(lo);
            if (lane == u) {
                mine = w;
                my_mask = mask;
            }
            if (u < have_groups) {
                cw += w;
                ce += __popc(mask);
            }
            if (j < have) acc[e0 + j] = is_exc ? 0 : sum[u];
        }
        if (lane < have_groups) {
            body[ch * CHUNK_GROUPS + lane] = (u8)mine;
            union_mask[ch * CHUNK_GROUPS + lane] = my_mask;
        }
    }
    if (lane == 0) {
        s_cw[warp] = cw;
        s_ce[warp] = ce;
    }
    __syncthreads();
    if (warp == 0) {
        bool in = lane < ts.tile_chunks;
        tile_totals(ts, blockIdx.x, in ? s_cw[lane] : 0, in ? s_ce[lane] : 0);
    }
}

// Where the sum holds an exception (after sum_chunks): every part's decoded value there, added
// in f64 in part order, and the bits the sum stores, a chunk per warp (chunks without any
// exception return at once).
template <class D>
__device__ void sum_values(const u64* frames, u32 parts, u64 header_len, u64 n, u8* part_ws, u64 stride,
                           const u32* union_mask, u32* value_bits, const u32* error) {
    __shared__ u32 stage[TILE_THREADS / 32][CHUNK_GROUPS * 64];  // a part per warp
    __shared__ u32 s_masks[TILE_THREADS / 32][CHUNK_GROUPS];
    if (*error & SUM_BAD_FRAME) return;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 ch = (u64)blockIdx.x * (TILE_THREADS / 32) + warp;
    const u32 have = chunk_values(n, ch);
    const u32 have_groups = (have + CFC_GROUP - 1) / CFC_GROUP;
    const u32 mask_l = lane < have_groups ? union_mask[ch * CHUNK_GROUPS + lane] : 0;
    if (!__any_sync(CFC_FULL_MASK, mask_l)) return;
    u32 mine = 0;  // bit u: the sum stores this lane's element of group u as an exception
#pragma unroll
    for (int u = 0; u < CHUNK_GROUPS; ++u) mine |= ((__shfl_sync(CFC_FULL_MASK, mask_l, u) >> lane) & 1u) << u;
    double total[CHUNK_GROUPS];
    typename D::T v[CHUNK_GROUPS];
#pragma unroll
    for (int u = 0; u < CHUNK_GROUPS; ++u) total[u] = 0.0;
    for (u32 p = 0; p < parts; ++p) {
        part_values<D>((const u8*)frames[p], header_len, n, part_ws + p * stride, ch, have, stage[warp],
                       s_masks[warp], v);
#pragma unroll
        for (int u = 0; u < CHUNK_GROUPS; ++u)
            if ((mine >> u) & 1u) total[u] += D::to_f64(v[u]);
    }
    const u64 e0 = ch * CHUNK_VALUES;
#pragma unroll
    for (int u = 0; u < CHUNK_GROUPS; ++u)
        if ((mine >> u) & 1u) value_bits[e0 + u * CFC_GROUP + lane] = sum_value_bits<D>(total[u]);
}

#define SUM_VALUES(name, D)                                                                        \
    extern "C" __global__ void cfc_codec_sum_values_##name(const u64* frames, u32 parts,           \
            u64 header_len, u64 n, u8* part_ws, u64 stride, const u32* union_mask,                 \
            u32* value_bits, const u32* error) {                                                   \
        sum_values<D>(frames, parts, header_len, n, part_ws, stride, union_mask, value_bits, error); \
    }
DEFINE_FOR_DTYPES(SUM_VALUES)

#define SUM_CHUNKS(name, D)                                                                        \
    /* at most 80 registers: 3 blocks per SM */                                                 \
    extern "C" __global__ __launch_bounds__(TILE_THREADS, 3) void cfc_codec_sum_chunks_##name(const u64* frames, u32 parts,           \
            u64 header_len, u64 n, u8* part_ws, u64 stride, i64* acc, u32* union_mask, u8* body,   \
            u8* ws) {                                                                              \
        sum_chunks<D>(frames, parts, header_len, n, part_ws, stride, acc, union_mask, body, ws);   \
    }
DEFINE_FOR_DTYPES(SUM_CHUNKS)

// ---- decoded sums (unpack + add + scale + write the output dtype) -------------------------
// The average at the end of an all-reduce in one pass: frames of one dtype and length (each with
// its own step), checked on the host or written by the kernels above, decoded and added element
// by element, scaled, and written in the output dtype, a chunk per warp after sum_offsets:
//   out[i] = O(s * (v_0[i] + v_1[i] + ...))
// where v_p[i] is what decompress gives for frame p (its dtype's value, exceptions included),
// widened to f32, and the sum runs in f32 in part order from v_0 (so -0.0 stays -0.0). The
// product is skipped when s is 1: one frame then decodes to decompress's values, into any of
// the three output dtypes (a NaN comes out as the output dtype's canonical quiet NaN, whatever
// its payload was). Nothing but the output is written: the average of an
// all-reduce needs no decoded copy of each rank's frame.
template <class D, class O>
__device__ void decode_sum(const u64* frames, u32 parts, u64 header_len, u64 n, u8* part_ws, u64 stride,
                           float scale, typename O::T* __restrict__ out, const u32* status) {
    __shared__ u32 stage[TILE_THREADS / 32][CHUNK_GROUPS * 64];  // a part per warp
    __shared__ u32 s_masks[TILE_THREADS / 32][CHUNK_GROUPS];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 ch = (u64)blockIdx.x * (TILE_THREADS / 32) + warp;
    const u32 have = chunk_values(n, ch);
    if (have == 0) return;  // the whole warp: past the end
    if (*status) return;    // a frame failed check_frames (or an earlier call did): nothing is written
    float acc[CHUNK_GROUPS];
    typename D::T v[CHUNK_GROUPS];
    for (u32 p = 0; p < parts; ++p) {
        part_values<D>((const u8*)frames[p], header_len, n, part_ws + p * stride, ch, have, stage[warp],
                       s_masks[warp], v);
#pragma unroll
        for (int u = 0; u < CHUNK_GROUPS; ++u) acc[u] = p == 0 ? D::to_f32(v[u]) : acc[u] + D::to_f32(v[u]);
    }
    typename O::T* oc = out + ch * CHUNK_VALUES;
#pragma unroll
    for (int u = 0; u < CHUNK_GROUPS; ++u) {
        const u32 j = u * CFC_GROUP + lane;
        const float r = scale == 1.0f ? acc[u] : acc[u] * scale;
        // A NaN is written as the dtype's canonical quiet NaN: which payload f32 arithmetic
        // and the f16 widening leave differs between machines (the CPU reference does this too).
        if (j < have) oc[j] = O::from_f32(isnan(r) ? __int_as_float(0x7fc00000) : r);
    }
}

#define DECODE_SUM_TO_F32(name, D)                                                                 \
    /* at most 80 registers: 3 blocks per SM */                                                    \
    extern "C" __global__ __launch_bounds__(TILE_THREADS, 3)                                       \
    void cfc_codec_decode_sum_to_f32_##name(const u64* frames, u32 parts,                          \
            u64 header_len, u64 n, u8* part_ws, u64 stride, double scale, float* out,              \
            const u32* status) {                                                                   \
        decode_sum<D, F32>(frames, parts, header_len, n, part_ws, stride, (float)scale, out, status); \
    }
#define DECODE_SUM_TO_BF16(name, D)                                                                \
    /* at most 80 registers: 3 blocks per SM */                                                    \
    extern "C" __global__ __launch_bounds__(TILE_THREADS, 3)                                       \
    void cfc_codec_decode_sum_to_bf16_##name(const u64* frames, u32 parts,                         \
            u64 header_len, u64 n, u8* part_ws, u64 stride, double scale, u16* out,                \
            const u32* status) {                                                                   \
        decode_sum<D, BF16>(frames, parts, header_len, n, part_ws, stride, (float)scale, out, status); \
    }
#define DECODE_SUM_TO_F16(name, D)                                                                 \
    /* at most 80 registers: 3 blocks per SM */                                                    \
    extern "C" __global__ __launch_bounds__(TILE_THREADS, 3)                                       \
    void cfc_codec_decode_sum_to_f16_##name(const u64* frames, u32 parts,                          \
            u64 header_len, u64 n, u8* part_ws, u64 stride, double scale, u16* out,                \
            const u32* status) {                                                                   \
        decode_sum<D, F16>(frames, parts, header_len, n, part_ws, stride, (float)scale, out, status); \
    }
DEFINE_FOR_DTYPES(DECODE_SUM_TO_F32)
DEFINE_FOR_DTYPES(DECODE_SUM_TO_BF16)
DEFINE_FOR_DTYPES(DECODE_SUM_TO_F16)

// Pass 2 of packing a sum, with the geometry of sum_chunks: each chunk's planes built in the
// warp's shared memory and written at their place, its exceptions (`value_bits`) in theirs;
// block 0 writes the header and the frame size (0 on an error).
template <class D>
__device__ void sum_pack(const i64* acc, const u32* value_bits, u64 n, u32 dtype, u32 ndim, const Dims& dims,
                         u8* __restrict__ out, u8* ws, const u32* union_mask) {
    __shared__ u32 stage[TILE_THREADS / 32][CHUNK_GROUPS * 64];  // a part per warp
    const CfcParams* pp = (const CfcParams*)ws;
    const Tiles ts = tiles_at(ws, n, TILE_THREADS / 32);
    const u32 size = D::SIZE;
    const u64 groups = ts.groups, header_len = 64 + 8 * (u64)ndim;
    u8* body = out + header_len;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 ch = (u64)blockIdx.x * ts.tile_chunks + warp;
    const u64 nwords = ts.totals[0], n_exc = ts.totals[1];
    const u64 idx_size = n <= (1ull << 32) ? 4 : 8;
    // A failed sum leaves no frame that a reader on the device would take (a sum of sums, a
    // decoding queued before the host waits): its magic is broken, size 0.
    if (pp->error & SUM_BAD_FRAME) {  // sum_chunks added nothing
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            out[0] = 0;
            *(u64*)(ws + 64) = 0;
            *(u32*)(ws + 72) = 0u;
        }
        return;
    }
    if (ch < ts.chunks) {
        const u64 e0 = ch * CHUNK_VALUES;
        const u32 have = chunk_values(n, ch);
        const uint4 info = ts.chunk_info[ch];
        const u64 g = ch * CHUNK_GROUPS + lane;
        const u32 wl = lane < CHUNK_GROUPS && g < groups ? body[g] : 0;
        const u32 mask_l = lane < CHUNK_GROUPS && g < groups ? union_mask[g] : 0;
        const u32 inc = cfc_lane_prefix_sum(wl, CHUNK_GROUPS);
        u32* st = stage[warp];
#pragma unroll
        for (int u = 0; u < CHUNK_GROUPS; ++u) {
            const u32 w = __shfl_sync(CFC_FULL_MASK, wl, u);
            const u32 at = __shfl_sync(CFC_FULL_MASK, inc - wl, u);
            const u32 j = u * CFC_GROUP + lane;
            const i64 q = j < have ? acc[e0 + j] : 0;  // 0 at the sum's exceptions
            const u64 z = ((u64)q << 1) ^ (u64)(q >> 63);
            for (u32 b = 0; b < w; ++b) {  // plane b: bit b of every lane's code
                u32 plane = __ballot_sync(CFC_FULL_MASK, (z >> b) & 1u);
                if (lane == 0) st[at + b] = plane;
            }
        }
        __syncwarp();
        put_words(body + groups + 4 * (words_before(ts, blockIdx.x) + info.x), st, info.z, (const u8*)~0ull,
                  lane < info.z ? st[lane] : 0);
        if (info.w) {
            // Each group's first exception slot: lane u < 8 holds group u's.
            const u32 inc_e = cfc_lane_prefix_sum((u32)__popc(mask_l), CHUNK_GROUPS);
            const u64 first_l = excs_before(ts, blockIdx.x) + info.y + inc_e - __popc(mask_l);
            u8* idx = body + groups + 4 * nwords;
            u8* val = idx + n_exc * idx_size;
            for (int u = 0; u < CHUNK_GROUPS; ++u) {
                const u32 mask = __shfl_sync(CFC_FULL_MASK, mask_l, u);
                const u64 first = __shfl_sync(CFC_FULL_MASK, first_l, u);
                if (!((mask >> lane) & 1u)) continue;
                const u64 e = e0 + u * CFC_GROUP + lane;
                const u64 slot = first + __popc(mask & ((1u << lane) - 1u));
                cfc_store_le(idx + slot * idx_size, e, (int)idx_size);
                cfc_store_le(val + slot * size, value_bits[e], size);
            }
        }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const u64 blen = groups + 4 * nwords + n_exc * (idx_size + size);
        cfc_write_header(out, 0, dtype, 3, 0, n, (u64)__double_as_longlong(pp->step),
                         (u64)__double_as_longlong(pp->eps), n_exc, blen, ndim, dims);
        if (pp->error) out[0] = 0;
        *(u64*)(ws + 64) = pp->error ? 0 : header_len + blen;
        *(u32*)(ws + 72) = 0u;
    }
}

#define SUM_PACK(name, D)                                                                          \
    extern "C" __global__ void cfc_codec_sum_pack_##name(const i64* acc, const u32* value_bits,     \
            u64 n, u32 dtype, u32 ndim, Dims dims, u8* out, u8* ws, const u32* union_mask) {       \
        sum_pack<D>(acc, value_bits, n, dtype, ndim, dims, out, ws, union_mask);                   \
    }
DEFINE_FOR_DTYPES(SUM_PACK)
