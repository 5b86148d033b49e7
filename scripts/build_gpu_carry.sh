#!/usr/bin/env bash
# Here (with Rust): build what scripts/gpu_run.sh runs on the GPU machine (which has no Rust) into
# .carry/: the cfc wheel, cfc-bench with the cuda feature, the test binaries of the engine on the
# GPU and of the CUDA codec against the CPU's (tests/engine_cuda.rs, tests/engine_cuda_orders.rs,
# tests/codec_cuda.rs) and of the crate's own unit tests (the engine's state machine on the
# CPU, the kernels' NVRTC check), and the gradient vectors of ../shared/data/grads where that
# folder exists.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .carry
MATURIN=maturin
[ -x .venv/bin/maturin ] && MATURIN=.venv/bin/maturin
rm -f .carry/cfc-*.whl
"$MATURIN" build --release -q -o .carry
cargo build --release --features cuda --bin cfc-bench
cp target/release/cfc-bench .carry/cfc-bench
test_binary() {  # the executable of cargo test target $1 (a --test name, or --lib)
    cargo test --release --features cuda $1 --no-run --message-format=json 2>/dev/null \
        | python3 -c "import json,sys; print([j['executable'] for j in map(json.loads, sys.stdin) if j.get('executable') and j.get('profile', {}).get('test')][-1])"
}
cp "$(test_binary '--test engine_cuda')" .carry/engine-cuda-tests
cp "$(test_binary '--test engine_cuda_orders')" .carry/engine-cuda-orders-tests
cp "$(test_binary '--test codec_cuda')" .carry/codec-cuda-tests
cp "$(test_binary --lib)" .carry/lib-tests
if [ -d ../shared/data/grads ]; then
    mkdir -p .carry/grads && cp ../shared/data/grads/* .carry/grads/
fi
ls -la .carry/cfc-*.whl .carry/cfc-bench .carry/engine-cuda-tests .carry/engine-cuda-orders-tests .carry/codec-cuda-tests \
    .carry/lib-tests
