"""Frozen weight norms computed once (``tta_brain.lobes.weight_norm``) change nothing but the work.

On the tiny real Wav2Vec2ForCTC, whose positional convolution carries ``weight_norm``: runs with
the cache equal runs with torch's own parametrisation bit for bit (transcripts, parameters,
optimiser moments, resets, LII values) whether the layer is frozen (SUTA, DSUTA + dynamic reset)
or adapted (every parameter); the cached weight follows in-place changes, loads and dtype moves;
the state dict keeps its keys.
"""
import pytest
import torch
from torch.nn.utils.parametrizations import _WeightNorm

from conftest import build_on, max_diff
from test_speed_paths import events, items, opt_tensors, run
from tta_brain.lobes.hf_ctc import HFCTCLobe
from tta_brain.lobes.weight_norm import CachedWeightNorm
from tta_brain.methods.resets import DynamicReset


def cached_norms(lobe):
    return [m for m in lobe.modules() if isinstance(m, CachedWeightNorm)]


def uncache(lobe):
    """Put torch's own weight_norm parametrisation back (the reference path)."""
    n = 0
    for module in lobe.modules():
        for plist in getattr(module, "parametrizations", {}).values():
            for i, p in enumerate(plist):
                if isinstance(p, CachedWeightNorm):
                    plist[i] = _WeightNorm(p.dim)
                    n += 1
    assert n, "nothing to uncache: the tiny model has no weight norm"
    return lobe


def pos_conv(lobe):
    return lobe.model.base_model.encoder.pos_conv_embed.conv


def test_the_positional_convolution_is_cached(tiny_model_dir):
    lobe = HFCTCLobe(tiny_model_dir)
    assert lobe.cached_weight_norms == 1 and len(cached_norms(lobe)) == 1
    plain = uncache(HFCTCLobe(tiny_model_dir))
    assert list(lobe.state_dict()) == list(plain.state_dict())
    lobe.requires_grad_(False)
    w1, w2 = pos_conv(lobe).weight, pos_conv(lobe).weight
    assert w1 is w2 and cached_norms(lobe)[0].computed == 1
    assert torch.equal(w1, pos_conv(plain).weight)


@pytest.mark.parametrize("name,kwargs", [
    ("suta", {}),
    ("dsuta+dynamic", {"buffer_size": 2}),
    ("suta", {"adapt_params": [{"select": "all"}]}),
])
def test_runs_equal_torch_weight_norm(tiny_model_dir, utterances, name, kwargs):
    stream = items(utterances, 8 if name.endswith("dynamic") else 5)

    def build():
        k = dict(kwargs, steps=2, lr=1e-3)
        if name.endswith("dynamic"):
            k["reset_policy"] = DynamicReset(K=4, patience=1, threshold=-1e9)
        return build_on(tiny_model_dir, name.split("+")[0], **k)
    got, want = build(), build()
    uncache(want.lobe)
    assert run(got, stream) == run(want, stream)
    assert max_diff(got.params, want.params) == 0.0
    assert max_diff(opt_tensors(got.optimizer, got.params),
                    opt_tensors(want.optimizer, want.params)) == 0.0
    assert events(got) == events(want)
    if name.endswith("dynamic"):                 # a reset and LII values were compared
        assert events(got)[0] and events(got)[1]
    norm = cached_norms(got.lobe)[0]
    adapted = any("parametrizations" in n for n in got.param_names)
    # frozen: computed once for the whole run; adapted: on every pass, never from the cache
    passes = sum(got.counts[k] for k in ("adapt_forward", "infer_forward", "aux_forward"))
    assert norm.computed == (passes if adapted else 1) and passes > len(stream)
    if adapted:
        assert max_diff([pos_conv(got.lobe).weight], [pos_conv(want.lobe).weight]) == 0.0


def test_the_cache_follows_changes(tiny_model_dir):
    lobe = HFCTCLobe(tiny_model_dir).requires_grad_(False)
    conv, norm = pos_conv(lobe), cached_norms(lobe)[0]
    g, v = conv.parametrizations.weight.original0, conv.parametrizations.weight.original1
    before = conv.weight.clone()
    with torch.no_grad():
        v.mul_(1.5).add_(0.01)                            # in place, as an optimiser or a restore
    assert torch.equal(conv.weight, torch._weight_norm(v, g, norm.dim))
    assert not torch.equal(conv.weight, before)
    other = HFCTCLobe(tiny_model_dir)
    lobe.load_state_dict(other.state_dict())
    assert torch.equal(conv.weight, before)
    lobe.double()
    assert conv.weight.dtype == torch.float64
    assert torch.equal(conv.weight, torch._weight_norm(conv.parametrizations.weight.original1,
                                                       conv.parametrizations.weight.original0,
                                                       norm.dim))
    assert norm.computed == 4


def test_the_cache_follows_tensors_swapped_in(tiny_model_dir):
    """load_state_dict(assign=True) puts new g and v tensors in (their versions may equal the old
    ones'), and so does assigning g alone: the weight is theirs, not the cached one."""
    lobe = HFCTCLobe(tiny_model_dir).requires_grad_(False)
    conv, norm = pos_conv(lobe), cached_norms(lobe)[0]
    before = conv.weight.clone()
    state = {k: v.clone() for k, v in lobe.state_dict().items()}
    key = next(k for k in state
               if k.endswith("pos_conv_embed.conv.parametrizations.weight.original1"))
    state[key] = state[key] * 1.5 + 0.01
    lobe.load_state_dict(state, assign=True)
    v = conv.parametrizations.weight.original1
    assert v._version == 0 and not torch.equal(conv.weight, before)
    assert torch.equal(conv.weight, torch._weight_norm(v, conv.parametrizations.weight.original0,
                                                       norm.dim))
    g = conv.parametrizations.weight.original0       # g alone: a new tensor, the same version
    conv.parametrizations.weight.original0 = torch.nn.Parameter(g * 2.0, requires_grad=False)
    new_g = conv.parametrizations.weight.original0
    assert new_g._version == g._version and new_g.data_ptr() != g.data_ptr()
    assert torch.equal(conv.weight, torch._weight_norm(v, new_g, norm.dim))


def test_inside_a_capture_the_cache_is_read_but_never_filled(tiny_model_dir, monkeypatch):
    """CUDA capture records kernels without running them, so a weight norm first computed inside
    a capture must stay the graph's own (``tta_brain.lobes.weight_norm._capturing`` stands in for
    ``torch.cuda.is_current_stream_capturing`` here; tests/test_gpu.py runs real graphs)."""
    from tta_brain.lobes import weight_norm
    lobe = HFCTCLobe(tiny_model_dir).requires_grad_(False)
    norm, conv = cached_norms(lobe)[0], pos_conv(lobe)
    read = []
    forward = type(conv)._conv_forward
    monkeypatch.setattr(type(conv), "_conv_forward",
                        lambda self, x, w, b: read.append(w) or forward(self, x, w, b))
    x = lobe.prepare(torch.randn(8000, generator=torch.Generator().manual_seed(0)))

    def logits():
        read.clear()
        with torch.no_grad():
            out = lobe.logits(x)
        return out, any(w is norm._cached for w in read)

    monkeypatch.setattr(weight_norm, "_capturing", lambda device: True)
    captured, from_cache = logits()
    assert not from_cache and norm._cached is None and norm.computed == 1
    monkeypatch.setattr(weight_norm, "_capturing", lambda device: False)
    eager, from_cache = logits()                          # fills the cache
    assert from_cache and norm.computed == 2 and torch.equal(captured, eager)
    monkeypatch.setattr(weight_norm, "_capturing", lambda device: True)
    captured, from_cache = logits()                       # a capture now reads the cache
    assert from_cache and norm.computed == 2 and torch.equal(captured, eager)


def test_a_refresh_writes_into_the_same_tensor():
    """A change of g or v refreshes the cached weight in place: a CUDA graph captured while the
    cache was valid holds that tensor's address and must read the new values after an eager
    pass (module docstring)."""
    wn = CachedWeightNorm(dim=2)
    g, v = torch.rand(1, 1, 3) + 0.5, torch.randn(4, 2, 3)
    first = wn(g, v)
    ptr = first.data_ptr()
    with torch.no_grad():
        g.mul_(2.0)
    second = wn(g, v)
    assert second.data_ptr() == ptr
    want = v * (g / v.norm(dim=(0, 1), keepdim=True))        # weight norm over all dims but 2
    assert torch.allclose(second, want, atol=1e-6)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_stacked_rows_under_vmap_are_computed_not_cached():
    """A batched sweep's runs that adapt the layer stack g and v (``torch.func`` wrappers, no
    requires_grad under an inference vmap): each row's weight norm, computed every time."""
    from torch.func import vmap
    wn = CachedWeightNorm(dim=2)
    g, v = torch.rand(3, 1, 1, 4) + 0.5, torch.randn(3, 5, 2, 4)
    for scale in (1.0, 2.0):
        got = vmap(wn)(g * scale, v)
        for r in range(3):
            assert torch.equal(got[r], torch._weight_norm(v[r], g[r] * scale, 2))
    assert wn.computed == 2 and wn._cached is None


def test_a_norm_one_of_whose_inputs_adapts_is_differentiable():
    """A selection that adapts g alone (or v alone) must get its gradient: the cache is for a
    layer none of whose inputs needs one."""
    wn = CachedWeightNorm(dim=2)
    g, v = torch.rand(1, 1, 3) + 0.5, torch.randn(4, 2, 3)
    wn(g, v)                                                   # both frozen: cached
    for adapted in ("g", "v"):
        gi, vi = g.clone().requires_grad_(adapted == "g"), v.clone().requires_grad_(adapted == "v")
        out = wn(gi, vi)
        want = torch._weight_norm(vi, gi, 2)
        grad, = torch.autograd.grad(out.sum(), gi if adapted == "g" else vi)
        assert torch.equal(out, want)
        assert torch.equal(grad, torch.autograd.grad(want.sum(), gi if adapted == "g" else vi)[0])
