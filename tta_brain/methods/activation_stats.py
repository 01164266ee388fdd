"""Source activation statistics (FOA, E-BATS) and the losses that align a test utterance with them.

Two kinds of statistics, computed from source (never test) speech with the source model:

* ``hidden``: per utterance, the time-mean of the CNN output (``[C]``) and of every transformer
  hidden state, concatenated (``[(L + 1) H]``: the layers' inputs and the last output, as
  ``output_hidden_states``); over utterances, their mean and (biased) std.
* ``tokens``: per label v (argmax pseudo label, blank left out), the mean and (biased) std of the
  concatenated all-layer states of the frames labelled v, over all utterances (``[V, (L + 1) H]``)
  and the frame count ``[V]`` (0: never predicted).

The losses take a population of candidates ``[P, ...]`` of one utterance and return ``[P]``.
"""
from typing import Dict, Iterable, Optional

import torch

from tta_brain.data.manifest import expand_path
from tta_brain.lobes.partial import PartialForward
from tta_brain.methods import source_stats as stats_file

__all__ = ["hidden_stats", "token_stats", "token_frames_blocker", "load_stats", "layer_means",
           "mean_alignment", "token_alignment", "confidence_weight"]


def layer_means(states) -> torch.Tensor:
    """Hidden states (a list of ``[P, F, H]``) -> their time means, concatenated ``[P, (L+1)H]``."""
    return torch.cat([h.float().mean(dim=1) for h in states], dim=1)


@stats_file.register_kind("hidden", partial_forward=True)
@torch.no_grad()
def hidden_stats(lobe, inputs: Iterable[torch.Tensor], options=None) -> Dict[str, torch.Tensor]:
    """The ``hidden`` statistics of ``inputs`` (normalised ``[1, T]`` model inputs)."""
    pf, cnn, layers = PartialForward(lobe), [], []
    for x in inputs:
        _, feats, states, _ = pf.hidden(x)
        cnn.append(feats.mean(dim=2)[0])
        layers.append(layer_means(states)[0])
    if not cnn:
        raise ValueError("hidden statistics: no utterances")
    cnn_std, cnn_mean = torch.std_mean(torch.stack(cnn), dim=0, unbiased=False)
    std, mean = torch.std_mean(torch.stack(layers), dim=0, unbiased=False)
    return {"cnn_mean": cnn_mean.cpu(), "cnn_std": cnn_std.cpu(), "layers_mean": mean.cpu(),
            "layers_std": std.cpu(), "n_utts": torch.tensor(len(cnn))}


def token_frames_blocker(lobe) -> Optional[str]:
    """Why ``lobe``'s frame labels (its logits' frames) are not its encoder states' frames, which
    the token-level statistics pair (None: they are)."""
    if getattr(lobe.model.base_model, "adapter", None) is not None:
        return (f"{type(lobe.model).__name__}: its adapter subsamples the encoder's frames, so "
                f"a frame's label is no encoder state's (token-level statistics)")
    return None


@stats_file.register_kind("tokens", partial_forward=True)
@torch.no_grad()
def token_stats(lobe, inputs: Iterable[torch.Tensor], options=None) -> Dict[str, torch.Tensor]:
    """The ``tokens`` statistics of ``inputs``: per-label mean/std of all-layer states (running
    sums of x and x^2 in float64)."""
    pf, V = PartialForward(lobe), lobe.vocab_size
    why = token_frames_blocker(lobe)
    if why:
        raise ValueError(why)
    s1 = s2 = None
    count = torch.zeros(V, dtype=torch.float64)
    for x in inputs:
        logits, _, states, _ = pf.hidden(x)
        z = torch.cat(states, dim=-1)[0].double().cpu()           # [F, D]
        onehot = _label_onehot(logits.argmax(-1)[0].cpu(), V, lobe.blank_id).double()
        if s1 is None:
            s1 = torch.zeros(V, z.shape[1], dtype=torch.float64)
            s2 = torch.zeros_like(s1)
        s1 += onehot.T @ z
        s2 += onehot.T @ (z * z)
        count += onehot.sum(0)
    if s1 is None:
        raise ValueError("token statistics: no utterances")
    n = count.clamp(min=1)[:, None]
    mean = s1 / n
    std = (s2 / n - mean * mean).clamp(min=0).sqrt()
    return {"mean": mean.float(), "std": std.float(), "count": count.long()}


def load_stats(path: str, data_root: str, lobe, kinds) -> Dict[str, Dict[str, torch.Tensor]]:
    """The statistics ``kinds`` of file ``path`` (``$data_root`` replaced) on ``lobe``'s device,
    checked to come from this source model; a one-line error naming the file and the command
    that makes it otherwise."""
    path = expand_path(path, data_root)
    try:
        record = stats_file.load(path)
        record.check_model(lobe.model, path)
    except stats_file.SourceStatsError as e:
        raise stats_file.SourceStatsError(str(e).replace("--kinds fisher", f"--kinds {','.join(kinds)}")) from None
    return {k: {n: t.to(lobe.device) for n, t in record.kind(k, path).items()} for k in kinds}


def _label_onehot(path: torch.Tensor, V: int, blank_id: int) -> torch.Tensor:
    """``path [..., F]`` -> one-hot ``[..., F, V]`` of the non-blank labels (blank rows zero)."""
    onehot = torch.nn.functional.one_hot(path, V).float()
    onehot[..., blank_id] = 0
    return onehot


# ----------------------------------------------------------------------------- losses
def mean_alignment(means: torch.Tensor, source_mean: torch.Tensor) -> torch.Tensor:
    """``sum_d (mu_p,d - mu_src,d)^2`` per candidate: ``means [P, D]`` -> ``[P]``."""
    means = means.float()
    return (means - source_mean.to(means)).pow(2).sum(dim=1)


def token_alignment(states, path: torch.Tensor, source: Dict[str, torch.Tensor],
                    blank_id: int) -> torch.Tensor:
    """E-BATS' token-level loss per candidate: for each label v predicted in the utterance (and
    seen in the source statistics), ``mean_d (mu_v - mu_src,v)^2 + mean_d (s_v - s_src,v)^2``
    with mu_v / s_v the mean / biased std of the all-layer states of the frames labelled v; the
    average over those labels (0 if none). ``states``: list of ``[P, F, H]``; ``path [P, F]``."""
    z = torch.cat(states, dim=-1).float()                           # [P, F, D]
    used = torch.zeros_like(source["count"], dtype=torch.bool)
    used[path.flatten()] = True
    used &= source["count"] > 0
    used[blank_id] = False
    labels = used.nonzero()[:, 0]                                   # the K labels that count
    if not len(labels):
        return z.new_zeros(len(z))
    lut = torch.full_like(source["count"], len(labels))             # others -> dropped column K
    lut[labels] = torch.arange(len(labels), device=lut.device)
    onehot = torch.nn.functional.one_hot(lut[path], len(labels) + 1)[..., :-1].to(z)   # [P, F, K]
    n = onehot.sum(dim=1)                                           # [P, K]
    per_label = onehot.transpose(1, 2)                              # [P, K, F]
    mean = per_label @ z / n.clamp(min=1)[..., None]                # [P, K, D]
    centred = z - onehot @ mean                                     # each frame minus its label's mean
    std = (per_label @ (centred * centred) / n.clamp(min=1)[..., None]).sqrt()
    mse = ((mean - source["mean"][labels].to(z)).pow(2).mean(-1)
           + (std - source["std"][labels].to(z)).pow(2).mean(-1))  # [P, K]
    present = (n > 0).to(z)
    k = present.sum(dim=1)
    return torch.where(k > 0, (mse * present).sum(dim=1) / k.clamp(min=1), torch.zeros_like(k))


def confidence_weight(loss: torch.Tensor, loss_max: float = 5.0) -> torch.Tensor:
    """E-BATS' weight of the token loss: ``2 - clip(L / loss_max, 0, 2)`` (high loss, low weight)."""
    return 2.0 - (loss / (loss_max + 1e-8)).clamp(0.0, 2.0)
