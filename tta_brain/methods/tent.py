"""Tent (Wang et al., ICLR 2021) for CTC, as the E-BATS benchmark runs it: one AdamW step per
utterance on the mean entropy (temperature 1) of the non-blank frames, LayerNorm weight and bias
adapted, back to the source model before every utterance (episodic), then a fresh forward for the
transcript."""
from tta_brain.methods import losses
from tta_brain.methods.base import TTAMethod
from tta_brain.methods.registry import register


@register("tent")
class Tent(TTAMethod):
    episodic = True

    def __init__(self, model, steps: int = 1, temperature: float = 1.0, **kwargs):
        kwargs.setdefault("adapt_params", ({"select": "layernorm"},))
        super().__init__(model, steps=steps, temperature=temperature, **kwargs)

    def loss(self, logits, lengths=None):
        return losses.entropy_loss(logits, lengths, temperature=self.temperature,
                                   blank_id=self.blank_id).mean()

    # what the device step needs to know (tta_brain.gpu): the entropy runs on the device alone,
    # so on CUDA the step is the device step (captured on length buckets, whose padded frames the
    # loss masks through ``lengths``)
    device_loss = True
