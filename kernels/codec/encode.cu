// The encoder: encode_groups, then pack_chunks; and error feedback ahead of an uncompressed send.
#include "codes.cuh"

// Error feedback ahead of an uncompressed send (the GPU all-reduce falling back to NCCL's own
// all-reduce): x = dtype(x + r) and r = 0, so what earlier compressed calls dropped goes out
// with this one. The rounding of x + r to a 16-bit dtype is not kept: a plain send of that
// dtype rounds the same way, and keeping it would cost this pass on every later plain call.
template <class D>
__device__ void fold_residual(typename D::T* x, u64 n, float* residual) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        typename D::T xi = x[i];
        x[i] = cfc_sent_value<D>(xi, cfc_compensate(D::to_f32(xi), residual[i]));
        residual[i] = 0.0f;
    }
}

#define FOLD_RESIDUAL(name, D)                                                                     \
    extern "C" __global__ void cfc_codec_fold_residual_##name(D::T* x, u64 n, float* residual) {   \
        fold_residual<D>(x, n, residual);                                                          \
    }
DEFINE_FOR_DTYPES(FOLD_RESIDUAL)

// ---- encode ----------------------------------------------------------------------------

// One thread's group: its 32 values in `row` (shared memory) are replaced by their codes; the
// OR of the codes, the exception mask, the codes' low bytes as slice_planes wants them and, at
// fixed rate, the largest error.
template <class D, bool FIXED>
__device__ __forceinline__ void code_group(u32* row, const CfcParams& P, u32* acc, u32* excm, u32* w8,
                                           double* max_err) {
#pragma unroll
    for (int j = 0; j < CFC_GROUP; ++j) {
        bool exc;
        double err;
        u32 z = encode_value<D, FIXED>(__uint_as_float(row[j]), P, &exc, &err);
        if (FIXED) *max_err = fmax(*max_err, err);
        *acc |= z;
        *excm |= (u32)exc << j;
        row[j] = z;  // for the planes past the first 8, rarely needed
        const int m = j / 4, b = j % 4;
        w8[m] = b == 0 ? z : __byte_perm(w8[m], z, b == 1 ? 0x3240 : b == 2 ? 0x3410 : 0x4210);
    }
}

// code_group for float32 in the bounded modes, by the float32 route: no value is an exception.
// The codes are not written back to the row (the slices past the first recompute them from
// the values, see encode_groups). Returns false when it was unsure of any value: the caller
// then codes the group, whose values are still in the row, by the f64 rule.
__device__ __forceinline__ bool code_group_f32(const u32* row, float inv, u32* acc, u32* w8) {
    bool all_sure = true;
#pragma unroll
    for (int j = 0; j < CFC_GROUP; ++j) {
        bool sure;
        const u32 z = f32_code(__uint_as_float(row[j]), inv, &sure);
        all_sure = all_sure && sure;
        *acc |= z;
        const int m = j / 4, b = j % 4;
        w8[m] = b == 0 ? z : __byte_perm(w8[m], z, b == 1 ? 0x3240 : b == 2 ? 0x3410 : 0x4210);
    }
    return all_sure;
}

// Stages the COUNT values v[0..COUNT) as float32 into s_row[0..COUNT); with error feedback (r,
// their residuals, not null) the values sent for x + r, and the compensated values x + r into
// c_row[0..COUNT).
template <class D, int COUNT>
__device__ __forceinline__ void stage_values(const typename D::T* v, const float* r, float* s_row, float* c_row) {
#pragma unroll
    for (int c = 0; c < COUNT; ++c) {
        typename D::T x = v[c];
        if (r) {
            float comp = cfc_compensate(D::to_f32(x), r[c]);
            x = cfc_sent_value<D>(x, comp);
            c_row[c] = comp;
        }
        s_row[c] = D::to_f32(x);
    }
}

// With error feedback, after a group is coded: its new residuals, c - (what the frame decodes
// to), replace the codes (or values) in `row`; `crow` holds the compensated values c. Returns
// whether pass 2 could fail to rebuild some c as decoded + residual (an exception, whose value
// is not decoded, or a subtraction that was not exact), in which case the caller keeps the
// group's c in the workspace. Pass 2 needs c only for the raw bytes of a frame that falls back
// to raw, and for exceptions' values.
template <class D>
__device__ __noinline__ bool group_residuals(u32* row, const float* crow, bool codes_in_row, float inv32,
                                             double step, u32 excm) {
    bool keep = excm != 0;
#pragma unroll 4
    for (int j = 0; j < CFC_GROUP; ++j) {
        bool sure;
        const u32 z = codes_in_row ? row[j] : f32_code(__uint_as_float(row[j]), inv32, &sure);
        const float c = crow[j];
        float d;
        if ((excm >> j) & 1u) {
            d = D::to_f32(D::from_f32(c));  // sent as it is (c is not finite where x was not)
        } else {
            d = D::to_f32(decode_zigzag32<D>(z, step));
        }
        const float rn = cfc_new_residual(c, d);
        keep = keep || __float_as_uint(d + rn) != __float_as_uint(c);
        row[j] = __float_as_uint(rn);
    }
    return keep;
}

// What coding a group by the f64 rule yields besides its codes (left in the row).
struct GroupCoded {
    u32 acc, excm;
    double max_err;
};

// code_group, out of line, for what is rare with float32 input: fixed rate, a group the float32
// route was unsure of (it leaves the values in the row), a bound outside the route's range.
// Keeping these out of the encoder's body keeps that body small, which matters for small
// inputs, where every SM runs it once from a cold instruction cache. The caller gathers the
// codes' low bytes from the row.
template <class D>
__device__ __noinline__ GroupCoded code_group_f64(u32* row, double step, double inv_step, double eps, u32 fixed) {
    CfcParams P;
    P.step = step;
    P.inv_step = inv_step;
    P.eps = eps;
    GroupCoded r = {0u, 0u, 0.0};
    u32 w8[8];  // not used: the caller gathers them
    if (fixed)
        code_group<D, true>(row, P, &r.acc, &r.excm, w8, &r.max_err);
    else
        code_group<D, false>(row, P, &r.acc, &r.excm, w8, &r.max_err);
    return r;
}

// Pass 1, a thread per group (a tile of 8 wc chunks is a block of 64 wc threads): the tile's
// values are staged in shared memory (with error feedback the values sent for x + r, and x + r
// itself in a second row; zeros past the end, which code to 0), then each thread quantizes its
// group once, writes its width to the frame, stages its bit planes right after those of the
// groups before it in the tile, and its exceptions in excmask; with error feedback it also
// works out the new residuals, which the block writes back in the order it read them (the
// residual is read and written once, here). Then the tile's sizes (tile_totals). A group's 32
// values are a row of 33 floats in shared memory, so that both the coalesced staging and each
// thread's walk along its row are free of bank conflicts.
#define STAGE_ROW 33
// Where value i of a tile sits in the shared-memory rows: row i / 32, column i % 32.
__device__ __forceinline__ u32 stage_at(u32 i) { return (i / CFC_GROUP) * STAGE_ROW + i % CFC_GROUP; }
// With block scales (`shifts` not null, blocks of 2^block_log2 values), each group is coded with
// its block's step and bound, the header's halved its block's shift times; `body` is then the
// frame's width table, after the scales.
template <class D>
__device__ void encode_groups(const typename D::T* __restrict__ x, u64 n, u32 mode, double value,
                              u32 fixed, u8* body, u8* ws, float* __restrict__ residual,
                              const u8* shifts, u32 block_log2) {
    extern __shared__ float s_vals[];  // blockDim.x rows of STAGE_ROW (twice that with a residual)
    __shared__ u32 s_cw[TILE_CHUNKS], s_ce[TILE_CHUNKS], s_cwo[32];
    CfcParams* pp = (CfcParams*)ws;
    const u32 threads = blockDim.x, tid = threadIdx.x;
    const Tiles ts = tiles_at(ws, n, threads / CHUNK_GROUPS);
    CfcParams P = make_params(mode, value, __longlong_as_double((i64)pp->max_abs_bits));
    if (blockIdx.x == 0 && tid == 0) {  // for pass 2 and the host
        pp->step = P.step;
        pp->inv_step = P.inv_step;
        pp->eps = P.eps;
        pp->error = P.error;
    }
    // An unusable bound (rel) is reported on the host; the residual must then stay as it was.
    if (P.error) residual = nullptr;
    const u64 first = (u64)blockIdx.x * threads * CFC_GROUP;  // the tile's first value
    const u32 tile_values = threads * CFC_GROUP;
    const u32 have = first >= n ? 0 : (u32)min(n - first, (u64)tile_values);
    const typename D::T* xt = x + first;
    float* rt = residual ? residual + first : nullptr;
    float* s_comp = s_vals + threads * STAGE_ROW;  // with a residual: the compensated values
    // 16-byte loads (V values each) where the whole tile exists and the pointers allow it.
    constexpr u32 V = 16 / sizeof(typename D::T);
    const bool whole = have == tile_values && (u64)xt % 16 == 0 && (u64)rt % 16 == 0;
    if (whole) {
#pragma unroll 4
        for (u32 k = 0; k < CFC_GROUP / V; ++k) {
            const u32 i0 = (k * threads + tid) * V;  // V values of one row
            const u32 at = stage_at(i0);
            uint4 raw = ((const uint4*)xt)[k * threads + tid];
            float4 r4[V / 4];
            if (rt)
#pragma unroll
                for (u32 c = 0; c < V / 4; ++c) r4[c] = ((const float4*)(rt + i0))[c];
            stage_values<D, V>((const typename D::T*)&raw, rt ? (const float*)r4 : nullptr, s_vals + at, s_comp + at);
        }
    } else {  // one value at a time; zeros past the end (they code to 0, with no exception)
#pragma unroll 4
        for (u32 k = 0; k < CFC_GROUP; ++k) {
            const u32 i = k * threads + tid;
            const u32 at = stage_at(i);
            if (i < have)
                stage_values<D, 1>(xt + i, rt ? rt + i : nullptr, s_vals + at, s_comp + at);
            else if (rt)
                s_vals[at] = s_comp[at] = 0.0f;
            else
                s_vals[at] = 0.0f;
        }
    }
    __syncthreads();
    const u64 g = (u64)blockIdx.x * threads + tid;  // this thread's group
    u32* row = (u32*)s_vals + tid * STAGE_ROW;      // its values, then its codes
    if (g < ts.groups) P = cfc_group_params(P, shifts, block_log2, g);  // its block's step and bound
    u32 acc = 0, excm = 0, w8[8];  // w8: the low bytes of the codes (see slice_planes)
    double max_err = 0.0;
    // The row holds the codes after code_group; after code_group_f32 it still holds the values.
    // (Whether the route is on is the same for the whole launch; only a group it is unsure of
    // takes another branch.)
    bool codes_in_row = true;
    const float inv32 = __double2float_rn(P.inv_step);
    if (D::SIZE == 4 && !fixed && f32_route_on(P) && code_group_f32(row, inv32, &acc, w8)) {
        codes_in_row = false;  // float32 (the only 4-byte dtype), every value sure
    } else if (D::SIZE == 4 || fixed) {
        const GroupCoded c = code_group_f64<D>(row, P.step, P.inv_step, P.eps, fixed);
        acc = c.acc;
        excm = c.excm;
        max_err = c.max_err;
#pragma unroll
        for (int m = 0; m < 8; ++m)  // byte 0 of codes 4m .. 4m + 3
            w8[m] = __byte_perm(__byte_perm(row[4 * m], row[4 * m + 1], 0x40),
                                __byte_perm(row[4 * m + 2], row[4 * m + 3], 0x40), 0x5410);
    } else {
        code_group<D, false>(row, P, &acc, &excm, w8, &max_err);  // bfloat16, float16
    }
    const bool exists = g < ts.groups;
    const u32 w = !exists ? 0 : fixed ? fixed : 32 - __clz(acc);
    // The 8 lanes of a chunk: where this group's planes start in the slot, the chunk's totals.
    const u32 iw = cfc_lane_prefix_sum(w, CHUNK_GROUPS);
    const u32 ie = cfc_lane_prefix_sum((u32)__popc(excm), CHUNK_GROUPS);
    const u32 cw = __shfl_sync(CFC_FULL_MASK, iw, CHUNK_GROUPS - 1, CHUNK_GROUPS);
    const u32 ce = __shfl_sync(CFC_FULL_MASK, ie, CHUNK_GROUPS - 1, CHUNK_GROUPS);
    if (exists) {
        body[g] = (u8)w;
        if (ce) ts.excmask[g] = excm;
    }
    if (tid % CHUNK_GROUPS == CHUNK_GROUPS - 1) {
        s_cw[tid / CHUNK_GROUPS] = cw;
        s_ce[tid / CHUNK_GROUPS] = ce;
    }
    __syncthreads();
    if (tid < 32) {  // where each chunk's planes start among the tile's
        u32 v = tid < ts.tile_chunks ? s_cw[tid] : 0;
        s_cwo[tid] = cfc_lane_prefix_sum(v) - v;
    }
    __syncthreads();
    // The tile's planes are staged back to back, so that pass 2 moves them in one piece.
    u32* slot = ts.stage + (u64)blockIdx.x * ts.tile_chunks * (CHUNK_GROUPS * 32) +
                s_cwo[tid / CHUNK_GROUPS] + (iw - w);
    for (u32 s = 0; 8 * s < w; ++s) {
        if (s > 0) {  // byte s of every code, from the row
            if (!codes_in_row) {  // the float32 route left the values there: code them again
#pragma unroll
                for (int j = 0; j < CFC_GROUP; ++j) {
                    bool sure;  // (it was, the first time)
                    row[j] = f32_code(__uint_as_float(row[j]), inv32, &sure);
                }
                codes_in_row = true;
            }
            const u32 sel = s | (s + 4) << 4;
#pragma unroll
            for (int m = 0; m < 8; ++m)
                w8[m] = __byte_perm(__byte_perm(row[4 * m], row[4 * m + 1], sel),
                                    __byte_perm(row[4 * m + 2], row[4 * m + 3], sel), 0x5410);
        }
        u32 plane[8];
        slice_planes(w8, plane);
#pragma unroll
        for (u32 b = 0; b < 8; ++b)
            if (8 * s + b < w) slot[8 * s + b] = plane[b];
    }
    if (rt) {  // the new residuals, into the row; c kept where pass 2 may need it
        const bool keep = group_residuals<D>(row, s_comp + tid * STAGE_ROW, codes_in_row, inv32, P.step, excm);
        if (exists) {
            ts.gw[g] = (u8)(w | (keep ? GW_KEPT : 0u));
            if (keep)
                for (u32 j = 0; j < CFC_GROUP; ++j) ts.cvals[g * CFC_GROUP + j] = s_comp[tid * STAGE_ROW + j];
        }
    }
    if (fixed) block_max_to(&pp->max_err_bits, max_err);  // holds a __syncthreads
    __syncthreads();
    if (rt) {  // written back as they were read
        if (whole) {
#pragma unroll 4
            for (u32 k = 0; k < CFC_GROUP / 4; ++k) {
                const u32 i0 = (k * threads + tid) * 4;
                const float* at = s_vals + stage_at(i0);
                ((float4*)rt)[k * threads + tid] = make_float4(at[0], at[1], at[2], at[3]);
            }
        } else {
#pragma unroll 4
            for (u32 k = 0; k < CFC_GROUP; ++k) {
                const u32 i = k * threads + tid;
                if (i < have) rt[i] = s_vals[stage_at(i)];
            }
        }
    }
    if (tid < 32) {
        bool in = tid < ts.tile_chunks;
        tile_totals(ts, blockIdx.x, in ? s_cw[tid] : 0, in ? s_ce[tid] : 0);
    }
}

#define ENCODE_GROUPS(name, D)                                                                     \
    extern "C" __global__ __launch_bounds__(TILE_THREADS, 4) void cfc_codec_encode_groups_##name(  \
            const D::T* x, u64 n, u32 mode, double value, u32 fixed, u8* body, u8* ws,             \
            float* residual, const u8* shifts, u32 block_log2) {                                   \
        encode_groups<D>(x, n, mode, value, fixed, body, ws, residual, shifts, block_log2);        \
    }
DEFINE_FOR_DTYPES(ENCODE_GROUPS)

// pack_chunks' work for chunk `ch` of a frame that falls back to raw, with error feedback (rare;
// run from a loop of its own, so that the common loop keeps its registers): each compensated
// value c is rebuilt as decoded + residual from the staged planes (pass 1 checked that this
// gives c back exactly) or read where pass 1 kept it; then the value sent for it as raw bytes,
// and the residual a raw frame leaves. `words_in_tile`: the chunk's first staged plane word
// among its tile's.
template <class D>
__device__ __forceinline__ void raw_chunk_with_feedback(const typename D::T* x, const Tiles& ts, u64 ch,
                                                        u32 words_in_tile, u32 have, u8* body, float* residual,
                                                        double step, bool typed, const u8* shifts, u32 block_log2) {
    const u32 lane = threadIdx.x & 31;
    const u64 g0 = ch * CHUNK_GROUPS, e0 = ch * CHUNK_VALUES;
    // Lane u < 8: group u's width, whether its c are kept, where its planes start.
    const u32 gw_l = lane < CHUNK_GROUPS && g0 + lane < ts.groups ? ts.gw[g0 + lane] : 0;
    const u32 wl = gw_l & ~GW_KEPT, inc = cfc_lane_prefix_sum(wl, CHUNK_GROUPS);
    const u32* planes_l = ts.stage + (ch / ts.tile_chunks) * ts.tile_chunks * (CHUNK_GROUPS * 32) + words_in_tile + inc - wl;
    for (u32 u = 0; u < CHUNK_GROUPS; ++u) {
        const u32 gwu = __shfl_sync(CFC_FULL_MASK, gw_l, u);
        const u32* planes = (const u32*)__shfl_sync(CFC_FULL_MASK, (u64)planes_l, u);
        const u32 j = u * CFC_GROUP + lane;
        if (j >= have) continue;
        float c;
        if (gwu & GW_KEPT) {
            c = ts.cvals[e0 + j];
        } else {
            const i64 q = code_at(planes, gwu, lane);
            const double sg = cfc_group_step(step, shifts, block_log2, g0 + u);
            c = D::to_f32(cfc_dequantize<D>(q, sg)) + residual[e0 + j];
        }
        const typename D::T v = cfc_sent_value<D>(x[e0 + j], c);
        residual[e0 + j] = cfc_new_residual(c, D::to_f32(v));
        if (typed)
            ((typename D::T*)body)[e0 + j] = v;
        else
            cfc_store_le(body + (e0 + j) * D::SIZE, D::bits(v), D::SIZE);
    }
}

// Pass 2, with the tiles of pass 1 (a tile per block, its 8 warps taking wc chunks each): block 0
// writes the header and the frame size (also to size_to unless null: the head of a row that an
// exchange sends, without a copy queued after this kernel); then, as the totals decide (the CPU
// reference's rule), either the elements' raw bytes, or the tile's staged planes (by the whole
// block) and each chunk's exceptions in their places. With error feedback pass 1 has written the residuals a
// quantized frame leaves, and kept the compensated values c of groups with exceptions (whose
// values are sent as they are); only a frame that falls back to raw rewrites the residuals,
// each c being rebuilt as decoded + residual from the staged planes, or read where kept.
// With block scales (`shifts` not null), a quantized body starts with them (copied here), and its
// width table, planes and exceptions follow; a raw frame has none.
template <class D>
__device__ void pack_chunks(const typename D::T* __restrict__ x, u64 n, u32 dtype, u32 mode, u32 fixed,
                            u32 ndim, const Dims& dims, u8* __restrict__ out, u8* __restrict__ ws,
                            float* __restrict__ residual, u32 wc, u64* size_to, u64* max_to,
                            const u8* shifts, u32 block_log2) {
    const CfcParams* pp = (const CfcParams*)ws;
    float* const residual_in = residual;  // (`residual` is cleared below where it must stay)
    const Tiles ts = tiles_at(ws, n, (TILE_THREADS / 32) * wc);
    const u32 size = D::SIZE;
    const u64 groups = ts.groups;
    const u64 header_len = 64 + 8 * (u64)ndim;
    u8* body = out + header_len;  // a raw frame's bytes
    const u64 scales_len = shifts ? cfc_scales_len(n, block_log2) : 0;
    u8* qbody = body + scales_len;  // a quantized frame's width table and what follows it
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // This warp's chunks (those of encode_groups' threads 8 k to 8 k + 7 for chunk k).
    const u64 ch0 = (u64)blockIdx.x * ts.tile_chunks + warp * wc;
    const u64 tile = blockIdx.x;
    const u64 tile_ch0 = tile * ts.tile_chunks;
    const bool tile_in = tile_ch0 < ts.chunks;
    // Every load the tile's copy of planes needs is issued here, together, before any of them
    // decides anything: the totals and parameters, the tile's sizes and offset, and its first
    // staged words (which lie in the tile's room whatever the totals say; past its planes they
    // are not used). Blocks are short, so one round trip instead of three matters. (The
    // chunks' own entries are read only where a chunk needs more than its planes.)
    const u32* staged = ts.stage + tile_ch0 * (CHUNK_GROUPS * 32);
    const u32 room = tile_in ? (u32)(min(tile_ch0 + ts.tile_chunks, ts.chunks) - tile_ch0) * CHUNK_VALUES : 0;
    const u32 k0 = threadIdx.x;
    const u32 cur0 = k0 < room ? staged[k0] : 0, prev0 = k0 > 0 && k0 <= room ? staged[k0 - 1] : 0;
    const uint4 last = tile_in ? ts.chunk_info[min(tile_ch0 + ts.tile_chunks, ts.chunks) - 1] : make_uint4(0, 0, 0, 0);
    const u64 tile_wb = tile_in ? words_before(ts, tile) : 0;
    const u64 nwords = ts.totals[0], n_exc = ts.totals[1];
    CfcParams P;
    P.step = pp->step;
    P.inv_step = pp->inv_step;
    P.eps = pp->eps;
    const u64 max_err_bits = pp->max_err_bits;
    if (pp->error) residual = nullptr;  // as in pass 1: leave the residual untouched
    const u64 idx_size = n <= (1ull << 32) ? 4 : 8;
    const u64 quant_len = scales_len + groups + 4 * nwords + n_exc * (idx_size + size);
    const bool raw = !fixed && quant_len >= n * size;
    if (!raw && tile_in) {  // the tile's planes, staged back to back, in one piece
        // The output has room for a body smaller than the raw bytes (fixed rate excepted).
        const u8* limit = fixed ? (const u8*)~0ull : body + n * size;
        put_words_block(qbody + groups + 4 * tile_wb, staged, last.x + last.z, limit, cur0, prev0);
    }
    if (!raw && scales_len)  // the scales, ahead of the width table pass 1 wrote
        for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < scales_len; k += (u64)gridDim.x * blockDim.x)
            body[k] = shifts[k];
    // Then, chunk by chunk, what the tile has besides planes: raw bytes (and residuals), exceptions.
    const bool typed = ((u64)body % size) == 0;  // raw bytes can be stored as elements
    if (raw && residual)  // (on its own, so that the loop below keeps its registers)
        for (u32 k = 0; k < wc && ch0 + k < ts.chunks; ++k)
            raw_chunk_with_feedback<D>(x, ts, ch0 + k, ts.chunk_info[ch0 + k].x, chunk_values(n, ch0 + k), body,
                                       residual, P.step, typed, shifts, block_log2);
    const bool any = ch0 < ts.chunks && (raw || last.y + last.w) && !(raw && residual);
    const u64 eb = any ? excs_before(ts, tile) : 0;
    uint4 info[WARP_CHUNKS];  // x, y: words and exceptions before the chunk in its tile; z, w: own
#pragma unroll
    for (int k = 0; k < WARP_CHUNKS; ++k) {
        bool in = any && k < wc && ch0 + k < ts.chunks;
        info[k] = in ? ts.chunk_info[ch0 + k] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (u32 k = 0; k < WARP_CHUNKS; ++k) {  // unrolled: info[k] stays in registers
        const u64 ch = ch0 + k;
        if (!any || k >= wc || ch >= ts.chunks) break;  // the same for the whole warp
        const u64 e0 = ch * CHUNK_VALUES;
        const u32 have = chunk_values(n, ch);
        if (!(raw || info[k].w)) continue;
        // Each group's first exception slot: lane u < 8 holds group u's mask and slot.
        u32 mask_l = 0;
        u64 first_l = 0;
        if (!raw) {
            u64 g = ch * CHUNK_GROUPS + lane;
            mask_l = lane < CHUNK_GROUPS && g < groups ? ts.excmask[g] : 0;
            u32 inc = cfc_lane_prefix_sum((u32)__popc(mask_l), CHUNK_GROUPS);
            first_l = eb + info[k].y + inc - __popc(mask_l);
        }
        u8* idx = qbody + groups + 4 * nwords;
        u8* val = idx + n_exc * idx_size;
        const typename D::T* xc = x + e0;
        float* rc = residual ? residual + e0 : nullptr;
#pragma unroll 2
        for (int u = 0; u < CHUNK_GROUPS; ++u) {
            u32 mask = __shfl_sync(CFC_FULL_MASK, mask_l, u);
            u64 first = __shfl_sync(CFC_FULL_MASK, first_l, u);
            u32 j = u * CFC_GROUP + lane;
            bool is_exc = (mask >> lane) & 1u;
            if (j >= have || !(raw || is_exc)) continue;
            typename D::T v = xc[j];
            if (rc) v = cfc_sent_value<D>(v, ts.cvals[e0 + j]);  // an exception's c is kept
            if (raw) {
                if (typed)
                    ((typename D::T*)body)[e0 + j] = v;
                else
                    cfc_store_le(body + (e0 + j) * size, D::bits(v), size);
            } else if (is_exc) {
                u64 q = first + __popc(mask & ((1u << lane) - 1u));
                cfc_store_le(idx + q * idx_size, e0 + j, (int)idx_size);
                cfc_store_le(val + q * size, D::bits(v), size);
            }
        }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        u64 blen = raw ? n * size : quant_len;
        u64 eps = fixed ? max_err_bits : (u64)__double_as_longlong(P.eps);
        cfc_write_header(out, raw ? 1 : 0, dtype, mode, fixed, n, (u64)__double_as_longlong(P.step), eps,
                         raw ? 0 : n_exc, blen, ndim, dims, raw || !shifts ? 0 : block_log2);
        // An unusable bound (coded with eps 1, reported by the error word) leaves no frame that
        // a reader on the device would take: the sums and decoders that may read it before the
        // host waits check the magic, as the host's readers do.
        if (pp->error) out[0] = 0;
        *(u64*)(ws + 64) = header_len + blen;
        *(u32*)(ws + 72) = raw ? 1u : 0u;
        if (size_to) *size_to = header_len + blen;
    }
    // Error feedback's running maximum (cfc_hook's largest error sent): the largest finite
    // |residual| of this block's chunks raises *max_to unless null, here rather than in a kernel
    // of its own after this one. The residuals are final: pass 1 wrote a quantized frame's, and
    // only this warp writes its chunks' in this pass (a raw frame's; the sync orders its lanes).
    if (max_to && residual_in) {  // the same for the whole block: every thread reaches the sync
        __syncwarp();
        double m = 0.0;
        for (u32 k = 0; k < wc && ch0 + k < ts.chunks; ++k) {
            const float* rc = residual_in + (ch0 + k) * CHUNK_VALUES;
            const u32 have = chunk_values(n, ch0 + k);
            for (u32 j = lane; j < have; j += 32) {
                const float v = fabsf(rc[j]);
                if (v <= 3.402823466e38f) m = fmax(m, (double)v);  // finite only (NaN fails the test)
            }
        }
        block_max_to(max_to, m);
    }
}

#define PACK_CHUNKS(name, D)                                                                       \
    extern "C" __global__ void cfc_codec_pack_chunks_##name(const D::T* x, u64 n, u32 dtype,       \
            u32 mode, u32 fixed, u32 ndim, Dims dims, u8* out, u8* ws, float* residual, u32 wc,    \
            u64* size_to, u64* max_to, const u8* shifts, u32 block_log2) {                         \
        pack_chunks<D>(x, n, dtype, mode, fixed, ndim, dims, out, ws, residual, wc, size_to,       \
                       max_to, shifts, block_log2);                                                \
    }
DEFINE_FOR_DTYPES(PACK_CHUNKS)
