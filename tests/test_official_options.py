"""Options that reproduce the official code where the paper's Algorithm 2 or our defaults differ:

* ``reset_lii_count``: the LII values that make the dynamic reset's Gaussian: ``paper`` (Algorithm
  2, r + K/2 < t <= r + K) or ``official`` (the official ``DynamicResetSystem`` collects while
  r + K/2 <= t < r + K and saves phi_D at t = r + K/2: r + K/2 < t < r + K);
* SDPL ``train_mode``: the official ``SDPLStrategy`` decodes the pseudo label in eval mode and
  takes the CTC step in train mode.
"""
import os
import statistics

import pytest
import torch

from conftest import build_on, reference_copy
from tta_brain import hparams
from tta_brain.methods import losses
from tta_brain.asr.ctc import collapse
from tta_brain.methods import UttInfo
from tta_brain.methods.resets import DynamicReset, make_reset_policy


class Fake:
    """What a reset policy may use (meta_values, loss_with, events); LII_t = planted[t]."""

    def __init__(self, planted):
        self.meta, self.events, self.planted, self.t = [torch.zeros(1)], [], planted, 0

    def meta_values(self):
        return self.meta

    def loss_with(self, values, x):
        return 0.0 if values is None else self.planted(self.t)


def drive(policy, planted, n, M):
    """The calls DSUTA makes (M utterances per meta-update); returns the reset times."""
    fake = Fake(planted)
    policy.bind(fake)
    resets = []
    for t in range(1, n + 1):
        fake.t = t
        info = UttInfo(position=t - 1)
        policy.before_utterance(info)
        policy.after_utterance(t, None, info)
        if t % M == 0:
            if policy.at_update(t):
                resets.append(t)
                policy.on_reset(t)
        policy.end_step(t)
    return fake, resets


@pytest.mark.parametrize("count,K,M", [("paper", 10, 5), ("official", 10, 5),
                                       ("paper", 100, 5), ("official", 100, 5),
                                       ("paper", 7, 1), ("official", 7, 1)])
def test_lii_positions_collected(count, K, M):
    """The Gaussian is fitted from LII_t at exactly these t (r = 0): paper r+K/2 < t <= r+K,
    official r+K/2 < t < r+K."""
    pol = DynamicReset(K=K, patience=2, lii_count=count)
    fake, _ = drive(pol, lambda t: float(t), K, M)        # LII_t = t: stats = the positions
    k = K // 2
    want = list(range(k + 1, K + 1 if count == "paper" else K))
    assert len(want) == (K - k if count == "paper" else K - k - 1)
    assert pol.mu == pytest.approx(statistics.mean(want))
    assert pol.sigma == pytest.approx(statistics.stdev(want))
    stages = {e.position + 1: e.reason for e in fake.events if e.kind == "lii"}
    assert [t for t, r in sorted(stages.items()) if r == "construction"] == want
    assert min(stages) == k + 1                           # LII from r + K/2 + 1 on, both modes
    if count == "official":
        assert stages[K] == "detection"                   # computed, not in the Gaussian


@pytest.mark.parametrize("count", ["paper", "official"])
def test_lii_positions_after_a_reset(count):
    """Second stage after a reset at r = 20 (K = 10, M = 5): stats from t in (25, 30] or (25, 30)."""
    K, M = 10, 5
    planted = lambda t: 100.0 if 11 <= t <= 20 else float(t % 3)   # shift right after stage 1
    pol = DynamicReset(K=K, patience=2, lii_count=count)
    fake, resets = drive(pol, planted, 30, M)
    assert resets == [20]
    after = sorted(e.position + 1 for e in fake.events if e.kind == "lii"
                   and e.reason == "construction" and e.position + 1 > 20)
    assert after == (list(range(26, 31)) if count == "paper" else list(range(26, 30)))
    assert pol.mu == pytest.approx(statistics.mean(t % 3 for t in after))


def test_lii_count_options():
    assert make_reset_policy("dynamic", K=10).lii_count == "paper"
    assert make_reset_policy("dynamic", K=10, lii_count="official").lii_count == "official"
    # the yaml rules (tta_brain.hparams) refuse K = 4 with the official count (1 value)
    for K, count, ok in ((4, "paper", True), (4, "official", False), (5, "official", True)):
        values = {"reset": "dynamic", "reset_K": K, "reset_lii_count": count}
        if ok:
            hparams.check("dsuta.yaml", values)
        else:
            with pytest.raises(hparams.HparamsError, match="reset_K = 4 with reset_lii_count = "
                                                           "official is not valid"):
                hparams.check("dsuta.yaml", values)
    from tta_brain.hparams import __file__ as hp
    text = open(os.path.join(os.path.dirname(hp), "reset.yaml")).read()
    assert "\nreset_lii_count: paper " in text and "lii_count: !ref <reset_lii_count>" in text


# ----------------------------------------------------------------------------- SDPL train mode
def test_sdpl_default_is_eval_mode_without_extra_passes(tiny_model_dir, utterances):
    m = build_on(tiny_model_dir, "sdpl", steps=3, lr=1e-3)
    assert not m.train_mode
    m.process(utterances[0])
    assert m.counts == {"adapt_forward": 3, "adapt_backward": 3, "infer_forward": 1,
                        "aux_forward": 0, "skipped_steps": 0}
    from tta_brain.hparams import __file__ as hp
    text = open(os.path.join(os.path.dirname(hp), "sdpl.yaml")).read()
    assert "\ntrain_mode: false " in text and "train_mode: !ref <train_mode>" in text


def test_sdpl_eval_mode_steps_on_the_greedy_label_of_each_steps_own_forward(tiny_model_dir,
                                                                             utterances):
    """The default (eval mode): each of the N steps is CTC on the greedy label (argmax, repeats
    merged, blanks dropped) of that step's own forward of the current model, AdamW from the
    source every utterance; by hand on a separate copy of the model."""
    steps, lr = 3, 1e-3
    ours = build_on(tiny_model_dir, "sdpl", steps=steps, lr=lr, cache_features="off",
                    cpu_native_backward=False)
    lobe, params = reference_copy(tiny_model_dir, ours.param_names)
    net = lobe.model
    init = [p.detach().clone() for p in params]
    labels = []
    for wav in utterances[:2]:
        hyp = ours.process(wav)
        with torch.no_grad():
            for p, v in zip(params, init):
                p.copy_(v)
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=True)
        x = lobe.prepare(wav)
        for _ in range(steps):
            opt.zero_grad()
            logits = net(x).logits
            label = collapse(logits.detach().argmax(-1)[0], lobe.blank_id)
            labels.append(label)
            losses.ctc_pseudo_label_loss(logits, [torch.tensor(label)],
                                         blank_id=lobe.blank_id).mean().backward()
            opt.step()
        with torch.no_grad():
            assert hyp == lobe.decode(net(x).logits)[0]
        assert max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(ours.params, params)) < 1e-6
    assert len({tuple(lb) for lb in labels[:steps]}) > 1      # the label moved between steps


def test_sdpl_train_mode_is_the_official_order(tiny_model_dir, utterances):
    """Per step: greedy label from an eval-mode forward, then the CTC step in train mode
    (dropout on). Reference: that loop by hand with torch's AdamW on the same RNG stream."""
    steps, lr = 3, 1e-3
    ours = build_on(tiny_model_dir, "sdpl", steps=steps, lr=lr, train_mode=True,
                    cache_features="off", cpu_native_backward=False)
    lobe, params = reference_copy(tiny_model_dir, ours.param_names, eval_mode=False)
    net = lobe.model
    init = [p.detach().clone() for p in params]
    ref_hyps, hyps = [], []
    for i, wav in enumerate(utterances[:3]):
        torch.manual_seed(100 + i)
        hyps.append(ours.process(wav))
        torch.manual_seed(100 + i)
        with torch.no_grad():
            for p, v in zip(params, init):
                p.copy_(v)
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=True)
        x = lobe.prepare(wav)
        for _ in range(steps):
            net.eval()
            with torch.no_grad():
                label = collapse(net(x).logits.argmax(-1)[0], lobe.blank_id)
            net.train()
            opt.zero_grad()
            loss = losses.ctc_pseudo_label_loss(net(x).logits, [torch.tensor(label)],
                                                blank_id=lobe.blank_id).mean()
            loss.backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            ref_hyps.append(lobe.decode(net(x).logits)[0])
    assert hyps == ref_hyps
    assert all(torch.equal(a, b) for a, b in zip(ours.params, params))
    assert ours.counts["aux_forward"] == 3 * steps and ours.counts["adapt_backward"] == 3 * steps
    assert not ours.net.training                           # back in eval mode
    # train mode changes the result (dropout is on in the tiny model)
    evalm = build_on(tiny_model_dir, "sdpl", steps=steps, lr=lr, cache_features="off",
                     cpu_native_backward=False)
    torch.manual_seed(100)
    evalm.process(utterances[0])
    torch.manual_seed(100)
    trainm = build_on(tiny_model_dir, "sdpl", steps=steps, lr=lr, train_mode=True,
                      cache_features="off", cpu_native_backward=False)
    trainm.process(utterances[0])
    assert not all(torch.equal(a, b) for a, b in zip(evalm.params, trainm.params))
