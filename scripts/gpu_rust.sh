#!/usr/bin/env bash
# On a GPU machine (no Rust there): the Rust side's NCCL tests (tests/nccl.rs, two GPUs; the
# unit tests of src/gpu_allreduce.rs, one) and
# `cfc-bench --gpu`, built here beforehand and carried in .carry/ (scripts/build_gpu_carry.sh).
# PARTS picks what runs (default: "tests nvlink socket"; "chunks" reruns NVLink with 16 and
# 256 MB chunks; "py" runs `python -m cfc.bench` over NVLink, the same all-reduce through PyTorch;
# "blocking" reruns NVLink with blocking NCCL communicators, CFC_NCCL_BLOCKING=1); SIZES, ITERS, BOUNDS, CHUNK_MB and
# GPUS pass on. Output under $OUT (tables, JSON, PNG: the PNG is drawn by the carried wheel).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_setup.sh
# The standalone binaries find NCCL and NVRTC themselves: pip's NCCL (the one PyTorch uses)
# by path, NVRTC from the CUDA toolkit.
CFC_NCCL_LIBRARY=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib', 'libnccl.so.2'))")
export CFC_NCCL_LIBRARY CFC_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
PARTS=${PARTS:-tests nvlink socket}
ARGS="--gpu ${GPUS:-2} --grads .carry/grads --sizes ${SIZES:-16M,64M,256M} --bounds ${BOUNDS:-0.3} --iters ${ITERS:-20} --chunk-mb ${CHUNK_MB:-256}"
for part in $PARTS; do case $part in
  tests) timeout 200 .carry/nccl-tests --test-threads=1 --skip a_peer_that_never_comes 2>&1 | tail -20 | tee "$OUT/rust_nccl_tests.log"
         timeout 120 .carry/lib-tests --test-threads=1 gpu_allreduce 2>&1 | tail -8 | tee -a "$OUT/rust_nccl_tests.log"
         # the one that waits for a timeout on purpose, on its own (bounded if it hangs)
         timeout 60 .carry/nccl-tests --exact a_peer_that_never_comes_is_an_error_after_the_timeout 2>&1 | tail -6 | tee -a "$OUT/rust_nccl_tests.log" ;;
  nvlink) timeout 300 .carry/cfc-bench $ARGS --json "$OUT/cfc_bench_nvlink.json" --png "$OUT/cfc_bench_nvlink.png" | tee "$OUT/cfc_bench_nvlink.md" ;;
  # (the same ranks, sizes, bound and chunks as the nvlink part, for a like-for-like table)
  py) SIZES=${SIZES:-16M,64M,256M} BOUNDS=${BOUNDS:-0.3} NPROC=${GPUS:-2} CHUNK_MB=${CHUNK_MB:-256} PARTS=nvlink \
        ITERS=${ITERS:-20} bash scripts/gpu_allreduce.sh 2>&1 | tail -12 ;;
  blocking) CFC_NCCL_BLOCKING=1 timeout 300 .carry/cfc-bench $ARGS | tee "$OUT/cfc_bench_nvlink_blocking.md" ;;
  chunks) for mb in 16 256; do timeout 300 .carry/cfc-bench ${ARGS/--chunk-mb ${CHUNK_MB:-256}/--chunk-mb $mb} \
            | tee "$OUT/cfc_bench_nvlink_chunk${mb}.md"; done ;;
  socket) env $SOCK timeout 400 .carry/cfc-bench $ARGS --json "$OUT/cfc_bench_socket.json" --png "$OUT/cfc_bench_socket.png" | tee "$OUT/cfc_bench_socket.md" ;;
esac; done
