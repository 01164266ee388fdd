"""Parakeet CTC (NVIDIA's FastConformer CTC checkpoints in transformers, ``nvidia/parakeet-ctc-*``)
and SEW-D as source models, on tiny random models written with ``save_pretrained``: a mel
feature extractor, a SentencePiece-style tokenizer of word pieces whose CTC blank is its last id,
a convolutional subsampling as the feature encoder, a kernel-1 convolution as the CTC head, batch
norms in the conformer layers. Also: a train-mode pass leaves every batch norm's running
statistics as the source's (HuBERT's ``conv_pos_batch_norm`` and Parakeet's)."""
import csv
import json

import pytest
import soundfile as sf
import torch

pytest.importorskip("librosa", reason="Parakeet's feature extractor needs librosa (the parakeet "
                                      "extra; the test extra installs it)")

from conftest import max_diff                                   # noqa: E402
from fake_corpora import fake_speech, write_stream              # noqa: E402
from tta_brain import decode                                    # noqa: E402
from tta_brain.asr.metrics import normalize_text                # noqa: E402
from tta_brain.lobes.hf_ctc import HFCTCLobe                    # noqa: E402
from tta_brain.lobes.testing import (PIECES, TINY, TINY_PARAKEET, TINY_SEWD,  # noqa: E402
                                     save_random_ctc_model)
from tta_brain.methods import UttInfo, build_method             # noqa: E402

NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                  final_dropout=0.0, feat_proj_dropout=0.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {"parakeet": save_random_ctc_model(str(root / "parakeet"), 0, arch="parakeet",
                                              **TINY_PARAKEET),
            "sew-d": save_random_ctc_model(str(root / "sewd"), 0, arch="sew-d", **TINY_SEWD)}


def wavs(n=4):
    return [torch.from_numpy(fake_speech(1.0 + 0.3 * i, seed=i)).float() for i in range(n)]


def transformers_pass(model_dir, wav):
    """What transformers gives: its processor's inputs into its model, and its own decoding."""
    from transformers import AutoModelForCTC, AutoProcessor
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForCTC.from_pretrained(model_dir).eval()
    inputs = processor(wav.numpy(), sampling_rate=16000, return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs)
    return model, processor, inputs, out.logits


def drop_specials(tokenizer, text):
    """Transformers' CTC text with the special tokens it writes (``<s>``, ``<unk>``) taken out.
    (Its ``skip_special_tokens=True`` drops them before it merges repeats: ``M <s> M`` becomes
    ``M``; a transcript here, as that text without the option, keeps ``MM``.)"""
    for tok in tokenizer.all_special_tokens:
        text = text.replace(tok, "")
    return text


def test_parakeet_logits_are_the_processors_and_models(models):
    lobe = HFCTCLobe(models["parakeet"])
    assert lobe.filterbank and lobe.word_pieces
    assert lobe.blank_id == len(PIECES) - 1 == lobe.tokenizer.pad_token_id
    for w in wavs():
        with torch.no_grad():
            got = lobe.logits(lobe.prepare(w))
        _, _, _, want = transformers_pass(models["parakeet"], w)
        assert got.shape == want.shape and got.shape[1] > 5
        assert max_diff([got], [want]) < 1e-6


def test_a_parakeet_extractor_with_an_odd_n_fft_is_refused_in_one_line(models, tmp_path):
    """The mask of the last frame (:attr:`masked_tail`) holds for an even n_fft only: an odd one
    is refused, not decoded with a wrong mask (mutation audit: the check was dropped)."""
    import shutil
    d = tmp_path / "odd"
    shutil.copytree(models["parakeet"], d)
    cfg = json.loads((d / "preprocessor_config.json").read_text())
    cfg.update(n_fft=cfg["win_length"] + 1 - cfg["win_length"] % 2)
    (d / "preprocessor_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"^{d}: a Parakeet feature extractor with an odd n_fft "
                                         rf"\({cfg['n_fft']}\) masks frames by the audio's length"):
        HFCTCLobe(str(d))


def test_word_pieces_become_words_and_a_repeated_piece_stays_two(models):
    """The pieces join by the tokenizer's own decoder (``\u2581`` starts a word), not by a
    character delimiter; the labels are collapsed already, so two equal pieces in a row are two
    (the tokenizer's ``decode`` would group them again, as CTC does frames)."""
    lobe = HFCTCLobe(models["parakeet"])
    ids = {p: i for i, p in enumerate(PIECES)}
    assert lobe.labels_to_text([ids[p] for p in ("\u2581th", "e", "\u2581", "o", "th", "er")]) == \
        "the other"
    assert lobe.labels_to_text([ids[p] for p in ("\u2581", "t", "r", "e", "e")]) == "tree"
    assert lobe.labels_to_text([ids["<unk>"], ids["\u2581a"], lobe.blank_id]) == "a"
    assert lobe.labels_to_text([]) == ""
    assert lobe.text_to_labels("the other") == [ids[p] for p in ("\u2581th", "e", "\u2581", "o",
                                                                 "th", "er")]
    # greedy decoding of any frame labels: transformers' own CTC decoding of them
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 60, len(PIECES), generator=g)
    logits[..., lobe.blank_id] += 1.0                          # blanks between repeats, too
    want = [" ".join(drop_specials(lobe.tokenizer, t).split())
            for t in lobe.tokenizer.batch_decode(logits.argmax(-1))]
    assert lobe.decode(logits) == want and all(want)


def test_selectors_name_parakeets_parts(models):
    """``cnn``: the convolutional subsampling and its Linear (the wav2vec 2.0 family's feature
    encoder and projection); ``encoder_bias``: the conformer layers' biases, not the
    subsampling's; ``layernorm``: the conformer layers' LayerNorms (not the batch norms)."""
    from tta_brain.methods.params import select_parameters
    lobe = HFCTCLobe(models["parakeet"])
    names = {spec: [n for n, _, _ in select_parameters(lobe.model, [{"select": spec}])]
             for spec in ("cnn", "feature_extractor", "feature_projection", "encoder_bias",
                          "layernorm")}
    assert names["cnn"] == names["feature_extractor"] + names["feature_projection"]
    assert names["feature_extractor"] and all(n.startswith("encoder.subsampling.layers.")
                                              for n in names["feature_extractor"])
    assert names["feature_projection"] == ["encoder.subsampling.linear.weight",
                                           "encoder.subsampling.linear.bias"]
    assert names["encoder_bias"] and all(n.startswith("encoder.layers.") and n.endswith(".bias")
                                         for n in names["encoder_bias"])
    assert len(names["layernorm"]) == 2 * 5 * TINY_PARAKEET["num_hidden_layers"]
    assert not any(".conv.norm." in n for n in names["layernorm"])     # BatchNorm1d


@pytest.mark.parametrize("name", ["suta", "csuta", "dsuta", "sgem", "sdpl", "awmc", "tent",
                                  "sar", "cotta"])
def test_gradient_methods_adapt_parakeet(models, name):
    kw = dict(lr=1e-2, steps=2) if name not in ("cotta", "sar", "tent", "csuta") else dict(lr=1e-2)
    if name == "dsuta":
        kw["buffer_size"] = 2
    if name == "sar":            # the random model is never sure: let every utterance through
        kw["e_margin_factor"] = 2.0
    m = build_method(name, model=HFCTCLobe(models["parakeet"]), **kw)
    before = [p.detach().clone() for p in m.params]
    hyps = [m.process(w, UttInfo(position=i)) for i, w in enumerate(wavs())]
    assert all(isinstance(h, str) for h in hyps)
    if m.episodic:               # back to the source before each utterance: adapt one more
        m.reset()
        m.adapt_step(m.lobe.prepare(wavs(1)[0]))
    assert max_diff(before, m.params) > 0
    if name == "suta":           # the CNN (subsampling) adapts, as on wav2vec 2.0
        assert any("subsampling" in n for n in m.param_names)
        x = m.lobe.prepare(wavs(2)[1])
        m.reset()
        losses = [float(m.adapt_step(x)) for _ in range(5)]
        assert losses[-1] < losses[0]


def test_lame_and_t3a_read_parakeets_head(models):
    """Parakeet's head is a kernel-1 convolution on its encoder's output: LAME and T3A take the
    logits and that hidden state from the model's own pass, T3A's classifier rows are its
    weights."""
    from tta_brain.methods import lame
    lame_m, t3a_m = (build_method(n, model=HFCTCLobe(models["parakeet"])) for n in ("lame", "t3a"))
    head = lame_m.lobe.model.ctc_head
    assert torch.equal(t3a_m.W, head.weight.detach()[:, :, 0])
    assert torch.equal(t3a_m.bias, head.bias.detach())
    for i, w in enumerate(wavs()):
        model, _, inputs, want = transformers_pass(models["parakeet"], w)
        with torch.no_grad():
            hidden = model.encoder(**inputs).last_hidden_state
            logits_, hidden_ = lame_m.prefix(lame_m.lobe.prepare(w))
        assert max_diff([logits_, hidden_], [want, hidden]) < 1e-5
        posteriors = lame.lame_posteriors(logits_[0], hidden_[0], lame_m.blank_id, **lame_m.opts)
        assert lame_m.process(w) == lame_m.lobe.decode(posteriors.clamp(min=1e-8).log()[None])[0]
        t3a_m.process(w)
    assert t3a_m.supports.shape[1] == TINY_PARAKEET["hidden_size"]
    assert len(t3a_m.supports) > len(PIECES), "no support was ever added"


@pytest.mark.parametrize("name,why", [
    ("foa", "ParakeetForCTC: a partial forward needs a wav2vec 2.0-style model"),
    ("ebats", "ParakeetForCTC: a partial forward needs a wav2vec 2.0-style model"),
    ("cea", "tc_coef > 0 needs a model with a separable CNN feature encoder")])
def test_methods_that_need_the_wav2vec2_cnn_refuse_parakeet_in_one_line(models, name, why):
    with pytest.raises(ValueError, match=why):
        build_method(name, model=HFCTCLobe(models["parakeet"]))


def test_sgems_word_lm_refuses_word_pieces_in_one_line(models, tmp_path):
    lm = tmp_path / "lm.arpa"
    lm.write_text("\\data\\\nngram 1=1\n\n\\1-grams:\n-1.0 the\n\n\\end\\\n")
    with pytest.raises(ValueError, match="lm_path: the word n-gram LM needs a character "
                                         "vocabulary with a word delimiter"):
        build_method("sgem", model=HFCTCLobe(models["parakeet"]), lm_path=str(lm))


@pytest.mark.parametrize("family", ["parakeet", "sew-d"])
def test_decode_and_a_batched_sweep(models, tmp_path, family):
    """Through ``tta_brain.decode``: the source run's transcripts are transformers' own
    decoding (its tokenizer's CTC decoding) of logits within rounding of its processor + model
    (the lobe normalises the waveform itself: a near-tied frame of a random model may flip, so
    the text is compared on the run's own logits); a batched sweep of two SUTA runs gives the
    transcripts of the two runs alone; DSUTA with the dynamic reset finishes."""
    from tta_brain import sweep
    root = write_stream(tmp_path / "data", n=8, block=4, seconds=(1.0, 1.6))
    common = [f"--source={models[family]}", f"--stream_csv={root / 'stream.csv'}",
              f"--data_root={root}", "--noprogressbar"]
    decode.main(["source", *common, f"--output_folder={tmp_path / 'source'}"])
    with open(tmp_path / "source" / "transcripts.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8
    lobe = HFCTCLobe(models[family])
    for r in rows:
        wav = torch.from_numpy(sf.read(str(root / "wav" / f"{r['ID']}.wav"), dtype="float32")[0])
        _, processor, _, want = transformers_pass(models[family], wav)
        with torch.no_grad():
            logits = lobe.logits(lobe.prepare(wav))
        assert max_diff([logits], [want]) < 1e-5
        text = drop_specials(processor.tokenizer, processor.batch_decode(logits.argmax(-1))[0])
        assert normalize_text(r["hyp"]) == normalize_text(text), r["ID"]
    def suta(out, em):
        return ["suta", *common, "--lr=1e-2", "--steps=2", f"--em_coef={em}",
                f"--output_folder={tmp_path / out}"]
    if family == "sew-d":        # refused before a folder is written; a grid runs them apart
        with pytest.raises(sweep.Refused, match="SEW-D's attention applies autograd Functions"):
            sweep.run([suta(f"s{i}", em) for i, em in enumerate((0.3, 1.0))])
        assert not (tmp_path / "s0").exists()
        return
    for i, em in enumerate((0.3, 1.0)):
        decode.main(suta(f"alone_s{i}", em))
    sweep.run([suta(f"s{i}", em) for i, em in enumerate((0.3, 1.0))])
    for i in range(2):
        assert (tmp_path / f"s{i}" / "transcripts.csv").read_text() == \
            (tmp_path / f"alone_s{i}" / "transcripts.csv").read_text()
    assert "Batched sweep of 2 runs" in (tmp_path / "s0" / "log.txt").read_text()
    decode.main(["dsuta", *common, f"--output_folder={tmp_path / 'dsuta'}", "--reset=dynamic",
                 "--reset_K=4", "--buffer_size=2", "--steps=2"])
    s = json.loads((tmp_path / "dsuta" / "summary.json").read_text())
    assert s["n_utts"] == 8 and s["n_words"] > 0


@pytest.mark.parametrize("family", ["hubert", "parakeet"])
def test_a_train_mode_pass_keeps_the_batch_norms_statistics(tmp_path, family):
    """Batch norms in train mode normalise by the utterance; their running statistics stay the
    source's (momentum 0), so an episodic method in train mode gives an utterance the same
    transcript wherever it comes in the stream, and a reset is the source model again. Before,
    every train-mode pass moved them (momentum 0.1), which no reset or checkpoint restored."""
    if family == "hubert":       # wav2vec 2.0-style, its positional convolution batch-normed
        d = save_random_ctc_model(str(tmp_path), 1, arch="hubert",
                                  **dict(TINY, **NO_DROPOUT, conv_pos_batch_norm=True))
    else:
        d = save_random_ctc_model(str(tmp_path), 1, arch="parakeet", **TINY_PARAKEET)
    lobe = HFCTCLobe(d)
    norms = [m for m in lobe.model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    stats = [(m.running_mean.clone(), m.running_var.clone()) for m in norms]
    assert norms and lobe.train_draws()[-1].endswith("(batch norm)")
    sdpl = build_method("sdpl", model=lobe, train_mode=True, lr=1e-2, steps=3)
    ws = wavs(2)
    first, _, again = (sdpl.process(w) for w in (ws[0], ws[1], ws[0]))
    assert first == again
    assert all(torch.equal(m.running_mean, mean) and torch.equal(m.running_var, var)
               for m, (mean, var) in zip(norms, stats))
    awmc = build_method("awmc", model=HFCTCLobe(d), lr=1e-2, steps=2)    # train mode, continual
    for w in ws:
        awmc.process(w)
    awmc_norms = [m for m in awmc.net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert all(torch.equal(m.running_mean, mean) for m, (mean, _) in zip(awmc_norms, stats))


def test_parakeets_dropout_is_named_among_its_train_mode_draws(tmp_path):
    """Parakeet keeps its dropout in the nested ``encoder_config``: train_draws named only its
    batch norm (the reason a method's refusal gives was half of it)."""
    d = save_random_ctc_model(str(tmp_path), 0, arch="parakeet",
                              **dict(TINY_PARAKEET, dropout=0.1))
    draws = HFCTCLobe(d).train_draws()
    assert "encoder_config.dropout=0.1" in draws and draws[-1].endswith("(batch norm)"), draws
    quiet = save_random_ctc_model(str(tmp_path / "q"), 0, arch="parakeet", **TINY_PARAKEET)
    assert not any("dropout" in x for x in HFCTCLobe(quiet).train_draws())


def test_a_dropout_module_that_no_config_key_names_is_a_train_mode_draw(tmp_path):
    """A dropout module with p > 0 whose rate no ``*dropout*`` key of config.json gives is still
    named (mutation audit: only the config's keys were read)."""
    lobe = HFCTCLobe(save_random_ctc_model(str(tmp_path), 0, arch="wav2vec2",
                                           **dict(TINY, **NO_DROPOUT)))
    assert lobe.train_draws() == []
    lobe.model.dropout.p = 0.1
    assert lobe.train_draws() == ["dropout (p=0.1)"]


@pytest.mark.parametrize("arch,cfg", [("sew", TINY), ("sew-d", TINY_SEWD)])
def test_sews_cnn_runs_as_matrix_products(tmp_path, arch, cfg):
    """``convolutions: gemm`` takes SEW's and SEW-D's CNN convolutions (SEW-D's were not found:
    transformers' ``base_model`` of it is the CTC model) and gives the native logits;
    Parakeet's 2-D subsampling is no CNN feature encoder: refused in one line."""
    from tta_brain.lobes.runtime import Runtime
    d = save_random_ctc_model(str(tmp_path), 0, arch=arch, **cfg)
    native, gemm = HFCTCLobe(d), HFCTCLobe(d, runtime=Runtime(convolutions="gemm"))
    assert gemm.gemm_convs == len(cfg["conv_kernel"])
    x = native.prepare(wavs(1)[0])
    with torch.no_grad():
        a, b = native.logits(x), gemm.logits(x)
    assert float((a - b).norm() / a.norm()) < 1e-4


def test_parakeet_refuses_gemm_convolutions_in_one_line(models):
    from tta_brain.lobes.runtime import Runtime
    with pytest.raises(ValueError, match=r"^convolutions: gemm: ParakeetForCTC has no convolution"
                                         r" .*no CNN feature encoder \(its input is "
                                         r"input_features\); use convolutions: native$"):
        HFCTCLobe(models["parakeet"], runtime=Runtime(convolutions="gemm"))


@pytest.mark.parametrize("name,mode", [("dsuta+dynamic", "device"), ("dsuta+dynamic", "graph"),
                                       ("suta", "graph"), ("tent", "graph")])
def test_parakeets_device_step_and_captured_replays_give_the_host_transcripts(models, utterances,
                                                                            name, mode):
    """The device step and its captured replays (the fake graph backend on CPU) on Parakeet,
    whose mask is made inside the step: the host path's transcripts, parameters to rounding."""
    from test_gpu import build, run, stream
    items = stream(utterances, 8)
    a, b = (build(models["parakeet"], name, m) for m in ("host", mode))
    assert run(a, items) == run(b, items)
    assert max_diff(a.params, b.params) < 1e-5
    if mode == "graph":
        assert b.step.stats["replays"] > 0


def test_loading_parakeet_prints_nothing_of_transformers_docstrings(models):
    """transformers 4.57 prints '... Config not found for parakeet ...' three times when a process
    first imports Parakeet's modelling code: a fresh process that loads the lobe prints none."""
    import subprocess
    import sys
    from conftest import ROOT
    code = (f"from tta_brain.lobes.hf_ctc import HFCTCLobe; "
            f"print('blank', HFCTCLobe({models['parakeet']!r}).blank_id)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines() == [f"blank {len(PIECES) - 1}"], res.stdout
