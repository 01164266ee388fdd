"""A real-size model: random weights in the exact facebook/wav2vec2-base-960h architecture.

Checks what the tiny models cannot: the parameter count of the source model (~94.4M), the size
of the default adapted set (LayerNorm + CNN + feature projection, ~4.6M as in the official
code), and that a SUTA step and a DSUTA slow update run end to end on it (1 s of audio).
"""

import pytest
import torch
from torch import nn

from tta_brain.lobes.hf_ctc import HFCTCLobe
from tta_brain.lobes.testing import BASE_960H, save_random_ctc_model
from tta_brain.methods import build_method

pytestmark = pytest.mark.slow   # end to end: python -m pytest -m 'not slow' leaves it out

@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_random_ctc_model(str(tmp_path_factory.mktemp("w2v2_base_960h_random")), 0,
                                 **BASE_960H)


@pytest.fixture
def lobe(base_dir):
    """The model loaded for one test (one model per method: a second method is refused)."""
    return HFCTCLobe(base_dir)


def one_second(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(16000) / 16000
    return (0.3 * torch.sin(2 * torch.pi * 180 * t) * (1 + torch.sin(2 * torch.pi * 3 * t))
            + 0.05 * torch.randn(16000, generator=g))


def expected_adapted(net):
    """LayerNorm (nn.LayerNorm only) + feature_extractor + feature_projection, by module walk."""
    ids = {}
    for mn, mod in net.named_modules():
        if isinstance(mod, nn.LayerNorm) or ".feature_extractor" in f".{mn}" \
                or ".feature_projection" in f".{mn}":
            for p in mod.parameters(recurse=False):
                ids[id(p)] = p
    return sum(p.numel() for p in ids.values())


def test_base_960h_architecture(lobe):
    cfg = lobe.model.config
    for k, v in BASE_960H.items():
        got = getattr(cfg, k)
        assert (tuple(got) if isinstance(got, list) else got) == v, k
    n = sum(p.numel() for p in lobe.model.parameters())
    assert 94_000_000 < n < 95_000_000, n
    assert n == 94_396_320                      # facebook/wav2vec2-base-960h
    assert lobe.vocab_size == 32 and lobe.blank_id == 0 and lobe.word_delimiter_id == 4
    assert not lobe.use_attention_mask and lobe.do_normalize
    assert int(lobe.output_lengths(torch.tensor(16000))) == 49


def test_suta_and_dsuta_on_the_real_size_model(lobe, base_dir):
    wav = one_second()
    net = lobe.model
    # ---- SUTA: one step
    suta = build_method("suta", model=lobe, steps=1, lr=2e-5)
    assert 4.0e6 <= suta.num_adapted <= 5.0e6, suta.num_adapted
    assert suta.num_adapted == expected_adapted(net)
    names = set(suta.param_names)
    assert not any(".attention." in n or ".feed_forward." in n or "pos_conv_embed" in n
                   or n.startswith("lm_head") for n in names)
    assert sum(p.numel() for p in net.parameters() if p.requires_grad) == suta.num_adapted
    x = lobe.prepare(wav)
    before = suta.loss_with(None, x)
    hyp = suta.process(wav)
    assert isinstance(hyp, str)
    assert suta.counts["adapt_backward"] == 1 and suta.counts["skipped_steps"] == 0
    changed = [not torch.equal(p, s) for p, s in zip(suta.params, suta.source)]
    assert all(changed)                          # Adam moves every adapted tensor
    assert suta.loss_with(suta.params, x) < before
    frozen = dict(net.named_parameters())["wav2vec2.encoder.layers.0.attention.q_proj.weight"]
    assert not frozen.requires_grad

    # ---- DSUTA: M = 1, N = 1: the slow update happens after the first utterance
    suta.reset()                                 # back to the checkpoint values
    assert all(torch.equal(p, s) for p, s in zip(suta.params, suta.source))
    dsuta = build_method("dsuta", model=HFCTCLobe(base_dir), steps=1, buffer_size=1, lr=2e-5)
    assert dsuta.num_adapted == suta.num_adapted
    source = [m.clone() for m in dsuta.meta]
    assert all(torch.equal(a, b) for a, b in zip(source, suta.source))
    assert isinstance(dsuta.process(wav), str)
    assert all(not torch.equal(m, s) for m, s in zip(dsuta.meta, source))   # meta updated
    assert all(not torch.equal(p, s) for p, s in zip(dsuta.params, source))  # fast params
    assert dsuta.n_buffered == 0
    assert dsuta.counts == {"adapt_forward": 1, "adapt_backward": 1, "infer_forward": 1,
                            "aux_forward": 0, "skipped_steps": 0}


def test_official_collection_on_the_real_size_model(lobe):
    """param_collection: official on wav2vec2-base: 63 tensors, 94 optimiser entries (conv weights
    and GroupNorm 4x, feature projection 2x), 4,633,856 parameters; the entries are the official
    code's list (restated as in tests/test_official_optimizer.py) in its order."""
    from tta_brain.methods.optim import RepeatedAdam
    from tta_brain.methods.params import select_parameters
    net = lobe.model
    groups = [{"select": "layernorm"}, {"select": "cnn"}, {"param_collection": "official"}]
    sel = select_parameters(net, groups)
    assert len(sel) == 63 and len(sel.order) == 94
    assert sum(p.numel() for _, p, _ in sel) == 4_633_856 == expected_adapted(net)
    assert sorted(sel.repeats).count(4) == 9 and sorted(sel.repeats).count(2) == 4
    names = []
    for nm, m in net.named_modules():
        if isinstance(m, nn.LayerNorm):
            names += [f"{nm}.{pn}" for pn, _ in m.named_parameters()
                      if not any(f"{nm}.{pn}" == n for n in names)]
        if len(nm.split(".")) > 1 and nm.split(".")[1] in ("feature_extractor", "feature_projection"):
            names += [f"{nm}.{pn}" for pn, _ in m.named_parameters()]
    assert [n for n, _, _ in sel.entries()] == names
    suta = build_method("suta", model=lobe, steps=1, lr=2e-5, adapt_params=groups)
    assert isinstance(suta.optimizer, RepeatedAdam)
    assert sum(len(g["params"]) for g in suta.optimizer.param_groups) == 63
    assert sum(sum(g["repeats"]) for g in suta.optimizer.param_groups) == 94
    assert suta.num_adapted == 4_633_856
    suta.reset()


def test_padded_pass_on_the_real_size_model(lobe):
    """The length buckets' padded pass at wav2vec2-base size (512-channel GroupNorm, 12 layers):
    1.47 s padded to its 25 % bucket (1.58 s, 5 frames more) gives the unpadded logits, SUTA loss
    and gradients (LayerNorm + CNN) to rounding."""
    import torch.nn.functional as F
    from tta_brain.gpu.graphs import bucket_length
    from tta_brain.methods import losses
    g = torch.Generator().manual_seed(0)
    t = torch.arange(23456) / 16000
    wav = (0.3 * torch.sin(2 * torch.pi * 180 * t) * (1 + torch.sin(2 * torch.pi * 3 * t))
           + 0.05 * torch.randn(23456, generator=g))
    x = lobe.prepare(wav)
    n = x.shape[-1]
    padded = F.pad(x, (0, bucket_length(n, 0.25, lobe.frame_stride, 16000) - n))
    assert padded.shape[-1] > n
    params = [p for name, p in lobe.model.named_parameters()
              if "layer_norm" in name or "feature_extractor" in name or "feature_projection" in name]
    lobe.model.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    try:
        ref = lobe.logits(x)
        loss_ref = losses.suta_loss(ref).mean()
        g_ref = torch.autograd.grad(loss_ref, params)
        logits, frames = lobe.padded_logits(padded, torch.tensor([n]))
        loss = losses.suta_loss(logits, frames).mean()
        g_pad = torch.autograd.grad(loss, params)
    finally:
        lobe.model.requires_grad_(False)
    T = ref.shape[1]
    assert int(frames) == T and logits.shape[1] > T
    assert (logits[:, :T] - ref).abs().max() < 2e-5
    assert torch.equal(logits[:, :T].argmax(-1), ref.argmax(-1))
    assert abs(float(loss.detach()) - float(loss_ref.detach())) < 1e-5
    for a, b in zip(g_ref, g_pad):
        assert (a - b).norm() <= 1e-4 * a.norm() + 1e-12
