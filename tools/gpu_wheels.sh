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
# On the GPU machine:  rm -rf .site; pip install --no-index --no-deps --target .site .whl/*.whl
set -euo pipefail

dest=${1:-.whl}
pyver=${PYVER:-3.12}
case "${1:-}" in -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac

# the project's run-time imports beyond torch/torchaudio/numpy, the test runner (pytest 9 and
# what it imports), and requests
# (huggingface_hub 0.x needs it; the machine's 1.x does not, so it may be missing there)
packages=(speechbrain hyperpyyaml ruamel.yaml ruamel.yaml.clib jiwer rapidfuzz transformers
          tokenizers huggingface_hub soundfile cffi pycparser espeakng-loader submitit
          cloudpickle cma pytest pluggy iniconfig pygments requests urllib3 idna certifi
          charset-normalizer)
mapfile -t pins < <(python - "${packages[@]}" <<'EOF'
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
platform=(--python-version "$pyver" --implementation cp --only-binary=:all:
          --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux_2_28_x86_64)
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
pip download -q --no-deps "${platform[@]}" -d "$dest" "${pins[@]}"
# every pin resolvable from <dest> alone for the target's tags, without touching this Python
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
pip install -q --dry-run --no-index --find-links "$dest" --no-deps "${platform[@]}" \
  --target "$check/site" "${pins[@]}"
echo "gpu_wheels.sh: ${#pins[@]} wheels for CPython $pyver in $dest (pinned to this environment)"
