"""SGEM (Kim et al., 2023) for CTC: Renyi entropy (alpha 1.5) on the frames of the beam-search
pseudo path + negative sampling, AdamW with cosine-annealed lr over the N steps, episodic.

The pseudo path is the CTC prefix beam search's best hypothesis force-aligned to the current
posteriors (``torchaudio.functional.forced_align``); its non-blank frames carry the entropy term.
With ``lm_path`` (an ARPA file or KenLM binary; the ``[lm]`` extra), the beam search is the
official code's: pyctcdecode + KenLM, LM weight ``lm_weight`` (pyctcdecode's alpha) and
``word_bonus`` per word (its beta), both at pyctcdecode's defaults; its unknown-word penalty is
not scaled by ``lm_weight`` (0 is not "no LM"). (The official code computes
the mask from the greedy argmax, so there its beam search does not change the loss;
``beam_width: 1`` gives that behaviour here.)
"""
import math
from typing import Optional

import torch

from tta_brain.methods import losses
from tta_brain.asr.ctc import prefix_beam_search, viterbi_align
from tta_brain.data.prep.progress import shown as progress_shown
from tta_brain.methods.base import TTAMethod
from tta_brain.methods.registry import register


__all__ = ["SGEM", "best_path", "sgem_loss", "annealed_lr"]


def best_path(logits: torch.Tensor, beam_width: int, blank_id: int, lm_search=None) -> torch.Tensor:
    """Frame path ``[1, T]`` of the best beam of ``logits [1, T, V]`` (the greedy path when
    ``beam_width <= 1``; ``lm_search``: an ``LMBeamSearch``), on the logits' device."""
    if beam_width <= 1:
        return logits.argmax(-1)
    log_probs = logits[0].detach().float().log_softmax(-1).cpu()   # one host copy per step
    if torch.isnan(log_probs).any() or not torch.isfinite(log_probs.max(-1).values).all():
        return logits.argmax(-1)    # a diverged model: no beam survives NaN scores (a -inf of
                                    # a masked token is fine); the loss is NaN, the step skipped
    if lm_search is not None:
        best = lm_search(log_probs, beam_width)[0][0]
    else:
        best = prefix_beam_search(log_probs, beam_width, blank_id)[0][0]
    return viterbi_align(log_probs, best, blank_id)[None].to(logits.device)


def sgem_loss(logits: torch.Tensor, path: torch.Tensor, renyi_alpha: float, temperature: float,
              blank_id: int, ns_threshold: float, ns_coef: float) -> torch.Tensor:
    """SGEM's step loss: the Renyi entropy on the non-blank frames of ``path`` plus ``ns_coef``
    x negative sampling."""
    em = losses.renyi_entropy_loss(logits, alpha=renyi_alpha, temperature=temperature,
                                   blank_id=blank_id, path=path)
    ns = losses.negative_sampling_loss(logits, temperature=temperature, threshold=ns_threshold)
    return (em + ns_coef * ns).mean()


def annealed_lr(base: float, lr: float, lr_min: float, step: int, steps: int) -> float:
    """The lr of a group with lr ``base`` at step ``step`` of ``steps``: cosine from ``base`` to
    ``base * lr_min / lr`` (its multiplier kept)."""
    frac = (1 + math.cos(math.pi * step / max(steps, 1))) / 2
    lo = base * lr_min / lr
    return lo + (base - lo) * frac


@register("sgem")
class SGEM(TTAMethod):
    episodic = True

    def __init__(self, model, lr: float = 4e-5, lr_min: float = 2e-5, renyi_alpha: float = 1.5,
                 ns_coef: float = 1.0, ns_threshold: float = 0.04, beam_width: int = 5,
                 lm_path: Optional[str] = None, lm_weight: float = 0.5, word_bonus: float = 1.5,
                 lm_unigrams: Optional[str] = None, **kwargs):
        kwargs.setdefault("adapt_params", ({"select": "cnn"},))
        super().__init__(model, lr=lr, **kwargs)
        self.lr_min, self.renyi_alpha = float(lr_min), float(renyi_alpha)
        self.ns_coef, self.ns_threshold = float(ns_coef), float(ns_threshold)
        self.beam_width, self.lm_weight, self.word_bonus = int(beam_width), lm_weight, word_bonus
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.lm_search = None
        if lm_path and self.lobe.word_delimiter_id is None:
            raise ValueError(f"lm_path: the word n-gram LM needs a character vocabulary with a "
                             f"word delimiter ('{self.lobe.word_delimiter}'); this model's "
                             + ("tokenizer has word pieces (e.g. Parakeet's SentencePiece)"
                                if self.lobe.word_pieces else "vocabulary has no such token"))
        if lm_path:
            from tta_brain.asr.lm import LMBeamSearch    # the [lm] extra; one-line error without it
            tokens = [self.lobe.id_to_token.get(i, "") for i in range(self.lobe.vocab_size)]
            self.lm_search = LMBeamSearch(tokens, lm_path, blank_id=self.blank_id,
                                          word_delimiter=self.lobe.word_delimiter,
                                          alpha=float(lm_weight), beta=float(word_bonus),
                                          unigrams=lm_unigrams, show_progress=progress_shown())

    def pseudo_path(self, logits: torch.Tensor) -> torch.Tensor:
        """Frame path ``[1, T]`` of the best beam (the greedy path when ``beam_width <= 1``)."""
        return best_path(logits, self.beam_width, self.blank_id, self.lm_search)

    def loss(self, logits):
        return sgem_loss(logits, self.pseudo_path(logits), self.renyi_alpha, self.temperature,
                         self.blank_id, self.ns_threshold, self.ns_coef)

    def before_step(self, step: int):
        """Cosine annealing from lr to lr_min over the N steps (per group multipliers kept)."""
        for g, base in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = annealed_lr(base, self.lr, self.lr_min, step, self.steps)
