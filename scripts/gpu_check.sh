#!/usr/bin/env bash
# On the GPU machine (no Rust there): install the wheel carried in .carry/, run the GPU tests,
# one compute-sanitizer pass, then the GPU benchmark. Writes logs under $OUT when set.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/cfc-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .carry/*.whl && export PYTHONPATH=/tmp/site
for d in ../shared/data/grads shared/data/grads .carry/grads; do [ -d "$d" ] && export CFC_GRADS_DIR=$(cd "$d" && pwd) && break; done
export CFC_LOG=${CFC_LOG:-info}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pytest -q -m gpu tests/python/test_gpu.py -x 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
python3 -m pytest -q tests/python 2>&1 | tail -3 | tee -a "$OUT/gpu_tests.log"
if [ "${SANITIZE:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu tests/python/test_gpu.py \
    -k "real_gradients or hostile or 1000 or 33 or feedback or capacity" 2>&1 | tail -6 | tee "$OUT/sanitizer.log"
fi
python3 benches/gpu_codec.py --grads "${CFC_GRADS_DIR:?no gradient vectors found}" --json "$OUT/gpu_codec.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/gpu_bench.log"
