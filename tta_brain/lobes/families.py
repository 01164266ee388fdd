"""What a transformers CTC model is made of, where transformers' own answer is wrong for a family.

:func:`base_model`: the network below the CTC head. ``PreTrainedModel.base_model`` looks the
module up by ``base_model_prefix``; SEW-D's prefix is 'sew-d' while its module is ``sew_d``, so
transformers returns the CTC model itself (whose first output is the logits, not the last
hidden state, and which has no ``feature_extractor``).

:data:`FEATURE_MODELS`: the base models whose CNN features the lobe computes once per utterance
(``tta_brain.lobes.hf_ctc``) and whose layers a partial forward runs (``tta_brain.lobes.partial``)."""
from torch import nn

__all__ = ["base_model", "FEATURE_MODELS"]

#: Base models whose forward is CNN -> projection -> encoder (-> adapter) -> CTC head, so the CNN
#: features can be computed once and the rest run from them (tested: identical logits).
FEATURE_MODELS = ("Wav2Vec2Model", "HubertModel", "Data2VecAudioModel", "WavLMModel",
                  "UniSpeechModel", "UniSpeechSatModel", "Wav2Vec2ConformerModel")


def base_model(model: nn.Module) -> nn.Module:
    """``model``'s base model (``model`` itself for a module without one)."""
    base = getattr(model, "base_model", model)
    if base is model:
        prefix = str(getattr(model, "base_model_prefix", "") or "").replace("-", "_")
        base = getattr(model, prefix, model) if prefix else model
    return base
