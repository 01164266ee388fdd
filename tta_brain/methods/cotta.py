"""CoTTA (Wang et al., CVPR 2022) for CTC, continual: a student adapts every module's weight and
bias (as the reference's ``collect_params``: ``select: weights_and_biases``) towards an EMA
teacher, a frozen source anchor decides when the teacher averages augmented views, and a random
0.1 % of the weights go back to the source after each step.

Per utterance: the anchor (source weights) gives the mean max-probability of x_t; below
``ap_threshold`` the teacher output is the mean of ``n_augment`` teacher passes on x_t plus
Gaussian noise (each view noised with probability 0.5, amplitude uniform in [0.001, 0.015] on the
raw waveform, as audiomentations' AddGaussianNoise; a seeded generator), else one plain teacher
pass. Loss: symmetric cross-entropy teacher/student over the student's non-blank frames; one
optimiser step; teacher <- EMA(``ema_decay``) of the student when the loss is > 0; stochastic
restore. With N steps each step takes the teacher's output anew (the reference calls its
adaptation once per step); the transcript is the teacher's output from before the last update
(the reference's).

Cost: every weight adapts, so the method holds the model, the source anchor, the teacher and
AdamW's two moments (5 model-sized copies, plus the gradients), and each utterance runs the
anchor (aux), the teacher (the transcript: infer) and the student (adapt) forwards and one
backward, the teacher ``n_augment`` times instead of once when the anchor is unsure.
"""
import torch

from tta_brain.methods import losses
from tta_brain.methods.base import TTAMethod
from tta_brain.methods.registry import register
from tta_brain.methods.state import restore, snapshot

#: ``restore_mask: fixed``: the seed the reference sets before drawing each tensor's mask.
REFERENCE_MASK_SEED = 42



def augmented_view(wav: torch.Tensor, gen: torch.Generator, noise) -> torch.Tensor:
    """One augmented view of the raw waveform ``wav``: Gaussian noise of an amplitude uniform in
    ``[lo, hi]``, added with probability ``p`` (``noise = (lo, hi, p)``), every draw from ``gen``
    (amplitude, noise, whether to keep the clean wave) in this order."""
    lo, hi, p = noise
    amp = lo + (hi - lo) * float(torch.rand((), generator=gen))
    noisy = (amp * torch.randn(wav.shape, generator=gen)).to(wav.device)
    keep = float(torch.rand((), generator=gen)) >= p
    return wav if keep else wav + noisy


@register("cotta")
class CoTTA(TTAMethod):
    episodic = False

    def __init__(self, model, lr: float = 1e-4, steps: int = 1, ema_decay: float = 0.999,
                 ap_threshold: float = 0.2, n_augment: int = 32, noise_min: float = 0.001,
                 noise_max: float = 0.015, noise_p: float = 0.5, restore_prob: float = 0.001,
                 restore_mask: str = "fresh", seed: int = 0, **kwargs):
        kwargs.setdefault("adapt_params", ({"select": "weights_and_biases"},))
        super().__init__(model, lr=lr, steps=steps, **kwargs)
        self.ema_decay, self.ap_threshold = float(ema_decay), float(ap_threshold)
        self.n_augment, self.noise = int(n_augment), (float(noise_min), float(noise_max), float(noise_p))
        self.restore_prob, self.restore_mask, self.seed = float(restore_prob), restore_mask, int(seed)
        self.teacher = snapshot(self.params)
        self.aug_gen = torch.Generator().manual_seed(self.seed)
        self.restore_gen = torch.Generator().manual_seed(self.seed + 1)
        self.counts.update(augmented=0)
        self._wav, self._fixed = None, None

    def process(self, wav, info=None):
        self._wav = wav                        # the augmented views noise the raw waveform
        return super().process(wav, info)

    @torch.no_grad()
    def teacher_logits(self, x, transcript: bool = True):
        """The teacher's output (the transcript's: counted as the inference forward, an earlier
        step's an auxiliary one; the anchor and the augmented views beyond the first are
        auxiliary forwards)."""
        self.counts["aux_forward"] += 1
        self.counts["infer_forward" if transcript else "aux_forward"] += 1
        anchor = self.logits(x, self.source).softmax(-1).max(-1).values.mean()
        if float(anchor) >= self.ap_threshold or self.n_augment < 1:
            return self.logits(x, self.teacher)
        self.counts["augmented"] += 1
        self.counts["aux_forward"] += self.n_augment - 1
        wav = self._wav.reshape(-1).float()
        views = []
        for _ in range(self.n_augment):
            xa = self.lobe.prepare(augmented_view(wav, self.aug_gen, self.noise))
            views.append(self.lobe.logits(xa, dict(zip(self._lobe_names, self.teacher))))
        return torch.stack(views).mean(0)

    def forward_and_adapt(self, x, info):
        last = max(self.steps, 1) - 1
        for n in range(last + 1):
            teacher = self.teacher_logits(x, transcript=n == last)
            if n >= self.steps:                # steps 0: the teacher's output, no update
                break
            value = self.adapt_step(x, loss_fn=lambda lg: losses.symmetric_cross_entropy_loss(
                lg, teacher, blank_id=self.blank_id).mean())
            if value > 0:                      # nan (skipped step) is not > 0
                with torch.no_grad():
                    torch._foreach_lerp_(self.teacher, [p.detach() for p in self.params],
                                         1 - self.ema_decay)
            self.stochastic_restore()
        return self.lobe.decode(teacher)[0]

    @torch.no_grad()
    def stochastic_restore(self):
        """Each adapted weight back to its source value with probability ``restore_prob``: a new
        mask every step (``fresh``, the CoTTA paper) or the reference's (``fixed``: the generator
        reseeded with the reference's 42 before each tensor, so the same weights every step, and
        the reference's weights: its ``torch.manual_seed(42); torch.rand(shape) < p``). The masks are drawn on the
        CPU (a seeded generator, the same on every device) as flat indices."""
        for p, src, idx in zip(self.params, self.source, self.restore_indices()):
            idx = idx.to(p.device)
            p.view(-1).index_copy_(0, idx, src.view(-1).index_select(0, idx))

    def restore_indices(self):
        """Per adapted tensor, the flat indices to restore this step. ``fresh``: each weight
        independently with probability p, drawn sparsely (K ~ Binomial(n, p) weights, a uniform
        K-subset of all n: the same law as n Bernoulli draws, without drawing n numbers)."""
        if self.restore_mask == "fixed":
            if self._fixed is None:
                self._fixed = []
                for p in self.params:
                    self.restore_gen.manual_seed(REFERENCE_MASK_SEED)
                    mask = torch.rand(p.shape, generator=self.restore_gen) < self.restore_prob
                    self._fixed.append(mask.view(-1).nonzero().squeeze(1))
            return self._fixed
        sizes = torch.tensor([p.numel() for p in self.params])
        n, g = int(sizes.sum()), self.restore_gen
        k = int(torch.binomial(torch.tensor(float(n)), torch.tensor(self.restore_prob), generator=g))
        # more than half: the weights kept are the subset drawn (its complement is a uniform
        # k-subset too); distinct draws slow down as the subset nears all n (at p 0.999: 8 s for
        # 20,000 weights, minutes for 200,000), never at the default p
        m = n - k if 2 * k > n else k
        flat = torch.empty(0, dtype=torch.long)
        while flat.numel() < m:                  # distinct draws: a uniform m-subset
            flat = torch.cat([flat, torch.randint(n, (m - flat.numel(),), generator=g)]).unique()
        if m != k:
            keep = torch.ones(n, dtype=torch.bool)
            keep[flat] = False
            flat = keep.nonzero().squeeze(1)
        ends = sizes.cumsum(0)
        owner = torch.bucketize(flat, ends, right=True)
        local = flat - (ends - sizes)[owner]
        return local.split(torch.bincount(owner, minlength=len(sizes)).tolist())

    def reset(self):
        super().reset()
        restore(self.teacher, self.source)

    def state_dict(self):
        return super().state_dict() | {"teacher": [t.clone() for t in self.teacher],
                                       "aug_gen": self.aug_gen.get_state(),
                                       "restore_gen": self.restore_gen.get_state()}

    def load_state_dict(self, sd):
        super().load_state_dict(sd)
        restore(self.teacher, sd["teacher"])
        self.aug_gen.set_state(sd["aug_gen"])
        self.restore_gen.set_state(sd["restore_gen"])
