# Shared helpers for the launch scripts: every step is echoed; --dry-run only echoes.
# shellcheck shell=bash

DRY_RUN=${DRY_RUN:-0}

# run CMD...: echo the command (shell-quoted), then run it unless DRY_RUN=1.
run() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  if [ "$DRY_RUN" != 1 ]; then
    "$@"
  fi
}

die() {
  echo "error: $*" >&2
  exit 2
}

# require_value FLAG VALUE: refuse an empty option value, naming the flag.
require_value() {
  [ -n "$2" ] || die "$1 is required (see --help)"
}
