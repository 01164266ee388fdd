#!/usr/bin/env bash
# Wheels for a lent GPU machine (tools/gpu_check.py): Python 3.12, torch 2.11 + CUDA and numpy
# there, no network, and its own transformers 5.x / huggingface_hub 1.x, which ours must shadow.
# Downloads, into <dest> (default .whl), the wheels of what tta-brain imports beyond torch, each
# pinned to the version installed HERE (so the set is the one the tests passed with; unpinned,
# pip takes the newest, e.g. a huggingface_hub that transformers 4.57 refuses at import), built
# for the GPU machine's Python, not this one's. Then checks that pip would install them there.
#
#   bash tools/gpu_wheels.sh [dest]          (PYVER=3.12 by default)
#
# On the GPU machine: bash tools/gpu_session.sh (it installs them into a fresh .site)
set -euo pipefail

dest=${1:-.whl}
pyver=${PYVER:-3.12}
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;; esac

# what tta-brain imports beyond what the GPU image holds (its package list: the device tool's
# KINDS.md; it has torch, torchaudio, numpy, scipy, pytest, requests, pyyaml, regex, safetensors,
# sentencepiece, tqdm, click, cloudpickle), plus what must shadow the image's own versions
# (transformers 5.x, huggingface_hub 1.x, tokenizers 0.23.2: transformers 4.57 refuses the last
# two). One version of each: the image's is left alone where ours is not needed. Not carried:
# espeakng-loader (10 MB; only the synthetic corpus's text-to-speech imports it).
packages=(speechbrain hyperpyyaml ruamel.yaml ruamel.yaml.clib jiwer rapidfuzz transformers
          tokenizers huggingface_hub soundfile cffi pycparser submitit cma)
listed=$(python - "${packages[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        sys.exit(f"gpu_wheels.sh: {name} is not installed here: install the project first "
                 f"(README: Setup)")
EOF
)
mapfile -t pins <<< "$listed"
platform=(--python-version "$pyver" --implementation cp --only-binary=:all:
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform manylinux1_x86_64)
if compgen -G "$dest/*.whl" > /dev/null; then      # the GPU machine installs every wheel there
  echo "gpu_wheels.sh: $dest already holds wheels: remove them first (or name another folder)" >&2
  exit 2
fi
mkdir -p "$dest"
# inside a checkout: ignored there (.git/info/exclude, this clone only), so no commit takes them;
# the device tool then carries them only where its call names the folder in `carry`
if top=$(git -C "$dest" rev-parse --show-toplevel 2>/dev/null) \
    && ! git -C "$top" check-ignore -q "$(realpath "$dest")"; then
  rel=$(realpath --relative-to="$top" "$dest")
  exclude=$(cd "$top" && realpath -m "$(git rev-parse --git-path info/exclude)")
  mkdir -p "$(dirname "$exclude")"
  echo "/$rel/" >> "$exclude"
  echo "gpu_wheels.sh: /$rel/ added to $top's .git/info/exclude (carry it: \"$rel\")"
fi
python -m pip download -q --no-deps "${platform[@]}" -d "$dest" "${pins[@]}"
# every pin resolvable from <dest> alone for the target's tags, without touching this Python
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
python -m pip install -q --dry-run --no-index --find-links "$dest" --no-deps "${platform[@]}" \
  --target "$check/site" "${pins[@]}"
echo "gpu_wheels.sh: ${#pins[@]} wheels for CPython $pyver in $dest (pinned to this environment)"
