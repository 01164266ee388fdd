"""R runs of one method as one batch: R adapted states over one shared model, one batched
forward/backward per step (``torch.func.vmap`` of ``functional_call`` over the stacked adapted
parameters, the input shared; the frozen weights are the model's own, once).

:class:`BatchedSUTA` batches ``suta``, ``csuta`` and ``tent`` (methods whose step is their loss of
the logits alone, then AdamW); its subclasses override what their method adds:
``batched_dsuta`` (the slow learner of ``dsuta``), ``batched_eata`` (the sample filter and the
Fisher term), ``batched_sar`` (the two-pass SAM step, recovery), ``batched_cotta`` (teachers, each
run's own generators), ``batched_cea`` (the second stage) and ``batched_pseudo`` (``sdpl``,
``sgem`` and ``awmc``: host pseudo labels, SGEM's lr schedule, AWMC's leaders).
(``batched_free`` batches the backprop-free methods, on another skeleton.) The R states are flat
rows (:class:`AdamRows`): parameters ``P [R, N]``
(every adapted tensor of a run, in the selection's order) and AdamW's moments ``M, V [R, N]`` with
a step count per run. Per utterance: the runs' own resets (episodic: every utterance; continual:
their policy: none, fixed, oracle, dynamic), then step n = 0 .. max(N_r) - 1 over the runs with
``n < N_r`` (a run with fewer steps leaves its parameters and moments alone), the per-run losses
summed for one backward (the runs do not mix: each row's gradient is its own loss's), each run's
AdamW update with its own learning rates, and one batched prediction. A non-finite loss or
gradient skips that run's update only, as the host step does, masked on the device. The dynamic
reset's LII losses are one batched forward too (every run's phi_D and the source), before the
adaptation. Nothing of an utterance reads the device but the prediction's one copy (``read``),
which also brings the steps' losses and masks (the skip records and counts) and the LII values.
:class:`BatchedSUTA` is driven by ``tta_brain.sweep``; :class:`RunView` is one run's method as the
Brain and its checkpoint see it (``process``, ``events``, ``counts``, ``state_dict`` in the
ordinary method's format). A method with a filter of its own steps (``batched_eata``) gives its
drop mask with its losses (:meth:`BatchedSUTA.losses`). On CUDA a step is device work alone
(:meth:`BatchedSUTA.step_body`), captured and replayed as a CUDA graph
(``tta_brain.gpu.batch_graphs``), on length buckets where asked (:meth:`BatchedSUTA.pad`).
"""
import logging
from contextlib import contextmanager, nullcontext
from functools import partial
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.func import functional_call, vmap

from tta_brain.gpu import train_draws
from tta_brain.gpu.batch_graphs import batch_graphs
from tta_brain.gpu.graphs import bucket_length
from tta_brain.lobes.families import base_model
from tta_brain.lobes.runtime import native_cpu_kernels
from tta_brain.methods import losses
from tta_brain.methods.csuta import CSUTA
from tta_brain.methods.events import Event, UttInfo
from tta_brain.methods.resets import DynamicReset, FixedReset, NoReset, OracleReset
from tta_brain.methods.suta import SUTA
from tta_brain.methods.tent import Tent

logger = logging.getLogger(__name__)

__all__ = ["AdamRows", "BatchedSUTA", "RunView", "POLICIES", "lii_testers"]

POLICIES = (NoReset, FixedReset, OracleReset, DynamicReset)


def optimizer_blocker(opt, what: str = "optimizer") -> Optional[str]:
    """Why optimiser ``opt`` cannot be batched rows (None: it can)."""
    if type(opt) not in (torch.optim.AdamW, torch.optim.Adam):
        return f"{what} {type(opt).__name__} (batched: AdamW, Adam)"
    if opt.defaults.get("amsgrad") or opt.defaults.get("maximize"):
        return f"{what}: amsgrad / maximize"
    return None


def optimizer_template(opt, params):
    """The layout of ``opt.state_dict()`` over ``params``: its param groups, and for each of its
    state indices the position of the tensor in ``params``."""
    index = {id(p): k for k, p in enumerate(params)}
    order = [index[id(p)] for g in opt.param_groups for p in g["params"]]
    return opt.state_dict()["param_groups"], order


def tensor_lrs(opt, params) -> torch.Tensor:
    """The learning rate of each tensor of ``params`` in ``opt`` (float64, as torch reads it)."""
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    return torch.tensor([float(lr_of[id(p)]) for p in params], dtype=torch.float64)


def settings_loss(m):
    """Method ``m``'s step loss as a function of the logits, bound to its settings alone (its
    class's ``loss`` reading ``em_coef``, ``temperature`` and ``blank_id``): the batch keeps no
    reference to the method, its model or its tensors."""
    return partial(type(m).loss, SimpleNamespace(em_coef=m.em_coef, temperature=m.temperature,
                                                 blank_id=m.blank_id))


#: Models whose attention mask masks whole query rows (the padded output frames of Parakeet's
#: subsampling: one at some lengths, an unpadded utterance too): there transformers' eager
#: softmax gives NaN, which the convolution module spreads to every frame (each step skipped,
#: empty transcripts), while SDPA gives such a row zeros, as the model's own forward runs it.
#: They keep SDPA, on its math kernel (which vmaps).
SDPA_MODELS = ("parakeet_ctc",)


@contextmanager
def eager_attention(lobe):
    """The lobe's model with transformers' eager attention (matmul + softmax) meanwhile: the
    fused SDPA kernels have no vmap batching rule on CPU (a per-row loop) and failed in the
    backward on CUDA. :data:`SDPA_MODELS` keep SDPA on its math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    config = lobe.model.config
    attn = getattr(config, "_attn_implementation", None)
    try:
        if attn is not None and getattr(config, "model_type", None) not in SDPA_MODELS:
            config._attn_implementation = "eager"
        # WavLM calls SDPA whatever the setting, its relative position bias as the mask: the
        # fused CPU kernel has no gradient for the mask, the math one does (and vmaps)
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        if attn is not None:
            config._attn_implementation = attn


@contextmanager
def one_frame_convolutions(lobe):
    """Meanwhile, a 1-D convolution of the lobe's model given one frame gets its input in the
    standard strides. A transposed ``[1, C, 1]`` input (wav2vec2's strided adapter, on a
    ~40 ms utterance) counts as both layouts, and under ``vmap`` PyTorch's own CPU kernels
    (``cpu_native_backward``) then stopped the backward: "slow_conv2d: grad_weight must be
    contiguous" (torch 2.11). The copy changes no value."""
    def restride(module, args):
        x = args[0]
        if x.shape[-1] == 1:
            return (x.clone(memory_format=torch.contiguous_format),) + tuple(args[1:])
        return None
    hooks = [m.register_forward_pre_hook(restride) for m in lobe.modules()
             if isinstance(m, torch.nn.Conv1d)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@contextmanager
def vmap_ready(lobe):
    """The lobe's model ready for a ``vmap`` over parameter rows: :func:`eager_attention` and
    :func:`one_frame_convolutions`."""
    with eager_attention(lobe), one_frame_convolutions(lobe):
        yield


def upload(values, dtype, device) -> torch.Tensor:
    """A tensor of host ``values`` on ``device`` (:func:`to_device`)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Host tensor ``t`` on ``device``; to CUDA from pinned memory without waiting (a blocking
    copy would synchronise the stream)."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def run_blocker(classes, m) -> Optional[str]:
    """Why built method ``m`` cannot be a run of a batch of method ``classes``, as far as every
    batch goes (another method or reset policy, fp16/bf16, compile; None: it can)."""
    return (f"method {m.name} (this batch: {', '.join(c.name for c in classes)})"
            if type(m) not in classes else
            f"reset {m.reset_policy.name} (batched: none, fixed, oracle, dynamic)"
            if m.reset_policy is not None and type(m.reset_policy) not in POLICIES else
            f"precision {m.runtime.precision} (batched: fp32)" if m.runtime.dtype is not None
            else "compile" if m.runtime.compile else None)


#: Base models whose forward ``torch.func.vmap`` cannot map, and why (their runs go separately)
UNMAPPED_MODELS = {"SEWDModel": "SEW-D's attention applies autograd Functions without "
                                "setup_context (XSoftmax, XDropout), which torch.func cannot map"}


def model_blocker(m) -> Optional[str]:
    """Why the batched forward (``vmap`` over the runs' stacked parameters) cannot run the model
    of method ``m`` (None: it can)."""
    why = UNMAPPED_MODELS.get(type(base_model(m.lobe.model)).__name__)
    return f"the model ({why})" if why else None


def train_mode_blocker(m) -> Optional[str]:
    """Why method ``m``'s ``train_mode`` cannot be batched (None: it is off, or the model's train
    mode draws nothing, so the batch's eval-mode passes are its passes): a batch cannot draw each
    run's dropout as its separate run draws it."""
    draws = train_draws(m)
    return (f"train_mode (this model draws in train mode: {', '.join(draws)}; a batch cannot "
            f"draw each run's as its separate run does: set train_mode false or run them "
            f"separately)" if draws else None)


def lii_testers(runs: Sequence) -> list:
    """The continual runs (views, or built methods) whose reset policy computes an LII after
    this utterance; each counted its two policy passes, as a separate run counts its losses
    computed ahead."""
    want = [v for v in runs if not v.episodic and v.reset_policy is not None
            and v.reset_policy.needs_lii(v.t + 1)]
    for v in want:
        v.counts["aux_forward"] += 2
    return want


def check_runs(batch, methods):
    """``(i, method)`` of ``methods``, each checked by ``batch.blocker`` and of run 1's method
    (a ``ValueError`` naming the run otherwise)."""
    for i, m in enumerate(methods):
        why = batch.blocker(m)
        if why:
            raise ValueError(f"run {i + 1}: {why}")
        if type(m) is not type(methods[0]):
            raise ValueError(f"run {i + 1}: method {m.name}, run 1's is {methods[0].name}")
        yield i, m


class RowIndex:
    """The device index tensor of each set of rows, made once (a tensor made from a host list
    is an upload, and on CUDA a blocking copy waits for the device); all rows and each row alone
    (a reset) are made at the start."""

    def __init__(self, device, R: int):
        self.device, self.cache = device, {}
        for runs in [list(range(R))] + [[r] for r in range(R)]:    # all, and each run's reset
            self(runs)

    def __call__(self, runs: Sequence[int]) -> torch.Tensor:
        key = tuple(runs)
        idx = self.cache.get(key)
        if idx is None:
            idx = self.cache[key] = upload(key, torch.int64, self.device)
        return idx


class AdamRows:
    """R rows of flat parameters ``P [R, N]`` with Adam / AdamW moments ``M, V`` and a step count
    per row, each row with its own learning rate per tensor (``lr [R, T]``, float64; ``numels``:
    the T tensors' sizes along a row), updated as torch's foreach Adam(W) updates each run's
    tensor list: on CPU bit for bit (the scalars computed in double as torch computes them, the
    element-wise operations in its order). ``init [N]``: the value a reset restores. ``opt``: an
    optimiser of the runs (betas, eps, weight decay, AdamW or Adam).

    Nothing here reads the device: the step counts ``k`` live on the device (an update whose
    ``mask`` row is false leaves that row, its moments and its count alone), the bias corrections
    are a table indexed by them (computed on the host as torch computes them, grown ahead of the
    most steps a row can have taken), and the index tensors of the row sets are made once."""

    def __init__(self, init: torch.Tensor, lr: torch.Tensor, numels: Sequence[int], opt):
        self.init = init
        dev = init.device
        self.lr = lr.to(device=dev, dtype=torch.float64)
        self.R = lr.shape[0]
        # the tensor each element belongs to: per-tensor scalars spread along a row by a gather
        self.owner = torch.repeat_interleave(torch.arange(len(numels)),
                                             torch.tensor(list(numels))).to(dev)
        self.P = init.repeat(self.R, 1)
        self.M, self.V = torch.zeros_like(self.P), torch.zeros_like(self.P)
        self.k = torch.zeros(self.R, dtype=torch.int64, device=dev)     # steps taken, per row
        self.bound = [0] * self.R       # host: steps a row may have taken (>= k) since its reset
        self.beta1, self.beta2 = opt.defaults["betas"]
        self.eps = opt.defaults["eps"]
        self.wd = opt.defaults.get("weight_decay", 0.0) or 0.0
        self.decoupled = isinstance(opt, torch.optim.AdamW) or bool(
            opt.defaults.get("decoupled_weight_decay"))
        self.rows_index = RowIndex(dev, self.R)
        self.bc1 = self.bc2_sqrt = torch.zeros(0, dtype=torch.float64)

    def tensors(self) -> List[torch.Tensor]:
        """The device tensors an update reads or writes."""
        return [self.P, self.M, self.V, self.k, self.lr, self.owner, self.bc1, self.bc2_sqrt]

    @property
    def steps(self) -> List[int]:
        """The rows' step counts (a host read: checkpoints and tests)."""
        return self.k.tolist()

    def index(self, runs: List[int]) -> Optional[torch.Tensor]:
        """None for all rows in order (no copy), else the rows' index tensor."""
        return None if runs == list(range(self.R)) else self.rows_index(runs)

    def rows(self, runs: List[int]) -> torch.Tensor:
        idx = self.index(runs)
        return self.P if idx is None else self.P.index_select(0, idx)

    def _spread(self, per_tensor: torch.Tensor) -> torch.Tensor:
        """``[R', T]`` float64 scalars -> ``[R', N]`` in the parameters' dtype (torch casts its
        double scalars to the tensor's type)."""
        return per_tensor.to(self.P.dtype).index_select(1, self.owner)

    def _corrections(self, most: int) -> None:
        """The bias-correction tables up to step ``most`` at least (torch's double scalars:
        ``1 - beta1 ** k`` and ``(1 - beta2 ** k) ** 0.5``); grown by doubling, so rarely."""
        if most < len(self.bc1):
            return
        ks = range(max(1024, 2 * most + 1))
        dev = self.P.device
        self.bc1 = upload([1 - self.beta1 ** k for k in ks], torch.float64, dev)
        self.bc2_sqrt = upload([(1 - self.beta2 ** k) ** 0.5 for k in ks], torch.float64, dev)

    @torch.no_grad()
    def update(self, runs: List[int], g: torch.Tensor,
               mask: Optional[torch.Tensor] = None) -> None:
        """One Adam(W) step of ``runs`` with their gradient rows ``g [len(runs), N]``; with
        ``mask`` (bool ``[len(runs)]``, on the device) only the rows where it is true step."""
        self.advance(runs)
        self.move(runs, g, mask)

    def advance(self, runs: List[int]) -> None:
        """The host's part of a step of ``runs`` (before :meth:`move`): their step bounds, and
        the bias-correction tables grown ahead of them."""
        for r in runs:
            self.bound[r] += 1
        self._corrections(max(self.bound[r] for r in runs))

    @torch.no_grad()
    def move(self, runs: List[int], g: torch.Tensor, mask: Optional[torch.Tensor] = None) -> None:
        """The device's part of :meth:`update` (device work only: a captured step runs it)."""
        idx = self.index(runs)
        if idx is None:
            p, m, v, lr, k = self.P, self.M, self.V, self.lr, self.k
        else:
            p, m, v, lr, k = (t.index_select(0, idx) for t in (self.P, self.M, self.V, self.lr,
                                                                self.k))
        k = k + 1 if mask is None else k + mask.to(k.dtype)
        new_p = p
        if self.wd:
            if self.decoupled:
                new_p = p.mul(self._spread(1 - lr * self.wd))
            else:
                g = g.add(p, alpha=self.wd)
        new_m = m.lerp(g, 1 - self.beta1)
        new_v = v.mul(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        step_size = self._spread(lr / self.bc1[k][:, None] * -1)
        denom = new_v.sqrt().div_(self.bc2_sqrt[k].to(p.dtype)[:, None])
        denom.add_(self.eps)
        new_p = new_p.add(new_m.mul(step_size).div_(denom))   # addcdiv's order: (value * m) / denom
        if mask is not None:
            keep = mask[:, None]
            new_p, new_m, new_v = (torch.where(keep, a, b) for a, b in
                                   ((new_p, p), (new_m, m), (new_v, v)))
        if idx is None:
            for t, new in ((self.P, new_p), (self.M, new_m), (self.V, new_v), (self.k, k)):
                t.copy_(new)
        else:
            for t, new in ((self.P, new_p), (self.M, new_m), (self.V, new_v), (self.k, k)):
                t.index_copy_(0, idx, new)

    @torch.no_grad()
    def reset(self, runs: List[int]) -> None:
        """Rows back to ``init``, their moments and step counts to zero."""
        idx = self.rows_index(runs)
        self.P.index_copy_(0, idx, self.init.expand(len(runs), -1))
        self.zero_moments(runs)

    @torch.no_grad()
    def zero_moments(self, runs: List[int]) -> None:
        idx = self.rows_index(runs)
        for t in (self.M, self.V, self.k):
            t.index_fill_(0, idx, 0)
        for r in runs:
            self.bound[r] = 0

    @torch.no_grad()
    def take(self, other: "AdamRows", runs: List[int], moments: List[int]) -> None:
        """Rows ``runs`` from ``other``'s (DSUTA's fast learner from the slow one); the moments
        and step counts of the rows in ``moments`` from ``other``'s, the others' zeroed."""
        idx = self.rows_index(runs)
        self.P.index_copy_(0, idx, other.P.index_select(0, idx))
        if moments:
            mi = self.rows_index(moments)
            for mine, theirs in ((self.M, other.M), (self.V, other.V), (self.k, other.k)):
                mine.index_copy_(0, mi, theirs.index_select(0, mi))
            for r in moments:
                self.bound[r] = other.bound[r]
        rest = [r for r in runs if r not in moments]
        if rest:
            self.zero_moments(rest)

    def state(self, r: int, template, split) -> Dict:
        """Row ``r``'s moments as the ``state_dict`` of its run's optimiser (``template``: see
        :func:`optimizer_template`; ``split``: flat row -> the run's tensors)."""
        groups, order = template
        m, v = split(self.M[r]), split(self.V[r])
        step = torch.tensor(float(self.k[r]), dtype=torch.float32)
        state = {i: {"step": step.clone(), "exp_avg": m[k].clone(), "exp_avg_sq": v[k].clone()}
                 for i, k in enumerate(order)}
        return {"state": state, "param_groups": [dict(g) for g in groups]}

    @torch.no_grad()
    def load(self, r: int, params, opt, template, numels) -> None:
        """Row ``r`` from its run's tensors ``params`` and optimiser ``state_dict`` ``opt``."""
        self.P[r] = torch.cat([p.reshape(-1).to(self.P) for p in params])
        self.M[r].zero_(), self.V[r].zero_()
        step = 0
        _, order = template
        for i, s in ((opt or {}).get("state") or {}).items():
            if not s:                   # never stepped (DSUTA's copied state): no moments
                continue
            k = order[int(i)]
            off = sum(numels[:k])
            self.M[r, off:off + numels[k]] = s["exp_avg"].reshape(-1).to(self.M)
            self.V[r, off:off + numels[k]] = s["exp_avg_sq"].reshape(-1).to(self.V)
            step = int(s["step"])
        self.k[r] = step
        self.bound[r] = step


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
        self.early_losses: Dict = {}            # the LII losses the batch computed (loss_with)
        self.info = UttInfo()                   # the utterance being processed
        self.reset_policy = method.reset_policy
        if self.reset_policy is not None:
            self.reset_policy.bind(self)
        self._describe = method.describe()

    def describe(self) -> str:
        return self._describe + f"; batched run {self.r + 1} of {self.batch.R}"

    def warnings(self, n_utts: int, boundaries=None) -> List[str]:
        return (self.reset_policy.warnings(n_utts, boundaries) if self.reset_policy is not None
                else [])

    def process(self, wav, info=None) -> str:
        """The transcript the batch computed for this run's current utterance."""
        hyp, self.hyp = self.hyp, None
        if hyp is None:
            raise RuntimeError(
                f"batched run {self.r + 1}: no transcript computed for this utterance")
        return hyp

    def meta_values(self):
        return self.batch.meta_values(self.r)

    def loss_with(self, values, x) -> float:
        """The SUTA loss of this utterance under ``values`` (the policy's phi_D) or the source
        (None), as the batch computed it (``BatchedSUTA.lii_ahead``)."""
        if values is not None and values is not getattr(self.reset_policy, "phi_D", None):
            raise RuntimeError(
                f"batched run {self.r + 1}: loss_with only knows phi_D and the source")
        return self.early_losses.pop("source" if values is None else "phi_D")

    def record_skip(self, why: str, clear_grads: bool = False) -> None:
        """As ``TTAMethod.record_skip`` (a batch holds no gradients to clear)."""
        self.counts["skipped_steps"] += 1
        with self.batch.serving(self.r):
            logger.warning("%s: utterance %d: %s, adaptation step skipped", self.name, self.t, why)
        self.events.append(Event("skip", self.t, why))

    def reset_meta(self, after: int, position: int, reason: str) -> None:
        self.batch.reset([self.r])
        self.events.append(Event("reset", position, reason))
        if self.reset_policy is not None:
            self.reset_policy.on_reset(after)

    def state_dict(self):
        sd = {"t": self.t, "counts": dict(self.counts)} | self.batch.state_dict(self.r)
        if self.reset_policy is not None:
            sd["reset_policy"] = self.reset_policy.state_dict()
        return sd

    def load_state_dict(self, sd):
        self.t = sd["t"]
        self.counts.update(sd["counts"])
        self.batch.load_state_dict(self.r, sd)
        if self.reset_policy is not None and "reset_policy" in sd:
            self.reset_policy.load_state_dict(sd["reset_policy"])


class BatchedSUTA:
    """R runs of ``suta``, ``csuta`` or ``tent`` on ``lobe`` (the model of ``methods[0]``; each
    run's step loss is its own method's ``loss`` of its logits). ``methods``:
    the runs' built methods (each checked by :meth:`blocker`; one method, the same selection,
    betas and eps); only their settings and optimisers' learning rates are read, their own
    models are not used. Subclasses (``batched_dsuta``) override the hooks of :meth:`process`:
    ``adapt``, ``update_due``, ``meta_update``, ``reset``, ``meta_values`` and the state."""

    #: the method classes this batch runs
    methods = (SUTA, CSUTA, Tent)
    #: its step is :meth:`step_body` (device work, state in place), so it may be captured as a
    #: CUDA graph (``tta_brain.gpu.batch_graphs``); else ``not_captured`` says why not
    capturable = True
    #: its losses mask the padded frames of a padded pass (they take ``lengths``), so its
    #: captured steps may run on length buckets
    masks_padding = True

    @classmethod
    def blocker(cls, m) -> Optional[str]:
        """Why a built method cannot be one run of this batch (None: it can)."""
        return run_blocker(cls.methods, m) or model_blocker(m) or train_mode_blocker(m) or (
            "nothing adapts" if not m.params else optimizer_blocker(m.optimizer))

    def __init__(self, lobe, methods: Sequence):
        first = methods[0]
        for i, m in check_runs(self, methods):
            if m.param_names != first.param_names:
                raise ValueError(f"run {i + 1}: adapts other parameters than run 1")
            self._same(i, m.optimizer, first.optimizer, "optimizer")
        self.lobe, self.R = lobe, len(methods)
        self.names = [f"model.{n}" for n in first.param_names]
        self.shapes = [p.shape for p in first.params]
        self.numels = [p.numel() for p in first.params]
        self.source = torch.cat([p.detach().reshape(-1) for p in first.source]).to(lobe.device)
        self.fast = AdamRows(self.source, torch.stack(
            [tensor_lrs(m.optimizer, m.params) for m in methods]), self.numels, first.optimizer)
        self.templates = [optimizer_template(m.optimizer, m.params) for m in methods]
        self.step_losses = [settings_loss(m) for m in methods]
        self.blank_id = first.blank_id
        self.cpu_native = lobe.runtime.cpu_native_backward and lobe.device.type == "cpu"
        self.views = [RunView(self, r, m) for r, m in enumerate(methods)]
        self.rows_index = RowIndex(lobe.device, self.R)
        self.notes, self.early, self.frames = [], None, 0   # this utterance's, for its read
        self.graphs = batch_graphs(self, first.runtime)     # CUDA: the captured steps, or None
        self.buckets = self._buckets(first.runtime)         # length buckets (0: off)
        self.samples = self.valid = None                    # this utterance's, on buckets
        self.lii_rows = None                                # the LII graphs' rows (buckets)
        #: ``serving(r)``: the context in which run r's own records are logged (the sweep's:
        #: they go to its log.txt alone); the batch's own records are logged outside any
        self.serving = nullcontext

    def _buckets(self, rt) -> float:
        """The length-bucket ratio of the captured steps (``cuda_graph_buckets``; 0: off), where
        the padded pass is exact for the model and the losses mask its padding."""
        ratio = rt.bucket_ratio(self.lobe.device.type) if self.graphs is not None else 0.0
        why = ratio and ("its losses do not mask padded frames" if not self.masks_padding
                         else self.lobe.padding_blocker())
        if why:
            # auto: buckets where exact, said once; asked for (a ratio): a warning
            (logger.info if rt.cuda_graph_buckets == "auto" else logger.warning)(
                "%s: no length buckets (%s); every new length is captured",
                type(self).__name__, why)
            ratio = 0.0
        if self.graphs is not None:      # the graphs kept, now that it is known (cache: auto)
            self.graphs.set_capacity(rt.graph_cache(ratio))
        if ratio:
            logger.info("%s: the captured steps run on length buckets (ratio %g)",
                        type(self).__name__, ratio)
        return ratio

    @staticmethod
    def _same(i, opt, first, what):
        for k in ("betas", "eps", "weight_decay"):
            if opt.defaults.get(k) != first.defaults.get(k):
                raise ValueError(f"run {i + 1}: {what} {k} differs from run 1's")

    @property
    def P(self) -> torch.Tensor:
        """The runs' adapted parameters ``[R, N]``."""
        return self.fast.P

    def _rows(self, t: torch.Tensor, runs: List[int]) -> torch.Tensor:
        """Rows ``runs`` of ``[R, ...]`` state ``t`` (``t`` itself, not a copy, for all rows in
        order)."""
        idx = self.fast.index(runs)
        return t if idx is None else t.index_select(0, idx)

    def _put_rows(self, t: torch.Tensor, runs: List[int], new: torch.Tensor) -> None:
        """Rows ``runs`` of ``t`` set to ``new`` (in place)."""
        idx = self.fast.index(runs)
        if idx is None:
            t.copy_(new)
        else:
            t.index_copy_(0, idx, new)

    # ------------------------------------------------------------- per-run state
    def split(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """A flat row as the run's tensors (views)."""
        return [t.view(s) for t, s in zip(flat.split(self.numels, -1), self.shapes)]

    def flat(self, tensors) -> torch.Tensor:
        """The run's tensors as one flat row."""
        return torch.cat([t.reshape(-1).to(self.source) for t in tensors])

    def values(self, r: int) -> List[torch.Tensor]:
        """Run ``r``'s adapted tensors (copies)."""
        return [t.clone() for t in self.split(self.fast.P[r])]

    def meta_values(self, r: int) -> List[torch.Tensor]:
        """Run ``r``'s phi_t, the tensors its reset policy tests (copies)."""
        return self.values(r)

    def state_dict(self, r: int) -> Dict:
        """Run ``r``'s parameters and optimiser state in its method's checkpoint format."""
        return {"params": self.values(r),
                "optimizer": self.fast.state(r, self.templates[r], self.split)}

    def load_state_dict(self, r: int, sd: Dict) -> None:
        self.fast.load(r, sd["params"], sd.get("optimizer"), self.templates[r], self.numels)

    def reset(self, runs: List[int]) -> None:
        """Runs back to the source: parameters and optimiser state."""
        self.fast.reset(runs)

    # ------------------------------------------------------------- passes
    def logits(self, flat: torch.Tensor, x: torch.Tensor,
               samples: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[R', 1, F, V]`` logits of ``x`` under each row of ``flat`` ``[R', N]``. Attention
        runs as matmul + softmax (transformers' eager attention) inside the vmap: the fused SDPA
        kernels have no vmap batching rule on CPU (a per-row loop) and failed in the backward on
        CUDA; the same maths, other rounding. ``samples``: ``x`` is zero-padded to its length
        bucket with these valid samples (``[1]``, on the device): the padded pass
        (``lobe.padded_logits``), F the bucket's frames."""
        return self.logits_each(flat, x, None, samples)

    def logits_each(self, flat: torch.Tensor, x: torch.Tensor, x_dim: Optional[int] = 0,
                    samples: Optional[torch.Tensor] = None):
        """As :meth:`logits`; ``x_dim`` 0: ``x`` ``[R', 1, T]`` holds one input per row (CoTTA's
        augmented views), None: ``x`` is shared."""
        kwargs = {} if samples is None else {"samples": samples}

        def one(row, inputs):
            return functional_call(self.lobe, dict(zip(self.names, self.split(row))), (inputs,),
                                   kwargs)
        with vmap_ready(self.lobe):
            return vmap(one, in_dims=(0, x_dim), randomness="same")(flat, x)

    def frames_of(self, samples: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The valid logit frames of a padded pass (None: not padded), on the device."""
        return None if samples is None else self.lobe.output_lengths(samples)

    def _loss(self, logits: torch.Tensor, v: RunView,
              lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The SUTA loss of one run's logits (the reset policy's LII, whatever the method)."""
        return losses.suta_loss(logits, lengths, alpha=v.em_coef, temperature=v.temperature,
                                blank_id=self.blank_id).mean()

    def step(self, runs: List[int], x: torch.Tensor, update: bool = True, grads: bool = True,
             left: int = 1):
        """One adaptation step of ``runs`` on ``x``: the device mask of the runs whose loss and
        gradient were finite and the gradient rows ``[len(runs)', N]`` (a row with a non-finite
        loss gets no gradient from it and is masked; the rows do not mix). ``update=False``: the
        gradients only (DSUTA's slow gradient with no fast steps), the non-finite ones dropped
        without a skip record. Nothing is read on the host: the losses and masks are noted for
        the utterance's one read (:meth:`settle` counts the backward passes and records the
        skipped steps), and a masked run's update is skipped on the device.

        ``grads=False``: the caller needs neither (None, None), so the step may be replayed from
        a captured CUDA graph (:attr:`graphs`; ``left``: the steps of these runs left in this
        utterance, this one included, decide whether a capture is worth it)."""
        for r in runs:
            self.views[r].counts["adapt_forward"] += 1
        if update:
            self.advance(runs)
        graphs = self.graphs
        if graphs is not None and update and not grads:
            finite = grad = None
            values = graphs.step(runs, x, left, self.samples)
        elif graphs is not None:
            finite, grad, values = graphs.eager(runs, x, update, self.samples)
        else:
            finite, grad, values = self.step_body(runs, x, update, self.samples)
        self.notes.append((self.settler(runs, update), values))
        return finite, grad

    def step_body(self, runs: List[int], x: torch.Tensor, update: bool = True,
                  samples: Optional[torch.Tensor] = None):
        """The device work of :meth:`step` (no host read, no host state: a captured step is
        this, replayed): the finite mask, the gradient rows and the values :meth:`settle`
        reads (``[w, len(runs)]`` float64). ``samples``: as :meth:`logits`."""
        leaf = self.fast.rows(runs).detach().requires_grad_(True)
        logits = self.logits(leaf, x, samples)
        loss, drop, why = self.losses(runs, logits, leaf, self.frames_of(samples))
        ok = loss.detach().isfinite()
        use = ok if drop is None else ok & ~drop
        grad = self.backward(torch.where(use, loss, torch.zeros_like(loss)).sum(), leaf)
        finite = use & grad.isfinite().all(dim=1)
        rows = [loss.detach(), ok, finite] + ([] if drop is None else [drop, *why.unbind(1)])
        if update:
            self.apply(runs, grad, finite)
        return finite, grad, self.pack(rows)

    def settler(self, runs: List[int], update: bool):
        """What settles a :meth:`step`'s values on the host (``handler(values)``, as
        :meth:`note`'s): the backward counts and skip or filter records (SAR: its SAM verdicts)."""
        return partial(self._settle_step, runs, update)

    def advance(self, runs: List[int]) -> None:
        """The host's part of the optimiser step of ``runs`` (before :meth:`apply`)."""
        self.fast.advance(runs)

    def apply(self, runs: List[int], grad: torch.Tensor, finite: torch.Tensor) -> None:
        """The optimiser step of ``runs`` with their gradient rows, where ``finite`` (device
        work only: :meth:`advance` did the host's part)."""
        self.fast.move(runs, grad, finite)

    def graph_key(self) -> tuple:
        """What besides the run set and the input's shape makes another captured step (CEA:
        its stage)."""
        return ()

    def device_tensors(self) -> List[torch.Tensor]:
        """Every tensor a step reads or writes besides its scratch (a captured step is valid
        while these stay where they are)."""
        return self.fast.tensors() + [self.source]

    def backward(self, total: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
        """The gradient rows of ``total`` (the runs' summed losses) w.r.t. ``leaf``."""
        if self.cpu_native:
            with native_cpu_kernels():
                return torch.autograd.grad(total, leaf)[0]
        return torch.autograd.grad(total, leaf)[0]

    def note(self, handler, rows: List[torch.Tensor]) -> None:
        """Device values ``rows`` (equal-length 1-D tensors) for this utterance's one read;
        ``handler(values)`` gets them back on the host (a list of lists) in :meth:`settle`."""
        self.notes.append((handler, self.pack(rows)))

    @staticmethod
    def pack(rows: List[torch.Tensor]) -> torch.Tensor:
        return torch.stack([t.to(torch.float64) for t in rows])

    def _settle_step(self, runs: List[int], update: bool, block: List[List[float]]) -> None:
        """A :meth:`step`'s values on the host: the backward counts and the skipped steps, as
        the host step records them, or the method's filter's records."""
        loss, ok, finite = block[:3]
        for j, r in enumerate(runs):
            v = self.views[r]
            if len(block) > 3 and block[3][j]:              # the method's filter dropped it
                with self.serving(r):
                    self.filtered(v, [row[j] for row in block[4:]])
            elif ok[j]:
                v.counts["adapt_backward"] += 1
                if not finite[j] and update:
                    v.record_skip("non-finite gradient")
            elif update:
                v.record_skip(f"non-finite loss {loss[j]}")

    def losses(self, runs: List[int], logits: torch.Tensor, leaf: torch.Tensor,
               lengths: Optional[torch.Tensor] = None):
        """The runs' step losses ``[R']`` from their logits ``[R', 1, F, V]`` (``leaf``: their
        adapted rows; ``lengths``: the valid frames of a padded pass, or None), and the method's
        filter of its steps: a bool ``[R']`` device mask of the dropped ones and the values
        ``[R', w]`` that say why (:meth:`filtered` reads them), or None, None. Default: each
        run's own ``loss``, no filter."""
        loss = torch.stack([self.step_losses[r](logits[j], lengths)
                            for j, r in enumerate(runs)])
        return loss, None, None

    def filtered(self, view: RunView, values: List[float]) -> None:
        """Run ``view``'s step that the method's filter dropped (``values``: as :meth:`losses`
        gave them), recorded as its method records one."""
        raise NotImplementedError(f"{type(self).__name__} has a filter but no filtered()")

    @torch.no_grad()
    def predict(self, runs: List[int], x: torch.Tensor) -> torch.Tensor:
        """The runs' frame labels, with the utterance's noted step values and LII losses, as one
        flat float64 device tensor (:meth:`settle` reads it)."""
        logits = self.prediction(runs, x)
        if self.samples is not None:                     # a padded pass: its valid frames
            logits = logits[:, :, :self.valid]
        for r in runs:
            self.views[r].counts["infer_forward"] += 1
        self.frames = logits.shape[2]
        parts = [logits[:, 0].argmax(-1).reshape(-1).to(torch.float64)]
        parts += [values.reshape(-1) for _, values in self.notes]
        if self.early is not None:
            parts.append(self.early[1])
        return torch.cat(parts)

    def prediction(self, runs: List[int], x: torch.Tensor) -> torch.Tensor:
        """The logits ``[R', 1, F, V]`` the runs' transcripts decode (their adapted rows'; on
        length buckets replayed from a captured forward once warm)."""
        if self.graphs is not None:
            return self.graphs.predict(runs, x, self.samples)
        return self.logits(self.fast.rows(runs), x, self.samples)

    @staticmethod
    def read(packed: torch.Tensor) -> torch.Tensor:
        """The utterance's one read of the device (on CUDA its one synchronisation)."""
        return packed.cpu()

    def settle(self, runs: List[int], host: torch.Tensor) -> None:
        """From the utterance's read (:meth:`predict`): each run's transcript, its backward
        counts and skipped steps (as the host step records them), its LII losses."""
        n = len(runs) * self.frames
        labels = host[:n].to(torch.int64).view(len(runs), self.frames)
        for r, hyp in zip(runs, self.lobe.decode_labels(labels)):
            self.views[r].hyp = hyp
        at = n
        for handler, values in self.notes:
            k, w = values.shape
            handler(host[at:at + k * w].view(k, w).tolist())
            at += k * w
        self.notes = []
        if self.early is not None:
            values = host[at:].tolist()
            for j, v in enumerate(self.early[0]):
                v.early_losses = {"phi_D": values[2 * j], "source": values[2 * j + 1]}
            self.early = None

    @torch.no_grad()
    def lii_ahead(self, views: List[RunView], x: torch.Tensor) -> None:
        """For the continual runs whose reset policy computes an LII after this utterance: the
        SUTA losses under their phi_D and under the source, one batched forward before the
        adaptation (phi_D, the source and x are all they depend on), read with the transcripts
        (``loss_with`` answers from them). Counted here, as a separate run counts its losses
        ahead: two forwards each, also where a recovery (SAR) then resets the run before its LII."""
        want = lii_testers(views)
        if not want:
            return
        rows = torch.stack([self.flat(v.reset_policy.phi_D) for v in want] + [self.source])
        logits = self.lii_forward(rows, x)
        n = self.frames_of(self.samples)
        self.early = (want, torch.stack([l for j, v in enumerate(want) for l in (
            self._loss(logits[j], v, n), self._loss(logits[-1], v, n))]).to(torch.float64))

    def lii_forward(self, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The LII's no-grad logits of ``x`` under ``rows`` ``[k, N]``; on length buckets
        replayed from a graph per row count and bucket once warm (``rows`` copied into a
        staging tensor of R + 1 rows made once, where the graph reads them)."""
        if self.graphs is None or self.samples is None:
            return self.logits(rows, x, self.samples)
        k = rows.shape[0]
        if self.lii_rows is None:
            self.lii_rows = torch.empty(self.R + 1, rows.shape[1], dtype=rows.dtype,
                                        device=rows.device)
        self.lii_rows[:k].copy_(rows)
        return self.graphs.forward(("lii", k), lambda: self.lii_rows[:k], x, self.samples,
                                   "the LII forward", "lii_replays")

    # ------------------------------------------------------------- the skeleton, batched
    @torch.enable_grad()
    def process(self, runs: List[int], wav: torch.Tensor, info) -> None:
        """One utterance for ``runs`` (each run's ``hyp`` is set): ``TTAMethod.process`` of each,
        with one read of the device (:meth:`read`), after the prediction."""
        x = self.pad(self.lobe.prepare(wav))
        views = [self.views[r] for r in runs]
        for v in views:
            v.info = info
        episodic = [v.r for v in views if v.episodic]
        if episodic:
            self.reset(episodic)
        for v in views:
            if not v.episodic and v.reset_policy is not None:
                with self.serving(v.r):
                    why = v.reset_policy.before_utterance(info)
                    if why:
                        v.reset_meta(v.t, info.position, why)
        self.notes, self.early = [], None
        self.lii_ahead(views, x)
        self.adapt(runs, x)
        self.settle(runs, self.read(self.predict(runs, x)))
        self.after(views, x, info)
        for v in views:
            v.t += 1

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """The utterance's input for every pass: on length buckets (:attr:`buckets` > 0) ``x``
        zero-padded to its bucket, its valid samples in :attr:`samples` (on the device) and its
        valid frames in :attr:`valid` (on the host); else ``x`` itself."""
        self.samples = self.valid = None
        if not self.buckets:
            return x
        lobe, n = self.lobe, x.shape[-1]
        n_pad = bucket_length(n, self.buckets, lobe.frame_stride, lobe.sample_rate)
        self.samples = torch.full((x.shape[0],), n, dtype=torch.long, device=x.device)
        self.valid = int(lobe.output_lengths(torch.tensor(n)))
        return F.pad(x, (0, n_pad - n))

    def adapt(self, runs: List[int], x: torch.Tensor) -> None:
        """The runs' adaptation steps on ``x`` (before the prediction)."""
        for n in range(max(self.views[r].steps for r in runs)):
            now = [r for r in runs if n < self.views[r].steps]
            self.before_step(now, n)
            self.step(now, x, grads=False, left=min(self.views[r].steps for r in now) - n)

    def before_step(self, runs: List[int], n: int) -> None:
        """Before step ``n`` (0-based) of ``runs`` (``TTAMethod.before_step``; SGEM: its lr
        schedule)."""

    def after(self, views: List[RunView], x: torch.Tensor, info) -> None:
        """The continual runs' policies after the prediction (``TTAMethod._policy_after``): the
        LII (computed ahead), then at an update a reset or the meta-update, then the end of the
        step."""
        views = [v for v in views if not v.episodic]
        due = []
        for v in views:
            policy = v.reset_policy
            with self.serving(v.r):
                if policy is not None:
                    policy.after_utterance(v.t + 1, x, info)
                if self.update_due(v.r):
                    why = policy.at_update(v.t + 1) if policy is not None else None
                    if why:
                        v.reset_meta(v.t + 1, info.position + 1, why)
                    else:
                        due.append(v.r)
        if due:
            self.meta_update(due)
        for v in views:
            if v.reset_policy is not None:
                with self.serving(v.r):
                    v.reset_policy.end_step(v.t + 1)

    def update_due(self, r: int) -> bool:
        """Is run ``r``'s meta-update due after this utterance (``TTAMethod.update_due``)?"""
        return True

    def meta_update(self, runs: List[int]) -> None:
        """The meta-update of ``runs`` (``TTAMethod.meta_update``: none for the SUTA family)."""
