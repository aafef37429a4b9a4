#!/usr/bin/env bash
# The accelerator benchmark in one call on a bare GPU machine (jax, flax, optax, orbax; no
# gin-config, seqio or TensorFlow), inside a 10-minute limit:
#
#   benchmarks/gpu_session.sh [OUT_DIR] [BUDGET_SECONDS]
#
# OUT_DIR (default $OUT, else ./out/accelerator) receives accelerator.json (the report of
# benchmarks/accelerator_step.py), log.txt and the profiler traces; BUDGET_SECONDS (default
# 540) bounds the benchmark's wall time: runs are measured in order of importance, each
# with what remains of the budget, and a run that no longer fits is recorded as skipped.
# gin-config is imported from its wheel in .cache/wheels/ when it is not installed (get it:
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --dest .cache/wheels
# gin-config==0.5.0` on a machine with the package index). Then, on a machine with the
# project installed: copy accelerator.json to benchmarks/accelerator/<device>.json and run
# `python benchmarks/report.py`.
set -euo pipefail

cd "$(dirname "$0")/.."
out="${1:-${OUT:-out/accelerator}}"
budget="${2:-540}"
mkdir -p "$out"
python="${PYTHON:-python3}"
start=$(date +%s)

gin_path=""
if ! "$python" -c "import gin" 2>/dev/null; then
  # gin-config is pure Python: its wheel is importable as it is (a zip on the path)
  gin_path=$(ls "$PWD"/.cache/wheels/gin_config-*.whl 2>/dev/null | head -n 1 || true)
  if [[ -z "$gin_path" ]]; then
    echo "gpu_session: gin-config is not installed and no wheel is in .cache/wheels/" >&2
    exit 2
  fi
fi
export PYTHONPATH="$PWD${gin_path:+:$gin_path}${PYTHONPATH:+:$PYTHONPATH}"

{
  "$python" - <<'EOF'
import importlib, jax
for name in ("jax", "flax", "optax", "orbax.checkpoint", "gin", "fsspec", "etils.epath"):
    module = importlib.import_module(name)
    print(f"{name} {getattr(module, '__version__', '')}")
print("devices:", jax.devices())
EOF
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
} 2>&1 | tee "$out/log.txt"

left=$((budget - ($(date +%s) - start)))
# Most informative first: the Base pair, the MoE layer, then Figure 5's trio.
"$python" benchmarks/accelerator_step.py \
  --runs base_learned,base_dense,moe_layer,fig5_learned,fig5_dense,fig5_frozen \
  --steps 10 --budget "$left" --profile "$out/trace" --out "$out/accelerator.json" \
  2>&1 | tee -a "$out/log.txt"
