"""Source models that take filterbank features, not the waveform (``main_input_name`` is
``input_features``: Wav2Vec2-BERT, w2v-BERT 2.0's CTC fine-tunes): the lobe gives the processor's
features and mask to the model, so its logits are those of the processor + model; the methods,
the rejects of too-short audio, the decode and the batched sweep run on them unchanged."""
import csv
import json

import numpy as np
import pytest
import soundfile as sf
import torch

from conftest import max_diff
from fake_corpora import write_stream
from tta_brain import decode
from tta_brain.data.loader import too_short
from tta_brain.lobes.hf_ctc import HFCTCLobe
from tta_brain.lobes.testing import TINY_BERT, save_random_ctc_model
from tta_brain.methods import UttInfo, build_method


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """Two tiny Wav2Vec2-BERT CTC models: without and with the strided adapter."""
    root = tmp_path_factory.mktemp("w2v_bert")
    return {adapter: save_random_ctc_model(str(root / str(adapter)), 0, arch="wav2vec2-bert",
                                           add_adapter=adapter, **TINY_BERT)
            for adapter in (False, True)}


def reference_logits(model_dir, wav):
    """What transformers gives: the processor's features and attention mask into the model."""
    from transformers import AutoFeatureExtractor, AutoModelForCTC
    fe = AutoFeatureExtractor.from_pretrained(model_dir)
    model = AutoModelForCTC.from_pretrained(model_dir).eval()
    inputs = fe(wav.numpy(), sampling_rate=16000, return_tensors="pt")
    with torch.no_grad():
        return model(**inputs).logits, inputs["attention_mask"]


@pytest.mark.parametrize("adapter", [False, True])
def test_logits_are_the_processors_and_models(bert, adapter):
    """16000 samples make an even number of filterbank frames, 16160 an odd one, which the
    processor pads and masks: with the adapter the masked frame changes every output frame
    (0.18 in the logits when it was dropped instead), so the lobe must pass the same mask."""
    lobe = HFCTCLobe(bert[adapter])
    assert lobe.filterbank and lobe.input_name == "input_features"
    g = torch.Generator().manual_seed(0)
    for n in (16000, 16160, 8000, 24160):
        wav = 0.1 * torch.randn(n, generator=g)
        x = lobe.prepare(wav)
        with torch.no_grad():
            got = lobe.logits(x)
        want, mask = reference_logits(bert[adapter], wav)
        assert got.shape == want.shape
        assert max_diff([got], [want]) < 1e-6
        assert int(lobe.output_lengths(torch.tensor(n))) == got.shape[1]
        assert lobe.feature_mask(x).tolist() == mask.tolist()
        assert int(mask[0, -1]) == (n % 320 == 0)       # the odd ones end on a masked frame


def test_too_short_audio_is_said_so(bert):
    """Under one filterbank window there is no frame; with one window the processor's
    per-bin normalisation divides by the std of one frame (NaN features): both are too short."""
    method = build_method("suta", model=HFCTCLobe(bert[False]))
    why = too_short(method)
    assert why(300) == "300 samples give no output frame"
    assert why(500) == "500 samples give no output frame"
    assert why(800) is None and why(16000) is None


@pytest.mark.parametrize("name", ["suta", "tent", "sdpl", "sgem", "awmc", "sar", "cotta",
                                  "csuta", "dsuta"])
def test_gradient_methods_adapt_a_filterbank_model(bert, utterances, name):
    """Each gradient method runs its steps on the filterbank model and moves what it adapts
    (SUTA: its loss falls over the steps of an utterance)."""
    kw = dict(lr=1e-2, steps=2) if name not in ("cotta", "sar", "tent") else dict(lr=1e-2)
    if name == "dsuta":
        kw["buffer_size"] = 2
    if name == "sar":            # the random model is never sure: let every utterance through
        kw["e_margin_factor"] = 2.0
    m = build_method(name, model=HFCTCLobe(bert[True]), **kw)
    before = [p.detach().clone() for p in m.params]
    hyps = [m.process(w, UttInfo(position=i)) for i, w in enumerate(utterances[:4])]
    assert all(isinstance(h, str) for h in hyps)
    if m.episodic:               # back to the source before each utterance: adapt one more
        m.reset()
        m.adapt_step(m.lobe.prepare(utterances[0]))
    assert max_diff(before, m.params) > 0
    if name == "suta":
        x = m.lobe.prepare(utterances[1])
        m.reset()
        losses = [float(m.adapt_step(x)) for _ in range(5)]
        assert losses[-1] < losses[0]


@pytest.mark.parametrize("name,why", [
    ("foa", "a partial forward needs a wav2vec 2.0-style model"),
    ("ebats", "a partial forward needs a wav2vec 2.0-style model"),
    ("cea", "tc_coef > 0 needs a model with a separable CNN feature encoder")])
def test_methods_that_need_the_cnn_refuse_in_one_line(bert, name, why):
    with pytest.raises(ValueError, match=why):
        build_method(name, model=HFCTCLobe(bert[False]))


def test_decode_on_a_filterbank_model(bert, tmp_path):
    """Through ``tta_brain.decode``: the source run's transcripts are transformers' greedy
    decoding of the processor + model; a too-short utterance is a reject with its reason; an
    adapting run with the dynamic reset finishes and scores."""
    from transformers import AutoModelForCTC, AutoProcessor
    root = write_stream(tmp_path / "data", n=8, block=4)
    sf.write(str(root / "wav" / "short.wav"), np.zeros(400, dtype="float32"), 16000)
    with open(root / "stream.csv") as f:
        rows = list(csv.DictReader(f))
    rows.insert(3, dict(rows[3], ID="short", duration="0.025", wav="$data_root/wav/short.wav"))
    for i, r in enumerate(rows):
        r["position"] = i
    with open(root / "stream.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    common = [f"--source={bert[True]}", f"--stream_csv={root / 'stream.csv'}",
              f"--data_root={root}", "--noprogressbar"]
    decode.main(["source", *common, f"--output_folder={tmp_path / 'source'}"])
    with open(tmp_path / "source" / "transcripts.csv") as f:
        got = {r["ID"]: r["hyp"] for r in csv.DictReader(f)}
    with open(tmp_path / "source" / "rejects.csv") as f:
        rejects = list(csv.DictReader(f))
    assert [r["ID"] for r in rejects] == ["short"]
    assert "400 samples give no output frame" in rejects[0]["reason"]
    processor = AutoProcessor.from_pretrained(bert[True])
    model = AutoModelForCTC.from_pretrained(bert[True]).eval()
    for r in rows:
        if r["ID"] == "short":
            continue
        wav, _ = sf.read(r["wav"].replace("$data_root", str(root)), dtype="float32")
        inputs = processor(audio=wav, sampling_rate=16000, return_tensors="pt")
        with torch.no_grad():
            ids = model(**inputs).logits.argmax(-1)
        assert got[r["ID"]] == " ".join(processor.batch_decode(ids)[0].split())
    decode.main(["dsuta", *common, f"--output_folder={tmp_path / 'dsuta'}", "--reset=dynamic",
                 "--reset_K=4", "--buffer_size=2", "--steps=2"])
    s = json.loads((tmp_path / "dsuta" / "summary.json").read_text())
    assert s["n_utts"] == 8 and s["n_skipped"] == 1 and s["n_words"] > 0


@pytest.mark.parametrize("name", ["suta", "cotta", "t3a"])
def test_batched_sweep_gives_the_separate_transcripts(bert, utterances, name):
    """Two runs of one batch against the same runs alone; CoTTA's augmented views (every
    utterance here: the random model is never sure) are each prepared as their own utterance;
    T3A's runs share one frozen pass of each utterance."""
    from tta_brain.sweep import batch_for
    cfgs = ([dict(filter_K=1), dict(filter_K=10)] if name == "t3a"
            else [dict(lr=1e-3), dict(lr=1e-2)])

    def build(cfg):
        return build_method(name, model=HFCTCLobe(bert[True]), **cfg)
    seps = [build(c) for c in cfgs]
    want = [[m.process(w, UttInfo(position=i)) for i, w in enumerate(utterances[:4])]
            for m in seps]
    ms = [build(c) for c in cfgs]
    batch = batch_for(ms[0])(ms[0].lobe, ms)
    got = [[] for _ in cfgs]
    for i, w in enumerate(utterances[:4]):
        batch.process([0, 1], w, UttInfo(position=i))
        for r, v in enumerate(batch.views):
            got[r].append(v.process(w))
    assert got == want
    if name == "cotta":
        assert all(m.counts["augmented"] == 4 for m in seps)
    if name == "t3a":
        assert [len(m.supports) for m in seps] == [len(v.method.supports) for v in batch.views]
        assert len(seps[0].supports) < len(seps[1].supports), "filter_K made no difference"
        return
    for r, m in enumerate(seps):
        assert max_diff(batch.values(r), m.params) < 1e-3      # batched rounding, as test_sweep


@pytest.mark.parametrize("mode", ["device", "graph"])
def test_device_step_gives_the_host_transcripts(bert, utterances, mode):
    """The device step and its captured replays (the fake graph backend on CPU) on the
    filterbank model: the host path's transcripts, parameters to rounding."""
    from test_gpu import build, run, stream
    items = stream(utterances, 8)
    a, b = build(bert[True], "dsuta+dynamic", "host"), build(bert[True], "dsuta+dynamic", mode)
    assert run(a, items) == run(b, items)
    assert max_diff(a.params, b.params) < 1e-5
    if mode == "graph":
        assert b.step.stats["replays"] > 0


@pytest.mark.parametrize("attention_mask", [False, True])
def test_a_waveform_models_input_is_its_processors(tmp_path, attention_mask):
    """The waveform models' counterpart of the features above: the lobe's normalised input
    (``prepare``, ``prepare_each``, ``normalize_waveforms`` with ``lengths``) is what
    transformers' ``Wav2Vec2FeatureExtractor`` gives the model (zero mean, unit population
    variance per utterance over its valid samples, 1e-7 under the root, the padding zero), so
    the logits and transcripts are the processor's + model's. A quiet utterance (variance far
    below 1e-7) checks the epsilon; a DC offset checks the mean."""
    from transformers import AutoModelForCTC, AutoProcessor

    from tta_brain.lobes.hf_ctc import normalize_waveforms
    from tta_brain.lobes.testing import TINY
    src = save_random_ctc_model(str(tmp_path), 0, arch="wav2vec2", attention_mask=attention_mask,
                                **TINY)
    lobe, processor = HFCTCLobe(src), AutoProcessor.from_pretrained(src)
    model = AutoModelForCTC.from_pretrained(src).eval()
    g = torch.Generator().manual_seed(0)
    n = (8000, 5600, 3200)
    wavs = [0.3 + 0.2 * torch.randn(n[0], generator=g), 0.1 * torch.randn(n[1], generator=g),
            1e-4 * torch.randn(n[2], generator=g)]
    for w in wavs:
        want = processor(w.numpy(), sampling_rate=16000, return_tensors="pt").input_values
        assert max_diff(lobe.prepare(w), want) < 1e-5
        # a float64 waveform (numpy's default) is the model's float32 input, as the processor's
        assert lobe.prepare(w.double()).dtype == torch.float32 == want.dtype
        with torch.no_grad():
            logits = model(want).logits
        assert max_diff(lobe.logits(lobe.prepare(w)), logits) < 1e-4
        text = processor.batch_decode(logits.argmax(-1))[0]   # (specials dropped after grouping)
        for special in set(processor.tokenizer.all_special_tokens) - {"<pad>"}:
            text = text.replace(special, "")
        assert lobe.decode(logits) == [" ".join(text.split())]
    rows = torch.stack([w[:n[2]] for w in wavs])
    want = torch.stack([processor(r.numpy(), sampling_rate=16000,
                                  return_tensors="pt").input_values[0] for r in rows])
    assert max_diff(lobe.prepare_each(rows)[:, 0], want) < 1e-5
    padded = torch.zeros(3, n[0])
    for i, w in enumerate(wavs):
        padded[i, :n[i]] = w
    got = normalize_waveforms(padded, torch.tensor(n))
    for i, w in enumerate(wavs):
        want = processor(w.numpy(), sampling_rate=16000, return_tensors="pt").input_values[0]
        assert max_diff(got[i, :n[i]], want) < 1e-5
        assert not got[i, n[i]:].any()
