#!/usr/bin/env bash
# Emulate a pod on one machine: N local processes (each with D CPU devices) join one JAX
# job over a loopback coordinator and run the same training command, exercising the exact
# multi-host code path of a TPU pod or GPU cluster.
#   launch/local_cpu_multiprocess.sh [--dry-run] [--processes N] [--devices D] -- <train flags>
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=common.sh
source "$here/common.sh"
procs=2 devices=4
while [ $# -gt 0 ]; do
  case "$1" in
    --processes) procs=$2; shift 2 ;;
    --devices) devices=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; break ;;
    *) die "unknown option $1" ;;
  esac
done
[ $# -gt 0 ] || die "no train flags after '--' (at least --gin_file=...)"
port=${MOE_JAX_COORDINATOR_PORT:-$((20000 + RANDOM % 20000))}
pids=()
for ((i = 0; i < procs; i++)); do
  if [ "$DRY_RUN" = 1 ]; then
    run env JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES="$devices" "$here/../.venv/bin/moe-jax" train \
      --coordinator_address=127.0.0.1:$port --process_count="$procs" --process_index="$i" "$@"
  else
    run env JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES="$devices" "$here/../.venv/bin/moe-jax" train \
      --coordinator_address=127.0.0.1:$port --process_count="$procs" --process_index="$i" "$@" &
    pids+=($!)
  fi
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
