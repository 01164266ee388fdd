"""The losses of the field's methods (Tent / EATA / SAR / CoTTA / CEA) against slow float64
references written from the papers' formulas with explicit loops (no code shared with the library)."""
import math

import pytest
import torch

from tta_brain.methods import losses

BLANK = 0


def _softmax(row, T=1.0):
    xs = [float(v) / T for v in row]
    m = max(xs)
    e = [math.exp(v - m) for v in xs]
    return [v / sum(e) for v in e]


def _argmax(row):
    row = [float(v) for v in row]
    return max(range(len(row)), key=lambda i: row[i])


def _entropy(p):
    return -sum(q * math.log(q) for q in p if q > 0)


def logits(T=12, V=6, seed=0, blank_bias=0.5):
    g = torch.Generator().manual_seed(seed)
    x = 2.0 * torch.randn(1, T, V, generator=g, dtype=torch.float64)
    x[..., BLANK] += blank_bias
    return x


def ref_confidence_weighted(x, T=2.5):
    vals = []
    for row in x[0]:
        if _argmax(row) == BLANK:
            continue
        h = _entropy(_softmax(row, T))
        vals.append(h / (1 + math.exp(-h)))          # sigmoid(H) * H
    return sum(vals) / len(vals) if vals else 0.0


def ref_symmetric_ce(x, teacher):
    vals = []
    for s_row, t_row in zip(x[0], teacher[0]):
        if _argmax(s_row) == BLANK:                   # the student's non-blank frames
            continue
        p, q = _softmax(s_row), _softmax(t_row)
        vals.append(-0.5 * sum(qi * math.log(pi) for pi, qi in zip(p, q))
                    - 0.5 * sum(pi * math.log(qi) for pi, qi in zip(p, q)))
    return sum(vals) / len(vals) if vals else 0.0


def ref_temporal_coherence(feats, mask):
    """A_t = sum_s softmax_s(<x_t, x_s>) x_s + x_t; mean_t ||A_t - A_{t-1}|| over masked t >= 1."""
    X = [[float(v) for v in col] for col in feats[0].T]      # [T][C]
    T = len(X)
    A = []
    for t in range(T):
        scores = [sum(a * b for a, b in zip(X[t], X[s])) for s in range(T)]
        w = _softmax(scores)
        A.append([sum(w[s] * X[s][c] for s in range(T)) + X[t][c] for c in range(len(X[t]))])
    d = [math.sqrt(sum((a - b) ** 2 for a, b in zip(A[t], A[t - 1]))) for t in range(1, T)
         if mask[0][t]]
    return sum(d) / len(d) if d else 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_confidence_weighted_entropy_matches_reference(seed):
    x = logits(seed=seed)
    got = losses.confidence_weighted_entropy_loss(x, temperature=2.5, blank_id=BLANK)
    assert abs(float(got[0]) - ref_confidence_weighted(x)) < 1e-9


def test_confidence_weighted_entropy_gradient_flows_through_the_weight():
    """The weight sigmoid(H) is not detached (frames the model is unsure of count more in the
    gradient too): autograd's gradient is that of the reference's sigmoid(H) * H, by central
    differences of the float64 reference (a detached weight drops the sigmoid'(H) H dH term)."""
    x = logits(seed=4).requires_grad_(True)
    losses.confidence_weighted_entropy_loss(x, temperature=2.5, blank_id=BLANK)[0].backward()
    eps, worst = 1e-6, 0.0
    for t in range(x.shape[1]):
        for v in range(x.shape[2]):
            hi, lo = x.detach().clone(), x.detach().clone()
            hi[0, t, v] += eps
            lo[0, t, v] -= eps
            fd = (ref_confidence_weighted(hi) - ref_confidence_weighted(lo)) / (2 * eps)
            worst = max(worst, abs(float(x.grad[0, t, v]) - fd))
    assert worst < 1e-6
    assert float(x.grad.abs().max()) > 1e-3                 # a gradient to compare at all


def test_confidence_weighted_entropy_default_temperature_and_explicit_path():
    """T defaults to 2.5; a given path (not the argmax) picks the non-blank frames."""
    x = logits(seed=5)
    default = float(losses.confidence_weighted_entropy_loss(x)[0])
    assert abs(default - ref_confidence_weighted(x)) < 1e-9
    path = x[0].argmax(-1).clone()
    path[:6] = torch.where(path[:6] == BLANK, torch.ones_like(path[:6]), torch.zeros_like(path[:6]))
    kept = x[0, path != BLANK]
    hs = [_entropy(_softmax(row, 2.5)) for row in kept]
    want = sum(h / (1 + math.exp(-h)) for h in hs) / len(hs)
    got = losses.confidence_weighted_entropy_loss(x, path=path[None])
    assert abs(float(got[0]) - want) < 1e-9
    assert abs(float(got[0]) - ref_confidence_weighted(x)) > 1e-6


def test_confidence_weighted_entropy_all_blank_is_zero():
    x = logits(blank_bias=50.0)
    assert float(losses.confidence_weighted_entropy_loss(x)[0]) == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_symmetric_cross_entropy_matches_reference(seed):
    x, teacher = logits(seed=seed), logits(seed=seed + 10)
    got = losses.symmetric_cross_entropy_loss(x, teacher, blank_id=BLANK)
    assert abs(float(got[0]) - ref_symmetric_ce(x, teacher)) < 1e-9
    # identical distributions: the entropy of the student's non-blank frames
    same = losses.symmetric_cross_entropy_loss(x, x, blank_id=BLANK)
    assert abs(float(same[0]) - float(losses.entropy_loss(x, temperature=1.0)[0])) < 1e-9


def test_symmetric_cross_entropy_ignores_padding():
    """With ``lengths``, the padded frames (here non-blank garbage) are not averaged."""
    x, teacher = logits(T=9, seed=6), logits(T=9, seed=16)
    pad = 30 * torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(7), dtype=x.dtype)
    pad[..., 1] += 100
    px, pt = torch.cat([x, pad], 1), torch.cat([teacher, -pad], 1)
    got = losses.symmetric_cross_entropy_loss(px, pt, lengths=torch.tensor([9]), blank_id=BLANK)
    assert abs(float(got[0]) - ref_symmetric_ce(x, teacher)) < 1e-9


@pytest.mark.parametrize("seed", [0, 1])
def test_temporal_coherence_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    feats = 0.5 * torch.randn(1, 4, 9, generator=g, dtype=torch.float64)
    mask = torch.rand(1, 9, generator=g) > 0.4
    got = losses.temporal_coherence_loss(feats, mask)
    assert abs(float(got[0]) - ref_temporal_coherence(feats, mask.tolist())) < 1e-9


def test_temporal_coherence_ignores_padding_and_empty_mask():
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(1, 4, 7, generator=g, dtype=torch.float64)
    mask = torch.ones(1, 7, dtype=torch.bool)
    padded = torch.cat([feats, 99 * torch.randn(1, 4, 3, generator=g, dtype=torch.float64)], 2)
    pmask = torch.cat([mask, torch.ones(1, 3, dtype=torch.bool)], 1)
    a = losses.temporal_coherence_loss(feats, mask)
    b = losses.temporal_coherence_loss(padded, pmask, lengths=torch.tensor([7]))
    assert torch.allclose(a, b)
    assert float(losses.temporal_coherence_loss(feats, torch.zeros(1, 7, dtype=torch.bool))[0]) == 0


def test_fisher_penalty_matches_reference_and_gradient():
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True),
              torch.randn(2, 2, generator=g, dtype=torch.float64, requires_grad=True)]
    anchors = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params]
    fisher = [torch.rand(p.shape, generator=g, dtype=torch.float64) for p in params]
    ref = sum(float(f) * (float(p) - float(a)) ** 2 for P, A, Fi in zip(params, anchors, fisher)
              for p, a, f in zip(P.detach().flatten(), A.flatten(), Fi.flatten()))
    got = losses.fisher_penalty(params, anchors, fisher)
    assert abs(float(got.detach()) - ref) < 1e-12
    got.backward()
    for p, a, f in zip(params, anchors, fisher):   # d/dtheta = 2 F (theta - theta0)
        assert torch.allclose(p.grad, 2 * f * (p.detach() - a))
    assert float(losses.fisher_penalty([], [], [])) == 0.0      # no parameter: no penalty


def test_mean_probability_and_entropy_margin():
    x = logits(T=5, V=4)
    ref = [sum(_softmax(x[0, t])[v] for t in range(5)) / 5 for v in range(4)]
    assert torch.allclose(losses.mean_probability(x)[0], torch.tensor(ref, dtype=x.dtype))
    padded = torch.cat([x, 40 * torch.ones(1, 3, 4, dtype=x.dtype)], 1)
    assert torch.allclose(losses.mean_probability(padded, torch.tensor([5])), losses.mean_probability(x))
    assert abs(losses.entropy_margin(32) - 0.4 * math.log(32)) < 1e-12
    assert abs(losses.entropy_margin(1000, 0.5) - 0.5 * math.log(1000)) < 1e-12
