#!/usr/bin/env bash
# The routing comparison of configs/routing_cpu.toml in its order (docs/moe.md "Comparison at CPU scale"):
#   configs/routing_cpu.sh ROOT [FAMILY] [PARALLEL]
# 1. train the dense source (`dense_half`) with the first other runs; 2. upcycle it into
# ROOT/upcycled/seed<N>; 3. train the rest (the upcycled run resumes at the dense step);
# 4. collect accuracy / cross-entropy curves and the routing table + plot into ROOT/results.
# Set PYTHON to the interpreter (default: the repository's .venv/bin/python, else python3
# on PATH); works from any directory, without an activated venv; every step is resumable.
set -euo pipefail
ROOT=${1:?usage: configs/routing_cpu.sh ROOT [FAMILY] [PARALLEL]}
FAMILY=${2:-configs/routing_cpu.toml}
PARALLEL=${3:-3}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x "$here/../.venv/bin/python" ]; then
  PY="$here/../.venv/bin/python"
else
  PY=$(command -v python3 || command -v python || true)
  [ -n "$PY" ] || { echo "configs/routing_cpu.sh: no Python found: set PYTHON=/path/to/python" >&2; exit 1; }
fi
MOE=("$PY" -m moe_jax.cli)

"${MOE[@]}" sweep run "$FAMILY" --root="$ROOT" --parallel="$PARALLEL" --only=dense_half,dense,top2_learned
"${MOE[@]}" sweep run "$FAMILY" --root="$ROOT" --dry-run --only=upcycled | while read -r line; do
  read -ra argv <<<"$line"
  out=$(printf '%s\n' "${argv[@]}" | sed -n 's/^--gin.MODEL_DIR=//p' | tr -d "'\"")
  seed_dir=$(basename "$out")
  if [ ! -d "$out/checkpoints" ]; then
    # the family trains it with its own gin files (its capacity factors): keep them
    "${MOE[@]}" upcycle --checkpoint="$ROOT/dense_half/$seed_dir" --out="$out" --keep_capacity "${argv[@]:2}"
  fi
done
"${MOE[@]}" sweep run "$FAMILY" --root="$ROOT" --parallel="$PARALLEL"
for metric in accuracy cross_entropy; do
  "${MOE[@]}" sweep collect "$FAMILY" --root="$ROOT" --out="$ROOT/results" --metric="$metric"
done
"$PY" -m moe_jax.experiments.routing_comparison "$FAMILY" --root="$ROOT" --out="$ROOT/results"
