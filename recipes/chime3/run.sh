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

recipe_dir=$(CDPATH= cd -P -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)  # physical: a linked recipe folder too
. "${recipe_dir}/../../tools/recipe.sh"   # repo_root, log, run, the grid options and stage
. "${recipe_dir}/db.sh"

# Options (each can be given as --name value).
stop_stage=4          # last stage to run
include_ped_real=false  # the official code leaves et05_ped_real out (7 splits); true: all 8
keep_raw_text=false   # true: keep verbalised punctuation (.PERIOD) / markers in references
stream_name=chime3
stream_seed=0         # seed of the random order (fixed across method seeds)
max_duration=         # leave out utterances longer than this (s); empty: keep all
seeds="0 1 2"         # the paper averages 3 runs
model=                # source model (empty: W2V2 from db.sh)

help_message=$(cat <<EOM
Usage: $0 [options]
  CHiME-3 (et05, enhanced) continual TTA recipe. Corpus locations are set in ${recipe_dir}/db.sh.
Options (default):
  --stage N (${stage})  --stop_stage N (${stop_stage})
  --include_ped_real true|false (${include_ped_real})  --keep_raw_text true|false (${keep_raw_text})
  --stream_name NAME (${stream_name})  --stream_seed N (${stream_seed})  --max_duration SEC (none: keep all)
${streams_help}
  --methods "LIST" (${methods})  --seeds "LIST" (${seeds})
  --conf_dir DIR (conf/)  --model DIR_OR_NAME (W2V2 of db.sh)
${grid_help}
  --data_dir DIR (${data_dir})  --exp_dir DIR (${exp_dir})  --dry_run true|false (${dry_run})
Stages: 0 manifest, 1 data check, 2 stream, 3 decode, 4 report.
EOM
)
int_options+=" stream_seed"
. "${repo_root}/tools/parse_options.sh"
if [ $# -gt 0 ]; then
  echo "$0: unexpected argument(s): $*" >&2
  exit 1
fi
check_grid_options
# absolute paths: manifests and decode commands must not depend on the working directory
case "${data_dir}" in /*) ;; *) data_dir=${PWD}/${data_dir} ;; esac
# the source statistics' folder (conf/<method>.opts: the decodes' data root is the corpus)
export TTA_SOURCE_STATS_DIR=${data_dir}
case "${exp_dir}" in /*) ;; *) exp_dir=${PWD}/${exp_dir} ;; esac

manifest=${data_dir}/chime3_et05.csv
stream_csv=${data_dir}/streams/${stream_name}.csv
check_decode 3 "" "${stream_name}=${stream_csv}"


if [ ${stage} -le 0 ] && [ ${stop_stage} -ge 0 ]; then
  log "Stage 0: CHiME-3 et05 (enhanced) -> ${manifest}"
  db_require CHIME3 "It must be the CHiME-3 root (the folder that contains data/audio/16kHz/enhanced)."
  prep_opts=()
  ${include_ped_real} && prep_opts+=(--include_ped_real)
  ${keep_raw_text} && prep_opts+=(--keep_raw_text)
  run "${python}" -m tta_brain.data.prep.prepare chime3 --root "${CHIME3}" --out "${manifest}" \
    --data_root "${CHIME3}" ${prep_opts[@]+"${prep_opts[@]}"}
fi

if [ ${stage} -le 1 ] && [ ${stop_stage} -ge 1 ]; then
  log "Stage 1: data check of ${manifest} (CHiME-3 is noisy already: nothing to corrupt)"
  run "${python}" -m tta_brain.data.prep.prepare validate "${manifest}"
  # utterances per split (reads the manifest: not in a dry run)
  ${dry_run} || "${python}" - "${manifest}" <<'PY'
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
  set_stream_write_opts
  run "${python}" -m tta_brain.data.prep.prepare streams --manifest "${manifest}" --out "${data_dir}" \
    --names "${stream_name}=random" --seed "${stream_seed}" ${dur_opts[@]+"${dur_opts[@]}"} \
    "${stream_write_opts[@]}"
fi

if [ ${stage} -le 3 ] && [ ${stop_stage} -ge 3 ] && [ -n "$(stats_kinds)" ]; then
  # the source statistics of eata / foa / ebats from clean speech in no stream (--stats_csv, e.g.
  # tr05 clean close-talk; not et05); conf/<method>.opts reads them from $TTA_SOURCE_STATS_DIR
  source_stats_stage 3 "${stats_csv}" "${CHIME3:-}" "${data_dir}"
fi

if [ ${stage} -le 3 ] && [ ${stop_stage} -ge 3 ]; then
  db_require CHIME3 "The stream's audio paths are relative to it (\$data_root)."
  resolve_model
  log "Stage 3: decode [${methods}] x seeds [${seeds}] (${engine}) -> ${exp_dir}/${stream_name}"
  # CHiME-3 is the paper's Table 1 column: single-domain option set (N = 10), no md streams
  decode_grid "${exp_dir}" "${CHIME3}" "" "${stream_name}=${stream_csv}"
fi

if [ ${stage} -le 4 ] && [ ${stop_stage} -ge 4 ]; then
  log "Stage 4: report ${exp_dir}/RESULTS.md"
  run "${python}" -m tta_brain.report --exp_dir "${exp_dir}" --out "${exp_dir}/RESULTS.md"
fi

log "Finished (stages ${stage}-${stop_stage})."
