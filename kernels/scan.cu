// Exclusive prefix sums of u64 arrays, in place, without leaving the device: a block scans
// 1024 values and writes its total; the totals are scanned the same way (the host launches
// one level per 1024x, sizes known in advance); then each block adds its scanned total.
#include "common.cuh"

#define SCAN_BLOCK 1024

extern "C" __global__ void cfc_scan_block(u64* data, u64 len, u64* block_sums) {
    __shared__ u64 warp_sums[32];
    u64 i = (u64)blockIdx.x * SCAN_BLOCK + threadIdx.x;
    u64 v = i < len ? data[i] : 0;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 inc = cfc_lane_prefix_sum(v);
    if (lane == 31) warp_sums[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        warp_sums[lane] = cfc_lane_prefix_sum(warp_sums[lane]);  // inclusive scan of warp totals
    }
    __syncthreads();
    u64 before = warp == 0 ? 0 : warp_sums[warp - 1];
    if (i < len) data[i] = before + inc - v;
    if (threadIdx.x == SCAN_BLOCK - 1) block_sums[blockIdx.x] = before + inc;
}

extern "C" __global__ void cfc_scan_add(u64* data, u64 len, const u64* block_offsets) {
    u64 i = (u64)blockIdx.x * SCAN_BLOCK + threadIdx.x;
    if (i < len) data[i] += block_offsets[blockIdx.x];
}
