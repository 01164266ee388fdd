"""SUTA (Lin et al., 2022): N steps of entropy + minimum-class-confusion minimisation per
utterance, starting from the source model every time (the skeleton's default: episodic, SUTA
loss, N steps, then the prediction)."""
from tta_brain.methods.base import TTAMethod
from tta_brain.methods.registry import register


@register("suta")
class SUTA(TTAMethod):
    episodic = True
