#!/usr/bin/env bash
# Runs `python3 "$@"` as NODES x PER_NODE ranks on this host, each node emulated (docs at
# ../shared/docs/DEVICE.md, "Emulated nodes"): NCCL takes ranks with different NCCL_HOSTID values
# for different hosts, so between nodes it goes over TCP on loopback, inside a node over NVLink.
# Rank r is local rank r % PER_NODE of node r / PER_NODE, on GPU (r % PER_NODE) % GPUS; so 2 nodes
# of 1 rank share a GPU (NCCL checks for duplicate GPUs within a host only). Each rank is a plain
# process with its own environment (torchrun cannot give ranks different ones); the exit status
# is the first failing rank's. Where a node has more ranks than there are GPUs, its ranks share
# a GPU, which NCCL refuses within one host: each rank then gets an NCCL_HOSTID of its own (cfc's
# node, CFC_NODE, stays the group's), so NCCL goes over sockets inside the node too; inside-node
# times are then those of sockets, not of NVLink (a line on stderr says so). Example, on one GPU:
#   NODES=2 PER_NODE=1 bash scripts/emulate_nodes.sh -m cfc.bench --sizes 64M --bounds 0.3
set -uo pipefail
NODES=${NODES:-2}
PER_NODE=${PER_NODE:-1}
GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$GPUS" -ge 1 ] || GPUS=1
WORLD=$((NODES * PER_NODE))
PORT=${MASTER_PORT:-$((29500 + RANDOM % 1000))}
if [ "$PER_NODE" -gt "$GPUS" ] && command -v nvidia-smi >/dev/null; then
    echo "emulate_nodes: $PER_NODE ranks per node on $GPUS GPU(s): NCCL goes over sockets inside each node too" >&2
fi
pids=()
for rank in $(seq 0 $((WORLD - 1))); do
    node=$((rank / PER_NODE)) local=$((rank % PER_NODE))
    hostid=node$node
    [ "$PER_NODE" -gt "$GPUS" ] && hostid=node$node.$local
    RANK=$rank WORLD_SIZE=$WORLD LOCAL_RANK=$((local % GPUS)) LOCAL_WORLD_SIZE=$PER_NODE \
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT NCCL_HOSTID=$hostid CFC_NODE=node$node \
    NCCL_IB_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo \
        python3 "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid"
    rc=$?
    if [ $rc -ne 0 ] && [ $status -eq 0 ]; then status=$rc; fi
done
exit $status
