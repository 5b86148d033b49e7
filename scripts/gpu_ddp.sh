#!/usr/bin/env bash
# On a GPU machine with 2 GPUs or more (no Rust there): install the wheel carried in .carry/, run the
# DDP hook's tests over NCCL, train the byte-level LM with plain all-reduce and cfc_hook, then
# time DDP steps of the 217M LM with every hook, over NVLink and over the socket transport.
# PARTS picks what runs (default: "tests train spread nvlink socket"; spread trains again with
# another seed, to show how far two plain runs differ; parity trains deterministically, once per
# seed of SEEDS (default "0 1 2"), plain all-reduce, cfc at 0.3 and 0.1 x RMS and PyTorch's bf16
# hook (TRAIN_HOOKS), plus plain again on the first seed, and prints benches/parity_table.py's
# table; RMS passes on; anatomy profiles a few steps per hook over both transports and prints where
# the NCCL kernels sit against the computation, benches/ddp_overlap.py); host times the comm
# thread's stages per bucket over both transports, at CAPS MB buckets (benches/ddp_host_profile.py); ab
# times the socket step (HOOKS, default "--base noop noop cfc") with an earlier wheel (.carry/old/*.whl)
# and this one, one run after the other, AB_ROUNDS times (default 2). NPROC (default 2) sets the
# processes of the step-time runs, STEPS their timed steps per hook (interleaved rounds of 5).
# shared runs two jobs of 300 steps at once on the same GPUs over the socket transport
# (SHARED_HOOK, default cfc; SHARED_ROUNDS times, default 3; with the wheels of SHARED_WHEELS,
# "new" by default, "old" for .carry/old/*.whl): each GPU then runs far behind its host, which
# shows a missing wait between streams; it prints each job's exit status and first CUDA error.
# sanitize runs the GPU tests of hostile frames under compute-sanitizer's memcheck (one GPU is
# enough): a bad frame must be reported without any read or write out of bounds. tests runs the
# hook's tests of one GPU per rank over NCCL; onegpu runs the hook's and AllReducer's tests of
# 3 ranks sharing GPU 0 over gloo, then of 2 (one GPU is enough; tests/python/conftest.py).
# Logs go under $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_setup.sh
PARTS=${PARTS:-tests train spread nvlink socket}
STEPS=${STEPS:-50}
NPROC=${NPROC:-2}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for part in $PARTS; do case $part in
  sanitize) timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu \
           -p no:cacheprovider tests/python/test_hostile.py 2>&1 | tail -25 | tee "$OUT/sanitize.log" ;;
  tests) timeout 300 python3 -m pytest -q -m gpu tests/python/test_ddp.py -k "not shared" -x 2>&1 | tail -25 \
           | tee "$OUT/ddp_tests.log" ;;
  onegpu) for ranks in 3 2; do CFC_TEST_SHARED_RANKS=$ranks timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider \
           tests/python/test_ddp.py tests/python/test_allreducer.py -k shared 2>&1 | tail -15 | tee "$OUT/onegpu_$ranks.log"; done ;;
  train) timeout 400 torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --hook allreduce,cfc \
           --steps ${TRAIN_STEPS:-1000} --d-model 256 --layers 4 --heads 8 --batch 32 --seq 256 --out "$OUT/ddp_train" \
           2>&1 | grep -v "^\s*\[" | tail -8 | tee "$OUT/ddp_train.log" ;;
  parity) first=1; for seed in ${SEEDS:-0 1 2}; do
           hooks=${TRAIN_HOOKS:-allreduce,cfc,cfc@0.1,bf16}; [ $first = 1 ] && hooks+=",allreduce"; first=0
           timeout 400 torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --deterministic \
           --hook $hooks --rms ${RMS:-0.3} --seed $seed --steps ${TRAIN_STEPS:-1000} --d-model 256 --layers 4 --heads 8 --batch 32 \
           --seq 256 --out "$OUT/ddp_parity_seed$seed" 2>&1 | grep -v "^\s*\[" | tail -8 | tee "$OUT/ddp_parity_seed$seed.log"; done
         python3 benches/parity_table.py --curve "$OUT"/ddp_parity_seed*/losses.json | tee "$OUT/ddp_parity.md" ;;
  spread) timeout 300 torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --hook allreduce,cfc --seed 1 \
           --steps ${TRAIN_STEPS:-1000} --d-model 256 --layers 4 --heads 8 --batch 32 --seq 256 --out "$OUT/ddp_train_seed1" \
           2>&1 | grep -v "^\s*\[" | tail -5 | tee "$OUT/ddp_train_seed1.log" ;;
  anatomy) for t in socket nvlink; do env $([ $t = socket ] && echo $SOCK) LABEL=$t timeout 300 torchrun --standalone \
           --nproc_per_node=$NPROC benches/ddp_overlap.py ${HOOKS:-noop allreduce cfc} 2>&1 | grep -E "^\||anatomy|Error|error" \
           | tee "$OUT/ddp_anatomy_$t.log"; done ;;
  host) for t in socket nvlink; do env $([ $t = socket ] && echo $SOCK) LABEL=$t timeout 300 torchrun --standalone \
           --nproc_per_node=$NPROC benches/ddp_host_profile.py --caps ${CAPS:-25} 2>&1 | grep -E "^\||^cfc|Error|error" \
           | tee "$OUT/ddp_host_$t.log"; done ;;
  ab) python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site_old .carry/old/*.whl
      for round in $(seq ${AB_ROUNDS:-2}); do for which in old new; do
        site=/tmp/site; [ $which = old ] && site=/tmp/site_old
        env $SOCK PYTHONPATH=$site LABEL="socket, $which wheel, round $round" timeout 300 torchrun --standalone \
          --nproc_per_node=$NPROC benches/ddp_step_time.py --steps $STEPS ${HOOKS:---base noop noop cfc} 2>&1 \
          | grep -E "^\||DDP step|Error|error" | tee -a "$OUT/ddp_ab.log"; done; done ;;
  shared) [ "${SHARED_WHEELS:-new}" = new ] \
           || python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site_old .carry/old/*.whl
      for which in ${SHARED_WHEELS:-new}; do site=/tmp/site; [ $which = old ] && site=/tmp/site_old
        for round in $(seq ${SHARED_ROUNDS:-3}); do for job in 1 2; do
          (log="$OUT/ddp_shared_${which}_${round}_$job.log"
           env $SOCK PYTHONPATH=$site timeout 300 torchrun --standalone --nproc_per_node=$NPROC benches/ddp_step_time.py \
             --sequential --steps 300 ${SHARED_HOOK:-cfc} > "$log" 2>&1; rc=$?
           echo "two jobs at once, $which wheel, round $round, job $job: exit $rc $(grep -m1 -o 'CUDA error.*' "$log" | cut -c1-120)") &
        done; wait; done; done 2>&1 | tee "$OUT/ddp_shared.log" ;;
  nvlink) LABEL=nvlink timeout 300 torchrun --standalone --nproc_per_node=$NPROC benches/ddp_step_time.py --steps $STEPS \
           --json "$OUT/ddp_nvlink_${NPROC}gpu.json" ${HOOKS:-} 2>&1 | grep -E "^\||DDP step|median|Error|error" | tee "$OUT/ddp_nvlink_${NPROC}gpu.log" ;;
  socket) env $SOCK LABEL=socket timeout 400 torchrun --standalone --nproc_per_node=$NPROC benches/ddp_step_time.py --steps $STEPS \
           --json "$OUT/ddp_socket_${NPROC}gpu.json" ${HOOKS:-} 2>&1 | grep -E "^\||DDP step|median|Error|error" | tee "$OUT/ddp_socket_${NPROC}gpu.log" ;;
esac; done
