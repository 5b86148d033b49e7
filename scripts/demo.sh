#!/usr/bin/env bash
# cfc's main job: set everything up, then train a byte-level transformer LM on the standard
# library's sources with DDP (2 processes; gloo on the CPU, NCCL where there are 2 GPUs), once
# with plain all-reduce and once with cfc_hook, and print loss parity and bytes saved. Then
# compress real gradients and the trained model's parameters (lossless and within a bound),
# compare plain and compressed all-reduce (on CPUs: 4 processes as 2 emulated nodes), and end
# on the step-time model of GPU nodes. Extra arguments go to the training run.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# (set, torchrun uses it without a warning; its stderr is not filtered, so the progress bar moves)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
phase "training with plain all-reduce, then with cfc_hook (2 processes, 150 steps each)"
rm -rf bench-out/grads  # (the gradients of this run's last step, saved by its plain run)
torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --hook allreduce,cfc --steps 150 \
    --out bench-out/ddp_train --save bench-out/ddp_train/lm.pt --save-grads bench-out/grads "$@"
GRADS=bench-out/grads
[ -d ../shared/data/grads ] && GRADS=../shared/data/grads  # (a larger set, where it is)
phase "compressing gradients ($GRADS)"
python examples/compress_demo.py --grads "$GRADS"
# The trained LM's parameters: lossless, within a bound, zstd and casts side by side
phase "compressing the trained model's parameters"
python examples/compress_model.py --state-dict bench-out/ddp_train/lm.pt
# The standalone all-reduce benchmark, plain against cfc: over NCCL where there are 2 GPUs,
# otherwise over gloo between 4 processes as 2 emulated nodes
phase "the all-reduce benchmark, plain against cfc"
if python -c "import torch, sys; sys.exit(torch.cuda.device_count() < 2)"; then
    BENCH=(--sizes 1M,16M,64M,256M)
    BENCH+=(--grads "$GRADS")
    torchrun --standalone --nproc_per_node=2 -m cfc.bench "${BENCH[@]}" --json bench-out/allreduce.json
else
    # On CPUs the codec costs more time than loopback saves, so the times favour plain; what
    # carries over to GPU nodes are the bytes that leave each node (the last column but two).
    NODES=2 PER_NODE=2 bash scripts/emulate_nodes.sh -m cfc.bench --cpu --sizes 4M --bounds 0.3 \
        --grads "$GRADS" --topologies flat,two-level --iters 3 --json bench-out/allreduce_cpu.json
fi
phase "what the bytes buy on GPU nodes of 8 (a model checked against measured runs)"
python benches/step_model.py --nodes 2,8,32 --gbits 100,400
python scripts/demo_summary.py bench-out/ddp_train/losses.json
