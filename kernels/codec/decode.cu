// The decoder: decode_offsets, decode_chunks, scatter_exceptions.
#include "codes.cuh"

// ---- decode ------------------------------------------------------------------------------
// The frame was checked on the host (Header::parse and the body checks of src/codec/bounded.rs), or was
// written by the kernels above. Kernels read step, codec and exception count from the frame's
// own header on the device, so a frame that never left the GPU decodes without a host copy.

#define HDR_CODEC 5
#define HDR_STEP 24
#define HDR_NEXC 40

// The aligned word at `a` (4-aligned), keeping only its bytes below `end` (the rest read as 0):
// nothing at or past `end` is read.
__device__ __forceinline__ u32 load_word_before(const u8* a, const u8* end) {
    if (a + 4 <= end) return *(const u32*)a;
    u32 v = 0;
    for (u32 bi = 0; bi < 4 && a + bi < end; ++bi) v |= (u32)a[bi] << (8 * bi);
    return v;
}

// Pass 1 of decoding, one span (512 chunks) per block, two chunks per thread: each
// chunk's plane words from its widths, their offsets within the tile, the tiles' offsets
// within the span, the span's total; the last span to finish scans the spans. Leaves what the
// encoder's pass 1 leaves, except that the exception counts (which the decoder does not need)
// count the widths past MAX_DECODE_WIDTH instead: totals[1] is 0 for a frame cfc wrote, and
// check_frames refuses any other (its planes would not fit the decoders' staging).
// With block scales (block_log2 nonzero: what the caller expects, which check_frames holds the
// frame to), the width table comes after them.
#define MAX_DECODE_WIDTH 64
__device__ void decode_offsets(const u8* frame, u64 header_len, u64 n, u8* ws, u32 block_log2) {
    __shared__ u32 s_warp[TILE_THREADS / 32];
    __shared__ u32 s_wide;
    if (frame[HDR_CODEC] != 0) return;  // raw: every element's place is known
    const Tiles ts = tiles_at(ws, n, TILE_CHUNKS);
    const u8* body = frame + header_len + cfc_scales_len(n, block_log2);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 c0 = (u64)blockIdx.x * SPAN_TILES * TILE_CHUNKS + 2 * threadIdx.x;
    if (threadIdx.x == 0) s_wide = 0;
    u32 w0 = 0, w1 = 0, wide = 0;
#pragma unroll
    for (u32 k = 0; k < CHUNK_GROUPS; ++k) {
        u64 g = c0 * CHUNK_GROUPS + k;
        u32 a = g < ts.groups ? body[g] : 0, b = g + CHUNK_GROUPS < ts.groups ? body[g + CHUNK_GROUPS] : 0;
        w0 += a;
        w1 += b;
        wide += (a > MAX_DECODE_WIDTH) + (b > MAX_DECODE_WIDTH);
    }
    __syncthreads();  // s_wide is set
    if (wide) atomicAdd(&s_wide, wide);
    // A tile is TPT threads: scan within it, then over the warp's tiles, then over the warps.
    const u32 TPT = TILE_CHUNKS / 2;
    u32 pair = w0 + w1, in_tile = cfc_lane_prefix_sum(pair, TPT);
    u32 tile_total = __shfl_sync(CFC_FULL_MASK, in_tile, lane | (TPT - 1));
    if (c0 < ts.chunks) ts.chunk_info[c0] = make_uint4(in_tile - pair, 0, w0, 0);
    if (c0 + 1 < ts.chunks) ts.chunk_info[c0 + 1] = make_uint4(in_tile - pair + w0, 0, w1, 0);
    u32 in_warp = cfc_lane_prefix_sum(lane % TPT == TPT - 1 ? tile_total : 0u);
    if (lane == 31) s_warp[warp] = in_warp;
    __syncthreads();
    u32 before = 0, span_total = 0;
    for (u32 k = 0; k < TILE_THREADS / 32; ++k) {
        before += k < warp ? s_warp[k] : 0;
        span_total += s_warp[k];
    }
    u64 tile = (u64)blockIdx.x * SPAN_TILES + threadIdx.x / TPT;
    if (lane % TPT == TPT - 1 && tile < ts.tiles) {
        ts.tile_words[tile] = before + in_warp - tile_total;
        ts.tile_excs[tile] = 0;
    }
    if (warp != 0) return;
    u32 last = 0;
    if (lane == 0) {
        ts.span_words[blockIdx.x] = span_total;
        ts.span_excs[blockIdx.x] = s_wide;  // the __syncthreads above follows every atomicAdd
        __threadfence();  // the span's total is visible before it counts as done
        last = atomicAdd(ts.done, 1u) == ts.spans - 1;
    }
    if (!__shfl_sync(CFC_FULL_MASK, last, 0)) return;
    __threadfence();
    u64 sw, se;
    warp_scan_pairs(ts.span_words, ts.span_excs, ts.spans, &sw, &se);
    if (lane == 0) {
        ts.totals[0] = sw;
        ts.totals[1] = se;
    }
}

extern "C" __global__ void cfc_codec_decode_offsets(const u8* frame, u64 header_len, u64 n, u8* ws) {
    decode_offsets(frame, header_len, n, ws, 0);  // (cfc.decompress: frames without block scales)
}

// One warp copies chunk `ch`'s planes (decode_offsets has run), realigned, to `st` (up to 64
// words per group). Lane u < 8 gets group u's width in *wl and, in *inc, the plane words up to
// and including that group (so group u's planes are st[inc - wl, inc)).
__device__ __forceinline__ void stage_chunk_planes(const u8* body, const Tiles& ts, u64 ch, u32* st, u32* wl,
                                                   u32* inc) {
    const u32 lane = threadIdx.x & 31;
    *wl = lane < CHUNK_GROUPS && ch * CHUNK_GROUPS + lane < ts.groups ? body[ch * CHUNK_GROUPS + lane] : 0;
    *inc = cfc_lane_prefix_sum(*wl, CHUNK_GROUPS);
    const u32 nw = __shfl_sync(CFC_FULL_MASK, *inc, CHUNK_GROUPS - 1);
    const uint4 info = ts.chunk_info[ch];
    const u8* pb = body + ts.groups + 4 * (words_before(ts, ch / TILE_CHUNKS) + info.x);
    const u8* end = pb + 4 * (u64)nw;
    const u32 sh = (u32)((u64)pb & 3);
    const u8* a0 = pb - sh;  // still inside the frame: the widths come before
    for (u32 k = lane; k < nw; k += 32) {
        u32 lo = *(const u32*)(a0 + 4 * k);
        st[k] = sh == 0 ? lo : __funnelshift_r(lo, load_word_before(a0 + 4 * k + 4, end), 8 * sh);
    }
    __syncwarp();
}

// Up to 8 decoded values v[0..cnt) to dst: 16-byte stores where all 8 exist and dst allows.
template <class D>
__device__ __forceinline__ void store_8(typename D::T* dst, const typename D::T* v, u32 cnt) {
    if (cnt == 8 && (u64)dst % 16 == 0) {
        u32 b[8];
#pragma unroll
        for (u32 i = 0; i < 8; ++i) b[i] = D::bits(v[i]);
        if (D::SIZE == 4) {
            ((uint4*)dst)[0] = make_uint4(b[0], b[1], b[2], b[3]);
            ((uint4*)dst)[1] = make_uint4(b[4], b[5], b[6], b[7]);
        } else {
            *(uint4*)dst = make_uint4(b[0] | b[1] << 16, b[2] | b[3] << 16, b[4] | b[5] << 16, b[6] | b[7] << 16);
        }
        return;
    }
#pragma unroll
    for (u32 i = 0; i < 8; ++i)
        if (i < cnt) dst[i] = v[i];
}

// Pass 2, one chunk per warp: the chunk's planes copied, realigned, to the warp's part of
// shared memory; then 4 lanes per group, each rebuilding 8 consecutive codes a byte at a time
// (unslice_codes) and writing their values together. Widths past 32 (frames of summed codes,
// up to 64 bits) take one bit at a time. Raw frames: the elements are copied.
template <class D>
__device__ void decode_chunks(const u8* frame, u64 header_len, u64 n, u8* ws, typename D::T* __restrict__ out) {
    __shared__ u32 stage[TILE_THREADS / 32][CHUNK_GROUPS * 64];  // a part per warp
    const Tiles ts = tiles_at(ws, n, TILE_CHUNKS);
    const u8* body = frame + header_len;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 ch = (u64)blockIdx.x * (TILE_THREADS / 32) + warp;  // a chunk per warp
    if (ch >= ts.chunks) return;
    const u64 e0 = ch * CHUNK_VALUES;
    const u32 have = chunk_values(n, ch);
    typename D::T* oc = out + e0;
    if (frame[HDR_CODEC] != 0) {
        bool typed = ((u64)body % D::SIZE) == 0;
        for (u32 j = lane; j < have; j += 32)
            oc[j] = typed ? ((const typename D::T*)body)[e0 + j]
                          : D::from_bits((u32)cfc_load_le(body + (e0 + j) * D::SIZE, D::SIZE));
        return;
    }
    u32 wl, inc;
    const u32* st = stage[warp];
    stage_chunk_planes(body, ts, ch, stage[warp], &wl, &inc);
    const double step = __longlong_as_double((i64)cfc_load_le(frame + HDR_STEP, 8));
    const u32 u = lane / 4, k = lane % 4;  // this lane: codes 8k .. 8k + 7 of group u
    const u32 w = __shfl_sync(CFC_FULL_MASK, wl, u);
    const u32* planes = st + __shfl_sync(CFC_FULL_MASK, inc - wl, u);
    const u32 j0 = u * CFC_GROUP + 8 * k;  // the first of them in the chunk
    typename D::T v[8];
    if (w <= 32) {
        u32 z[8];
        unslice_codes(planes, w, k, z);
#pragma unroll
        for (u32 i = 0; i < 8; ++i) v[i] = decode_zigzag32<D>(z[i], step);
    } else {  // sums of codes: up to 64 bits
#pragma unroll
        for (u32 i = 0; i < 8; ++i) v[i] = D::from_f32(__double2float_rn((double)code_at(planes, w, 8 * k + i) * step));
    }
    store_8<D>(oc + j0, v, j0 >= have ? 0 : min(have - j0, 8u));
}

#define DECODE_CHUNKS(name, D)                                                                     \
    extern "C" __global__ void cfc_codec_decode_chunks_##name(const u8* frame, u64 header_len,     \
            u64 n, u8* ws, D::T* out) {                                                            \
        decode_chunks<D>(frame, header_len, n, ws, out);                                           \
    }
DEFINE_FOR_DTYPES(DECODE_CHUNKS)

// After decode_chunks (which wrote code 0's value there): every exception's stored bits.
template <class D>
__device__ void scatter_exceptions(const u8* frame, u64 header_len, u64 n, u64 groups, const u64* nwords,
                                   typename D::T* out) {
    u64 n_exc = frame[HDR_CODEC] == 0 ? cfc_load_le(frame + HDR_NEXC, 8) : 0;
    if (n_exc == 0) return;
    u64 idx_size = n <= (1ull << 32) ? 4 : 8;
    const u8* idx = frame + header_len + groups + 4 * *nwords;
    const u8* val = idx + n_exc * idx_size;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n_exc; k += (u64)gridDim.x * blockDim.x) {
        u64 i = cfc_load_le(idx + k * idx_size, (int)idx_size);
        if (i < n) out[i] = D::from_bits((u32)cfc_load_le(val + k * D::SIZE, D::SIZE));
    }
}

#define SCATTER(name, D)                                                                           \
    extern "C" __global__ void cfc_codec_scatter_exceptions_##name(const u8* frame, u64 header_len, \
            u64 n, u64 groups, const u64* nwords, D::T* out) {                                     \
        scatter_exceptions<D>(frame, header_len, n, groups, nwords, out);                          \
    }
DEFINE_FOR_DTYPES(SCATTER)
