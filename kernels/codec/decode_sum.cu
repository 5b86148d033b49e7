// Decoded sums: the average at the end of an all-reduce, written in the output dtype.
#include "codes.cuh"

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
                           float scale, typename O::T* __restrict__ out, const u32* status, u32 block_log2) {
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
                       s_masks[warp], v, block_log2);
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
            const u32* status, u32 block_log2) {                                                   \
        decode_sum<D, F32>(frames, parts, header_len, n, part_ws, stride, (float)scale, out, status, \
                           block_log2);                                                            \
    }
#define DECODE_SUM_TO_BF16(name, D)                                                                \
    /* at most 80 registers: 3 blocks per SM */                                                    \
    extern "C" __global__ __launch_bounds__(TILE_THREADS, 3)                                       \
    void cfc_codec_decode_sum_to_bf16_##name(const u64* frames, u32 parts,                         \
            u64 header_len, u64 n, u8* part_ws, u64 stride, double scale, u16* out,                \
            const u32* status, u32 block_log2) {                                                   \
        decode_sum<D, BF16>(frames, parts, header_len, n, part_ws, stride, (float)scale, out, status, \
                            block_log2);                                                           \
    }
#define DECODE_SUM_TO_F16(name, D)                                                                 \
    /* at most 80 registers: 3 blocks per SM */                                                    \
    extern "C" __global__ __launch_bounds__(TILE_THREADS, 3)                                       \
    void cfc_codec_decode_sum_to_f16_##name(const u64* frames, u32 parts,                          \
            u64 header_len, u64 n, u8* part_ws, u64 stride, double scale, u16* out,                \
            const u32* status, u32 block_log2) {                                                   \
        decode_sum<D, F16>(frames, parts, header_len, n, part_ws, stride, (float)scale, out, status, \
                           block_log2);                                                            \
    }
DEFINE_FOR_DTYPES(DECODE_SUM_TO_F32)
DEFINE_FOR_DTYPES(DECODE_SUM_TO_BF16)
DEFINE_FOR_DTYPES(DECODE_SUM_TO_F16)

// Pass 2 of packing a sum, with the geometry of sum_chunks: each chunk's planes built in the
// warp's shared memory and written at their place, its exceptions (`value_bits`) in theirs;
// block 0 writes the header and the frame size (0 on an error).
// With block scales (block_log2 nonzero), the sum's body starts with the scales of its first
// quantized part (zeros where every part is raw: its codes are then all 0), then the width
// table sum_chunks wrote.
template <class D>
__device__ void sum_pack(const i64* acc, const u32* value_bits, u64 n, u32 dtype, u32 ndim, const Dims& dims,
                         u8* __restrict__ out, u8* ws, const u32* union_mask, const u64* frames, u32 parts,
                         u32 block_log2) {
    __shared__ u32 stage[TILE_THREADS / 32][CHUNK_GROUPS * 64];  // a part per warp
    const CfcParams* pp = (const CfcParams*)ws;
    const Tiles ts = tiles_at(ws, n, TILE_THREADS / 32);
    const u32 size = D::SIZE;
    const u64 groups = ts.groups, header_len = 64 + 8 * (u64)ndim;
    const u64 scales_len = cfc_scales_len(n, block_log2);
    u8* body = out + header_len + scales_len;
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
    if (scales_len) {
        const u8* from = nullptr;
        for (u32 p = 0; p < parts && !from; ++p)
            if (((const u8*)frames[p])[HDR_CODEC] == 0) from = (const u8*)frames[p] + header_len;
        for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < scales_len; k += (u64)gridDim.x * blockDim.x)
            out[header_len + k] = from ? from[k] : 0;
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
        const u64 blen = scales_len + groups + 4 * nwords + n_exc * (idx_size + size);
        cfc_write_header(out, 0, dtype, 3, 0, n, (u64)__double_as_longlong(pp->step),
                         (u64)__double_as_longlong(pp->eps), n_exc, blen, ndim, dims, block_log2);
        if (pp->error) out[0] = 0;
        *(u64*)(ws + 64) = pp->error ? 0 : header_len + blen;
        *(u32*)(ws + 72) = 0u;
    }
}

#define SUM_PACK(name, D)                                                                          \
    extern "C" __global__ void cfc_codec_sum_pack_##name(const i64* acc, const u32* value_bits,     \
            u64 n, u32 dtype, u32 ndim, Dims dims, u8* out, u8* ws, const u32* union_mask,         \
            const u64* frames, u32 parts, u32 block_log2) {                                        \
        sum_pack<D>(acc, value_bits, n, dtype, ndim, dims, out, ws, union_mask, frames, parts,     \
                    block_log2);                                                                   \
    }
DEFINE_FOR_DTYPES(SUM_PACK)
