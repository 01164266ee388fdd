"""CSUTA: continual SUTA. One step per utterance (default), never reset by itself; the parameters
and the optimiser state carry over. Any reset policy of ``tta_brain.resets`` can be attached."""
from tta_brain.methods.base import TTAMethod, register


@register("csuta")
class CSUTA(TTAMethod):
    continual = True

    def __init__(self, model, steps: int = 1, **kwargs):
        super().__init__(model, steps=steps, **kwargs)

    def adapt_and_predict(self, x, info):
        t = self.t + 1
        self.policy_before(t, info)
        for _ in range(self.steps):
            self.adapt_step(x)
        hyp = self.predict(x)
        self.policy_after(t, x, info)          # the steps above were this utterance's update
        return hyp
