"""The package works from a non-editable install: the method yamls ship inside it."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # end to end: python -m pytest -m 'not slow' leaves it out

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys, torch
import tta_brain
from tta_brain import hparams
from tta_brain.stream import TTAStream
assert "site" in tta_brain.__file__ or sys.argv[2] in tta_brain.__file__, tta_brain.__file__
print("methods", hparams.available())
tta = TTAStream.from_hparams("dsuta", source=sys.argv[1],
                             overrides={"reset": "dynamic", "steps": 1, "reset_K": 10})
g = torch.Generator().manual_seed(0)
for i in range(3):
    print("hyp", repr(tta.transcribe(0.1 * torch.randn(8000, generator=g))))
print("counts", tta.counts["adapt_forward"])
"""


def test_installed_package_has_its_hparams(tmp_path, tiny_model_dir):
    target = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps",
                          "--no-build-isolation", "--quiet", "--target", str(target), str(REPO)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (target / "tta_brain" / "hparams" / "dsuta.yaml").is_file()
    assert (target / "tta_brain" / "hparams" / "run.yaml").is_file()
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", SCRIPT, tiny_model_dir, str(target)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "'dsuta'" in out and "'suta'" in out and "'run'" not in out
    assert out.count("hyp ") == 3 and "counts 3" in out
