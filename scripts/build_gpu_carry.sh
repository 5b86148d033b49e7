#!/usr/bin/env bash
# Here (with Rust): build what scripts/gpu_rust.sh runs on the GPU machine into .carry/:
# cfc-bench with the cuda feature, the test binary of tests/nccl.rs and that of the crate's own
# unit tests (those of src/gpu_allreduce.rs need a GPU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .carry
cargo build --release --features cuda --bin cfc-bench
cp target/release/cfc-bench .carry/cfc-bench
test_bin=$(cargo test --release --features cuda --test nccl --no-run --message-format=json 2>/dev/null \
    | python3 -c "import json,sys; print([j['executable'] for j in map(json.loads, sys.stdin) if j.get('executable') and 'nccl' in j['target']['name']][0])")
cp "$test_bin" .carry/nccl-tests
lib_bin=$(cargo test --release --features cuda --lib --no-run --message-format=json 2>/dev/null \
    | python3 -c "import json,sys; print([j['executable'] for j in map(json.loads, sys.stdin) if j.get('executable') and j['target']['kind'] == ['lib']][0])")
cp "$lib_bin" .carry/lib-tests
ls -la .carry/cfc-bench .carry/nccl-tests .carry/lib-tests
