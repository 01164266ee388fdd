"""Padded passes (``tta_brain.lobes.partial``, the length buckets of the captured steps): a
zero-padded utterance gives the unpadded logits and gradients on real tiny models of every
architecture the blocker lets through, and the blocker names the ones where it would not."""
import pytest
import torch
import torch.nn.functional as F

from fake_corpora import fake_speech
from tta_brain.lobes.hf_ctc import HFCTCLobe
from tta_brain.lobes.testing import TINY, save_random_ctc_model
from tta_brain.methods import losses

EXACT = [("wav2vec2", {}),                                                   # GroupNorm CNN
         ("wav2vec2", {"feat_extract_norm": "layer", "do_stable_layer_norm": True}),
         ("hubert", {}),
         ("hubert", {"feat_extract_norm": "layer", "do_stable_layer_norm": True})]  # HuBERT-large


def lobe_of(tmp_path, arch, cfg):
    return HFCTCLobe(save_random_ctc_model(str(tmp_path), 1, arch=arch, **dict(TINY, **cfg)))


def suta_grads(lobe, loss_of):
    """Gradients of the SUTA loss over the LayerNorm and CNN parameters (the paper's selection)."""
    params = [p for n, p in lobe.model.named_parameters()
              if "layer_norm" in n or "feature_extractor" in n or "feature_projection" in n]
    lobe.model.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    loss = loss_of()
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("arch,cfg", EXACT)
@pytest.mark.parametrize("pad", [1, 320, 4321])
def test_padded_pass_is_the_unpadded_pass(tmp_path, arch, cfg, pad):
    lobe = lobe_of(tmp_path, arch, cfg)
    assert lobe.padding_blocker() is None
    x = lobe.prepare(torch.from_numpy(fake_speech(0.83, seed=3)).float())
    n = x.shape[-1]
    xp = F.pad(x, (0, pad))
    samples = torch.tensor([n])
    with torch.no_grad():
        ref = lobe.logits(x)
        logits, frames = lobe.padded_logits(xp, samples)
        frames_pad = int(lobe.output_lengths(torch.tensor(n + pad)))
        feats = F.pad(lobe.features(x), (0, frames_pad - ref.shape[1]))
        from_feats, _ = lobe.padded_logits(None, samples, feats)
    T = ref.shape[1]
    assert int(frames) == T and logits.shape[1] == frames_pad
    assert torch.allclose(logits[:, :T], ref, atol=2e-6), (logits[:, :T] - ref).abs().max()
    assert torch.allclose(from_feats[:, :T], ref, atol=2e-6)
    # the SUTA loss and its gradients, the padded frames masked by the loss
    loss = lambda lg, ln=None: losses.suta_loss(lg, ln).mean()
    g_ref = suta_grads(lobe, lambda: loss(lobe.logits(x)))
    g_pad = suta_grads(lobe, lambda: loss(*lobe.padded_logits(xp, samples)))
    for a, b in zip(g_ref, g_pad):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4), (a - b).abs().max()


def test_without_the_masked_groupnorm_padding_changes_the_logits(tmp_path):
    """What the padded pass guards against: the model's own forward on zero-padded input (the
    GroupNorm of the first CNN layer then averages over the padding) gives other logits."""
    lobe = lobe_of(tmp_path, "wav2vec2", {})
    x = lobe.prepare(torch.from_numpy(fake_speech(0.83, seed=3)).float())
    with torch.no_grad():
        ref = lobe.logits(x)
        naive = lobe.logits(F.pad(x, (0, 4321)))[:, :ref.shape[1]]
        padded, _ = lobe.padded_logits(F.pad(x, (0, 4321)), torch.tensor([x.shape[-1]]))
    assert (naive - ref).abs().max() > 1e-3
    assert (padded[:, :ref.shape[1]] - ref).abs().max() < 2e-6


@pytest.mark.parametrize("arch,cfg,why", [
    ("data2vec-audio", {}, "Data2VecAudioEncoder"),
    ("hubert", {"conv_pos_batch_norm": True}, "conv_pos_batch_norm"),
    ("wav2vec2", {"add_adapter": True, "output_hidden_size": 32}, "adapter")])
def test_padding_blocker_names_the_models_it_would_change(tmp_path, arch, cfg, why):
    lobe = lobe_of(tmp_path, arch, cfg)
    assert why in (lobe.padding_blocker() or "")
    if arch == "data2vec-audio":          # and there the padded pass is indeed not the model's
        x = lobe.prepare(torch.from_numpy(fake_speech(0.83, seed=3)).float())
        with torch.no_grad():
            ref = lobe.logits(x)
            padded, _ = lobe.padded_logits(F.pad(x, (0, 4321)), torch.tensor([x.shape[-1]]))
        assert (padded[:, :ref.shape[1]] - ref).abs().max() > 1e-3


def test_a_first_layer_groupnorm_of_several_channels_a_group_is_refused(tmp_path):
    """The masked norm of a padded pass normalises each channel alone: a first-layer GroupNorm
    with fewer groups than channels would be computed wrongly, so the blocker names it; so it
    does a GroupNorm of a later layer (not masked at all) and any other kind of CNN norm."""
    lobe = lobe_of(tmp_path, "wav2vec2", {})
    first = lobe.model.base_model.feature_extractor.conv_layers[0]
    c = first.layer_norm.num_channels
    first.layer_norm = torch.nn.GroupNorm(2, c, affine=True)
    assert "CNN layer 0 has a GroupNorm" in (lobe.padding_blocker() or "")
    # nor is a per-channel GroupNorm after the first layer masked, nor another kind of norm
    first.layer_norm = torch.nn.GroupNorm(c, c, affine=True)
    assert lobe.padding_blocker() is None
    second = lobe.model.base_model.feature_extractor.conv_layers[1]
    second.layer_norm = torch.nn.GroupNorm(c, c, affine=True)
    assert "CNN layer 1 has a GroupNorm" in (lobe.padding_blocker() or "")
    second.layer_norm = torch.nn.BatchNorm1d(c)
    assert "CNN layer 1 normalises with BatchNorm1d" in (lobe.padding_blocker() or "")
