"""Parameter selection on a real tiny Wav2Vec2ForCTC: selectors, lr multipliers, errors."""
import logging
import re

import pytest
import torch
from torch import nn

from tta_brain.methods.params import SELECTORS, param_groups, select_parameters


@pytest.fixture(scope="module")
def net(tiny_model_dir):
    from transformers import Wav2Vec2ForCTC
    return Wav2Vec2ForCTC.from_pretrained(tiny_model_dir)


def names(net, groups):
    return [n for n, _, _ in select_parameters(net, groups)]


def all_names(net):
    return [n for n, _ in net.named_parameters()]


def layernorm_names(net):
    out = []
    for mn, m in net.named_modules():
        if type(m) is nn.LayerNorm:
            out += [f"{mn}.weight", f"{mn}.bias"]
    return out


def test_layernorm_selects_every_layernorm_and_nothing_else(net):
    got = names(net, ["layernorm"])
    expected = layernorm_names(net)
    assert sorted(got) == sorted(expected)
    # tiny model: feature projection LN + encoder LN + 2 per transformer layer
    assert len(got) == 2 * (1 + 1 + 2 * net.config.num_hidden_layers)
    # the CNN's first GroupNorm is called 'layer_norm' but is a GroupNorm: not selected
    assert "wav2vec2.feature_extractor.conv_layers.0.layer_norm.weight" not in got
    assert all(n.endswith((".weight", ".bias")) for n in got)


def test_feature_extractor_projection_and_cnn(net):
    fe = names(net, ["feature_extractor"])
    fp = names(net, ["feature_projection"])
    cnn = names(net, ["cnn"])
    assert fe == [n for n in all_names(net) if n.startswith("wav2vec2.feature_extractor.")]
    assert fp == [n for n in all_names(net) if n.startswith("wav2vec2.feature_projection.")]
    assert "wav2vec2.feature_extractor.conv_layers.0.layer_norm.weight" in fe  # GroupNorm
    assert len(fe) == len(net.config.conv_dim) + 2      # conv weights (no bias) + GroupNorm
    assert fp == ["wav2vec2.feature_projection.layer_norm.weight",
                  "wav2vec2.feature_projection.layer_norm.bias",
                  "wav2vec2.feature_projection.projection.weight",
                  "wav2vec2.feature_projection.projection.bias"]
    assert sorted(cnn) == sorted(fe + fp)


def test_encoder_bias(net):
    got = names(net, ["encoder_bias"])
    expected = [n for n in all_names(net) if n.startswith("wav2vec2.encoder.") and n.endswith(".bias")]
    assert got == expected
    assert "wav2vec2.encoder.layers.0.attention.q_proj.bias" in got
    assert "wav2vec2.encoder.layers.1.feed_forward.output_dense.bias" in got
    assert "lm_head.bias" not in got
    assert not any("feature_projection" in n for n in got)
    assert not any(n.endswith(".weight") for n in got)


def test_all_and_regex(net):
    assert names(net, ["all"]) == all_names(net)
    got = names(net, ["regex:attention\\.(q|k)_proj\\.weight$"])
    assert got == [n for n in all_names(net) if re.search(r"attention\.(q|k)_proj\.weight$", n)]
    assert len(got) == 2 * net.config.num_hidden_layers
    assert names(net, [{"select": "regex:^lm_head\\."}]) == ["lm_head.weight", "lm_head.bias"]


def test_default_paper_selection_union_in_model_order(net):
    got = select_parameters(net, [{"select": "layernorm"}, {"select": "cnn"}])
    got_names = [n for n, _, _ in got]
    want = set(layernorm_names(net)) | {n for n in all_names(net)
                                        if "feature_extractor." in n or "feature_projection." in n}
    assert set(got_names) == want
    assert len(got_names) == len(set(got_names))                # no duplicates
    assert got_names == [n for n in all_names(net) if n in want]  # model order
    params = dict(net.named_parameters())
    assert all(p is params[n] for n, p, _ in got)               # the live parameters


def test_first_group_wins_lr_mult(net):
    # feature_projection LayerNorm matches both groups: the first one decides its multiplier
    got = {n: m for n, _, m in select_parameters(
        net, [{"select": "layernorm", "lr_mult": 1.0}, {"select": "cnn", "lr_mult": 4.0}])}
    assert got["wav2vec2.feature_projection.layer_norm.weight"] == 1.0
    assert got["wav2vec2.feature_projection.projection.weight"] == 4.0
    assert got["wav2vec2.feature_extractor.conv_layers.0.conv.weight"] == 4.0
    assert got["wav2vec2.encoder.layer_norm.bias"] == 1.0
    got = {n: m for n, _, m in select_parameters(
        net, [{"select": "cnn", "lr_mult": 4.0}, {"select": "layernorm", "lr_mult": 1.0}])}
    assert got["wav2vec2.feature_projection.layer_norm.weight"] == 4.0
    assert got["wav2vec2.encoder.layer_norm.bias"] == 1.0
    # default multiplier 1; a bare string is a group too
    got = select_parameters(net, ["feature_projection", {"select": "layernorm", "lr_mult": 2}])
    assert {m for n, _, m in got if "feature_projection" in n} == {1.0}
    assert {m for n, _, m in got if "encoder" in n} == {2.0}


def test_param_groups_one_per_multiplier(net):
    sel = select_parameters(net, [{"select": "layernorm", "lr_mult": 1.0},
                                  {"select": "feature_extractor", "lr_mult": 4.0},
                                  {"select": "feature_projection", "lr_mult": 1.0}])
    groups = param_groups(sel, lr=2e-5)
    assert len(groups) == 2
    by_lr = {g["lr"]: g["params"] for g in groups}
    assert set(by_lr) == {2e-5, 8e-5}
    ids = lambda ps: {id(p) for p in ps}
    assert ids(by_lr[8e-5]) == ids(p for n, p, m in sel if m == 4.0)
    assert ids(by_lr[2e-5]) == ids(p for n, p, m in sel if m == 1.0)
    opt = torch.optim.AdamW(groups, lr=2e-5)   # accepted by a real optimiser
    assert sum(len(g["params"]) for g in opt.param_groups) == len(sel)


def test_unknown_selector_is_a_clear_error(net):
    with pytest.raises(ValueError, match="Unknown parameter selector 'layernorms'.*layernorm"):
        select_parameters(net, ["layernorms"])
    with pytest.raises(ValueError, match="Unknown parameter selector"):
        select_parameters(net, [{"select": "transformer"}])


def test_bad_group_entries_are_clear_errors(net):
    with pytest.raises(ValueError, match="Bad adapt_params entry"):
        select_parameters(net, [{"selector": "layernorm"}])
    with pytest.raises(ValueError, match="Bad adapt_params entry"):
        select_parameters(net, [{"select": "layernorm", "lr": 3}])
    with pytest.raises(ValueError, match="empty"):
        select_parameters(net, [])
    for bad in (-1.0, float("inf"), True, "2"):
        with pytest.raises(ValueError, match=r"lr_mult .* must be a number >= 0"):
            select_parameters(net, [{"select": "layernorm", "lr_mult": bad}])
    # 0 is a number >= 0: the group's tensors are claimed (first group wins) and kept still
    got = select_parameters(net, [{"select": "layernorm", "lr_mult": 0}, "all"])
    assert {m for n, _, m in got if n in names(net, ["layernorm"])} == {0.0}


def test_empty_selection_is_a_clear_error(net, caplog):
    with pytest.raises(ValueError, match="selects no parameter"):
        select_parameters(net, ["regex:^no_such_parameter$"])
    # a group matching nothing next to one that matches: allowed, with a warning
    with caplog.at_level(logging.WARNING, logger="tta_brain.methods.params"):
        got = select_parameters(net, ["regex:^nothing$", "layernorm"])
    assert got and "matches no parameter" in caplog.text


def test_selectors_registry_is_documented():
    assert set(SELECTORS) == {"layernorm", "feature_extractor", "feature_projection", "cnn",
                              "encoder_bias", "weights_and_biases", "all"}


def test_selection_is_clean_by_default(net):
    """Without a ``{param_collection: ...}`` entry the optimiser sees each tensor once, in model
    order (the official list: tests/test_official_optimizer.py)."""
    sel = select_parameters(net, ["layernorm", "cnn"])
    assert sel.collection == "clean"
    assert sel.order == list(range(len(sel))) and sel.repeats == [1] * len(sel)
    assert sel.entries() == list(sel)
    assert select_parameters(net, ["layernorm", "cnn", {"param_collection": "clean"}]) == sel
