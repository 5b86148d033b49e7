#!/usr/bin/env bash
# On a GPU machine (no Rust there): install the wheel carried in .carry/, run the all-reduce
# tests over NCCL, then `python -m cfc.bench` with NPROC GPUs (default: all of them) over NCCL's
# own choice of transport (NVLink) and over the socket transport (TCP on loopback), with
# cfc.distributed.NcclAllReducer (--native) beside the Python engine.
# PARTS picks what runs (default: "tests nvlink socket"); SIZES, BOUNDS, ITERS, CHUNK_MB pass on; CFC_TEST_GPUS=4
# runs the tests with 4 ranks instead of 2 (the tests of ranks sharing one GPU over gloo are
# scripts/gpu_ddp.sh's part onegpu). Output under $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_setup.sh
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
PARTS=${PARTS:-tests nvlink socket}
ARGS="--grads .carry/grads --sizes ${SIZES:-1M,4M,16M,64M,256M,1G} --bounds ${BOUNDS:-0.3,0.1} --iters ${ITERS:-20} --chunk-mb ${CHUNK_MB:-64} --auto --native"
for part in $PARTS; do case $part in
  tests) timeout 300 python3 -m pytest -q -m gpu tests/python/test_allreducer.py -k "not shared" 2>&1 | tail -15 \
           | tee "$OUT/allreducer_tests.log" ;;
  nvlink) timeout 300 torchrun --standalone --nproc_per_node=$NPROC -m cfc.bench $ARGS --label "NCCL NVLink" \
           --json "$OUT/allreduce_nvlink_${NPROC}gpu.json" --png "$OUT/allreduce_nvlink_${NPROC}gpu.png" 2>/dev/null \
           | tee "$OUT/allreduce_nvlink_${NPROC}gpu.log" ;;
  socket) env $SOCK timeout 400 torchrun --standalone --nproc_per_node=$NPROC -m cfc.bench $ARGS --label "NCCL socket" \
           --json "$OUT/allreduce_socket_${NPROC}gpu.json" --png "$OUT/allreduce_socket_${NPROC}gpu.png" 2>/dev/null \
           | tee "$OUT/allreduce_socket_${NPROC}gpu.log" ;;
esac; done
