// The lossless codec's decoder on the GPU: the bytes of src/lossless.rs's decode, for a frame
// the host has checked (cfc::validate). One block of LL_THREADS threads per chunk of
// LL_CHUNK words: the chunk table gives each chunk's method and length, and an exclusive scan
// of the lengths (kernels/scan.cu, between the two kernels here) gives its offset.
//
// Pack blocks are decoded into shared memory first: one warp per group of 32 words, where
// lane j rebuilds word j from the group's bit planes (plane q holds bit pos[q] of every word),
// then the exceptions overwrite their words. The chunk then leaves shared memory in order:
// straight (pack), or scattered by the sparse bitmask (sparse + pack), with each word's rank
// among the nonzero words from a block-wide scan of the bitmask's popcounts.
#include "common.cuh"

#define LL_CHUNK 4096
#define LL_THREADS 128
#define LL_GROUPS (LL_CHUNK / CFC_GROUP)  // 128: one bitmask word per thread
#define LL_PACK_HEADER 20
#define LL_LEN_MASK 0x0fffffffu

__device__ __forceinline__ u32 ll_load_u32(const u8* p) { return *(const u32*)p; }  // 4-aligned
__device__ __forceinline__ u16 ll_load_u16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }
__device__ __forceinline__ u64 ll_load_u64(const u8* p) {
    return (u64)ll_load_u32(p) | ((u64)ll_load_u32(p + 4) << 32);
}

// Payload lengths of the chunk table as u64 words, plus a 0 after them, ready for the scan.
extern "C" __global__ void cfc_lossless_lengths(const u8* frame, u64 header_len, u64 chunks, u64* words) {
    u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (c == 0) words[chunks] = 0;
    if (c < chunks) words[c] = ll_load_u32(frame + header_len + 4 * c) & LL_LEN_MASK;
}

// Loads the i-th word of W (1, 2, 4 or 8 bytes) of an array starting 4-aligned (every part
// of a lossless body does): words up to 4 bytes are then aligned; one of 8 bytes may sit at
// 4 mod 8, so it is read as two halves.
template <class W>
__device__ __forceinline__ W ll_load_word(const u8* p, u32 i) {
    if (sizeof(W) == 8) return (W)ll_load_u64(p + 8 * (u64)i);
    return ((const W*)p)[i];
}

// Decodes a checked pack block of m words at p into sh[0..m).
template <class W>
__device__ void ll_unpack(const u8* p, u32 m, W* sh, u32* pos) {
    u32 x = ll_load_u16(p);
    u64 mask = ll_load_u64(p + 4);
    W base = (W)ll_load_u64(p + 12);
    u32 k = __popcll(mask);
    if (threadIdx.x == 0) {
        u32 q = 0;
        for (u64 rest = mask; rest; rest &= rest - 1) pos[q++] = __ffsll(rest) - 1;
    }
    __syncthreads();
    const u8* planes = p + LL_PACK_HEADER;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 groups = (m + CFC_GROUP - 1) / CFC_GROUP;
    for (u32 g = warp; g < groups; g += LL_THREADS / 32) {
        const u8* gp = planes + 4 * (u64)g * k;
        W v = base;
        for (u32 q = 0; q < k; q++) {
            u32 plane = ll_load_u32(gp + 4 * q);
            v |= (W)((plane >> lane) & 1u) << pos[q];
        }
        u32 i = g * CFC_GROUP + lane;
        if (i < m) sh[i] = v;
    }
    __syncthreads();
    const u8* idx = planes + 4 * (u64)groups * k;
    const u8* vals = idx + ((2 * x + 3) & ~3u);
    for (u32 j = threadIdx.x; j < x; j += LL_THREADS) {
        sh[ll_load_u16(idx + 2 * j)] = ll_load_word<W>(vals, j);
    }
    __syncthreads();
}

// Each thread's exclusive prefix of nonzero words over the bitmask words before its own
// (thread t owns bitmask word t), through shared memory.
__device__ u32 ll_rank_base(const u8* bitmask, u32 m, u32* scratch) {
    u32 t = threadIdx.x;
    u32 words = (m + CFC_GROUP - 1) / CFC_GROUP;
    u32 c = t < words ? __popc(ll_load_u32(bitmask + 4 * t)) : 0;
    u32 lane = t & 31, warp = t >> 5;
    u32 inc = c;
    for (int o = 1; o < 32; o <<= 1) {
        u32 v = __shfl_up_sync(CFC_FULL_MASK, inc, o);
        if (lane >= o) inc += v;
    }
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    u32 before = 0;
    for (u32 w = 0; w < warp; w++) before += scratch[w];
    __syncthreads();
    return before + inc - c;
}

template <class W>
__device__ void ll_decode(const u8* frame, u64 header_len, u64 n, const u64* offsets, W* out) {
    __shared__ W sh[LL_CHUNK];
    __shared__ u32 pos[64];
    __shared__ u32 scratch[LL_THREADS / 32];
    __shared__ u32 ranks[LL_GROUPS];
    u64 chunks = (n + LL_CHUNK - 1) / LL_CHUNK;
    const u8* body = frame + header_len;
    for (u64 c = blockIdx.x; c < chunks; c += gridDim.x) {
        u32 entry = ll_load_u32(body + 4 * c);
        u32 method = entry >> 28;
        const u8* p = body + 4 * chunks + offsets[c];
        u32 m = (u32)min((u64)LL_CHUNK, n - c * LL_CHUNK);
        W* o = out + c * LL_CHUNK;
        if (method == 0) {  // raw
            for (u32 i = threadIdx.x; i < m; i += LL_THREADS) o[i] = ll_load_word<W>(p, i);
        } else if (method == 1) {  // pack
            ll_unpack<W>(p, m, sh, pos);
            for (u32 i = threadIdx.x; i < m; i += LL_THREADS) o[i] = sh[i];
        } else {  // sparse (2) or sparse + pack (3): bitmask first
            u32 bwords = (m + CFC_GROUP - 1) / CFC_GROUP;
            u32 base = ll_rank_base(p, m, scratch);
            if (threadIdx.x < bwords) ranks[threadIdx.x] = base;
            const u8* vals = p + 4 * bwords;
            if (method == 3) {
                u32 nnz = 0;
                for (u32 w = 0; w < bwords; w++) nnz += __popc(ll_load_u32(p + 4 * w));
                ll_unpack<W>(vals, nnz, sh, pos);  // its __syncthreads also publish ranks
            } else {
                __syncthreads();
            }
            for (u32 i = threadIdx.x; i < m; i += LL_THREADS) {
                u32 bits = ll_load_u32(p + 4 * (i / CFC_GROUP));
                u32 lane = i % CFC_GROUP;
                W v = 0;
                if ((bits >> lane) & 1u) {
                    u32 r = ranks[i / CFC_GROUP] + __popc(bits & ((1u << lane) - 1u));
                    v = method == 3 ? sh[r] : ll_load_word<W>(vals, r);
                }
                o[i] = v;
            }
        }
        __syncthreads();  // sh, pos and ranks are reused by the next chunk
    }
}

extern "C" __global__ void cfc_lossless_decode_w1(const u8* frame, u64 header_len, u64 n, const u64* offsets, u8* out) {
    ll_decode<u8>(frame, header_len, n, offsets, out);
}
extern "C" __global__ void cfc_lossless_decode_w2(const u8* frame, u64 header_len, u64 n, const u64* offsets, u16* out) {
    ll_decode<u16>(frame, header_len, n, offsets, out);
}
extern "C" __global__ void cfc_lossless_decode_w4(const u8* frame, u64 header_len, u64 n, const u64* offsets, u32* out) {
    ll_decode<u32>(frame, header_len, n, offsets, out);
}
extern "C" __global__ void cfc_lossless_decode_w8(const u8* frame, u64 header_len, u64 n, const u64* offsets, u64* out) {
    ll_decode<u64>(frame, header_len, n, offsets, out);
}
