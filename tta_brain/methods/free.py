"""The backprop-free skeleton (LAME, T3A, FOA, E-BATS): no optimiser, no backward; a method
evaluates candidates of one utterance and keeps (continual) or drops (episodic) what it learnt.

It is a :class:`~tta_brain.methods.base.TTAMethod` with nothing to adapt by gradient, so the stream
contract is the gradient skeleton's: ``process(wav, info) -> text`` (episodic: ``reset()`` first;
continual: the reset-policy hooks around it), ``events``, ``counts``, ``state_dict`` /
``load_state_dict``. What differs, per utterance x::

    ctx = prefix(x)                      the frozen network before the insertion point, once
    out = candidates_forward(ctx, Z)     candidates Z [P, D] through the rest of the network
    fitness, logits = score(out)         -> fitness [P], logits [P, F, V] (the run's settings)
    hyp = adapt(x, ctx)                  the method: drives ``search(x, ctx)``, a generator that
                                         yields candidate batches (CMA-ES generations) and is
                                         sent their (fitness, logits parts); it returns the
                                         transcript's logits [1, F, V]

``evaluate`` (= ``score(candidates_forward(...))``) runs the whole population as one batch, or
``population_batch`` candidates at a time (1: one at a time; with ``shared_prefix: false`` each
from the input again, as the reference). Because a method's search only yields candidates and
its prefix and candidates' forward read no setting of the run, a batched sweep
(``tta_brain.methods.batched_free``) drives R runs' searches in lock-step: one prefix, one
forward of all their candidates, each run's own ``score``.
The carried state (``free_state``) is saved with the checkpoint; ``reset()`` goes back to
``initial_state()``. For the dynamic reset policy, the carried state is ``meta_values()`` and
``loss_at(prefix(x), values)`` the method's fitness with it (``loss_tensor(values, x)``, counted);
the two LII losses of an utterance come from its one prefix, which its adaptation reuses.

Counts: ``adapt_forward`` = candidates evaluated (one per candidate, batched or not),
``aux_forward`` = policy passes, ``infer_forward`` = passes for a transcript alone.
"""
import math
import warnings
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from tta_brain.lobes.partial import PartialForward
from tta_brain.methods.base import TTAMethod

__all__ = ["FreeMethod", "make_es", "check_search", "tell", "EarlyStop", "drive"]


def make_es(x0, sigma0: float, popsize: int, seed: int):
    """A pycma ``CMAEvolutionStrategy`` drawing from its own ``RandomState(seed)`` (the global
    numpy RNG is left alone; the strategy pickles with its RNG, so a resumed run draws the same)."""
    import cma
    opts = {"seed": np.nan, "randn": np.random.RandomState(int(seed)).randn, "popsize": int(popsize),
            "maxiter": float("inf"), "verbose": -9, "CMA_diagonal": False}
    return cma.CMAEvolutionStrategy(np.asarray(x0, dtype=float), float(sigma0), opts)


def check_search(name: str, es, dim: int, popsize: int) -> None:
    """A loaded CMA-ES search ``es`` must be the method's: ``dim`` values, ``popsize`` candidates
    (a ValueError saying both; a stream state of other ``n_prompts`` or ``popsize`` was taken, as
    adapted tensors there are none to tell them apart)."""
    if (es.N, es.popsize) != (dim, popsize):
        raise ValueError(f"{name}: the state's CMA-ES search has dimension {es.N} and population "
                         f"{es.popsize}, this method's {dim} and {popsize}")


def tell(es, candidates, fitness: torch.Tensor) -> None:
    """``es.tell`` of a generation's fitness ``[P]``. A generation whose every fitness is NaN (a
    search whose step size overflowed its candidates, or a model that outputs NaN) is told as
    it is: pycma sets a NaN value to the median of the others, of none here (NaN again), which
    numpy's median of an empty list warned about in every such generation ("Mean of empty
    slice", "invalid value encountered")."""
    values = fitness.double().cpu().tolist()
    if not all(math.isnan(v) for v in values):
        es.tell(candidates, values)
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Mean of empty slice", RuntimeWarning)
        warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)
        es.tell(candidates, values)


def drive(search, evaluate):
    """Run generator ``search`` (:meth:`FreeMethod.search`) to its end, each candidate batch it
    yields answered by ``evaluate(candidates)``; its return value."""
    try:
        candidates = next(search)
        while True:
            candidates = search.send(evaluate(candidates))
    except StopIteration as done:
        return done.value


class EarlyStop:
    """The reference's early stop of the CMA-ES generations of an utterance: a generation whose
    best fitness does not improve on the previous generation's best (carried over from the
    previous utterance: ``previous``) by more than ``threshold`` counts as stale, an improving
    one clears the count; ``patience`` stale generations in a row stop."""

    def __init__(self, threshold: float, patience: int, previous: float = math.inf):
        self.threshold, self.patience, self.previous, self.stale = threshold, patience, previous, 0

    def __call__(self, best: float) -> bool:
        self.stale = 0 if self.previous - best > self.threshold else self.stale + 1
        self.previous = best
        return self.stale >= self.patience


class FreeMethod(TTAMethod):
    """The skeleton; a method sets ``prefix`` / ``evaluate`` (CMA-ES methods) or overrides
    ``adapt``, and ``initial_state`` / ``free_state`` / ``load_free_state`` for what it carries."""

    def __init__(self, model, episodic: Optional[bool] = None, reset_policy=None,
                 population_batch: int = 0, shared_prefix: bool = True, **kwargs):
        if kwargs.pop("adapt_params", None):
            raise ValueError(f"{self.name} is backprop-free: it adapts no parameter by gradient "
                             f"(no adapt_params)")
        if getattr(getattr(model, "runtime", None), "compile", False):
            # its passes (lobe.head_input, the stages of lobes/partial.py, lobe.features) are not
            # the lobe's compiled forward: compile would be recorded and change nothing
            raise ValueError(f"compile: true (--compile) is not supported by {self.name}: its "
                             f"passes do not run through the compiled model forward, so it "
                             f"would decode uncompiled; use compile: false")
        if (getattr(reset_policy, "name", None) == "dynamic"
                and type(self).meta_values is FreeMethod.meta_values
                and type(self).center is FreeMethod.center):    # a method of one's own: it
            # would stop with a NotImplementedError at the first utterance's LII
            raise ValueError(f"{self.name}: reset = 'dynamic' needs the state the method carries, "
                             f"which it does not define: center() (the search mean, as FOA and "
                             f"E-BATS) or meta_values() with loss_at() (as T3A); or use reset "
                             f"fixed or oracle")
        super().__init__(model, adapt_params=(), steps=kwargs.pop("steps", 1), episodic=episodic,
                         reset_policy=reset_policy, **kwargs)
        self.population_batch, self.shared_prefix = int(population_batch), bool(shared_prefix)
        self.pf = self.partial_forward(model)
        self._held = None          # (x, prefix(x)) of the utterance whose LII losses came first
        self.load_free_state(self.initial_state())

    def share_model(self, lobe) -> None:
        """Run on ``lobe`` (the same source model, e.g. a batched sweep's one copy) instead of
        the model it was built with."""
        self.lobe, self.net, self.runtime = lobe, lobe.model, lobe.runtime
        self.pf = self.partial_forward(lobe)
        self.features = self.runtime.feature_cache(lobe, lobe.feature_cache_blocker([], False))

    #: whether the method inserts candidates inside the network (FOA, E-BATS: the stages of a
    #: :class:`PartialForward`, wav2vec 2.0-style models only); LAME and T3A read the frozen
    #: model's logits and last hidden state (``lobe.head_input``) and run on any CTC model
    needs_partial = True

    def partial_forward(self, lobe) -> Optional[PartialForward]:
        """The stages of ``lobe``'s model for a method that needs them (else None)."""
        return PartialForward(lobe) if self.needs_partial else None

    def describe(self) -> str:
        population = "" if type(self).candidates_forward is FreeMethod.candidates_forward else (
            f"; candidates per forward: {self.population_batch or 'the whole population'}"
            f"{'' if self.shared_prefix else ', each from the input'}")
        return (f"{self.name}: {'episodic' if self.episodic else 'continual'}, backprop-free "
                f"(no parameter adapts by gradient){population}")

    # ------------------------------------------------------------- what a method defines
    def prefix(self, x: torch.Tensor):
        """The network before the insertion point, once per utterance."""
        return x

    def candidates_forward(self, ctx, candidates: torch.Tensor):
        """Candidates ``[P, D]`` of one utterance through the network after the prefix: a tuple
        of tensors whose first dimension is P (reads no setting of the run)."""
        raise NotImplementedError

    def score(self, out) -> tuple:
        """``candidates_forward``'s output -> (fitness ``[P]``, logits ``[P, F, V]``), with the
        run's settings and state."""
        raise NotImplementedError

    def evaluate(self, ctx, candidates: torch.Tensor):
        """Candidates ``[P, D]`` of one utterance -> (fitness ``[P]``, logits ``[P, F, V]``)."""
        return self.score(self.candidates_forward(ctx, candidates))

    def search(self, x: torch.Tensor, ctx):
        """The method's adaptation on the utterance, as a generator: it yields candidate
        batches (arrays ``[P, D]``), is sent each one's ``(fitness [P], logits parts)`` (as
        :meth:`evaluate_population` returns them) and returns the transcript's logits
        ``[1, F, V]`` (a method without candidates returns at once)."""
        raise NotImplementedError
        yield                                                    # pragma: no cover

    def adapt(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """Adapt on the utterance (:meth:`search`, its candidates evaluated here); the logits
        ``[1, F, V]`` of its transcript."""
        return drive(self.search(x, ctx), lambda cands: self.evaluate_population(x, ctx, cands))

    def initial_state(self) -> Dict:
        """A fresh copy of the state a method starts from (and resets to)."""
        return {}

    def free_state(self) -> Dict:
        return {}

    def load_free_state(self, state: Dict) -> None:
        pass

    # ------------------------------------------------------------- the population
    def evaluate_population(self, x, ctx, candidates) -> tuple:
        """``evaluate`` over all candidates, ``population_batch`` at a time (0: all at once);
        without ``shared_prefix`` each evaluation starts from the input ``x`` again (the
        reference's loop: population_batch 1, shared_prefix false)."""
        z = torch.as_tensor(np.asarray(candidates), dtype=torch.float32, device=self.lobe.device)
        step = self.population_batch or len(z)
        parts = [self.evaluate(ctx if self.shared_prefix else self.prefix(x), z[i:i + step])
                 for i in range(0, len(z), step)]
        self.counts["adapt_forward"] += len(z)
        return torch.cat([p[0] for p in parts]), [p[1] for p in parts]

    @staticmethod
    def pick(logit_parts, index: int) -> torch.Tensor:
        """Candidate ``index``'s logits ``[1, F, V]`` from ``evaluate_population``'s parts."""
        for part in logit_parts:
            if index < len(part):
                return part[index:index + 1]
            index -= len(part)
        raise IndexError(index)

    # ------------------------------------------------------------- the skeleton's hooks
    @torch.no_grad()
    def forward_and_adapt(self, x: torch.Tensor, info) -> str:
        held, self._held = self._held, None
        with self.runtime.autocast(self.lobe.device.type):       # the run's precision
            ctx = held[1] if held is not None and held[0] is x else self.prefix(x)
            return self.lobe.decode(self.adapt(x, ctx))[0]

    @torch.no_grad()
    def _losses_ahead(self, t: int, x: torch.Tensor) -> None:
        """The reset policy's two LII losses of utterance ``t`` from one prefix of ``x``, which
        the utterance's adaptation then reuses (the frozen network runs once per utterance, as in
        a batched sweep; counted as two policy passes, as :meth:`loss_tensor` counts each)."""
        policy = self.reset_policy
        self.early_losses, self._held = {}, None
        if policy is None or not policy.needs_lii(t):
            return
        self.counts["aux_forward"] += 2
        with self.runtime.autocast(self.lobe.device.type):
            ctx = self.prefix(x)
            self.early_losses = self.lii_losses(ctx)
        self._held = (x, ctx)

    def lii_losses(self, ctx) -> Dict[str, torch.Tensor]:
        """The LII's two losses of the utterance whose prefix is ``ctx`` (``loss_with`` answers
        from them): at the reset policy's phi_D and at the start."""
        return {"phi_D": self.loss_at(ctx, self.reset_policy.phi_D),
                "source": self.loss_at(ctx, None)}

    def reset(self):
        self.load_free_state(self.initial_state())

    def meta_values(self) -> List[torch.Tensor]:
        """The carried state as tensors (CMA-ES methods: the search mean)."""
        return [torch.as_tensor(self.center(), dtype=torch.float32)]

    def center(self) -> np.ndarray:
        raise NotImplementedError(f"{self.name} carries no state a reset policy can test")

    @torch.no_grad()
    def loss_tensor(self, values: Optional[Sequence[torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
        """The reset policy's loss of ``x`` at the carried state ``values`` (a policy pass,
        counted): :meth:`loss_at` of its prefix."""
        self.counts["aux_forward"] += 1
        with self.runtime.autocast(self.lobe.device.type):
            return self.loss_at(self.prefix(x), values)

    def loss_at(self, ctx, values: Optional[Sequence[torch.Tensor]]) -> torch.Tensor:
        """The loss of the utterance whose prefix is ``ctx`` at the carried state ``values``:
        here the fitness of candidate :meth:`lii_candidate` (``values``)."""
        z = torch.as_tensor(self.lii_candidate(values)[None], device=self.lobe.device)
        return torch.as_tensor(self.evaluate(ctx, z)[0][0])

    def lii_candidate(self, values: Optional[Sequence[torch.Tensor]]) -> np.ndarray:
        """The candidate ``[D]`` (float32) that is the carried state ``values`` (None: zero,
        where the search starts)."""
        if values is None:
            return np.zeros(self.meta_values()[0].numel(), dtype=np.float32)
        return values[0].detach().reshape(-1).cpu().numpy().astype(np.float32)

    def state_dict(self) -> Dict:
        sd = super().state_dict()
        sd["free"] = self.free_state()
        return sd

    def load_state_dict(self, sd: Dict):
        super().load_state_dict(sd)
        self.load_free_state(sd["free"])
