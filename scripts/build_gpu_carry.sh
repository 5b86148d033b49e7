#!/usr/bin/env bash
# Here (with Rust): build what the scripts/gpu_*.sh scripts run on the GPU machine (which has no
# Rust) into .carry/: the cfc wheel, cfc-bench with the cuda feature, the test binary of
# tests/nccl.rs and that of the crate's own unit tests (those of src/gpu_allreduce.rs need a
# GPU), and the gradient vectors of ../shared/data/grads where that folder exists.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .carry
MATURIN=maturin
[ -x .venv/bin/maturin ] && MATURIN=.venv/bin/maturin
rm -f .carry/cfc-*.whl
"$MATURIN" build --release -q -o .carry
cargo build --release --features cuda --bin cfc-bench
cp target/release/cfc-bench .carry/cfc-bench
test_bin=$(cargo test --release --features cuda --test nccl --no-run --message-format=json 2>/dev/null \
    | python3 -c "import json,sys; print([j['executable'] for j in map(json.loads, sys.stdin) if j.get('executable') and 'nccl' in j['target']['name']][0])")
cp "$test_bin" .carry/nccl-tests
lib_bin=$(cargo test --release --features cuda --lib --no-run --message-format=json 2>/dev/null \
    | python3 -c "import json,sys; print([j['executable'] for j in map(json.loads, sys.stdin) if j.get('executable') and j['target']['kind'] == ['lib']][0])")
cp "$lib_bin" .carry/lib-tests
if [ -d ../shared/data/grads ]; then
    mkdir -p .carry/grads && cp ../shared/data/grads/* .carry/grads/
fi
ls -la .carry/cfc-*.whl .carry/cfc-bench .carry/nccl-tests .carry/lib-tests
