"""The CNN's convolutions as matrix products (the run option ``convolutions: gemm``,
``tta_brain.lobes.gemm_conv``): the same convolution as torch's ``conv1d`` to rounding (values,
input / weight / bias gradients, under ``vmap`` and autocast), on every wav2vec 2.0-style model
the lobe takes (logits, padded passes, state dict), and through the methods: the same
transcripts as the native convolutions for SUTA, DSUTA + dynamic reset (host step, device step,
fake-captured on length buckets) and a batched sweep; a model without a CNN refused in one line;
the run option checked, recorded and fingerprinted (a folder decoded before it is the native
one's)."""
import copy
import io
import json
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

from conftest import max_diff
from fake_graphs import FakeBackend
from tta_brain.gpu import make_step
from tta_brain.lobes.gemm_conv import GemmConv, conv1d_gemm, feature_encoder_convs
from tta_brain.lobes.hf_ctc import HFCTCLobe
from tta_brain.lobes.runtime import Runtime
from tta_brain.lobes.testing import TINY, save_random_ctc_model
from tta_brain.methods import UttInfo, build_method
from tta_brain.methods.resets import make_reset_policy

#: wav2vec2-base's CNN layers (in, out, kernel, stride) at a short length, and one with a bias
SHAPES = [(1, 16, 10, 5, 400, False), (16, 16, 3, 2, 79, False), (16, 16, 2, 2, 9, False),
          (8, 12, 3, 2, 50, True), (4, 6, 4, 1, 20, True)]


def rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


@pytest.mark.parametrize("cin,cout,k,s,t,bias", SHAPES)
def test_conv1d_gemm_is_conv1d(cin, cout, k, s, t, bias):
    g = torch.Generator().manual_seed(k * 10 + s)
    x = torch.randn(2, cin, t, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(cout, cin, k, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(cout, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    want, got = F.conv1d(x, w, b, s), conv1d_gemm(x, w, b, s)
    assert got.shape == want.shape
    assert rel(got, want) < 1e-12                         # float64: the same sums
    up = torch.randn(want.shape, generator=g, dtype=torch.float64)
    inputs = [x, w] + ([b] if bias else [])
    for gw, gg in zip(torch.autograd.grad(want, inputs, up), torch.autograd.grad(got, inputs, up)):
        assert rel(gg, gw) < 1e-12
    # float32: to rounding; an unbatched input and a non-contiguous one as conv1d takes them
    x32, w32 = x.detach().float(), w.detach().float()
    assert rel(conv1d_gemm(x32, w32, None, s), F.conv1d(x32, w32, None, s)) < 1e-5
    assert rel(conv1d_gemm(x32[0], w32, None, s), F.conv1d(x32[0], w32, None, s)) < 1e-5
    xt = x32.transpose(0, 2).contiguous().transpose(0, 2)
    assert rel(conv1d_gemm(xt, w32, None, s), F.conv1d(x32, w32, None, s)) < 1e-5


def test_conv1d_gemm_under_vmap_and_autocast():
    """A batched sweep's runs (``vmap`` over stacked weights) give each run's convolution; under
    autocast the output's dtype is conv1d's (a float32 bias does not promote it)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 8, 60, generator=g)
    ws, b = torch.randn(4, 8, 8, 3, generator=g), torch.randn(8, generator=g)
    got = vmap(lambda w: conv1d_gemm(x, w, b, 2))(ws)
    for r in range(4):
        assert rel(got[r], F.conv1d(x, ws[r], b, 2)) < 1e-5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert conv1d_gemm(x, ws[0], b, 2).dtype == F.conv1d(x, ws[0], b, 2).dtype


ARCHS = {
    "wav2vec2-group": ("wav2vec2", dict(feat_extract_norm="group", do_stable_layer_norm=False)),
    "wav2vec2-layer-stable": ("wav2vec2", dict(feat_extract_norm="layer", do_stable_layer_norm=True,
                                               conv_bias=True)),
    "hubert": ("hubert", dict(feat_extract_norm="group")),
    "wavlm": ("wavlm", dict(feat_extract_norm="group")),
    "data2vec-audio": ("data2vec-audio", dict(num_conv_pos_embeddings=2, conv_pos_kernel_size=5,
                                              num_conv_pos_embedding_groups=2)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemm_archs")
    return {a: save_random_ctc_model(str(root / a), 0, arch=fam, **dict(TINY, **extra))
            for a, (fam, extra) in ARCHS.items()}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_cnn_model_gives_its_logits(models, arch):
    """Each model's CNN convolutions (and only those) are taken; logits, CNN features, a padded
    pass and the state dict are the native model's (to rounding); a deep copy (CoTTA's teacher,
    a method's snapshot) keeps them."""
    native = HFCTCLobe(models[arch])
    gemm = HFCTCLobe(models[arch], runtime=Runtime(convolutions="gemm"))
    convs = feature_encoder_convs(gemm.model)
    assert gemm.gemm_convs == len(convs) == len(gemm.model.config.conv_kernel)
    assert native.gemm_convs == 0
    assert all(isinstance(c, GemmConv) for c in convs)
    others = [m for m in gemm.model.modules() if isinstance(m, torch.nn.Conv1d) and m not in convs]
    assert not any(isinstance(m, GemmConv) for m in others)        # the positional convolution
    assert list(gemm.model.state_dict()) == list(native.model.state_dict())
    x = native.prepare(torch.randn(7000, generator=torch.Generator().manual_seed(1)))
    with torch.no_grad():
        assert rel(gemm(x), native(x)) < 1e-4
        assert rel(gemm.features(x), native.features(x)) < 1e-5
        if native.padding_blocker() is None:
            padded = torch.nn.functional.pad(x, (0, 900))
            samples = torch.tensor([x.shape[-1]])
            (lg, fg), (ln, fn) = (lobe.padded_logits(padded, samples) for lobe in (gemm, native))
            assert torch.equal(fg, fn)
            assert rel(lg[:, :int(fn)], ln[:, :int(fn)]) < 1e-4
    assert all(isinstance(c, GemmConv) for c in feature_encoder_convs(copy.deepcopy(gemm.model)))
    buf = io.BytesIO()           # pickled as a module (models with a weight norm pickle only
    torch.save(convs[1], buf)    # through their state dict, as torch says, gemm or not)
    buf.seek(0)
    again, h = torch.load(buf, weights_only=False), torch.randn(1, convs[1].in_channels, 40)
    assert isinstance(again, GemmConv) and torch.equal(again(h), convs[1](h))


def test_a_model_without_a_cnn_is_refused_in_one_line(tmp_path, tiny_model_dir):
    bert = save_random_ctc_model(str(tmp_path / "bert"), 0, arch="wav2vec2-bert")
    with pytest.raises(ValueError, match=r"^convolutions: gemm: Wav2Vec2BertForCTC has no "
                                         r"convolution .*no CNN feature encoder.*use "
                                         r"convolutions: native$"):
        HFCTCLobe(bert, runtime=Runtime(convolutions="gemm"))
    with pytest.raises(ValueError, match=r"^Runtime\(convolutions='GEMM'\): convolutions must "
                                         r"be one of native, gemm$"):
        Runtime(convolutions="GEMM")                  # the Python API: the runtime refuses it
    rt = Runtime()
    rt.convolutions = "GEMM"                          # changed after it was built: the lobe
    with pytest.raises(ValueError, match=r"^convolutions: 'GEMM' is not one of native, gemm$"):
        HFCTCLobe(tiny_model_dir, runtime=rt)


def test_padded_grouped_or_dilated_convolutions_are_left_native():
    """conv1d_gemm has no padding, groups or dilation: such a convolution must not be taken
    (a padded one would lose its edge frames), and a CNN of only such ones is refused."""
    from types import SimpleNamespace
    from tta_brain.lobes.gemm_conv import gemm_convolutions
    convs = [torch.nn.Conv1d(2, 2, 3, padding=1), torch.nn.Conv1d(2, 2, 3, groups=2),
             torch.nn.Conv1d(2, 2, 3, dilation=2)]
    model = torch.nn.Module()
    model.feature_extractor = torch.nn.Module()
    model.feature_extractor.conv_layers = torch.nn.ModuleList(
        [torch.nn.Module() for _ in convs])
    for layer, conv in zip(model.feature_extractor.conv_layers, convs):
        layer.conv = conv
    with pytest.raises(ValueError, match="padded, grouped or dilated"):
        gemm_convolutions(model)
    assert not any(isinstance(c, GemmConv) for c in convs)
    # a CNN converted already is converted again without a refusal (nothing left to take)
    plain = torch.nn.Conv1d(2, 2, 3)
    model.feature_extractor.conv_layers[0].conv = plain
    assert gemm_convolutions(model) == 1 and isinstance(plain, GemmConv)
    assert gemm_convolutions(model) == 0


def items(utterances, n):
    return [(utterances[i % len(utterances)], UttInfo(id=f"u{i}", position=i, domain="d",
                                                      segment=str(i // 4)))
            for i in range(n)]


def method(model_dir, name, convolutions, step=None, **runtime):
    base, _, reset = name.partition("+")
    kw = dict(lr=1e-2, steps=3)
    if base == "dsuta":
        kw["buffer_size"] = 2
    if reset:
        kw["reset_policy"] = make_reset_policy(reset, K=4, patience=1, threshold=-100.0)
    if step is not None:
        kw["make_step"] = step
    lobe = HFCTCLobe(model_dir, runtime=Runtime(convolutions=convolutions, **runtime))
    return build_method(base, model=lobe, **kw)


@pytest.mark.parametrize("name", ["suta", "dsuta+dynamic"])
def test_methods_give_the_native_transcripts(tiny_model_dir, utterances, name):
    """SUTA and DSUTA + dynamic reset (LayerNorm + CNN adapted, so the gradients run through
    every convolution): the same transcripts and resets as the native convolutions, parameters
    to rounding; and the device step, fake-captured on length buckets (the GPU's default path,
    stand-in graphs on CPU tensors), gives them too."""
    stream = items(utterances, 10)
    native, gemm = method(tiny_model_dir, name, "native"), method(tiny_model_dir, name, "gemm")
    assert gemm.lobe.gemm_convs == 3 and native.lobe.gemm_convs == 0
    want = [native.process(w, i) for w, i in stream]
    assert [gemm.process(w, i) for w, i in stream] == want
    assert max_diff(native.params, gemm.params) < 1e-4
    fresh = method(tiny_model_dir, name, "native")
    assert max_diff(native.params, [p.detach() for p in fresh.params]) > 1e-3      # it adapted
    assert [(e.kind, e.position) for e in gemm.events] == [(e.kind, e.position)
                                                           for e in native.events]
    fake = FakeBackend()
    captured = method(tiny_model_dir, name, "gemm",
                      step=partial(make_step, backend=fake, device_on_cpu=True),
                      cuda_graphs="on", cuda_graph_buckets=0.25, cuda_graph_cache=4)
    assert [captured.process(w, i) for w, i in stream] == want
    assert captured.step.buckets == 0.25 and fake.captures > 0
    assert captured.step.cache.stats["hits"] > 0
    assert max_diff(native.params, captured.params) < 1e-4


def test_batched_sweep_gives_the_separate_transcripts(tiny_model_dir, utterances, monkeypatch):
    """A batched sweep of SUTA runs on GEMM convolutions (``vmap``: one batched matrix product a
    layer) gives each run's separate transcripts on the native convolutions."""
    from tta_brain.lobes import gemm_conv
    from tta_brain.sweep import batch_for
    calls = []
    real = gemm_conv.conv1d_gemm
    monkeypatch.setattr(gemm_conv, "conv1d_gemm",
                        lambda x, w, *a: calls.append(w.shape) or real(x, w, *a))
    cfgs = [(1e-3, 3), (1e-2, 2), (3e-3, 3)]

    def build(conv, lr, steps):
        lobe = HFCTCLobe(tiny_model_dir, runtime=Runtime(convolutions=conv))
        return build_method("suta", model=lobe, lr=lr, steps=steps)
    ms = [build("gemm", *c) for c in cfgs]
    batch = batch_for(ms[0])(ms[0].lobe, ms)
    seps = [build("native", *c) for c in cfgs]
    runs = list(range(len(cfgs)))
    for w, info in items(utterances, 6):
        batch.process(runs, w, info)
        assert [v.process(w) for v in batch.views] == [m.process(w, info) for m in seps]
    for v, m in zip(batch.views, seps):
        assert max_diff(batch.values(v.r), m.params) < 1e-3
    assert len(calls) >= 6 * 3 * 3          # the batch's passes ran on them: 6 utts, 3+ passes


#: ``structure.runtime`` of every packaged yaml's fingerprint at 5bd7b42, before the option
RUNTIME_DIGEST_BEFORE = "9d56d024b0c5"


def _decode(tmp_path, model, out, *extra):
    from fake_corpora import write_stream
    from tta_brain import decode
    data = tmp_path / "data"
    if not (data / "stream.csv").exists():
        write_stream(data, n=3, block=3, seconds=(0.6, 0.8))
    return decode.main(["suta", f"--source={model}", f"--stream_csv={data / 'stream.csv'}",
                        f"--data_root={data}", f"--output_folder={tmp_path / out}",
                        "--noprogressbar", "--steps=2", *extra])


def test_decode_run_option(tmp_path, tiny_model_dir, capsys):
    """``--convolutions=gemm``: checked by the yaml rules, logged, recorded in the summary and
    the fingerprint (a native folder is another run's); a folder fingerprinted before the option
    existed is the native run's (resumed or skipped, not refused)."""
    from tta_brain.run import identity
    _decode(tmp_path, tiny_model_dir, "native")
    native = (tmp_path / "native" / "transcripts.csv").read_text()
    _decode(tmp_path, tiny_model_dir, "gemm", "--convolutions=gemm")
    assert (tmp_path / "gemm" / "transcripts.csv").read_text() == native
    summary = json.loads((tmp_path / "gemm" / "summary.json").read_text())
    assert summary["hparams"]["convolutions"] == "gemm"
    assert "convolutions: gemm: 3 CNN convolutions run as matrix products" in \
        (tmp_path / "gemm" / "log.txt").read_text()
    fp = identity.read_fingerprint(tmp_path / "native")
    assert fp["hparams"]["convolutions"] == "native"
    with pytest.raises(SystemExit, match="hparams.convolutions: 'native' != 'gemm'"):
        _decode(tmp_path, tiny_model_dir, "native", "--convolutions=gemm")   # another run's
    # as 5bd7b42 (the last code without the option) wrote it: no key, and the run block's
    # runtime digested without its reference to the key (that code's digest of it)
    del fp["hparams"]["convolutions"]
    assert fp["structure"]["runtime"] == RUNTIME_DIGEST_BEFORE
    identity.write_fingerprint(tmp_path / "native", fp)
    _decode(tmp_path, tiny_model_dir, "native")   # finished: skipped, not refused
    assert "finished with the same settings" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="convolutions = 'fast' is not valid: convolutions must "
                                         "be one of native, gemm"):
        _decode(tmp_path, tiny_model_dir, "bad", "--convolutions=fast")
    assert not (tmp_path / "bad").exists()
