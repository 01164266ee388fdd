#!/usr/bin/env bash
# Synthetic noisy-speech benchmark: runs anywhere, offline, on a CPU.
# espeak-ng speech in LibriSpeech's layout + synthetic noise domains + a tiny wav2vec2 CTC model
# (committed in source_model/), then the paper's experiments in miniature.
#
#   stage 0: synthesise the test speech (and the training speech with --retrain true) + noises
#   stage 1: train the tiny source model (skipped: the committed one is reused unless --retrain)
#   stage 2: noisy single-domain sets at the chosen SNRs (the LS-C writer, unchanged)
#   stage 3: stream manifests (single domains, MD-Easy/Hard-like with s variants, MD-Long-like)
#   --long true: the long-stream benchmark instead (md_long of 3,000 utterances from its own
#   held-out split, every continual method of conf/long.methods; data/long<N>/, exp/long<N>/)
#   stage 4: decode every method x stream x seed
#   stage 5: RESULTS.md + plots
set -euo pipefail

recipe_dir=$(CDPATH= cd -P -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)  # physical: a linked recipe folder too
. "${recipe_dir}/../../tools/recipe.sh"   # repo_root, log, run, the grid options and stage

# Options (each can be given as --name value).
stop_stage=5
corpus_seed=1          # text, voices and rendering of the corpus
n_train=10000          # training utterances (rendered only with --retrain true)
n_test=400             # test utterances (held-out sentences and voices)
noise_seed=1
retrain=false          # train the source model anew instead of using source_model/
train_minutes=180      # training budget (CPU); the 14-epoch schedule takes about 150 min on one core
train_seed=1
model=${recipe_dir}/source_model
snrs="20"              # SNR(s) in dB; the tiny model is hurt, not destroyed, here (10 dB destroys it)
noise_table=${recipe_dir}/conf/noises.yaml
md_easy_order="AC TP SD MU TR"  # the five it does best on
md_hard_order="GS MU VC BA TR"  # the five noises the source model does worst on (paper: GS MU VC BA NB)
streams="md_easy md_hard"
stream_seed=0
per_domain=80          # utterances per domain block of MD-Easy/Hard (paper: 500)
md_long_total=800      # MD-Long-like length (paper: 10000)
md_long_min=20
md_long_max=100        # (paper: 500)
seeds="0"
long=false             # true: the long-stream configuration (README "Long streams")
long_total=3000        # --long true: md_long length (paper: 10000; 10000 works too)
long_max=500           # --long true: longest domain block (paper: 500; shortest: md_long_min)
n_long=                # --long true: clean utterances of its split (default long_total / 3)
long_window=100        # --long true: LONG.md's window (utterances) of the collapse figures and plot
noprogressbar=false    # true: no progress bars (synthesis, corruption, training, decoding)

help_message=$(cat <<EOM
Usage: $0 [options]
  Synthetic continual-TTA benchmark (offline, CPU). Default: MD-Easy/Hard-like streams at ${snrs} dB.
Options (default):
  --stage N (${stage})  --stop_stage N (${stop_stage})
  --n_test N (${n_test})  --n_train N (${n_train})  --corpus_seed N (${corpus_seed})
  --retrain true|false (${retrain})  --train_minutes N (${train_minutes})  --train_seed N (${train_seed})
  --model DIR (source_model/)
  --snrs "LIST" (${snrs})  --noise_table YAML (conf/noises.yaml)  --noise_seed N (${noise_seed})
  --streams "LIST" (${streams}; also single domains, md_*_s100, md_*_s20, md_long, and
                    NAME=KIND for a stream of your own name, e.g. held_out=md_easy)
  --per_domain N (${per_domain})  --stream_seed N (${stream_seed})
  --md_long_total N (${md_long_total})  --md_long_min N (${md_long_min})  --md_long_max N (${md_long_max})
  --long true|false (${long}: md_long of --long_total utterances, blocks --md_long_min to
                    --long_max, from --n_long held-out utterances, conf/long.methods)
  --long_total N (${long_total})  --long_max N (${long_max})  --n_long N (long_total / 3)
  --long_window N (${long_window}: LONG.md's windowed WER; a short --long_total needs a shorter one)
  --md_easy_order "LIST" (${md_easy_order})  --md_hard_order "LIST" (${md_hard_order})
${streams_help}
  --methods "LIST" (${methods})
  --seeds "LIST" (${seeds})
  --conf_dir DIR (conf/)  --noprogressbar true|false (${noprogressbar})
${grid_help}
${md_opts_help}
  --data_dir DIR (${data_dir})  --exp_dir DIR (${exp_dir})  --dry_run true|false (${dry_run})
Stages: 0 speech+noises, 1 source model, 2 noisy sets, 3 streams, 4 decode, 5 report.
EOM
)
int_options+=" corpus_seed n_train n_test noise_seed train_minutes train_seed stream_seed per_domain md_long_total md_long_min md_long_max long_total long_max n_long long_window"
. "${repo_root}/tools/parse_options.sh"
if [ $# -gt 0 ]; then
  echo "$0: unexpected argument(s): $*" >&2
  exit 1
fi
check_grid_options
if ${noprogressbar}; then
  export TTA_NOPROGRESSBAR=1
  decode_opts="--noprogressbar ${decode_opts}"
fi
case "${data_dir}" in /*) ;; *) data_dir=${PWD}/${data_dir} ;; esac
case "${exp_dir}" in /*) ;; *) exp_dir=${PWD}/${exp_dir} ;; esac
test_split=test-synth
if ${long}; then   # own data and results trees; --streams / --methods given still win
  ${retrain} && { echo "$0: train the model without --long first" >&2; exit 1; }
  data_dir=${data_dir}/long${long_total} exp_dir=${exp_dir}/long${long_total}
  test_split=test-synth-long n_long=${n_long:-$((long_total / 3))}
  md_long_total=${long_total} md_long_max=${long_max}
  [[ ${po_given} == *" streams "* ]] || streams=md_long
  [[ ${po_given} == *" methods "* ]] || methods=$("${python}" -c "import sys
from tta_brain import hparams
tokens = [t for ln in open(sys.argv[1]) for t in ln.partition('#')[0].split()]
print(' '.join(t for t in tokens if t.partition('+')[0] in hparams.available()))" \
    "${conf_dir}/long.methods")
fi
# K of the dynamic reset and the fixed-reset period follow the block size: K = half a block
# (the construction stage ends inside the first block), the fixed period a quarter of it.
# At least their smallest values valid for every method: K 10 (DSUTA's phi_D is saved after K/2
# utterances, at least one meta-update of buffer_size 5 later: K >= 2 x 5), period 1; so blocks
# under 20 utterances get K 10. Given --md_recipe_opts or --md_decode_opts replace them.
if [ -z "${md_decode_opts}" ] && [ -z "${md_recipe_opts}" ]; then
  md_recipe_opts="--reset_K=$(( per_domain / 2 > 10 ? per_domain / 2 : 10 ))"
  md_recipe_opts+=" --reset_every=$(( per_domain / 4 > 1 ? per_domain / 4 : 1 ))"
fi
grid_streams "${data_dir}" "${snrs}" "${streams}"   # (decode_snr_streams' own)
check_decode 4 "${md_streams}" "${stream_args[@]}"

corpus=${data_dir}/corpus
noise_dir=${data_dir}/noises
test_csv=${data_dir}/test_synth.csv
noisy_dir=${data_dir}/noisy
domains=$("${python}" -c "import yaml,sys; print(' '.join(yaml.safe_load(open(sys.argv[1]))))" "${noise_table}")

if [ ${stage} -le 0 ] && [ ${stop_stage} -ge 0 ]; then
  train_n=0
  if ${retrain}; then train_n=${n_train}; fi
  if ${long}; then
    log "Stage 0: long-stream speech (${n_long} test) -> ${corpus}; noises -> ${noise_dir}"
    run "${python}" -m tta_brain.data.prep.synthetic long_test --root "${corpus}" \
      --n_test "${n_long}" --seed "${corpus_seed}" --n_train_ref "${n_train}" --n_test_ref "${n_test}"
  else
    log "Stage 0: speech (${n_test} test, ${train_n} train) -> ${corpus}; noises -> ${noise_dir}"
    run "${python}" -m tta_brain.data.prep.synthetic corpus --root "${corpus}" --n_train "${train_n}" \
      --n_test "${n_test}" --seed "${corpus_seed}"
  fi
  run "${python}" -m tta_brain.data.prep.synthetic noises --noise_dir "${noise_dir}" --seed "${noise_seed}"
fi

if [ ${stage} -le 1 ] && [ ${stop_stage} -ge 1 ]; then
  if ${retrain}; then
    log "Stage 1: train the source model (${train_minutes} min budget) -> ${model}"
    run "${python}" "${recipe_dir}/train_source.py" --data_root "${corpus}" --output_dir "${model}" \
      --seed "${train_seed}" --max_minutes "${train_minutes}"
  elif [ -f "${model}/config.json" ]; then
    log "Stage 1: using the source model in ${model} (--retrain true to train it anew)"
  else
    echo "ERROR: no source model in ${model}; run with --retrain true or pass --model DIR" >&2
    exit 1
  fi
fi

if [ ${stage} -le 2 ] && [ ${stop_stage} -ge 2 ]; then
  log "Stage 2: noisy sets [${domains}] at [${snrs}] dB -> ${noisy_dir}"
  if ! ${dry_run} && [ ! -d "${corpus}/LibriSpeech/${test_split}" ]; then   # (the reader's
    echo "ERROR: no rendered corpus ${corpus}/LibriSpeech/${test_split}: run stage 0 first" \
      "(--stage 0)" >&2                                       # hint is LibriSpeech's download)
    exit 1
  fi
  run "${python}" -m tta_brain.data.prep.prepare librispeech --root "${corpus}" --split "${test_split}" \
    --out "${test_csv}"
  # shellcheck disable=SC2086
  run "${python}" -m tta_brain.data.prep.prepare corrupt --manifest "${test_csv}" --out "${noisy_dir}" \
    --noise_dir "${noise_dir}" --domain_table "${noise_table}" --snrs ${snrs} \
    --domains ${domains} --seed "${noise_seed}" --data_root "${data_dir}"
fi

if [ ${stage} -le 3 ] && [ ${stop_stage} -ge 3 ]; then
  set_stream_write_opts
  # A size option goes to prepare when some stream takes it (md_easy/md_hard and their
  # variants: per_domain; md_long: the md_long ones) or when it was given: prepare warns about
  # a size that no stream takes, which is for the user's options, not this recipe's defaults.
  takes_blocks=false takes_long=false
  for spec in ${streams}; do
    case "${spec#*=}" in md_easy*|md_hard*) takes_blocks=true ;; md_long) takes_long=true ;; esac
  done
  size_opts=()
  for pair in per_domain:per_domain md_long_total:total md_long_min:min_len md_long_max:max_len; do
    var=${pair%%:*}
    if { [ "${var}" = per_domain ] && ${takes_blocks}; } \
        || { [ "${var}" != per_domain ] && ${takes_long}; } || [[ ${po_given} == *" ${var} "* ]]; then
      size_opts+=("--${pair#*:}" "${!var}")
    fi
  done
  failed=0              # every SNR is tried, so one rerun sees all the refusals
  for snr in ${snrs}; do
    log "Stage 3: streams [${streams}] at ${snr} dB -> ${data_dir}/snr${snr}/streams"
    # shellcheck disable=SC2086
    run "${python}" -m tta_brain.data.prep.prepare streams --manifest_dir "${noisy_dir}/manifests" \
      --snr "${snr}" --out "${data_dir}/snr${snr}" --names ${streams} --seed "${stream_seed}" \
      ${size_opts[@]+"${size_opts[@]}"} --md_easy_order ${md_easy_order} \
      --md_hard_order ${md_hard_order} "${stream_write_opts[@]}" || failed=$?
  done
  [ "${failed}" -eq 0 ] || exit "${failed}"
fi

if [ ${stage} -le 4 ] && [ ${stop_stage} -ge 4 ] && [ -n "$(stats_kinds)" ]; then
  # eata's source statistics from clean speech in no stream: without --stats_csv, ${stats_utts}
  # utterances rendered with other sentences and speaker draws (corpus seed + 1000), no noise
  if [ -z "${stats_csv}" ]; then
    stats_csv=${data_dir}/stats_synth.csv
    run "${python}" -m tta_brain.data.prep.synthetic corpus --root "${data_dir}/stats_corpus" \
      --n_train 0 --n_test "${stats_utts}" --n_test_speakers 10 --seed $((corpus_seed + 1000))
    run "${python}" -m tta_brain.data.prep.prepare librispeech --root "${data_dir}/stats_corpus" \
      --split test-synth --out "${stats_csv}"
  fi
  source_stats_stage 4 "${stats_csv}" "${data_dir}" "${data_dir}"  # conf/<method>.opts
fi

if [ ${stage} -le 4 ] && [ ${stop_stage} -ge 4 ]; then
  decode_snr_streams 4 "${data_dir}"
fi

if [ ${stage} -le 5 ] && [ ${stop_stage} -ge 5 ]; then
  for snr in ${snrs}; do
    log "Stage 5: report -> ${exp_dir}/snr${snr}/RESULTS.md"
    # smoothing and reset-detection window: half a domain block (= the dynamic reset's K)
    run "${python}" -m tta_brain.report --exp_dir "${exp_dir}/snr${snr}" \
      --out "${exp_dir}/snr${snr}/RESULTS.md" --window $((per_domain / 2)) --smooth $((per_domain / 2))
    if ${long}; then   # collapse figures, memory and the WER-over-position plot
      run "${python}" -m tta_brain.report.long --exp_dir "${exp_dir}/snr${snr}" --stream md_long \
        --window "${long_window}" --margin 5
    fi
  done
fi

log "Finished (stages ${stage}-${stop_stage})."
