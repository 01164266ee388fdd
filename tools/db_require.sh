#!/usr/bin/env bash
# db_require VAR HINT: stop with an actionable message when VAR is empty.
db_require() {
  local var=$1 hint=$2 value=${!1:-}
  if [ -z "${value}" ] && ${dry_run:-false}; then   # the commands can be seen before the corpus is
    echo "dry run: ${var} is not set; the commands say <${var}> (a real run stops here: ${hint%.})" >&2
    printf -v "${var}" '%s' "<${var}>"
    return 0
  fi
  if [ -z "${value}" ]; then
    echo "ERROR: ${var} is not set. ${hint}" >&2
    echo "       Set it in ${db_file:-the recipe db.sh} or export ${var}=... before running." >&2
    exit 1
  fi
}
