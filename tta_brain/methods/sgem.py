"""SGEM (Kim et al., 2023) for CTC: Renyi entropy (alpha 1.5) on the frames of the beam-search
pseudo path + negative sampling, AdamW with cosine-annealed lr over the N steps, episodic.

The pseudo path is the CTC prefix beam search's best hypothesis force-aligned to the current
posteriors (``torchaudio.functional.forced_align``); its non-blank frames carry the entropy term.
With ``lm_path`` (an ARPA file or KenLM binary; the ``[lm]`` extra), the beam search is the
official code's: pyctcdecode + KenLM, LM weight ``lm_weight`` (pyctcdecode's alpha) and
``word_bonus`` per word (its beta), both at pyctcdecode's defaults. (The official code computes
the mask from the greedy argmax, so there its beam search does not change the loss;
``beam_width: 1`` gives that behaviour here.)
"""
import math
from typing import Optional

import torch

from tta_brain.methods import losses
from tta_brain.asr.ctc import prefix_beam_search, viterbi_align
from tta_brain.methods.base import TTAMethod
from tta_brain.methods.registry import register


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
        if lm_path:
            from tta_brain.asr.lm import LMBeamSearch    # the [lm] extra; one-line error without it
            tokens = [self.lobe.id_to_token.get(i, "") for i in range(self.lobe.vocab_size)]
            self.lm_search = LMBeamSearch(tokens, lm_path, blank_id=self.blank_id,
                                          word_delimiter=self.lobe.word_delimiter,
                                          alpha=float(lm_weight), beta=float(word_bonus),
                                          unigrams=lm_unigrams)

    def pseudo_path(self, logits: torch.Tensor) -> torch.Tensor:
        """Frame path ``[1, T]`` of the best beam (the greedy path when ``beam_width <= 1``)."""
        if self.beam_width <= 1:
            return logits.argmax(-1)
        log_probs = logits[0].detach().float().log_softmax(-1).cpu()   # one host copy per step
        if self.lm_search is not None:
            best = self.lm_search(log_probs, self.beam_width)[0][0]
        else:
            best = prefix_beam_search(log_probs, self.beam_width, self.blank_id)[0][0]
        return viterbi_align(log_probs, best, self.blank_id)[None].to(logits.device)

    def loss(self, logits):
        path = self.pseudo_path(logits)
        em = losses.renyi_entropy_loss(logits, alpha=self.renyi_alpha, temperature=self.temperature,
                                       blank_id=self.blank_id, path=path)
        ns = losses.negative_sampling_loss(logits, temperature=self.temperature,
                                           threshold=self.ns_threshold)
        return (em + self.ns_coef * ns).mean()

    def before_step(self, step: int):
        """Cosine annealing from lr to lr_min over the N steps (per group multipliers kept)."""
        frac = (1 + math.cos(math.pi * step / max(self.steps, 1))) / 2
        for g, base in zip(self.optimizer.param_groups, self.base_lrs):
            lo = base * self.lr_min / self.lr
            g["lr"] = lo + (base - lo) * frac
