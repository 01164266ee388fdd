"""CSUTA: continual SUTA. One step per utterance (default), never reset by itself; the parameters
and the optimiser state carry over. Any reset policy of ``tta_brain.resets`` can be attached."""
from tta_brain.methods.base import TTAMethod, register


@register("csuta")
class CSUTA(TTAMethod):
    continual = True

    def __init__(self, model, steps: int = 1, **kwargs):
        super().__init__(model, steps=steps, **kwargs)

    def adapt_and_predict(self, x, info):
        t, policy = self.t + 1, self.reset_policy
        if policy is not None and (why := policy.before_utterance(info)):
            self.reset_meta(t - 1, info.position, why)
        for _ in range(self.steps):
            self.adapt_step(x)
        hyp = self.predict(x)
        if policy is not None:
            policy.after_utterance(t, x, info)
            if why := policy.at_update(t):
                self.reset_meta(t, info.position + 1, why)
            policy.end_step(t)
        return hyp
