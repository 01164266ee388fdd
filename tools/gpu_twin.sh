#!/usr/bin/env bash
# A CPU twin of the lent GPU machine's Python, to rehearse tools/gpu_session.sh here before device
# minutes are spent: a venv of CPython 3.12 (the image's minor version) holding the versions the
# image holds of what tta-brain touches (the device tool's KINDS.md: torch 2.11 + CUDA 13 build,
# numpy 2.5.2, transformers 5.17 / huggingface_hub 1.33 / tokenizers 0.23.2, which our wheels must
# shadow, and the image's other packages that our imports reach), none of ours.
#
#   bash tools/gpu_twin.sh [venv]        (default /tmp/gpu_twin; PYTHON312: the interpreter)
#   PATH=<venv>/bin:$PATH bash tools/gpu_session.sh --cpu_smoke --budget_s 900 --tests_s 0
#
# The second line installs .whl into .site with the twin's python3 and runs every check section
# on CPU (--cpu_smoke), the official side by side included when .official is there. Needs a
# package index (about 5 GB: the CUDA build of torch, as on the image) and a Python 3.12: pyenv's,
# or name one in PYTHON312.
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;; esac
venv=${1:-/tmp/gpu_twin}
py=""
for cand in ${PYTHON312:-} "$(command -v python3.12 || true)" \
            "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python; do
  if [[ -n $cand && -x $cand ]] && "$cand" -c \
      'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    py=$cand
    break
  fi
done
if [[ -z $py || ( -n ${PYTHON312:-} && $py != "$PYTHON312" ) ]]; then
  echo "gpu_twin.sh: no Python 3.12 found${PYTHON312:+ at $PYTHON312}: set PYTHON312 to one" >&2
  exit 2
fi
"$py" -m venv "$venv"
# the image's versions (KINDS.md, 2026-11); unpinned: packages whose version the image does not
# list and our code does not care about
"$venv/bin/python" -m pip install -q torch==2.11.0 torchaudio==2.11.0 numpy==2.5.2 \
  transformers==5.17.0 huggingface_hub==1.33.0 tokenizers==0.23.2 safetensors==0.8.0 \
  sentencepiece==0.2.2 pytest pyyaml regex tqdm scipy requests cloudpickle packaging filelock \
  joblib click matplotlib pandas typing-extensions psutil
"$venv/bin/python" - <<'EOF'
import sys, numpy, torch, transformers
print(f"gpu_twin.sh: python {sys.version.split()[0]}, torch {torch.__version__}, numpy "
      f"{numpy.__version__}, transformers {transformers.__version__} (the image's, to be shadowed)")
EOF
