#!/usr/bin/env bash
# One call on a lent GPU machine, run in the repository root: the carried wheels into a fresh
# .site, the machine described and every module the check imports imported (a missing one stops it
# in one line), tools/gpu_check.py within a budget, then the CUDA-only tests (tests/test_gpu.py,
# tests/test_sweep.py -k cuda). Every log goes under $OUT (default gpu_session_out); the summary
# goes to stdout; the exit status is 0 only if both passed.
#
#   bash tools/gpu_session.sh [--budget_s S] [--tests_s T] [--tests_k EXPR] [--smoke]
#                             [gpu_check options ...]
#
# Here first: bash tools/gpu_wheels.sh, and for the check's side by side with the official code
# its src/, config/ and vocab.json in .official/Dynamic-SUTA (e.g. `git archive HEAD src config
# vocab.json` of a fetched hhhaaahhhaa/Dynamic-SUTA); the call carries ".whl" and ".official"
# (both ignored by git). The defaults (check 480 s: every default section, about 464 s by the
# check's COST, the H200's seconds of 2026-11-27 and estimates; tests 100 s, 59-63 s there; about
# 9 minutes with the install) leave a session's 15
# device minutes, after the machine's start (about 40 s there), room to rerun a section or two
# (e.g. --sections memory --budget_s 100 --tests_s 0: no tests; --tests_k cotta: only the CUDA
# tests whose names match it too). --smoke: on this machine's
# CPU (the check's --cpu_smoke on its first section, the CUDA tests collected, not run; no .site).
# tools/gpu_twin.sh: a CPU twin of the image's Python to rehearse the whole call.
set -uo pipefail

budget=480 tests_s=100 smoke=0 tests_k="cuda and not gpu_session" check_opts=()
while (($#)); do
  case "$1" in
    --budget_s) budget=$2; shift 2 ;;
    --tests_s) tests_s=$2; shift 2 ;;
    --tests_k) tests_k="cuda and ($2) and not gpu_session"; shift 2 ;;
    --smoke) smoke=1; shift ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) check_opts+=("$1"); shift ;;
  esac
done
out=${OUT:-gpu_session_out}
mkdir -p "$out"
log() { echo "gpu_session: $*"; }
start=$(date +%s)

if ((smoke)); then
  py=(python)
else
  if ! compgen -G ".whl/*.whl" > /dev/null; then
    log "no wheels in .whl: run 'bash tools/gpu_wheels.sh' on the development machine and carry" \
        "\".whl\" with the call" >&2
    exit 3
  fi
  rm -rf .site                          # an install over an earlier one lost modules once
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target .site .whl/*.whl > "$out/install.log" 2>&1; then
    log "installing .whl failed (see $out/install.log):" >&2
    tail -3 "$out/install.log" >&2
    exit 3
  fi
  export PYTHONPATH=".site:.${PYTHONPATH:+:$PYTHONPATH}"
  py=(python3)                          # the image's interpreter (its venv's python3)
fi

{
  date -u
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1 || true
} > "$out/machine.txt"
# every module a section or test imports, lazily imported ones too (cma, submitit): a module the
# image lacks stops here in one line, not minutes later inside a section
if ! "${py[@]}" - >> "$out/machine.txt" 2>&1 <<'EOF'
import sys
try:
    import torch, numpy, transformers, speechbrain, cma, jiwer, soundfile, submitit
    import tta_brain.decode, tta_brain.sweep, tta_brain.grid, tta_brain.methods.batched
except ImportError as e:
    sys.exit(f"import failed: {e}")
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| numpy", numpy.__version__, "| transformers", transformers.__version__,
      "| speechbrain", speechbrain.__version__)
EOF
then
  log "$(tail -n 1 "$out/machine.txt") (carry its wheel: tools/gpu_wheels.sh's packages;" \
      "machine: $out/machine.txt)" >&2
  exit 3
fi
cat "$out/machine.txt"

check=(tools/gpu_check.py --out "$out/check" --budget_s "$budget")
((smoke)) && check+=(--cpu_smoke --sections transcripts)   # (test_gpu runs every section)
log "check: ${check[*]} ${check_opts[*]}"
timeout $((${budget%.*} + 120)) "${py[@]}" "${check[@]}" "${check_opts[@]}" \
  > "$out/check.log" 2>&1
check_rc=$?
tail -n 60 "$out/check.log"

# -rA: the passed tests' output too, where the tests comparing to rounding print their figures
tests=(-m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_sweep.py -rA --durations=5
       -k "$tests_k")    # not this script's own CPU smoke test (40 s)
((smoke)) && tests+=(--collect-only)
if [[ $tests_s == 0 ]]; then         # a rerun of check sections alone (timeout 0: no limit)
  log "tests: not run (--tests_s 0)"
  tests_rc=0
else
  log "tests: ${tests[*]}"
  timeout "$tests_s" "${py[@]}" "${tests[@]}" > "$out/tests.log" 2>&1
  tests_rc=$?
  grep -h "on CUDA:\|on buckets:" "$out/tests.log"   # the rounding figures (relative changes)
  grep -v "^PASSED" "$out/tests.log" | tail -n 15
fi

log "check exit $check_rc, tests exit $tests_rc (124: over its time), $(($(date +%s) - start)) s;" \
    "logs in $out"
((check_rc == 0 && tests_rc == 0))
