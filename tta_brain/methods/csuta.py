"""CSUTA: continual SUTA. One step per utterance (default), never reset by itself; the parameters
and the optimiser state carry over. Any reset policy of ``tta_brain.methods.resets`` can be attached."""
from tta_brain.methods.base import TTAMethod
from tta_brain.methods.registry import register


@register("csuta")
class CSUTA(TTAMethod):
    episodic = False

    def __init__(self, model, steps: int = 1, **kwargs):
        super().__init__(model, steps=steps, **kwargs)
