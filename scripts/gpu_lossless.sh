#!/usr/bin/env bash
# On a GPU machine (no Rust there): install the wheel carried in .carry/, run the lossless GPU
# tests, decode frames of every chunk method under compute-sanitizer, then the lossless
# benchmark (ratio, GPU decode speed, fetch from pinned memory against a plain copy).
# PARTS picks what runs (default: "tests sanitizer bench"); MB sets the bench sizes.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_setup.sh
PARTS=${PARTS:-tests sanitizer bench}
GRADS=${CFC_GRADS_DIR:-.carry/grads}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for part in $PARTS; do case $part in
  tests) CFC_GRADS_DIR=$GRADS timeout 240 python3 -m pytest -q -m gpu tests/python/test_lossless.py tests/python/test_gpu.py \
           -rfE 2>&1 | tail -25 | tee "$OUT/lossless_tests.log" ;;
  sanitizer) SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
         timeout 240 "$SAN" --tool memcheck --error-exitcode 9 \
           python3 -m pytest -q -m gpu tests/python/test_lossless.py -k "every_method or hostile or encoder_writes and 4097" 2>&1 \
           | tail -12 | tee "$OUT/lossless_sanitizer.log" ;;
  bench) timeout 400 python3 benches/lossless_gpu.py --mb ${MB:-64,256} --grads "$GRADS" \
           --json "$OUT/lossless_gpu.json" 2>&1 | grep -v '^{' | tee "$OUT/lossless_gpu.log" ;;
esac; done
