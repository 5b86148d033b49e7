#!/usr/bin/env bash
# cfc's main job: set everything up, then compress and decompress real gradients and a model's
# parameters, printing ratio, max error against the bound and throughput.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python examples/compress_demo.py "$@"
