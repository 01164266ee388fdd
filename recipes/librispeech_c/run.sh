#!/usr/bin/env bash
# LS-C recipe: LibriSpeech test-other + MS-SNSD noises (10 domains), continual test-time
# adaptation of a CTC model on single-domain and multi-domain streams (Dynamic SUTA paper).
#
#   stage 0: LibriSpeech split -> manifest                        (needs LIBRISPEECH)
#   stage 1: noise-corrupted sets for every SNR and domain        (needs MS_SNSD unless only GS)
#   stage 2: stream manifests (single domains, MD-Easy/Hard with s=500/100/20, MD-Long)
#   stage 3: decode every method x stream x seed                  (needs W2V2)
#   stage 4: RESULTS.md per SNR
set -euo pipefail

recipe_dir=$(CDPATH= cd -P -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)  # physical: a linked recipe folder too
. "${recipe_dir}/../../tools/recipe.sh"   # repo_root, log, run, the grid options and stage
. "${recipe_dir}/db.sh"

# Options (each can be given as --name value).
stop_stage=4          # last stage to run
split=test-other      # LibriSpeech split
stats_split=          # LibriSpeech split for eata's source statistics (in no stream, e.g. dev-clean)
snrs="5"              # SNRs in dB (the paper: 5; also 0 and 10)
domains="AA AC BA CM GS MU NB SD TP VC"
noise_seed=666        # seed of the Gaussian (GS) noise
streams="AA AC BA CM GS MU NB SD TP VC md_easy md_hard md_easy_s100 md_easy_s20 md_hard_s100 md_hard_s20 md_long"
stream_seed=0         # seed of the stream orders (fixed across method seeds)
max_duration=20       # utterances longer than this (s) are left out of the streams, as in the paper
per_domain=           # MD-Easy/Hard utterances per domain (empty: 500)
md_long_total=        # MD-Long length (empty: 10000)
md_long_min=          # MD-Long shortest run (empty: 20)
md_long_max=          # MD-Long longest run (empty: 500)
seeds="0 1 2"         # the paper averages 3 runs
model=                # source model (empty: W2V2 from db.sh)

help_message=$(cat <<EOM
Usage: $0 [options]
  LS-C continual TTA recipe. Corpus locations are set in ${recipe_dir}/db.sh.
Options (default):
  --stage N (${stage})  --stop_stage N (${stop_stage})
  --split NAME (${split})  --snrs "LIST" (${snrs})  --domains "LIST" (${domains})
  --streams "LIST" (${streams}; NAME=KIND for a stream of your own name, e.g. held_out=md_easy)
  --stream_seed N (${stream_seed})  --noise_seed N (${noise_seed})  --max_duration SEC (${max_duration})
  --stats_split NAME (LibriSpeech split in no stream for the source statistics; or --stats_csv)
  --per_domain N  --md_long_total N  --md_long_min N  --md_long_max N  (paper sizes if empty)
${streams_help}
  --methods "LIST" (${methods})  --seeds "LIST" (${seeds})
  --conf_dir DIR (conf/)  --model DIR_OR_NAME (W2V2 of db.sh)
${grid_help}
${md_opts_help}
  --data_dir DIR (${data_dir})  --exp_dir DIR (${exp_dir})  --dry_run true|false (${dry_run})
Stages: 0 manifest, 1 corrupt, 2 streams, 3 decode, 4 report.
EOM
)
int_options+=" noise_seed stream_seed per_domain md_long_total md_long_min md_long_max"
. "${repo_root}/tools/parse_options.sh"
if [ $# -gt 0 ]; then
  echo "$0: unexpected argument(s): $*" >&2
  exit 1
fi
check_grid_options
# --stats_split: a LibriSpeech split other than the test split, refused before any stage runs
# (it was refused at stage 3, after the data stages)
stats_splits=" dev-clean dev-other test-clean test-other train-clean-100 train-clean-360"
stats_splits+=" train-other-500 "
stats_splits=${stats_splits/ ${split} / }
if [ -n "${stats_split}" ] && [[ ${stats_splits} != *" ${stats_split} "* ]]; then
  echo "$0: --stats_split ${stats_split}: one of${stats_splits% } (a LibriSpeech split in no" \
    "stream: --split ${split} is the test split; or --stats_csv CSV)" >&2
  exit 1
fi
# absolute paths: manifests and decode commands must not depend on the working directory
case "${data_dir}" in /*) ;; *) data_dir=${PWD}/${data_dir} ;; esac
case "${exp_dir}" in /*) ;; *) exp_dir=${PWD}/${exp_dir} ;; esac

clean_csv=${data_dir}/librispeech_${split//-/_}.csv
lsc_dir=${data_dir}/ls_c
grid_streams "${data_dir}" "${snrs}" "${streams}"   # (decode_snr_streams' own)
check_decode 3 "${md_streams}" "${stream_args[@]}"


if [ ${stage} -le 0 ] && [ ${stop_stage} -ge 0 ]; then
  log "Stage 0: LibriSpeech ${split} -> ${clean_csv}"
  db_require LIBRISPEECH "It must be the folder that contains LibriSpeech/${split} (openslr.org/12)."
  run "${python}" -m tta_brain.data.prep.prepare librispeech --root "${LIBRISPEECH}" --split "${split}" \
    --out "${clean_csv}"
fi

if [ ${stage} -le 1 ] && [ ${stop_stage} -ge 1 ]; then
  log "Stage 1: corrupt ${clean_csv} with [${domains}] at SNR [${snrs}] dB -> ${lsc_dir}"
  if [ "${domains}" != "GS" ]; then
    db_require MS_SNSD "It must be a clone of https://github.com/microsoft/MS-SNSD (with noise_test/)."
  fi
  # shellcheck disable=SC2086
  run "${python}" -m tta_brain.data.prep.prepare corrupt --manifest "${clean_csv}" --out "${lsc_dir}" \
    --noise_dir "${MS_SNSD:-}" --snrs ${snrs} --domains ${domains} --seed "${noise_seed}" \
    --data_root "${data_dir}"
fi

if [ ${stage} -le 2 ] && [ ${stop_stage} -ge 2 ]; then
  size_opts=()
  [ -n "${per_domain}" ] && size_opts+=(--per_domain "${per_domain}")
  [ -n "${md_long_total}" ] && size_opts+=(--total "${md_long_total}")
  [ -n "${md_long_min}" ] && size_opts+=(--min_len "${md_long_min}")
  [ -n "${md_long_max}" ] && size_opts+=(--max_len "${md_long_max}")
  set_stream_write_opts
  failed=0              # every SNR is tried, so one rerun sees all the refusals
  for snr in ${snrs}; do
    log "Stage 2: streams [${streams}] at ${snr} dB -> ${data_dir}/snr${snr}/streams"
    # shellcheck disable=SC2086
    run "${python}" -m tta_brain.data.prep.prepare streams --manifest_dir "${lsc_dir}/manifests" \
      --snr "${snr}" --out "${data_dir}/snr${snr}" --names ${streams} --seed "${stream_seed}" \
      --max_duration "${max_duration}" ${size_opts[@]+"${size_opts[@]}"} "${stream_write_opts[@]}" \
      || failed=$?
  done
  [ "${failed}" -eq 0 ] || exit "${failed}"
fi

if [ ${stage} -le 3 ] && [ ${stop_stage} -ge 3 ] && [ -n "$(stats_kinds)" ]; then
  # eata's source statistics from clean speech in no stream: --stats_csv, or --stats_split NAME
  # of LibriSpeech (e.g. dev-clean; the E-BATS reference took test-other, this recipe's test data)
  if [ -z "${stats_csv}" ] && [ -n "${stats_split}" ]; then
    db_require LIBRISPEECH "It must be the folder that contains LibriSpeech/${stats_split}."
    stats_csv=${data_dir}/librispeech_${stats_split//-/_}.csv
    run "${python}" -m tta_brain.data.prep.prepare librispeech --root "${LIBRISPEECH}" \
      --split "${stats_split}" --out "${stats_csv}"
  fi
  source_stats_stage 3 "${stats_csv}" "${data_dir}" "${data_dir}"  # conf/<method>.opts
fi

if [ ${stage} -le 3 ] && [ ${stop_stage} -ge 3 ]; then
  resolve_model
  decode_snr_streams 3 "${data_dir}"
fi

if [ ${stage} -le 4 ] && [ ${stop_stage} -ge 4 ]; then
  for snr in ${snrs}; do
    log "Stage 4: report ${exp_dir}/snr${snr}/RESULTS.md"
    run "${python}" -m tta_brain.report --exp_dir "${exp_dir}/snr${snr}" \
      --out "${exp_dir}/snr${snr}/RESULTS.md"
  done
fi

log "Finished (stages ${stage}-${stop_stage})."
