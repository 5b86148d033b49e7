# Sourced by scripts/demo.sh and scripts/test.sh: makes .venv with everything cfc needs and
# installs cfc into it (release build of the Rust core and binding). Idempotent.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
SETUP_START=$SECONDS
# Announces a phase of the run, with the time since it began.
phase() { printf '\n==== [%4ss] %s\n' "$((SECONDS - SETUP_START))" "$*"; }
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 9) else "cfc needs Python 3.9 or newer")'
command -v cargo >/dev/null || { echo "cfc needs a Rust toolchain (cargo) on PATH" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
export VIRTUAL_ENV="$PWD/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"
# torch is only needed by the Python tests, the examples and the DDP hook; numpy by the package;
# matplotlib by the loss plot of examples/ddp_train.py.
phase "Python packages into .venv (the first time: torch and its CUDA libraries, about 5 GB, a few minutes)"
python -m pip install --disable-pip-version-check "maturin>=1.7,<2" "numpy>=1.21" "pytest>=7" \
    "torch>=2.1" "matplotlib>=3.5"
phase "building cfc (Rust, release; the first time about 3 minutes on 2 cores)"
maturin develop --release
phase "ready"

# NVRTC and CUDA's headers from the CUDA build of torch (its nvidia-* wheels): with them the Rust
# tests compile every kernel for the GPUs cfc supports (NVRTC needs no GPU), and CFC_NVRTC_CHECK
# makes that compulsory, so a kernel that does not compile fails here rather than on a GPU.
nvidia_dir="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia"
for d in "$nvidia_dir"/cu*; do
    if ls "$d"/lib/libnvrtc.so.* >/dev/null 2>&1 && [ -f "$d/include/cuda_fp16.h" ]; then
        export LD_LIBRARY_PATH="$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CFC_CUDA_INCLUDE="$d/include" CFC_NVRTC_CHECK=1
        break
    fi
done
