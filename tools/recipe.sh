#!/usr/bin/env bash
# Shared by the recipes' run.sh, sourced right after recipe_dir is set: repo_root, PYTHONPATH,
# log() and run() (tools/log.sh), the grid options' defaults and the decode stage on
# tta_brain.grid (python -m tta_brain.grid --help explains every option).
repo_root=$(CDPATH= cd -P -- "${recipe_dir}/../.." && pwd -P)
export PYTHONPATH="${repo_root}${PYTHONPATH:+:${PYTHONPATH}}"
. "${repo_root}/tools/log.sh"

# Options every recipe has (each can be given as --name value).
stage=0               # first stage to run
python=python3
methods="source suta sgem csuta awmc dsuta dsuta+dynamic dsuta+fixed dsuta+oracle"  # method tokens, or all
conf_dir=${recipe_dir}/conf   # <method>.opts, <method>_md.opts, <token>.opts: decode overrides
data_dir=${recipe_dir}/data
exp_dir=${recipe_dir}/exp
dry_run=false         # print the decode/report commands instead of running them
# Grid options.
hparams_dir=          # own yamls (<token>.yaml or <method>.yaml; empty: the packaged ones)
decode_opts=          # overrides for every decode (named in the run folder, e.g. suta_lr1e-4)
md_decode_opts=       # overrides for multi-domain streams only (md_*, NAME=md_*)
md_recipe_opts=       # the recipe's own settings for those streams (e.g. K = half a block)
sweep=                # "key=v1,v2 ...": one run per combination (named in the run folder)
engine=local          # local | slurm: where the decodes run
nj=0                  # decodes at a time (0: local, one per CPU core or --per_gpu per GPU; slurm 64)
gpus=                 # local: GPU ids, e.g. "0 1 2 3"
per_gpu=2             # local: decodes per GPU
batch_runs=1          # suta/csuta/dsuta/tent/eata/sar/cotta/cea runs of one stream differing only in settings: batched sweeps of N
slurm_conf=${recipe_dir}/conf/slurm.yaml   # partition, time, memory, GPUs of one Slurm job
slurm_conf_default=${slurm_conf}
grid_help="  --engine local|slurm (${engine})  --nj N (${nj}: one per core; slurm 64)  --gpus \"LIST\" (none: CPU)  --per_gpu N (${per_gpu})
  --batch_runs N (${batch_runs})  --slurm_conf YAML (conf/slurm.yaml)
  --decode_opts \"OPTS\"  --sweep \"K=V1,V2 ...\"  --hparams_dir DIR (packaged yamls)  --python BIN (${python})"
# the recipes with multi-domain streams add these to their help (CHiME-3 has none: no such option)
md_opts_help="  --md_decode_opts \"OPTS\"  --md_recipe_opts \"OPTS\" (multi-domain streams only)"
# Source statistics of the methods that need them (eata: Fisher information), before decoding.
stats_csv=            # clean manifest of speech that is in no stream (synthetic: rendered if empty)
stats_utts=100        # its first N utterances (the EATA reference: 100)
# the options that take an integer (tools/parse_options.sh refuses anything else); a recipe adds
# its own
int_options="nj per_gpu batch_runs stats_utts"
append_options="streams sweep"     # given twice: both lists (both sweep axes), as the grid takes them
grid_help="${grid_help}
  --stats_csv CSV (clean speech in no stream: the source statistics of eata, foa, ebats)  --stats_utts N (${stats_utts})"

# Streams are written once (every method must decode the same stream): a stream whose rebuild
# would differ from its written file (e.g. a transcript corrected in the corpus) is refused,
# naming every such stream, unless --force_streams true.
force_streams=false
streams_help="  --force_streams true|false (${force_streams}; true: rewrite the streams whose rebuild differs from the written file)"

# set_stream_write_opts: stream_write_opts, the streams step's options for such streams (the
# refusal's advice names this recipe's option, not the python CLI's --force / --out).
set_stream_write_opts() {
  stream_write_opts=(--rebuild_hint "or rerun $0 with --force_streams true")
  if ${force_streams}; then stream_write_opts+=(--force); fi
}

# check_grid_options: the grid options that cannot go together, refused before any stage runs
# (tta_brain.grid refuses them too, but only at the decode stage, after the data stages).
check_grid_options() {
  case "${engine}" in
    local|slurm) ;;
    *) echo "$0: --engine ${engine}: local or slurm" >&2; exit 1 ;;
  esac
  if [ "${engine}" = local ] && [ "${slurm_conf}" != "${slurm_conf_default}" ]; then
    echo "$0: --slurm_conf ${slurm_conf}: read by --engine slurm only (this recipe would decode" \
      "on this machine); add --engine slurm, or leave --slurm_conf out" >&2
    exit 1
  fi
  if [ "${engine}" = slurm ] && [ -n "${gpus}" ]; then
    echo "$0: --gpus picks this machine's GPUs (--engine local); a Slurm job asks for its GPU" \
      "in --slurm_conf (gpus_per_node: 1) and then decodes on it" >&2
    exit 1
  fi
}

# check_decode STAGE MD_STREAMS STREAM_ARG...: when the decode stage STAGE is to run, its runs
# (the streams decode_grid will get, not read yet) have their settings checked now (method tokens,
# reset tags, option values of --decode_opts / --sweep / conf, --nj, --slurm_conf, the device),
# before the data stages: a bad value was found only after them, a failure per run.
check_decode() {
  ${dry_run} && return 0                  # the dry run's grid checks them, printing its commands
  if [ "${stage}" -gt "$1" ] || [ "${stop_stage}" -lt "$1" ]; then return 0; fi
  local md=$2 which=$1
  shift 2
  local opts=(--engine "${engine}" --nj "${nj}" --gpus "${gpus}" --per_gpu "${per_gpu}" --check)
  [ "${batch_runs}" != 1 ] && opts+=(--batch_runs "${batch_runs}")
  [ "${engine}" = slurm ] && opts+=(--slurm_conf "${slurm_conf}")
  # shellcheck disable=SC2086
  if ! "${python}" -m tta_brain.grid --exp_dir "${exp_dir}" --source "${model:-${W2V2:-model}}" \
      --streams "$@" --md_streams "${md}" --methods "${methods}" \
      --seeds "${seeds}" --hparams_dir "${hparams_dir}" --conf_dir "${conf_dir}" \
      --md_decode_opts="${md_decode_opts}" --md_recipe_opts="${md_recipe_opts}" \
      --decode_opts="${decode_opts}" ${sweep:+--sweep ${sweep}} "${opts[@]}"; then
    echo "$0: stage ${which} (decode) would refuse the runs above; nothing was run" >&2
    exit 1
  fi
}

# method_tokens: the method tokens of --methods ("all": every packaged method).
method_tokens() {
  if [ "${methods}" = all ]; then
    "${python}" -c "from tta_brain import hparams; print(' '.join(hparams.available()))"
  else
    echo "${methods}"
  fi
}

# method_stats_kinds METHOD: the source-statistics kinds a method reads (eata: fisher; foa:
# hidden; ebats: hidden, tokens; none for the others).
method_stats_kinds() {
  case $1 in
    eata) echo fisher ;;
    foa) echo hidden ;;
    ebats) echo hidden tokens ;;
  esac
}

# stats_methods: the listed methods that read source statistics (each once).
stats_methods() {
  local tok
  for tok in $(method_tokens); do
    if [ -n "$(method_stats_kinds "${tok%%+*}")" ]; then echo "${tok%%+*}"; fi
  done | sort -u
}

# stats_kinds: the source-statistics kinds the listed methods need.
stats_kinds() {
  local m
  echo $(for m in $(stats_methods); do printf '%s\n' $(method_stats_kinds "${m}"); done | sort -u)
}

# resolve_model: the source model, --model or else $W2V2 (the recipe's db.sh); every stage
# that reads it asks here (the statistics stage ran with an empty --source before)
resolve_model() {
  if [ -z "${model}" ]; then
    db_require W2V2 "It must be a local CTC model directory or a hub name (or pass --model)."
    model=${W2V2}
  fi
}

# source_stats_stage STAGE CSV DATA_ROOT DIR: the statistics of each listed method that needs
# them, of ${model} (in the language of a --target_lang=LANG in --decode_opts) on the first
# ${stats_utts} utterances of CSV (clean, in no stream) -> DIR/source_stats_<method>.pt
# (conf/<method>.opts names it). One file per method, so a method's file never changes when
# another method is added (its runs' fingerprints count the file's content); a current file is
# kept.
source_stats_stage() {
  local m kinds out lang
  lang=$(target_lang_of "${decode_opts:-}")  # an MMS checkpoint's language: the decode's adapter
  for m in $(stats_methods); do
    kinds=$(method_stats_kinds "${m}") out=$4/source_stats_${m}.pt
    if [ -z "$2" ] && [ -f "${out}" ]; then
      log "Stage $1: source statistics of ${m} (${kinds}): using ${out} (--stats_csv CSV to recompute them)"
      continue
    elif [ -z "$2" ]; then
      echo "ERROR: ${m} needs source statistics (${kinds}): name a manifest of clean speech" \
        "that is in no stream with --stats_csv CSV" >&2
      exit 1
    fi
    resolve_model                      # the statistics are the source model's: the decode's
    log "Stage $1: source statistics of ${m} (${kinds}) of ${model} on ${stats_utts} utterances of $2 -> ${out}"
    run "${python}" -m tta_brain.stats --source "${model}" --manifest "$2" --data_root "$3" \
      --kinds "${kinds}" --out "${out}" --max_utts "${stats_utts}" --reuse \
      ${lang:+--target_lang "${lang}"}
  done
}

# target_lang_of OPTS: the language the last --target_lang=LANG of a decode option string names
# (decode takes the last one given), or nothing.
target_lang_of() {
  local o lang=""
  for o in $1; do
    case ${o} in --target_lang=*) lang=${o#*=} ;; esac
  done
  echo "${lang}"
}

# grid_streams DATA_DIR "SNRS" "STREAMS": stream_args (snr<S>/<name>=<csv>) and md_streams (the
# names decoded with the multi-domain option set: md_*, or NAME=md_* of your own name).
grid_streams() {
  local data=$1 snr spec name
  stream_args=() md_streams=""
  for snr in $2; do
    for spec in $3; do
      name=${spec%%=*}
      stream_args+=("snr${snr}/${name}=${data}/snr${snr}/streams/${name}.csv")
      case "${spec#*=}" in md_*) md_streams="${md_streams} ${name}" ;; esac
    done
  done
}

# decode_snr_streams STAGE DATA_DIR: the decode stage of a recipe with per-SNR stream folders
# (snrs, streams, methods, seeds, exp_dir set by the recipe).
decode_snr_streams() {
  grid_streams "$2" "${snrs}" "${streams}"
  log "Stage $1: decode [${methods}] x [${streams}] x seeds [${seeds}] (${engine}) -> ${exp_dir}"
  decode_grid "${exp_dir}" "$2" "${md_streams}" "${stream_args[@]}"
}

# decode_grid EXP_DIR DATA_ROOT MD_STREAMS STREAM_ARG...: every method x stream x seed as jobs.
decode_grid() {
  local exp=$1 data_root=$2 md=$3
  shift 3
  local opts=(--engine "${engine}" --nj "${nj}" --gpus "${gpus}" --per_gpu "${per_gpu}")
  [ "${batch_runs}" != 1 ] && opts+=(--batch_runs "${batch_runs}")
  [ "${engine}" = slurm ] && opts+=(--slurm_conf "${slurm_conf}")
  ${dry_run} && opts+=(--dry_run)
  # shellcheck disable=SC2086
  "${python}" -m tta_brain.grid --exp_dir "${exp}" --source "${model}" --data_root "${data_root}" \
    --streams "$@" --methods "${methods}" --seeds "${seeds}" --hparams_dir "${hparams_dir}" \
    --conf_dir "${conf_dir}" --md_streams "${md}" --md_decode_opts="${md_decode_opts}" \
    --md_recipe_opts="${md_recipe_opts}" \
    --decode_opts="${decode_opts}" ${sweep:+--sweep ${sweep}} "${opts[@]}"
}
