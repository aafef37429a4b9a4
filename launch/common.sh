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

# pack_checkout REPO ARCHIVE: REPO's working tree as a .tar.gz (tracked files as they are
# now, untracked files that git does not ignore: what `git status` shows is what ships),
# written through a temporary index (REPO's own index and files are untouched). Says which
# commit it is and how many uncommitted changes go with it, also under --dry-run.
pack_checkout() {
  local repo=$1 archive=$2 head changes index tree
  head=$(git -C "$repo" rev-parse --short HEAD)
  changes=$(git -C "$repo" status --porcelain | wc -l | tr -d ' ')
  if [ "$changes" = 0 ]; then
    echo "note: shipping the working tree of $repo: commit $head, no uncommitted changes"
  else
    echo "warning: shipping the working tree of $repo: commit $head plus $changes uncommitted" \
      "change(s), listed by 'git status --short'; commit them to keep a record of what ran"
  fi
  index=$(mktemp -d)
  tree=$(export GIT_INDEX_FILE="$index/index"
    git -C "$repo" read-tree HEAD && git -C "$repo" add -A && git -C "$repo" write-tree)
  rm -rf "$index"
  run git -C "$repo" archive --format=tar.gz -o "$archive" "$tree"
}
