#!/usr/bin/env bash
# Every test of cfc: set everything up, then the Rust checks and tests and the Python tests.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

if cargo fmt --version >/dev/null 2>&1; then
    cargo fmt --all --check
else
    echo "rustfmt not installed: skipping the format check"
fi
if cargo clippy --version >/dev/null 2>&1; then
    cargo clippy --workspace --all-targets --release -- -D warnings
else
    echo "clippy not installed: skipping lints"
fi
# Release mode: the property tests push more than 10^8 elements through the codec.
cargo test --workspace --release
python -m pytest tests/python
