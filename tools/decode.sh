#!/usr/bin/env bash
# Shared by the recipes' decode stage. Source it after setting: python, hparams_dir, conf_dir,
# model, methods, seeds, dry_run (true|false), and log() (tools/log.sh).
#
# A method token is a yaml name in hparams_dir (suta) or a method+reset tag (dsuta+dynamic):
# the yaml is <token>.yaml if present, else <method>.yaml with --reset=<reset>. Extra overrides
# come from conf_dir/<method>.opts, then conf_dir/<token>.opts (one --key=value per line, #
# comments); on multi-domain streams the recipe may pass a kind suffix (e.g. _md) and then
# conf_dir/<method><kind>.opts is read too (the paper uses N=5 for DSUTA there). The token names
# the experiment folder.

run() {  # run or print a command
  if ${dry_run}; then
    printf 'DRY-RUN:'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

method_hparams() {
  if [ -f "${hparams_dir}/$1.yaml" ]; then
    echo "${hparams_dir}/$1.yaml"
  else
    echo "${hparams_dir}/${1%%+*}.yaml"
  fi
}

method_opts() {  # method_opts TOKEN [KIND]
  local token=$1 kind=${2:-} base=${1%%+*} f
  local files=("${conf_dir}/${base}.opts")
  if [ -n "${kind}" ]; then files+=("${conf_dir}/${base}${kind}.opts"); fi
  if [ "${token}" != "${base}" ]; then
    files+=("${conf_dir}/${token}.opts")
    if [ ! -f "${hparams_dir}/${token}.yaml" ]; then printf -- '--reset=%s ' "${token#*+}"; fi
  fi
  for f in "${files[@]}"; do
    if [ -f "${f}" ]; then
      grep -v '^[[:space:]]*#' "${f}" | tr '\n' ' ' || true
    fi
  done
}

# decode_runs STREAM_CSV OUT_DIR DATA_ROOT [EXTRA_OPTS] [KIND]: every method token x seed on one stream;
# runs whose summary.json exists are skipped (an interrupted run resumes from its checkpoint).
decode_runs() {
  local csv=$1 out_dir=$2 data_root=$3 extra=${4:-} kind=${5:-} method hparams method_extra seed out
  if [ ! -f "${csv}" ]; then
    echo "ERROR: stream ${csv} not found; run the earlier stages first (--stage 0)." >&2
    exit 1
  fi
  for method in ${methods}; do
    hparams=$(method_hparams "${method}")
    if [ ! -f "${hparams}" ]; then
      echo "ERROR: ${hparams} not found (methods: $(cd "${hparams_dir}" && ls -- *.yaml 2>/dev/null | sed 's/\.yaml$//' | tr '\n' ' '))" >&2
      exit 1
    fi
    method_extra=$(method_opts "${method}" "${kind}")
    for seed in ${seeds}; do
      out=${out_dir}/${method}/seed${seed}
      if [ -f "${out}/summary.json" ]; then
        log "decode: ${out} done, skipping"
        continue
      fi
      log "decode: $(basename "${csv}" .csv) with ${method}, seed ${seed} -> ${out}"
      # shellcheck disable=SC2086
      run ${python} -m tta_brain.decode "${hparams}" --source="${model}" \
        --stream_csv="${csv}" --output_folder="${out}" --seed="${seed}" \
        --data_root="${data_root}" ${method_extra} ${extra}
    done
  done
}
