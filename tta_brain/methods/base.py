"""The method skeleton (Tent-style): collect the adapted parameters, adapt on each utterance and
predict under ``torch.enable_grad()``, reset. Episodic (back to the source before every
utterance) vs continual (state carries over, a reset policy may be attached) is one setting.

A method owns the adapted parameters (``tta_brain.methods.params``), its optimiser(s) and the source
snapshot; the lobe owns the model and how passes run (``tta_brain.lobes.runtime``). The stream driver
(``TTABrain`` or ``TTAStream``) calls ``process(wav, info)`` once per utterance in stream order;
what else happened (resets, LII values, skipped steps) is left in ``method.events``.

Per utterance x_t (t counted from 1) the skeleton runs::

    episodic:   reset(); hyp = forward_and_adapt(x_t)
    continual:  policy: reset before x_t? (oracle)        -> reset_meta()
                hyp = forward_and_adapt(x_t)
                policy sees x_t (LII); if update_due(): policy says reset -> reset_meta(),
                else meta_update(); policy: end of step t
"""
import logging
from typing import Callable, Dict, List, Optional, Sequence

import torch

from tta_brain.gpu import make_step as default_step
from tta_brain.lobes.hf_ctc import freeze_batch_norm_statistics
from tta_brain.lobes.runtime import check_default_dtype
from tta_brain.methods import losses
from tta_brain.methods.events import Event, UttInfo
from tta_brain.methods.optim import build_optimizer
from tta_brain.methods.params import describe_selection, select_parameters
from tta_brain.methods.state import restore, snapshot, zero_optimizer_state

logger = logging.getLogger(__name__)

__all__ = ["TTAMethod", "DEFAULT_PARAMS"]

DEFAULT_PARAMS = ({"select": "layernorm"}, {"select": "cnn"})


def check_model_free(model, name: str) -> None:
    """A model another method was built on (:func:`bind_model`) is refused in one line: its
    weights are that method's (adapted, or left adapted after an episodic utterance: the new
    method would take them for the source) and its gradient flags set for that method's
    parameters (the new one's ``configure_model`` switched off some of the first method's: it
    went on adapting fewer tensors, silently)."""
    owner = getattr(model, "_tta_method", None)
    if owner is not None:
        raise ValueError(f"{name}: this model was given to a {owner} method already (its weights "
                         f"and gradient flags are that method's): load the source model again, "
                         f"one model per method (HFCTCLobe(source))")


def bind_model(model, name: str) -> None:
    """Mark ``model`` as the built method ``name``'s (see :func:`check_model_free`)."""
    try:
        model._tta_method = name
    except AttributeError:          # a lobe of one's own with __slots__: not marked
        pass


class TTAMethod:
    """The skeleton. Subclasses set ``loss`` (default: SUTA), and where needed
    ``forward_and_adapt`` / ``update_due`` / ``meta_update`` / ``reset``.

    Arguments
    ---------
    model : HFCTCLobe
        The source model (adapted in place; the source values are snapshotted).
    adapt_params : list
        Parameter groups (see ``tta_brain.methods.params``).
    lr : float
        Base learning rate (times each group's ``lr_mult``).
    optimizer : callable
        ``param_groups -> torch.optim.Optimizer`` (a ``!name:torch.optim.AdamW`` partial in yaml).
    steps : int
        Adaptation steps per utterance (N).
    temperature, em_coef : float
        SUTA loss temperature and entropy weight alpha.
    episodic : bool, optional
        Back to the source model before every utterance (default: the method's own setting).
    reset_policy : ResetPolicy, optional
        For continual methods only; see ``tta_brain.methods.resets``.
    train_mode : bool
        Adapt with the model in train mode (dropout on); predictions stay in eval mode.
    make_step : callable, optional
        ``method -> step``: chooses the adaptation step once, at the end of construction
        (default ``tta_brain.gpu.make_step``: the host step, or the device step where the runtime
        options, the device and the method's declared ``device_loss`` allow it). Tests pass a
        factory with their doubles here.
    """

    name = "base"
    episodic = True

    def __init__(self, model, adapt_params: Sequence = DEFAULT_PARAMS, lr: float = 2e-5,
                 optimizer: Optional[Callable] = None, steps: int = 10, temperature: float = 2.5,
                 em_coef: float = 0.3, episodic: Optional[bool] = None, reset_policy=None,
                 train_mode: bool = False, make_step: Optional[Callable] = None):
        check_default_dtype(self.name)
        check_model_free(model, self.name)
        self.lobe, self.net, self.runtime = model, model.model, model.runtime
        self.blank_id = model.blank_id
        self.steps, self.lr = int(steps), float(lr)
        self.temperature, self.em_coef = float(temperature), float(em_coef)
        self.train_mode = bool(train_mode)
        if episodic is not None:
            self.episodic = bool(episodic)
        self.counts = {"adapt_forward": 0, "adapt_backward": 0, "infer_forward": 0,
                       "aux_forward": 0, "skipped_steps": 0}
        self.events: List[Event] = []
        self.early_losses: Dict[str, object] = {}    # this utterance's LII losses (loss_with)
        self.t = 0                                   # utterances processed
        self.info = UttInfo()                        # the utterance being processed
        self.adapt_params = list(adapt_params or ())
        self.selected = select_parameters(self.net, adapt_params) if adapt_params else []
        self.param_names = [n for n, _, _ in self.selected]
        self.params = [p for _, p, _ in self.selected]
        self._lobe_names = [f"model.{n}" for n in self.param_names]
        self.configure_model()
        self.source = snapshot(self.params)
        self.optimizer = build_optimizer(optimizer, self.selected, self.lr)
        self.features = self.runtime.feature_cache(
            self.lobe, self.lobe.feature_cache_blocker(self.params, self.train_mode))
        self.num_adapted = sum(p.numel() for p in self.params)
        self.reset_policy = reset_policy
        if reset_policy is not None:
            if getattr(reset_policy, "name", "none") != "none" and self.episodic:
                raise ValueError(f"Reset policy '{reset_policy.name}' needs a continual method "
                                 f"(csuta, dsuta, awmc, eata, sar, cotta, t3a, foa, ebats); "
                                 f"'{self.name}' starts every utterance "
                                 f"from the source model already")
            reset_policy.bind(self)
        self.step = (make_step or default_step)(self)
        bind_model(model, self.name)        # built: a second method on it is refused

    def describe(self) -> str:
        """One line: what adapts, by group, and how (logged by the driver)."""
        total = sum(p.numel() for p in self.net.parameters())
        groups = describe_selection(self.net, self.adapt_params) if self.params else "nothing"
        return (f"{self.name}: {'episodic' if self.episodic else 'continual'}, {self.steps} "
                f"step(s) per utterance; adapts {len(self.params)} tensors, "
                f"{self.num_adapted / 1e6:.3f}M of {total / 1e6:.2f}M parameters ({groups})")

    def warnings(self, n_utts: int, boundaries=None) -> List[str]:
        """Why the reset policy cannot act on a stream of ``n_utts`` utterances with the true
        domain ``boundaries`` (positions; None: unknown) (the driver logs them and keeps them in
        the summary)."""
        return (self.reset_policy.warnings(n_utts, boundaries) if self.reset_policy is not None
                else [])

    def end_warnings(self) -> List[str]:
        """What the method's state says about the run when its stream ends (a search that
        diverged: E-BATS); the driver keeps them with :meth:`warnings` in the summary."""
        return []

    # ------------------------------------------------------------- set-up
    def configure_model(self):
        """Eval mode (no dropout / SpecAugment) and gradients only for the adapted parameters.
        ``train_mode``: the batch norms' running statistics stay the source's (their train-mode
        passes normalise by the utterance and update nothing that a reset would not restore)."""
        self.net.eval()
        self.net.requires_grad_(False)
        for p in self.params:
            p.requires_grad_(True)
        if self.train_mode and (norms := freeze_batch_norm_statistics(self.net)):
            logger.info("%s: train_mode: %d batch norm(s) normalise by the utterance, their "
                        "running statistics kept the source's", self.name, len(norms))

    def loss(self, logits: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The adaptation objective of one utterance (default: SUTA); ``lengths``: its valid
        frames when the logits are padded (the length buckets of ``tta_brain.gpu``)."""
        return losses.suta_loss(logits, lengths, alpha=self.em_coef, temperature=self.temperature,
                                blank_id=self.blank_id).mean()

    # ------------------------------------------------------------- passes
    def forward(self, x: torch.Tensor, kind: str = "adapt_forward") -> torch.Tensor:
        self.counts[kind] += 1
        return self.logits(x)

    def logits(self, x: torch.Tensor, values: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
        """Logits of ``x`` (float32), with the adapted parameters set to ``values`` if given (the
        live model is untouched). Not counted."""
        params = None if values is None else dict(zip(self._lobe_names, values))
        out = self.step.logits(x, params)        # the device step's replayed forwards, or None
        if out is not None:
            return out
        return self.lobe.logits(x, params, self.features.get(x))

    def backward(self, loss: torch.Tensor) -> List[torch.Tensor]:
        """Counted backward of ``loss``; the adapted gradients (see ``Runtime.backward``)."""
        if not loss.requires_grad:          # was torch's "does not require grad" traceback
            raise RuntimeError(f"{self.name}: {type(self).__name__}.backward: the loss has no "
                               f"gradient (computed under torch.no_grad() or inference_mode, or "
                               f"not from the adapted parameters); decorate forward_and_adapt "
                               f"with @torch.enable_grad()")
        grads = self.runtime.backward(loss, self.params, self.lobe.device)
        self.counts["adapt_backward"] += 1
        return grads

    def adapt_step(self, x: torch.Tensor, optimizer=None, loss_fn=None, after_backward=None):
        """One forward/backward/update on ``x`` by the method's step (``self.step``). Non-finite
        losses or gradients skip the update (recorded with :meth:`record_skip`).

        ``after_backward()`` runs between backward and the optimiser step (DSUTA keeps the
        first-step gradient there). Returns the loss: a float (may be nan), or a 0-d device tensor
        from the device step, which reads nothing on the host until the prediction.
        """
        if not torch.is_grad_enabled():     # was backward's "does not require grad" traceback
            raise RuntimeError(f"{self.name}: {type(self).__name__}.forward_and_adapt runs without "
                               f"gradients (torch.no_grad() or inference_mode): its adaptation "
                               f"step has no backward; decorate it with @torch.enable_grad()")
        return self.step(x, optimizer or self.optimizer, loss_fn, after_backward)

    #: the method's filter of its own steps, decided on the device (``tta_brain.gpu.guard.
    #: StepFilter``: EATA's sample filter, SAR's device step), or None; its rows are handed to
    #: :meth:`step_notes`
    step_filter = None

    def step_notes(self, rows: List[List[float]]) -> None:
        """The rows ``step_filter`` noted (``[dropped, *values]`` per step, on the host): by the
        host step after every step, by the device step once per utterance with the transcript.
        Default: each dropped step goes to :meth:`filtered`."""
        for row in rows:
            if row[0]:
                self.filtered(row[1:])

    def filtered(self, values: List[float]) -> None:
        """A step that ``step_filter`` dropped (``values``: the row its loss noted)."""
        raise NotImplementedError(f"{self.name} has a step_filter but no filtered()")

    def device_tensors(self) -> List[torch.Tensor]:
        """Device state a captured step reads or writes besides parameters, optimiser state and
        ``step_filter`` (updated in place; its addresses are checked before a graph is reused)."""
        return []

    def record_skip(self, why: str, clear_grads: bool = True) -> float:
        """A skipped adaptation step: counted, logged, recorded as an event; returns nan."""
        self.counts["skipped_steps"] += 1
        for p in self.params if clear_grads else ():
            p.grad = None
        logger.warning("%s: utterance %d: %s, adaptation step skipped", self.name, self.t, why)
        self.events.append(Event("skip", self.t, why))
        return float("nan")

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> str:
        return self.step.transcript(self.forward(x, "infer_forward"))

    @torch.no_grad()
    def loss_tensor(self, values: Optional[Sequence[torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
        """SUTA loss of ``x`` with the adapted parameters set to ``values`` (None = source), a
        0-d tensor on the model's device (counted as an ``aux_forward``)."""
        values = self.source if values is None else values
        self.counts["aux_forward"] += 1
        logits = self.logits(x, values)
        return losses.suta_loss(logits, alpha=self.em_coef, temperature=self.temperature,
                                blank_id=self.blank_id).mean()

    def loss_with(self, values: Optional[Sequence[torch.Tensor]], x: torch.Tensor) -> float:
        """:meth:`loss_tensor` as a float: the one computed ahead for this utterance's LII
        (``early_losses``: ``phi_D`` / ``source``) where there is one, else computed now."""
        key = "source" if values is None else "phi_D"
        if key in self.early_losses and (values is None or values is getattr(
                self.reset_policy, "phi_D", None)):
            return float(self.early_losses.pop(key))
        return float(self.loss_tensor(values, x))

    def _losses_ahead(self, t: int, x: torch.Tensor) -> None:
        """The reset policy's LII losses of utterance ``t`` (they depend on phi_D, the source and
        ``x`` alone), queued before the adaptation: the device step reads them with the
        transcript, in its one copy (no host sync of their own)."""
        policy = self.reset_policy
        self.early_losses = {}
        if policy is not None and policy.needs_lii(t):
            self.early_losses = {"phi_D": self.loss_tensor(policy.phi_D, x),
                                 "source": self.loss_tensor(None, x)}

    # ------------------------------------------------------------- the skeleton
    @torch.enable_grad()
    def process(self, wav: torch.Tensor, info: Optional[UttInfo] = None) -> str:
        """Adapt on one utterance (1-D waveform at 16 kHz, or ``[1, T]``) and return its
        transcript. A batch ``[B, T]`` (B > 1) is a one-line ValueError: the skeleton adapts on one
        utterance and returns one transcript (the first row's was returned, the others dropped)."""
        if not torch.is_tensor(wav) or not (wav.dim() == 1 or (wav.dim() == 2
                                                              and wav.shape[0] == 1)):
            what = (f"shape {tuple(wav.shape)}" if torch.is_tensor(wav)
                    else f"a {type(wav).__name__}")
            raise ValueError(f"{self.name}.process: wav must be one utterance, a 1-D tensor of "
                             f"samples (or [1, T]), got {what} (TTAStream.transcribe takes numpy, "
                             f"integer PCM and channels)")
        check_default_dtype(f"{self.name}.process")
        x = self.begin(wav, info)
        try:
            hyp = self.forward_and_adapt(x, self.info)
            self.end(x)
        finally:
            self.features.clear()               # the feature cache lives for one utterance
        self.t += 1
        return hyp

    def begin(self, wav: torch.Tensor, info: Optional[UttInfo] = None,
              losses_ahead: bool = True) -> torch.Tensor:
        """The utterance's input, after what comes before its adaptation: episodic, the reset;
        continual, the reset policy's check and its LII losses (``process``; a batched sweep
        of backprop-free runs calls it for each run, ``losses_ahead`` false: it computes the
        runs' LII losses together)."""
        info = self.info = info or UttInfo(position=self.t)
        x = self.lobe.prepare(wav)
        try:
            if self.episodic:
                self.reset()
            else:
                self._policy_before(self.t + 1, info)
                if losses_ahead:
                    self._losses_ahead(self.t + 1, x)
        except BaseException:
            self.features.clear()
            raise
        return x

    def end(self, x: torch.Tensor) -> None:
        """What comes after the utterance's adaptation and transcript (continual: the reset
        policy's LII test, the meta-update or a reset); ``t`` is still the utterance's index."""
        if not self.episodic:
            self._policy_after(self.t + 1, x, self.info)

    def before_step(self, n: int) -> None:
        """Hook before adaptation step ``n`` (0-based) of an utterance (SGEM: its lr schedule)."""

    def forward_and_adapt(self, x: torch.Tensor, info: UttInfo) -> str:
        """N adaptation steps on ``x``, then the prediction."""
        for n in range(self.steps):
            self.before_step(n)
            self.adapt_step(x)
        return self.predict(x)

    def steps_with(self, optimizer) -> int:
        """Adaptation steps per utterance taken with ``optimizer`` (CEA: its second stage's)."""
        return self.steps

    def update_due(self) -> bool:
        """Continual methods: is a meta-update due after this utterance (DSUTA: buffer full)?
        By default every utterance's steps are its update."""
        return True

    def meta_update(self) -> None:
        """Continual methods: update the meta-parameters (DSUTA: the slow step)."""

    def reset(self):
        """Back to the source model: adapted parameters and optimiser state."""
        if self.params:
            restore(self.params, self.source)
        if self.optimizer is not None:
            zero_optimizer_state(self.optimizer)

    # ------------------------------------------------------- reset policy (continual methods)
    def meta_values(self) -> List[torch.Tensor]:
        """The tensors that carry knowledge across utterances (phi_t)."""
        return self.params

    def _policy_before(self, t: int, info: UttInfo) -> None:
        if self.reset_policy is not None and (why := self.reset_policy.before_utterance(info)):
            self.reset_meta(t - 1, info.position, why)

    def _policy_after(self, t: int, x: torch.Tensor, info: UttInfo) -> None:
        policy = self.reset_policy
        if policy is not None:
            policy.after_utterance(t, x, info)
        if self.update_due():
            why = policy.at_update(t) if policy is not None else None
            if why:
                self.reset_meta(t, info.position + 1, why)
            else:
                self.meta_update()
        if policy is not None:
            policy.end_step(t)

    def reset_meta(self, after: int, position: int, reason: str):
        """Reset to the source after utterance ``after`` (1-based count), recorded at
        ``position``: the stream position of the first utterance that starts from the reset model."""
        self.reset()
        self.events.append(Event("reset", position, reason))
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
        if self.params:
            restore(self.params, sd["params"])
        if self.optimizer is not None and sd.get("optimizer") is not None:
            self.optimizer.load_state_dict(sd["optimizer"])
        if self.reset_policy is not None and "reset_policy" in sd:
            self.reset_policy.load_state_dict(sd["reset_policy"])
