#!/usr/bin/env bash
# Kaldi/ESPnet-style command-line options for recipe scripts.
#
# Define every option as a shell variable with its default, then source this file:
#
#     stage=0
#     use_gpu=false
#     help_message="Usage: $0 [options]"
#     . tools/parse_options.sh
#
# Accepted forms: --foo-bar VALUE, --foo_bar VALUE, --foo-bar=VALUE. Each sets the variable
# foo_bar, which must already be defined; anything else is an "invalid option" error (exit 1).
# A variable whose default is true/false only accepts true or false; --stage and --stop_stage,
# and the options named in $int_options, only an integer; --stage no later than --stop_stage.
# --config FILE sources FILE (shell assignments of known options) before the remaining options.
# --help / -h prints $help_message and exits 0.
# Parsing stops at "--" or at the first argument that does not start with "--"; those arguments
# stay in "$@" for the caller (this file is sourced, so it shifts the caller's arguments).

while [ $# -gt 0 ]; do
  case "$1" in
    --help|-h)
      printf '%s\n' "${help_message:-Usage: $0 [options] (no help message defined)}"
      exit 0 ;;
    --)
      shift
      break ;;
    --*=*)
      _po_name=${1%%=*}
      _po_value=${1#*=}
      _po_shift=1 ;;
    --*)
      if [ $# -lt 2 ]; then
        echo "$0: option $1 needs a value" >&2
        exit 1
      fi
      _po_name=$1
      _po_value=$2
      _po_shift=2 ;;
    *)
      break ;;
  esac
  _po_name=${_po_name#--}
  _po_name=${_po_name//-/_}
  if [ "${_po_name}" = config ]; then
    if [ ! -f "${_po_value}" ]; then
      echo "$0: config file ${_po_value} not found" >&2
      exit 1
    fi
    # shellcheck disable=SC1090
    . "${_po_value}"
    shift "${_po_shift}"
    continue
  fi
  if ! [[ ${_po_name} =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || [ -z "${!_po_name+set}" ]; then
    echo "$0: invalid option --${_po_name//_/-} (see --help)" >&2
    exit 1
  fi
  case "${!_po_name}" in
    true|false)
      if [ "${_po_value}" != true ] && [ "${_po_value}" != false ]; then
        echo "$0: option --${_po_name//_/-} expects true or false, got '${_po_value}'" >&2
        exit 1
      fi ;;
  esac
  printf -v "${_po_name}" '%s' "${_po_value}"
  shift "${_po_shift}"
done
# Stage numbers are compared with [ -le ]: anything but an integer is an error here, not a
# shell complaint per stage and a run that silently does nothing; so are the recipe's counts
# and seeds ($int_options: bash arithmetic read "abc" as an unset variable's name).
for _po_name in stage stop_stage ${int_options:-}; do
  if [ -n "${!_po_name+set}" ] && ! [[ ${!_po_name} =~ ^-?[0-9]+$ ]]; then
    echo "$0: option --${_po_name//_/-} expects an integer, got '${!_po_name}'" >&2
    exit 1
  fi
done
if [ -n "${stage+set}" ] && [ -n "${stop_stage+set}" ] && [ "${stage}" -gt "${stop_stage}" ]; then
  echo "$0: --stage ${stage} is after --stop-stage ${stop_stage}: no stage would run" >&2
  exit 1
fi
unset _po_name _po_value _po_shift
true
