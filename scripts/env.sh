# Sourced by scripts/demo.sh and scripts/test.sh: makes .venv with everything cfc needs and
# installs cfc into it (release build of the Rust core and binding). Idempotent.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 9) else "cfc needs Python 3.9 or newer")'
command -v cargo >/dev/null || { echo "cfc needs a Rust toolchain (cargo) on PATH" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
export VIRTUAL_ENV="$PWD/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"
# torch is only needed by the Python tests, the examples and the DDP hook; numpy by the package;
# matplotlib by the loss plot of examples/ddp_train.py.
python -m pip install -q --disable-pip-version-check "maturin>=1.7,<2" "numpy>=1.21" "pytest>=7" "torch>=2.1" "matplotlib>=3.5"
maturin develop --release -q
