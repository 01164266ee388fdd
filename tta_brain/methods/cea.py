"""CEA for CTC, episodic, as the E-BATS benchmark runs it: two stages of steps per utterance,
each with its own AdamW, from the source model every time.

Stage 1 (``steps`` steps, ``adapt_params`` = LayerNorm + CNN + feature projection, ``lr``):
``em_coef * mean_t sigmoid(H_t) H_t`` over the non-blank frames (confidence-weighted entropy,
T = 2.5) ``+ (1 - em_coef) * MCC``. Stage 2 (``steps2`` steps, ``stage2_params`` = LayerNorm,
``lr2``): ``em_coef * entropy over all frames + (1 - em_coef) * MCC + tc_coef * temporal
coherence`` of the CNN features (``losses.temporal_coherence_loss`` on the non-blank frames).
The CNN features come from the same forward as the logits. With a group-norm feature encoder
(wav2vec2-base) no LayerNorm sits inside the CNN, so the coherence term has no gradient there
(as in the reference); a layer-norm encoder (``do_stable_layer_norm``) adapts through it.
``param_collection: ebats`` gives stage 1 the reference's optimiser list (its CNN tensors
repeated, a repeated tensor's AdamW steps one after the other: ``methods.params``).
"""
from tta_brain.methods import losses
from tta_brain.methods.base import TTAMethod
from tta_brain.methods.optim import build_optimizer
from tta_brain.methods.params import select_parameters
from tta_brain.methods.registry import register
from tta_brain.methods.state import zero_optimizer_state


@register("cea")
class CEA(TTAMethod):
    episodic = True
    # on CUDA both stages are device steps, captured (one graph per stage and input length; no
    # length buckets: its losses do not mask padded frames); its second optimiser runs fused too
    device_loss = True
    device_optimizers = ("optimizer2",)

    def __init__(self, model, steps: int = 10, steps2: int = 10, lr2: float = 2e-4,
                 tc_coef: float = 0.3, stage2_params=({"select": "layernorm"},), **kwargs):
        super().__init__(model, steps=steps, **kwargs)
        self.steps2, self.tc_coef = int(steps2), float(tc_coef)
        stage2 = select_parameters(self.net, stage2_params)
        adapted = {id(p) for p in self.params}
        outside = [n for n, p, _ in stage2 if id(p) not in adapted]
        if outside:
            raise ValueError(f"cea: stage2_params must be adapted in stage 1 too (adapt_params), "
                             f"{outside[0]} is not")
        if self.tc_coef and not self.lobe.supports_features:
            raise ValueError(f"cea: tc_coef > 0 needs a model with a separable CNN feature encoder "
                             f"({type(self.net).__name__} has none; tc_coef 0 leaves the "
                             f"temporal coherence term out)")
        if self.tc_coef and getattr(self.net.base_model, "adapter", None) is not None:
            raise ValueError(f"cea: tc_coef > 0 needs the logits' frames to be the CNN's "
                             f"({type(self.net).__name__}'s adapter subsamples them; tc_coef 0 "
                             f"leaves the temporal coherence term out)")
        self.optimizer2 = build_optimizer(kwargs.get("optimizer"), stage2, float(lr2))
        self._stage2, self._feats = False, None

    def logits(self, x, values=None):
        if not (self._stage2 and self.tc_coef):     # (without the coherence term: the model's
            return super().logits(x, values)        # own forward, which any CTC model has)
        self._feats = self.lobe.features(x)     # stage 2: keep the CNN output of this forward
        params = None if values is None else dict(zip(self._lobe_names, values))
        return self.lobe.logits(x, params, self._feats)

    def loss(self, logits):
        if not self._stage2:
            em = losses.confidence_weighted_entropy_loss(logits, temperature=self.temperature,
                                                         blank_id=self.blank_id)
        else:
            em = losses.entropy_loss(logits, temperature=self.temperature, non_blank=False)
        loss = self.em_coef * em + (1 - self.em_coef) * losses.mcc_loss(logits, temperature=self.temperature)
        if self._stage2 and self.tc_coef:
            mask = losses.non_blank_mask(logits, blank_id=self.blank_id)
            loss = loss + self.tc_coef * losses.temporal_coherence_loss(self._feats, mask)
        return loss.mean()

    def steps_with(self, optimizer) -> int:
        return self.steps2 if optimizer is self.optimizer2 else self.steps

    def forward_and_adapt(self, x, info):
        for n in range(self.steps):
            self.adapt_step(x)
        self._stage2 = True                      # logits() keeps the CNN features
        try:
            for n in range(self.steps2):
                self.adapt_step(x, optimizer=self.optimizer2)
        finally:
            self._stage2, self._feats = False, None
        return self.predict(x)

    def reset(self):
        super().reset()
        zero_optimizer_state(self.optimizer2)
