// The lossless codec's decoder on the GPU: the bytes of src/lossless.rs's decode, for a frame
// the host has checked (cfc::validate). One block of LL_THREADS threads per chunk of
// LL_CHUNK words: the chunk table gives each chunk's method and length, and an exclusive scan
// of the lengths (kernels/scan.cu, between the two kernels here) gives its offset.
//
// Pack blocks: one warp per group of 32 words; lane j takes its word's k varying bits (bits
// j k .. j k + k of the group) with a funnel shift and puts them back at their places through
// byte tables in shared memory; then the exceptions overwrite their words. A pack chunk is
// written straight to the output; the pack block of a sparse + pack chunk goes to shared
// memory, then is scattered by the bitmask, each nonzero word's rank coming from a
// block-wide scan of the bitmask's popcounts.
#include "common.cuh"

#define LL_CHUNK 4096
#define LL_THREADS 128
#define LL_GROUPS (LL_CHUNK / CFC_GROUP)  // 128: one bitmask word per thread
#define LL_PACK_HEADER 20
#define LL_LEN_MASK 0x0fffffffu
#define LL_ILP 4  // groups of 32 words each lane decodes at once
#define LL_RUNS 4  // runs of adjacent mask bits put back by shifts (more: byte tables)

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

// The k varying bits of word j of a group (bits j k .. j k + k of its k 32-bit words); F is
// u32 when k <= 32 is known (words of 4 bytes or less).
template <class F>
__device__ __forceinline__ F ll_field(const u8* gp, u32 k, u32 j) {
    u32 off = j * k, idx = off >> 5, sh = off & 31;
    u32 w0 = ll_load_u32(gp + 4 * idx);
    u32 w1 = idx + 1 < k ? ll_load_u32(gp + 4 * (idx + 1)) : 0;
    if (sizeof(F) == 4 || k <= 32) {
        u32 v = __funnelshift_r(w0, w1, sh);
        return k == 32 ? v : v & ((1u << k) - 1u);
    }
    u32 w2 = idx + 2 < k ? ll_load_u32(gp + 4 * (idx + 2)) : 0;
    u64 lo = ((u64)w1 << 32) | w0;
    u64 v = (lo >> sh) | (sh ? (u64)w2 << (64 - sh) : 0);
    return k == 64 ? v : v & ((1ull << k) - 1ull);
}

template <bool WIDE> struct LLWide { typedef u32 T; };
template <> struct LLWide<true> { typedef u64 T; };

// Bits per lookup of the tables that put varying bits back in place: bytes, or nibbles for
// 8-byte words (whose tables would otherwise not fit beside a chunk in shared memory).
template <class W>
struct LLTable {
    // The type a word's varying bits are handled in: 32-bit arithmetic unless the words are wider.
    typedef typename LLWide<sizeof(W) == 8>::T F;
    static const u32 BITS = sizeof(W) == 8 ? 4 : 8;
    static const u32 ENTRIES = 1u << BITS;
    static const u32 PARTS = 8 * sizeof(W) / BITS;
};

// Decodes a checked pack block of m words at p into dst[0..m) (shared or global memory).
// dep[b][v]: the bits of value v in part b (BITS bits each) of a word's k varying bits, put
// back at their places in the word (built here, from the mask).
template <class W>
__device__ void ll_unpack(const u8* p, u32 m, W* dst, W (*dep)[LLTable<W>::ENTRIES]) {
    typedef LLTable<W> T;
    u32 x = ll_load_u16(p);
    u64 mask = ll_load_u64(p + 4);
    W base = (W)ll_load_u64(p + 12);
    u32 k = __popcll(mask);
    u32 parts = (k + T::BITS - 1) / T::BITS;
    // Most masks are a few runs of adjacent bits (a sign bit, then exponent and mantissa bits):
    // then a field goes back in place with a shift and a mask per run. Other masks use tables.
    typedef typename T::F F;
    u32 runs = 0, run_src[LL_RUNS], run_dst[LL_RUNS];
    F run_mask[LL_RUNS];
    {
        u64 rest = mask;
        u32 src = 0;
        while (rest && runs <= LL_RUNS) {
            u32 lo = __ffsll(rest) - 1;
            u64 from_lo = rest >> lo;
            u32 len = from_lo == ~0ull ? 64 - lo : __ffsll(~from_lo) - 1;
            if (runs < LL_RUNS) {
                run_src[runs] = src;
                run_dst[runs] = lo;
                run_mask[runs] = (F)(len == 64 ? ~0ull : (1ull << len) - 1);
            }
            runs++;
            src += len;
            rest = len + lo >= 64 ? 0 : rest & ~(((1ull << len) - 1) << lo);
        }
    }
    bool by_runs = runs <= LL_RUNS;
    if (!by_runs) {
        for (u32 e = threadIdx.x; e < parts * T::ENTRIES; e += LL_THREADS) {
            u32 b = e / T::ENTRIES, v = e % T::ENTRIES;
            W d = 0;
            u64 rest = mask;
            for (u32 q = 0; q < T::BITS * b; q++) rest &= rest - 1;  // drop the bits of lower parts
            for (u32 i = 0; i < T::BITS && rest; i++, rest &= rest - 1) {
                if ((v >> i) & 1u) d |= (W)1 << (__ffsll(rest) - 1);
            }
            dep[b][v] = d;
        }
    }
    __syncthreads();
    const u8* fields = p + LL_PACK_HEADER;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 groups = (m + CFC_GROUP - 1) / CFC_GROUP;
    // LL_ILP groups per warp at a time: their loads are all issued before any is used, so a
    // thread has several in flight (one at a time left the kernel waiting on memory latency).
    const u32 warps = LL_THREADS / 32;
    for (u32 g0 = warp; g0 < groups; g0 += warps * LL_ILP) {
        F f[LL_ILP];
#pragma unroll
        for (u32 u = 0; u < LL_ILP; u++) {
            u32 g = g0 + u * warps;
            f[u] = (k && g < groups) ? ll_field<F>(fields + 4 * (u64)g * k, k, lane) : 0;
        }
#pragma unroll
        for (u32 u = 0; u < LL_ILP; u++) {
            u32 i = (g0 + u * warps) * CFC_GROUP + lane;
            if (i >= m) continue;
            F v = base;
            if (by_runs) {
#pragma unroll
                for (u32 r = 0; r < LL_RUNS; r++) {
                    if (r < runs) v |= ((f[u] >> run_src[r]) & run_mask[r]) << run_dst[r];
                }
            } else {
                for (u32 b = 0; b < parts; b++) v |= dep[b][(f[u] >> (T::BITS * b)) & (T::ENTRIES - 1)];
            }
            dst[i] = (W)v;
        }
    }
    __syncthreads();
    const u8* idx = fields + 4 * (u64)groups * k;
    const u8* vals = idx + ((2 * x + 3) & ~3u);
    for (u32 j = threadIdx.x; j < x; j += LL_THREADS) {
        dst[ll_load_u16(idx + 2 * j)] = ll_load_word<W>(vals, j);
    }
    __syncthreads();
}

// Each thread's exclusive prefix of nonzero words over the bitmask words before its own
// (thread t owns bitmask word t), through shared memory.
__device__ u32 ll_rank_base(const u8* bitmask, u32 m, u32* scratch, u32* total) {
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
    u32 before = 0, all = 0;
    for (u32 w = 0; w < LL_THREADS / 32; w++) {
        if (w < warp) before += scratch[w];
        all += scratch[w];
    }
    *total = all;
    __syncthreads();
    return before + inc - c;
}

template <class W>
__device__ void ll_decode(const u8* frame, u64 header_len, u64 n, const u64* offsets, W* out, u64 first,
                          u64 last) {
    __shared__ W sh[LL_CHUNK];
    __shared__ W dep[LLTable<W>::PARTS][LLTable<W>::ENTRIES];
    __shared__ u32 scratch[LL_THREADS / 32];
    __shared__ u32 ranks[LL_GROUPS];
    u64 chunks = (n + LL_CHUNK - 1) / LL_CHUNK;
    const u8* body = frame + header_len;
    last = min(last, chunks);
    for (u64 c = first + blockIdx.x; c < last; c += gridDim.x) {
        u32 entry = ll_load_u32(body + 4 * c);
        u32 method = entry >> 28;
        const u8* p = body + 4 * chunks + offsets[c];
        u32 m = (u32)min((u64)LL_CHUNK, n - c * LL_CHUNK);
        W* o = out + c * LL_CHUNK;
        if (method == 0) {  // raw
            for (u32 i = threadIdx.x; i < m; i += LL_THREADS) o[i] = ll_load_word<W>(p, i);
        } else if (method == 1) {  // pack
            ll_unpack<W>(p, m, o, dep);
        } else {  // sparse (2) or sparse + pack (3): bitmask first
            u32 bwords = (m + CFC_GROUP - 1) / CFC_GROUP;
            u32 nnz;
            u32 base = ll_rank_base(p, m, scratch, &nnz);
            if (threadIdx.x < bwords) ranks[threadIdx.x] = base;
            const u8* vals = p + 4 * bwords;
            if (method == 3) {
                ll_unpack<W>(vals, nnz, sh, dep);  // its __syncthreads also publish ranks
            } else {
                __syncthreads();
            }
#pragma unroll 4
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
        __syncthreads();  // sh, dep and ranks are reused by the next chunk
    }
}

extern "C" __global__ void cfc_lossless_decode_w1(const u8* frame, u64 header_len, u64 n, const u64* offsets,
                                                   u8* out, u64 first, u64 last) {
    ll_decode<u8>(frame, header_len, n, offsets, out, first, last);
}
extern "C" __global__ void cfc_lossless_decode_w2(const u8* frame, u64 header_len, u64 n, const u64* offsets,
                                                   u16* out, u64 first, u64 last) {
    ll_decode<u16>(frame, header_len, n, offsets, out, first, last);
}
extern "C" __global__ void cfc_lossless_decode_w4(const u8* frame, u64 header_len, u64 n, const u64* offsets,
                                                   u32* out, u64 first, u64 last) {
    ll_decode<u32>(frame, header_len, n, offsets, out, first, last);
}
extern "C" __global__ void cfc_lossless_decode_w8(const u8* frame, u64 header_len, u64 n, const u64* offsets,
                                                   u64* out, u64 first, u64 last) {
    ll_decode<u64>(frame, header_len, n, offsets, out, first, last);
}
