#!/usr/bin/env bash
# log MESSAGE...: print a timestamped line with the calling script, line and function to stderr.
log() {
  local fname=${BASH_SOURCE[1]##*/}
  printf '%s (%s:%s:%s) %s\n' "$(date '+%Y-%m-%dT%H:%M:%S')" "${fname}" "${BASH_LINENO[0]}" \
    "${FUNCNAME[1]:-main}" "$*" >&2
}

# run CMD...: run a command, or print it (DRY-RUN: ...) when ${dry_run} is true.
run() {
  if ${dry_run:-false}; then
    printf 'DRY-RUN:'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}
