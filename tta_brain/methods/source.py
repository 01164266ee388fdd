"""No adaptation: the source model's greedy transcript (the baseline every table starts with)."""
from tta_brain.methods.base import TTAMethod
from tta_brain.methods.registry import register


@register("source")
class Source(TTAMethod):
    def __init__(self, model, **kwargs):
        kwargs.setdefault("adapt_params", ())
        super().__init__(model, **kwargs)

    def describe(self) -> str:
        total = sum(p.numel() for p in self.net.parameters())
        return f"{self.name}: no adaptation, greedy CTC of the {total / 1e6:.2f}M-parameter model"

    def forward_and_adapt(self, x, info):
        return self.predict(x)
