"""The TTA method base class, the registry and the per-utterance bookkeeping.

A method owns the source-model lobe, the adapted parameters (see ``tta_brain.params``), its
optimiser(s) and the source snapshot. The stream driver (``TTABrain`` or ``TTAStream``) calls
``process(wav, info)`` once per utterance in stream order and gets the hypothesis back; events
(resets, LII values) are left in ``method.events`` for the driver to record.
"""
import logging
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.func import functional_call

from tta_brain import losses
from tta_brain.params import param_groups, select_parameters
from tta_brain.state import restore, snapshot, zero_optimizer_state

logger = logging.getLogger(__name__)

__all__ = ["TTAMethod", "UttInfo", "register", "METHODS", "build_method"]

METHODS: Dict[str, type] = {}


def register(name: str):
    """Class decorator: make a method available by ``name`` (``build_method``, ``TTAStream``)."""
    def deco(cls):
        cls.name = name
        METHODS[name] = cls
        return cls
    return deco


def build_method(name: str, **kwargs) -> "TTAMethod":
    if name not in METHODS:
        raise ValueError(f"Unknown TTA method '{name}'. Valid: {', '.join(sorted(METHODS))}")
    return METHODS[name](**kwargs)


@dataclass
class UttInfo:
    """What a method may know about an utterance besides its audio."""
    id: str = ""
    position: int = 0          # 0-based position in the stream
    domain: str = ""
    segment: int = 0           # contiguous-block index (only oracle reset may look at it)


DEFAULT_PARAMS = ({"select": "layernorm"}, {"select": "cnn"})


class TTAMethod:
    """Base class: parameter selection, optimiser, counted forward/backward passes, reset.

    Arguments
    ---------
    model : HFCTCLobe
        The source model (adapted in place; the source values are snapshotted).
    adapt_params : list
        Parameter groups (see ``tta_brain.params``).
    lr : float
        Base learning rate (times each group's ``lr_mult``).
    optimizer : callable
        ``params -> torch.optim.Optimizer`` (a ``!name:torch.optim.AdamW`` partial in yaml).
    steps : int
        Adaptation steps per utterance.
    temperature, em_coef : float
        SUTA loss temperature and entropy weight alpha.
    reset_policy : ResetPolicy, optional
        Only for continual methods; see ``tta_brain.resets``.

    Speed options (results unchanged; ``tools/bench_speed.py`` measures them):

    cache_features : "auto" | "on" | "off"
        Run the CNN feature encoder once per utterance and every pass of that utterance
        (adaptation steps, prediction, LII losses) from its output. Exact (bit-identical logits)
        when no adapted parameter is in the feature encoder, so ``auto`` turns it on exactly then
        (and not in ``train_mode``); with the paper's ``layernorm + cnn`` selection it is off.
    amp : "none" | "bf16" | "fp16"
        Autocast the model forward (GPU); losses in float32. fp16 backpropagates
        ``loss * amp_loss_scale`` (default 2**12) and unscales the gradients before the checks
        and the update. Changes the numerics: check the WER before using it.
    compile : bool
        ``torch.compile`` the model forward (dynamic shapes; GPU). Off by default.
    cpu_native_backward : bool
        On CPU, run the backward with oneDNN off (PyTorch's own convolution kernels). oneDNN
        builds its convolution-backward kernels for every new input length, which on a real
        stream (every utterance a new length) costs about one extra backward per utterance; the
        native kernels are as fast here and need no per-length set-up. Gradients agree to
        rounding (float32 summation order). Default on; no effect on GPU.
    plain : bool
        The plain reference path of everything above and of the bookkeeping (per-tensor
        gradient checks, the optimiser's own defaults, no feature cache). For tests.

    Without ``plain``, Adam/AdamW optimisers built with ``foreach=None`` run their ``foreach``
    implementation (the default on GPU; on CPU it gives the same numbers as the per-tensor loop
    and saves its Python overhead), and the gradient check is one fused reduction and one sync.
    """

    name = "base"
    continual = False          # has state that carries across utterances (meta-parameters)

    def __init__(self, model, adapt_params: Sequence = DEFAULT_PARAMS, lr: float = 2e-5,
                 optimizer: Optional[Callable] = None, steps: int = 10, temperature: float = 2.5,
                 em_coef: float = 0.3, reset_policy=None, train_mode: bool = False,
                 cache_features="auto", amp: str = "none", amp_loss_scale: Optional[float] = None,
                 compile: bool = False, cpu_native_backward: bool = True, plain: bool = False):
        self.lobe = model
        self.net = model.model                      # the HF module (parameter names are its)
        self.steps = int(steps)
        self.lr = float(lr)
        self.temperature = float(temperature)
        self.em_coef = float(em_coef)
        self.train_mode = bool(train_mode)
        self.plain = bool(plain)
        self.blank_id = model.blank_id
        self.counts = {"adapt_forward": 0, "adapt_backward": 0, "infer_forward": 0,
                       "aux_forward": 0, "skipped_steps": 0}
        self.events: List[tuple] = []
        self.t = 0                                  # utterances processed
        self.selected = select_parameters(self.net, adapt_params) if adapt_params else []
        self.param_names = [n for n, _, _ in self.selected]
        self.params = [p for _, p, _ in self.selected]
        self.configure_model()
        self.source = snapshot(self.params)
        opt_fn = optimizer or partial(torch.optim.AdamW, weight_decay=0.0)
        self.optimizer = opt_fn(param_groups(self.selected, self.lr)) if self.params else None
        if self.optimizer is not None and not self.plain:
            prefer_foreach(self.optimizer)
        self.cpu_native_backward = bool(cpu_native_backward)
        self._setup_speed(cache_features, amp, amp_loss_scale, compile)
        n = sum(p.numel() for p in self.params)
        logger.info("%s adapts %d tensors, %.3fM parameters (%s)", self.name, len(self.params),
                    n / 1e6, ", ".join(sorted({str(g) for g in adapt_params})) if adapt_params else "-")
        self.num_adapted = n
        self.reset_policy = reset_policy
        if reset_policy is not None and getattr(reset_policy, "name", "none") != "none":
            if not self.continual:
                raise ValueError(f"Reset policy '{reset_policy.name}' needs a continual method "
                                 f"(csuta, dsuta); '{self.name}' resets every utterance already")
            reset_policy.bind(self)

    # ------------------------------------------------------------- set-up
    def configure_model(self):
        """Eval mode (no dropout / SpecAugment) and gradients only for the adapted parameters."""
        self.net.eval()
        self.net.requires_grad_(False)
        for p in self.params:
            p.requires_grad_(True)

    def _setup_speed(self, cache_features, amp, amp_loss_scale, compile):
        amp = "none" if amp in (None, False) else str(amp)
        dtypes = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
        if amp not in dtypes:
            raise ValueError(f"amp must be one of {', '.join(dtypes)}, not '{amp}'")
        self.amp = dtypes[amp]
        self.loss_scale = float(amp_loss_scale if amp_loss_scale is not None
                                else 2.0 ** 12 if amp == "fp16" else 1.0)
        mode = {True: "on", False: "off", None: "off"}.get(cache_features, cache_features)
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"cache_features must be auto, on or off, not '{cache_features}'")
        why_not = self._feature_cache_blocker()
        if mode == "on" and why_not:
            raise ValueError(f"cache_features: on is not exact here: {why_not}")
        self.cache_features = mode != "off" and not why_not and not self.plain
        self._feat_src = self._feats = None
        self._lobe_names = [f"model.{n}" for n in self.param_names]
        if compile:
            self.lobe.compile_forward()

    def _feature_cache_blocker(self) -> Optional[str]:
        """Why the CNN features of an utterance cannot be computed once (None: they can)."""
        if not self.params:
            return "no adapted parameters (one pass per utterance)"
        if not getattr(self.lobe, "supports_features", False):
            return "the model has no separable feature encoder"
        if self.train_mode:
            return "train_mode"
        fe = {id(p) for p in self.net.base_model.feature_extractor.parameters()}
        if any(id(p) in fe for p in self.params):
            return "feature-encoder parameters are adapted"
        return None

    def loss(self, logits: torch.Tensor) -> torch.Tensor:
        """The adaptation objective of one utterance (default: SUTA)."""
        return losses.suta_loss(logits, alpha=self.em_coef, temperature=self.temperature,
                                blank_id=self.blank_id).mean()

    # ------------------------------------------------------------- passes
    def forward(self, x: torch.Tensor, kind: str = "adapt_forward") -> torch.Tensor:
        self.counts[kind] += 1
        return self.logits(x)

    def logits(self, x: torch.Tensor, values: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
        """Logits of ``x`` (float32), with the adapted parameters set to ``values`` if given
        (``functional_call``: the live model is untouched). Not counted."""
        feats = self._features(x) if self.cache_features else None
        kwargs = {} if feats is None else {"features": feats}
        with self.autocast():
            if values is None:
                logits = self.lobe(x, **kwargs)
            else:
                logits = functional_call(self.lobe, dict(zip(self._lobe_names, values)), (x,),
                                         kwargs)
        return logits if self.amp is None else logits.float()

    def autocast(self):
        if self.amp is None:
            return nullcontext()
        return torch.autocast(self.lobe.device.type, dtype=self.amp)

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        """The CNN features of ``x``, computed once per utterance (see ``cache_features``)."""
        if self._feat_src is not x:
            with torch.no_grad(), self.autocast():
                self._feats = self.lobe.features(x)
            self._feat_src = x
        return self._feats

    def backward(self, loss: torch.Tensor) -> List[torch.Tensor]:
        """Counted backward of ``loss`` (fp16: scaled, then unscaled); the adapted gradients."""
        if self.loss_scale != 1.0:
            loss = loss * self.loss_scale
        if self.cpu_native_backward and self.lobe.device.type == "cpu":
            with native_cpu_kernels():
                loss.backward()
        else:
            loss.backward()
        self.counts["adapt_backward"] += 1
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads and self.loss_scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / self.loss_scale)
        return grads

    def _grads_finite(self, grads: List[torch.Tensor]) -> bool:
        if self.plain:
            return all(torch.isfinite(g).all() for g in torch._foreach_norm(grads))
        return bool(torch.stack(torch._foreach_norm(grads)).isfinite().all())

    def adapt_step(self, x: torch.Tensor, optimizer=None, loss_fn=None, after_backward=None):
        """One forward/backward/update on ``x``. Non-finite losses or gradients skip the update.

        ``after_backward(grads_ok)`` runs between backward and the optimiser step (DSUTA uses it
        to keep the first-step gradient). Returns the loss value (float, may be nan).
        """
        optimizer = optimizer or self.optimizer
        optimizer.zero_grad(set_to_none=False)
        if self.train_mode:
            self.net.train()
        logits = self.forward(x, "adapt_forward")
        loss = (loss_fn or self.loss)(logits)
        if self.train_mode:
            self.net.eval()
        value = float(loss.detach())               # the one host sync before the backward
        if not math.isfinite(value):
            return self._skip(f"non-finite loss {value}")
        grads = self.backward(loss)
        if grads and not self._grads_finite(grads):
            return self._skip("non-finite gradient")
        if after_backward is not None:
            after_backward()
        optimizer.step()
        return value

    def _skip(self, why: str) -> float:
        self.counts["skipped_steps"] += 1
        for p in self.params:
            p.grad = None
        logger.warning("%s: utterance %d: %s, adaptation step skipped", self.name, self.t, why)
        self.events.append(("skip", self.t, why))
        return float("nan")

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> str:
        logits = self.forward(x, "infer_forward")
        return self.lobe.decode(logits)[0]

    @torch.no_grad()
    def loss_with(self, values: Optional[Sequence[torch.Tensor]], x: torch.Tensor) -> float:
        """SUTA loss of ``x`` with the adapted parameters set to ``values`` (None = source).

        Uses ``torch.func.functional_call``: no parameter copy, the live model is untouched.
        """
        values = self.source if values is None else values
        self.counts["aux_forward"] += 1
        logits = self.logits(x, values)
        return float(losses.suta_loss(logits, alpha=self.em_coef, temperature=self.temperature,
                                      blank_id=self.blank_id).mean())

    # ------------------------------------------------------------- API
    def process(self, wav: torch.Tensor, info: Optional[UttInfo] = None) -> str:
        """Adapt on one utterance (1-D waveform at 16 kHz) and return its transcript."""
        info = info or UttInfo(position=self.t)
        x = self.lobe.prepare(wav)
        try:
            hyp = self.adapt_and_predict(x, info)
        finally:
            self._feat_src = self._feats = None     # the feature cache lives for one utterance
        self.t += 1
        return hyp

    def adapt_and_predict(self, x: torch.Tensor, info: UttInfo) -> str:
        raise NotImplementedError

    def reset(self):
        """Back to the source model: adapted parameters and optimiser state."""
        restore(self.params, self.source)
        if self.optimizer is not None:
            zero_optimizer_state(self.optimizer)

    # ------------------------------------------------------- meta-parameters (continual methods)
    def meta_values(self) -> List[torch.Tensor]:
        """The tensors that carry knowledge across utterances (phi_t)."""
        return self.params

    def policy_before(self, t: int, info: UttInfo) -> None:
        """Before adapting x_t: a reset the policy wants now (oracle boundary)."""
        if self.reset_policy is not None and (why := self.reset_policy.before_utterance(info)):
            self.reset_meta(t - 1, info.position, why)

    def policy_after(self, t: int, x: torch.Tensor, info: UttInfo, update_due: bool = True,
                     update: Optional[Callable[[], None]] = None) -> None:
        """After the prediction for x_t: the policy sees x_t (LII); when a meta-update is due,
        it may reset instead of ``update()``; then the end of step t."""
        policy = self.reset_policy
        if policy is not None:
            policy.after_utterance(t, x, info)
        if update_due:
            why = policy.at_update(t) if policy is not None else None
            if why:
                self.reset_meta(t, info.position + 1, why)
            elif update is not None:
                update()
        if policy is not None:
            policy.end_step(t)

    def reset_meta(self, after: int, position: int, reason: str):
        """Reset the meta-parameters to the source after utterance ``after`` (1-based count).

        Recorded as an event at ``position``: the stream position of the first utterance that
        starts from the reset model.
        """
        self.reset()
        self._record_reset(after, position, reason)

    def _record_reset(self, after: int, position: int, reason: str):
        self.events.append(("reset", position, reason))
        if self.reset_policy is not None:
            self.reset_policy.on_reset(after)

    # ------------------------------------------------------------- resume
    def state_dict(self) -> Dict:
        sd = {"t": self.t, "counts": dict(self.counts),
              "params": [p.detach().clone() for p in self.params],
              "optimizer": self.optimizer.state_dict() if self.optimizer else None}
        if self.reset_policy is not None:
            sd["reset_policy"] = self.reset_policy.state_dict()
        return sd

    def load_state_dict(self, sd: Dict):
        self.t = sd["t"]
        self.counts.update(sd["counts"])
        restore(self.params, sd["params"])
        if self.optimizer is not None and sd.get("optimizer") is not None:
            self.optimizer.load_state_dict(sd["optimizer"])
        if self.reset_policy is not None and "reset_policy" in sd:
            self.reset_policy.load_state_dict(sd["reset_policy"])


@contextmanager
def native_cpu_kernels():
    """oneDNN (mkldnn) off inside the block (process-wide flag, restored on exit)."""
    prev = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = prev


def prefer_foreach(optimizer: torch.optim.Optimizer) -> None:
    """Let an Adam/AdamW built with ``foreach=None`` use its ``foreach`` implementation (and
    ``zero_grad`` its foreach zeroing). PyTorch already picks it on GPU; on CPU its default is the
    per-tensor loop, which computes the same numbers with more Python overhead."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in optimizer.param_groups:
        if group.get("foreach") is None and not group.get("fused") and not group.get("differentiable"):
            group["foreach"] = True
    if optimizer.defaults.get("foreach") is None and not optimizer.defaults.get("fused"):
        optimizer.defaults["foreach"] = True


def method_tag(name: str, reset: str = "none") -> str:
    """Results tag of a method + reset policy, e.g. ``dsuta+dynamic``."""
    return name if reset in (None, "", "none") else f"{name}+{reset}"
