"""The optimised paths give the same transcripts and parameters as the plain reference paths.

On a tiny real Wav2Vec2ForCTC (``conftest.save_ctc_model``) and deterministic audio:

* SUTA / CSUTA / DSUTA (+ dynamic reset) with the default speed paths vs ``plain=True`` (the
  optimiser's own per-tensor loop, per-tensor gradient checks, no feature cache) and, for DSUTA,
  the first-step gradient reuse vs ``slow_grad: recompute`` (M fresh passes on phi_t, the
  official code's way);
* the per-utterance CNN feature cache (``cache_features``) vs the full forward, including the LII
  losses of the dynamic reset, and the architectures it supports (wav2vec2 group/layer norm,
  HuBERT, data2vec-audio);
* the CPU backward without oneDNN (``cpu_native_backward``) vs with it: same transcripts,
  gradients equal to rounding;
* the ``foreach`` optimiser-state copies of ``tta_brain.methods.state`` vs per-tensor loops;
* bf16 autocast runs and the fp16 loss scale is undone exactly;
* ``tools/bench_speed.py`` runs end to end (counts only: it is not a timed test).
"""
import json
import os

import pytest
import torch
from torch import nn

from conftest import max_diff
from tta_brain.lobes.hf_ctc import HFCTCLobe
from tta_brain.methods import UttInfo
from tta_brain.methods.resets import DynamicReset
from tta_brain.methods.state import copy_optimizer_state, snapshot, zero_optimizer_state
from tta_brain.lobes.testing import TINY, save_random_ctc_model

TOL = 1e-6



def items(utterances, n):
    return [(utterances[i % len(utterances)], UttInfo(id=f"u{i}", position=i, domain="d"))
            for i in range(n)]


def run(method, stream):
    return [method.process(w, info) for w, info in stream]


def opt_tensors(opt, params):
    return [v for p in params for k, v in sorted(opt.state[p].items()) if torch.is_tensor(v)]


def events(m):
    """Resets exactly; LII values to TOL."""
    resets = [e for e in m.events if e.kind == "reset"]
    lii = [(e.position, e.reason) for e in m.events if e.kind == "lii"]
    return resets, lii, [e.value for e in m.events if e.kind == "lii"]


def assert_same_run(a, b, hyps_a, hyps_b, meta=False):
    assert hyps_a == hyps_b
    assert max_diff(a.params, b.params) <= TOL
    assert max_diff(opt_tensors(a.optimizer, a.params), opt_tensors(b.optimizer, b.params)) <= TOL
    if meta:
        assert max_diff(a.meta, b.meta) <= TOL
        assert max_diff(opt_tensors(a.slow_optimizer, a.meta),
                        opt_tensors(b.slow_optimizer, b.meta)) <= TOL
        ra, la, va = events(a)
        rb, lb, vb = events(b)
        assert ra == rb and la == lb
        assert all(abs(x - y) <= TOL for x, y in zip(va, vb))


# ----------------------------------------------------------------------------- SUTA / CSUTA
@pytest.mark.parametrize("name", ["suta", "csuta"])
def test_suta_fast_paths_equal_plain(make, utterances, source_values, name):
    kw = dict(steps=3, lr=1e-3)
    fast, plain = make(name, **kw), make(name, plain=True, **kw)
    assert fast.optimizer.param_groups[0]["foreach"] is True
    assert plain.optimizer.param_groups[0]["foreach"] is False
    assert not fast.features.enabled                   # layernorm + cnn: the CNN is adapted
    stream = items(utterances, 4)
    assert_same_run(fast, plain, run(fast, stream), run(plain, stream))
    assert max_diff(fast.params, source_values(fast)) > 1e-4      # it did adapt
    assert fast.counts == plain.counts


# ----------------------------------------------------------------------------- DSUTA
@pytest.mark.parametrize("threshold", [2.0, -1e9])   # -1e9: every test detects -> resets
@pytest.mark.parametrize("steps", [2, 0])
def test_dsuta_reuse_equals_plain_recompute(make, utterances, threshold, steps):
    M, n = 2, 10

    def build(**kw):
        return make("dsuta", steps=steps, buffer_size=M, lr=1e-3,
                    reset_policy=DynamicReset(K=4, patience=1, threshold=threshold), **kw)
    fast = build()
    plain = build(plain=True, slow_grad="recompute")
    stream = items(utterances, n)
    assert_same_run(fast, plain, run(fast, stream), run(plain, stream), meta=True)
    resets, lii, _ = events(fast)
    assert len(lii) >= 4                              # LII at t = 3..6 at least (K = 4)
    if threshold < 0:
        assert resets                                  # the reset path was exercised
    # reuse: N passes per utterance (1 with N = 0); the reference pays M fresh passes per slow
    # update (updates = full buffers that did not end in a reset) instead of the N = 0 pass
    n_updates = n // M - len(resets)
    assert fast.counts["adapt_forward"] == fast.counts["adapt_backward"] == (steps or 1) * n
    assert plain.counts["adapt_forward"] == plain.counts["adapt_backward"] == steps * n + M * n_updates
    assert fast.counts["aux_forward"] == plain.counts["aux_forward"]


def test_dsuta_recompute_state_dict_round_trip(make, utterances):
    kw = dict(steps=1, buffer_size=3, lr=1e-3, slow_grad="recompute")
    stream = items(utterances, 5)
    full = make("dsuta", **kw)
    hyps = run(full, stream)
    first = make("dsuta", **kw)
    run(first, stream[:4])                            # one utterance in the buffer
    rest = make("dsuta", **kw)
    rest.load_state_dict(first.state_dict())
    assert len(rest.buffer_x) == 1
    assert run(first, stream[4:]) == run(rest, stream[4:]) == hyps[4:]
    assert max_diff(rest.meta, full.meta) == 0


# ----------------------------------------------------------------------------- CNN feature cache
LN_ONLY = ({"select": "layernorm"},)


@pytest.mark.parametrize("name,kw", [
    ("suta", dict(steps=3)),
    ("dsuta", dict(steps=2, buffer_size=2, reset_policy=None)),
    ("dsuta+dynamic", dict(steps=2, buffer_size=2)),
])
def test_feature_cache_equals_full_forward(make, utterances, name, kw):
    base = name.split("+")[0]
    kw = dict(kw, lr=1e-3, adapt_params=LN_ONLY)

    def build(**extra):
        k = dict(kw, **extra)
        if name.endswith("dynamic"):
            k["reset_policy"] = DynamicReset(K=4, patience=1, threshold=-1e9)
        return make(base, **k)
    cached, plain = build(), build(plain=True)
    off = build(cache_features="off")
    assert cached.features.enabled and not plain.features.enabled and not off.features.enabled
    calls = []
    orig = cached.lobe.features
    cached.lobe.features = lambda x: calls.append(x.shape) or orig(x)
    stream = items(utterances, 7)
    hyps = run(cached, stream)
    assert_same_run(cached, plain, hyps, run(plain, stream), meta=base == "dsuta")
    assert_same_run(cached, off, hyps, run(off, stream), meta=base == "dsuta")
    assert len(calls) == len(stream)                 # the CNN ran once per utterance
    assert cached.features._feats is None            # ... and the cache was dropped after it
    if name.endswith("dynamic"):
        assert cached.counts["aux_forward"] > 0


def test_feature_cache_auto_off_when_the_cnn_adapts(make):
    assert not make("suta").features.enabled                                 # paper: layernorm + cnn
    assert not make("suta", adapt_params=({"select": "feature_extractor"},)).features.enabled
    assert make("suta", adapt_params=({"select": "feature_projection"},)).features.enabled
    assert not make("source").features.enabled
    assert not make("awmc", adapt_params=LN_ONLY + ({"select": "feature_extractor"},)
                    ).features.enabled                              # its CNN adapts
    with pytest.raises(ValueError, match="feature-encoder parameters are adapted"):
        make("suta", cache_features="on")
    assert make("suta", cache_features="on",                              # on where it is exact
                adapt_params=({"select": "feature_projection"},)).features.enabled


def test_feature_cache_in_train_mode_where_the_cnn_draws_nothing(make, utterances):
    """AWMC adapts in train mode by default (the tiny model's dropouts of 0.1 and SpecAugment
    draw). Its feature encoder draws nothing, so its CNN features are computed once per utterance
    for the anchor, leader, chaser and prediction passes, and a run seeded alike equals the
    uncached run bit for bit (the same draws in the same order). A dropout module in the feature
    encoder keeps the cache off in train mode, and ``cache_features: on`` then says why."""
    import numpy as np
    kw = dict(steps=2, lr=1e-3)
    cached, off = make("awmc", **kw), make("awmc", cache_features="off", **kw)
    assert cached.train_mode and cached.lobe.train_draws()
    assert cached.features.enabled and not off.features.enabled
    calls = []
    orig = cached.lobe.features
    cached.lobe.features = lambda x: calls.append(x.shape) or orig(x)
    stream = items(utterances, 5)
    hyps = []
    for m in (cached, off):
        torch.manual_seed(0)
        np.random.seed(0)                          # SpecAugment's masks are numpy's draws
        hyps.append(run(m, stream))
    assert hyps[0] == hyps[1]
    assert max_diff(cached.params, off.params) == 0.0
    assert max_diff(cached.leader, off.leader) == 0.0
    assert cached.counts == off.counts
    assert len(calls) == len(stream)               # once per utterance, not 2 + 2 x steps
    assert max_diff(cached.params, cached.source) > 0     # it did adapt
    m = make("awmc", **kw)
    m.lobe.model.base_model.feature_extractor.conv_layers[0].add_module("drop", nn.Dropout(0.1))
    assert m.lobe.feature_cache_blocker(m.params, True) == (
        "train_mode (the feature encoder draws in train mode: conv_layers.0.drop (p=0.1))")
    assert m.lobe.feature_cache_blocker(m.params, False) is None


POS16 = dict(num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2)
ARCHS = {
    "wav2vec2-layer-stable": ("wav2vec2", dict(feat_extract_norm="layer", do_stable_layer_norm=True,
                                               **POS16)),
    "hubert": ("hubert", dict(feat_extract_norm="group", **POS16)),
    "wavlm": ("wavlm", dict(feat_extract_norm="group", **POS16)),
    "data2vec-audio": ("data2vec-audio", dict(num_conv_pos_embeddings=2, conv_pos_kernel_size=5,
                                              num_conv_pos_embedding_groups=2)),
    # the strided adapter after the encoder (its frames: half as many)
    "wav2vec2-adapter": ("wav2vec2", dict(add_adapter=True, adapter_stride=2, adapter_kernel_size=3,
                                          num_adapter_layers=1, output_hidden_size=32, **POS16)),
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_from_features_identical(arch, tmp_path):
    family, extra = ARCHS[arch]
    cfg = {k: v for k, v in TINY.items() if k not in POS16}
    lobe = HFCTCLobe(save_random_ctc_model(str(tmp_path / arch), 0, arch=family, **cfg, **extra))
    assert lobe.supports_features
    x = lobe.prepare(torch.randn(9000, generator=torch.Generator().manual_seed(1)))
    with torch.no_grad():
        assert torch.equal(lobe(x), lobe(None, features=lobe.features(x)))


# ----------------------------------------------------------------------------- CPU backward kernels
def test_cpu_native_backward_matches_onednn(make, utterances):
    """cpu_native_backward (default) vs oneDNN: gradients equal to rounding, same transcripts."""
    native, onednn = make("suta", steps=3, lr=1e-3), make("suta", steps=3, lr=1e-3,
                                                          cpu_native_backward=False)
    assert torch.backends.mkldnn.enabled
    grads, during = [], []               # oneDNN's flag while each backward runs
    for m in (native, onednn):
        x = m.lobe.prepare(utterances[0])
        hook = m.params[0].register_hook(lambda g: during.append(torch.backends.mkldnn.enabled))
        m.adapt_step(x, after_backward=lambda m=m: grads.append(snapshot([p.grad for p in m.params])))
        hook.remove()
    assert during == [False, True]
    assert torch.backends.mkldnn.enabled                          # the flag is restored
    torch.backends.mkldnn.enabled = False           # as it was: a user's own "off" stays off
    try:
        native.adapt_step(native.lobe.prepare(utterances[0]))
        assert not torch.backends.mkldnn.enabled
    finally:
        torch.backends.mkldnn.enabled = True
    scale = max(float(g.abs().max()) for g in grads[1])
    assert max_diff(grads[0], grads[1]) <= 1e-4 * scale
    stream = items(utterances, 3)
    assert run(native, stream) == run(onednn, stream)


def test_a_failed_backward_restores_onednn():
    """oneDNN's process-wide flag comes back when the native-kernel backward raises (a method's
    error, a second backward through a freed graph): the rest of the process keeps oneDNN."""
    from tta_brain.lobes.runtime import Runtime
    p = nn.Parameter(torch.randn(4))
    loss = p.exp().sum()
    Runtime().backward(loss, [p], torch.device("cpu"))
    try:
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            Runtime().backward(loss, [p], torch.device("cpu"))
        assert torch.backends.mkldnn.enabled
    finally:
        torch.backends.mkldnn.enabled = True


# ----------------------------------------------------------------------------- state copies
def _loop_copy(src, src_params, dst, dst_params):
    """The per-tensor reference of copy_optimizer_state."""
    for ps, pd in zip(src_params, dst_params):
        s, d = src.state[ps], dst.state[pd]
        if not s:
            for v in d.values():
                if torch.is_tensor(v):
                    v.zero_()
            continue
        for k, v in s.items():
            d[k] = v.clone() if torch.is_tensor(v) else v


def _stepped_opt(params, seed, steps=2):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return opt


def test_copy_and_zero_optimizer_state_match_loops():
    shapes = [(4, 3), (3,), (2, 2, 5)]
    mk = lambda: [torch.nn.Parameter(torch.zeros(s)) for s in shapes]  # noqa: E731
    sp, dp, rp = mk(), mk(), mk()
    src, dst, ref = _stepped_opt(sp, 0, 3), _stepped_opt(dp, 1), _stepped_opt(rp, 1)
    before = [v.data_ptr() for v in opt_tensors(dst, dp)]
    copy_optimizer_state(src, sp, dst, dp)
    _loop_copy(src, sp, ref, rp)
    assert max_diff(opt_tensors(dst, dp), opt_tensors(ref, rp)) == 0
    assert [v.data_ptr() for v in opt_tensors(dst, dp)] == before          # in place
    assert all(float(dst.state[p]["step"]) == 3 for p in dp)
    # a never-stepped source zeroes the destination; zero_optimizer_state zeroes everything
    fresh = torch.optim.AdamW(mk(), lr=1e-2)
    copy_optimizer_state(fresh, fresh.param_groups[0]["params"], dst, dp)
    assert all(float(v.abs().max()) == 0 for v in opt_tensors(dst, dp))
    zero_optimizer_state(src)
    assert all(float(v.abs().max()) == 0 for v in opt_tensors(src, sp))
    # into an empty destination: cloned, not aliased
    sp2 = mk()
    src2 = _stepped_opt(sp2, 2)
    empty = torch.optim.AdamW(mk(), lr=1e-2)
    ep = empty.param_groups[0]["params"]
    copy_optimizer_state(src2, sp2, empty, ep)
    assert max_diff(opt_tensors(empty, ep), opt_tensors(src2, sp2)) == 0
    assert not {v.data_ptr() for v in opt_tensors(empty, ep)} & {
        v.data_ptr() for v in opt_tensors(src2, sp2)}


# ----------------------------------------------------------------------------- mixed precision
def test_bf16_autocast_runs_and_fp16_scale_is_undone(make, utterances):
    m = make("suta", steps=2, lr=1e-3, precision="bf16")
    dtypes = set()                       # the forward runs in the precision asked for
    m.lobe.model.lm_head.register_forward_hook(lambda mod, i, o: dtypes.add(o.dtype))
    hyp = m.process(utterances[0])
    assert dtypes == {torch.bfloat16}
    assert isinstance(hyp, str) and m.counts["skipped_steps"] == 0
    assert all(torch.isfinite(p).all() for p in m.params)
    # fp16: without a loss scale small activation gradients underflow; the scaled backward,
    # unscaled before the checks and the update, is much closer to the float32 gradient
    a = make("suta", steps=1, lr=1e-3, precision="fp16")
    b = make("suta", steps=1, lr=1e-3, precision="fp16", loss_scale=1.0)
    ref = make("suta", steps=1, lr=1e-3)
    assert a.runtime.scale == 4096 and b.runtime.scale == 1
    grads = []
    for m in (a, b, ref):
        x = m.lobe.prepare(utterances[1])
        m.adapt_step(x, after_backward=lambda m=m: grads.append(snapshot([p.grad for p in m.params])))
    scale = max(float(g.abs().max()) for g in grads[2])
    err_scaled, err_unscaled = max_diff(grads[0], grads[2]), max_diff(grads[1], grads[2])
    assert err_scaled < 0.01 * scale and 10 * err_scaled < err_unscaled


def test_fp16_backward_skips_parameters_without_a_gradient():
    """A selected parameter the loss does not reach (``masked_spec_embed`` in eval mode under
    ``select: all``) has no gradient: the unscaled gradients are those of the others."""
    from tta_brain.lobes.runtime import Runtime
    used, unused = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(2))
    grads = Runtime(precision="fp16").backward((used ** 2).sum(), [used, unused],
                                               torch.device("cpu"))
    assert len(grads) == 1 and torch.allclose(grads[0], 2 * used.detach())


def test_feature_cache_runs_in_the_forwards_precision(make, utterances):
    """Under bf16 the cached CNN features are computed in the autocast of the passes they stand
    for: a cached run equals the uncached one bit for bit."""
    kw = dict(steps=2, lr=1e-3, precision="bf16", adapt_params=({"select": "feature_projection"},))
    cached, off = make("suta", **kw), make("suta", cache_features="off", **kw)
    assert cached.features.enabled and not off.features.enabled
    stream = items(utterances, 3)
    assert run(cached, stream) == run(off, stream)
    assert max_diff(cached.params, off.params) == 0.0


@pytest.mark.skipif(not os.environ.get("TTA_TEST_COMPILE"),
                    reason="torch.compile takes minutes on CPU; set TTA_TEST_COMPILE=1")
def test_compiled_forward_same_transcripts(make, utterances):
    kw = dict(steps=2, buffer_size=2, lr=1e-3, reset_policy=DynamicReset(K=4, patience=1))
    eager = make("dsuta", **kw)
    kw["reset_policy"] = DynamicReset(K=4, patience=1)
    compiled = make("dsuta", compile=True, **kw)
    stream = items(utterances, 6)
    assert run(eager, stream) == run(compiled, stream)
    assert max_diff(eager.meta, compiled.meta) < 1e-4    # fused kernels: not bit-identical


# ----------------------------------------------------------------------------- benchmark script
def test_bench_speed_runs(tiny_model_dir, tmp_path, capsys):
    import bench_speed
    out = tmp_path / "bench.json"
    res = bench_speed.main(["--model", tiny_model_dir, "--n_utts", "3", "--seconds", "0.6",
                            "--repeats", "1", "--warmup", "6", "--json", str(out)])
    printed = capsys.readouterr().out
    for m in ("source", "suta", "dsuta", "dsuta+dynamic", "overhead"):
        assert m in printed
    c = {m: r["counts_per_utt"] for m, r in res.items()}
    assert c["suta"] == dict(adapt_forward=10, adapt_backward=10, infer_forward=1, aux_forward=0)
    assert c["dsuta"] == dict(adapt_forward=5, adapt_backward=5, infer_forward=1, aux_forward=0)
    assert c["dsuta+dynamic"]["aux_forward"] == 2 and c["dsuta+dynamic"]["adapt_forward"] == 5
    assert c["source"]["infer_forward"] == 1 and c["source"]["adapt_forward"] == 0
    data = json.loads(out.read_text())
    assert set(data["methods"]) == {"source", "suta", "dsuta", "dsuta+dynamic"}
    assert data["methods"]["suta"]["wall"]["ratio_to_suta"] == 1.0
    assert {"wall", "cpu"} <= set(data["methods"]["dsuta"])
    assert "overhead_frac" in data["methods"]["dsuta"]["wall"]


@pytest.mark.slow
def test_bench_memory_runs(tmp_path, capsys):
    """The memory benchmark's whole path (generated model, decode children, windows, the control
    loop) on a few utterances; its figures are for a person to read, not asserted."""
    import bench_memory
    out = tmp_path / "mem.json"
    for extra in ([], ["--control"]):
        rc = bench_memory.main(["--lengths", "4", "8", "--window", "4", "--tolerance_mb", "1000",
                                "--slope_tolerance", "1000", "--workdir", str(tmp_path / "w"),
                                "--json", str(out), *extra])
        printed = capsys.readouterr().out
        assert rc == 0 and "median RSS per 4-utterance window" in printed and "FLAT" in printed
        data = json.loads(out.read_text())
        assert [r["n"] for r in data["results"]] == [4, 8]
        assert len(data["results"][1]["trace"]) == 8 and "tail_slope" in data["results"][1]


def test_feature_cache_follows_its_input_without_a_clear():
    """The cache is keyed on the input tensor: another utterance's input gets its own features
    even where the caller forgot to clear (the methods clear after every utterance)."""
    from types import SimpleNamespace
    from tta_brain.lobes.runtime import FeatureCache, Runtime
    lobe = SimpleNamespace(device=torch.device("cpu"), features=lambda x: x * 2)
    fc = FeatureCache(lobe, enabled=True, runtime=Runtime())
    a, b = torch.ones(3), torch.full((3,), 5.0)
    assert fc.get(a) is fc.get(a) and torch.equal(fc.get(a), a * 2)
    assert torch.equal(fc.get(b), b * 2)
    assert FeatureCache(lobe, enabled=False, runtime=Runtime()).get(a) is None
