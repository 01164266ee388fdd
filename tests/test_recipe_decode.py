"""LS-C and CHiME-3 recipes end to end (stages 0-4) on fake corpora with a tiny real HF model:
real decoding, reset records, reports - no dry run."""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import save_ctc_model
from fake_corpora import make_chime3, make_librispeech, make_ms_snsd
from tta_brain.data.manifest import read_manifest

pytestmark = pytest.mark.slow   # end to end: python -m pytest -m 'not slow' leaves it out

REPO = Path(__file__).resolve().parents[1]
COMMON = "--noprogressbar --ckpt_every=0"     # keys every method yaml has


def fast_conf(tmp_path):
    """Per-method overrides (conf/<method>.opts): method-specific keys go there."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "dsuta.opts").write_text("# tiny run\n--steps=1\n--buffer_size=2\n--reset_K=4\n"
                                     "--reset_every=6\n")
    (conf / "dsuta_md.opts").write_text("--steps=2\n")   # multi-domain streams only
    (conf / "suta.opts").write_text("--steps=1\n")
    return conf


def run(script, *args, env=None):
    base = {k: v for k, v in os.environ.items() if k not in ("LIBRISPEECH", "MS_SNSD", "CHIME3")}
    base.update(env or {})
    res = subprocess.run(["bash", str(script), *map(str, args)], env=base, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def test_lsc_recipe_stages_0_to_4(tmp_path):
    make_librispeech(tmp_path / "corpus", speakers=(11, 12, 13), chapters=(100,), utts=4)
    make_ms_snsd(tmp_path / "MS-SNSD")
    model = save_ctc_model(str(tmp_path / "model"))
    env = {"LIBRISPEECH": str(tmp_path / "corpus"), "MS_SNSD": str(tmp_path / "MS-SNSD")}
    data, exp = tmp_path / "data", tmp_path / "exp"
    methods = "source dsuta dsuta+oracle dsuta+fixed dsuta+dynamic"
    lsc = REPO / "recipes/librispeech_c/run.sh"
    opts = ["--data_dir", data, "--exp_dir", exp, "--model", model, "--seeds", "0",
            "--decode_opts", COMMON, "--conf_dir", fast_conf(tmp_path)]
    run(lsc, *opts, "--stop_stage", 2, "--streams", "GS md_hard", "--per_domain", 5, env=env)
    run(lsc, *opts, "--stage", 3, "--stop_stage", 3, "--streams", "GS", "--methods", "dsuta",
        env=env)
    run(lsc, *opts, "--stage", 3, "--streams", "md_hard", "--methods", methods, env=env)
    stream = read_manifest(data / "snr5/streams/md_hard.csv")
    bounds = [int(r["position"]) for a, r in zip(stream, stream[1:]) if a["segment"] != r["segment"]]
    assert bounds == [5, 10, 15, 20]
    for token in methods.split():
        summ = json.loads((exp / f"snr5/md_hard/{token}/seed0/summary.json").read_text())
        assert summ["method"] == token and summ["n_utts"] == 25 and summ["boundaries"] == bounds
        assert 0 <= summ["wer"]
        rows = read_manifest(exp / f"snr5/md_hard/{token}/seed0/transcripts.csv")
        assert [r["ID"] for r in rows] == [r["ID"] for r in stream]  # same stream, same order
    oracle = json.loads((exp / "snr5/md_hard/dsuta+oracle/seed0/summary.json").read_text())
    assert oracle["resets"] == bounds
    fixed = json.loads((exp / "snr5/md_hard/dsuta+fixed/seed0/summary.json").read_text())
    assert fixed["resets"] == [6, 12, 18, 24]           # every 6, checked at multiples of M=2
    # conf/dsuta.opts applies to every dsuta token; conf/dsuta_md.opts to multi-domain streams
    # only, after it
    def hp(stream, token, key):
        text = (exp / f"snr5/{stream}/{token}/seed0/hyperparams.yaml").read_text()
        return re.search(rf"^{key}: (\S+)", text, re.M).group(1)
    assert hp("GS", "dsuta", "steps") == "1" and hp("GS", "dsuta", "buffer_size") == "2"
    assert hp("md_hard", "dsuta", "steps") == "2" and hp("md_hard", "dsuta", "buffer_size") == "2"
    assert hp("md_hard", "dsuta+dynamic", "steps") == "2"
    assert hp("md_hard", "dsuta+dynamic", "reset") == "dynamic"
    dyn = exp / "snr5/md_hard/dsuta+dynamic/seed0"
    assert len(read_manifest(dyn / "lii.csv")) > 0
    results = (exp / "snr5/RESULTS.md").read_text()
    for token in methods.split():
        assert f"|{token}|" in results.replace(" ", "")


def test_chime3_recipe_stage3_decodes_and_reports(tmp_path):
    make_chime3(tmp_path / "CHiME3", per_split=2)
    model = save_ctc_model(str(tmp_path / "model"))
    env = {"CHIME3": str(tmp_path / "CHiME3")}
    data, exp = tmp_path / "data", tmp_path / "exp"
    run(REPO / "recipes/chime3/run.sh", "--stop_stage", 2, "--data_dir", data, env=env)
    run(REPO / "recipes/chime3/run.sh", "--stage", 3, "--data_dir", data, "--exp_dir", exp,
        "--model", model, "--methods", "source suta", "--seeds", "0",
        "--decode_opts", COMMON, "--conf_dir", fast_conf(tmp_path), env=env)
    for m in ("source", "suta"):
        summ = json.loads((exp / f"chime3/{m}/seed0/summary.json").read_text())
        assert summ["n_utts"] == 14 and len(summ["wer_per_domain"]) == 7
    assert (exp / "RESULTS.md").exists()
