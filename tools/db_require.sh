#!/usr/bin/env bash
# db_require VAR HINT: stop with an actionable message when VAR is empty.
db_require() {
  local var=$1 hint=$2 value=${!1:-}
  if [ -z "${value}" ]; then
    echo "ERROR: ${var} is not set. ${hint}" >&2
    echo "       Set it in ${db_file:-the recipe db.sh} or export ${var}=... before running." >&2
    exit 1
  fi
}
