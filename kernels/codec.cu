// The error-bounded codec on the GPU. Produces the bytes of the CPU reference (src/codec.rs,
// docs/FORMAT.md) without any host synchronization: every size stays on the device.
//
// Compress: [max_abs -> params] (rel/bits modes) or set_params (abs) -> encode_groups (one warp
// per group: width and exception count) -> exclusive scans of both (scan.cu) -> finish (header,
// raw-or-quantized decision, frame size) -> pack (bit planes by ballot, exceptions, or the raw
// bytes). Decompress: widths -> scan -> decode_groups -> scatter exceptions.
#include "common.cuh"

#define DEFINE_FOR_DTYPES(MACRO) MACRO(f32, F32) MACRO(bf16, BF16) MACRO(f16, F16)
// Kernels are launched with CFC_BLOCK threads (8 groups per block), scan kernels with 1024.

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

extern "C" __global__ void cfc_codec_reset(CfcParams* p) {
    p->step = p->inv_step = p->eps = 0.0;
    p->max_abs_bits = p->max_err_bits = 0;
    p->error = p->pad = 0;
}

// mode 0 abs (value = eps), 1 rel (value = rel), 2 bits (value = bits). Mirrors
// quantizer_for() in src/codec.rs; error 1 = the resulting eps is unusable.
extern "C" __global__ void cfc_codec_params(CfcParams* p, u32 mode, double value) {
    double max = __longlong_as_double((i64)p->max_abs_bits);
    double eps, step;
    p->error = 0;
    if (mode == 2) {
        u32 bits = (u32)value;
        double qmax = (double)((1ull << (bits - 1)) - 1);
        step = max > 0.0 ? max / qmax : 1.0;
        if (!(step >= 2.2250738585072014e-308 && step <= 1.7976931348623157e308)) step = 2.2250738585072014e-308;
        while (max * (1.0 / step) > CFC_MAX_CODE) step = __longlong_as_double(__double_as_longlong(step) + 1);
        p->step = step;
        p->inv_step = 1.0 / step;
        p->eps = step / 2.0;
        return;
    }
    eps = mode == 1 ? (max > 0.0 ? value * max : value) : value;
    if (!(eps >= 2.2250738585072014e-308 && eps <= 1.7976931348623157e308 / 4.0)) {
        p->error = 1;
        eps = 1.0;
    }
    step = 2.0 * eps;
    p->step = step;
    p->inv_step = 1.0 / step;
    p->eps = eps;
}

// ---- encode ----------------------------------------------------------------------------
// Each warp takes CFC_UNROLL consecutive groups per step and issues all their independent loads
// before using any: enough bytes in flight to approach memory bandwidth.
#define CFC_UNROLL 4
// Kernels walk groups with grid-stride warps (one warp = one group at a time); reductions
// across the grid go through one atomic per block.

// 1.5 * 2^52: (t + MAGIC) - MAGIC is rint(t) for |t| < 2^51, with the integer in the low bits
// of t + MAGIC. The same trick as the CPU reference, cheaper than rint + conversions on the GPU
// (needs --fmad=false, so that x * inv + MAGIC is never contracted).
#define CFC_ROUND_MAGIC 6755399441055744.0

// One lane's element: its zigzag code (0 for an exception) and whether it is an exception.
template <class D>
__device__ __forceinline__ u32 encode_lane(typename D::T v, bool valid, const CfcParams* p, u32 fixed,
                                           bool* exc, double* err_out) {
    *exc = false;
    *err_out = 0.0;
    if (!valid) return 0;
    double x64 = D::to_f64(v);
    double t = x64 * p->inv_step;
    double shifted = t + CFC_ROUND_MAGIC;
    double qf = shifted - CFC_ROUND_MAGIC;
    i64 q = (i64)(int)(u32)__double2loint(shifted);
    double dec = D::to_f64(D::from_f32(__double2float_rn(qf * p->step)));
    double err = fabs(dec - x64);
    bool ok = fabs(t) <= CFC_MAX_CODE && (fixed ? (err <= 1.7976931348623157e308) : (err <= p->eps));
    if (!ok) { *exc = true; return 0; }
    *err_out = err;
    return (u32)((q << 1) ^ (q >> 63));
}

// Pass 1: per group, width and exception count (widths go straight into the frame body) and the
// bit planes, staged at a fixed place per group (32 words) for pass 2 to move into the frame.
template <class D>
__device__ void encode_groups(const typename D::T* x, u64 n, u64 groups, const CfcParams* p, u32 fixed,
                              u8* widths, u64* words, u64* excs, u32* staging, u32* excmask,
                              float* residual) {
    u32 lane = threadIdx.x & 31;
    u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    if (blockIdx.x == 0 && threadIdx.x == 0) {  // the scans' totals slot
        words[groups] = 0;
        excs[groups] = 0;
    }
    double max_err = 0.0;
    // In registers for the whole loop; only the fields no block writes during this kernel.
    CfcParams P;
    P.step = p->step;
    P.inv_step = p->inv_step;
    P.eps = p->eps;
    // An unusable bound (rel) is reported on the host; the residual must then stay as it was.
    if (p->error) residual = nullptr;
    for (u64 g0 = warp * CFC_UNROLL; g0 < groups; g0 += warps * CFC_UNROLL) {
      typename D::T v[CFC_UNROLL];
      float c[CFC_UNROLL];
#pragma unroll
      for (int u = 0; u < CFC_UNROLL; ++u) {
        u64 i = (g0 + u) * CFC_GROUP + lane;
        v[u] = i < n ? x[i] : typename D::T(0);
        if (residual && i < n) {  // error feedback: compress x + r
            c[u] = cfc_compensate(D::to_f32(v[u]), residual[i]);
            v[u] = cfc_sent_value<D>(v[u], c[u]);
        }
      }
      // All lanes' codes first (independent work the compiler interleaves), then the warp votes.
      u32 zs[CFC_UNROLL];
      bool excs_[CFC_UNROLL];
#pragma unroll
      for (int u = 0; u < CFC_UNROLL; ++u) {
        double err;
        u64 i = (g0 + u) * CFC_GROUP + lane;
        zs[u] = encode_lane<D>(v[u], i < n, &P, fixed, &excs_[u], &err);
        max_err = fmax(max_err, err);
        // Keep the compensated value: pack, which knows what the frame will decode to (codes,
        // exceptions or raw bytes), turns it into the new residual.
        if (residual && i < n) residual[i] = c[u];
      }
#pragma unroll
      for (int u = 0; u < CFC_UNROLL; ++u) {
        u64 g = g0 + u;
        if (g >= groups) break;  // the same for the whole warp
        u32 z = zs[u];
        bool exc = excs_[u];
        u32 w = fixed ? fixed : 32 - __clz(__reduce_or_sync(CFC_FULL_MASK, z));
        u32 exc_bits = __ballot_sync(CFC_FULL_MASK, exc);
        u32 nexc = __popc(exc_bits);
        u32 mine = 0;
        for (u32 b = 0; b < w; ++b) {
            u32 word = __ballot_sync(CFC_FULL_MASK, (z >> b) & 1u);
            if (lane == b) mine = word;
        }
        if (lane < w) staging[g * CFC_GROUP + lane] = mine;
        if (lane == 0) {
            widths[g] = (u8)w;
            words[g] = w;
            excs[g] = nexc;
            excmask[g] = exc_bits;
        }
      }
    }
    if (fixed) block_max_to((u64*)&((CfcParams*)p)->max_err_bits, max_err);
}

#define ENCODE_GROUPS(name, D)                                                                     \
    extern "C" __global__ void cfc_codec_encode_groups_##name(const D::T* x, u64 n, u64 groups,    \
            const CfcParams* p, u32 fixed, u8* widths, u64* words, u64* excs, u32* staging,         \
            u32* excmask, float* residual) {                                                       \
        encode_groups<D>(x, n, groups, p, fixed, widths, words, excs, staging, excmask, residual); \
    }
DEFINE_FOR_DTYPES(ENCODE_GROUPS)

// After the scans: words[groups] and excs[groups] are the totals. One thread writes the header,
// decides between the quantized and the raw body (as compress() does) and the frame size.
struct Dims { u64 d[8]; };

extern "C" __global__ void cfc_codec_finish(u8* out, u64 n, u64 groups, u32 dtype, u32 dsize, u32 mode,
        u32 fixed, u32 ndim, Dims dims, const u64* words, const u64* excs, CfcParams* p,
        u64* frame_size, u32* raw_flag) {
    u64 header_len = 64 + 8 * (u64)ndim;
    u64 idx_size = n <= (1ull << 32) ? 4 : 8;
    u64 n_exc = excs[groups];
    u64 quant_len = groups + 4 * words[groups] + n_exc * (idx_size + dsize);
    u64 raw_len = n * dsize;
    u32 raw = (!fixed && quant_len >= raw_len) ? 1 : 0;
    u64 body = raw ? raw_len : quant_len;
    double eps = fixed ? __longlong_as_double((i64)p->max_err_bits) : p->eps;
    u8* h = out;
    h[0] = 'C'; h[1] = 'F'; h[2] = 'C'; h[3] = 'F';
    h[4] = 1; h[5] = (u8)raw; h[6] = (u8)dtype; h[7] = 0;
    h[8] = (u8)mode; h[9] = (u8)ndim; h[10] = 5; h[11] = (u8)fixed;
    h[12] = h[13] = h[14] = h[15] = 0;
    cfc_store_le(h + 16, n, 8);
    cfc_store_le(h + 24, (u64)__double_as_longlong(p->step), 8);
    cfc_store_le(h + 32, (u64)__double_as_longlong(eps), 8);
    cfc_store_le(h + 40, raw ? 0 : n_exc, 8);
    cfc_store_le(h + 48, body, 8);
    cfc_store_le(h + 56, body, 8);
    for (u32 k = 0; k < ndim; ++k) cfc_store_le(h + 64 + 8 * k, dims.d[k], 8);
    *frame_size = header_len + body;
    *raw_flag = raw;
}

// Pass 2: staged planes move to their scanned place in the frame, exceptions (known from pass
// 1's mask) are written; a raw frame gets the elements' bytes instead. With error feedback the
// residual holds the compensated values c (pass 1), and becomes c - (what the frame decodes to).
template <class D>
__device__ void pack(const typename D::T* x, u64 n, u64 groups, const CfcParams* p, u8* body,
                     const u64* words, const u64* excs, const u32* raw_flag, const u32* staging,
                     const u32* excmask, float* residual) {
    u32 lane = threadIdx.x & 31;
    u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    bool raw = *raw_flag != 0;
    u64 idx_size = n <= (1ull << 32) ? 4 : 8;
    u8* planes = body + groups;
    u64 n_exc = excs[groups];
    u8* idx = planes + 4 * words[groups];
    u8* val = idx + n_exc * idx_size;
    double step = p->step;
    if (p->error) residual = nullptr;  // as in encode_groups: leave the residual untouched
    for (u64 g0 = warp * CFC_UNROLL; g0 < groups; g0 += warps * CFC_UNROLL) {
        if (raw) {
#pragma unroll
            for (int u = 0; u < CFC_UNROLL; ++u) {
                u64 i = (g0 + u) * CFC_GROUP + lane;
                if (i >= n) continue;
                typename D::T v = x[i];
                if (residual) {
                    float c = residual[i];
                    v = cfc_sent_value<D>(v, c);
                    residual[i] = cfc_new_residual(c, D::to_f32(v));
                }
                cfc_store_le(body + i * D::SIZE, D::bits(v), D::SIZE);
            }
            continue;
        }
        u64 wo[CFC_UNROLL + 1], eo[CFC_UNROLL + 1];
#pragma unroll
        for (int u = 0; u <= CFC_UNROLL; ++u) {
            u64 g = min(g0 + u, groups);
            wo[u] = words[g];
            eo[u] = excs[g];
        }
        u32 st[CFC_UNROLL];
#pragma unroll
        for (int u = 0; u < CFC_UNROLL; ++u)
            st[u] = g0 + u < groups && lane < wo[u + 1] - wo[u] ? staging[(g0 + u) * CFC_GROUP + lane] : 0;
#pragma unroll
        for (int u = 0; u < CFC_UNROLL; ++u) {
            u64 g = g0 + u;
            if (g >= groups) break;  // the same for the whole warp
            u32 w = (u32)(wo[u + 1] - wo[u]);
            if (lane < w) cfc_store_le(planes + 4 * (wo[u] + lane), st[u], 4);
            u32 mask = eo[u + 1] != eo[u] ? excmask[g] : 0;
            u64 i = g * CFC_GROUP + lane;
            bool is_exc = (mask >> lane) & 1u;
            // An exception stores the value that was compressed: x, or with feedback dtype(c).
            typename D::T v = is_exc && !residual ? x[i] : typename D::T(0);
            if (residual) {
                // The code this lane sent, rebuilt from the staged planes.
                u32 z = 0;
                for (u32 b = 0; b < w; ++b) z |= ((__shfl_sync(CFC_FULL_MASK, st[u], b) >> lane) & 1u) << b;
                if (i < n) {
                    float c = residual[i];
                    float sent;
                    if (is_exc) {
                        v = cfc_sent_value<D>(x[i], c);
                        sent = D::to_f32(v);
                    } else {
                        i64 q = (i64)(int)((z >> 1) ^ (0u - (z & 1u)));
                        double qf = __longlong_as_double(__double_as_longlong(CFC_ROUND_MAGIC) + q) - CFC_ROUND_MAGIC;
                        sent = D::to_f32(D::from_f32(__double2float_rn(qf * step)));
                    }
                    residual[i] = cfc_new_residual(c, sent);
                }
            }
            if (is_exc) {
                u64 k = eo[u] + __popc(mask & ((1u << lane) - 1u));
                cfc_store_le(idx + k * idx_size, i, (int)idx_size);
                cfc_store_le(val + k * D::SIZE, D::bits(v), D::SIZE);
            }
        }
    }
}

#define PACK(name, D)                                                                              \
    extern "C" __global__ void cfc_codec_pack_##name(const D::T* x, u64 n, u64 groups,             \
            const CfcParams* p, u8* body, const u64* words, const u64* excs, const u32* raw_flag,  \
            const u32* staging, const u32* excmask, float* residual) {                             \
        pack<D>(x, n, groups, p, body, words, excs, raw_flag, staging, excmask, residual);         \
    }
DEFINE_FOR_DTYPES(PACK)

// ---- decode ------------------------------------------------------------------------------
// The frame was checked on the host (Header::parse and the body checks of src/codec.rs), or was
// written by the kernels above. Kernels read step, codec and exception count from the frame's
// own header on the device, so a frame that never left the GPU decodes without a host copy.

#define HDR_CODEC 5
#define HDR_STEP 24
#define HDR_NEXC 40

extern "C" __global__ void cfc_codec_widths_to_words(const u8* frame, u64 header_len, u64 groups, u64* words) {
    u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (g == 0) words[groups] = 0;
    if (g < groups) words[g] = frame[5] == 0 ? frame[header_len + g] : 0;
}

// One warp per group: lane b loads plane b, shuffles broadcast it, lane j rebuilds code j
// (widths up to 64 bits). Raw frames: each lane copies its element.
template <class D>
__device__ void decode_groups(const u8* frame, u64 header_len, u64 n, u64 groups, const u64* words,
                              typename D::T* out) {
    u32 lane = threadIdx.x & 31;
    u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u8* body = frame + header_len;
    bool raw = frame[HDR_CODEC] != 0;
    double step = __longlong_as_double((i64)cfc_load_le(frame + HDR_STEP, 8));
    for (u64 g0 = warp * CFC_UNROLL; g0 < groups; g0 += warps * CFC_UNROLL) {
        if (raw) {
#pragma unroll
            for (int u = 0; u < CFC_UNROLL; ++u) {
                u64 i = (g0 + u) * CFC_GROUP + lane;
                if (i < n) out[i] = D::from_bits((u32)cfc_load_le(body + i * D::SIZE, D::SIZE));
            }
            continue;
        }
        u32 w[CFC_UNROLL];
        u64 off[CFC_UNROLL];
#pragma unroll
        for (int u = 0; u < CFC_UNROLL; ++u) {
            bool in = g0 + u < groups;
            w[u] = in ? body[g0 + u] : 0;
            off[u] = in ? words[g0 + u] : 0;
        }
        u32 lo[CFC_UNROLL];
#pragma unroll
        for (int u = 0; u < CFC_UNROLL; ++u)
            lo[u] = lane < w[u] ? (u32)cfc_load_le(body + groups + 4 * (off[u] + lane), 4) : 0;
        // Codes of all groups first (warp shuffles), then the arithmetic, interleaved.
        double qf[CFC_UNROLL];
#pragma unroll
        for (int u = 0; u < CFC_UNROLL; ++u) {
            qf[u] = 0.0;
            if (g0 + u >= groups) break;  // the same for the whole warp
            u64 z = 0;
            for (u32 b = 0; b < w[u] && b < 32; ++b)
                z |= (u64)((__shfl_sync(CFC_FULL_MASK, lo[u], b) >> lane) & 1u) << b;
            if (w[u] > 32) {  // sums of codes: up to 64 bits
                const u8* planes = body + groups + 4 * off[u];
                u32 hi = lane + 32 < w[u] ? (u32)cfc_load_le(planes + 4 * (lane + 32), 4) : 0;
                for (u32 b = 32; b < w[u]; ++b)
                    z |= (u64)((__shfl_sync(CFC_FULL_MASK, hi, b - 32) >> lane) & 1u) << b;
                qf[u] = (double)((i64)(z >> 1) ^ -(i64)(z & 1));
            } else {
                // Exact (double)q for |q| < 2^51 through the same magic constant as the encoder.
                i64 q = (i64)(z >> 1) ^ -(i64)(z & 1);
                qf[u] = __longlong_as_double(__double_as_longlong(CFC_ROUND_MAGIC) + q) - CFC_ROUND_MAGIC;
            }
        }
#pragma unroll
        for (int u = 0; u < CFC_UNROLL; ++u) {
            u64 i = (g0 + u) * CFC_GROUP + lane;
            if (g0 + u < groups && i < n) out[i] = D::from_f32(__double2float_rn(qf[u] * step));
        }
    }
}

#define DECODE_GROUPS(name, D)                                                                     \
    extern "C" __global__ void cfc_codec_decode_groups_##name(const u8* frame, u64 header_len,     \
            u64 n, u64 groups, const u64* words, D::T* out) {                                      \
        decode_groups<D>(frame, header_len, n, groups, words, out);                                \
    }
DEFINE_FOR_DTYPES(DECODE_GROUPS)

template <class D>
__device__ void scatter_exceptions(const u8* frame, u64 header_len, u64 n, u64 groups, const u64* words,
                                   typename D::T* out) {
    u64 n_exc = frame[HDR_CODEC] == 0 ? cfc_load_le(frame + HDR_NEXC, 8) : 0;
    u64 idx_size = n <= (1ull << 32) ? 4 : 8;
    const u8* idx = frame + header_len + groups + 4 * words[groups];
    const u8* val = idx + n_exc * idx_size;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n_exc; k += (u64)gridDim.x * blockDim.x) {
        u64 i = cfc_load_le(idx + k * idx_size, (int)idx_size);
        if (i < n) out[i] = D::from_bits((u32)cfc_load_le(val + k * D::SIZE, D::SIZE));
    }
}

#define SCATTER(name, D)                                                                           \
    extern "C" __global__ void cfc_codec_scatter_exceptions_##name(const u8* frame, u64 header_len, \
            u64 n, u64 groups, const u64* words, D::T* out) {                                      \
        scatter_exceptions<D>(frame, header_len, n, groups, words, out);                           \
    }
DEFINE_FOR_DTYPES(SCATTER)
