// What the bounds are computed from: the largest magnitude (rel and bits modes) and a bucket's
// statistics (the engine's rms and rel rules).
#include "codec.cuh"

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

// ---- block exponents (the engine's block scales) ----

// floor(log2(v)) of a positive finite double, subnormals included.
__device__ __forceinline__ long long log2_floor(double v) {
    const u64 bits = (u64)__double_as_longlong(v);
    const long long e = (long long)((bits >> 52) & 0x7ff);
    if (e == 0) return -1074 + 63 - (long long)__clzll((long long)(bits & ((1ull << 52) - 1)));
    return e - 1023;
}

// Each block's exponent byte of x + r (src/codec/scales.rs, block_exponents, bit for bit): a warp
// per block of 2^log2 values, lane j adding the squares of the finite values j, j + 32, ... in
// turn (f64), the lanes then folded by halves; the byte is floor(floor(log2(sum / count)) / 2)
// + 127, clamped to 1..=254, or 0 where the sum is 0.
template <class D>
__device__ void block_exponents(const typename D::T* x, u64 n, const float* residual, u32 log2, u8* out) {
    const u64 warps = ((u64)gridDim.x * blockDim.x) / 32;
    const u32 lane = threadIdx.x & 31;
    const u64 blocks = (n + (1ull << log2) - 1) >> log2;
    for (u64 b = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32; b < blocks; b += warps) {
        const u64 lo = b << log2, hi = min(lo + (1ull << log2), n);
        double s = 0.0;
        for (u64 i = lo + lane; i < hi; i += 32) {
            float v = D::to_f32(x[i]);
            if (residual) v += residual[i];
            if (isfinite(v)) s += (double)v * (double)v;
        }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(CFC_FULL_MASK, s, o);
        if (lane == 0) {
            const double v = s / (double)(hi - lo);
            u8 e = 0;
            if (v > 0.0) {
                if (isinf(v)) {
                    e = 254;
                } else {
                    const long long e2 = log2_floor(v);
                    const long long half = e2 >= 0 ? e2 / 2 : -((-e2 + 1) / 2);  // floor(e2 / 2)
                    e = (u8)max(1ll, min(254ll, half + 127));
                }
            }
            out[b] = e;
        }
    }
}

#define BLOCK_EXPONENTS(name, D)                                                                   \
    extern "C" __global__ void cfc_codec_block_exponents_##name(const D::T* x, u64 n,              \
                                                                const float* residual, u32 log2,  \
                                                                u8* out) {                         \
        block_exponents<D>(x, n, residual, log2, out);                                             \
    }
DEFINE_FOR_DTYPES(BLOCK_EXPONENTS)
