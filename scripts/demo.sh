#!/usr/bin/env bash
# cfc's main job: set everything up, then train a byte-level transformer LM on the standard
# library's sources with DDP (2 processes; gloo on the CPU, NCCL where there are 2 GPUs), once
# with plain all-reduce and once with cfc_hook, and print loss parity and bytes saved. Then
# compress real gradients and the trained model's parameters (lossless and within a bound),
# and compare plain and compressed all-reduce. Extra arguments go to the training run.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# (set, torchrun uses it without a warning; its stderr is not filtered, so the progress bar moves)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
phase "training with plain all-reduce, then with cfc_hook (2 processes, 150 steps each)"
torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --hook allreduce,cfc --steps 150 \
    --out bench-out/ddp_train --save bench-out/ddp_train/lm.pt "$@"
phase "compressing gradients"
python examples/compress_demo.py
# The trained LM's parameters: lossless, within a bound, zstd and casts side by side
phase "compressing the trained model's parameters"
python examples/compress_model.py --state-dict bench-out/ddp_train/lm.pt
# The standalone all-reduce benchmark, plain against cfc: over NCCL where there are 2 GPUs
# (python -m cfc.bench), otherwise cfc-bench's CPU mode (ranks as threads)
phase "the all-reduce benchmark, plain against cfc"
if python -c "import torch, sys; sys.exit(torch.cuda.device_count() < 2)"; then
    BENCH=(--sizes 1M,16M,64M,256M)
    [ -d ../shared/data/grads ] && BENCH+=(--grads ../shared/data/grads)
    torchrun --standalone --nproc_per_node=2 -m cfc.bench "${BENCH[@]}" --json bench-out/allreduce.json
else
    cargo run --release --quiet --bin cfc-bench -- --ranks 2,4 --sizes 1M,4M --iters 3 \
        --json bench-out/allreduce_cpu.json
fi
python scripts/demo_summary.py bench-out/ddp_train/losses.json
