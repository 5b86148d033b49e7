// Sums of frames with one step, and the checks of frames from elsewhere that come before them.
#include "codes.cuh"

// ---- sums of frames ----------------------------------------------------------------------
// The device side of src/codec/sum.rs (Codes::sum, then Codes::to_frame without zstd), for frames of
// one dtype and length, checked on the host or written by the kernels above. sum_offsets finds
// where every part's chunks lie (decode_offsets, a part per grid row, each in its own region of
// the workspace); sum_chunks then takes a chunk of the sum per warp and, part after part in
// order, adds the part's codes into registers (0 where the part holds an exception, which its
// sorted exception list tells), and writes the sum's widths, codes (`acc`, i64) and exception
// mask, and the chunk's sizes (tile_totals). Where any part holds an exception, sum_values adds
// every part's decoded value there in f64, in part order, and keeps the bits the sum stores
// (`value_bits`). sum_pack writes the frame, as the encoder's pass 2 does. The workspace's
// CfcParams carry the step (the first part's), eps (the parts' eps added in order) and the
// error bits below; a frame with an error gets size 0.
#define HDR_EPS 32
#define SUM_STEPS_DIFFER 1u
#define SUM_OVERFLOW 2u
#define SUM_BAD_FRAME 4u  // set by check_frames: the sum's kernels then add nothing
#define SUM_EPS_OVERFLOW 8u  // the parts' eps add up past the largest f64 (the CPU refuses it too)

// The bits a sum's exception stores for the f64 total of the parts' values there (sum_bits in
// src/codec/sum.rs): rounded to f32, then to the dtype; NaN as the quiet NaN, whatever its payload.
template <class D>
__device__ __forceinline__ u32 sum_value_bits(double total) {
    float f = isnan(total) ? __int_as_float(0x7fc00000) : __double2float_rn(total);
    return D::bits(D::from_f32(f));
}

// Addresses of up to 8 parts' frames (`count`), from the launch's arguments into `table` (a
// Dims is eight u64 passed by value): the sum's kernels read the frames through the table.
extern "C" __global__ void cfc_codec_sum_table(u64* table, Dims batch, u32 count) {
    if (threadIdx.x < count) table[threadIdx.x] = batch.d[threadIdx.x];
}

// Each frame's length in the table (after the addresses) lowered to the u64 `back` bytes before
// the frame, where that is smaller (a row's head, as cfc's exchanges lay frames out): for work
// recorded once as a CUDA graph and replayed with each step's lengths. The table's own value is
// the room the frame lies in, so a head that says more is never read past.
extern "C" __global__ void cfc_codec_sum_lens(u64* table, u32 parts, u64 back) {
    for (u32 j = threadIdx.x; j < parts; j += blockDim.x) {
        const u64 head = *(const u64*)(table[j] - back);
        if (head < table[parts + j]) table[parts + j] = head;
    }
}

// Every part's chunk offsets: part blockIdx.y's frame, in its region of `stride` bytes at `parts`.
extern "C" __global__ void cfc_codec_sum_offsets(const u64* frames, u64 header_len, u64 n, u8* parts, u64 stride,
                                                  u32 block_log2) {
    decode_offsets((const u8*)frames[blockIdx.y], header_len, n, parts + blockIdx.y * stride, block_log2);
}

// ---- checks of frames from elsewhere ------------------------------------------------------
// The kernels that add frames (sum_chunks, sum_values, decode_sum) read what a frame's header,
// widths and exception list say, trusting them: frames that another rank sent are checked
// here first, on the device (the host sees only their sizes), and nothing is added if one
// fails. A frame whose bytes were corrupted on the way, or written by something other than
// cfc's codec, then ends in a reported error, never in a read past its end.
#define HDR_N 16
#define HDR_BODY_LEN 48
#define HDR_RAW_BODY_LEN 56

__device__ __forceinline__ void report_bad_frame(u32* status, u32 bit, u32 part) {
    atomicOr(&status[0], bit);
    atomicCAS(&status[1], 0u, part + 1);  // the first bad frame found, counted from 1
}

// Whether the header fields that the CPU's read_header checks and the length checks below do
// not cover are as it requires: a known bound mode that fits the codec, bits only in bits mode
// (2 to 32), reserved bytes zero, dimensions below 2^63 that multiply to n without overflow, a finite
// positive step and a finite eps >= 0 (step 1 and eps 0 in lossless mode), no exceptions in a
// raw frame. A step of NaN or infinity would otherwise reach the output as values. With
// `match_dims`, each dimension must also be the caller's (a sum writes its frame with the
// caller's shape, and the CPU refuses frames of another shape); without, any that multiply to n.
__device__ __forceinline__ bool header_fields_ok(const u8* f, u64 n, u32 ndim, const Dims& dims, bool match_dims,
                                                 bool raw, u32 block_log2) {
    const u8 mode = f[8], bits = f[11];
    // Block scales: a quantized frame has them exactly when the caller expects them (modes abs,
    // rel, sum and rms), a raw frame never; mode rms only with them (or raw).
    const bool scaled = !raw && block_log2 != 0;
    bool ok = mode <= 5 && !(mode == 4 && !raw) && !(mode == 5 && !scaled && !raw) &&
              !(scaled && (mode == 2 || mode == 4)) && (mode == 2 ? bits >= 2 && bits <= 32 : bits == 0) &&
              f[7] == (scaled ? 2 : 0) && f[12] == (scaled ? block_log2 : 0) && (f[13] | f[14] | f[15]) == 0;
    u64 prod = 1;
    for (u32 i = 0; i < ndim; i++) {
        const u64 d = cfc_load_le(f + 64 + 8 * i, 8);
        ok &= (d == 0 || __umul64hi(prod, d) == 0) && (d >> 63) == 0 && (!match_dims || d == dims.d[i]);
        prod *= d;
    }
    const double step = __longlong_as_double((long long)cfc_load_le(f + HDR_STEP, 8));
    const double eps = __longlong_as_double((long long)cfc_load_le(f + HDR_EPS, 8));
    ok &= prod == n && isfinite(step) && step > 0.0 && isfinite(eps) && eps >= 0.0;
    if (mode == 4) ok &= step == 1.0 && eps == 0.0;
    if (raw) ok &= cfc_load_le(f + HDR_NEXC, 8) == 0;
    return ok;
}

// Whether frame p = blockIdx.y (at table[p], with table[parts + p] bytes readable there, its
// chunk offsets in its region after sum_offsets) is a quantized or raw frame without a zstd
// stage of n elements of `dtype` (`size` bytes each) in `ndim` dimensions, with a header the
// CPU would read (header_fields_ok; dimensions `dims` if `match_dims`), whose widths are at most MAX_DECODE_WIDTH and whose
// widths, planes and exceptions fill its body exactly, within its bytes, with exception
// indices increasing and below n. One that is not sets `bit` in status[0] and its index + 1 in
// status[1] (if none is there yet). Every block of row p checks the header; the blocks share
// out the exception list.
// With block scales expected (block_log2 nonzero), a quantized frame must have them, and each
// shift must leave its block a normal step.
extern "C" __global__ void cfc_codec_check_frames(const u64* table, u32 parts, u64 header_len, u64 n, u32 dtype,
                                                  u32 size, u32 ndim, Dims dims, u32 match_dims, u8* regions,
                                                  u64 stride, u32* status, u32 bit, u32 block_log2) {
    const u32 p = blockIdx.y;
    const u8* f = (const u8*)table[p];
    const u64 len = table[parts + p];
    const u64 groups = (n + CFC_GROUP - 1) / CFC_GROUP, idx_size = n <= (1ull << 32) ? 4 : 8;
    bool ok = len >= header_len && f[0] == 'C' && f[1] == 'F' && f[2] == 'C' && f[3] == 'F' && f[4] == 1 &&
              f[5] <= 1 && f[6] == dtype && f[9] == ndim && f[10] == 5;
    u64 blen = 0, n_exc = 0, nwords = 0;
    if (ok) {
        blen = cfc_load_le(f + HDR_BODY_LEN, 8);
        ok = cfc_load_le(f + HDR_N, 8) == n && cfc_load_le(f + HDR_RAW_BODY_LEN, 8) == blen && blen <= len - header_len;
    }
    const bool raw = f[5] == 1;
    ok = ok && header_fields_ok(f, n, ndim, dims, match_dims != 0, raw, block_log2);
    const u64 scales_len = raw ? 0 : cfc_scales_len(n, block_log2);
    if (ok && raw) {
        ok = blen == n * size;
    } else if (ok) {
        const Tiles ts = tiles_at(regions + p * stride, n, TILE_CHUNKS);
        n_exc = cfc_load_le(f + HDR_NEXC, 8);
        nwords = ts.totals[0];
        ok = ts.totals[1] == 0 && n_exc <= n &&
             blen == scales_len + groups + 4 * nwords + n_exc * (idx_size + size);
    }
    if (!ok) {
        if (threadIdx.x == 0) report_bad_frame(status, bit, p);
        return;
    }
    if (scales_len) {  // every block's step a normal number
        const double step = __longlong_as_double((long long)cfc_load_le(f + HDR_STEP, 8));
        if (!cfc_shifts_normal(f + header_len, scales_len, step, (u64)blockIdx.x * blockDim.x + threadIdx.x,
                               (u64)gridDim.x * blockDim.x))
            report_bad_frame(status, bit, p);
    }
    if (raw || n_exc == 0) return;
    const u8* idx = f + header_len + scales_len + groups + 4 * nwords;
    bool in_order = true;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n_exc; k += (u64)gridDim.x * blockDim.x) {
        const u64 i = cfc_load_le(idx + k * idx_size, (int)idx_size);
        in_order &= i < n && (k + 1 == n_exc || cfc_load_le(idx + (k + 1) * idx_size, (int)idx_size) > i);
    }
    if (!in_order) report_bad_frame(status, bit, p);
}

// First k in [0, count) whose exception index is >= i (count if none): exception indices are
// strictly increasing (checked on the host, or written so by the encoder).
__device__ __forceinline__ u64 exception_at_or_after(const u8* idx, u64 idx_size, u64 count, u64 i) {
    u64 lo = 0, hi = count;
    while (lo < hi) {
        u64 mid = (lo + hi) / 2;
        if (cfc_load_le(idx + mid * idx_size, (int)idx_size) < i) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// One part's view of chunk `ch` for this warp: the codes of the lanes' elements (group u in
// q[u]), and in *exc bit u whether the part stores that element as an exception (raw parts:
// all), with the stored bits in exc_bits[u]. Stages the planes in `st` (the warp's shared memory)
// and uses `s_mask` (8 words of the warp's shared memory).
template <class D>
__device__ __forceinline__ void part_chunk(const u8* frame, u64 header_len, u64 n, u8* ws, u64 ch, u32 have,
                                           u32* st, u32* s_mask, i64* q, u32* exc, u32* exc_bits,
                                           bool want_bits, u32 block_log2) {
    const u32 lane = threadIdx.x & 31;
    const u8* body = frame + header_len;  // a raw part's bytes
    const u64 e0 = ch * CHUNK_VALUES;
    *exc = 0;
    if (frame[HDR_CODEC] != 0) {  // raw: every element stored as it is
#pragma unroll
        for (int u = 0; u < CHUNK_GROUPS; ++u) {
            u32 j = u * CFC_GROUP + lane;
            q[u] = 0;
            if (j < have) {
                *exc |= 1u << u;
                if (want_bits) exc_bits[u] = (u32)cfc_load_le(body + (e0 + j) * D::SIZE, D::SIZE);
            }
        }
        return;
    }
    body += cfc_scales_len(n, block_log2);  // a quantized part's width table, after its scales
    const Tiles ts = tiles_at(ws, n, TILE_CHUNKS);
    u32 wl, inc;
    stage_chunk_planes(body, ts, ch, st, &wl, &inc);
#pragma unroll
    for (int u = 0; u < CHUNK_GROUPS; ++u) {
        q[u] = lane_code(st + __shfl_sync(CFC_FULL_MASK, inc - wl, u), __shfl_sync(CFC_FULL_MASK, wl, u));
        // Past the last element, a group's codes are padding, which the format leaves free and
        // the CPU's sum never reads: 0 here, so that they neither overflow nor reach the sum.
        if (u * CFC_GROUP + lane >= have) q[u] = 0;
    }
    const u64 n_exc = cfc_load_le(frame + HDR_NEXC, 8);
    if (n_exc == 0) return;
    // The part's exceptions in this chunk: a run of its sorted list, marked in s_mask.
    const u64 idx_size = n <= (1ull << 32) ? 4 : 8;
    const u64 groups = ts.groups;
    u64 nwords = 0;  // the part's plane words: the last chunk's offset and size
    {
        const uint4 last = ts.chunk_info[ts.chunks - 1];
        nwords = words_before(ts, (ts.chunks - 1) / TILE_CHUNKS) + last.x + last.z;
    }
    const u8* idx = body + groups + 4 * nwords;
    const u8* val = idx + n_exc * idx_size;
    if (lane < CHUNK_GROUPS) s_mask[lane] = 0;
    __syncwarp();
    const u64 k0 = exception_at_or_after(idx, idx_size, n_exc, e0);
    for (u64 k = k0 + lane; k < n_exc; k += 32) {
        u64 i = cfc_load_le(idx + k * idx_size, (int)idx_size);
        if (i >= e0 + have) break;
        atomicOr(&s_mask[(i - e0) / CFC_GROUP], 1u << ((i - e0) % CFC_GROUP));
    }
    __syncwarp();
#pragma unroll
    for (int u = 0; u < CHUNK_GROUPS; ++u) {
        if (!((s_mask[u] >> lane) & 1u)) continue;
        *exc |= 1u << u;
        q[u] = 0;
        if (want_bits) {
            u64 k = exception_at_or_after(idx, idx_size, n_exc, e0 + u * CFC_GROUP + lane);
            exc_bits[u] = (u32)cfc_load_le(val + k * D::SIZE, D::SIZE);
        }
    }
    __syncwarp();  // s_mask is reused by the next part
}

// One part's decoded values of this lane's elements of chunk `ch` (group u in v[u]), what
// decompress gives: the stored bits where the part holds an exception, else its code times its
// step (part_chunk's staging and s_mask use).
template <class D>
__device__ __forceinline__ void part_values(const u8* frame, u64 header_len, u64 n, u8* ws, u64 ch, u32 have,
                                            u32* st, u32* s_mask, typename D::T* v, u32 block_log2) {
    const double step = __longlong_as_double((i64)cfc_load_le(frame + HDR_STEP, 8));
    // (a raw part's values are all stored: no step is used)
    const u8* shifts = block_log2 && frame[HDR_CODEC] == 0 ? frame + header_len : nullptr;
    i64 q[CHUNK_GROUPS];
    u32 exc, exc_bits[CHUNK_GROUPS];
    part_chunk<D>(frame, header_len, n, ws, ch, have, st, s_mask, q, &exc, exc_bits, true, block_log2);
#pragma unroll
    for (int u = 0; u < CHUNK_GROUPS; ++u) {
        const double sg = cfc_group_step(step, shifts, block_log2, ch * CHUNK_GROUPS + u);
        v[u] = (exc >> u) & 1u ? D::from_bits(exc_bits[u]) : cfc_dequantize<D>(q[u], sg);
    }
}

// The sum, a chunk per warp in tiles of 8 chunks (pass 1 of packing it; see above).
template <class D>
// With block scales, every quantized part must have the first quantized part's (raw parts,
// whose values are all stored, fit any); `body` is the sum's width table, after its scales.
__device__ void sum_chunks(const u64* frames, u32 parts, u64 header_len, u64 n, u8* part_ws, u64 stride,
                           i64* acc, u32* union_mask, u8* body, u8* ws, u32 block_log2) {
    __shared__ u32 stage[TILE_THREADS / 32][CHUNK_GROUPS * 64];  // a part per warp
    __shared__ u32 s_masks[TILE_THREADS / 32][CHUNK_GROUPS];
    __shared__ u32 s_cw[TILE_THREADS / 32], s_ce[TILE_THREADS / 32];
    CfcParams* pp = (CfcParams*)ws;
    if (pp->error & SUM_BAD_FRAME) return;  // the whole block
    const Tiles ts = tiles_at(ws, n, TILE_THREADS / 32);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (blockIdx.x == 0 && threadIdx.x == 0) {  // the header fields every part must agree on
        const u64 step = cfc_load_le((const u8*)frames[0] + HDR_STEP, 8);
        double eps = 0.0;
        u32 err = 0;
        for (u32 p = 0; p < parts; ++p) {
            const u8* f = (const u8*)frames[p];
            if (cfc_load_le(f + HDR_STEP, 8) != step) err |= SUM_STEPS_DIFFER;
            eps += __longlong_as_double((i64)cfc_load_le(f + HDR_EPS, 8));
        }
        if (block_log2) {  // one thread: the scales are a byte per block
            const u64 sl = cfc_scales_len(n, block_log2);
            const u8* first = nullptr;
            for (u32 p = 0; p < parts && !(err & SUM_STEPS_DIFFER); ++p) {
                const u8* f = (const u8*)frames[p];
                if (f[HDR_CODEC] != 0) continue;
                if (!first) {
                    first = f;
                    continue;
                }
                for (u64 k = 0; k < sl; ++k)
                    if (f[header_len + k] != first[header_len + k]) {
                        err |= SUM_STEPS_DIFFER;
                        break;
                    }
            }
        }
        if (!isfinite(eps)) err |= SUM_EPS_OVERFLOW;
        pp->step = __longlong_as_double((i64)step);
        pp->eps = eps;
        atomicOr(&pp->error, err);
    }
    const u64 ch = (u64)blockIdx.x * ts.tile_chunks + warp;
    const u32 have = chunk_values(n, ch);  // 0 for the warps past the end
    const u32 have_groups = (have + CFC_GROUP - 1) / CFC_GROUP;
    u32 cw = 0, ce = 0;
    if (have) {
        const u64 e0 = ch * CHUNK_VALUES;
        i64 sum[CHUNK_GROUPS], q[CHUNK_GROUPS];
        u32 exc_bits[CHUNK_GROUPS];  // unused: no bits asked for
        u32 any_exc = 0;  // bit u: some part stores this lane's element of group u as an exception
        bool overflow = false;
#pragma unroll
        for (int u = 0; u < CHUNK_GROUPS; ++u) sum[u] = 0;
        for (u32 p = 0; p < parts; ++p) {
            u32 exc;
            part_chunk<D>((const u8*)frames[p], header_len, n, part_ws + p * stride, ch, have, stage[warp],
                          s_masks[warp], q, &exc, exc_bits, false, block_log2);
            any_exc |= exc;
#pragma unroll
            for (int u = 0; u < CHUNK_GROUPS; ++u) {
                i64 s = (i64)((u64)sum[u] + (u64)q[u]);
                overflow |= ((sum[u] ^ s) & (q[u] ^ s)) < 0;  // both operands' sign differs from the sum's
                sum[u] = s;
            }
        }
        if (__any_sync(CFC_FULL_MASK, overflow) && lane == 0) atomicOr(&pp->error, SUM_OVERFLOW);
        u32 mine = 0, my_mask = 0;
#pragma unroll
        for (int u = 0; u < CHUNK_GROUPS; ++u) {
            const u32 j = u * CFC_GROUP + lane;
            const bool is_exc = (any_exc >> u) & 1u;
            const u32 mask = __ballot_sync(CFC_FULL_MASK, is_exc);
            const u64 z = j < have && !is_exc ? ((u64)sum[u] << 1) ^ (u64)(sum[u] >> 63) : 0;
            const u32 hi = __reduce_or_sync(CFC_FULL_MASK, (u32)(z >> 32));
            const u32 lo = __reduce_or_sync(CFC_FULL_MASK, (u32)z);
            const u32 w = hi ? 64 - __clz(hi) : 32 - __clz(lo);
            if (lane == u) {
                mine = w;
                my_mask = mask;
            }
            if (u < have_groups) {
                cw += w;
                ce += __popc(mask);
            }
            if (j < have) acc[e0 + j] = is_exc ? 0 : sum[u];
        }
        if (lane < have_groups) {
            body[ch * CHUNK_GROUPS + lane] = (u8)mine;
            union_mask[ch * CHUNK_GROUPS + lane] = my_mask;
        }
    }
    if (lane == 0) {
        s_cw[warp] = cw;
        s_ce[warp] = ce;
    }
    __syncthreads();
    if (warp == 0) {
        bool in = lane < ts.tile_chunks;
        tile_totals(ts, blockIdx.x, in ? s_cw[lane] : 0, in ? s_ce[lane] : 0);
    }
}

// Where the sum holds an exception (after sum_chunks): every part's decoded value there, added
// in f64 in part order, and the bits the sum stores, a chunk per warp (chunks without any
// exception return at once).
template <class D>
__device__ void sum_values(const u64* frames, u32 parts, u64 header_len, u64 n, u8* part_ws, u64 stride,
                           const u32* union_mask, u32* value_bits, const u32* error, u32 block_log2) {
    __shared__ u32 stage[TILE_THREADS / 32][CHUNK_GROUPS * 64];  // a part per warp
    __shared__ u32 s_masks[TILE_THREADS / 32][CHUNK_GROUPS];
    if (*error & SUM_BAD_FRAME) return;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 ch = (u64)blockIdx.x * (TILE_THREADS / 32) + warp;
    const u32 have = chunk_values(n, ch);
    const u32 have_groups = (have + CFC_GROUP - 1) / CFC_GROUP;
    const u32 mask_l = lane < have_groups ? union_mask[ch * CHUNK_GROUPS + lane] : 0;
    if (!__any_sync(CFC_FULL_MASK, mask_l)) return;
    u32 mine = 0;  // bit u: the sum stores this lane's element of group u as an exception
#pragma unroll
    for (int u = 0; u < CHUNK_GROUPS; ++u) mine |= ((__shfl_sync(CFC_FULL_MASK, mask_l, u) >> lane) & 1u) << u;
    double total[CHUNK_GROUPS];
    typename D::T v[CHUNK_GROUPS];
#pragma unroll
    for (int u = 0; u < CHUNK_GROUPS; ++u) total[u] = 0.0;
    for (u32 p = 0; p < parts; ++p) {
        part_values<D>((const u8*)frames[p], header_len, n, part_ws + p * stride, ch, have, stage[warp],
                       s_masks[warp], v, block_log2);
#pragma unroll
        for (int u = 0; u < CHUNK_GROUPS; ++u)
            if ((mine >> u) & 1u) total[u] += D::to_f64(v[u]);
    }
    const u64 e0 = ch * CHUNK_VALUES;
#pragma unroll
    for (int u = 0; u < CHUNK_GROUPS; ++u)
        if ((mine >> u) & 1u) value_bits[e0 + u * CFC_GROUP + lane] = sum_value_bits<D>(total[u]);
}

#define SUM_VALUES(name, D)                                                                        \
    extern "C" __global__ void cfc_codec_sum_values_##name(const u64* frames, u32 parts,           \
            u64 header_len, u64 n, u8* part_ws, u64 stride, const u32* union_mask,                 \
            u32* value_bits, const u32* error, u32 block_log2) {                                   \
        sum_values<D>(frames, parts, header_len, n, part_ws, stride, union_mask, value_bits, error, \
                      block_log2);                                                                 \
    }
DEFINE_FOR_DTYPES(SUM_VALUES)

#define SUM_CHUNKS(name, D)                                                                        \
    /* at most 80 registers: 3 blocks per SM */                                                 \
    extern "C" __global__ __launch_bounds__(TILE_THREADS, 3) void cfc_codec_sum_chunks_##name(const u64* frames, u32 parts,           \
            u64 header_len, u64 n, u8* part_ws, u64 stride, i64* acc, u32* union_mask, u8* body,   \
            u8* ws, u32 block_log2) {                                                              \
        sum_chunks<D>(frames, parts, header_len, n, part_ws, stride, acc, union_mask, body, ws,    \
                      block_log2);                                                                 \
    }
DEFINE_FOR_DTYPES(SUM_CHUNKS)
