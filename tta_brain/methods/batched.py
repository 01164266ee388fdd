"""R runs of the SUTA family (``suta``, ``csuta``) as one batch: R adapted states over one shared
model, one batched forward/backward per step (``torch.func.vmap`` of ``functional_call`` over the
stacked adapted parameters, the input shared; the frozen weights are the model's own, once).

The R states are flat rows: parameters ``P [R, N]`` (every adapted tensor of a run, in the
selection's order) and AdamW's moments ``M, V [R, N]`` with a step count per run. Per utterance:
the runs' own resets (episodic: every utterance; continual: their policy: none, fixed, oracle),
then step n = 0 .. max(N_r) - 1 over the runs with ``n < N_r`` (a run with fewer steps leaves its
parameters and moments alone), the per-run losses summed for one backward (the runs do not mix:
each row's gradient is its own loss's), each run's AdamW update with its own learning rates, and
one batched prediction. A non-finite loss or gradient skips that run's update only, as the host
step does. :class:`BatchedSUTA` is driven by ``tta_brain.sweep``; :class:`RunView` is one
run's method as the Brain and its checkpoint see it (``process``, ``events``, ``counts``,
``state_dict`` in the ordinary method's format).
"""
import logging
import math
from typing import List, Optional, Sequence

import torch
from torch.func import functional_call, vmap

from tta_brain.lobes.runtime import native_cpu_kernels
from tta_brain.methods import losses
from tta_brain.methods.csuta import CSUTA
from tta_brain.methods.events import Event
from tta_brain.methods.resets import FixedReset, NoReset, OracleReset
from tta_brain.methods.suta import SUTA

logger = logging.getLogger(__name__)

__all__ = ["BatchedSUTA", "RunView", "batch_blocker"]

METHODS = (SUTA, CSUTA)
POLICIES = (NoReset, FixedReset, OracleReset)


def batch_blocker(m) -> Optional[str]:
    """Why a built method cannot be one run of a batch (None: it can)."""
    opt = m.optimizer
    return (f"method {m.name} (batched: suta, csuta)" if type(m) not in METHODS else
            f"reset {m.reset_policy.name} (batched: none, fixed, oracle)"
            if m.reset_policy is not None and type(m.reset_policy) not in POLICIES else
            f"precision {m.runtime.precision} (batched: fp32)" if m.runtime.dtype is not None else
            "compile" if m.runtime.compile else
            "train_mode" if m.train_mode else
            "nothing adapts" if not m.params else
            f"optimizer {type(opt).__name__} (batched: AdamW, Adam)"
            if type(opt) not in (torch.optim.AdamW, torch.optim.Adam) else
            "amsgrad / maximize" if opt.defaults.get("amsgrad") or opt.defaults.get("maximize")
            else None)


class RunView:
    """One run of a batch, seen as its method (what ``TTABrain`` and its checkpoint use)."""

    def __init__(self, batch: "BatchedSUTA", r: int, method):
        self.batch, self.r = batch, r
        self.name, self.episodic = method.name, method.episodic
        self.lobe = batch.lobe
        self.steps, self.em_coef, self.temperature = method.steps, method.em_coef, method.temperature
        self.num_adapted = method.num_adapted
        self.counts = {k: 0 for k in method.counts}
        self.events: List[Event] = []
        self.t = 0
        self.hyp: Optional[str] = None          # set by the batch, returned by process
        self.reset_policy = method.reset_policy
        if self.reset_policy is not None:
            self.reset_policy.bind(self)
        self._describe = method.describe()

    def describe(self) -> str:
        return self._describe + f"; batched run {self.r + 1} of {self.batch.R}"

    def warnings(self, n_utts: int) -> List[str]:
        return self.reset_policy.warnings(n_utts) if self.reset_policy is not None else []

    def process(self, wav, info=None) -> str:
        """The transcript the batch computed for this run's current utterance."""
        hyp, self.hyp = self.hyp, None
        if hyp is None:
            raise RuntimeError(f"batched run {self.r}: no transcript computed for this utterance")
        return hyp

    def meta_values(self):
        return self.batch.values(self.r)

    def record_skip(self, why: str) -> None:
        self.counts["skipped_steps"] += 1
        logger.warning("%s: utterance %d: %s, adaptation step skipped", self.name, self.t, why)
        self.events.append(Event("skip", self.t, why))

    def reset_meta(self, after: int, position: int, reason: str) -> None:
        self.batch.reset([self.r])
        self.events.append(Event("reset", position, reason))
        if self.reset_policy is not None:
            self.reset_policy.on_reset(after)

    def state_dict(self):
        sd = {"t": self.t, "counts": dict(self.counts), "params": self.batch.values(self.r),
              "optimizer": self.batch.optimizer_state(self.r)}
        if self.reset_policy is not None:
            sd["reset_policy"] = self.reset_policy.state_dict()
        return sd

    def load_state_dict(self, sd):
        self.t = sd["t"]
        self.counts.update(sd["counts"])
        self.batch.load(self.r, sd["params"], sd.get("optimizer"))
        if self.reset_policy is not None and "reset_policy" in sd:
            self.reset_policy.load_state_dict(sd["reset_policy"])


class BatchedSUTA:
    """R SUTA-family runs on ``lobe`` (the model of ``methods[0]``). ``methods``: the runs' built
    methods (each checked by :func:`batch_blocker`; the same selection, betas and eps); only
    their settings and optimisers' learning rates are read, their own models are not used."""

    def __init__(self, lobe, methods: Sequence):
        first = methods[0]
        for i, m in enumerate(methods):
            why = batch_blocker(m)
            if why:
                raise ValueError(f"run {i + 1}: {why}")
            if m.param_names != first.param_names:
                raise ValueError(f"run {i + 1}: adapts other parameters than run 1")
            for k in ("betas", "eps", "weight_decay"):
                if m.optimizer.defaults.get(k) != first.optimizer.defaults.get(k):
                    raise ValueError(f"run {i + 1}: optimizer {k} differs from run 1's")
        self.lobe, self.R = lobe, len(methods)
        self.names = [f"model.{n}" for n in first.param_names]
        self.shapes = [p.shape for p in first.params]
        self.numels = [p.numel() for p in first.params]
        dev = lobe.device
        self.source = torch.cat([p.detach().reshape(-1) for p in first.source]).to(dev)
        self.P = self.source.repeat(self.R, 1)
        self.M, self.V = torch.zeros_like(self.P), torch.zeros_like(self.P)
        self.n_steps = [0] * self.R
        self.beta1, self.beta2 = first.optimizer.defaults["betas"]
        self.eps = first.optimizer.defaults["eps"]
        self.wd = first.optimizer.defaults.get("weight_decay", 0.0) or 0.0
        self.decoupled = isinstance(first.optimizer, torch.optim.AdamW) or bool(
            first.optimizer.defaults.get("decoupled_weight_decay"))
        self.lr = torch.stack([self._lrs(m) for m in methods])          # [R, N]
        self.templates = [self._template(m) for m in methods]
        self.blank_id = first.blank_id
        self.cpu_native = lobe.runtime.cpu_native_backward and dev.type == "cpu"
        self.views = [RunView(self, r, m) for r, m in enumerate(methods)]

    # ------------------------------------------------------------- per-run state
    def _lrs(self, m) -> torch.Tensor:
        """The run's learning rate of every adapted element (its optimiser's groups)."""
        lr_of = {id(p): g["lr"] for g in m.optimizer.param_groups for p in g["params"]}
        return torch.cat([torch.full((n,), float(lr_of[id(p)]), dtype=torch.float32)
                          for p, n in zip(m.params, self.numels)]).to(self.P.device)

    def _template(self, m):
        """The run's optimiser ``state_dict`` layout: param groups, state index -> tensor."""
        index = {id(p): k for k, p in enumerate(m.params)}
        order = [index[id(p)] for g in m.optimizer.param_groups for p in g["params"]]
        return m.optimizer.state_dict()["param_groups"], order

    def _rows(self, flat: torch.Tensor) -> List[torch.Tensor]:
        return [t.view(s) for t, s in zip(flat.split(self.numels, -1), self.shapes)]

    def values(self, r: int) -> List[torch.Tensor]:
        """Run ``r``'s adapted tensors (copies)."""
        return [t.clone() for t in self._rows(self.P[r])]

    def optimizer_state(self, r: int):
        """Run ``r``'s AdamW state in the format of its own optimiser's ``state_dict``."""
        groups, order = self.templates[r]
        m, v = self._rows(self.M[r]), self._rows(self.V[r])
        step = torch.tensor(float(self.n_steps[r]), dtype=torch.float32)
        state = {i: {"step": step.clone(), "exp_avg": m[k].clone(), "exp_avg_sq": v[k].clone()}
                 for i, k in enumerate(order)}
        return {"state": state, "param_groups": [dict(g) for g in groups]}

    @torch.no_grad()
    def load(self, r: int, params, opt) -> None:
        self.P[r] = torch.cat([p.reshape(-1).to(self.P) for p in params])
        self.M[r].zero_(), self.V[r].zero_()
        self.n_steps[r] = 0
        _, order = self.templates[r]
        for i, s in ((opt or {}).get("state") or {}).items():
            k = order[int(i)]
            off = sum(self.numels[:k])
            self.M[r, off:off + self.numels[k]] = s["exp_avg"].reshape(-1).to(self.M)
            self.V[r, off:off + self.numels[k]] = s["exp_avg_sq"].reshape(-1).to(self.V)
            self.n_steps[r] = int(s["step"])

    @torch.no_grad()
    def reset(self, runs: List[int]) -> None:
        """Runs back to the source: parameters and optimiser state."""
        idx = torch.tensor(runs, device=self.P.device)
        self.P[idx] = self.source
        self.M[idx] = 0.0
        self.V[idx] = 0.0
        for r in runs:
            self.n_steps[r] = 0

    # ------------------------------------------------------------- passes
    def logits(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``[R', 1, F, V]`` logits of ``x`` under each row of ``flat`` ``[R', N]``. Attention
        runs as matmul + softmax (transformers' eager attention) inside the vmap: the fused SDPA
        kernels have no vmap batching rule on CPU (a per-row loop) and failed in the backward on
        CUDA; the same maths, other rounding."""
        def one(row):
            return functional_call(self.lobe, dict(zip(self.names, self._rows(row))), (x,))
        config = self.lobe.model.config
        attn = getattr(config, "_attn_implementation", None)
        try:
            if attn is not None:
                config._attn_implementation = "eager"
            return vmap(one, randomness="same")(flat)
        finally:
            if attn is not None:
                config._attn_implementation = attn

    def step(self, runs: List[int], x: torch.Tensor) -> None:
        """One adaptation step of ``runs`` on ``x``."""
        views = [self.views[r] for r in runs]
        idx = torch.tensor(runs, device=self.P.device)
        whole = runs == list(range(self.R))
        leaf = (self.P if whole else self.P[idx]).detach().requires_grad_(True)
        logits = self.logits(leaf, x)
        per_run = [losses.suta_loss(logits[j], alpha=v.em_coef, temperature=v.temperature,
                                    blank_id=self.blank_id).mean() for j, v in enumerate(views)]
        values = torch.stack([l.detach() for l in per_run]).tolist()    # one host read
        ok = []
        for j, v in enumerate(views):
            v.counts["adapt_forward"] += 1
            if math.isfinite(values[j]):
                ok.append(j)
            else:
                v.record_skip(f"non-finite loss {values[j]}")
        if not ok:
            return
        total = sum(per_run[j] for j in ok)
        if self.cpu_native:
            with native_cpu_kernels():
                (grad,) = torch.autograd.grad(total, leaf)
        else:
            (grad,) = torch.autograd.grad(total, leaf)
        finite = grad.isfinite().all(dim=1).tolist()
        apply = []
        for j in ok:
            views[j].counts["adapt_backward"] += 1
            if finite[j]:
                apply.append(j)
            else:
                views[j].record_skip("non-finite gradient")
        if apply:
            self._adamw([runs[j] for j in apply], grad if len(apply) == len(runs)
                        else grad[torch.tensor(apply, device=grad.device)])

    @torch.no_grad()
    def _adamw(self, runs: List[int], g: torch.Tensor) -> None:
        """AdamW (torch's foreach update, row by row with each run's lr) on ``runs``."""
        whole = runs == list(range(self.R))
        for r in runs:
            self.n_steps[r] += 1
        s = [self.n_steps[r] for r in runs]
        dev = self.P.device
        col = lambda vals: torch.tensor(vals, dtype=torch.float32, device=dev)[:, None]
        if whole:
            p, m, v, lr = self.P, self.M, self.V, self.lr
        else:
            idx = torch.tensor(runs, device=dev)
            p, m, v, lr = self.P[idx], self.M[idx], self.V[idx], self.lr[idx]
        if self.wd:
            if self.decoupled:
                p.mul_(1 - lr * self.wd)
            else:
                g = g.add(p, alpha=self.wd)
        m.lerp_(g, 1 - self.beta1)
        v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        inv_bc1 = col([-1.0 / (1 - self.beta1 ** k) for k in s])
        denom = v.sqrt().div_(col([(1 - self.beta2 ** k) ** 0.5 for k in s])).add_(self.eps)
        p.add_(m.div(denom).mul_(lr * inv_bc1))
        if not whole:
            self.P[idx], self.M[idx], self.V[idx] = p, m, v

    @torch.no_grad()
    def transcripts(self, runs: List[int], x: torch.Tensor) -> List[str]:
        whole = runs == list(range(self.R))
        flat = self.P if whole else self.P[torch.tensor(runs, device=self.P.device)]
        logits = self.logits(flat, x)
        for r in runs:
            self.views[r].counts["infer_forward"] += 1
        return self.lobe.decode_labels(logits[:, 0].argmax(-1).cpu())

    # ------------------------------------------------------------- the skeleton, batched
    @torch.enable_grad()
    def process(self, runs: List[int], wav: torch.Tensor, info) -> None:
        """One utterance for ``runs`` (each run's ``hyp`` is set): ``TTAMethod.process`` of each."""
        x = self.lobe.prepare(wav)
        views = [self.views[r] for r in runs]
        episodic = [v.r for v in views if v.episodic]
        if episodic:
            self.reset(episodic)
        for v in views:
            if not v.episodic and v.reset_policy is not None:
                why = v.reset_policy.before_utterance(info)
                if why:
                    v.reset_meta(v.t, info.position, why)
        for n in range(max(v.steps for v in views)):
            todo = [v.r for v in views if n < v.steps]
            self.step(todo, x)
        for v, hyp in zip(views, self.transcripts(runs, x)):
            v.hyp = hyp
            t = v.t + 1
            policy = v.reset_policy
            if not v.episodic and policy is not None:
                policy.after_utterance(t, x, info)
                why = policy.at_update(t)
                if why:
                    v.reset_meta(t, info.position + 1, why)
                policy.end_step(t)
            v.t = t
