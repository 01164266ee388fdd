"""No adaptation: the source model's greedy transcript (the baseline every table starts with)."""
from tta_brain.methods.base import TTAMethod, register


@register("source")
class Source(TTAMethod):
    def __init__(self, model, **kwargs):
        kwargs.setdefault("adapt_params", ())
        super().__init__(model, **kwargs)

    def adapt_and_predict(self, x, info):
        return self.predict(x)
