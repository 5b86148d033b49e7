// The lossless codec's decoder on the GPU: the bytes of src/codec/lossless.rs's decode, for a frame
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
// A raw frame (codec 1: the GPU encoder found nothing to gain) has no table: all zeros.
extern "C" __global__ void cfc_lossless_lengths(const u8* frame, u64 header_len, u64 chunks, u64* words) {
    u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (c == 0) words[chunks] = 0;
    if (c < chunks) words[c] = frame[5] == 2 ? ll_load_u32(frame + header_len + 4 * c) & LL_LEN_MASK : 0;
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
        if (sizeof(F) == 4) {
            // k <= 32: lane q loads the group's word q (one coalesced load), and each lane takes
            // the two words its field lies in from the lanes that hold them.
            u32 word[LL_ILP];
#pragma unroll
            for (u32 u = 0; u < LL_ILP; u++) {
                u32 g = g0 + u * warps;
                word[u] = (g < groups && lane < k) ? ll_load_u32(fields + 4 * ((u64)g * k + lane)) : 0;
            }
            u32 off = lane * k, idx = off >> 5, sh = off & 31;
            u32 low = k >= 32 ? ~0u : (1u << k) - 1u;
#pragma unroll
            for (u32 u = 0; u < LL_ILP; u++) {
                u32 w0 = __shfl_sync(CFC_FULL_MASK, word[u], idx & 31);
                u32 w1 = __shfl_sync(CFC_FULL_MASK, word[u], (idx + 1) & 31);  // unused when sh + k <= 32
                f[u] = (F)(__funnelshift_r(w0, w1, sh) & low);
            }
        } else {
#pragma unroll
            for (u32 u = 0; u < LL_ILP; u++) {
                u32 g = g0 + u * warps;
                f[u] = (k && g < groups) ? ll_field<F>(fields + 4 * (u64)g * k, k, lane) : 0;
            }
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

// Block-wide exclusive prefix sum of one value per thread (LL_THREADS of them), through
// scratch (a word per warp); *total gets the sum of all. Every thread of the block calls it.
__device__ u32 ll_block_scan(u32 c, u32* scratch, u32* total) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 inc = cfc_lane_prefix_sum(c);
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    u32 before = 0, all = 0;
    for (u32 w = 0; w < LL_THREADS / 32; w++) {
        if (w < warp) before += scratch[w];
        all += scratch[w];
    }
    *total = all;
    __syncthreads();  // scratch may be reused at once
    return before + inc - c;
}

// Each thread's exclusive prefix of nonzero words over the bitmask words before its own
// (thread t owns bitmask word t).
__device__ u32 ll_rank_base(const u8* bitmask, u32 m, u32* scratch, u32* total) {
    u32 t = threadIdx.x;
    u32 words = (m + CFC_GROUP - 1) / CFC_GROUP;
    return ll_block_scan(t < words ? __popc(ll_load_u32(bitmask + 4 * t)) : 0, scratch, total);
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
    bool raw = frame[5] != 2;  // a raw frame of the GPU encoder: the words as they are
    for (u64 c = first + blockIdx.x; c < last; c += gridDim.x) {
        u32 m = (u32)min((u64)LL_CHUNK, n - c * LL_CHUNK);
        W* o = out + c * LL_CHUNK;
        if (raw) {
            const u8* p = body + c * LL_CHUNK * sizeof(W);
            for (u32 i = threadIdx.x; i < m; i += LL_THREADS) o[i] = ll_load_word<W>(p, i);
            continue;
        }
        u32 entry = ll_load_u32(body + 4 * c);
        u32 method = entry >> 28;
        const u8* p = body + 4 * chunks + offsets[c];
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

// ---- The encoder: the bytes of src/codec/lossless.rs's compress_lossless_bytes ----
//
// Pass 1 (one block per chunk): count each bit's ones with ballots, plan a pack block exactly
// as plan_pack() does (majority base, bits ranked by disagreement, one histogram of each
// word's largest rank index of disagreement, the smallest layout), for all words and for the
// nonzero ones, choose the smallest method, and write the chunk's payload into its staging
// slot (as large as the raw chunk, which bounds the chosen method) and its table entry.
// Then the entries' lengths are scanned, one thread writes the header (or decides on a raw
// frame, as compress_lossless_bytes does), and pass 2 gathers the payloads into the frame.

struct LLPlan {
    u64 mask;
    u64 base;
    u32 k;
    u32 x;
    u32 size;
};

template <class W>
struct LLEnc {
    typedef typename LLTable<W>::F F;
    static const u32 BITS = LLTable<W>::BITS;
    static const u32 ENTRIES = LLTable<W>::ENTRIES;
    static const u32 PARTS = LLTable<W>::PARTS;
    u32 ones[64];
    u32 hist[65];
    u8 rank[64];
    u8 order[64];
    u32 nord;
    u8 tab[sizeof(W)][256];
    F ext[PARTS][ENTRIES];
    u32 acc[LL_THREADS / 32][66];
    u32 gcount[LL_GROUPS];
    u32 goff[LL_GROUPS];
    u32 excbal[LL_GROUPS];  // which words of each group are exceptions (ll_write_pack)
    u32 scratch[LL_THREADS / 32];
    u32 bitmask[LL_GROUPS];
    LLPlan plan[2];
    u32 method, len;
};

__device__ __forceinline__ u32 ll_pack_size(u32 m, u32 w, u32 k, u32 x) {
    return LL_PACK_HEADER + 4 * ((m + 31) / 32) * k + ((2 * x + 3) & ~3u) + ((w * x + 3) & ~3u);
}

// Exclusive prefix of v[t] (t < LL_GROUPS, one per thread) into out[], visible to the whole
// block on return; returns the sum of all.
__device__ u32 ll_scan_groups(const u32* v, u32* out, u32* scratch) {
    u32 total;
    out[threadIdx.x] = ll_block_scan(v[threadIdx.x], scratch, &total);
    __syncthreads();
    return total;
}

// Plans a pack block for src[0..m) into e.plan[which] (as plan_pack in src/codec/lossless.rs).
template <class W>
__device__ void ll_plan(const W* src, u32 m, LLEnc<W>& e, int which) {
    const u32 bits = 8 * sizeof(W);
    u32 t = threadIdx.x, lane = t & 31, warp = t >> 5;
    if (t < 64) e.ones[t] = 0;
    if (t < 65) e.hist[t] = 0;
    __syncthreads();
    u32 acc0 = 0, acc1 = 0;
    u32 groups = (m + 31) / 32;
    for (u32 g = warp; g < groups; g += LL_THREADS / 32) {
        u32 i = g * 32 + lane;
        bool valid = i < m;
        u64 v = valid ? (u64)src[i] : 0;
        for (u32 b = 0; b < bits; b++) {
            u32 bal = __ballot_sync(CFC_FULL_MASK, valid && ((v >> b) & 1));
            if ((b & 31) == lane) {
                if (b < 32) acc0 += __popc(bal);
                else acc1 += __popc(bal);
            }
        }
    }
    if (lane < bits) atomicAdd(&e.ones[lane], acc0);
    if (lane + 32 < bits) atomicAdd(&e.ones[lane + 32], acc1);
    __syncthreads();
    if (t == 0) {
        u64 base = 0;
        u32 dis[64];
        u32 n = 0;
        for (u32 b = 0; b < bits; b++) {
            u32 c = e.ones[b];
            if (2 * c > m) {
                base |= 1ull << b;
                dis[b] = m - c;
            } else {
                dis[b] = c;
            }
            e.rank[b] = 0;
            if (dis[b] > 0) {
                // Insertion into order: most disagreement first, ties: the higher bit first.
                u32 p = n++;
                while (p > 0) {
                    u32 q = e.order[p - 1];
                    if (dis[q] > dis[b] || (dis[q] == dis[b] && q > b)) break;
                    e.order[p] = (u8)q;
                    p--;
                }
                e.order[p] = (u8)b;
            }
        }
        for (u32 r = 0; r < n; r++) e.rank[e.order[r]] = (u8)r;
        e.nord = n;
        e.plan[which].base = base;
    }
    __syncthreads();
    for (u32 id = t; id < sizeof(W) * 256; id += LL_THREADS) {
        u32 p = id >> 8, v = id & 255;
        u32 best = 0;
        for (u32 i = 0; i < 8; i++) {
            if ((v >> i) & 1u) best = max(best, (u32)e.rank[8 * p + i] + 1);
        }
        e.tab[p][v] = (u8)best;
    }
    __syncthreads();
    u64 base = e.plan[which].base;
    for (u32 i = t; i < m; i += LL_THREADS) {
        u64 d = (u64)src[i] ^ base;
        u32 r = 0;
        for (u32 p = 0; p < sizeof(W); p++) r = max(r, (u32)e.tab[p][(d >> (8 * p)) & 255]);
        atomicAdd(&e.hist[r], 1u);
    }
    __syncthreads();
    if (t == 0) {
        u32 x = 0;
        for (u32 r = 1; r < 65; r++) x += e.hist[r];
        u32 best = ll_pack_size(m, sizeof(W), 0, x), k = 0, bx = x;
        for (u32 kk = 1; kk <= e.nord; kk++) {
            x -= e.hist[kk];
            u32 size = ll_pack_size(m, sizeof(W), kk, x);
            if (size < best) {
                best = size;
                k = kk;
                bx = x;
            }
        }
        u64 mask = 0;
        for (u32 r = 0; r < k; r++) mask |= 1ull << e.order[r];
        e.plan[which].mask = mask;
        e.plan[which].base = base & ~mask;
        e.plan[which].k = k;
        e.plan[which].x = bx;
        e.plan[which].size = best;
    }
    __syncthreads();
}

// Writes the planned pack block of src[0..m) at dst (4-aligned).
template <class W>
__device__ void ll_write_pack(const W* src, u32 m, LLEnc<W>& e, int which, u8* dst) {
    typedef typename LLEnc<W>::F F;
    const u32 w = sizeof(W);
    u32 t = threadIdx.x, lane = t & 31, warp = t >> 5;
    LLPlan pl = e.plan[which];
    u32 k = pl.k;
    if (t == 0) {
        *(u32*)dst = pl.x;  // exception count (u16) and the reserved u16, little-endian
        *(u32*)(dst + 4) = (u32)pl.mask;
        *(u32*)(dst + 8) = (u32)(pl.mask >> 32);
        *(u32*)(dst + 12) = (u32)pl.base;
        *(u32*)(dst + 16) = (u32)(pl.base >> 32);
    }
    // ext[b][v]: the part-b value v of a word, its mask bits moved down to their field places.
    for (u32 id = t; id < LLEnc<W>::PARTS * LLEnc<W>::ENTRIES; id += LL_THREADS) {
        u32 b = id / LLEnc<W>::ENTRIES, v = id % LLEnc<W>::ENTRIES;
        F f = 0;
        for (u32 i = 0; i < LLEnc<W>::BITS; i++) {
            u32 bit = LLEnc<W>::BITS * b + i;
            if (bit < 8 * w && ((v >> i) & 1u) && ((pl.mask >> bit) & 1)) {
                f |= (F)1 << __popcll(pl.mask & ((1ull << bit) - 1));
            }
        }
        e.ext[b][v] = f;
    }
    __syncthreads();
    u8* fields = dst + LL_PACK_HEADER;
    u32 groups = (m + 31) / 32;
    u32* acc = e.acc[warp];
    for (u32 g = warp; g < groups; g += LL_THREADS / 32) {
        u32 i = g * 32 + lane;
        bool valid = i < m;
        u64 v = valid ? (u64)src[i] : 0;
        bool exc = valid && (((v ^ pl.base) & ~pl.mask) != 0);
        u32 bal = __ballot_sync(CFC_FULL_MASK, exc);
        if (lane == 0) {
            e.excbal[g] = bal;
            e.gcount[g] = __popc(bal);
        }
        if (k) {
            for (u32 q = lane; q < k + 2; q += 32) acc[q] = 0;
            __syncwarp();
            F f = 0;
            if (valid) {
                for (u32 b = 0; b < LLEnc<W>::PARTS; b++) {
                    f |= e.ext[b][(v >> (LLEnc<W>::BITS * b)) & (LLEnc<W>::ENTRIES - 1)];
                }
            }
            u32 off = lane * k, idx = off >> 5, sh = off & 31;
            u64 lo = (u64)f << sh;
            if (lo) {
                atomicOr(&acc[idx], (u32)lo);
                if (lo >> 32) atomicOr(&acc[idx + 1], (u32)(lo >> 32));
            }
            if (sizeof(F) == 8 && sh && (u64)f >> (64 - sh)) atomicOr(&acc[idx + 2], (u32)((u64)f >> (64 - sh)));
            __syncwarp();
            for (u32 q = lane; q < k; q += 32) *(u32*)(fields + 4 * ((u64)g * k + q)) = acc[q];
            __syncwarp();
        }
    }
    for (u32 g = groups + t; g < LL_GROUPS; g += LL_THREADS) e.gcount[g] = 0;
    __syncthreads();
    ll_scan_groups(e.gcount, e.goff, e.scratch);
    u8* idx = fields + 4 * groups * k;
    u8* vals = idx + ((2 * pl.x + 3) & ~3u);
    for (u32 g = warp; g < groups; g += LL_THREADS / 32) {
        u32 i = g * 32 + lane;
        u32 bal = e.excbal[g];
        if ((bal >> lane) & 1u) {
            u64 v = (u64)src[i];
            u32 pos = e.goff[g] + __popc(bal & ((1u << lane) - 1u));
            idx[2 * pos] = (u8)i;
            idx[2 * pos + 1] = (u8)(i >> 8);
            for (u32 b = 0; b < w; b++) vals[w * pos + b] = (u8)(v >> (8 * b));
        }
    }
    if (t == 0) {
        for (u32 b = 2 * pl.x; b < ((2 * pl.x + 3) & ~3u); b++) idx[b] = 0;
        for (u32 b = w * pl.x; b < ((w * pl.x + 3) & ~3u); b++) vals[b] = 0;
    }
    __syncthreads();
}

template <class W>
__device__ void ll_encode(const W* x, u64 n, u8* staging, u32* entries) {
    __shared__ W nz[LL_CHUNK];
    __shared__ LLEnc<W> e;
    const u32 w = sizeof(W);
    u32 t = threadIdx.x, lane = t & 31, warp = t >> 5;
    u64 c = blockIdx.x;
    u32 m = (u32)min((u64)LL_CHUNK, n - c * LL_CHUNK);
    const W* src = x + c * LL_CHUNK;
    u8* dst = staging + c * (u64)((LL_CHUNK * w + 3) & ~3u);
    u32 groups = (m + 31) / 32;
    // The bitmask of nonzero words, and the nonzero words in order (in shared memory).
    for (u32 g = warp; g < LL_GROUPS; g += LL_THREADS / 32) {
        u32 i = g * 32 + lane;
        bool nonzero = i < m && src[i] != 0;
        u32 bal = __ballot_sync(CFC_FULL_MASK, nonzero);
        if (lane == 0) {
            e.bitmask[g] = g < groups ? bal : 0;
            e.gcount[g] = __popc(bal);
        }
    }
    __syncthreads();
    u32 nnz = ll_scan_groups(e.gcount, e.goff, e.scratch);
    for (u32 g = warp; g < groups; g += LL_THREADS / 32) {
        u32 i = g * 32 + lane;
        u32 bal = e.bitmask[g];
        if ((bal >> lane) & 1u) nz[e.goff[g] + __popc(bal & ((1u << lane) - 1u))] = src[i];
    }
    __syncthreads();
    // Sizes of the four methods; the smallest wins (ties: the lower method), as encode_chunk.
    ll_plan<W>(src, m, e, 0);
    u32 raw = (m * w + 3) & ~3u;
    u32 best = raw, method = 0;
    if (e.plan[0].size < best) { best = e.plan[0].size; method = 1; }
    u32 bm = 4 * groups;
    if (nnz < m) {
        ll_plan<W>(nz, nnz, e, 1);
        u32 sparse = bm + ((nnz * w + 3) & ~3u);
        if (sparse < best) { best = sparse; method = 2; }
        u32 sp = bm + e.plan[1].size;
        if (sp < best) { best = sp; method = 3; }
    }
    if (method == 0) {
        for (u32 i = t; i < m; i += LL_THREADS) {
            W v = src[i];
            for (u32 b = 0; b < w; b++) dst[w * i + b] = (u8)((u64)v >> (8 * b));
        }
        for (u32 b = m * w + t; b < raw; b += LL_THREADS) dst[b] = 0;
    } else if (method == 1) {
        ll_write_pack<W>(src, m, e, 0, dst);
    } else {
        for (u32 g = t; g < groups; g += LL_THREADS) *(u32*)(dst + 4 * g) = e.bitmask[g];
        if (method == 2) {
            for (u32 r = t; r < nnz; r += LL_THREADS) {
                W v = nz[r];
                for (u32 b = 0; b < w; b++) dst[bm + w * r + b] = (u8)((u64)v >> (8 * b));
            }
            for (u32 b = nnz * w + t; b < ((nnz * w + 3) & ~3u); b += LL_THREADS) dst[bm + b] = 0;
        } else {
            ll_write_pack<W>(nz, nnz, e, 1, dst + bm);
        }
    }
    if (t == 0) entries[c] = (method << 28) | best;
}

extern "C" __global__ void cfc_lossless_encode_w1(const u8* x, u64 n, u8* staging, u32* entries) {
    ll_encode<u8>(x, n, staging, entries);
}
extern "C" __global__ void cfc_lossless_encode_w2(const u16* x, u64 n, u8* staging, u32* entries) {
    ll_encode<u16>(x, n, staging, entries);
}
extern "C" __global__ void cfc_lossless_encode_w4(const u32* x, u64 n, u8* staging, u32* entries) {
    ll_encode<u32>(x, n, staging, entries);
}
extern "C" __global__ void cfc_lossless_encode_w8(const u64* x, u64 n, u8* staging, u32* entries) {
    ll_encode<u64>(x, n, staging, entries);
}

// The entries' lengths as u64 words with a 0 after them, for the scan.
extern "C" __global__ void cfc_lossless_entry_lengths(const u32* entries, u64 chunks, u64* words) {
    u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (c == 0) words[chunks] = 0;
    if (c < chunks) words[c] = entries[c] & LL_LEN_MASK;
}

// After the scan (words[chunks] = all payloads): the header, and the raw-or-lossless choice.
extern "C" __global__ void cfc_lossless_finish(u8* out, u64 n, u64 chunks, u32 dtype, u32 dsize, u32 ndim,
                                               Dims dims, const u64* words, u64* frame_size, u32* raw_flag) {
    u64 header_len = 64 + 8 * (u64)ndim;
    u64 lossless_len = 4 * chunks + words[chunks];
    u64 raw_len = n * dsize;
    u32 raw = lossless_len >= raw_len ? 1 : 0;
    u64 body = raw ? raw_len : lossless_len;
    // Mode 4 (lossless), step 1.0, eps 0, no exceptions.
    cfc_write_header(out, raw ? 1 : 2, dtype, 4, 0, n, 0x3ff0000000000000ull, 0, 0, body, ndim, dims, 0);
    *frame_size = header_len + body;
    *raw_flag = raw;
}

// Pass 2, one block per chunk: its table entry and staged payload to their places, or (raw
// frame) its input bytes.
extern "C" __global__ void cfc_lossless_gather(const u8* x, u64 n, u32 dsize, u64 header_len, const u8* staging,
                                               const u32* entries, const u64* words, const u32* raw_flag, u8* out) {
    u64 c = blockIdx.x;
    u64 chunks = (n + LL_CHUNK - 1) / LL_CHUNK;
    u8* body = out + header_len;
    if (*raw_flag) {
        u64 a = c * LL_CHUNK * dsize, b = min(n, (c + 1) * LL_CHUNK) * dsize;
        for (u64 i = a + threadIdx.x; i < b; i += blockDim.x) body[i] = x[i];
        return;
    }
    if (threadIdx.x == 0) *(u32*)(body + 4 * c) = entries[c];
    u32 len = entries[c] & LL_LEN_MASK;
    const u32* from = (const u32*)(staging + c * (u64)((LL_CHUNK * dsize + 3) & ~3u));
    u32* to = (u32*)(body + 4 * chunks + words[c]);
    for (u32 i = threadIdx.x; i < len / 4; i += blockDim.x) to[i] = from[i];
}
