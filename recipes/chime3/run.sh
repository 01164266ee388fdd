#!/usr/bin/env bash
# CHiME-3 recipe: continual test-time adaptation on the enhanced et05 set (real noisy speech),
# all utterances in one random order (Dynamic SUTA paper, table 1, column CHiME-3).
#
#   stage 0: et05 enhanced audio + transcripts -> manifest      (needs CHIME3)
#   stage 1: data check (manifest columns, utterances per split; nothing to corrupt)
#   stage 2: the randomly ordered stream -> data/streams/<stream_name>.csv
#   stage 3: decode every method x seed                         (needs CHIME3 and W2V2)
#   stage 4: RESULTS.md
set -euo pipefail

recipe_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "${recipe_dir}/../.." && pwd)
export PYTHONPATH="${repo_root}${PYTHONPATH:+:${PYTHONPATH}}"
. "${repo_root}/tools/log.sh"
. "${recipe_dir}/db.sh"

# Options (each can be given as --name value).
stage=0               # first stage to run
stop_stage=4          # last stage to run
python=python3
include_ped_real=false  # the official code leaves et05_ped_real out (7 splits); true: all 8
keep_raw_text=false   # true: keep verbalised punctuation (.PERIOD) / markers in references
stream_name=chime3
stream_seed=0         # seed of the random order (fixed across method seeds)
max_duration=         # leave out utterances longer than this (s); empty: keep all
methods="source suta sgem csuta awmc dsuta dsuta+dynamic dsuta+fixed dsuta+oracle"  # yaml names or method+reset tags (sdpl too)
seeds="0 1 2"         # the paper averages 3 runs
hparams_dir=          # own yamls (<token>.yaml or <method>.yaml; empty: the packaged ones)
conf_dir=${recipe_dir}/conf   # <method>.opts: extra decode overrides per method token
model=                # source model (empty: W2V2 from db.sh)
sweep=                # "key=v1,v2 ...": one run per combination (named in the run folder)
engine=local          # local | slurm: where the decodes run (tta_brain.grid)
nj=0                  # decodes at a time (0: local, one per CPU core or --per_gpu per GPU; slurm 64)
gpus=                 # local: GPU ids, e.g. "0 1 2 3"
per_gpu=2             # local: decodes per GPU
slurm_conf=${recipe_dir}/conf/slurm.yaml   # partition, time, memory, GPUs of a Slurm job
decode_opts=          # extra --key=value overrides for every decode
data_dir=${recipe_dir}/data
exp_dir=${recipe_dir}/exp
dry_run=false         # print the decode/report commands instead of running them

help_message=$(cat <<EOM
Usage: $0 [options]
  CHiME-3 (et05, enhanced) continual TTA recipe. Corpus locations are set in ${recipe_dir}/db.sh.
Options (default):
  --stage N (${stage})  --stop_stage N (${stop_stage})
  --include_ped_real true|false (${include_ped_real})  --keep_raw_text true|false (${keep_raw_text})
  --stream_name NAME (${stream_name})  --stream_seed N (${stream_seed})  --max_duration SEC
  --methods "LIST" (${methods})  --seeds "LIST" (${seeds})
  --hparams_dir DIR  --conf_dir DIR  --model DIR_OR_NAME  --decode_opts "OPTS"  --sweep "K=V1,V2 ..."
  --engine local|slurm (${engine})  --nj N  --gpus "LIST"  --per_gpu N  --slurm_conf YAML
  --data_dir DIR (${data_dir})  --exp_dir DIR (${exp_dir})  --dry_run true|false
Stages: 0 manifest, 1 data check, 2 stream, 3 decode, 4 report.
EOM
)
. "${repo_root}/tools/parse_options.sh"
if [ $# -gt 0 ]; then
  echo "$0: unexpected argument(s): $*" >&2
  exit 1
fi
# absolute paths: manifests and decode commands must not depend on the working directory
case "${data_dir}" in /*) ;; *) data_dir=${PWD}/${data_dir} ;; esac
case "${exp_dir}" in /*) ;; *) exp_dir=${PWD}/${exp_dir} ;; esac

manifest=${data_dir}/chime3_et05.csv
stream_csv=${data_dir}/streams/${stream_name}.csv


if [ ${stage} -le 0 ] && [ ${stop_stage} -ge 0 ]; then
  log "Stage 0: CHiME-3 et05 (enhanced) -> ${manifest}"
  db_require CHIME3 "It must be the CHiME-3 root (the folder that contains data/audio/16kHz/enhanced)."
  prep_opts=()
  ${include_ped_real} && prep_opts+=(--include_ped_real)
  ${keep_raw_text} && prep_opts+=(--keep_raw_text)
  ${python} -m tta_brain.data.prepare chime3 --root "${CHIME3}" --out "${manifest}" \
    --data_root "${CHIME3}" ${prep_opts[@]+"${prep_opts[@]}"}
fi

if [ ${stage} -le 1 ] && [ ${stop_stage} -ge 1 ]; then
  log "Stage 1: data check of ${manifest} (CHiME-3 is noisy already: nothing to corrupt)"
  ${python} -m tta_brain.data.prepare validate "${manifest}"
  # utterances per split
  ${python} - "${manifest}" <<'PY'
import collections, csv, sys
with open(sys.argv[1], newline="") as f:
    counts = collections.Counter(row["domain"] for row in csv.DictReader(f))
print("utterances per split: " + ", ".join(f"{d}={n}" for d, n in sorted(counts.items())))
PY
fi

if [ ${stage} -le 2 ] && [ ${stop_stage} -ge 2 ]; then
  log "Stage 2: random-order stream -> ${stream_csv}"
  dur_opts=()
  [ -n "${max_duration}" ] && dur_opts+=(--max_duration "${max_duration}")
  ${python} -m tta_brain.data.prepare streams --manifest "${manifest}" --out "${data_dir}" \
    --names "${stream_name}=random" --seed "${stream_seed}" ${dur_opts[@]+"${dur_opts[@]}"}
fi

if [ ${stage} -le 3 ] && [ ${stop_stage} -ge 3 ]; then
  db_require CHIME3 "The stream's audio paths are relative to it (\$data_root)."
  if [ -z "${model}" ]; then
    db_require W2V2 "It must be a local CTC model directory or a hub name (or pass --model)."
    model=${W2V2}
  fi
  log "Stage 3: decode [${methods}] x seeds [${seeds}] (${engine}) -> ${exp_dir}/${stream_name}"
  grid_opts=(--engine "${engine}" --nj "${nj}" --gpus "${gpus}" --per_gpu "${per_gpu}")
  [ "${engine}" = slurm ] && grid_opts+=(--slurm_conf "${slurm_conf}")
  ${dry_run} && grid_opts+=(--dry_run)
  # CHiME-3 is the paper's Table 1 column: single-domain options (N = 10), no --md_streams
  # shellcheck disable=SC2086
  ${python} -m tta_brain.grid --exp_dir "${exp_dir}" --source "${model}" --data_root "${CHIME3}" \
    --streams "${stream_name}=${stream_csv}" --methods "${methods}" --seeds "${seeds}" \
    --hparams_dir "${hparams_dir}" --conf_dir "${conf_dir}" --decode_opts="${decode_opts}" \
    ${sweep:+--sweep ${sweep}} "${grid_opts[@]}"
fi

if [ ${stage} -le 4 ] && [ ${stop_stage} -ge 4 ]; then
  log "Stage 4: report ${exp_dir}/RESULTS.md"
  run ${python} -m tta_brain.report --exp_dir "${exp_dir}" --out "${exp_dir}/RESULTS.md"
fi

log "Finished (stages ${stage}-${stop_stage})."
