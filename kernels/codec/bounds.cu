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
