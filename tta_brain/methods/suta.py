"""SUTA (Lin et al., 2022): N steps of entropy + minimum-class-confusion minimisation per
utterance, starting from the source model every time (episodic)."""
from tta_brain.methods.base import TTAMethod, register


@register("suta")
class SUTA(TTAMethod):
    def adapt_and_predict(self, x, info):
        self.reset()
        for _ in range(self.steps):
            self.adapt_step(x)
        return self.predict(x)
