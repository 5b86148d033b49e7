# Sourced by scripts/gpu_run.sh and scripts/gpu_lossless.sh on the GPU machine (no Rust there):
# $OUT for logs, cfc installed from the wheel carried in .carry/, NVLink multicast off (DEVICE.md),
# and $SOCK, the environment that makes NCCL use TCP over loopback (the socket transport).
OUT=${OUT:-/tmp/cfc-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .carry/*.whl && export PYTHONPATH=/tmp/site
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SOCK="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo"
