// Shared helpers of cfc's CUDA kernels. Compiled by NVRTC (see src/cuda/mod.rs); the only
// headers are CUDA's own fp16/bf16 ones, found through an include path cfc discovers.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define CFC_GROUP 32
#define CFC_FULL_MASK 0xffffffffu
// Largest code magnitude (zigzag codes then fit in 32 bits); must equal format::MAX_CODE.
#define CFC_MAX_CODE 2147483647.0

// Parameters that may be computed on the device (rel and bits modes) so that no host round
// trip is needed. Layout shared with src/cuda/mod.rs (PARAMS_BYTES).
struct CfcParams {
    double step;
    double inv_step;
    double eps;
    u64 max_abs_bits;  // max |finite x| as f64 bits (non-negative doubles order like u64)
    u64 max_err_bits;  // fixed rate: largest error made, as f64 bits
    u32 error;         // nonzero: the bound could not be set (see src/cuda/mod.rs)
    u32 pad;
};

// Element access per dtype: load as double, and the decode rule of docs/FORMAT.md
// (f64 multiply, round to f32, round to the element type, ties to even).
struct F32 {
    typedef float T;
    static __device__ __forceinline__ double to_f64(T v) { return (double)v; }
    static __device__ __forceinline__ float to_f32(T v) { return v; }
    static __device__ __forceinline__ T from_f32(float v) { return v; }
    static __device__ __forceinline__ u32 bits(T v) { return __float_as_uint(v); }
    static __device__ __forceinline__ T from_bits(u32 b) { return __uint_as_float(b); }
    static const int SIZE = 4;
};
struct BF16 {
    typedef u16 T;
    static __device__ __forceinline__ double to_f64(T v) { return (double)__uint_as_float(((u32)v) << 16); }
    static __device__ __forceinline__ float to_f32(T v) { return __uint_as_float(((u32)v) << 16); }
    // NaN keeps its payload with the quiet bit set, as the CPU reference (the `half` crate) does.
    static __device__ __forceinline__ T from_f32(float v) {
        u32 x = __float_as_uint(v);
        if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x0040u);
        return __bfloat16_as_ushort(__float2bfloat16_rn(v));
    }
    static __device__ __forceinline__ u32 bits(T v) { return v; }
    static __device__ __forceinline__ T from_bits(u32 b) { return (u16)b; }
    static const int SIZE = 2;
};
struct F16 {
    typedef u16 T;
    static __device__ __forceinline__ double to_f64(T v) { return (double)__half2float(__ushort_as_half(v)); }
    static __device__ __forceinline__ float to_f32(T v) { return __half2float(__ushort_as_half(v)); }
    static __device__ __forceinline__ T from_f32(float v) {
        u32 x = __float_as_uint(v);
        if ((x & 0x7fffffffu) > 0x7f800000u)  // NaN, as the CPU reference converts it
            return (u16)(((x & 0x80000000u) >> 16) | 0x7c00u | 0x0200u | ((x & 0x007fffffu) >> 13));
        return __half_as_ushort(__float2half_rn(v));
    }
    static __device__ __forceinline__ u32 bits(T v) { return v; }
    static __device__ __forceinline__ T from_bits(u32 b) { return (u16)b; }
    static const int SIZE = 2;
};

// Error feedback (src/codec/feedback.rs). The compensated value of x with residual r: a NaN residual
// counts as 0 and a non-finite x is kept, so that no arithmetic ever sees a NaN.
__device__ __forceinline__ float cfc_compensate(float xf, float r) {
    return (!isfinite(xf) || isnan(r)) ? xf : xf + r;
}

// The residual after sending `sent` for compensated value `c`.
__device__ __forceinline__ float cfc_new_residual(float c, float sent) {
    return (isfinite(c) && isfinite(sent)) ? c - sent : 0.0f;
}

// The value compressed for x with compensated value c: x itself (bits untouched) unless finite.
template <class D>
__device__ __forceinline__ typename D::T cfc_sent_value(typename D::T x, float c) {
    return isfinite(D::to_f32(x)) ? D::from_f32(c) : x;
}

template <class D>
__device__ __forceinline__ typename D::T cfc_dequantize(i64 q, double step) {
    return D::from_f32(__double2float_rn((double)q * step));
}

// Inclusive sum of `v` over the lanes of this lane's run of `width` lanes (a power of two up to
// 32), up to and including this lane. Every lane of the warp must call it.
template <class I>
__device__ __forceinline__ I cfc_lane_prefix_sum(I v, unsigned width = 32) {
    unsigned lane = threadIdx.x & 31;
    for (unsigned o = 1; o < width; o <<= 1) {
        I a = __shfl_up_sync(CFC_FULL_MASK, v, o);
        if ((lane & (width - 1)) >= o) v += a;
    }
    return v;
}

// Little-endian stores/loads of `nbytes` at any alignment (frame fields are not aligned).
__device__ __forceinline__ void cfc_store_le(u8* p, u64 v, int nbytes) {
    for (int k = 0; k < nbytes; ++k) p[k] = (u8)(v >> (8 * k));
}
__device__ __forceinline__ u64 cfc_load_le(const u8* p, int nbytes) {
    u64 v = 0;
    for (int k = 0; k < nbytes; ++k) v |= ((u64)p[k]) << (8 * k);
    return v;
}

// A frame's shape, passed to kernels by value.
struct Dims { u64 d[8]; };

// Block scales (docs/FORMAT.md, "Block scales"): with blocks of 2^log2 elements (log2 from 5 to
// 24; 0: none), a quantized body starts with one shift byte per block, and block b's step is the
// header's halved shift[b] times.
__device__ __forceinline__ u64 cfc_scales_len(u64 n, u32 log2) { return log2 ? (n + (1ull << log2) - 1) >> log2 : 0; }

// 2^-s exactly (s up to 255).
__device__ __forceinline__ double cfc_halvings(u32 s) { return __longlong_as_double((long long)((1023ull - s) << 52)); }

// The step of group g of a frame whose shifts are at `shifts` (null: none).
__device__ __forceinline__ double cfc_group_step(double step, const u8* shifts, u32 log2, u64 g) {
    return shifts ? step * cfc_halvings(shifts[g >> (log2 - 5)]) : step;
}

// The encoder's parameters for group g: `P`, or with block scales (`shifts` not null) its
// block's: step and bound halved its shift times (exact: powers of two), the inverse step
// computed from the step, as the CPU's Quantizer::halved does.
__device__ __forceinline__ CfcParams cfc_group_params(CfcParams P, const u8* shifts, u32 log2, u64 g) {
    if (shifts) {
        const double h = cfc_halvings(shifts[g >> (log2 - 5)]);
        P.step *= h;
        P.inv_step = 1.0 / P.step;
        P.eps *= h;
    }
    return P;
}

// Whether the shifts this thread checks (`s` from `first` by `stride`, below `count`; the
// shifts at `shifts`) leave every block of a frame of step `step` a normal step (the CPU's
// check_shift).
__device__ __forceinline__ bool cfc_shifts_normal(const u8* shifts, u64 count, double step, u64 first, u64 stride) {
    bool normal = true;
    for (u64 s = first; s < count; s += stride) normal &= step * cfc_halvings(shifts[s]) >= 2.2250738585072014e-308;
    return normal;
}

// A frame header (docs/FORMAT.md) at `h`: 64 bytes, then 8 per dimension. `step` and `eps` are
// the f64 fields' bits; `block_log2` nonzero: the body starts with block scales.
__device__ inline void cfc_write_header(u8* h, u32 codec, u32 dtype, u32 mode, u32 bits, u64 n, u64 step,
                                        u64 eps, u64 n_exc, u64 body_len, u32 ndim, const Dims& dims,
                                        u32 block_log2) {
    h[0] = 'C'; h[1] = 'F'; h[2] = 'C'; h[3] = 'F';
    h[4] = 1; h[5] = (u8)codec; h[6] = (u8)dtype; h[7] = block_log2 ? 2 : 0;
    h[8] = (u8)mode; h[9] = (u8)ndim; h[10] = 5; h[11] = (u8)bits;
    h[12] = (u8)block_log2;
    h[13] = h[14] = h[15] = 0;
    cfc_store_le(h + 16, n, 8);
    cfc_store_le(h + 24, step, 8);
    cfc_store_le(h + 32, eps, 8);
    cfc_store_le(h + 40, n_exc, 8);
    cfc_store_le(h + 48, body_len, 8);
    cfc_store_le(h + 56, body_len, 8);  // raw_body_len: no zstd stage on the device
    for (u32 k = 0; k < ndim; ++k) cfc_store_le(h + 64 + 8 * k, dims.d[k], 8);
}
