"""The package works from a non-editable install: the method yamls ship inside it; the Python it
says it needs is one its pinned packages install on."""
import ast
import os
import re
import subprocess
import sys
from importlib.metadata import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

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


def test_python_floor_is_one_every_pinned_requirement_installs_on():
    """setup.py's ``python_requires`` floor (and the README's) satisfies the Requires-Python of
    every pinned requirement (torch 2.11 needs 3.10: a floor of 3.9 promised an install that pip
    cannot make). A range requirement does not bind it: pip takes an older release there."""
    tree = ast.parse((REPO / "setup.py").read_text())
    values = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name)}
    requirements = [Requirement(r) for r in ast.literal_eval(values["INSTALL_REQUIRES"])]
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "id", "") == "setup")
    floor = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "python_requires"))
    assert floor.startswith(">="), floor
    floor = Version(floor[2:])
    pinned = [r for r in requirements if [s.operator for s in r.specifier] == ["=="]]
    assert {"torch", "torchaudio", "transformers"} <= {r.name for r in pinned}
    needs = {r.name: metadata(r.name).get("Requires-Python") for r in pinned}
    too_low = {n: rp for n, rp in needs.items() if rp and floor not in SpecifierSet(rp)}
    assert not too_low, f"python_requires >={floor}, but these need more: {too_low}"
    assert needs["torch"], "torch states its Requires-Python"
    readme = (REPO / "README.md").read_text()
    assert re.search(rf"^Python {re.escape(str(floor))}\b", readme, re.M), "README's Python line"
