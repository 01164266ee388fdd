"""The backprop-free methods (LAME, T3A, FOA, E-BATS) on tiny real models: partial forwards equal
the model's, the maths against slow references written from the formulas, CMA-ES reproducible,
the population batched == one at a time, decodes, resume after kill -9."""
import csv
import math
import os
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
import torch.nn.functional as F

from conftest import assert_resumes_after_kill_9, max_diff, save_ctc_model
from fake_corpora import fake_speech, write_stream
from tta_brain import decode, stats as stats_cli
from tta_brain.lobes.hf_ctc import HFCTCLobe
from tta_brain.lobes.partial import PartialForward
from tta_brain.lobes.testing import (TINY, TINY_ADAPTER, TINY_BERT, TINY_PARAKEET, TINY_SEWD,
                                     save_random_ctc_model)
from tta_brain.methods import activation_stats as act, build_method, lame, t3a
from tta_brain.methods.base import TTAMethod
from tta_brain.methods.free import EarlyStop
from tta_brain.methods.resets import make_reset_policy
from tta_brain.methods.source_stats import SourceStatsError

REPO = Path(__file__).resolve().parents[1]
SMALL = {"ebats": ["--popsize=8", "--generations=4"], "foa": ["--popsize=8"], "t3a": [], "lame": []}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    """A 20-utterance test stream, and source statistics from OTHER (clean) speech made with the
    statistics command."""
    root = write_stream(tmp_path_factory.mktemp("stream"))
    clean = tmp_path_factory.mktemp("clean")
    stats = hidden_token_stats(clean, tiny_model_dir)
    return {"root": root, "csv": root / "stream.csv", "model": tiny_model_dir, "stats": stats,
            "clean": [str(clean / f"c{i}.wav") for i in range(6)]}


def hidden_token_stats(clean, model_dir, kinds="hidden,tokens"):
    """The ``hidden`` and ``tokens`` statistics (``kinds``) of six clean utterances written to
    folder ``clean`` (c0.wav .. c5.wav), made with the statistics command; the file's path."""
    rows = []
    for i in range(6):
        sig = fake_speech(0.6 + 0.1 * i, seed=500 + i)
        sf.write(str(clean / f"c{i}.wav"), sig, 16000, subtype="PCM_16")
        rows.append({"ID": f"c{i}", "duration": f"{len(sig) / 16000:.3f}", "wav": str(clean / f"c{i}.wav"),
                     "spk_id": "s", "wrd": "ALPHA"})
    with open(clean / "clean.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    stats = clean / "stats.pt"
    assert stats_cli.main(["--source", model_dir, "--manifest", str(clean / "clean.csv"),
                           "--kinds", kinds, "--out", str(stats)]) == 0
    return stats


def build(setup, name, **kw):
    if name in ("foa", "ebats"):
        kw.setdefault("source_stats", str(setup["stats"]))
    return build_method(name, model=HFCTCLobe(setup["model"]), **kw)


def wavs(n=6):
    return [torch.from_numpy(fake_speech(0.4 + 0.05 * i, seed=40 + i)) for i in range(n)]


# ----------------------------------------------------------------------------- partial forwards
@pytest.mark.parametrize("arch,cfg", [("wav2vec2", {}), ("wav2vec2", {"feat_extract_norm": "layer",
                                       "do_stable_layer_norm": True}), ("hubert", {}),
                                      ("data2vec-audio", {}), ("wavlm", {}),
                                      ("wavlm", {"feat_extract_norm": "layer",
                                                 "do_stable_layer_norm": True}),
                                      ("unispeech-sat", {}),
                                      ("wav2vec2", {"add_adapter": True,
                                                    "output_hidden_size": 32})])
def test_partial_forward_is_the_models_forward(tmp_path, arch, cfg):
    lobe = HFCTCLobe(save_random_ctc_model(str(tmp_path), 1, arch=arch, **dict(TINY, **cfg)))
    pf = PartialForward(lobe)
    x = lobe.prepare(torch.from_numpy(fake_speech(0.7, seed=1)))
    with torch.no_grad():
        ref = lobe.model(x, output_hidden_states=True)
        logits, _, states, _ = pf.hidden(x)
        bias = torch.randn(3, pf.conv_channels)
        batched = pf.from_features(pf.finish_cnn(pf.last_conv(x) + bias[:, :, None]))[0]
        single = [pf.from_features(pf.finish_cnn(pf.last_conv(x) + b[None, :, None]))[0] for b in bias]
    assert torch.equal(logits, ref.logits)
    assert len(states) == len(ref.hidden_states)
    assert all(torch.equal(a, b) for a, b in zip(states, ref.hidden_states))
    assert torch.allclose(batched, torch.cat(single), atol=1e-5)
    assert not torch.allclose(batched[0], batched[1]), "the bias had no effect"


def test_prompted_hidden_states_leave_the_prompt_positions_out(tmp_path):
    """FOA's prompts are prepended positions: every hidden state handed back (its statistics
    loss) and the last one cover the utterance's frames only, the prompt positions dropped."""
    lobe = HFCTCLobe(save_random_ctc_model(str(tmp_path), 1, arch="wav2vec2", **TINY))
    pf = PartialForward(lobe)
    x = lobe.prepare(torch.from_numpy(fake_speech(0.7, seed=1)))
    with torch.no_grad():
        h = pf.encoder_input(pf.finish_cnn(pf.last_conv(x)))
        prompts = torch.randn(2, 3, h.shape[-1])
        logits, states, last = pf.prompted(h, prompts)
        full = torch.cat([prompts[:1], h], dim=1)
        ref_states, _ = pf.layers(full)
    F_ = h.shape[1]
    assert logits.shape[:2] == (2, F_) and last.shape[1] == F_
    assert all(s.shape[:2] == (2, F_) for s in states)
    assert all(torch.allclose(a[:1], b[:, 3:], atol=1e-5) for a, b in zip(states, ref_states))


@pytest.mark.parametrize("arch,why", [
    # the reason: SEW has the parts that were listed (feature_extractor, feature_projection,
    # encoder, lm_head); its forward after the CNN is another one
    ("sew", "SEWForCTC: a partial forward needs a wav2vec 2.0-style model whose forward after "
            "the CNN it reproduces (base model one of Wav2Vec2Model, "),
    ("wav2vec2-conformer", "Wav2Vec2ConformerForCTC: its encoder (Wav2Vec2ConformerEncoder) is "
                           "not one the partial forward runs layer by layer"),
])
def test_models_the_partial_forward_would_get_wrong_are_refused(tmp_path, arch, why):
    """SEW pools and upsamples around its encoder, and its cached-features pass gave other logits
    than the model (other transcripts under the default feature cache); a Conformer's layers need
    its relative position embeddings. Both still decode through the model's own forward."""
    lobe = HFCTCLobe(save_random_ctc_model(str(tmp_path), 1, arch=arch, **TINY))
    with pytest.raises(ValueError, match=re.escape(why)):
        PartialForward(lobe)
    x = lobe.prepare(torch.from_numpy(fake_speech(0.7, seed=1)))
    with torch.no_grad():
        assert torch.equal(lobe.logits(x), lobe.model(x).logits)
    if arch == "sew":
        assert not lobe.supports_features
        assert lobe.feature_cache_blocker(list(lobe.parameters())[-2:]) == (
            "the model has no separable feature encoder")
    else:           # the conformer's features path is its forward: the feature cache may run
        assert lobe.supports_features
        with torch.no_grad():
            assert torch.equal(lobe(None, features=lobe.features(x)), lobe.model(x).logits)


def test_token_statistics_of_a_model_whose_adapter_subsamples_its_frames_are_refused(
        tmp_path, capsys):
    """A wav2vec 2.0 with a strided adapter (``add_adapter``): its logits have half the
    encoder's frames, so a frame's label is no encoder state's. The ``tokens`` statistics said
    ``ERROR: mat1 and mat2 shapes cannot be multiplied`` (and E-BATS, refused for want of them,
    pointed at that command); now both are refused in one line naming the model and its adapter.
    FOA's ``hidden`` statistics (time means) are made as before."""
    d = save_random_ctc_model(str(tmp_path / "model"), 1, **TINY_ADAPTER)
    clean = tmp_path / "clean"
    clean.mkdir()
    hidden_token_stats(clean, d, kinds="hidden")
    capsys.readouterr()
    out = clean / "tokens.pt"
    assert stats_cli.main(["--source", d, "--manifest", str(clean / "clean.csv"),
                           "--kinds", "tokens", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("ERROR: ") and not out.exists(), err
    assert "Wav2Vec2ForCTC" in err and "adapter" in err, err
    with pytest.raises(ValueError, match="Wav2Vec2ForCTC.*adapter") as e:
        build_method("ebats", model=HFCTCLobe(d), source_stats=str(clean / "stats.pt"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("arch,cfg", [
    ("sew", TINY), ("sew-d", TINY_SEWD), ("wav2vec2-conformer", TINY),
    ("wav2vec2", TINY_ADAPTER),
    ("wav2vec2-bert", dict(TINY_BERT, add_adapter=True))])
def test_lame_and_t3a_read_what_the_head_reads_on_any_ctc_model(tmp_path, arch, cfg):
    """LAME and T3A need only the frozen model's logits and the last hidden state its CTC head
    reads: on models the partial forward does not cover (SEW, Conformer, filterbank input) and
    behind a strided adapter (whose output, not the encoder's, the head reads: the encoder's has
    twice the frames of the logits) they take them from the model's own forward."""
    from transformers import AutoFeatureExtractor
    d = save_random_ctc_model(str(tmp_path), 1, arch=arch, **cfg)
    fe = AutoFeatureExtractor.from_pretrained(d)
    ws = wavs(4)
    lame_m, t3a_m = (build_method(n, model=HFCTCLobe(d)) for n in ("lame", "t3a"))
    model = lame_m.lobe.model
    V = model.config.vocab_size
    for i, w in enumerate(ws):
        inputs = fe(w.numpy(), sampling_rate=16000, return_tensors="pt")   # as transformers runs it
        with torch.no_grad():
            base = getattr(model, "sew_d", None) or model.base_model    # (SEW-D's is itself)
            hidden = base(**inputs).last_hidden_state
            logits = model(**inputs).logits
            logits_, hidden_ = lame_m.prefix(lame_m.lobe.prepare(w))
        assert hidden.shape[1] == logits.shape[1]
        assert max_diff([logits_, hidden_], [logits, hidden]) < 1e-5     # waveform normalisation: rounding
        # LAME's own pass's posteriors: on an AMD EPYC the rounding above flipped a near-tied
        # frame of SEW's ('OOZ GOAOOYOGOZXG' from transformers' pass, '...XGO' from LAME's)
        want = lame.lame_posteriors(logits_[0], hidden_[0], lame_m.blank_id, **lame_m.opts)
        assert lame_m.process(w) == lame_m.lobe.decode(want.clamp(min=1e-8).log()[None])[0]
        t3a_m.process(w)
        if i == 0:       # the supports T3A added (any, when a frame is not blank) are rows of
            # the head's input for this utterance; the others are the head's own rows
            dist = lambda a, b: torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist").min(-1).values
            added = t3a_m.supports[dist(t3a_m.supports, t3a_m.W) > 1e-6]
            assert len(added) == 0 or float(dist(added, hidden[0]).max()) < 1e-5
    assert t3a_m.supports.shape[1] == model.lm_head.in_features
    assert len(t3a_m.supports) > V, "no support was ever added: the test would prove nothing"


# ----------------------------------------------------------------------------- LAME
def slow_lame(prob, feats, knn, lam, steps, tol):
    """LAME from its formulas, with Python loops: kNN by sorting each row, W symmetrised."""
    n, V = prob.shape
    W = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        d = [(float((feats[i] - feats[j]).norm()), j) for j in range(n) if j != i]
        for _, j in sorted(d)[:knn]:
            W[i, j] += 0.5
            W[j, i] += 0.5
    unary = -torch.log(prob.double() + 1e-10)
    Y = torch.softmax(-unary, -1)
    old = math.inf
    for it in range(steps):
        Y = torch.softmax(-unary + lam * W @ Y, -1)
        e = float((Y * (unary + Y.clamp(min=1e-20).log())).sum() - lam * (Y * (W @ Y)).sum())
        if it > 1 and abs(old - e) <= tol * abs(old):
            break
        old = e
    return Y


def test_lame_against_slow_reference_and_converges():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 8, generator=g) * 2
    logits[:, 0] -= 1.0                          # few likely-blank frames: all in the graph
    hidden = torch.randn(40, 6, generator=g)
    feats = F.normalize(hidden, dim=-1)
    W = lame.knn_affinity(feats, 5)
    assert torch.equal(W, W.T) and set(W.unique().tolist()) <= {0.0, 0.5, 1.0}
    Y, energies = lame.laplacian_optimization(-(logits.softmax(-1) + 1e-10).log(), W, 1.0, 100, 1e-8)
    assert len(energies) < 100, "did not converge in 100 steps"
    assert abs(energies[-1] - energies[-2]) <= 1e-8 * abs(energies[-2])
    assert energies[-1] <= energies[0] + 1e-6
    ref = slow_lame(logits.softmax(-1), feats, 5, 1.0, 100, 1e-8)
    assert torch.allclose(Y.double(), ref, atol=1e-5)
    out = lame.lame_posteriors(logits, hidden, blank_id=0)
    assert torch.allclose(out.sum(-1), torch.ones(40))


def test_lame_bound_lambda_reaches_the_iterations_and_the_method_returns_log_posteriors(setup):
    """``bound_lambda`` is the iterations' (0.5: the slow reference at 0.5, not LAME at 1), and
    the method's output is the log of LAME's posteriors (what a beam search with an LM reads),
    with the options it was built with."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(30, 6, generator=g) * 2
    logits[:, 0] -= 6                            # no likely-blank frame: every frame in the graph
    hidden = torch.randn(30, 5, generator=g)
    prob = logits.softmax(-1)
    ref = slow_lame(prob, F.normalize(hidden, dim=-1), 5, 0.5, 100, 1e-8)
    out = lame.lame_posteriors(logits, hidden, blank_id=0, bound_lambda=0.5)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert float((out - lame.lame_posteriors(logits, hidden, blank_id=0)).abs().max()) > 1e-3
    m = build(setup, "lame", bound_lambda=0.5)
    got, adapt = [], m.adapt
    m.adapt = lambda x, ctx: got.append((ctx, adapt(x, ctx))) or got[-1][1]
    m.process(wavs(1)[0])
    (logits, last), out = got[0]
    assert m.opts["bound_lambda"] == 0.5
    want = lame.lame_posteriors(logits[0], last[0], m.blank_id, **m.opts)
    assert torch.allclose(out[0], want.clamp(min=1e-8).log(), atol=1e-6)


def test_lame_leaves_blank_frames_out_and_restores_their_blank_probability():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(30, 6, generator=g)
    logits[:12, 0] += 8                          # 12 likely-blank frames, 18 others (> k + 1)
    hidden = torch.randn(30, 5, generator=g)
    prob = logits.softmax(-1)
    out = lame.lame_posteriors(logits, hidden, blank_id=0)
    # likely-blank frames have no neighbours: Y = q, then renormalised with q_blank -> q
    assert torch.allclose(out[:12], prob[:12], atol=1e-6)
    keep = prob[:, 0] <= 0.5
    ref = slow_lame(prob[keep], F.normalize(hidden[keep], dim=-1), 5, 1.0, 100, 1e-8)
    assert torch.allclose(out[keep], (ref / ref.sum(-1, keepdim=True)).float(), atol=1e-5)


def test_lame_blank_threshold_is_a_blank_probability_above_one_half():
    """Every frame whose blank probability exceeds 0.5 (blank_threshold) leaves the graph, also
    the moderately likely ones (0.5 < q_blank < 0.9): they keep q, the others are LAME's."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(30, 6, generator=g)
    logits[:12, 0] += 2.5
    hidden = torch.randn(30, 5, generator=g)
    prob = logits.softmax(-1)
    blank = prob[:, 0] > 0.5
    assert int(((prob[:, 0] > 0.5) & (prob[:, 0] < 0.9)).sum()) >= 3 and int((~blank).sum()) > 6
    out = lame.lame_posteriors(logits, hidden, blank_id=0)
    assert torch.allclose(out[blank], prob[blank], atol=1e-6)
    ref = slow_lame(prob[~blank], F.normalize(hidden[~blank], dim=-1), 5, 1.0, 100, 1e-8)
    assert torch.allclose(out[~blank], (ref / ref.sum(-1, keepdim=True)).float(), atol=1e-5)


def test_lame_on_a_mostly_blank_utterance_puts_every_frame_in_the_graph():
    """Too few non-blank frames (<= k + 1) for a graph of their own: every frame is in the graph
    (the slow reference's), then the likely-blank ones get q_blank back and rows are renormalised
    (after which their blank probability is q_blank / (q_blank + LAME's other mass), not q_blank)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(20, 6, generator=g)
    logits[:16, 0] += 6                          # 16 likely-blank frames, 4 others (< k + 1)
    hidden = torch.randn(20, 5, generator=g)
    prob = logits.softmax(-1)
    blank = prob[:, 0] > 0.5
    assert int((~blank).sum()) <= 6 and int(blank.sum()) >= 14
    ref = slow_lame(prob, F.normalize(hidden, dim=-1), 5, 1.0, 100, 1e-8)
    moved = float((ref[blank, 0] - prob[blank, 0].double()).abs().max())
    assert moved > 1e-3                          # the graph moved the blank probabilities
    ref[blank, 0] = prob[blank, 0].double()
    ref = ref / ref.sum(-1, keepdim=True)
    out = lame.lame_posteriors(logits, hidden, blank_id=0)
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_lame_restores_the_blank_probability_where_the_graph_lowered_it():
    """Likely-blank frames in the graph (too few others) whose neighbours pulled their blank
    probability down: the restore of q_blank visibly raises it again (by more than 0.01 after
    renormalising), as the slow reference with the restore gives."""
    g = torch.Generator().manual_seed(149)
    logits = torch.randn(20, 6, generator=g)
    logits[:16, 0] += 3.0
    hidden = torch.randn(20, 5, generator=g)
    prob = logits.softmax(-1)
    blank = prob[:, 0] > 0.5
    assert int((~blank).sum()) <= 6
    ref = slow_lame(prob, F.normalize(hidden, dim=-1), 5, 1.0, 100, 1e-8)
    unrestored = ref.clone()
    ref[blank, 0] = prob[blank, 0].double()
    ref = ref / ref.sum(-1, keepdim=True)
    assert float((ref - unrestored).abs().max()) > 1e-2
    out = lame.lame_posteriors(logits, hidden, blank_id=0)
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_t3a_loss_at_the_start_is_the_suta_loss_of_the_source_head(setup):
    """The reset policy's loss of T3A at the start (``values`` None) is the SUTA loss of the
    source model's own logits, whatever supports the method has gathered; at its carried
    prototypes it is the loss of the adjusted classifier."""
    lobe = HFCTCLobe(setup["model"])
    m = build_method("t3a", model=lobe, filter_K=2, temperature=2.5, em_coef=0.3)
    for w in wavs(3):
        m.process(w)
    assert len(m.supports) > len(m.W)
    x = m.lobe.prepare(wavs(4)[3])
    with torch.no_grad():
        logits = lobe(x)
        ctx = m.prefix(x)
        hidden = ctx[1]
    from tta_brain.methods import losses
    got = float(m.loss_at(ctx, None))
    assert got == pytest.approx(float(losses.suta_loss(logits, alpha=0.3, temperature=2.5,
                                                       blank_id=m.blank_id)[0]), rel=1e-5)
    protos = m.meta_values()
    adjusted = hidden @ protos[0].T + m.bias
    assert float(m.loss_at(ctx, protos)) == pytest.approx(float(losses.suta_loss(
        adjusted, alpha=0.3, temperature=2.5, blank_id=m.blank_id)[0]), rel=1e-5)
    assert abs(got - float(m.loss_at(ctx, protos))) > 1e-6


@pytest.mark.parametrize("name", ["foa", "ebats"])
def test_cma_es_loss_at_the_start_is_the_fresh_methods(setup, name):
    """The reset policy's loss at the start (``values`` None) is the loss at a fresh method's
    carried state (the search's starting mean), not at another candidate."""
    m = build(setup, name)
    x = m.lobe.prepare(wavs(1)[0])
    start = build(setup, name).meta_values()
    with torch.no_grad():
        ctx = m.prefix(x)
        got = float(m.loss_at(ctx, None))
        assert got == pytest.approx(float(m.loss_at(ctx, start)), rel=1e-6)
        other = [torch.full_like(start[0], 0.5)]
        assert abs(got - float(m.loss_at(ctx, other))) > 1e-6


def test_lame_changes_no_parameter(setup):
    m = build(setup, "lame")
    before = {k: v.clone() for k, v in m.net.state_dict().items()}
    hyps = [m.process(w) for w in wavs(3)]
    assert all(torch.equal(before[k], v) for k, v in m.net.state_dict().items())
    assert m.episodic and m.counts["adapt_backward"] == 0 and m.counts["infer_forward"] == 3
    assert any(hyps)


# ----------------------------------------------------------------------------- T3A
def test_select_supports_against_sorting():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 5, (200,), generator=g)
    ent = torch.rand(200, generator=g)
    keep = t3a.select_supports(labels, ent, 7)
    for c in range(5):
        idx = [i for i in range(200) if labels[i] == c]
        best = sorted(idx, key=lambda i: float(ent[i]))[:7]
        assert sorted(keep[labels[keep] == c].tolist()) == sorted(best)
    assert len(t3a.select_supports(labels, ent, -1)) == 200


def test_t3a_memory_stays_bounded_per_class(setup):
    m = build(setup, "t3a", filter_K=3)
    V = m.lobe.vocab_size
    for w in wavs(6):
        m.process(w)
        counts = torch.bincount(m.labels, minlength=V)
        assert int(counts.max()) <= 3 and len(m.supports) <= 3 * V
    assert len(m.supports) > V, "no support was ever added: the test would prove nothing"
    # the head's rows (entropy 1e-8) stay among the supports of their class
    for c in range(V):
        assert any(torch.equal(s, m.W[c]) for s in m.supports[m.labels == c]), c
    assert m.meta_values()[0].shape == m.W.shape


def test_t3a_adds_no_support_from_an_all_blank_utterance(setup):
    """Only an utterance with a non-blank argmax frame adds its frames as supports: one whose
    every frame is blank leaves the supports as they were (the head's V rows)."""
    m = build(setup, "t3a", filter_K=3)
    with torch.no_grad():
        m.lobe.model.lm_head.bias[m.blank_id] += 100.0   # every frame's argmax: the blank
    V = m.lobe.vocab_size
    for w in wavs(2):
        m.process(w)
    assert len(m.supports) == V and torch.equal(m.supports, m.W)


def test_t3a_logits_are_the_prototype_classifier_by_hand(setup):
    """T3A's transcript logits after each utterance, by hand: supports = the head's rows (labelled
    by their most cosine-similar row, entropy 1e-8) plus, for an utterance with a non-blank frame,
    every frame's last hidden state (its argmax label, its entropy at T = 1); each class keeps its
    filter_K lowest-entropy supports; prototype = the mean of its L2-normalised supports;
    logits = hidden @ prototypes^T + the head's bias."""
    K = 2
    lobe = HFCTCLobe(setup["model"])
    with torch.no_grad():            # a head bias to keep (the random one is zero), blank frames
        bias = 0.05 * torch.randn(lobe.vocab_size, generator=torch.Generator().manual_seed(5))
        bias[lobe.blank_id] += 0.1
        lobe.model.lm_head.bias.copy_(bias)
    m = build_method("t3a", model=lobe, filter_K=K)
    got, adapt = [], m.adapt
    m.adapt = lambda x, ctx: got.append(adapt(x, ctx)) or got[-1]
    W, b = m.net.lm_head.weight.detach(), m.net.lm_head.bias.detach()
    V = len(W)
    Wn = W / W.norm(dim=1, keepdim=True)
    pool = [(int(c), 1e-8, W[i]) for i, c in enumerate((Wn @ Wn.T).argmax(-1))]
    filtered = False
    for w in wavs(3):
        x = m.lobe.prepare(w)
        with torch.no_grad():
            hidden = m.net.wav2vec2(x)[0][0]                     # [F, H]
            logits = m.net.lm_head(hidden)
        labels = logits.argmax(-1)
        if (labels != m.blank_id).any():                         # every frame, blank ones too
            p = logits.softmax(-1)
            ent = -(p * p.log()).sum(-1)
            pool += [(int(c), float(e), h) for c, e, h in zip(labels, ent, hidden)]
        kept = []
        for c in range(V):
            mine = sorted((s for s in pool if s[0] == c), key=lambda s: s[1])
            filtered |= len(mine) > K
            kept += mine[:K]
        pool = kept
        protos = W.clone()
        for c in range(V):
            vs = [h / h.norm() for cc, _, h in pool if cc == c]
            if vs:
                protos[c] = torch.stack(vs).mean(0)
        m.process(w)
        want = hidden @ protos.T + b
        assert torch.allclose(got[-1][0], want, atol=1e-5), float((got[-1][0] - want).abs().max())
        assert torch.allclose(m.ent.sort().values, torch.tensor(sorted(e for _, e, _ in pool)),
                              rtol=1e-5)             # the kept supports' entropies, at T = 1
    assert any(c == m.blank_id and e > 1e-8 for c, e, _ in pool), "no blank frame kept"
    assert filtered, "no class ever had more than filter_K supports: the filter was not tested"
    assert len(pool) > V, "no frame was ever kept: the prototypes were the head's rows"


# ----------------------------------------------------------------------------- statistics
def test_hidden_and_token_stats_against_slow_references(setup):
    lobe = HFCTCLobe(setup["model"])
    inputs = [lobe.prepare(torch.from_numpy(sf.read(p, dtype="float32")[0])) for p in setup["clean"]]
    hid, tok = act.hidden_stats(lobe, inputs), act.token_stats(lobe, inputs)
    cnn, layers, frames = [], [], {}
    with torch.no_grad():
        for x in inputs:
            out = lobe.model(x, output_hidden_states=True)
            cnn.append(lobe.features(x)[0].mean(dim=1))
            layers.append(torch.cat([h[0].mean(dim=0) for h in out.hidden_states]))
            z = torch.cat([h[0] for h in out.hidden_states], dim=-1)
            for f, v in enumerate(out.logits[0].argmax(-1).tolist()):
                if v != lobe.blank_id:
                    frames.setdefault(v, []).append(z[f])
    s, m = torch.std_mean(torch.stack(layers), dim=0, unbiased=False)
    assert torch.allclose(hid["layers_mean"], m, atol=1e-6) and torch.allclose(hid["layers_std"], s, atol=1e-6)
    s, m = torch.std_mean(torch.stack(cnn), dim=0, unbiased=False)
    assert torch.allclose(hid["cnn_mean"], m, atol=1e-6) and torch.allclose(hid["cnn_std"], s, atol=1e-6)
    assert int(hid["n_utts"]) == len(inputs) > 1
    assert set(torch.nonzero(tok["count"])[:, 0].tolist()) == set(frames) and frames
    for v, zs in frames.items():
        s, m = torch.std_mean(torch.stack(zs), dim=0, unbiased=False)
        assert int(tok["count"][v]) == len(zs)
        assert torch.allclose(tok["mean"][v], m, atol=1e-5) and torch.allclose(tok["std"][v], s, atol=1e-4)
    unseen = tok["count"] == 0                      # never predicted: zeros, not 0 / 0
    assert unseen.any() and (tok["mean"][unseen] == 0).all() and (tok["std"][unseen] == 0).all()
    for fn in (act.hidden_stats, act.token_stats):
        with pytest.raises(ValueError, match=r"statistics: no utterances"):
            fn(lobe, [])


def test_statistic_losses_against_slow_references():
    g = torch.Generator().manual_seed(0)
    P, Fr, H, L, V = 3, 12, 4, 3, 6
    states = [torch.randn(P, Fr, H, generator=g) for _ in range(L)]
    path = torch.randint(0, V, (P, Fr), generator=g)
    path[2] = 0                                                     # all blank: loss 0
    path[1] %= 2                   # label 1 alone: the mean over its labels, not the population's
    assert set(path[1].tolist()) == {0, 1} and len(set(path[0].tolist()) - {0, 2}) > 1
    src = {"mean": torch.randn(V, L * H, generator=g), "std": torch.rand(V, L * H, generator=g),
           "count": torch.tensor([5, 3, 0, 2, 7, 1])}               # label 2 never seen: skipped
    got = act.token_alignment(states, path, src, blank_id=0)
    for p in range(P):
        z = torch.cat([h[p] for h in states], dim=-1)
        terms = []
        for v in sorted(set(path[p].tolist()) - {0, 2}):
            s, m = torch.std_mean(z[path[p] == v], dim=0, unbiased=False)
            terms.append(F.mse_loss(m, src["mean"][v]) + F.mse_loss(s, src["std"][v]))
        want = sum(terms) / len(terms) if terms else torch.tensor(0.0)
        assert torch.allclose(got[p], want, atol=1e-5), p
    means = act.layer_means(states)
    mu = torch.randn(L * H, generator=g)
    for p in range(P):
        want = sum(((states[l][p].mean(0) - mu[l * H:(l + 1) * H]) ** 2).sum() for l in range(L))
        assert torch.allclose(act.mean_alignment(means, mu)[p], want, atol=1e-5)
    w = act.confidence_weight(torch.tensor([0.0, 2.5, 5.0, 20.0]))
    assert torch.allclose(w, torch.tensor([2.0, 1.5, 1.0, 0.0]), atol=1e-6)


def test_early_stop_as_the_reference():
    stop = EarlyStop(0.001, 3, previous=math.inf)
    seq = [5.0, 4.0, 3.9995, 3.9994, 3.0, 3.0, 2.9999, 2.9999]
    fired = [stop(b) for b in seq]
    assert fired == [False, False, False, False, False, False, False, True]
    # stale means no gain over the previous generation's best (not over the best so far): a
    # worse generation, then a gain on it, clears the count
    stop = EarlyStop(0.001, 2, previous=math.inf)
    assert [stop(b) for b in (1.0, 2.0, 1.5, 1.4, 1.4, 1.4)] == [False] * 5 + [True]


@pytest.mark.parametrize("name", ["ebats", "foa"])
def test_statistics_path_expands_data_root(setup, name):
    """``--source_stats=$data_root/...`` reads the file under the run's data root."""
    m = build(setup, name, source_stats="$data_root/stats.pt", data_root=str(setup["stats"].parent))
    plain = build(setup, name)
    assert torch.equal(m.stats["hidden"]["cnn_mean"], plain.stats["hidden"]["cnn_mean"])


def test_missing_statistics_file_is_one_line_naming_the_command(setup, tmp_path):
    with pytest.raises(SourceStatsError, match=r"not found: .*nope.pt .*tta_brain.stats .*--kinds hidden,tokens") as e:
        build(setup, "ebats", source_stats=str(tmp_path / "nope.pt"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name,kinds", [("ebats", "hidden,tokens"), ("foa", "hidden")])
def test_statistics_of_another_model_are_refused_naming_the_kinds(setup, tmp_path, name, kinds):
    """Statistics made with another source model are refused in one line naming the file, and
    the command to make them again asks for this method's kinds (not EATA's fisher)."""
    other = save_ctc_model(str(tmp_path / "other"), seed=5)
    path = hidden_token_stats(tmp_path, other)
    with pytest.raises(SourceStatsError, match=rf"stats.pt: computed on another model .*--kinds "
                                               rf"{kinds} --out ") as e:
        build(setup, name, source_stats=str(path))
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- CMA-ES methods
@pytest.mark.parametrize("name,kw", [("ebats", {"popsize": 6, "generations": 3}), ("foa", {"popsize": 6})])
def test_cma_es_is_reproducible_and_batched_equals_one_at_a_time(setup, name, kw):
    runs = {}
    for key, extra in (("a", {}), ("b", {}), ("one", {"population_batch": 1}),
                       ("three", {"population_batch": 4}), ("seed", {"cma_seed": 7}),
                       ("reference", {"population_batch": 1, "shared_prefix": False})):
        m = build(setup, name, **kw, **extra)
        hyps = [m.process(w) for w in wavs(4)]
        runs[key] = (hyps, m.center().copy(), dict(m.counts))
    assert runs["a"][0] == runs["b"][0] and np.array_equal(runs["a"][1], runs["b"][1])
    assert runs["one"][0] == runs["a"][0] and runs["three"][0] == runs["a"][0]
    assert runs["reference"][0] == runs["a"][0]
    assert np.allclose(runs["one"][1], runs["a"][1], atol=1e-6)
    assert not np.allclose(runs["seed"][1], runs["a"][1]), "the seed changed nothing"
    assert runs["a"][2]["adapt_backward"] == 0 and runs["a"][2]["adapt_forward"] >= 4 * 6


def test_state_dict_resumes_identically(setup):
    for name, kw in (("ebats", {"popsize": 6, "generations": 3}), ("foa", {"popsize": 6}), ("t3a", {})):
        ws = wavs(6)
        a = build(setup, name, **kw)
        whole = [a.process(w) for w in ws]
        b = build(setup, name, **kw)
        first = [b.process(w) for w in ws[:3]]
        sd = b.state_dict()
        c = build(setup, name, **kw)
        c.load_state_dict(sd)
        assert first + [c.process(w) for w in ws[3:]] == whole, name


def test_ebats_tema_restarts_from_the_ema(setup):
    m = build(setup, "ebats", popsize=6, generations=2, ema_decay=0.5)
    m.process(wavs(1)[0])
    mean1 = m.es.mean.copy()
    assert np.allclose(m.ema["mean"], 0.5 * mean1)                   # EMA from zero, decay 0.5
    m.process(wavs(2)[1])
    assert m.ema["sigma"] != m.sigma0
    m.reset()
    assert np.array_equal(m.ema["mean"], np.zeros(m.dim)) and m.best == math.inf


def test_ebats_says_when_its_step_size_diverges(setup, tmp_path, monkeypatch, caplog):
    """The reference carries sigma forward unbounded: on the tiny model it grew 30,000,000x
    over 2,000 utterances and every transcript went empty from about 950, with only the generic
    empty-hypotheses warning. Passing SIGMA_GROWTH x its start is logged (with the utterance)
    and the end state is a run warning, in the summary; a run below it says nothing."""
    import logging
    from tta_brain.methods import ebats as ebats_module
    m = build(setup, "ebats", popsize=6, generations=2)
    m.process(wavs(1)[0])
    assert m.end_warnings() == []
    real = ebats_module.ema_update

    def runaway(ema, es, decay):             # as a search whose step size keeps growing
        real(ema, es, decay)
        ema["sigma"] *= 1000.0
    monkeypatch.setattr(ebats_module, "ema_update", runaway)
    with caplog.at_level(logging.WARNING, logger="tta_brain.methods.ebats"):
        m.process(wavs(2)[1])
        m.process(wavs(3)[2])
    said = [r.getMessage() for r in caplog.records if "passed 100x its start" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("ebats: utterance 1: ")
    assert m.end_warnings()[0].startswith("ebats: the T-EMA of CMA-ES' step size sigma reached")

    def back(ema, es, decay):                # then back to its start without a reset: still said
        real(ema, es, decay)
        ema["sigma"] = m.sigma0
    monkeypatch.setattr(ebats_module, "ema_update", back)
    m.process(wavs(4)[3])
    assert m.ema["sigma"] == m.sigma0 and m.end_warnings()
    monkeypatch.setattr(ebats_module, "ema_update", runaway)
    m.reset()                                  # a reset after it: still said (the peak)
    assert m.end_warnings() and m.ema["sigma"] == m.sigma0
    s = decode.main(args(setup, "ebats", tmp_path / "exp"))     # the summary keeps it
    assert any(w.startswith("ebats: the T-EMA of CMA-ES' step size") for w in s.warnings)
    assert "passed 100x its start" in (tmp_path / "exp" / "log.txt").read_text()


def test_ebats_divergence_warning_survives_a_resume(setup, monkeypatch):
    """The peak T-EMA sigma is part of the saved state: a run that diverged, came back below
    SIGMA_GROWTH x and was then resumed from its checkpoint still ends with the warning."""
    from tta_brain.methods import ebats as ebats_module
    real = ebats_module.ema_update
    m = build(setup, "ebats", popsize=6, generations=2)

    def runaway(ema, es, decay):
        real(ema, es, decay)
        ema["sigma"] *= 1000.0
    monkeypatch.setattr(ebats_module, "ema_update", runaway)
    m.process(wavs(1)[0])
    monkeypatch.setattr(ebats_module, "ema_update", real)
    m.ema["sigma"] = m.sigma0                  # back at its start, as after a reset
    m.process(wavs(2)[1])
    assert m.ema["sigma"] < ebats_module.SIGMA_GROWTH * m.sigma0 and m.end_warnings()
    resumed = build(setup, "ebats", popsize=6, generations=2)
    resumed.load_state_dict(m.state_dict())
    assert resumed.end_warnings() == m.end_warnings()


def test_ebats_generation_of_nan_fitness_is_told_without_numpys_warning(setup, monkeypatch):
    """A step size that overflows its candidates (sigma 1e39: float32 biases of inf) makes every
    fitness of a generation NaN; pycma's tell then took numpy's median of no value, a
    RuntimeWarning ("Mean of empty slice") in every such generation (the suite's one numpy
    warning, from the diverging search above). Now none, and the run is the same as with pycma's
    own tell: transcripts, CMA-ES state, T-EMA and the carried best fitness (NaN)."""
    import warnings
    from tta_brain.methods import ebats as ebats_module

    def run():
        m = build(setup, "ebats", sigma=1e39, popsize=6, generations=3)
        hyps = [m.process(w) for w in wavs(2)]
        return hyps, m
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hyps, m = run()
    assert math.isnan(m.best)                  # every fitness NaN: the case that warned

    def pycmas(es, cands, fit):
        es.tell(cands, fit.double().cpu().tolist())
    monkeypatch.setattr(ebats_module, "tell", pycmas)
    with pytest.warns(RuntimeWarning) as said:
        hyps_before, before = run()
    assert "Mean of empty slice." in {str(w.message) for w in said}
    assert hyps == hyps_before
    for a, b in ((m.es.mean, before.es.mean), (m.es.sm.C, before.es.sm.C),
                 (m.ema["mean"], before.ema["mean"]), (m.ema["C"], before.ema["C"]),
                 ([m.es.sigma, m.ema["sigma"], m.best],
                  [before.es.sigma, before.ema["sigma"], before.best])):
        np.testing.assert_array_equal(a, b)



def test_foa_generation_of_nan_fitness_is_told_without_numpys_warning(setup, monkeypatch):
    """FOA's generation goes through the same ``tell``: at sigma 1e39 every sampled candidate's
    fitness is NaN (float32 prompts of inf), the first utterance's best is one of them (argmin
    of NaN), and from the second utterance on every fitness, the kept best's too, is NaN: pycma's
    own tell warned ("Mean of empty slice") in each such generation. Now none, and the run is the
    same: transcripts, CMA-ES state, the kept best prompt and the activation-shift EMA."""
    import warnings
    from tta_brain.methods import foa as foa_module

    def run():
        m = build(setup, "foa", sigma=1e39, popsize=6)
        hyps = [m.process(w) for w in wavs(3)]
        return hyps, m
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hyps, m = run()

    def pycmas(es, cands, fit):
        es.tell(cands, fit.double().cpu().tolist())
    monkeypatch.setattr(foa_module, "tell", pycmas)
    with pytest.warns(RuntimeWarning) as said:
        hyps_before, before = run()
    assert "Mean of empty slice." in {str(w.message) for w in said}   # the case that warned
    assert hyps == hyps_before
    for a, b in ((m.es.mean, before.es.mean), (m.es.sm.C, before.es.sm.C),
                 (m.best_prompt, before.best_prompt), (m.hist.numpy(), before.hist.numpy()),
                 ([m.es.sigma, m.es.countiter], [before.es.sigma, before.es.countiter])):
        np.testing.assert_array_equal(a, b)

@pytest.mark.parametrize("cov_ratio", [1.0, 0.5])
def test_ebats_next_generation_is_sampled_from_the_tema_state(setup, cov_ratio):
    """The restart before an utterance acts on what pycma samples the generation from: at the
    first ``ask`` the strategy's mean and sigma are the T-EMA's, its covariance (``sm.C`` and the
    ``B D^2 B^T`` the sampler draws with) ``r EMA_C + (1 - r) I``, its evolution paths (``pc``,
    CSA's ``adapt_sigma.ps``) zero and no diagonal scaling (``sigma_vec``) left over."""
    import copy
    m = build(setup, "ebats", popsize=6, generations=2, ema_decay=0.5, cov_ratio=cov_ratio)
    m.process(wavs(1)[0])
    ema, es = copy.deepcopy(m.ema), m.es
    # the state the search ended in is not the EMA's: a restart that did nothing would show
    assert not np.allclose(es.mean, ema["mean"]) and es.sigma != ema["sigma"]
    assert not np.allclose(es.sm.C, ema["C"])
    assert np.abs(es.pc).max() > 0 and np.abs(es.adapt_sigma.ps).max() > 0
    seen, ask = [], es.ask

    def spy(*a, **k):
        sm = es.sm
        seen.append({"mean": es.mean.copy(), "sigma": es.sigma, "C": sm.C.copy(),
                     "BD": (sm.B * sm.D ** 2) @ sm.B.T, "pc": es.pc.copy(),
                     "ps": es.adapt_sigma.ps.copy(), "scaling": es.sigma_vec.scaling})
        return ask(*a, **k)
    es.ask = spy
    m.process(wavs(2)[1])
    first = seen[0]
    want_C = cov_ratio * ema["C"] + (1 - cov_ratio) * np.eye(m.dim)
    assert np.array_equal(first["mean"], ema["mean"]) and first["sigma"] == ema["sigma"]
    assert np.allclose(first["C"], want_C, rtol=0, atol=1e-12)
    assert np.allclose(first["BD"], want_C, rtol=0, atol=1e-10)     # what ask() draws with
    assert not np.any(first["pc"]) and not np.any(first["ps"])
    assert np.all(np.asarray(first["scaling"]) == 1.0)
    assert len(seen) == 2 and not np.array_equal(seen[1]["mean"], ema["mean"])   # then it moves


def test_ebats_fitness_blank_entropy_and_token_weight_by_hand(setup):
    """E-BATS' fitness on crafted candidates, by hand: a candidate without a non-blank frame has
    entropy 10 (not 0); L = H_nb(T = 2) + 2 [sum (mu_cnn - src)^2 + sum (mu_layers - src)^2 / H];
    the token loss is added with weight w = 2 - clip(L / 5, 0, 2), L that sum: one candidate with
    w in (1, 2), one in (0, 1), one clipped to 0, each with a token loss > 0."""
    m = build(setup, "ebats", popsize=4, generations=1)
    src, tokens = m.stats["hidden"], m.stats["tokens"]
    H, C, V, blank = m.pf.hidden_size, m.dim, m.lobe.vocab_size, m.blank_id
    n_states = len(src["layers_mean"]) // H
    seen = [v for v in torch.nonzero(tokens["count"])[:, 0].tolist() if v != blank]
    assert seen, "no label in the token statistics"
    P, Fr = 4, 7
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(P, Fr, V, generator=g)
    logits[0, :, blank] += 8                               # candidate 0: every frame blank
    for p in range(1, P):
        for f in range(Fr):
            logits[p, f, blank if f % 2 else seen[(p + f) % len(seen)]] += 8
    shift = [0.0, 0.0, 0.4, 1.0]                           # CNN means off the source's by this
    feats = torch.stack([src["cnn_mean"][:, None] + s + 0.3 * torch.randn(C, Fr, generator=g)
                         for s in shift])
    states = [src["layers_mean"][i * H:(i + 1) * H] + 0.5 * torch.randn(P, Fr, H, generator=g)
              for i in range(n_states)]
    got = m.fitness(logits, feats, states)
    tok = act.token_alignment(states, logits.argmax(-1), tokens, blank)
    weights = []
    for p in range(P):
        q = (logits[p] / 2.0).softmax(-1)
        ent_f = -(q * q.log()).sum(-1)
        nb = logits[p].argmax(-1) != blank
        ent = float(ent_f[nb].mean()) if nb.any() else 10.0
        align = float(((feats[p].mean(1) - src["cnn_mean"]) ** 2).sum())
        align += sum(float(((states[i][p].mean(0) - src["layers_mean"][i * H:(i + 1) * H]) ** 2)
                           .sum()) for i in range(n_states)) / H
        L = ent + 2.0 * align
        w = 2.0 - min(max(L / 5.0, 0.0), 2.0)
        weights.append(w)
        want = L + w * float(tok[p])
        assert abs(float(got[p]) - want) < 1e-5 * max(1.0, abs(want)), (p, float(got[p]), want)
    assert float(got[0]) >= 10.0                           # the 10, not entropy_loss's 0
    assert all(float(t) > 0 for t in tok[1:]), tok
    assert 1 < weights[1] < 2 and 0 < weights[2] < 1 and weights[3] == 0.0, weights


def test_foa_shifts_the_head_input_by_the_source_minus_an_ema_of_test_means(setup):
    """FOA's activation shift by hand: no shift on the first utterance; after it
    m = the population's mean (over candidates and frames) of the last hidden state, later
    m <- 0.95 m + 0.05 m_t; the transcript's logits = lm_head(h_best + 0.1 (mu_src_last - m)),
    m the EMA before the utterance, h_best the best candidate's last hidden state."""
    from tta_brain.methods import source_stats
    m = build(setup, "foa", popsize=6)
    H = m.H
    src_last = source_stats.load(str(setup["stats"])).stats["hidden"]["layers_mean"][-H:]
    seen, got = [], []
    forward, adapt = m.candidates_forward, m.adapt
    m.candidates_forward = lambda h0, z: seen.append((z, forward(h0, z))) or seen[-1][1]
    m.adapt = lambda x, ctx: got.append(adapt(x, ctx)) or got[-1]
    hist = None
    for i, w in enumerate(wavs(3)):
        seen.clear()
        m.process(w)
        (z, (_, _, last)), = seen                          # one generation, one batch
        kept = m.best_prompt.astype(np.float32)           # the best candidate, as evaluated
        best = [j for j, c in enumerate(z.numpy()) if np.array_equal(c, kept)]
        assert len(best) == 1
        h = last[best[0]]
        want = m.net.lm_head(h if hist is None else h + 0.1 * (src_last - hist))
        assert torch.allclose(got[-1][0], want, atol=1e-5), i
        if hist is not None:                               # the shift changed the logits
            assert float((m.net.lm_head(h) - want).abs().max()) > 1e-4
        mean = last.mean(dim=1).mean(dim=0)
        hist = mean if hist is None else 0.95 * hist + 0.05 * mean
        assert torch.allclose(m.hist, hist, atol=1e-6), i


# ----------------------------------------------------------------------------- the decode command
def args(setup, name, out, *extra):
    stats = [f"--source_stats={setup['stats']}"] if name in ("foa", "ebats") else []
    return [name, f"--source={setup['model']}", f"--stream_csv={setup['csv']}",
            f"--output_folder={out}", f"--data_root={setup['root']}", "--noprogressbar",
            *stats, *SMALL[name], *extra]


#: The families of the README's first paragraph (``lobes/testing.py``'s ARCHS, and UniSpeech):
#: those the partial forward runs (FOA, E-BATS and their statistics), and those with a separable
#: CNN feature encoder (CEA's coherence term).
FAMILIES = {"wav2vec2": TINY, "hubert": TINY, "data2vec-audio": TINY, "wavlm": TINY,
            "unispeech": TINY, "unispeech-sat": TINY, "sew": TINY, "sew-d": TINY_SEWD,
            "wav2vec2-conformer": TINY, "wav2vec2-bert": TINY_BERT, "parakeet": TINY_PARAKEET}
PARTIAL_FAMILIES = {"wav2vec2", "hubert", "data2vec-audio", "wavlm", "unispeech", "unispeech-sat"}


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_every_family_decodes_each_method_or_refuses_it_in_one_line(tmp_path, monkeypatch, arch):
    """README (first paragraph): any Hugging Face CTC family is a source model from a local
    directory. Through ``tta_brain.decode`` on 2 utterances: SUTA, Tent, LAME and T3A decode on
    every family; FOA and E-BATS (their statistics made with the statistics command) on the
    wav2vec 2.0-style ones, the others refused in one line naming the model, as their statistics
    are; CEA on the families with a separable CNN feature encoder (the Conformer's too), the
    others refused in one line naming the model, and decoding with ``--tc_coef=0`` (before, SEW-D,
    Wav2Vec2-BERT and Parakeet stopped with an AttributeError in CEA's second stage)."""
    from tta_brain.lobes import testing
    if arch == "parakeet":
        pytest.importorskip("librosa", reason="Parakeet's feature extractor needs librosa")
    monkeypatch.setitem(testing.ARCHS, "unispeech", ("UniSpeechConfig", "UniSpeechForCTC"))
    model = save_random_ctc_model(str(tmp_path / "model"), 0, arch=arch, **FAMILIES[arch])
    ctc_class = testing.ARCHS[arch][1]
    root = write_stream(tmp_path / "data", n=2, block=2)
    clean = write_stream(tmp_path / "clean", n=3, block=10)
    stats = tmp_path / "stats.pt"
    partial = arch in PARTIAL_FAMILIES
    assert stats_cli.main(["--source", model, "--manifest", str(clean / "stream.csv"),
                           "--data_root", str(clean), "--kinds", "hidden,tokens",
                           "--out", str(stats)]) == (0 if partial else 1)
    assert stats.exists() == partial
    common = [f"--source={model}", f"--stream_csv={root / 'stream.csv'}", f"--data_root={root}",
              "--noprogressbar"]
    small = dict(SMALL, suta=["--steps=1"], tent=["--steps=1"], cea=["--steps=1", "--steps2=1"],
                 foa=[*SMALL["foa"], f"--source_stats={stats}"],
                 ebats=[*SMALL["ebats"], f"--source_stats={stats}"])
    for name in ("suta", "tent", "cea", "lame", "t3a", "foa", "ebats"):
        out = tmp_path / name
        argv = [name, *common, f"--output_folder={out}", *small[name]]
        if name in ("foa", "ebats") and not partial or name == "cea" and (
                arch in ("sew", "sew-d", "wav2vec2-bert", "parakeet")):
            with pytest.raises(SystemExit) as e:
                decode.main(argv)
            msg = str(e.value)
            assert msg.startswith("ERROR: ") and f"{name}" in msg and "\n" not in msg, msg
            assert ctc_class in msg, msg
            assert not (out / "transcripts.csv").exists()
            if name != "cea":
                continue
            argv.append("--tc_coef=0")
        s = decode.main(argv)
        assert s.n_utts == 2 and s.n_skipped == 0, name
        assert (out / "summary.json").exists(), name
        assert len(list(csv.DictReader(open(out / "transcripts.csv")))) == 2, name


@pytest.mark.parametrize("name", ["lame", "t3a", "foa", "ebats"])
def test_compile_is_refused_in_one_line(setup, tmp_path, name):
    """Their passes (lobe.head_input, the partial forward's stages) are not the lobe's compiled
    forward: ``--compile`` decoded uncompiled and recorded ``compile: true``."""
    with pytest.raises(SystemExit, match=rf"ERROR: .*compile: true \(--compile\) is not "
                                         rf"supported by {name}") as e:
        decode.main(args(setup, name, tmp_path / "exp", "--compile"))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "exp" / "transcripts.csv").exists()


@pytest.mark.parametrize("name", ["lame", "t3a", "foa", "ebats"])
def test_decodes_20_utterances(setup, tmp_path, name):
    extra = ["--reset=fixed", "--reset_every=8"] if name != "lame" else []
    s = decode.main(args(setup, name, tmp_path / "exp", *extra))
    assert s.n_utts == 20 and s.n_skipped == 0
    rows = list(csv.DictReader(open(tmp_path / "exp" / "transcripts.csv")))
    assert len(rows) == 20 and any(r["hyp"] for r in rows)
    if name != "lame":
        assert s.resets == [8, 16]
    assert s.counts["adapt_backward"] == 0


def test_dynamic_reset_runs_on_a_free_method(setup, tmp_path):
    s = decode.main(args(setup, "ebats", tmp_path / "exp", "--reset=dynamic", "--reset_K=6",
                         "--reset_patience=1", "--reset_threshold=-100", "--ckpt_every=0"))
    assert s.n_utts == 20 and s.resets
    assert len(list(csv.DictReader(open(tmp_path / "exp" / "lii.csv")))) >= 3


def test_dynamic_reset_on_an_own_free_method_without_state_is_refused_when_built(setup):
    """A continual method of one's own on the free skeleton that defines no carried state (no
    ``center`` / ``meta_values``): the dynamic reset, whose LII needs that state, is one line
    naming the method when it is built, not a NotImplementedError after the first utterance;
    the fixed reset, which needs only ``reset()``, decodes."""
    from tta_brain.methods.free import FreeMethod

    class Sharpen(FreeMethod):
        name, episodic, needs_partial = "sharpen", False, False

        def prefix(self, x):
            return self.lobe.head_input(x)

        def adapt(self, x, ctx):
            return (ctx[0] / 0.5).log_softmax(-1)

    lobe = HFCTCLobe(setup["model"])
    with pytest.raises(ValueError, match=r"^sharpen: reset = 'dynamic' needs .*center\(\).*"
                                         r"meta_values\(\)") as e:
        Sharpen(lobe, reset_policy=make_reset_policy("dynamic", K=4))
    assert "\n" not in str(e.value)
    m = Sharpen(lobe, reset_policy=make_reset_policy("fixed", every=2))
    assert all(isinstance(m.process(w), str) for w in wavs(4))
    assert [e.position for e in m.events if e.kind == "reset"] == [2, 4]


@pytest.mark.parametrize("name", ["t3a", "foa", "ebats"])
def test_lii_losses_come_from_the_prefix_the_adaptation_reuses(setup, name):
    """A separate run with a dynamic reset: an utterance's two LII losses come from its one
    prefix, which its adaptation then reuses (T3A's prefix is the whole frozen pass), with the
    transcripts, LII values, resets and counts of losses each computed from a prefix of its own
    (the gradient skeleton's ``loss_tensor`` per loss)."""
    opts = {"t3a": {}, "foa": {"popsize": 6}, "ebats": {"popsize": 6, "generations": 2}}[name]

    def run(prefix_per_loss: bool):
        policy = make_reset_policy("dynamic", K=4, patience=1, threshold=-100.0)
        m = build(setup, name, reset_policy=policy, **opts)
        if prefix_per_loss:
            m._losses_ahead = types.MethodType(TTAMethod._losses_ahead, m)
        calls, prefix = [], m.prefix
        m.prefix = lambda x: calls.append(x) or prefix(x)
        return [m.process(w) for w in wavs(12)], m, len(calls)

    hyps, m, n_prefix = run(False)
    ref_hyps, ref, ref_n_prefix = run(True)
    lii = [e for e in m.events if e.kind == "lii"]
    assert hyps == ref_hyps and m.counts == ref.counts
    assert m.events == ref.events                   # reasons, and the LII values exactly
    assert len(lii) >= 4 and any(e.kind == "reset" for e in m.events)
    assert m.counts["aux_forward"] == 2 * len(lii)
    assert n_prefix == 12 and ref_n_prefix == 12 + 2 * len(lii)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t3a", "foa", "ebats"])
def test_kill_9_and_rerun_reproduces_the_uninterrupted_run(setup, tmp_path, name):
    ref = tmp_path / "ref"
    decode.main(args(setup, name, ref, "--ckpt_every=3"))
    out = tmp_path / "exp"
    cmd = [sys.executable, "-m", "tta_brain.decode", *args(setup, name, out, "--ckpt_every=3")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    assert_resumes_after_kill_9(cmd, out, env, ref)


@pytest.mark.parametrize("name", ["lame", "t3a", "foa", "ebats"])
def test_every_free_method_runs_through_the_stream_api(setup, tmp_path, name):
    from tta_brain.stream import TTAStream
    overrides = {"source_stats": str(setup["stats"])} if name in ("foa", "ebats") else {}
    overrides.update({"ebats": {"popsize": 6, "generations": 2}, "foa": {"popsize": 6}}.get(name, {}))
    stream = TTAStream.from_hparams(name, source=setup["model"], overrides=overrides)
    ws = wavs(4)
    first = [stream.transcribe(w) for w in ws[:2]]
    stream.save(tmp_path / "state.pt")
    rest = [stream.transcribe(w) for w in ws[2:]]
    again = TTAStream.from_hparams(name, source=setup["model"], overrides=overrides)
    again.load(tmp_path / "state.pt")
    assert [again.transcribe(w) for w in ws[2:]] == rest and all(isinstance(h, str) for h in first)
    assert stream.counts["adapt_backward"] == 0



@pytest.mark.parametrize("name,saved,other", [("foa", {"n_prompts": 3}, {"n_prompts": 2}),
                                              ("foa", {"popsize": 6}, {"popsize": 8}),
                                              ("ebats", {"popsize": 6}, {"popsize": 9})])
def test_a_stream_state_of_another_search_is_refused(setup, tmp_path, name, saved, other):
    """A CMA-ES method adapts no tensor, so a live stream's identity could not tell a state
    searched with other ``n_prompts`` or ``popsize`` from its own: the load was taken, said
    "continuing with this stream's: popsize 6 -> 8" and went on with the file's population (or,
    for another prompt count, stopped the next transcribe with a reshape RuntimeError). Now one
    line names the difference and the stream is left as it was."""
    from tta_brain.stream import StreamStateError, TTAStream
    small = {"source_stats": str(setup["stats"]), "generations": 2} if name == "ebats" else {
        "source_stats": str(setup["stats"]), "popsize": 6}
    stream = TTAStream.from_hparams(name, source=setup["model"], overrides={**small, **saved})
    stream.transcribe(wavs(1)[0])
    stream.save(tmp_path / "state.pt")
    fresh = TTAStream.from_hparams(name, source=setup["model"], overrides={**small, **other})
    es = fresh.method.es
    with pytest.raises(StreamStateError, match=re.escape(
            f"{tmp_path / 'state.pt'}: does not fit this stream's {name} (ValueError: {name}: "
            f"the state's CMA-ES search has dimension {stream.method.dim} and population "
            f"{stream.method.popsize}, this method's {fresh.method.dim} and "
            f"{fresh.method.popsize})")):
        fresh.load(tmp_path / "state.pt")
    assert fresh.method.es is es and fresh.position == 0 and fresh.method.t == 0
    assert fresh.transcribe(wavs(1)[0]) == TTAStream.from_hparams(
        name, source=setup["model"], overrides={**small, **other}).transcribe(wavs(1)[0])

@pytest.mark.slow
def test_speed_benchmark_population_modes_agree():
    import bench_speed
    res = bench_speed.main(["--population", "--n_utts", "2", "--seconds", "0.6"])
    for name in ("ebats", "foa"):
        assert set(res[name]) == {"batched", "one at a time", "reference loop"}
        assert all(r["same_transcripts"] for r in res[name].values()), name


# ----------------------------------------------------------------------------- FOA's fitness and E-BATS' T-EMA, by hand
def test_foa_fitness_by_hand(setup):
    """FOA's fitness on crafted candidates, by hand (the docstring's formula): F = 0.2 *
    sum_d (mu_layers - mu_layers_src)^2 / 64 + H_nb(T = 2.5), mu_layers the time means of every
    hidden state; the EMA of the shift takes the time mean of the LAST hidden state; the first
    utterance's logits are unshifted. Other coefficients are read from their options."""
    for kw, (coef, div, T) in (({}, (0.2, 64.0, 2.5)),
                               ({"fitness_coef": 0.5, "disc_div": 8.0, "temperature": 1.5},
                                (0.5, 8.0, 1.5))):
        m = build(setup, "foa", popsize=4, **kw)
        src = m.stats["hidden"]["layers_mean"]
        H, V, blank = m.H, m.lobe.vocab_size, m.blank_id
        n_states = len(src) // H
        P, Fr = 3, 6
        g = torch.Generator().manual_seed(5)
        logits = torch.randn(P, Fr, V, generator=g)
        for p in range(P):                             # half the frames non-blank, all candidates
            for f in range(Fr):
                logits[p, f, blank if f % 2 else (1 + (p + f) % (V - 1)) % V] += 4
        states = [src[i * H:(i + 1) * H] + (0.2 + 0.3 * i) * torch.randn(P, Fr, H, generator=g)
                  for i in range(n_states)]
        last = torch.randn(P, Fr, H, generator=g)
        m._last_means = []
        assert m.hist is None
        fit, lg = m.score((logits, states, last))
        for p in range(P):
            q = (logits[p] / T).softmax(-1)
            ent_f = -(q * q.log()).sum(-1)
            nb = logits[p].argmax(-1) != blank
            assert nb.any()
            ent = float(ent_f[nb].mean())
            disc = sum(float(((states[i][p].mean(0) - src[i * H:(i + 1) * H]) ** 2).sum())
                       for i in range(n_states))
            want = coef * disc / div + ent
            assert abs(float(fit[p]) - want) < 1e-5 * max(1.0, abs(want)), (kw, p, float(fit[p]), want)
        assert torch.equal(lg, logits)                 # no shift before the first utterance
        (means,) = m._last_means                      # the shift's EMA: the last state's mean
        assert torch.allclose(means, states[-1].mean(dim=1), atol=1e-6)


def test_foa_first_prompt_is_xavier_uniform(setup):
    """The previous-best candidate of the first utterance is the reference's Xavier-uniform
    prompt U(-sqrt(6 / 2H), sqrt(6 / 2H)): its values fill that range (n_prompts * H draws)."""
    m = build(setup, "foa", popsize=4)
    first = np.asarray(m.best_prompt)
    bound = np.sqrt(6.0 / (2 * m.H))
    assert first.shape == (m.n_prompts * m.H,)
    assert np.abs(first).max() <= bound and np.abs(first).max() > 0.8 * bound


def test_foa_keeps_the_lowest_fitness_candidate(setup):
    """FOA's fitness is a loss: the best prompt an utterance keeps is its lowest-fitness
    candidate, and the transcript's logits are that candidate's."""
    m = build(setup, "foa", popsize=6)
    seen, fits = [], []
    forward, score = m.candidates_forward, m.score
    m.candidates_forward = lambda h0, z: seen.append(z.clone()) or forward(h0, z)
    m.score = lambda out: (lambda r: fits.append(r[0].clone()) or r)(score(out))
    for w in wavs(2):
        seen.clear(), fits.clear()
        m.process(w)
        (z,), (fit,) = seen, fits
        assert len(set(fit.tolist())) == len(fit)      # a strict order
        assert np.array_equal(m.best_prompt.astype(np.float32), z[int(fit.argmin())].numpy())


def test_foa_generation_is_the_population_plus_the_previous_best(setup):
    """FOA's one generation per utterance: popsize CMA-ES samples plus the previous utterance's
    best prompt as the last candidate (the first utterance's: the Xavier-uniform prompt)."""
    P = 5
    m = build(setup, "foa", popsize=P)
    seen = []
    forward = m.candidates_forward
    m.candidates_forward = lambda h0, z: seen.append(z.clone()) or forward(h0, z)
    for w in wavs(3):
        previous = np.asarray(m.best_prompt, dtype=np.float32)
        seen.clear()
        m.process(w)
        (z,) = seen
        assert z.shape == (P + 1, m.dim)
        assert np.array_equal(z[-1].numpy(), previous)
    assert m.counts["adapt_forward"] == 3 * (P + 1)


def test_ebats_transcript_is_the_last_generations_best_candidate(setup):
    """E-BATS' output is the best candidate of the LAST generation, not the best of all its
    generations: the logits returned are the lowest-fitness candidate's of the final batch."""
    m = build(setup, "ebats", popsize=6, generations=4, patience=100)
    batches, got = [], []
    score, adapt = m.score, m.adapt
    m.score = lambda out: (lambda r: batches.append((r[0].clone(), r[1].clone())) or r)(score(out))
    m.adapt = lambda x, ctx: got.append(adapt(x, ctx)) or got[-1]
    later = 0
    for w in wavs(4):
        batches.clear()
        m.process(w)
        assert len(batches) == 4                           # no early stop: every generation
        fit, logits = batches[-1]
        assert torch.equal(got[-1][0], logits[int(fit.argmin())])
        assert m.best == float(fit.min())           # the early stop's (carried) best fitness
        later += min(float(f.min()) for f, _ in batches[:-1]) < float(fit.min())
    assert later, "the last generation was always the best: the test could not tell"


def test_ebats_tema_is_an_ema_with_its_decay(setup):
    """After an utterance the T-EMA moves by (1 - ema_decay) towards CMA-ES' state: mean,
    sigma and C = decay * EMA + (1 - decay) * state (from 0, sigma0 and I). A decay of 0.8, so
    the weights cannot be swapped unseen."""
    m = build(setup, "ebats", popsize=6, generations=2, ema_decay=0.8)
    m.process(wavs(1)[0])
    es = m.es
    assert np.allclose(m.ema["mean"], 0.2 * es.mean, rtol=0, atol=1e-12)
    assert math.isclose(m.ema["sigma"], 0.8 * m.sigma0 + 0.2 * es.sigma, rel_tol=1e-12)
    assert np.allclose(m.ema["C"], 0.8 * np.eye(m.dim) + 0.2 * es.sm.C, rtol=0, atol=1e-12)


def test_ebats_early_stop_carries_the_best_fitness_across_utterances(setup):
    """The early stop compares a generation's best fitness with the previous generation's,
    carried over from the previous utterance (``EarlyStop``): with patience 1 and a threshold no
    gain reaches, the first utterance runs 2 generations (its first improves on inf), every
    later one stops after its first."""
    P = 6
    m = build(setup, "ebats", popsize=P, generations=4, patience=1, early_stop_threshold=1e9)
    ws = wavs(3)
    m.process(ws[0])
    assert m.counts["adapt_forward"] == 2 * P and math.isfinite(m.best)
    m.process(ws[1])
    m.process(ws[2])
    assert m.counts["adapt_forward"] == 4 * P


def test_ebats_candidate_is_a_bias_on_the_last_conv_output(setup):
    """An E-BATS candidate z is an additive per-channel bias after the conv of the last CNN
    layer: its logits are the whole model's with that conv's output shifted by z (a hook)."""
    m = build(setup, "ebats", popsize=4, generations=1)
    x = m.lobe.prepare(wavs(1)[0])
    z = torch.randn(m.dim, generator=torch.Generator().manual_seed(2)) * 0.5
    conv = m.net.base_model.feature_extractor.conv_layers[-1].conv
    handle = conv.register_forward_hook(lambda mod, inp, out: out + z[None, :, None])
    try:
        with torch.no_grad():
            want = m.pf.hidden(x)[0]
    finally:
        handle.remove()
    with torch.no_grad():
        got = m.candidates_forward(m.prefix(x), z[None])[0]
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
