#!/usr/bin/env bash
# The accelerator benchmark in one call on a bare GPU machine (jax, flax, optax, orbax; no
# gin-config, seqio or TensorFlow), inside a 10-minute limit:
#
#   [RUNS=a,b,...] benchmarks/gpu_session.sh [OUT_DIR] [BUDGET_SECONDS]
#
# OUT_DIR (default $OUT, else ./out/accelerator) receives accelerator.json (the report of
# benchmarks/accelerator_step.py), init_program.json (benchmarks/init_program.py --device;
# INIT_CHECK=0 skips it), log.txt and the profiler traces; BUDGET_SECONDS (default
# 540) bounds the benchmark's wall time: runs (RUNS, names of accelerator_step.py --runs;
# default below) are measured in order, each with what remains of the budget, and a run
# that no longer fits is recorded as skipped.
# Wheels in .whl/ are installed first, offline (get them on a machine with the package
# index: `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux2014_x86_64 -d .whl gin-config==0.5.0 tokamax==0.0.12 einshape pydantic
# pydantic_core annotated-types typing-inspection qwix typeguard==2.13.3 immutabledict
# tensorboardX`). Then, on a machine with the
# project installed: copy accelerator.json to benchmarks/accelerator/<device>.json and run
# `python benchmarks/report.py`.
set -euo pipefail

cd "$(dirname "$0")/.."
out="${1:-${OUT:-out/accelerator}}"
budget="${2:-540}"
mkdir -p "$out"
python="${PYTHON:-python3}"
start=$(date +%s)

# Packages the machine lacks (gin-config; tokamax and its needs for the dropless kernel)
# travel as wheels in .whl/ and are installed offline, for this call only.
site=""
if compgen -G ".whl/*.whl" >/dev/null; then
  site=$(mktemp -d)
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
fi
if [[ -z "$site" ]] && ! "$python" -c "import gin" 2>/dev/null; then
  echo "gpu_session: gin-config is not installed and no wheel is in .whl/" >&2
  exit 2
fi
export PYTHONPATH="$PWD${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"

{
  "$python" - <<'EOF'
import importlib, jax
for name in ("jax", "flax", "optax", "orbax.checkpoint", "gin", "fsspec", "etils.epath", "tokamax"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '')}")
    except ImportError as err:
        print(f"{name}: not importable ({err})")
print("devices:", jax.devices())
EOF
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
} 2>&1 | tee "$out/log.txt"

# The initial state's program, T5-Base dense as it runs by default (unrolled layers, initialised
# by the scanned program): init_state() as a run calls it, and the
# threefry kernel's program against the inlined one (compile, run, the same state?).
if [[ "${INIT_CHECK:-1}" == 1 ]]; then
  "$python" benchmarks/init_program.py --device --runs experiments/base_dense.gin \
    --layers unrolled --json "$out/init_program.json" 2>&1 | tee -a "$out/log.txt" || true
fi

left=$((budget - ($(date +%s) - start)))
# Most informative first: the Base pair as it runs by default (unrolled), the dense step's
# attention traffic cut by a fused kernel (the project's Pallas flash kernel; cuDNN's), the
# MoE layer, Figure 5's trio with the Pallas kernel, then with cuDNN's, the MoE step with the
# Pallas kernel, bfloat16 logits, then the Base pair scanned with 'minimal' remat.
runs="${RUNS:-base_dense,base_learned,base_dense_pallas,base_dense_cudnn,moe_layer,fig5_dense_pallas,fig5_learned_pallas,fig5_frozen_pallas,fig5_dense_cudnn,base_learned_pallas,base_dense_bf16_logits,base_dense_scanned_minimal,base_learned_scanned_minimal}"
"$python" benchmarks/accelerator_step.py \
  --runs "$runs" \
  --steps 10 --budget "$left" --profile "$out/trace" --out "$out/accelerator.json" \
  2>&1 | tee -a "$out/log.txt"
