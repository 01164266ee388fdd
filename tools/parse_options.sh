#!/usr/bin/env bash
# Kaldi/ESPnet-style command-line options for recipe scripts.
#
# Define every option as a shell variable with its default, list it in $help_message as
# --name, then source this file:
#
#     stage=0
#     use_gpu=false
#     help_message="Usage: $0 [options]
#       --stage N (${stage})  --use_gpu true|false (${use_gpu})"
#     . tools/parse_options.sh
#
# Accepted forms: --foo-bar VALUE, --foo_bar VALUE, --foo-bar=VALUE. Each sets the variable
# foo_bar; an option is a variable that is defined AND listed in $help_message (so the script's
# own variables, e.g. repo_root, are no options, and --help lists every option); anything else
# is an "invalid option" error (exit 1).
# An option named in $append_options (a list: --streams, --sweep) given twice on the command line
# takes both values, space-separated (it kept the last one, silently); a --config line and then
# the command line: the command line's value replaces the file's, as for every option.
# A variable whose default is true/false only accepts true or false; --stage and --stop_stage,
# and the options named in $int_options, only an integer (or, where the default is empty,
# nothing); --stage no later than --stop_stage, and no later than the default --stop_stage
# (the script's last stage).
# --config FILE reads FILE's NAME=VALUE lines (# comments, blank lines; VALUE may be quoted
# whole with '' or "") as if they were options, in the place of --config: a line that is no
# such assignment, names no option, or has a value the option does not take (true/false, an
# integer), is an error naming FILE:LINE. It is not sourced.
# A value ~ or ~/... (--data_dir=~/data, a --config line) is the home folder, as the shell
# expands it in "--data_dir ~/data".
# --help / -h prints $help_message and exits 0 (exit 1 if it lists an option that is no
# variable: the help would promise what the script cannot take; so every --word in the help is
# an option of this script: quote another tool's flags without their dashes).
# Parsing stops at "--" or at the first argument that does not start with "--"; those arguments
# stay in "$@" for the caller (this file is sourced, so it shifts the caller's arguments).
# Afterwards $po_given is " name1 name2 " of the options that were given (on the command line or
# by --config), so a script can tell a value the user chose from its own default:
#     [[ ${po_given} == *" per_domain "* ]]

# _po_listed: " name1 name2 ... " of the options $help_message lists (--foo-bar -> foo_bar).
_po_listed=" "
_po_rest=${help_message:-}
# (a "--" inside a word is none: the help's paths, e.g. a clone in /data/tta--old, name no option)
while [[ ${_po_rest} =~ (^|[^A-Za-z0-9_./~-])--([A-Za-z][A-Za-z0-9_-]*)(.*) ]]; do
  _po_name=${BASH_REMATCH[2]//-/_}
  _po_rest=${BASH_REMATCH[3]}
  case "${_po_listed}" in *" ${_po_name} "*) ;; *) _po_listed+="${_po_name} " ;; esac
done
_po_last_stage=${stop_stage:-}
po_given=" "
_po_default_empty=" "          # the int options whose default is empty (bash 3: no arrays)
for _po_name in ${int_options:-}; do
  if [ -n "${!_po_name+set}" ] && [ -z "${!_po_name}" ]; then
    _po_default_empty+="${_po_name} "
  fi
done

# _po_set NAME VALUE WHERE: set option NAME (as spelled by the user) to VALUE, or exit 1 with
# a message that starts with WHERE.
_po_set() {
  local _po_n=$1 _po_v=$2 _po_w=$3
  _po_n=${_po_n//-/_}
  if ! [[ ${_po_n} =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || [ -z "${!_po_n+set}" ] \
      || [[ ${_po_listed} != *" ${_po_n} "* ]] || [[ ${_po_n} == _po_* ]]; then
    echo "${_po_w}: invalid option --${_po_n//_/-} (see --help)" >&2
    exit 1
  fi
  case "${!_po_n}" in
    true|false)
      if [ "${_po_v}" != true ] && [ "${_po_v}" != false ]; then
        echo "${_po_w}: option --${_po_n//_/-} expects true or false, got '${_po_v}'" >&2
        exit 1
      fi ;;
  esac
  # ~ and ~/... are the home folder, as the shell expands them in "--name ~/x" but not in
  # "--name=~/x" or a --config line (which made a folder named ~ in the working directory)
  case "${_po_v}" in "~") _po_v=${HOME} ;; "~/"*) _po_v=${HOME}/${_po_v#"~/"} ;; esac
  local _po_prev=_po_where_${_po_n}
  if [[ " ${append_options:-} " == *" ${_po_n} "* ]] && [[ ${po_given} == *" ${_po_n} "* ]] \
      && [ "${!_po_prev}" = "${_po_w}" ] && [ "${_po_w}" = "$0" ]; then
    _po_v="${!_po_n} ${_po_v}"       # a list option given twice on the command line: both
  fi
  printf -v "${_po_n}" '%s' "${_po_v}"
  printf -v "_po_where_${_po_n}" '%s' "${_po_w}"     # where the value came from, for the checks below
  case "${po_given}" in *" ${_po_n} "*) ;; *) po_given+="${_po_n} " ;; esac
}

# _po_config FILE: the NAME=VALUE lines of FILE, each set as an option.
_po_config() {
  local _po_f=$1 _po_l _po_i=0 _po_n _po_v
  if [ ! -f "${_po_f}" ]; then
    echo "$0: config file ${_po_f} not found" >&2
    exit 1
  fi
  while IFS= read -r _po_l || [ -n "${_po_l}" ]; do
    _po_i=$((_po_i + 1))
    _po_l=${_po_l%$'\r'}
    [[ ${_po_l} =~ ^[[:space:]]*(#.*)?$ ]] && continue
    if ! [[ ${_po_l} =~ ^[[:space:]]*([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]]; then
      echo "${_po_f}:${_po_i}: expected NAME=VALUE (an option of $0 --help), got: ${_po_l}" >&2
      exit 1
    fi
    _po_n=${BASH_REMATCH[1]}
    _po_v=${BASH_REMATCH[2]}
    if [[ ${_po_v} =~ ^\"([^\"]*)\"[[:space:]]*(#.*)?$ ]] \
        || [[ ${_po_v} =~ ^\'([^\']*)\'[[:space:]]*(#.*)?$ ]] \
        || [[ ${_po_v} =~ ^([^\"\'[:space:]]*)[[:space:]]*(#.*)?$ ]]; then
      _po_v=${BASH_REMATCH[1]}
    else
      echo "${_po_f}:${_po_i}: ${_po_n}: quote a value with spaces whole (\"...\" or '...'), got: ${_po_v}" >&2
      exit 1
    fi
    _po_set "${_po_n}" "${_po_v}" "${_po_f}:${_po_i}"
  done < "${_po_f}"
}

while [ $# -gt 0 ]; do
  case "$1" in
    --help|-h)
      printf '%s\n' "${help_message:-Usage: $0 [options] (no help message defined)}"
      printf '%s\n' "  --config FILE (NAME=VALUE lines, one option each, read in its place)"
      for _po_name in ${_po_listed}; do
        if [ -z "${!_po_name+set}" ]; then
          echo "$0: the help lists --${_po_name//_/-}, which is no option of this script" >&2
          exit 1
        fi
      done
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
  if [ "${_po_name//-/_}" = config ]; then
    _po_config "${_po_value}"
  else
    _po_set "${_po_name}" "${_po_value}" "$0"
  fi
  shift "${_po_shift}"
done
# Stage numbers are compared with [ -le ]: anything but an integer is an error here, not a
# shell complaint per stage and a run that silently does nothing; so are the recipe's counts
# and seeds ($int_options: bash arithmetic read "abc" as an unset variable's name).
for _po_name in stage stop_stage ${int_options:-}; do
  if [ -n "${!_po_name+set}" ] && ! [[ ${!_po_name} =~ ^-?[0-9]+$ ]] \
      && ! { [ -z "${!_po_name}" ] && [[ ${_po_default_empty} == *" ${_po_name} "* ]]; }; then
    _po_where=_po_where_${_po_name}
    echo "${!_po_where:-$0}: option --${_po_name//_/-} expects an integer, got '${!_po_name}'" >&2
    exit 1
  fi
done
if [ -n "${stage+set}" ] && [ -n "${stop_stage+set}" ] && [ "${stage}" -gt "${stop_stage}" ]; then
  echo "$0: --stage ${stage} is after --stop-stage ${stop_stage}: no stage would run" >&2
  exit 1
fi
if [ -n "${stage+set}" ] && [ -n "${_po_last_stage}" ] && [ "${stage}" -gt "${_po_last_stage}" ]; then
  echo "$0: --stage ${stage}: this script's last stage is ${_po_last_stage} (see --help)" >&2
  exit 1
fi
for _po_name in ${po_given}; do unset "_po_where_${_po_name}"; done
unset _po_name _po_value _po_shift _po_rest _po_listed _po_last_stage _po_default_empty _po_where
unset -f _po_set _po_config
true
