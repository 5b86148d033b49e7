#pragma once
// The error-bounded codec on the GPU. Produces the bytes of the CPU reference (src/codec/bounded.rs,
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
//
// This header holds what every file of the family shares: the dtype macro and the bound
// parameters. The family's sources, spliced into one NVRTC program in this order (src/kernels.rs):
// codec.cuh, codes.cuh, bounds.cu, encode.cu, decode.cu, sum.cu, decode_sum.cu, rice.cu.
#include "../common.cuh"

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

// The quantization parameters of mode 0 abs (value = eps), 1 rel (value = rel) or 2 bits
// (value = bits), from the largest finite magnitude `max`. Mirrors quantizer_for() in
// src/codec/bounded.rs; error 1 = the resulting eps is unusable. Every block of the encoder computes
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
