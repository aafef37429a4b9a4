#!/usr/bin/env bash
# Train moe-jax on a Cloud TPU VM slice (all workers run the same command; JAX finds
# its peers itself on TPU pods).
#
# usage: launch/tpu_pod.sh --tpu NAME --zone ZONE --accelerator TYPE --model-dir gs://... \
#          [--project P] [--version RUNTIME] [--reuse] [--keep] [--no-check] [--dry-run] \
#          -- --gin_file=... [more moe-jax train flags]
#
# Steps (each echoed): compile the run's train step for the slice here, from this CPU
# (`moe-jax compile --target=tpu:TYPE`, needs `make compilers`; stops before booking
# anything when the run does not fit; $MOE_JAX names the command, --no-check skips it),
# create the slice (or reuse it), copy this checkout's working tree (uncommitted changes
# and untracked files that git does not ignore included; said, with a warning when there
# are any, also under --dry-run) to every worker,
# install it with the TPU extra, start `moe-jax train` on all workers with the same gin
# flags and MODEL_DIR, tail worker 0's log, delete the slice (unless --keep).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=common.sh
source "$here/common.sh"

tpu="" zone="" accel="" model_dir="" project="" version="tpu-ubuntu2204-base" reuse=0 keep=0 check=1
while [ $# -gt 0 ]; do
  case "$1" in
    --tpu) tpu=$2; shift 2 ;;
    --zone) zone=$2; shift 2 ;;
    --accelerator) accel=$2; shift 2 ;;
    --model-dir) model_dir=$2; shift 2 ;;
    --project) project=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    --reuse) reuse=1; shift ;;
    --keep) keep=1; shift ;;
    --no-check) check=0; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    --) shift; break ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
require_value --tpu "$tpu"
require_value --zone "$zone"
require_value --accelerator "$accel"
require_value --model-dir "$model_dir"
case "$model_dir" in gs://*) ;; *) die "--model-dir must be a gs:// path on a pod (got $model_dir)" ;; esac
[ $# -gt 0 ] || die "no train flags after '--' (at least --gin_file=...)"

gc=(gcloud compute tpus tpu-vm)
where=(--zone "$zone")
[ -n "$project" ] && where+=(--project "$project")
train_flags=$(printf ' %q' "$@")

if [ "$check" = 1 ]; then
  read -ra moe_jax <<< "${MOE_JAX:-moe-jax}"
  run "${moe_jax[@]}" compile --target="tpu:$accel" --no_eval "$@" ||
    die "the run does not compile or fit on $accel (moe-jax compile above); fix it or pass --no-check"
fi

if [ "$reuse" = 1 ]; then
  run "${gc[@]}" describe "$tpu" "${where[@]}"
else
  run "${gc[@]}" create "$tpu" "${where[@]}" --accelerator-type "$accel" --version "$version"
fi

archive=/tmp/moe-jax-$$.tar.gz
pack_checkout "$(cd "$here/.." && pwd)" "$archive"
run "${gc[@]}" scp "$archive" "$tpu:~/moe-jax.tar.gz" "${where[@]}" --worker=all
run "${gc[@]}" ssh "$tpu" "${where[@]}" --worker=all --command \
  "mkdir -p ~/moe-jax && tar -xzf ~/moe-jax.tar.gz -C ~/moe-jax && cd ~/moe-jax && python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu]'"
run "${gc[@]}" ssh "$tpu" "${where[@]}" --worker=all --command \
  "cd ~/moe-jax && nohup .venv/bin/moe-jax train --gin.MODEL_DIR=\"'$model_dir'\"$train_flags > ~/train.log 2>&1 &"
run "${gc[@]}" ssh "$tpu" "${where[@]}" --worker=0 --command \
  "pid=\$(pgrep -f 'moe-jax train' | head -n 1); tail -n 100 -f --pid=\$pid ~/train.log"
if [ "$keep" = 0 ]; then
  run "${gc[@]}" delete "$tpu" "${where[@]}" --quiet
fi
