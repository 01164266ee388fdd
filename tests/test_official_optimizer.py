"""``param_collection: official``: the optimiser sees exactly what the official code's sees.

The reference is built the way the official SUTA / Dynamic SUTA code builds it
(``SUTASystem.collect_params`` / ``setup_optimizer`` / ``DSUTAStrategy`` in
hhhaaahhhaa/Dynamic-SUTA, restated here): walk ``named_modules()``; a LayerNorm's weight and bias
are appended when they do not require grad yet; every module whose dotted name has
``feature_extractor`` or ``feature_projection`` as its second component appends all its
parameters (recursive, unguarded); then ``torch.optim.AdamW(list, lr, weight_decay=0)``, which on
the GPU the official code runs on resolves to the ``foreach`` implementation. SUTA: the model and
the optimiser back to their initial snapshot before every utterance, N x (zero_grad, loss,
backward, step). DSUTA: a fast and a slow system; the fast one loads the slow one's model and
optimiser state (``load_state_dict``) before every utterance; every M utterances the slow one
accumulates ``(L_i / M).backward()`` over the buffer and takes one step.
"""
import copy
import io
import warnings
from functools import partial

import pytest
import torch
from torch import nn

from conftest import build_on
from tta_brain.methods import losses
from tta_brain.lobes.hf_ctc import HFCTCLobe
from tta_brain.methods import UttInfo
from tta_brain.methods.optim import build_optimizer
from tta_brain.methods.optim import RepeatedAdam
from tta_brain.methods.params import (Selection, describe_selection, official_entries, param_groups,
                              select_parameters)
from tta_brain.lobes.testing import TINY, save_random_ctc_model

OFFICIAL = ({"select": "layernorm"}, {"select": "cnn"}, {"param_collection": "official"})
CLEAN = ({"select": "layernorm"}, {"select": "cnn"})
POS16 = dict(num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2)
ARCHS = {
    "wav2vec2-group": ("wav2vec2", dict(feat_extract_norm="group", **POS16)),
    "wav2vec2-layer-stable": ("wav2vec2", dict(feat_extract_norm="layer", do_stable_layer_norm=True,
                                               conv_bias=True, **POS16)),
    "hubert": ("hubert", dict(feat_extract_norm="group", **POS16)),
    "hubert-no-proj-ln": ("hubert", dict(feat_extract_norm="group", feat_proj_layer_norm=False,
                                         **POS16)),
    "data2vec-audio": ("data2vec-audio", dict(num_conv_pos_embeddings=2, conv_pos_kernel_size=5,
                                              num_conv_pos_embedding_groups=2)),
}


def official_list(model):
    """The official collection, restated (train_LN and train_feature on, bias_only off)."""
    model.requires_grad_(False)
    params, names = [], []
    for nm, m in model.named_modules():
        if isinstance(m, nn.LayerNorm):
            for pn, p in m.named_parameters():
                if pn in ("weight", "bias") and not p.requires_grad:
                    p.requires_grad = True
                    params.append(p)
                    names.append(f"{nm}.{pn}")
        parts = nm.split(".")
        if len(parts) > 1 and parts[1] in ("feature_extractor", "feature_projection"):
            for pn, p in m.named_parameters():
                p.requires_grad = True
                params.append(p)
                names.append(f"{nm}.{pn}")
    return params, names


def ebats_list(model):
    """The E-BATS reference's ``collect_params`` (TTAs-1/systems/GradientBasedSystem.py, its
    CEA's first stage: train_LN and train_feature on, bias_only off), restated: the same walk,
    but a LayerNorm's weight and bias are appended whenever the rule meets it."""
    params, names = [], []
    for nm, m in model.named_modules():
        if isinstance(m, nn.LayerNorm):
            for pn, p in m.named_parameters():
                if pn in ("weight", "bias"):
                    params.append(p)
                    names.append(f"{nm}.{pn}")
        parts = nm.split(".")
        if len(parts) > 1 and parts[1] in ("feature_extractor", "feature_projection"):
            for pn, p in m.named_parameters():
                params.append(p)
                names.append(f"{nm}.{pn}")
    return params, names


EBATS = ({"select": "layernorm"}, {"select": "cnn"}, {"param_collection": "ebats"})


def official_adamw(params, lr):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*duplicate parameters.*")
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=True)


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory):
    cfg = {k: v for k, v in TINY.items() if k not in POS16}
    root = tmp_path_factory.mktemp("archs")
    return {a: save_random_ctc_model(str(root / a), 0, arch=fam, **cfg, **extra)
            for a, (fam, extra) in ARCHS.items()}


# ----------------------------------------------------------------------------- the list
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_official_list_equals_the_official_collection(arch, arch_models):
    net = HFCTCLobe(arch_models[arch]).model
    sel = select_parameters(net, OFFICIAL)
    ref = HFCTCLobe(arch_models[arch]).model
    ref_params, ref_names = official_list(ref)
    entries = sel.entries()
    assert [n for n, _, _ in entries] == ref_names              # same entries, same order
    ref_by_id = {id(p): n for n, p in ref.named_parameters()}
    assert [ref_by_id[id(p)] for p in ref_params] == ref_names  # (the names are the tensors')
    live = dict(net.named_parameters())
    assert all(p is live[n] for n, p, _ in entries)             # our entries: the live tensors
    # each tensor once in the selection (what the method adapts), in model order = clean mode
    clean = select_parameters(net, CLEAN)
    assert [n for n, _, _ in sel] == [n for n, _, _ in clean]
    assert [p for _, p, _ in sel] == [p for _, p, _ in clean]
    assert clean.collection == "clean" and clean.repeats == [1] * len(clean)
    # repeats from the module tree: one per module from feature_* down to the owner
    for (n, _, _), k in zip(sel, sel.repeats):
        parts = n.split(".")
        if parts[1] in ("feature_extractor", "feature_projection"):
            assert k == len(parts) - 2, n
        else:
            assert k == 1, n
    assert len(sel.order) == len(ref_names) > len(sel)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_ebats_list_equals_the_references_collection(arch, arch_models):
    net = HFCTCLobe(arch_models[arch]).model
    sel = select_parameters(net, EBATS)
    _, ref_names = ebats_list(HFCTCLobe(arch_models[arch]).model)
    assert [n for n, _, _ in sel.entries()] == ref_names and sel.collection == "ebats"
    assert [p for _, p, _ in sel] == [p for _, p, _ in select_parameters(net, CLEAN)]
    official = select_parameters(net, OFFICIAL)
    ln = {n for n, _, _ in sel if "layer_norm" in n and ("feature_projection" in n
                                                        or "feature_extractor" in n)}
    for (n, _, _), k, ko in zip(sel, sel.repeats, official.repeats):
        is_ln = isinstance(net.get_submodule(n.rpartition(".")[0]), nn.LayerNorm)
        assert k == ko + (is_ln and n in ln), n      # a LayerNorm under feature_* once more


def test_wav2vec2_group_norm_repeats_by_hand(arch_models):
    net = HFCTCLobe(arch_models["wav2vec2-group"]).model
    sel = select_parameters(net, OFFICIAL)
    rep = {n: k for (n, _, _), k in zip(sel, sel.repeats)}
    fe = "wav2vec2.feature_extractor.conv_layers"
    assert rep[f"{fe}.0.conv.weight"] == 4 and rep[f"{fe}.2.conv.weight"] == 4
    assert rep[f"{fe}.0.layer_norm.weight"] == 4 and rep[f"{fe}.0.layer_norm.bias"] == 4  # GroupNorm
    assert rep["wav2vec2.feature_projection.layer_norm.weight"] == 2
    assert rep["wav2vec2.feature_projection.projection.bias"] == 2
    assert rep["wav2vec2.encoder.layer_norm.weight"] == 1
    assert rep["wav2vec2.encoder.layers.1.final_layer_norm.bias"] == 1
    # the E-BATS reference's list: its LayerNorm rule unguarded (GroupNorm is no LayerNorm)
    sel = select_parameters(net, EBATS)
    rep = {n: k for (n, _, _), k in zip(sel, sel.repeats)}
    assert rep[f"{fe}.0.conv.weight"] == 4 and rep[f"{fe}.0.layer_norm.weight"] == 4
    assert rep["wav2vec2.feature_projection.layer_norm.weight"] == 3
    assert rep["wav2vec2.feature_projection.projection.bias"] == 2
    assert rep["wav2vec2.encoder.layer_norm.weight"] == 1


def test_collection_entry_is_validated_and_described(arch_models):
    net = HFCTCLobe(arch_models["wav2vec2-group"]).model
    with pytest.raises(ValueError, match="Bad adapt_params entry"):
        select_parameters(net, [{"select": "layernorm"}, {"param_collection": "paper"}])
    with pytest.raises(ValueError, match="Bad adapt_params entry"):
        select_parameters(net, [{"param_collection": "official", "select": "cnn"}])
    with pytest.raises(ValueError, match="2 times"):
        select_parameters(net, ["cnn", {"param_collection": "clean"},
                                {"param_collection": "official"}])
    with pytest.raises(ValueError, match="empty"):
        select_parameters(net, [{"param_collection": "official"}])
    text = describe_selection(net, OFFICIAL)
    assert "param_collection official: 38 optimiser entries for 19 tensors (5 x4, 4 x2, 10 x1)" in text
    assert "param_collection" not in describe_selection(net, CLEAN)
    # a selection beyond the official rules: encoder biases enter once, the CNN still repeats
    sel = select_parameters(net, ["encoder_bias", "feature_extractor",
                                  {"param_collection": "official"}])
    names = [n for n, _, _ in sel.entries()]
    assert names.count("wav2vec2.encoder.layers.0.attention.q_proj.bias") == 1
    assert names.count("wav2vec2.feature_extractor.conv_layers.1.conv.weight") == 4
    assert not any("feature_projection" in n for n in names)
    with pytest.raises(ValueError, match="not parameters"):
        official_entries(net, [torch.nn.Parameter(torch.zeros(1))])


# ----------------------------------------------------------------------------- the optimiser
def _grads(shapes, g):
    return [torch.randn(s, generator=g) for s in shapes]


@pytest.mark.parametrize("cls,wd", [(torch.optim.AdamW, 0.0), (torch.optim.AdamW, 0.1),
                                    (torch.optim.Adam, 0.1)])
def test_repeated_adam_is_torch_foreach_over_the_repeated_list(cls, wd):
    """Bit-identical to torch 2.11's AdamW/Adam(foreach=True) over a list with real repeats;
    torch only warns about the duplicates; its per-tensor loop (foreach=False) differs."""
    g = torch.Generator().manual_seed(0)
    shapes, ks = [(5, 3), (7,), (4, 4, 2), (3,)], [4, 1, 2, 3]
    start = [torch.randn(s, generator=g) for s in shapes]
    ref, loop, ours = ([nn.Parameter(t.clone()) for t in start] for _ in range(3))
    rep = lambda ps: [p for p, k in zip(ps, ks) for _ in range(k)]
    with pytest.warns(UserWarning, match="duplicate parameters"):
        o_ref = cls(rep(ref), lr=1e-2, weight_decay=wd, foreach=True)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        o_loop = cls(rep(loop), lr=1e-2, weight_decay=wd, foreach=False)
    o_ours = RepeatedAdam([{"params": ours, "repeats": ks}], lr=1e-2, weight_decay=wd,
                          decoupled_weight_decay=cls is torch.optim.AdamW)
    for _ in range(6):
        grads = _grads(shapes, g)
        for ps in (ref, loop, ours):
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
        o_ref.step(), o_loop.step(), o_ours.step()
    assert all(torch.equal(a, b) for a, b in zip(ref, ours))
    for a, b in zip(ref, ours):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(o_ref.state[a][key], o_ours.state[b][key])
    assert float(o_ours.state[ours[0]]["step"]) == 6 * 4              # k steps per step
    assert torch.equal(ref[1], loop[1])                               # once: the same
    assert not torch.equal(ref[0], loop[0])                           # repeated: not the same
    # sequential (param_collection: ebats): torch's per-tensor loop, bit for bit
    o_seq = RepeatedAdam([{"params": (seq := [nn.Parameter(t.clone()) for t in start]),
                           "repeats": ks}], sequential=True, lr=1e-2, weight_decay=wd,
                         decoupled_weight_decay=cls is torch.optim.AdamW)
    o_loop2 = None
    with pytest.warns(UserWarning, match="duplicate parameters"):
        o_loop2 = cls(rep(loop2 := [nn.Parameter(t.clone()) for t in start]), lr=1e-2,
                      weight_decay=wd, foreach=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        grads = _grads(shapes, g)
        for ps in (seq, loop2):
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
        o_seq.step(), o_loop2.step()
    assert all(torch.equal(a, b) for a, b in zip(loop2, seq))
    for a, b in zip(loop2, seq):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(o_loop2.state[a][key], o_seq.state[b][key])
    # state_dict round trip keeps the repeats
    o2 = RepeatedAdam([{"params": [nn.Parameter(t.clone()) for t in start], "repeats": ks}],
                      lr=1e-2, weight_decay=wd, decoupled_weight_decay=cls is torch.optim.AdamW)
    o2.load_state_dict(o_ours.state_dict())
    assert o2.param_groups[0]["repeats"] == ks


@pytest.mark.parametrize("device", [False, True])
def test_repeated_adam_groups_without_gradients_and_mixed_dtypes(device):
    """Several groups (one per lr), a group whose tensors have no gradient in a step, a tensor
    without one, float32 and float64 tensors in one group (host): torch's foreach Adam over the
    list with the repeats, bit for bit, also on the device path (``to_device``; here on CPU)."""
    g = torch.Generator().manual_seed(0)
    other = torch.float32 if device else torch.float64   # the device's scalars are float32
    start = [torch.randn(5, generator=g), torch.randn(3, 2, generator=g, dtype=other),
             torch.randn(4, generator=g), torch.randn(2, generator=g, dtype=other)]
    ks, lrs, group_of = [3, 2, 1, 2], [1e-2, 3e-2], [0, 0, 1, 1]
    ref, ours = ([nn.Parameter(t.clone()) for t in start] for _ in range(2))
    groups = lambda ps, rep: [{"params": [p for p, k, i in zip(ps, ks, group_of) if i == j
                                          for _ in range(k if rep else 1)], "lr": lr}
                              for j, lr in enumerate(lrs)]
    with pytest.warns(UserWarning, match="duplicate parameters"):
        o_ref = torch.optim.AdamW(groups(ref, True), lr=1e-2, weight_decay=0.0, foreach=True)
    o_ours = RepeatedAdam([dict(gr, repeats=[k for k, i in zip(ks, group_of) if i == j])
                           for j, gr in enumerate(groups(ours, False))],
                          lr=1e-2, weight_decay=0.0, decoupled_weight_decay=True)
    if device:
        o_ours.to_device()
    # which tensors get a gradient: all; group 0 none; one of each group; all
    for has in ([1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 0], [1, 1, 1, 1]):
        for p_ref, p_ours, t, h in zip(ref, ours, start, has):
            gr = torch.randn(t.shape, generator=g, dtype=t.dtype) if h else None
            p_ref.grad, p_ours.grad = gr, None if gr is None else gr.clone()
        o_ref.step(), o_ours.step()
        assert all(torch.equal(a, b) for a, b in zip(ref, ours))
    for a, b in zip(ref, ours):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(o_ref.state[a][key].cpu(), o_ours.state[b][key].cpu())


def test_build_optimizer_official(arch_models):
    net = HFCTCLobe(arch_models["wav2vec2-group"]).model
    sel = select_parameters(net, [{"select": "layernorm", "lr_mult": 1.0},
                                  {"select": "cnn", "lr_mult": 3.0},
                                  {"param_collection": "official"}])
    opt = build_optimizer(None, sel, 1e-3)
    assert isinstance(opt, RepeatedAdam)
    assert [g["lr"] for g in opt.param_groups] == [3e-3, 1e-3]
    assert sum(sum(g["repeats"]) for g in opt.param_groups) == len(sel.order) == 38
    assert opt.defaults["weight_decay"] == 0.0 and opt.defaults["decoupled_weight_decay"]
    opt = build_optimizer(partial(torch.optim.AdamW, weight_decay=0.01, eps=1e-6,
                                  betas=(0.8, 0.99)), sel, 1e-3)
    assert opt.defaults["weight_decay"] == 0.01 and opt.defaults["eps"] == 1e-6
    assert all(g["betas"] == (0.8, 0.99) for g in opt.param_groups)     # the factory's, not Adam's
    with pytest.raises(ValueError, match="Adam/AdamW"):
        build_optimizer(partial(torch.optim.SGD), sel, 1e-3)
    with pytest.raises(ValueError, match="amsgrad"):
        build_optimizer(partial(torch.optim.AdamW, amsgrad=True), sel, 1e-3)
    with pytest.raises(ValueError, match="one repeat count >= 1 per tensor"):   # never updated
        RepeatedAdam([{"params": [nn.Parameter(torch.zeros(2))], "repeats": [0]}], lr=1e-3)
    with pytest.raises(ValueError, match="lr must be a float"):     # a group's, which torch lets by
        RepeatedAdam([{"params": [nn.Parameter(torch.zeros(2))], "lr": torch.tensor(1e-3)}],
                     lr=1e-3)
    # a group added later gets its repeats (1 per tensor) and the same checks; a refused group
    # is not kept
    p, q = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    opt = RepeatedAdam([{"params": [p], "repeats": [2]}], lr=1e-2)
    opt.add_param_group({"params": [q]})
    assert opt.param_groups[-1]["repeats"] == [1]
    (p.sum() + q.sum()).backward()
    opt.step()                                          # a group without "repeats" would fail here
    assert torch.allclose(q, torch.full((3,), 1 - 1e-2)) and p[0] < q[0]    # p stepped twice
    for bad, why in (({"repeats": [0]}, "one repeat count"), ({"lr": torch.tensor(1.)}, "float")):
        with pytest.raises(ValueError, match=why):
            opt.add_param_group(dict({"params": [nn.Parameter(torch.zeros(1))]}, **bad))
        assert len(opt.param_groups) == 2
    # clean: unchanged (a plain AdamW, no repeats key)
    opt = build_optimizer(None, select_parameters(net, CLEAN), 1e-3)
    assert type(opt) is torch.optim.AdamW and "repeats" not in opt.param_groups[0]
    # the same selection over other tensors keeps the repeats (DSUTA's meta-parameters)
    moved = sel.on([p.detach().clone() for _, p, _ in sel])
    assert moved.order == sel.order and moved.collection == "official"
    assert isinstance(moved, Selection)


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_build_optimizer_runs_adam_and_adamw_foreach(arch_models, cls):
    """A clean selection's Adam or AdamW built with foreach=None runs torch's foreach
    implementation (its groups and its defaults, which a group added later takes); an explicit
    foreach=False is kept."""
    net = HFCTCLobe(arch_models["wav2vec2-group"]).model
    sel = select_parameters(net, [{"select": "layernorm", "lr_mult": 2.0}, {"select": "cnn"}])
    opt = build_optimizer(partial(cls), sel, 1e-3)
    assert type(opt) is cls and sorted(g["lr"] for g in opt.param_groups) == [1e-3, 2e-3]
    assert all(g["foreach"] is True for g in opt.param_groups) and opt.defaults["foreach"] is True
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    assert opt.param_groups[-1]["foreach"] is True
    opt = build_optimizer(partial(cls, foreach=False), sel, 1e-3)
    assert not any(g["foreach"] for g in opt.param_groups) and opt.defaults["foreach"] is False


# ----------------------------------------------------------------------------- SUTA / DSUTA end to end
LR, STEPS, N_UTT = 2e-3, 3, 6


def _stream(utterances, n=N_UTT):
    return [(utterances[i % len(utterances)], UttInfo(id=f"u{i}", position=i, domain="d"))
            for i in range(n)]


def _ours(model_dir, name, groups=OFFICIAL, **kw):
    return build_on(model_dir, name, adapt_params=groups, lr=LR, steps=STEPS,
                    cache_features="off", cpu_native_backward=False, **kw)


class OfficialSystem:
    """One ``SUTASystem`` of the official code: a model, its collected list, AdamW over it."""

    def __init__(self, model_dir):
        self.lobe = HFCTCLobe(model_dir)          # for the input normalisation and decoding only
        self.model = self.lobe.model
        self.model.eval()
        self.params, _ = official_list(self.model)
        self.opt = official_adamw(self.params, LR)

    def loss(self, x):
        return losses.suta_loss(self.model(x).logits, blank_id=self.lobe.blank_id).mean()

    def adapt(self, x):
        self.model.zero_grad()
        self.loss(x).backward()
        self.opt.step()
        self.model.zero_grad()

    @torch.no_grad()
    def infer(self, x):
        return self.lobe.decode(self.model(x).logits)[0]

    def snapshot(self):
        return copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.opt.state_dict())

    def load(self, snap):
        self.model.load_state_dict(copy.deepcopy(snap[0]))
        self.opt.load_state_dict(copy.deepcopy(snap[1]))

    def unique_state(self):
        seen, out = set(), []
        for p in self.params:
            if id(p) not in seen:
                seen.add(id(p))
                out.append((p, self.opt.state[p]))
        return out


def _names_values(net, names):
    params = dict(net.named_parameters())
    return [params[n].detach() for n in names]


def test_suta_official_equals_the_official_code(tiny_model_dir, utterances):
    items = _stream(utterances)
    ref = OfficialSystem(tiny_model_dir)
    init = ref.snapshot()
    ref_hyps = []
    for wav, _ in items:
        ref.load(init)                                 # load_snapshot("init")
        x = ref.lobe.prepare(wav)
        for _ in range(STEPS):
            ref.adapt(x)
        ref_hyps.append(ref.infer(x))
    ours = _ours(tiny_model_dir, "suta")
    hyps = [ours.process(w, i) for w, i in items]
    assert hyps == ref_hyps
    want = _names_values(ref.model, ours.param_names)
    assert all(torch.equal(p, w) for p, w in zip(ours.params, want))          # bit-identical
    # the moments of the last utterance, tensor by tensor
    ref_state = {id(p): s for p, s in ref.unique_state()}
    ref_by_name = dict(ref.model.named_parameters())
    for n, p in zip(ours.param_names, ours.params):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.optimizer.state[p][key], ref_state[id(ref_by_name[n])][key])
    assert float(ours.optimizer.state[ours.params[0]]["step"]) == STEPS * 4   # conv: 4 entries
    # the clean mode is measurably different on the same stream (the test can tell them apart)
    clean = _ours(tiny_model_dir, "suta", groups=CLEAN)
    [clean.process(w, i) for w, i in items]
    diff = max(float((a.detach() - b).abs().max()) for a, b in zip(clean.params, want))
    assert diff > 1e-4


@pytest.mark.parametrize("slow_grad", ["reuse", "recompute"])
@pytest.mark.parametrize("literal", [True, False])
def test_dsuta_official_equals_the_official_code(tiny_model_dir, utterances, slow_grad, literal):
    """M = 3. ``literal``: the official slow gradient, sum_i grad(L_i / M) (the 1/M enters the
    backward, so it equals ours, (sum_i grad L_i) / M, to rounding); otherwise the reference
    divides the accumulated gradient by M after the backward passes: bit-identical."""
    M = 3
    items = _stream(utterances, 7)
    fast, slow = OfficialSystem(tiny_model_dir), OfficialSystem(tiny_model_dir)
    start = slow.snapshot()
    memory, ref_hyps = [], []
    for t, (wav, _) in enumerate(items, 1):
        fast.load(start)                               # fast starts from the slow model + moments
        x = fast.lobe.prepare(wav)
        for _ in range(STEPS):
            fast.adapt(x)
        ref_hyps.append(fast.infer(x))
        memory.append(x)
        if t % M == 0:                                 # suta_adapt_auto(batch_size=1)
            slow.load(start)
            slow.model.zero_grad()
            for xb in memory:
                (slow.loss(xb) / len(memory) if literal else slow.loss(xb)).backward()
            if not literal:
                with torch.no_grad():
                    for p in set(slow.params):
                        p.grad /= len(memory)
            slow.opt.step()
            slow.model.zero_grad()
            start = slow.snapshot()
            memory.clear()
    ours = _ours(tiny_model_dir, "dsuta", buffer_size=M, slow_grad=slow_grad)
    hyps = [ours.process(w, i) for w, i in items]
    assert hyps == ref_hyps
    tol = 2e-5 if literal else 0.0        # rounding: 1% of the lr (measured: <= 1.2e-5)

    def close(a, b):
        return max(float((x.detach().double() - y.detach().double()).abs().max())
                   for x, y in zip(a, b)) <= tol
    assert close(ours.meta, _names_values(slow.model, ours.param_names))
    assert close(ours.params, _names_values(fast.model, ours.param_names))
    for opt, tensors, system in ((ours.slow_optimizer, ours.meta, slow),
                                 (ours.optimizer, ours.params, fast)):
        ref_state = {id(p): s for p, s in system.unique_state()}
        by_name = dict(system.model.named_parameters())
        for n, p in zip(ours.param_names, tensors):
            s, r = opt.state[p], ref_state[id(by_name[n])]
            assert float(s["step"]) == float(r["step"])
            assert close([s["exp_avg"], s["exp_avg_sq"]], [r["exp_avg"], r["exp_avg_sq"]])
    # 2 slow updates: a conv tensor's slow step count is 2 x 4; the fast one continued from it
    conv = ours.param_names.index("wav2vec2.feature_extractor.conv_layers.0.conv.weight")
    assert float(ours.slow_optimizer.state[ours.meta[conv]]["step"]) == 2 * 4
    assert float(ours.optimizer.state[ours.params[conv]]["step"]) == 2 * 4 + STEPS * 4
    # resume: the official optimisers survive a state_dict round trip
    again = _ours(tiny_model_dir, "dsuta", buffer_size=M, slow_grad=slow_grad)
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    buf.seek(0)
    again.load_state_dict(torch.load(buf, weights_only=False))
    more = _stream(utterances, 9)[7:]          # utterance 9 completes a buffer
    assert [again.process(w, i) for w, i in more] == [ours.process(w, i) for w, i in more]
    assert all(torch.equal(a, b) for a, b in zip(again.meta, ours.meta))


def test_sdpl_and_csuta_take_the_official_collection(tiny_model_dir, utterances):
    for name in ("sdpl", "csuta"):
        m = _ours(tiny_model_dir, name)
        assert isinstance(m.optimizer, RepeatedAdam)
        assert sum(sum(g["repeats"]) for g in m.optimizer.param_groups) == 38
        m.process(*_stream(utterances, 1)[0])
        assert m.counts["skipped_steps"] == 0


@pytest.mark.parametrize("name", ["cea", "suta"])
def test_ebats_collection_is_the_references_optimiser(tiny_model_dir, utterances, name):
    """CEA (and the E-BATS benchmark's SUTA) with ``param_collection: ebats`` == the method whose
    (first-stage) optimiser is the reference's own: ``torch.optim.AdamW(collect_params list,
    foreach=False)`` over the list with its repeats (torch warns about them); bit for bit on CPU,
    over 3 episodic utterances; and not the clean list's numbers."""
    kw = dict(steps=2, steps2=2, lr=1e-2, lr2=1e-2) if name == "cea" else dict(steps=3, lr=1e-2)
    ours = build_on(tiny_model_dir, name, adapt_params=EBATS, **kw)
    ref = build_on(tiny_model_dir, name, adapt_params=CLEAN, **kw)
    clean = build_on(tiny_model_dir, name, adapt_params=CLEAN, **kw)
    assert isinstance(ours.optimizer, RepeatedAdam) and ours.optimizer.sequential
    params, _ = ebats_list(ref.net)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        ref.optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0, foreach=False)
    for i in range(3):
        u = utterances[i % len(utterances)]
        hyps = [m.process(u) for m in (ours, ref, clean)]
        assert hyps[0] == hyps[1]
        adapted = [dict(m.net.named_parameters()) for m in (ours, ref, clean)]
        # the last utterance's adapted weights (episodic: restored at the next one's start)
        assert all(torch.equal(adapted[0][n], adapted[1][n]) for n in adapted[0])
    assert any(not torch.equal(adapted[0][n], adapted[2][n]) for n in adapted[0])


def test_packaged_yamls_expose_param_collection():
    from tta_brain.hparams import __file__ as hp
    import os
    d = os.path.dirname(hp)
    for name in ("suta", "csuta", "sdpl", "dsuta", "cea"):
        text = open(os.path.join(d, f"{name}.yaml")).read()
        assert "\nparam_collection: clean " in text, name
        assert "- param_collection: !ref <param_collection>" in text, name
    assert param_groups([], 1.0) == []
