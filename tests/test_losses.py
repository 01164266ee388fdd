"""Every loss of ``tta_brain.methods.losses`` against an independent, slow float64 reference.

The references below are written from the formulas (paper appendix + notes on the official code)
with explicit Python loops over frames and classes; they share no code with the library.
"""
import math

import pytest
import torch

from tta_brain.methods import losses

TOL = 1e-6
BLANK = 0


# ----------------------------------------------------------------------------- references
def _softmax(row, temperature=1.0):
    xs = [float(v) / temperature for v in row]
    m = max(xs)
    e = [math.exp(v - m) for v in xs]
    s = sum(e)
    return [v / s for v in e]


def _argmax(row):
    row = [float(v) for v in row]
    return max(range(len(row)), key=lambda i: row[i])


def _shannon(p):
    return -sum(q * math.log(q) for q in p if q > 0)


def _frames(logits_b, length):
    T = len(logits_b) if length is None else int(length)
    return [list(map(float, logits_b[t])) for t in range(T)]


def ref_entropy(logits_b, length=None, T=2.5, non_blank=True, path=None):
    hs = []
    for t, row in enumerate(_frames(logits_b, length)):
        best = _argmax(row) if path is None else int(path[t])
        if non_blank and best == BLANK:
            continue
        hs.append(_shannon(_softmax(row, T)))
    return sum(hs) / len(hs) if hs else 0.0


def ref_mcc(logits_b, length=None, T=2.5, reweight=True, num_classes=None):
    frames = _frames(logits_b, length)
    V = len(frames[0])
    L = len(frames)
    ps = [_softmax(row, T) for row in frames]
    if reweight:
        w = [1.0 + math.exp(-_shannon(p)) for p in ps]
        s = sum(w)
        w = [L * wi / s for wi in w]
    else:
        w = [1.0] * L
    C = [[0.0] * V for _ in range(V)]
    for t in range(L):
        for i in range(V):
            for j in range(V):
                C[i][j] += w[t] * ps[t][i] * ps[t][j]
    for i in range(V):
        rs = sum(C[i])
        C[i] = [c / rs for c in C[i]]
    total = sum(sum(r) for r in C)
    trace = sum(C[i][i] for i in range(V))
    return (total - trace) / (num_classes or V)


def ref_suta(logits_b, length=None, alpha=0.3, T=2.5, num_classes=None):
    return (alpha * ref_entropy(logits_b, length, T)
            + (1 - alpha) * ref_mcc(logits_b, length, T, num_classes=num_classes))


def ref_renyi(logits_b, length=None, alpha=1.5, T=2.5, non_blank=True, path=None):
    hs = []
    for t, row in enumerate(_frames(logits_b, length)):
        best = _argmax(row) if path is None else int(path[t])
        if non_blank and best == BLANK:
            continue
        p = _softmax(row, T)
        if alpha == 1:
            h = _shannon(p)
        elif alpha == math.inf:
            h = -math.log(max(p))
        else:
            h = math.log(sum(q ** alpha for q in p)) / (1 - alpha)
        hs.append(h)
    return sum(hs) / len(hs) if hs else 0.0


def ref_negative_sampling(logits_b, length=None, T=2.5, threshold=0.04):
    frames = _frames(logits_b, length)
    V = len(frames[0])
    vals = []
    for row in frames:
        p0 = _softmax(row, 1.0)
        pT = _softmax(row, T)
        neg = sum(pT[v] for v in range(V) if p0[v] < threshold * 10.0 / V)
        vals.append(-math.log(1.0 - neg))
    return sum(vals) / len(vals)


def _lse(*xs):
    xs = [x for x in xs if x != -math.inf]
    if not xs:
        return -math.inf
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


def ref_ctc_nll(logits_b, target, length=None, blank=BLANK):
    """-log p(target | x) by the CTC forward algorithm (log space, explicit loops)."""
    frames = _frames(logits_b, length)
    lp = [[math.log(q) for q in _softmax(row)] for row in frames]
    ext = [blank]
    for lab in target:
        ext += [int(lab), blank]
    S, Tn = len(ext), len(lp)
    alpha = [-math.inf] * S
    alpha[0] = lp[0][ext[0]]
    if S > 1:
        alpha[1] = lp[0][ext[1]]
    for t in range(1, Tn):
        new = [-math.inf] * S
        for s in range(S):
            cands = [alpha[s]]
            if s >= 1:
                cands.append(alpha[s - 1])
            if s >= 2 and ext[s] != blank and ext[s] != ext[s - 2]:
                cands.append(alpha[s - 2])
            new[s] = _lse(*cands) + lp[t][ext[s]]
        alpha = new
    tot = _lse(alpha[S - 1], alpha[S - 2]) if S > 1 else alpha[0]
    return -tot


# ----------------------------------------------------------------------------- helpers
def rand_logits(B, T, V, seed=0, scale=3.0, blank_bias=0.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    x[..., BLANK] += blank_bias
    return x.to(dtype)


def padded_batch(seed=0, V=7, lens=(9, 5, 12, 1), blank_bias=1.0):
    """Items of different lengths, padded with large random garbage (which must be ignored)."""
    g = torch.Generator().manual_seed(seed)
    Tm = max(lens)
    items = [3.0 * torch.randn(L, V, generator=g, dtype=torch.float64) for L in lens]
    for it in items:
        it[:, BLANK] += blank_bias
    batch = 50.0 * torch.randn(len(lens), Tm, V, generator=g, dtype=torch.float64)
    for b, it in enumerate(items):
        batch[b, :len(it)] = it
    return batch, torch.tensor(lens), items


def close(a, b, tol=TOL):
    a = a.detach() if torch.is_tensor(a) else a
    b = b.detach() if torch.is_tensor(b) else b
    return abs(float(a) - float(b)) <= tol


# ----------------------------------------------------------------------------- entropy
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_entropy_matches_reference(seed):
    x = rand_logits(3, 11, 6, seed=seed, blank_bias=1.5)
    got = losses.entropy_loss(x)
    assert got.shape == (3,)
    for b in range(3):
        assert close(got[b], ref_entropy(x[b]))
    # all frames (non_blank=False) and another temperature
    got = losses.entropy_loss(x, temperature=1.0, non_blank=False)
    for b in range(3):
        assert close(got[b], ref_entropy(x[b], T=1.0, non_blank=False))


def test_entropy_mask_uses_explicit_path():
    x = rand_logits(1, 10, 5, seed=3)
    path = torch.tensor([[0, 1, 1, 0, 0, 2, 0, 3, 3, 0]])
    got = losses.entropy_loss(x, path=path)
    assert close(got[0], ref_entropy(x[0], path=path[0]))


def test_entropy_all_blank_guard_is_zero_with_finite_grad():
    x = rand_logits(2, 8, 5, seed=4, blank_bias=50.0).requires_grad_(True)
    assert (x.argmax(-1) == BLANK).all()
    em = losses.entropy_loss(x)
    assert torch.equal(em, torch.zeros(2, dtype=x.dtype))
    total = losses.suta_loss(x).sum()
    assert torch.isfinite(total)
    total.backward()
    assert torch.isfinite(x.grad).all()
    # one all-blank item next to a normal one: the normal one is unaffected
    y = torch.cat([x.detach()[:1], rand_logits(1, 8, 5, seed=5)])
    got = losses.entropy_loss(y)
    assert got[0] == 0 and close(got[1], ref_entropy(y[1]))


def test_entropy_all_blank_float32_grad_finite():
    x = rand_logits(1, 6, 32, seed=6, blank_bias=40.0, dtype=torch.float32).requires_grad_(True)
    for fn in (losses.entropy_loss, losses.suta_loss, losses.renyi_entropy_loss,
               losses.negative_sampling_loss):
        x.grad = None
        v = fn(x).sum()
        v.backward()
        assert torch.isfinite(v), fn.__name__
        assert torch.isfinite(x.grad).all(), fn.__name__


# ----------------------------------------------------------------------------- mcc
@pytest.mark.parametrize("seed", [0, 1])
def test_mcc_matches_reference(seed):
    x = rand_logits(2, 9, 6, seed=seed)
    got = losses.mcc_loss(x)
    assert got.shape == (2,)
    for b in range(2):
        assert close(got[b], ref_mcc(x[b]))
    got = losses.mcc_loss(x, reweight=False, temperature=1.3)
    for b in range(2):
        assert close(got[b], ref_mcc(x[b], reweight=False, T=1.3))
    got = losses.mcc_loss(x, num_classes=32)
    for b in range(2):
        assert close(got[b], ref_mcc(x[b], num_classes=32))


def test_mcc_reweighting_differs_from_plain():
    # sanity: the reweighting is not a no-op (so the test above really checks it)
    x = rand_logits(1, 9, 6, seed=7)
    assert abs(float(losses.mcc_loss(x)[0]) - float(losses.mcc_loss(x, reweight=False)[0])) > 1e-5


def test_mcc_reweight_grad_does_not_flow_through_weights():
    """H_t is detached: the gradient equals that of the weighted loss with frozen weights."""
    x = rand_logits(1, 7, 5, seed=8).requires_grad_(True)
    losses.mcc_loss(x)[0].backward()
    g1 = x.grad.clone()
    xd = x.detach()
    p = (xd / 2.5).softmax(-1)
    H = -(p * p.log()).sum(-1)
    w = 1 + torch.exp(-H)
    w = len(w[0]) * w / w.sum()
    z = xd.clone().requires_grad_(True)
    pz = (z / 2.5).softmax(-1)[0]
    C = torch.einsum("t,tv,tu->vu", w[0], pz, pz)
    C = C / C.sum(1, keepdim=True)
    ((C.sum() - C.trace()) / 5).backward()
    assert torch.allclose(g1, z.grad, atol=1e-10)


# ----------------------------------------------------------------------------- suta
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_suta_matches_reference(seed):
    x = rand_logits(3, 10, 8, seed=seed, blank_bias=1.0)
    got = losses.suta_loss(x)
    assert got.shape == (3,)
    for b in range(3):
        assert close(got[b], ref_suta(x[b]))
        assert close(got[b], 0.3 * ref_entropy(x[b], T=2.5) + 0.7 * ref_mcc(x[b], T=2.5))


def test_suta_alpha_extremes():
    x = rand_logits(2, 10, 8, seed=9, blank_bias=1.0)
    em = losses.suta_loss(x, alpha=1.0)
    mc = losses.suta_loss(x, alpha=0.0)
    for b in range(2):
        assert close(em[b], ref_entropy(x[b]))
        assert close(mc[b], ref_mcc(x[b]))


def test_suta_forwards_its_options_to_both_terms():
    """Temperature, path, reweight and num_classes reach the term they belong to: the entropy
    over the given path's non-blank frames, the MCC at the same temperature with its options."""
    x = rand_logits(2, 10, 6, seed=23, blank_bias=1.0)
    path = torch.tensor([[0, 1, 1, 0, 2, 0, 3, 0, 0, 4], [5, 0, 0, 2, 2, 0, 1, 0, 3, 0]])
    assert not torch.equal(path != BLANK, x.argmax(-1) != BLANK)
    got = losses.suta_loss(x, alpha=0.4, temperature=1.3, path=path, reweight=False, num_classes=32)
    for b in range(2):
        want = (0.4 * ref_entropy(x[b], T=1.3, path=path[b])
                + 0.6 * ref_mcc(x[b], T=1.3, reweight=False, num_classes=32))
        assert close(got[b], want)


def test_suta_float32_close_to_reference():
    x = rand_logits(2, 50, 32, seed=10, blank_bias=2.0, dtype=torch.float32)
    got = losses.suta_loss(x)
    for b in range(2):
        assert close(got[b], ref_suta(x[b].double()), tol=1e-5)


# ----------------------------------------------------------------------------- renyi
@pytest.mark.parametrize("alpha", [1.5, 1, 2.0, 0.5, math.inf])
def test_renyi_matches_reference(alpha):
    x = rand_logits(2, 12, 6, seed=11, blank_bias=1.0)
    got = losses.renyi_entropy_loss(x, alpha=alpha)
    assert got.shape == (2,)
    for b in range(2):
        assert close(got[b], ref_renyi(x[b], alpha=alpha))
    got = losses.renyi_entropy_loss(x, alpha=alpha, non_blank=False)
    for b in range(2):
        assert close(got[b], ref_renyi(x[b], alpha=alpha, non_blank=False))


def test_renyi_alpha1_equals_shannon_entropy_loss():
    x = rand_logits(2, 12, 6, seed=12, blank_bias=1.0)
    assert torch.allclose(losses.renyi_entropy_loss(x, alpha=1), losses.entropy_loss(x), atol=1e-12)
    # alpha -> 1 is continuous
    near = losses.renyi_entropy_loss(x, alpha=1 + 1e-6)
    assert torch.allclose(near, losses.entropy_loss(x), atol=1e-5)


def test_renyi_with_path_and_all_blank():
    x = rand_logits(1, 10, 5, seed=13)
    path = torch.tensor([[0, 0, 3, 3, 0, 1, 0, 0, 2, 0]])
    got = losses.renyi_entropy_loss(x, path=path)
    assert close(got[0], ref_renyi(x[0], path=path[0]))
    assert losses.renyi_entropy_loss(x, path=torch.zeros(1, 10, dtype=torch.long))[0] == 0


def test_sgem_step_loss_is_renyi_on_the_path_plus_weighted_negative_sampling():
    """SGEM's step loss: Renyi entropy (its alpha) over the non-blank frames of the given path,
    plus ns_coef x negative sampling, batch mean; each term from the explicit references."""
    from tta_brain.methods.sgem import sgem_loss
    x = rand_logits(2, 10, 5, seed=21, blank_bias=0.5)
    path = torch.tensor([[0, 2, 2, 0, 4, 0, 0, 1, 0, 3], [1, 0, 0, 3, 3, 0, 2, 0, 0, 0]])
    assert not torch.equal(path, x.argmax(-1))              # the path, not the argmax, counts
    for alpha, coef, thr in [(1.5, 0.25, 0.04), (2.0, 3.0, 0.1)]:
        got = sgem_loss(x, path, renyi_alpha=alpha, temperature=2.5, blank_id=BLANK,
                        ns_threshold=thr, ns_coef=coef)
        ref = sum(ref_renyi(x[b], alpha=alpha, path=path[b])
                  + coef * ref_negative_sampling(x[b], threshold=thr) for b in range(2)) / 2
        assert close(got, ref)


# ----------------------------------------------------------------------------- negative sampling
@pytest.mark.parametrize("seed,V", [(0, 6), (1, 32)])
def test_negative_sampling_matches_reference(seed, V):
    x = rand_logits(2, 10, V, seed=seed, scale=2.5)
    got = losses.negative_sampling_loss(x)
    assert got.shape == (2,)
    for b in range(2):
        assert close(got[b], ref_negative_sampling(x[b]))
    got = losses.negative_sampling_loss(x, temperature=1.0, threshold=0.1)
    for b in range(2):
        assert close(got[b], ref_negative_sampling(x[b], T=1.0, threshold=0.1))


def test_negative_sampling_threshold_uses_untempered_probs():
    # one frame, V=4, threshold 0.04*10/4 = 0.1: untempered p = (0.6, 0.3, 0.05, 0.05)
    p = torch.tensor([[[0.6, 0.3, 0.05, 0.05]]], dtype=torch.float64)
    x = p.log()
    pt = (x / 2.5).softmax(-1)[0, 0]
    expected = -math.log(1 - float(pt[2] + pt[3]))
    assert close(losses.negative_sampling_loss(x)[0], expected)
    # tempered probabilities would all be > 0.1 here: negatives come from the raw ones
    assert (pt > 0.1).all()


def test_negative_sampling_every_class_negative_is_finite():
    """A flat frame under a threshold above 0.1 makes every class a negative (mass 1): the loss
    stays finite (mass clamped below 1), with a finite gradient."""
    x = torch.zeros(1, 3, 5, dtype=torch.float64)
    x[0, 1] = rand_logits(1, 1, 5, seed=25)[0, 0]
    x.requires_grad_(True)
    got = losses.negative_sampling_loss(x, threshold=0.2)
    assert torch.isfinite(got).all() and float(got[0].detach()) > 1.0
    got.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_negative_sampling_gradient_only_through_tempered_probs():
    x = rand_logits(1, 5, 6, seed=14).requires_grad_(True)
    losses.negative_sampling_loss(x)[0].backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- ctc pseudo label
def test_ctc_pseudo_label_matches_forward_algorithm():
    x = rand_logits(3, 6, 4, seed=15)
    targets = [torch.tensor([1, 2]), torch.tensor([2, 2]), torch.tensor([1, 3, 1])]
    got = losses.ctc_pseudo_label_loss(x, targets)
    assert got.shape == (3,)
    for b in range(3):
        ref = ref_ctc_nll(x[b], targets[b].tolist()) / len(targets[b])
        # the library computes CTC in float32
        assert close(got[b], ref, tol=1e-5)


def test_awmc_step_loss_is_the_mean_of_the_anchor_and_leader_ctc():
    """AWMC's step loss: 0.5 * (CTC(anchor labels) + CTC(leader labels)), each per label as
    ``ctc_pseudo_label_loss``; equal labels give that one CTC."""
    from tta_brain.methods.awmc import pseudo_label_loss
    x = rand_logits(1, 7, 5, seed=21)
    anchor, leader = [1, 2, 3], [2, 4]
    want = 0.5 * (ref_ctc_nll(x[0], anchor) / 3 + ref_ctc_nll(x[0], leader) / 2)
    got = pseudo_label_loss(x, [torch.tensor(anchor)], [torch.tensor(leader)])
    assert close(got, want, tol=1e-5)
    same = pseudo_label_loss(x, [torch.tensor(leader)], [torch.tensor(leader)])
    assert close(same, ref_ctc_nll(x[0], leader) / 2, tol=1e-5)


def test_ctc_pseudo_label_tiny_case_by_enumeration():
    """T=3, V=3, target [1]: brute-force sum over all frame paths that collapse to [1]."""
    from itertools import product
    x = rand_logits(1, 3, 3, seed=16)
    lp = x[0].log_softmax(-1)
    tot = 0.0
    for path in product(range(3), repeat=3):
        out, prev = [], None
        for k in path:
            if k != prev and k != BLANK:
                out.append(k)
            prev = k
        if out == [1]:
            tot += math.exp(sum(float(lp[t, k]) for t, k in enumerate(path)))
    ref = -math.log(tot)
    assert close(ref, ref_ctc_nll(x[0], [1]), tol=1e-12)  # the reference itself is right
    assert close(losses.ctc_pseudo_label_loss(x, [torch.tensor([1])])[0], ref, tol=1e-5)


def test_ctc_pseudo_label_blank_id_other_than_zero():
    """A vocabulary whose blank is not label 0 (e.g. last): CTC's blank is ``blank_id``."""
    x = rand_logits(2, 6, 4, seed=24)
    targets = [torch.tensor([0, 2]), torch.tensor([1, 1])]
    got = losses.ctc_pseudo_label_loss(x, targets, blank_id=3)
    for b in range(2):
        want = ref_ctc_nll(x[b], targets[b].tolist(), blank=3) / len(targets[b])
        assert close(got[b], want, tol=1e-5)
    # the same logits and targets under blank 0 give another loss: the values above are blank 3's
    assert not close(got[1], losses.ctc_pseudo_label_loss(x[1:], targets[1:])[0], tol=1e-3)


def test_ctc_pseudo_label_empty_and_impossible_targets():
    x = rand_logits(2, 4, 4, seed=17)
    got = losses.ctc_pseudo_label_loss(x, [torch.tensor([], dtype=torch.long),
                                          torch.tensor([1, 1, 1])])
    all_blank = -float(x[0].log_softmax(-1)[:, BLANK].sum())
    assert close(got[0], all_blank, tol=1e-5)
    assert got[1] == 0  # [1,1,1] needs 5 frames > 4: infinite loss zeroed


def test_ctc_pseudo_label_padding_invariance_and_grad():
    batch, lens, items = padded_batch(seed=18, V=5, lens=(7, 4, 9))
    targets = [torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([2, 2, 4])]
    batch.requires_grad_(True)
    got = losses.ctc_pseudo_label_loss(batch, targets, lengths=lens)
    for b, it in enumerate(items):
        alone = losses.ctc_pseudo_label_loss(it[None], [targets[b]])[0]
        assert close(got[b], alone, tol=1e-5)
        assert close(got[b], ref_ctc_nll(it, targets[b].tolist()) / len(targets[b]), tol=1e-5)
    got.sum().backward()
    assert torch.isfinite(batch.grad).all()
    for b, L in enumerate(lens.tolist()):
        assert batch.grad[b, L:].abs().sum() == 0  # padding gets no gradient



def _former_ctc_pseudo_label_loss(logits, targets, lengths=None, blank_id=0):
    """The former implementation (targets gathered on the host), kept as a reference."""
    import torch.nn.functional as F
    B, T = logits.shape[:2]
    log_probs = logits.float().log_softmax(dim=-1).transpose(0, 1)
    in_lens = torch.full((B,), T, dtype=torch.long) if lengths is None else torch.as_tensor(lengths).long().cpu()
    tgt_lens = torch.tensor([len(t) for t in targets], dtype=torch.long)
    flat = torch.cat([torch.as_tensor(t, dtype=torch.long).cpu() for t in targets]) if tgt_lens.sum() else torch.zeros(0, dtype=torch.long)
    loss = F.ctc_loss(log_probs, flat.to(logits.device), in_lens, tgt_lens, blank=blank_id,
                      reduction="none", zero_infinity=True)
    return loss / tgt_lens.clamp(min=1).to(loss.device)


@pytest.mark.parametrize("with_lengths", [False, True])
def test_ctc_pseudo_label_identical_to_former_for_lists_tensors_and_greedy_labels(with_lengths):
    """Greedy pseudo labels from ``ctc.greedy_labels`` (tensors on the logits' device), plain
    lists and CPU tensors give bit-identical losses and gradients, equal to the former code."""
    from tta_brain.asr.ctc import collapse, greedy_labels
    batch, lens, _ = padded_batch(seed=21, V=6, lens=(12, 7, 9, 1), blank_bias=0.5)
    batch = batch.float()
    lens = lens if with_lengths else None
    labels = greedy_labels(batch, BLANK, lens)
    as_lists = [collapse(row[: (int(lens[b]) if lens is not None else None)].argmax(-1).tolist())
                for b, row in enumerate(batch)]
    assert [t.tolist() for t in labels] == as_lists
    results = []
    for targets in (labels, as_lists, [torch.tensor(t, dtype=torch.long) for t in as_lists]):
        x = batch.clone().requires_grad_(True)
        loss = losses.ctc_pseudo_label_loss(x, targets, lengths=lens)
        loss.sum().backward()
        results.append((loss.detach(), x.grad))
    x = batch.clone().requires_grad_(True)
    ref = _former_ctc_pseudo_label_loss(x, as_lists, lengths=lens)
    ref.sum().backward()
    for loss, grad in results:
        assert torch.equal(loss, ref.detach()) and torch.equal(grad, x.grad)


def test_ctc_pseudo_label_all_targets_empty():
    x = rand_logits(2, 5, 4, seed=22, dtype=torch.float32)
    got = losses.ctc_pseudo_label_loss(x, [torch.zeros(0, dtype=torch.long), []])
    ref = _former_ctc_pseudo_label_loss(x, [[], []])
    assert torch.equal(got, ref)
    assert close(got[0], -float(x[0].log_softmax(-1)[:, BLANK].sum()), tol=1e-5)


# ----------------------------------------------------------------------------- padding / lengths
LOSS_CASES = [
    ("entropy", lambda x, l: losses.entropy_loss(x, l), lambda it: ref_entropy(it)),
    ("mcc", lambda x, l: losses.mcc_loss(x, l), lambda it: ref_mcc(it)),
    ("suta", lambda x, l: losses.suta_loss(x, l), lambda it: ref_suta(it)),
    ("renyi", lambda x, l: losses.renyi_entropy_loss(x, l), lambda it: ref_renyi(it)),
    ("renyi_inf", lambda x, l: losses.renyi_entropy_loss(x, l, alpha=math.inf),
     lambda it: ref_renyi(it, alpha=math.inf)),
    ("neg", lambda x, l: losses.negative_sampling_loss(x, l), lambda it: ref_negative_sampling(it)),
]


@pytest.mark.parametrize("name,fn,ref", LOSS_CASES, ids=[c[0] for c in LOSS_CASES])
def test_padding_does_not_change_per_sample_losses(name, fn, ref):
    batch, lens, items = padded_batch(seed=19)
    got = fn(batch, lens)
    assert got.shape == (len(items),)
    for b, it in enumerate(items):
        assert close(got[b], ref(it)), (name, b)
        assert close(got[b], fn(it[None], None)[0]), (name, b)
    # lengths as a list work too
    assert torch.allclose(fn(batch, lens.tolist()), got)
    # changing the padded values changes nothing
    batch2 = batch.clone()
    for b, L in enumerate(lens.tolist()):
        batch2[b, L:] = -batch2[b, L:] * 3 + 7
    assert torch.allclose(fn(batch2, lens), got, atol=1e-12)


@pytest.mark.parametrize("name,fn,ref", LOSS_CASES, ids=[c[0] for c in LOSS_CASES])
def test_padding_gets_no_gradient(name, fn, ref):
    batch, lens, _ = padded_batch(seed=20)
    batch.requires_grad_(True)
    fn(batch, lens).sum().backward()
    assert torch.isfinite(batch.grad).all()
    for b, L in enumerate(lens.tolist()):
        assert batch.grad[b, L:].abs().sum() == 0, name


def test_frame_and_non_blank_masks():
    x = torch.zeros(2, 4, 3)
    x[0, :, 1] = 1
    x[1, 1, 2] = 1  # frames 0,2,3 of item 1 are ties -> argmax 0 (blank)
    fm = losses.frame_mask(x, torch.tensor([4, 2]))
    assert fm.tolist() == [[True] * 4, [True, True, False, False]]
    nb = losses.non_blank_mask(x, torch.tensor([3, 4]))
    assert nb.tolist() == [[True, True, True, False], [False, True, False, False]]
