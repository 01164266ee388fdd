"""Shared fixtures: tiny *real* Hugging Face CTC models written with ``save_pretrained``."""
import os
import sys

import pytest
import torch

from tta_brain.lobes.hf_ctc import save_char_processor

# Tiny models on a shared 2-core machine: one thread avoids oversubscription (20-50x slowdowns),
# also in the recipe subprocesses the tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def save_ctc_model(out_dir, seed=0, norm="group", hidden=32, layers=2, **config_overrides):
    """A randomly initialised Wav2Vec2ForCTC + processor (wav2vec2-base-960h vocabulary)."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(seed)
    cfg = dict(vocab_size=32, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
               intermediate_size=2 * hidden, conv_dim=(16, 16, 16), conv_kernel=(10, 8, 8),
               conv_stride=(5, 8, 8), feat_extract_norm=norm, num_conv_pos_embeddings=16,
               num_conv_pos_embedding_groups=2, pad_token_id=0, layerdrop=0.0,
               mask_time_prob=0.0, do_stable_layer_norm=False)
    cfg.update(config_overrides)
    model = Wav2Vec2ForCTC(Wav2Vec2Config(**cfg))
    model.save_pretrained(out_dir)
    save_char_processor(out_dir, attention_mask=(norm == "layer"))
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_ctc_model(str(tmp_path_factory.mktemp("tiny_w2v2")))


@pytest.fixture
def tiny_lobe(tiny_model_dir):
    from tta_brain.lobes.hf_ctc import HFCTCLobe
    return HFCTCLobe(tiny_model_dir)


@pytest.fixture(scope="session")
def utterances():
    """A few deterministic 'speech-like' waveforms (AM tones + noise), 16 kHz, 0.5-1.2 s."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i, sec in enumerate((0.8, 1.2, 0.5, 1.0, 0.7, 0.9)):
        n = int(16000 * sec)
        tt = torch.arange(n) / 16000
        f0 = 120 + 30 * i
        env = 0.5 * (1 + torch.sin(2 * torch.pi * 3 * tt))
        wav = env * sum(torch.sin(2 * torch.pi * f0 * h * tt) / h for h in (1, 2, 3))
        out.append((0.3 * wav + 0.05 * torch.randn(n, generator=g)).float())
    return out
