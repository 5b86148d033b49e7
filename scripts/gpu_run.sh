#!/usr/bin/env bash
# On the GPU machine (no Rust there): what scripts/build_gpu_carry.sh carried in .carry/. PARTS
# picks what runs, in order:
#   rust     the engine's GPU tests (the CUDA backend writes the CPU backend's bits; failures on
#            one GPU rank reach every rank) and the crate's unit tests;
#   pytest   `pytest -m gpu` of the codec, the hook, AllReducer and cfc.fsdp (PYTEST_K filters);
#   bench    cfc-bench --gpu over NVLink and over sockets (SIZES, BOUNDS, ITERS);
#   pybench  python -m cfc.bench under torchrun over NVLink and over sockets, both algorithms
#            (PYSIZES, BOUNDS, ALGORITHMS), the wheels of WHICH (default new; "old new" for the
#            A/B), AB_ROUNDS times (default 1);
#   step     the 217M LM's DDP step time (benches/ddp_step_time.py) over sockets and NVLink,
#            this wheel against the one in .carry/old/ (when there; with the benchmark script of
#            its own, .carry/old/ddp_step_time.py), one run after the other, AB_ROUNDS times
#            (default 2); WHICH="new" skips the old wheel, NVLINK_WHICH=new runs only the new
#            one over NVLink; SOCKET_HOOKS and NVLINK_HOOKS are the benchmark's arguments;
#   parity   examples/ddp_train.py deterministically, plain all-reduce and cfc, over SEEDS
#            (default "0 1 2"), then benches/parity_table.py;
#   fsdp     examples/fsdp_train.py over sockets and NVLink: noop (no gradient traffic), plain
#            float32, bfloat16 reduce_dtype, cfc and cfc with fallback="auto" (FSDP_WAYS picks;
#            FSDP_ARGS: model size, steps, --rounds; FSDP_TIMEOUT per link, default 400 s);
#   fsdphost benches/fsdp_host_time.py over NVLink: where cfc.fsdp's calls hold the host
#            (FSDP_HOST_WAYS, default those of the script; FSDP_HOST_ARGS: model size, steps);
#   levels   emulated nodes (scripts/emulate_nodes.sh): python -m cfc.bench at LEVEL_SIZES (default
#            64M,256M) with cfc flat and two-level, an A/A copy of fp32 and LEVEL_ROUNDS rounds
#            (default 3), NODES x PER_NODE ranks (default 2 x 2); then 2 nodes of 1 (two-level falls
#            back to flat); then (LEVEL_STEP=0 skips it) the 217M LM's DDP step (STEP_HOOKS) on the
#            same emulated nodes;
#            and whether this machine lets a user limit loopback's rate (tc);
#   quality  benches/quality.py over sockets (QUALITY_ARGS: families, hooks, seeds, sizes; --fsdp
#            for FSDP2), its table and JSON under $OUT (QUALITY_NAME names them, default quality);
# NPROC: ranks of the torchrun and cfc-bench parts (default: every GPU, one rank each); the
# tests take CFC_TEST_GPUS (default: every GPU).
# Logs and tables go under $OUT; the last lines printed are a short summary.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_setup.sh
CFC_NCCL_LIBRARY=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib', 'libnccl.so.2'))")
export CFC_NCCL_LIBRARY LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
GPUS=$(nvidia-smi -L | wc -l)
NPROC=${NPROC:-$GPUS}
export CFC_TEST_GPUS=${CFC_TEST_GPUS:-$GPUS} CFC_GRADS_DIR=$PWD/.carry/grads
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -2
PARTS=${PARTS:-rust pytest}
SUMMARY=$OUT/summary.txt
touch "$SUMMARY"  # (appended to: several calls of one run share it)
new_site=/tmp/site
old_site=/tmp/site-old
if ls .carry/old/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --upgrade --target $old_site .carry/old/*.whl
fi
for part in $PARTS; do case $part in
  rust)
    CFC_REQUIRE_GPU=1 timeout ${RUST_TIMEOUT:-300} .carry/engine-cuda-tests --include-ignored --test-threads=1 2>&1 | tail -15 | tee "$OUT/rust_engine_cuda.log"
    CFC_REQUIRE_GPU=1 timeout 200 .carry/engine-cuda-orders-tests --include-ignored --test-threads=1 2>&1 | tail -15 | tee "$OUT/rust_engine_cuda_orders.log"
    CFC_REQUIRE_GPU=1 timeout 200 .carry/codec-cuda-tests --include-ignored --test-threads=1 2>&1 | tail -15 | tee "$OUT/rust_codec_cuda.log"
    CFC_REQUIRE_GPU=1 timeout 200 .carry/lib-tests --test-threads=2 2>&1 | tail -4 | tee "$OUT/rust_lib.log"
    grep -h "test result" "$OUT"/rust_*.log >> "$SUMMARY" ;;
  pytest)
    timeout ${PYTEST_TIMEOUT:-480} python3 -m pytest -q -p no:cacheprovider -m gpu ${PYTEST_ARGS:-} ${PYTEST_FILES:-tests/python/test_gpu.py tests/python/test_ddp.py tests/python/test_allreducer.py tests/python/test_fsdp.py} \
        ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -60
    tail -1 "$OUT/pytest_gpu.log" >> "$SUMMARY" ;;
  bench)
    ARGS="--gpu $NPROC --grads .carry/grads --sizes ${SIZES:-64M,256M} --bounds ${BOUNDS:-0.3} --iters ${ITERS:-20}"
    timeout 200 .carry/cfc-bench $ARGS | tee "$OUT/cfc_bench_nvlink_$NPROC.md"
    env $SOCK timeout 300 .carry/cfc-bench $ARGS | tee "$OUT/cfc_bench_socket_$NPROC.md"
    { echo "cfc-bench nvlink, $NPROC ranks:"; grep "^|" "$OUT/cfc_bench_nvlink_$NPROC.md"; echo "cfc-bench socket, $NPROC ranks:"; grep "^|" "$OUT/cfc_bench_socket_$NPROC.md"; } >> "$SUMMARY" ;;
  pybench)
    for round in $(seq ${AB_ROUNDS:-1}); do
      for which in ${WHICH:-new}; do
        site=$([ $which = new ] && echo $new_site || echo $old_site)
        [ -d $site ] || continue
        for link in ${LINKS:-socket nvlink}; do
          envs=$([ $link = socket ] && echo "$SOCK" || echo "")
          log="$OUT/pybench_${link}_${NPROC}_${which}_$round.md"
          env $envs PYTHONPATH=$site timeout 300 torchrun --standalone --nproc_per_node=$NPROC -m cfc.bench \
              --grads .carry/grads --sizes ${PYSIZES:-16M,64M,256M} --bounds ${BOUNDS:-0.3} \
              --algorithms ${ALGORITHMS:-all-gather,reduce-scatter} --label $link 2>&1 \
              | grep -E "^\||Error|error" | tee "$log"
          { echo "python -m cfc.bench $link, $NPROC ranks, $which round $round:"; grep "^|" "$log"; } >> "$SUMMARY"
        done
      done
    done ;;
  step)
    for round in $(seq ${AB_ROUNDS:-2}); do
      for which in ${WHICH:-old new}; do
        site=$([ $which = new ] && echo $new_site || echo $old_site)
        [ -d $site ] || continue
        for link in ${LINKS:-socket nvlink}; do
          [ $link = nvlink ] && [ -n "${NVLINK_WHICH:-}" ] && [ $which != "$NVLINK_WHICH" ] && continue
          envs=$([ $link = socket ] && echo "$SOCK" || echo "")
          hooks=$([ $link = socket ] && echo "${SOCKET_HOOKS:---base noop noop cfc noop}" || echo "${NVLINK_HOOKS:-allreduce cfc-auto allreduce}")
          script=$([ $which = old ] && [ -f .carry/old/ddp_step_time.py ] && echo .carry/old/ddp_step_time.py || echo benches/ddp_step_time.py)
          env $envs PYTHONPATH=$site timeout 300 torchrun --standalone --nproc_per_node=$NPROC $script \
              --steps ${STEPS:-30} $hooks 2>&1 | grep -E "^\||Error|error" | tee "$OUT/step_${link}_${NPROC}_${which}_${round}.md"
          { echo "step $link $NPROC ranks $which round $round:"; grep "^|" "$OUT/step_${link}_${NPROC}_${which}_${round}.md"; } >> "$SUMMARY"
        done
      done
    done ;;
  parity)
    for seed in ${SEEDS:-0 1 2}; do
      timeout 400 torchrun --standalone --nproc_per_node=$NPROC examples/ddp_train.py --deterministic \
          --hook ${TRAIN_HOOKS:-allreduce,cfc} --seed $seed --steps ${TRAIN_STEPS:-1000} --d-model 256 --layers 4 \
          --heads 8 --batch 32 --seq 256 --out "$OUT/ddp_parity_seed$seed" 2>&1 | tail -4
    done
    python3 benches/parity_table.py "$OUT"/ddp_parity_seed*/losses.json | tee "$OUT/ddp_parity.md"
    cat "$OUT/ddp_parity.md" >> "$SUMMARY" ;;
  fsdp)
    for link in ${LINKS:-socket nvlink}; do
      envs=$([ $link = socket ] && echo "$SOCK" || echo "")
      env $envs PYTHONPATH=/tmp/site timeout ${FSDP_TIMEOUT:-400} torchrun --standalone --nproc_per_node=$NPROC examples/fsdp_train.py \
          --comm ${FSDP_WAYS:-noop,plain,bf16,cfc,cfc-auto} ${FSDP_ARGS:---d-model 1024 --layers 8 --heads 16 --seq 256 --batch 8 --steps 30} \
          2>&1 | grep -vE "^W[0-9]|\*\*\*|OMP_NUM" | tail -14 | tee "$OUT/fsdp_${link}_$NPROC.md"
      { echo "fsdp $link, $NPROC ranks:"; cat "$OUT/fsdp_${link}_$NPROC.md"; } >> "$SUMMARY"
    done ;;
  fsdphost)
    PYTHONPATH=/tmp/site timeout 200 torchrun --standalone --nproc_per_node=$NPROC benches/fsdp_host_time.py \
        ${FSDP_HOST_WAYS:+--comm $FSDP_HOST_WAYS} ${FSDP_HOST_ARGS:-} 2>&1 | grep -vE "^W[0-9]|\*\*\*|OMP_NUM" \
        | tail -6 | tee "$OUT/fsdp_host_$NPROC.md"
    { echo "fsdp host time, $NPROC ranks:"; cat "$OUT/fsdp_host_$NPROC.md"; } >> "$SUMMARY" ;;
  levels)
    echo "tc: $(command -v tc || echo none); user $(id -u)" | tee -a "$SUMMARY"
    N=${NODES:-2} P=${PER_NODE:-2}
    log="$OUT/levels_bench_${N}x${P}.md"
    if [ "${LEVEL_BENCH:-1}" = 1 ]; then
    NODES=$N PER_NODE=$P PYTHONPATH=$new_site timeout 400 bash scripts/emulate_nodes.sh -m cfc.bench \
        --grads .carry/grads --sizes ${LEVEL_SIZES:-64M,256M} --bounds ${BOUNDS:-0.3} --topologies flat,two-level \
        --aa --rounds ${LEVEL_ROUNDS:-3} --iters ${ITERS:-10} --json "$OUT/levels_bench_${N}x${P}.json" 2>&1 \
        | grep -E "^\||^all-reduce|Error|error|emulated" | tee "$log"
    { echo "python -m cfc.bench, $N emulated nodes of $P:"; grep -E "^\||^all-reduce|emulated" "$log"; } >> "$SUMMARY"
    log="$OUT/levels_bench_2x1.md"
    NODES=2 PER_NODE=1 PYTHONPATH=$new_site timeout 200 bash scripts/emulate_nodes.sh -m cfc.bench \
        --grads .carry/grads --sizes 64M --bounds ${BOUNDS:-0.3} --topologies two-level --iters ${ITERS:-10} 2>&1 \
        | grep -E "^\||^all-reduce|Error|error" | tee "$log"
    { echo "python -m cfc.bench, 2 emulated nodes of 1 (two-level falls back to flat):"; grep "^|" "$log"; } >> "$SUMMARY"
    fi
    if [ "${LEVEL_STEP:-1}" = 1 ]; then
      log="$OUT/levels_step_${N}x${P}.md"
      NODES=$N PER_NODE=$P PYTHONPATH=$new_site timeout ${STEP_TIMEOUT:-360} bash scripts/emulate_nodes.sh \
          benches/ddp_step_time.py ${STEP_HOOKS:-allreduce allreduce bf16 powersgd4 cfc-flat cfc-2l} \
          ${STEP_ARGS:---steps 12 --warmup 4 --block 3} --json "$OUT/levels_step_${N}x${P}.json" 2>&1 \
          | grep -vE "^\s*$|Warning|warn" | tail -25 | tee "$log"
      { echo "DDP step, 217M LM, $N emulated nodes of $P:"; grep -E "^\||ms" "$log" | tail -12; } >> "$SUMMARY"
    fi ;;
  quality)
    name=${QUALITY_NAME:-quality}
    env $SOCK PYTHONPATH=/tmp/site timeout ${QUALITY_TIMEOUT:-560} torchrun --standalone --nproc_per_node=$NPROC benches/quality.py \
        ${QUALITY_ARGS:-} --json "$OUT/$name.json" 2>&1 | grep -vE "^W[0-9]|\*\*\*|OMP_NUM" | tee "$OUT/$name.log" | tail -40
    { echo "$name, $NPROC ranks:"; grep -E "^\||held-out loss against" "$OUT/$name.log"; } >> "$SUMMARY" ;;
esac; done
echo "==== summary"
cat "$SUMMARY"
