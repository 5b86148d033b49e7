// Rice frames on the GPU (codec 3, docs/FORMAT.md "Body of a rice frame"): the bytes of the CPU
// reference, src/codec/rice.rs. A warp per block of 1024 values; lane j holds element j of each
// of the block's 32 groups, so a group's bit plane is one ballot and its codes one warp scan.
//
// Compress: [max_abs] (rel) -> rice_size (codes, k, each block's head, words and exceptions) ->
// scans of words and exceptions -> rice_write (header, and heads, planes, unary streams and
// exceptions in place, or the raw bytes). Decompress: rice_offsets -> scan -> rice_decode ->
// rice_scatter (exceptions). Every size stays on the device.
//
// Block scales (docs/FORMAT.md "Block scales"; `shifts` not null on the encoder's side, the
// frame's header byte 12 on the decoder's): each group is coded with its block's step and bound,
// the header's halved its block's shift times (as encode_groups does), and the body starts with
// the shifts, a byte per block, so the heads and words after them are at any alignment: they
// are read and written through rice_load/rice_store, whole words where the address allows.
//
// Workspace (after WS_HEADER's 80 bytes: CfcParams, frame size at 64, raw flag at 72):
//   heads u64 x B, words u64 x (B + 1), excs u64 x (B + 1), then the scans' scratch.
// The scans are exclusive, so words[B] and excs[B] end up as the totals.
#include "codes.cuh"

#define RICE_BLOCK 1024
#define RICE_WS_HEADER 80
#define RICE_WARPS 4  // warps per thread block (RICE_WARPS in src/cuda/rice.rs)

// A value's code by the f64 rule (encode_value), out of line: it is rare for float32 (values the
// float32 route is unsure of) and keeps the callers small.
template <class D>
__device__ __noinline__ u32 rice_code_f64(float f, CfcParams P, bool* exc) {
    double e;
    return encode_value<D, false>(f, P, exc, &e);
}

// A little-endian word of `bytes` (4 or 8) at `p`, of any alignment.
__device__ __forceinline__ u64 rice_load(const u8* p, int bytes) {
    if (((u64)p & (bytes - 1)) == 0) return bytes == 8 ? *(const u64*)p : *(const u32*)p;
    return cfc_load_le(p, bytes);
}
__device__ __forceinline__ void rice_store(u8* p, u64 v, int bytes) {
    if (((u64)p & (bytes - 1)) != 0)
        cfc_store_le(p, v, bytes);
    else if (bytes == 8)
        *(u64*)p = v;
    else
        *(u32*)p = (u32)v;
}

// Bytes of block scales at the start of a rice body: the frame's (header byte 12), none for a
// raw frame. (Decoders read frames checked on the host or on the device, where byte 12 is 5 to
// 24 or 0.)
__device__ __forceinline__ u64 rice_scales_len(const u8* frame, u64 n) {
    return frame[5] == 3 ? cfc_scales_len(n, frame[12]) : 0;
}

struct RiceWs {
    u64* heads;
    u64* words;
    u64* excs;
};

__device__ __forceinline__ RiceWs rice_ws(u8* ws, u64 blocks) {
    RiceWs r;
    r.heads = (u64*)(ws + RICE_WS_HEADER);
    r.words = r.heads + blocks;
    r.excs = r.words + blocks + 1;
    return r;
}

// The value compressed for element i: x[i], or with error feedback (r not null) the value sent
// for x + r, whose compensated value goes to *comp (src/codec/feedback.rs).
template <class D>
__device__ __forceinline__ typename D::T rice_sent(const typename D::T* x, const float* r, u64 i, float* comp) {
    const typename D::T xi = x[i];
    if (!r) return xi;
    *comp = cfc_compensate(D::to_f32(xi), r[i]);
    return cfc_sent_value<D>(xi, *comp);
}

// The code of a value (f: as float32, exactly): by the float32 route where it is sure of it
// (float32 input and `route`), else by the f64 rule; *exc: whether it is an exception (code 0).
template <class D>
__device__ __forceinline__ u32 rice_code(float f, const CfcParams& P, bool route, float inv32, bool* exc) {
    bool sure = false;
    u32 c = 0;
    *exc = false;
    if (D::SIZE == 4 && route) c = f32_code(f, inv32, &sure);
    if (!sure) c = rice_code_f64<D>(f, P, exc);
    return c;
}

// The block's zigzag codes into z (element 1024 b + i at z[i]; 0 past n and at exceptions), a
// group per step with lane j on element j, and the groups where lane j holds an exception (bit
// g). The codes live in shared memory rather than registers so that the loops over groups stay
// loops: 32 unrolled copies of each made the kernels too large for the instruction cache.
// With block scales (`shifts`), each group takes its block's parameters.
template <class D>
__device__ __forceinline__ u32 rice_codes(const typename D::T* __restrict__ x, const float* r, u64 n, u64 b,
                                          const CfcParams& P0, const u8* shifts, u32 block_log2, u32* z) {
    const u32 lane = threadIdx.x & 31;
    u32 excm = 0;
#pragma unroll 4
    for (u32 g = 0; g < 32; ++g) {
        const u64 i = b * RICE_BLOCK + g * 32 + lane;
        const CfcParams P = cfc_group_params(P0, shifts, block_log2, b * 32 + g);
        u32 c = 0;
        bool exc = false;
        if (i < n) {
            float comp;
            c = rice_code<D>(D::to_f32(rice_sent<D>(x, r, i, &comp)), P, D::SIZE == 4 && f32_route_on(P),
                             __double2float_rn(P.inv_step), &exc);
        }
        z[g * 32 + lane] = c;
        excm |= (u32)exc << g;
    }
    __syncwarp();
    return excm;
}

// The block's coded groups (mask) and k, by the rule of src/codec/rice.rs; every lane gets them.
__device__ __forceinline__ void rice_choose(const u32* z, u32* mask_out, u32* k_out) {
    const u32 lane = threadIdx.x & 31;
    u32 mask = 0, mx = 0;
#pragma unroll 4
    for (u32 g = 0; g < 32; ++g) {
        const u32 c = z[g * 32 + lane];
        mask |= (u32)(__ballot_sync(CFC_FULL_MASK, c != 0) != 0) << g;
        mx = max(mx, c);
    }
    mx = __reduce_max_sync(CFC_FULL_MASK, mx);
    const u32 bits = 32 - __clz(mx);
    u32 k = bits > 5 ? bits - 5 : 0;
    const u32 coded = 32 * __popc(mask);
    while (mask != 0 && k < 63) {
        u32 gain = 0;
        for (u32 m = mask; m; m &= m - 1) {
            const u64 c = z[(__ffs(m) - 1) * 32 + lane];
            gain += (u32)((c >> k) - (c >> (k + 1)));
        }
        gain = __reduce_add_sync(CFC_FULL_MASK, gain);
        if (gain <= coded) break;
        ++k;
    }
    *mask_out = mask;
    *k_out = mask ? k : 0;
}

// Sum over the coded groups of z >> k: the unary stream's zeros.
__device__ __forceinline__ u32 rice_zeros(const u32* z, u32 mask, u32 k) {
    const u32 lane = threadIdx.x & 31;
    u32 s = 0;
    for (u32 m = mask; m; m &= m - 1) s += (u32)((u64)z[(__ffs(m) - 1) * 32 + lane] >> k);
    return __reduce_add_sync(CFC_FULL_MASK, s);
}

// Pass 1, a warp per block: each block's head, its data words and its exceptions, into the
// workspace (the words and exceptions then scanned by the host's scan launches).
template <class D>
__device__ void rice_size(const typename D::T* __restrict__ x, u64 n, u32 mode, double value, u8* ws,
                          const float* residual, const u8* shifts, u32 block_log2) {
    CfcParams* pp = (CfcParams*)ws;
    const u64 blocks = (n + RICE_BLOCK - 1) / RICE_BLOCK;
    const u64 b = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const u32 lane = threadIdx.x & 31;
    const RiceWs w = rice_ws(ws, blocks);
    const CfcParams P = make_params(mode, value, __longlong_as_double((i64)pp->max_abs_bits));
    if (b == 0 && lane == 0) {  // for pass 2 and the host
        pp->step = P.step;
        pp->inv_step = P.inv_step;
        pp->eps = P.eps;
        pp->error = P.error;
        w.words[blocks] = w.excs[blocks] = 0;  // so that the scans leave the totals there
    }
    if (b >= blocks) return;  // the whole warp
    __shared__ u32 s_codes[RICE_WARPS][RICE_BLOCK];
    u32* z = s_codes[threadIdx.x / 32];
    const u32 excm = rice_codes<D>(x, residual, n, b, P, shifts, block_log2, z);
    u32 mask, k;
    rice_choose(z, &mask, &k);
    const u32 unary_words = mask ? (32 * __popc(mask) + rice_zeros(z, mask, k) + 31) / 32 : 0;
    const u32 excs = __reduce_add_sync(CFC_FULL_MASK, __popc(excm));
    if (lane == 0) {
        w.heads[b] = (u64)mask | (u64)k << 32 | (u64)unary_words << 48;
        w.words[b] = (u64)k * __popc(mask) + unary_words;
        w.excs[b] = excs;
    }
}

#define RICE_SIZE(name, D)                                                                         \
    extern "C" __global__ void cfc_codec_rice_size_##name(const D::T* x, u64 n, u32 mode, double value, \
                                                          u8* ws, const float* residual,           \
                                                          const u8* shifts, u32 block_log2) {      \
        rice_size<D>(x, n, mode, value, ws, residual, shifts, block_log2);                         \
    }
DEFINE_FOR_DTYPES(RICE_SIZE)

// A warp's largest finite |new residual| raises *max_to (f64 bits; non-negative doubles order
// as their bits do).
__device__ __forceinline__ void rice_max_to(u64* max_to, double m) {
    for (int o = 16; o > 0; o >>= 1) m = fmax(m, __shfl_down_sync(CFC_FULL_MASK, m, o));
    if ((threadIdx.x & 31) == 0 && m > 0.0) atomicMax(max_to, (u64)__double_as_longlong(m));
}

// Pass 2, a warp per block, after the scans: block 0 writes the header and the frame size; then,
// as the totals decide (the CPU reference's rule), the block's raw bytes, or its head, planes,
// unary stream and exceptions in their places. The codes are computed again (cheaper than
// staging them). With error feedback (residual not null) each residual becomes what the frame
// will not give back, c - decoded, and the largest finite one raises *max_to (unless null).
// With block scales (`shifts`), a rice body starts with them (copied here).
template <class D>
__device__ void rice_write(const typename D::T* __restrict__ x, u64 n, u32 dtype, u32 mode, u32 ndim,
                           const Dims& dims, u8* __restrict__ out, u8* ws, u64* size_to, float* residual,
                           u64* max_to, const u8* shifts, u32 block_log2) {
    __shared__ u32 s_codes[RICE_WARPS][RICE_BLOCK];
    const CfcParams* pp = (const CfcParams*)ws;
    const u64 blocks = (n + RICE_BLOCK - 1) / RICE_BLOCK;
    const u64 b = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const RiceWs w = rice_ws(ws, blocks);
    CfcParams P;
    P.step = pp->step;
    P.inv_step = pp->inv_step;
    P.eps = pp->eps;
    P.error = pp->error;
    if (P.error) residual = nullptr;  // an unusable bound (rel): the residual stays as it was
    const u64 size = D::SIZE, idx_size = n <= (1ull << 32) ? 4 : 8;
    const u64 nwords = w.words[blocks], n_exc = w.excs[blocks];
    const u64 header_len = 64 + 8 * (u64)ndim;
    const u64 scales_len = shifts ? cfc_scales_len(n, block_log2) : 0;
    const u64 quant_len = scales_len + 8 * blocks + 4 * nwords + n_exc * (idx_size + size);
    const bool raw = quant_len >= n * size;
    u8* body = out + header_len;
    u8* heads = body + scales_len;  // (a quantized body's: after its scales)
    if (b == 0 && lane == 0) {
        const u64 blen = raw ? n * size : quant_len;
        cfc_write_header(out, raw ? 1 : 3, dtype, mode, 0, n, (u64)__double_as_longlong(P.step),
                         (u64)__double_as_longlong(P.eps), raw ? 0 : n_exc, blen, ndim, dims,
                         raw || !shifts ? 0 : block_log2);
        if (P.error) out[0] = 0;  // an unusable bound (rel): no reader takes the frame
        *(u64*)(ws + 64) = header_len + blen;
        *(u32*)(ws + 72) = raw ? 1u : 0u;
        if (size_to) *size_to = header_len + blen;
    }
    if (!raw)  // the scales, ahead of the heads
        for (u64 s = (u64)blockIdx.x * blockDim.x + threadIdx.x; s < scales_len; s += (u64)gridDim.x * blockDim.x)
            body[s] = shifts[s];
    if (b >= blocks) return;  // the whole warp
    double max_err = 0.0;
    if (raw) {
        for (u32 j = lane; j < RICE_BLOCK; j += 32) {
            const u64 i = b * RICE_BLOCK + j;
            if (i >= n) continue;
            float c;
            const typename D::T v = rice_sent<D>(x, residual, i, &c);
            ((typename D::T*)body)[i] = v;  // (the body is 8-aligned)
            if (residual) {
                const float rn = cfc_new_residual(c, D::to_f32(v));
                residual[i] = rn;
                if (fabsf(rn) <= 3.402823466e38f) max_err = fmax(max_err, (double)fabsf(rn));
            }
        }
        if (residual && max_to) rice_max_to(max_to, max_err);
        return;
    }
    // The codes again, and in the same pass each exception's index and value (after every
    // block's data, in index order) and, with error feedback, each new residual: c minus what the
    // frame decodes to (an exception: the value sent). Each residual is read before it is written.
    u32* z = s_codes[warp];
    {
        u8* idx = heads + 8 * blocks + 4 * nwords;
        u8* val = idx + n_exc * idx_size;
        u64 r_exc = w.excs[b];
#pragma unroll 2
        for (u32 g = 0; g < 32; ++g) {
            const u64 i = b * RICE_BLOCK + g * 32 + lane;
            const CfcParams Pg = cfc_group_params(P, shifts, block_log2, b * 32 + g);
            const bool route = D::SIZE == 4 && f32_route_on(Pg);
            const float inv32 = __double2float_rn(Pg.inv_step);
            u32 code = 0;
            bool exc = false;
            float c = 0.0f, f = 0.0f;
            typename D::T v = D::from_bits(0);
            if (i < n) {
                v = rice_sent<D>(x, residual, i, &c);
                f = D::to_f32(v);
                code = rice_code<D>(f, Pg, route, inv32, &exc);
            }
            z[g * 32 + lane] = code;
            const u32 em = __ballot_sync(CFC_FULL_MASK, exc);
            if (exc) {
                const u64 q = r_exc + __popc(em & ((1u << lane) - 1u));
                cfc_store_le(idx + q * idx_size, i, (int)idx_size);
                cfc_store_le(val + q * size, D::bits(v), (int)size);
            }
            r_exc += __popc(em);
            if (residual && i < n) {
                const float d = exc ? f : D::to_f32(decode_zigzag32<D>(code, Pg.step));
                const float rn = cfc_new_residual(c, d);
                residual[i] = rn;
                if (fabsf(rn) <= 3.402823466e38f) max_err = fmax(max_err, (double)fabsf(rn));
            }
        }
        __syncwarp();
    }
    const u64 head = w.heads[b];
    const u32 mask = (u32)head, k = (u32)(head >> 32) & 63;
    if (lane == 0) rice_store(heads + 8 * b, head, 8);
    u8* data = heads + 8 * blocks + 4 * w.words[b];
    // Planes: coded group after coded group, lane p < k writes plane p.
    u32 gi = 0;
    for (u32 m = mask; m; m &= m - 1, ++gi) {
        const u32 c = z[(__ffs(m) - 1) * 32 + lane];
        u32 mine = 0;
        for (u32 p = 0; p < k; ++p) {
            const u32 plane = __ballot_sync(CFC_FULL_MASK, (c >> p) & 1);
            if (lane == p) mine = plane;
        }
        if (lane < k) rice_store(data + 4 * ((u64)gi * k + lane), mine, 4);
    }
    // The unary stream, word after word: code r's stop bit at (the zeros and stop bits before
    // it) + z >> k. A group's stop bits fall in the words from base / 32 on, each gathered by one
    // OR over the warp; the last, partly filled, waits in `pending` for the next group's bits.
    u8* unary = data + 4 * (u64)k * __popc(mask);
    u32 base = 0, pending = 0;
    for (u32 m = mask; m; m &= m - 1) {
        const u32 h = (u32)((u64)z[(__ffs(m) - 1) * 32 + lane] >> k);
        const u32 inc = cfc_lane_prefix_sum(h + 1);
        const u32 pos = base + inc - 1, total = __shfl_sync(CFC_FULL_MASK, inc, 31);
        const u32 first = base / 32, last = (base + total - 1) / 32;
        for (u32 wd = first; wd <= last; ++wd) {
            u32 bits = __reduce_or_sync(CFC_FULL_MASK, pos / 32 == wd ? 1u << (pos % 32) : 0u);
            if (wd == first) bits |= pending;
            if (wd < last) {
                if (lane == 0) rice_store(unary + 4 * wd, bits, 4);
            } else {
                pending = bits;
            }
        }
        base += total;
        if (base % 32 == 0) {  // the last word is full
            if (lane == 0) rice_store(unary + 4 * last, pending, 4);
            pending = 0;
        }
    }
    if (base % 32 != 0 && lane == 0) rice_store(unary + 4 * (base / 32), pending, 4);
    if (residual && max_to) rice_max_to(max_to, max_err);
}

#define RICE_WRITE(name, D)                                                                        \
    extern "C" __global__ void cfc_codec_rice_write_##name(const D::T* x, u64 n, u32 dtype, u32 mode, \
            u32 ndim, Dims dims, u8* out, u8* ws, u64* size_to, float* residual, u64* max_to,     \
            const u8* shifts, u32 block_log2) {                                                    \
        rice_write<D>(x, n, dtype, mode, ndim, dims, out, ws, size_to, residual, max_to, shifts,   \
                      block_log2);                                                                 \
    }
DEFINE_FOR_DTYPES(RICE_WRITE)

// ---- decode ----------------------------------------------------------------------------

// The decoders take the frames rice_write makes, which may have fallen back to raw bytes (codec
// byte 1): then the values are copied.

// Each block's data words, from its head (a thread per block; words[blocks] = 0), for the scan.
extern "C" __global__ void cfc_codec_rice_offsets(const u8* frame, u64 header_len, u64 n, u8* ws) {
    const u64 blocks = (n + RICE_BLOCK - 1) / RICE_BLOCK;
    const RiceWs w = rice_ws(ws, blocks);
    const u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (b > blocks) return;
    u64 words = 0;
    if (b < blocks && frame[5] != 1) {
        const u64 head = cfc_load_le(frame + header_len + rice_scales_len(frame, n) + 8 * b, 8);
        words = ((head >> 32) & 63) * __popc((u32)head) + (head >> 48);
    }
    w.words[b] = words;
}

// A warp per block, after the scan of words: the block's values, exceptions aside (rice_scatter
// writes those next). The stop bits' positions go to shared memory first (rank r: the stop bit
// of the block's r-th coded value), then each value is its planes' low bits and the gap between
// its stop bit and the one before.
template <class D>
__device__ void rice_decode(const u8* __restrict__ frame, u64 header_len, u64 n, u8* ws, typename D::T* __restrict__ out,
                            const u32* status) {
    __shared__ u16 s_pos[RICE_WARPS][RICE_BLOCK];
    const u64 blocks = (n + RICE_BLOCK - 1) / RICE_BLOCK;
    const u64 b = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    if (b >= blocks || (status && *status)) return;  // (a frame failed its checks: nothing is decoded)
    const RiceWs w = rice_ws(ws, blocks);
    const u8* body = frame + header_len;
    if (frame[5] == 1) {  // raw
        for (u32 j = lane; j < RICE_BLOCK && b * RICE_BLOCK + j < n; j += 32) {
            const u64 i = b * RICE_BLOCK + j;
            out[i] = ((const typename D::T*)body)[i];
        }
        return;
    }
    const double step = __longlong_as_double((i64)cfc_load_le(frame + 24, 8));
    const u32 block_log2 = frame[12];
    const u8* shifts = block_log2 ? body : nullptr;  // (the scales, then the heads)
    const u8* heads = body + rice_scales_len(frame, n);
    const u64 head = rice_load(heads + 8 * b, 8);
    const u32 mask = (u32)head, k = (u32)(head >> 32) & 63, unary_words = (u32)(head >> 48);
    const u8* data = heads + 8 * blocks + 4 * w.words[b];
    const u8* unary = data + 4 * (u64)k * __popc(mask);
    u16* pos = s_pos[warp];
    u32 rank = 0;
    for (u32 c0 = 0; c0 < unary_words; c0 += 32) {
        u32 word = c0 + lane < unary_words ? (u32)rice_load(unary + 4 * (c0 + lane), 4) : 0;
        const u32 ones = __popc(word);
        u32 r = rank + cfc_lane_prefix_sum(ones) - ones;
        while (word) {
            pos[r++] = (u16)(32 * (c0 + lane) + __ffs(word) - 1);
            word &= word - 1;
        }
        rank = __shfl_sync(CFC_FULL_MASK, r, 31);  // lane 31's end: every stop bit so far
    }
    __syncwarp();
    const typename D::T zero = cfc_dequantize<D>(0, step);
    typename D::T* ob = out + b * RICE_BLOCK;
    const u64 have = min((u64)RICE_BLOCK, n - b * RICE_BLOCK);
    u32 gi = 0;
    for (u32 g = 0; g < 32; ++g) {
        const u32 j = g * 32 + lane;
        if (!((mask >> g) & 1)) {
            if (j < have) ob[j] = zero;
            continue;
        }
        const u8* planes = data + 4 * (u64)gi * k;
        const u32 p0 = lane < k ? (u32)rice_load(planes + 4 * lane, 4) : 0;
        const u32 p1 = lane + 32 < k ? (u32)rice_load(planes + 4 * (lane + 32), 4) : 0;
        u64 low = 0;
        for (u32 p = 0; p < k; ++p) {
            const u32 plane = __shfl_sync(CFC_FULL_MASK, p < 32 ? p0 : p1, p & 31);
            low |= (u64)((plane >> lane) & 1) << p;
        }
        const u32 r = 32 * gi + lane;
        const u32 before = r == 0 ? 0 : (u32)pos[r - 1] + 1;
        const u64 z = ((u64)(pos[r] - before) << k) | low;
        const i64 q = (i64)(z >> 1) ^ -(i64)(z & 1);
        if (j < have) ob[j] = cfc_dequantize<D>(q, cfc_group_step(step, shifts, block_log2, b * 32 + g));
        ++gi;
    }
}

#define RICE_DECODE(name, D)                                                                       \
    extern "C" __global__ void cfc_codec_rice_decode_##name(const u8* frame, u64 header_len, u64 n, u8* ws, \
                                                            D::T* out, const u32* status) {        \
        rice_decode<D>(frame, header_len, n, ws, out, status);                                     \
    }
DEFINE_FOR_DTYPES(RICE_DECODE)

// The exceptions' raw bits into their places (a thread per exception, grid-stride).
template <class D>
__device__ void rice_scatter(const u8* frame, u64 header_len, u64 n, const u8* ws, typename D::T* out,
                             const u32* status) {
    const u64 blocks = (n + RICE_BLOCK - 1) / RICE_BLOCK;
    const RiceWs w = rice_ws((u8*)ws, blocks);
    if ((status && *status) || frame[5] == 1) return;  // (a frame failed its checks); raw: no exceptions
    const u64 n_exc = cfc_load_le(frame + 40, 8), idx_size = n <= (1ull << 32) ? 4 : 8;
    const u8* idx = frame + header_len + rice_scales_len(frame, n) + 8 * blocks + 4 * w.words[blocks];
    const u8* val = idx + n_exc * idx_size;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n_exc; e += (u64)gridDim.x * blockDim.x) {
        const u64 i = cfc_load_le(idx + e * idx_size, (int)idx_size);
        out[i] = D::from_bits((u32)cfc_load_le(val + e * D::SIZE, D::SIZE));
    }
}

#define RICE_SCATTER(name, D)                                                                      \
    extern "C" __global__ void cfc_codec_rice_scatter_##name(const u8* frame, u64 header_len, u64 n, const u8* ws, \
                                                             D::T* out, const u32* status) {       \
        rice_scatter<D>(frame, header_len, n, ws, out, status);                                    \
    }
DEFINE_FOR_DTYPES(RICE_SCATTER)

// ---- the decoded sum of rice frames from other ranks (the engine's all-gather) ---------------
// Frames another rank sent are hostile: each is checked on the device (rice_check_heads, a scan,
// rice_check_blocks) before anything is decoded from it, as the CPU's reader checks a frame
// (docs/FORMAT.md), and a frame that fails sets `bit` in status[0] (and its part + 1 in
// status[1]): then nothing is written, then or later. Each frame is decoded (rice_decode,
// rice_scatter) into a buffer of its dtype, added in f32 in frame order (rice_accumulate), and
// the sum scaled and written in the output dtype (rice_finish): decode_sum's rule.

// Frame `part` (at `frame`, exactly `len` bytes): a rice or raw frame without a zstd stage of n
// elements of `dtype` (`size` bytes) in `ndim` dimensions, with a header the CPU would read; each
// block head has its reserved bits zero, at most 1024 unary words, and is 0 where no group is
// coded. With block scales expected (block_log2 nonzero), a rice frame must have them, of that
// block size, each leaving its block a normal step (as check_frames holds bit planes); a raw
// frame has none. A thread per block (and one more), the scales shared out among all of them:
// each block's words go to the workspace for the scan.
extern "C" __global__ void cfc_codec_rice_check_heads(const u8* f, u64 len, u64 n, u32 dtype, u32 size, u32 ndim,
                                                      u8* ws, u32* status, u32 bit, u32 part, u32 block_log2) {
    const u64 blocks = (n + RICE_BLOCK - 1) / RICE_BLOCK;
    const RiceWs w = rice_ws(ws, blocks);
    const u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 header_len = 64 + 8 * (u64)ndim;
    bool ok = len >= header_len && f[0] == 'C' && f[1] == 'F' && f[2] == 'C' && f[3] == 'F' && f[4] == 1 &&
              (f[5] == 1 || f[5] == 3) && f[6] == dtype && f[8] != 2 && f[9] == ndim && f[10] == 5;
    const bool raw = ok && f[5] == 1;
    u64 blen = 0;
    if (ok) {
        blen = cfc_load_le(f + HDR_BODY_LEN, 8);
        Dims none;
        ok = cfc_load_le(f + HDR_N, 8) == n && cfc_load_le(f + HDR_RAW_BODY_LEN, 8) == blen &&
             blen == len - header_len && header_fields_ok(f, n, ndim, none, false, raw, block_log2);
    }
    const u64 scales_len = raw ? 0 : cfc_scales_len(n, block_log2);
    if (ok && raw) ok = blen == n * size;
    if (ok && !raw) ok = cfc_load_le(f + HDR_NEXC, 8) <= n && scales_len + 8 * blocks <= blen;
    if (ok && scales_len) {  // every block's step a normal number
        const double step = __longlong_as_double((long long)cfc_load_le(f + HDR_STEP, 8));
        if (!cfc_shifts_normal(f + header_len, scales_len, step, b, (u64)gridDim.x * blockDim.x))
            report_bad_frame(status, bit, part);
    }
    if (b > blocks) return;
    u64 words = 0;
    if (ok && !raw && b < blocks) {
        const u64 head = cfc_load_le(f + header_len + scales_len + 8 * b, 8);
        const u32 mask = (u32)head, k = (u32)(head >> 32) & 63, u = (u32)(head >> 48);
        ok = ((head >> 38) & 0x3ff) == 0 && u <= RICE_BLOCK && (mask != 0 || head == 0);
        words = (u64)k * __popc(mask) + u;
    }
    w.words[b] = ok ? words : 0;
    if (!ok) report_bad_frame(status, bit, part);
}

// After rice_check_heads and the scan of words, a warp per block: the heads, data and exceptions
// fill the body exactly; each block's unary stream holds one stop bit per coded value, no
// quotient above 31, and ends in its last word; exception indices increase and stay below n.
extern "C" __global__ void cfc_codec_rice_check_blocks(const u8* f, u64 n, u32 size, u32 ndim, u8* ws, u32* status,
                                                       u32 bit, u32 part) {
    if (status[0] || f[5] == 1) return;  // (a frame already failed: nothing will be decoded; raw)
    const u64 blocks = (n + RICE_BLOCK - 1) / RICE_BLOCK;
    const RiceWs w = rice_ws(ws, blocks);
    const u64 header_len = 64 + 8 * (u64)ndim;
    const u64 blen = cfc_load_le(f + HDR_BODY_LEN, 8), n_exc = cfc_load_le(f + HDR_NEXC, 8);
    const u64 idx_size = n <= (1ull << 32) ? 4 : 8;
    const u64 nwords = w.words[blocks];
    // (the scales' bytes, which rice_check_heads held to the expected block size)
    const u64 scales_len = rice_scales_len(f, n);
    if (scales_len + 8 * blocks + 4 * nwords + n_exc * (idx_size + size) != blen) {
        if (threadIdx.x == 0) report_bad_frame(status, bit, part);
        return;
    }
    const u8* body = f + header_len + scales_len;  // (the heads)
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u8* idx = body + 8 * blocks + 4 * nwords;
    for (u64 e = t; e < n_exc; e += (u64)gridDim.x * blockDim.x) {
        const u64 i = cfc_load_le(idx + e * idx_size, (int)idx_size);
        if (i >= n || (e + 1 < n_exc && cfc_load_le(idx + (e + 1) * idx_size, (int)idx_size) <= i))
            report_bad_frame(status, bit, part);
    }
    const u64 b = t / 32;
    const u32 lane = threadIdx.x & 31;
    if (b >= blocks) return;  // the whole warp
    const u64 head = cfc_load_le(body + 8 * b, 8);
    const u32 mask = (u32)head, k = (u32)(head >> 32) & 63, u = (u32)(head >> 48);
    const u8* unary = body + 8 * blocks + 4 * (w.words[b] + (u64)k * __popc(mask));
    // Stop bits in order: each lane's first one is checked against the last one before its word
    // (a running maximum of the lanes' last positions, carried from chunk to chunk).
    u32 ones = 0;
    int last = -1;  // position of the last stop bit so far
    bool ok = true;
    for (u32 c0 = 0; c0 < u; c0 += 32) {
        u32 word = c0 + lane < u ? (u32)cfc_load_le(unary + 4 * (c0 + lane), 4) : 0;
        const int mine = word ? (int)(32 * (c0 + lane) + 31 - __clz(word)) : -1;
        int before = mine;  // inclusive running maximum over the lanes, then made exclusive
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(CFC_FULL_MASK, before, o);
            if (lane >= (u32)o) before = max(before, v);
        }
        const int chunk_last = __shfl_sync(CFC_FULL_MASK, before, 31);
        before = __shfl_up_sync(CFC_FULL_MASK, before, 1);
        int prev = lane == 0 ? last : max(last, before);
        ones += __reduce_add_sync(CFC_FULL_MASK, __popc(word));
        while (word) {
            const int pos = (int)(32 * (c0 + lane)) + __ffs(word) - 1;
            ok &= pos - prev - 1 <= 31;
            prev = pos;
            word &= word - 1;
        }
        last = max(last, chunk_last);
    }
    ok &= ones == 32 * (u32)__popc(mask);
    ok &= u == 0 || last >= (int)(32 * (u - 1));  // the stream ends in its last word
    if (__any_sync(CFC_FULL_MASK, !ok) && lane == 0) report_bad_frame(status, bit, part);
}

// acc = v (first) or acc + v, in f32, for each of n values of dtype D.
template <class D>
__device__ void rice_accumulate(const typename D::T* v, u64 n, float* acc, u32 first, const u32* status) {
    if (*status) return;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        acc[i] = first ? D::to_f32(v[i]) : acc[i] + D::to_f32(v[i]);
}

#define RICE_ACCUMULATE(name, D)                                                                   \
    extern "C" __global__ void cfc_codec_rice_accumulate_##name(const D::T* v, u64 n, float* acc, u32 first, \
                                                                const u32* status) {               \
        rice_accumulate<D>(v, n, acc, first, status);                                              \
    }
DEFINE_FOR_DTYPES(RICE_ACCUMULATE)

// out = O(scale * acc) (the product skipped at scale 1), a NaN as the canonical quiet NaN.
template <class O>
__device__ void rice_finish(const float* acc, u64 n, double scale, typename O::T* out, const u32* status) {
    if (*status) return;
    const float s = (float)scale;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const float r = s == 1.0f ? acc[i] : acc[i] * s;
        out[i] = O::from_f32(isnan(r) ? __int_as_float(0x7fc00000) : r);
    }
}

// (named by the output dtype)
#define RICE_FINISH(name, O)                                                                       \
    extern "C" __global__ void cfc_codec_rice_finish_##name(const float* acc, u64 n, double scale, O::T* out, \
                                                            const u32* status) {                   \
        rice_finish<O>(acc, n, scale, out, status);                                                \
    }
DEFINE_FOR_DTYPES(RICE_FINISH)
