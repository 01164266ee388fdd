"""Recipe regression test: the synthetic benchmark, end to end, on a reduced configuration.

Runs ``recipes/synthetic/run.sh`` stages 0-5 with the recipe's defaults on one stream (test
speech, noises, noisy sets at 20 dB, the MD-Hard-like stream of 5 x 80 utterances, source / SUTA /
DSUTA + dynamic reset with the committed source model, two decodes at a time, report) and asserts
the paper's orderings with margins measured over seeds 0-2 by ``recipes/synthetic/regression.py``
(4 to 8 minutes on 2 idle CPU cores: recipes/synthetic/README.md); then, on the same data, the
collapse regression of long streams (issue #21): DSUTA without a reset collapses at a raised
learning rate and the dynamic reset brings it back (``regression.STRESS``). The fast tests at
the end check the margins and boundary matching of ``regression.py`` and train
``recipes/synthetic/train_source.py`` for an epoch or two on a tiny fake corpus.
"""

import importlib.util
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

slow = pytest.mark.slow   # end to end: python -m pytest -m 'not slow' leaves them out

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("synthetic_regression",
                                              REPO / "recipes" / "synthetic" / "regression.py")
regression = importlib.util.module_from_spec(spec)
spec.loader.exec_module(regression)
spec = importlib.util.spec_from_file_location("synthetic_train_source",
                                              REPO / "recipes" / "synthetic" / "train_source.py")
train_source = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_source)
SEED = 0


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    work = tmp_path_factory.mktemp("synthetic_recipe")
    exp_dir = regression.run_recipe(work, SEED)
    res = regression.collect(exp_dir)
    res["clean"] = regression.clean_wer(work / f"data_seed{SEED}")
    return {"work": work, "exp": exp_dir, "data": work / f"data_seed{SEED}", "res": res,
            "margins": regression.margins(res)}


@slow
def test_report_and_plots_are_written(recipe):
    text = (recipe["exp"] / "RESULTS.md").read_text()
    for label in regression.REDUCED["methods"].split():
        assert re.search(rf"^\|{re.escape(label)}\|", text, re.M), f"no row for {label} in RESULTS.md"
    assert "python" in text.lower() and "torch" in text  # environment block
    pngs = {p.name for p in (recipe["exp"] / "plots").glob("*.png")}
    assert "wer_diff_md_hard.png" in pngs, pngs
    assert any(name.startswith("resets") for name in pngs), pngs
    for png in (recipe["exp"] / "plots").glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


@slow
def test_noisy_stream_is_hard_for_the_source_model(recipe):
    res = recipe["res"]
    assert recipe["margins"]["noisy_minus_clean"] > regression.MARGINS["noisy_minus_clean"], res
    assert 15.0 < res["clean"] < 35.0, res  # the committed model: 25.1 % on clean test speech


@slow
def test_suta_beats_the_source_model(recipe):
    assert recipe["margins"]["source_minus_suta"] > regression.MARGINS["source_minus_suta"], recipe["res"]


@slow
def test_dsuta_beats_suta(recipe):
    assert recipe["margins"]["suta_minus_dsuta"] > regression.MARGINS["suta_minus_dsuta"], recipe["res"]


@slow
def test_dynamic_reset_detects_most_boundaries(recipe):
    res = recipe["res"]
    assert res["boundaries"] == [80, 160, 240, 320]
    assert res["detected_fraction"] >= regression.MARGINS["detected_fraction"], res
    assert min(res["resets"]) >= 80, res  # no reset inside the first domain block
    # the run's resets are its row of the RESULTS.md reset table, beside the true boundaries
    # (a number anywhere in the file, a WER's digits or a boundary, passed for any reset)
    text = (recipe["exp"] / "RESULTS.md").read_text()
    table = text.split("## Reset steps", 1)[1].split("\n## ", 1)[0]
    assert "True boundaries (first position of a new segment): 80, 160, 240, 320;" in table
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in table.splitlines() if line.startswith("|dsuta+dynamic|")]
    assert [r[:4] for r in rows] == [["dsuta+dynamic", str(SEED),
                                      ", ".join(map(str, res["resets"])), str(len(res["resets"]))]]
    assert rows[0][4] == f"{len(res['detected'])}/4", rows


@slow
def test_readme_api_example_runs_on_the_recipe_data(recipe):
    """The README's TTAStream example, as written, with the data folder of this run."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Python API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "TTAStream.from_hparams" in code
    code = code.replace("recipes/synthetic/data", str(recipe["data"]))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 101, lines[-3:]
    assert lines[0].startswith("9") and len(lines[0].split()) >= 2  # "<utt id> <transcript>"
    assert lines[-1].startswith("resets at [") and "adapt_forward" in lines[-1]
    # its settings are the recipe's DSUTA + dynamic reset on md_hard (conf/dsuta*.opts, K 40):
    # the API in a loop gives the recipe's decode's transcripts, utterance for utterance
    from tta_brain.run.records import read_transcripts
    decoded = read_transcripts(recipe["exp"] / "md_hard" / "dsuta+dynamic" / "seed0")[:100]
    assert lines[:-1] == [f"{t.ID} {t.hyp}" for t in decoded]


@slow
def test_dsuta_collapses_without_reset_and_the_dynamic_reset_recovers(recipe):
    """Stages 3-4 on this recipe run's data: an md_long of 300 utterances, source / DSUTA / DSUTA
    + dynamic reset at lr 2e-3 (regression.STRESS; margins measured over seeds 0-2)."""
    fig = regression.stress_figures(regression.run_stress(recipe["work"], SEED))
    margins = regression.stress_margins(fig)
    assert fig[regression.DSUTA]["first_above"] is not None, fig    # above the source + 5 somewhere
    assert fig[regression.DYNAMIC]["resets"], fig
    for key, least in regression.STRESS_MARGINS.items():
        assert margins[key] > least, (key, margins, fig)


# ------------------------------------------------------------------- fast: regression.py's figures
def test_margins_are_the_differences_the_tests_assert_in_their_direction():
    res = {"clean": 20.0, "source": 61.0, "suta": 50.0, "dsuta+dynamic": 46.5,
           "detected_fraction": 0.75}
    assert regression.margins(res) == {"noisy_minus_clean": 41.0, "source_minus_suta": 11.0,
                                       "suta_minus_dsuta": 3.5, "detected_fraction": 0.75}
    assert (regression.DSUTA, regression.DYNAMIC) == ("dsuta_lr2e-3", "dsuta+dynamic_lr2e-3")
    fig = {"source": {"wer": 60.0}, regression.DSUTA: {"wer": 75.0},
           regression.DYNAMIC: {"wer": 58.0}}
    assert regression.stress_margins(fig) == {"dsuta_minus_source": 15.0,
                                              "dsuta_minus_dynamic": 17.0,
                                              "source_minus_dynamic": 2.0}


def _write_run(folder, method, wer, resets=(), boundaries=()):
    from dataclasses import asdict
    from tta_brain.run.summary import Summary, write_summary
    folder.mkdir(parents=True)
    write_summary(folder, Summary(
        method=method, stream="md_hard", seed=0, wer=wer, wer_per_domain={}, n_utts=400,
        n_words=4000, n_err=int(wer * 40), n_skipped=0, skipped=[], resets=list(resets),
        boundaries=list(boundaries), counts={}, wall_time_s=1.0, audio_s=1.0,
        time_per_audio_s=1.0, num_adapted_params=0, hparams={}, device="cpu", versions={}))


def test_collect_matches_each_boundary_once_within_the_detect_window(tmp_path):
    """A reset DETECT_WINDOW (40) utterances after a boundary detects it, one at 41 does not; two
    resets after one boundary detect it once; the fraction is of the true boundaries."""
    assert regression.DETECT_WINDOW == 40
    stream = tmp_path / "md_hard"
    _write_run(stream / "source" / "seed0", "source", 60.0)
    _write_run(stream / "suta" / "seed0", "suta", 50.0)
    # 80 + 40: detected; 160 + 41: missed; 240 + 1 and + 5: one detection; 320 + 41: missed;
    # 50: before the first boundary
    _write_run(stream / "dsuta+dynamic" / "seed0", "dsuta+dynamic", 45.0,
               resets=[245, 120, 201, 50, 241, 361], boundaries=[80, 160, 240, 320])
    res = regression.collect(tmp_path)
    assert {m: res[m] for m in ("source", "suta", "dsuta+dynamic")} == {
        "source": 60.0, "suta": 50.0, "dsuta+dynamic": 45.0}
    assert res["resets"] == [245, 120, 201, 50, 241, 361] and res["boundaries"] == [80, 160, 240, 320]
    assert res["detected"] == [80, 240]
    assert res["detected_fraction"] == 0.5
    (stream / "suta" / "seed0" / "summary.json").unlink()
    with pytest.raises(FileNotFoundError, match="no run of suta under"):
        regression.collect(tmp_path)


# ------------------------------------------------------------------- fast: train_source.py
def test_make_batches_keeps_every_utterance_once_under_the_padded_size():
    lengths = [16000 * s for s in (1, 5, 2, 2, 9, 3, 1, 4, 7, 2, 6, 3)]
    batches = train_source.make_batches(lengths, 10.0, random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:   # padded to the longest: at most batch_seconds (one long one alone)
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 10 * 16000, batches
    assert len(batches) == 6      # [1 1 2 2] [2 3 3] [4] [5] [6 7] [9]: buckets of like lengths
    assert batches == train_source.make_batches(lengths, 10.0, random.Random(0))
    orders = {tuple(map(tuple, train_source.make_batches(lengths, 10.0, random.Random(s))))
              for s in range(5)}
    assert len(orders) > 1        # the order of the buckets is the rng's


def test_the_encoder_and_processor_use_wav2vec2_base_960h_vocabulary():
    from tta_brain.lobes.hf_ctc import W2V2_CHAR_VOCAB
    encode = train_source.make_encoder()
    vocab = train_source.VOCAB
    assert encode("Hotel it's") == [vocab[c] for c in "HOTEL|IT'S"]
    assert encode("A?") == [vocab["A"], vocab["<unk>"]]
    processor = train_source.build_processor()
    assert processor.tokenizer.get_vocab() == {t: i for i, t in enumerate(W2V2_CHAR_VOCAB)}
    assert processor.tokenizer.pad_token_id == 0     # the CTC blank of the training loss
    assert processor.decode(encode("HOTEL IT'S")) == "HOTEL IT'S"
    assert processor.feature_extractor.sampling_rate == 16000



def test_collate_pads_at_the_end_and_error_rates_are_wer_then_cer_of_the_hypotheses():
    import torch
    data = [("a", torch.linspace(-1, 1, 8000), "HOTEL ALPHA"),   # (as load_audio returns them)
            ("b", torch.cos(torch.arange(12000.0)), "GOLF")]
    x, lens, labels = train_source.collate(data, [0, 1], train_source.make_encoder())
    assert x.shape == (2, 12000) and lens.tolist() == [8000, 12000]
    assert torch.equal(x[0, 8000:], torch.zeros(4000))     # zero padding after the speech
    assert abs(float(x[0, :8000].mean())) < 1e-5                 # normalised as the extractor
    assert float(x[0, :8000].std()) == pytest.approx(1, abs=1e-3)
    assert [l.tolist() for l in labels] == [train_source.make_encoder()(t) for _, _, t in data]
    # 1 of 3 reference words deleted (the other way round: 1 insertion in 2 words, 50 %)
    wer, cer = train_source.error_rates(["ALPHA BRAVO GOLF"], ["ALPHA BRAVO"])
    assert wer == pytest.approx(100 / 3) and cer == pytest.approx(100 * 5 / 16)

@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    """A LibriSpeech-layout corpus: train-synth of 6 utterances (speakers 11, 12), test-synth of
    3 utterances of another speaker (held out)."""
    from fake_corpora import make_librispeech
    root = tmp_path_factory.mktemp("tiny_synth")
    make_librispeech(root, "train-synth", speakers=(11, 12), utts=3, durations=(1.5, 2.5))
    make_librispeech(root, "test-synth", speakers=(21,), utts=3, durations=(1.5, 2.5), seed=1)
    return root


def _train(corpus, out, *args, **train):
    """train_source.main on ``corpus`` with a tiny model (dropout and time masks on: the torch
    rng matters) and ``train`` over the settings; returns its training_info.json."""
    import yaml
    from tta_brain.lobes.testing import TINY
    model = {k: list(v) if isinstance(v, tuple) else v for k, v in TINY.items()}
    model.update(hidden_dropout=0.1, mask_time_prob=0.2, mask_time_length=2)
    cfg = {"model": model,
           "train": dict(dict(epochs=1, batch_seconds=5.0, lr=1e-2, weight_decay=0.01,
                              betas=[0.9, 0.98], warmup_steps=1000, final_lr_ratio=0.1,
                              max_grad_norm=5.0, dev_utts=100, num_threads=1), **train)}
    conf = Path(str(out) + ".yaml")
    conf.write_text(yaml.safe_dump(cfg))
    train_source.main(["--data_root", str(corpus), "--output_dir", str(out), "--config", str(conf),
                       "--noprogressbar", *map(str, args)])
    return json.loads((Path(out) / "training_info.json").read_text())


def _weights(model_dir):
    from safetensors.torch import load_file
    return load_file(str(Path(model_dir) / "model.safetensors"))


def test_train_source_exports_a_model_that_loads_like_wav2vec2_base_960h(tiny_corpus, tmp_path):
    from transformers import AutoModelForCTC, AutoProcessor
    info = _train(tiny_corpus, tmp_path / "model", "--seed", 3, "--epochs", 2, dev_utts=2)
    processor = AutoProcessor.from_pretrained(tmp_path / "model")
    model = AutoModelForCTC.from_pretrained(tmp_path / "model").eval()
    assert processor.tokenizer.get_vocab() == train_source.VOCAB
    assert (model.config.vocab_size, model.config.pad_token_id) == (32, 0)
    assert (info["seed"], info["epochs"], info["test_split"]) == (3, 2, "test-synth")
    assert (info["train_utts"], info["test_utts"]) == (6, 3)  # the test speaker's are held out
    assert [h["epoch"] for h in info["history"]] == [1, 2]
    # the exported model is the trained one: its CER on the whole test split is the logged one,
    # on its first dev_utts the last epoch's monitoring CER
    base = tiny_corpus / "LibriSpeech"
    test = train_source.load_split_audio(train_source.read_split(str(base / "test-synth")))
    hyps = train_source.transcribe(model, processor, test)      # (one batch, by length)
    assert hyps[::-1] == train_source.transcribe(model, processor, test[::-1])  # each its own
    _, cer = train_source.error_rates([t for _, _, t in test], hyps)
    assert info["clean_test_cer"] == round(cer, 2)
    _, dev_cer = train_source.error_rates([t for _, _, t in test[:2]],
                                          train_source.transcribe(model, processor, test[:2]))
    assert info["history"][-1]["dev_cer"] == pytest.approx(dev_cer) and dev_cer != cer
    train = train_source.load_split_audio(train_source.read_split(str(base / "train-synth")))
    _, train_cer = train_source.error_rates([t for _, _, t in train],
                                            train_source.transcribe(model, processor, train))
    assert round(train_cer, 2) != info["clean_test_cer"]     # (so that the above tells them apart)
    assert not (tmp_path / "model.tmp").exists() and (tmp_path / "model_ckpt" / "last.pt").is_file()


def test_train_source_is_seeded_and_resumes_where_it_stopped(tiny_corpus, tmp_path, monkeypatch):
    """Same seed, same weights; another seed, others (and other batch orders, each epoch its
    own); one epoch then a rerun with --epochs 2 resumes from the checkpoint (model, optimiser,
    schedule, rng) to the weights of 2 epochs at once (the lr is in its warm-up, which does not
    depend on the number of epochs)."""
    import torch
    make_batches, orders = train_source.make_batches, []

    def recorded(lengths, batch_seconds, rng):     # the training batches (5 s), not the decodes'
        batches = make_batches(lengths, batch_seconds, rng)
        if batch_seconds == 5.0:
            orders.append(batches)
        return batches

    monkeypatch.setattr(train_source, "make_batches", recorded)
    _train(tiny_corpus, tmp_path / "a", "--epochs", 2)
    a = _weights(tmp_path / "a")
    _train(tiny_corpus, tmp_path / "b", "--epochs", 2)
    assert all(torch.equal(a[k], v) for k, v in _weights(tmp_path / "b").items())
    _train(tiny_corpus, tmp_path / "c", "--epochs", 2, "--seed", 2)
    assert not all(torch.equal(a[k], v) for k, v in _weights(tmp_path / "c").items())
    # per run: the count of steps per epoch (rng of its own), epoch 1's batches, epoch 2's
    assert len(orders) == 9 and orders[1:3] == orders[4:6] and len(orders[1]) > 2
    assert orders[1] != orders[2] and orders[1:3] != orders[7:9], orders
    info = _train(tiny_corpus, tmp_path / "r", "--epochs", 1)
    assert info["epochs"] == 1
    info = _train(tiny_corpus, tmp_path / "r", "--epochs", 2)
    assert [h["epoch"] for h in info["history"]] == [1, 2] and info["epochs"] == 2
    resumed = _weights(tmp_path / "r")
    assert resumed.keys() == a.keys()
    assert all(torch.equal(a[k], v) for k, v in resumed.items())
    state = torch.load(tmp_path / "r_ckpt" / "last.pt", weights_only=False)
    steps = state["scheduler"]["last_epoch"]
    assert steps > 2
    assert state["scheduler"]["_last_lr"][0] == pytest.approx(1e-2 * (steps + 1) / 1000)


def test_train_source_cosine_schedule_and_time_budget(tiny_corpus, tmp_path):
    """After the warm-up the lr decays to lr * final_lr_ratio at the last step; a time budget
    that one epoch exhausts (less than the 2 minutes kept for the final evaluation and export)
    shortens the schedule to that epoch."""
    import torch
    info = _train(tiny_corpus, tmp_path / "m", "--epochs", 2, warmup_steps=1)
    state = torch.load(tmp_path / "m_ckpt" / "last.pt", weights_only=False)
    assert state["scheduler"]["last_epoch"] > 2
    assert state["scheduler"]["_last_lr"][0] == pytest.approx(1e-2 * 0.1)
    info = _train(tiny_corpus, tmp_path / "t", "--epochs", 3, "--max_minutes", 1.9)  # < 2 min
    assert info["epochs"] == 1 and len(info["history"]) == 1
    info = _train(tiny_corpus, tmp_path / "s", "--max_train_utts", 4)
    assert info["train_utts"] == 4 and info["test_utts"] == 3


def test_regression_runs_pass_their_seed_stream_and_stress_settings_to_the_recipe(tmp_path,
                                                                                    monkeypatch):
    """run_recipe and run_stress as dry runs: the seed is the stream's and the decodes'; the
    collapse regression's md_long, learning rate and run labels are STRESS's."""
    real, printed = subprocess.run, []

    def dry_run(cmd, **kwargs):
        out = real(cmd + ["--dry_run", "true"], capture_output=True, text=True, **kwargs)
        printed.append(out.stdout + out.stderr)
        return out

    monkeypatch.setattr(regression.subprocess, "run", dry_run)
    root = regression.run_recipe(tmp_path, 7)
    assert root == tmp_path / "exp_seed7" / "snr20"
    text = "\n".join(printed)
    assert re.search(r"prepare streams .*--names md_hard --seed 7 ", text), text
    decodes = re.findall(r"tta_brain\.decode (\S+) .*--output_folder=(\S+) --seed=(\d+)", text)
    assert sorted(decodes) == [(m, str(root / "md_hard" / label / "seed7"), "7") for m, label in
                               [("dsuta", "dsuta+dynamic"), ("source", "source"), ("suta", "suta")]]
    assert "Stage 5" in printed[-1]
    printed.clear()
    root = regression.run_stress(tmp_path, 7)
    assert root == tmp_path / "stress_seed7" / "snr20"
    text = "\n".join(printed)
    assert "Stage 2" in printed[0]      # the data of the seed, where there is none yet
    assert re.search(r"prepare streams .*--names md_long --seed 7 --total 300 .*--max_len 100 ",
                     text), text
    decoded = r"tta_brain\.decode (\S+) .*--output_folder=\S+/md_long/(\S+)/seed(\d+) (.*)"
    decodes = re.findall(decoded, text)
    assert sorted(label for _, label, _, _ in decodes) == sorted(
        ["source", regression.DSUTA, regression.DYNAMIC])
    for method, label, seed, opts in decodes:
        assert seed == "7" and (method == "source" or "--lr=2e-3" in opts), (label, opts)


def test_measurement_prints_the_minimum_of_each_margin_over_seeds_and_flags_those_below(
        tmp_path, monkeypatch, capsys):
    """regression.py's main on the runs of two seeds (their summaries as the recipe writes
    them; the recipe runs and the clean decode are stood in for)."""
    runs = {0: (20.0, 60.0, 50.0, 45.0, [120]), 1: (25.0, 70.0, 55.0, 52.0, [85, 170, 250])}
    for seed, (_, source, suta, dynamic, resets) in runs.items():
        stream = tmp_path / f"exp_seed{seed}" / "md_hard"
        _write_run(stream / "source" / "seed0", "source", source)
        _write_run(stream / "suta" / "seed0", "suta", suta)
        _write_run(stream / "dsuta+dynamic" / "seed0", "dsuta+dynamic", dynamic, resets=resets,
                   boundaries=[80, 160, 240, 320])
    monkeypatch.setattr(regression, "run_recipe", lambda work, seed: work / f"exp_seed{seed}")
    monkeypatch.setattr(regression, "clean_wer", lambda data: runs[int(data.name[-1])][0])
    assert regression.main(["--work_dir", str(tmp_path), "--seeds", "0", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    minima = out[out.index("margin: min over seeds (asserted)") + 1:]
    assert minima == ["  noisy_minus_clean: 40.00 (30.0)", "  source_minus_suta: 10.00 (8.0)",
                      "  suta_minus_dsuta: 3.00 (1.0)",
                      "  detected_fraction: 0.25 (0.5)   <-- below the asserted margin"]
    # the collapse regression's: above the asserted margin or flagged
    figs = {seed: {"source": {"wer": 60.0, "worst": 70.0, "first_above": None, "resets": []},
                   regression.DSUTA: {"wer": dsuta, "worst": 90.0, "first_above": 100, "resets": []},
                   regression.DYNAMIC: {"wer": 58.0, "worst": 65.0, "first_above": None,
                                        "resets": [150]}}
            for seed, dsuta in ((0, 75.0), (1, 61.0))}
    monkeypatch.setattr(regression, "run_stress", lambda work, seed: seed)
    monkeypatch.setattr(regression, "stress_figures", lambda seed: figs[seed])
    assert regression.main(["--work_dir", str(tmp_path), "--seeds", "0", "1", "--collapse"]) == 0
    out = capsys.readouterr().out.splitlines()
    minima = out[out.index("margin: min over seeds (asserted)") + 1:]
    assert minima == ["  dsuta_minus_source: 1.00 (1.0)   <-- not above the asserted margin",
                      "  dsuta_minus_dynamic: 3.00 (1.0)", "  source_minus_dynamic: 2.00 (0.0)"]
