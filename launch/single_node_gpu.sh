#!/usr/bin/env bash
# Train on every GPU of one machine from a single process (JAX sees all local GPUs; the
# mesh file spreads experts over them). usage:
#   launch/single_node_gpu.sh [--dry-run] --gin_file=... [--gin.MODEL_DIR=...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=common.sh
source "$here/common.sh"
if [ "${1:-}" = --dry-run ]; then DRY_RUN=1; shift; fi
[ $# -gt 0 ] || die "no train flags (at least --gin_file=...)"
# the mesh file goes last: its bfloat16 ACTIVATION_DTYPE must follow the model files
run "$here/../.venv/bin/moe-jax" train "$@" --gin_file=meshes/gpu_8x_h100.gin
