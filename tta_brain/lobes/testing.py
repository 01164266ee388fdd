"""Randomly initialised Hugging Face CTC models with the wav2vec2-base-960h character processor
(Wav2Vec2-BERT: its 80-bin filterbank feature extractor with that tokenizer; Parakeet CTC: its
mel feature extractor and a SentencePiece-style tokenizer, as NVIDIA's checkpoints), written with
``save_pretrained``: the tiny (and real-size) models of the tests and the benchmarks.
Nothing is downloaded; a model is the same for the same seed and config."""
import os
from typing import Optional

__all__ = ["save_random_ctc_model", "save_random_mms_model", "TINY", "TINY_BERT", "TINY_SEWD",
           "TINY_PARAKEET", "TINY_MMS", "MMS_VOCABS", "BASE_960H", "ARCHS", "PIECES"]

#: A tiny wav2vec2 (31 k parameters): 3 CNN layers of 16 channels, 2 transformer layers of 32.
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            conv_dim=(16, 16, 16), conv_kernel=(10, 8, 8), conv_stride=(5, 8, 8),
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, layerdrop=0.0,
            mask_time_prob=0.0)
#: :data:`TINY` with one strided adapter layer after the encoder (``add_adapter``): the CTC head
#: reads half the encoder's frames.
TINY_ADAPTER = dict(TINY, add_adapter=True, output_hidden_size=32, adapter_stride=2,
                    adapter_kernel_size=3, num_adapter_layers=1)
#: facebook/wav2vec2-base-960h's config.json (architecture fields): 94.4 M parameters.
BASE_960H = dict(
    hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
    hidden_act="gelu", conv_dim=(512,) * 7, conv_kernel=(10, 3, 3, 3, 3, 2, 2),
    conv_stride=(5, 2, 2, 2, 2, 2, 2), conv_bias=False, feat_extract_norm="group",
    feat_extract_activation="gelu", do_stable_layer_norm=False, num_conv_pos_embeddings=128,
    num_conv_pos_embedding_groups=16, layer_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    hidden_dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, feat_proj_dropout=0.1,
    final_dropout=0.1, layerdrop=0.1, mask_time_prob=0.05, apply_spec_augment=True,
    ctc_loss_reduction="sum")
#: Architectures by name: (config class, CTC model class) in ``transformers``.
ARCHS = {"wav2vec2": ("Wav2Vec2Config", "Wav2Vec2ForCTC"),
         "hubert": ("HubertConfig", "HubertForCTC"),
         "data2vec-audio": ("Data2VecAudioConfig", "Data2VecAudioForCTC"),
         "wavlm": ("WavLMConfig", "WavLMForCTC"),
         "unispeech-sat": ("UniSpeechSatConfig", "UniSpeechSatForCTC"),
         "sew": ("SEWConfig", "SEWForCTC"),
         "sew-d": ("SEWDConfig", "SEWDForCTC"),
         "wav2vec2-conformer": ("Wav2Vec2ConformerConfig", "Wav2Vec2ConformerForCTC"),
         "wav2vec2-bert": ("Wav2Vec2BertConfig", "Wav2Vec2BertForCTC"),
         "parakeet": ("ParakeetCTCConfig", "ParakeetForCTC")}
#: A tiny Wav2Vec2-BERT (filterbank input: 80 mel bins stacked in pairs, as w2v-BERT 2.0's
#: SeamlessM4T processor), 2 conformer layers of 32; ``add_adapter=True`` adds w2v-BERT 2.0 CTC
#: fine-tunes' strided adapter.
TINY_BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 output_hidden_size=32, conv_depthwise_kernel_size=3, feature_projection_input_dim=160,
                 num_adapter_layers=1, adapter_kernel_size=3, adapter_stride=2, layerdrop=0.0,
                 mask_time_prob=0.0)

#: A tiny SEW-D (TINY's CNN; disentangled attention over 16 relative position buckets).
TINY_SEWD = dict(TINY, squeeze_factor=1, max_position_embeddings=64, position_buckets=16)
#: A tiny Parakeet CTC (FastConformer: 3 strided 2-D convolutions over 80 mel bins, 8x
#: subsampling, 2 conformer layers of 32 with batch norm in their convolution modules), without
#: dropout; its encoder config (``ParakeetCTCConfig(encoder_config=...)``).
TINY_PARAKEET = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, subsampling_conv_channels=8, conv_kernel_size=9,
                     dropout=0.0, dropout_positions=0.0, layerdrop=0.0, activation_dropout=0.0,
                     attention_dropout=0.0)
#: The tiny Parakeet's SentencePiece-style vocabulary (lower case, ``▁`` starts a word, a
#: few pieces of two or more characters; ``<pad>``, the CTC blank, last, as in
#: nvidia/parakeet-ctc-*) and the BPE merges that make its longer pieces.
PIECES = (("<unk>", "\u2581") + tuple("abcdefghijklmnopqrstuvwxyz'")
          + ("th", "\u2581th", "\u2581a", "er", "<pad>"))
_MERGES = (("t", "h"), ("\u2581", "th"), ("\u2581", "a"), ("e", "r"))


def _save_piece_processor(out_dir: str):
    """A ``ParakeetProcessor`` (mel features; a fast BPE tokenizer over :data:`PIECES` with
    SentencePiece's word marker, its CTC blank the pad token) saved into ``out_dir``."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {piece: i for i, piece in enumerate(PIECES)}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=list(_MERGES), unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    bpe.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer = transformers.ParakeetTokenizerFast(tokenizer_object=bpe, unk_token="<unk>",
                                                   pad_token="<pad>")
    transformers.ParakeetProcessor(feature_extractor=transformers.ParakeetFeatureExtractor(),
                                   tokenizer=tokenizer).save_pretrained(out_dir)


def save_random_ctc_model(out_dir: str, seed: int = 0, arch: str = "wav2vec2",
                          attention_mask: Optional[bool] = None, **config) -> str:
    """``<arch>ForCTC`` with ``config`` (vocabulary of 32 characters, blank 0; ``parakeet``: the
    pieces of :data:`PIECES`, blank last, ``config`` its encoder's), initialised after
    ``torch.manual_seed(seed)``, saved with its processor into ``out_dir``; returns ``out_dir``.
    The processor returns an attention mask for layer-norm feature encoders unless
    ``attention_mask`` says otherwise. The caller's random state is left as it was."""
    import torch

    with torch.random.fork_rng(devices=[]):
        return _save_random_ctc_model(out_dir, seed, arch, attention_mask, **config)


def _save_random_ctc_model(out_dir, seed, arch, attention_mask, **config):
    import torch
    import transformers

    from tta_brain.lobes.hf_ctc import W2V2_CHAR_VOCAB, save_char_processor
    cfg_cls, model_cls = ARCHS[arch]
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(seed)
    if arch == "parakeet":          # ``config``: the encoder's; the blank is the last class
        cfg = transformers.ParakeetCTCConfig(vocab_size=len(PIECES), pad_token_id=len(PIECES) - 1,
                                             encoder_config=config)
        transformers.ParakeetForCTC(cfg).save_pretrained(out_dir)
        _save_piece_processor(out_dir)
        return out_dir
    cfg = dict(vocab_size=len(W2V2_CHAR_VOCAB), pad_token_id=0)
    cfg.update(config)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**cfg))
    model.save_pretrained(out_dir)
    if attention_mask is None:
        attention_mask = cfg.get("feat_extract_norm") == "layer"
    processor = save_char_processor(out_dir, attention_mask=attention_mask)
    if model.main_input_name == "input_features":      # w2v-BERT 2.0's processor: 80-bin fbank
        fbank = transformers.SeamlessM4TFeatureExtractor(
            feature_size=80, num_mel_bins=80, sampling_rate=16000, stride=2, padding_value=1.0)
        transformers.Wav2Vec2BertProcessor(feature_extractor=fbank,
                                           tokenizer=processor.tokenizer).save_pretrained(out_dir)
    return out_dir


#: A tiny MMS (facebook/mms-1b-all's layout: a stable-layer-norm wav2vec2 with an attention
#: adapter in every transformer layer, ``adapter_attn_dim``; layer-norm CNN).
TINY_MMS = dict(TINY, do_stable_layer_norm=True, feat_extract_norm="layer", adapter_attn_dim=8)
_MMS_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>", "|")
#: The tiny MMS's vocabularies, one per language (lower-case letters, as MMS's): of two sizes.
MMS_VOCABS = {"eng": _MMS_SPECIALS + tuple("abcdefghijklmnopqrstuvwxyz'"),
              "fra": _MMS_SPECIALS + tuple("abcdefghijklmnopqrstuvwxyz'\u00e0\u00e7\u00e8\u00e9")}


def save_random_mms_model(out_dir: str, seed: int = 0, default: Optional[str] = "eng",
                          vocabs: Optional[dict] = None, **config) -> str:
    """A randomly initialised MMS-like ``Wav2Vec2ForCTC`` (:data:`TINY_MMS` with ``config``)
    saved into ``out_dir`` as MMS's checkpoints are: one adapter file per language of ``vocabs``
    (:data:`MMS_VOCABS`; ``adapter.<lang>.safetensors``: every layer's attention adapter and a
    CTC head of that language's vocabulary size, random), ``model.safetensors`` holding the
    ``default`` language's adapter, a vocab.json of one vocabulary per language and a tokenizer
    whose ``target_lang`` is ``default`` (None: none, a checkpoint that must be told its
    language). The caller's random state is left as it was; returns ``out_dir``."""
    import json

    import torch
    import transformers
    from safetensors.torch import save_file

    vocabs = dict(vocabs or MMS_VOCABS)
    first = default or next(iter(vocabs))
    os.makedirs(out_dir, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cfg = transformers.Wav2Vec2Config(**dict(TINY_MMS, vocab_size=len(vocabs[first]),
                                                  pad_token_id=0, **config))
        model = transformers.Wav2Vec2ForCTC(cfg)
        for lang, vocab in vocabs.items():
            weights = {k: torch.randn(p.shape) * 0.5 for k, p in model._get_adapters().items()
                       if not k.startswith("lm_head.")}
            weights["lm_head.weight"] = torch.randn(len(vocab), cfg.hidden_size) * 0.5
            weights["lm_head.bias"] = torch.randn(len(vocab)) * 0.5
            save_file(weights, os.path.join(out_dir, f"adapter.{lang}.safetensors"))
            if lang == first:
                model.load_state_dict(weights, strict=False)
    model.save_pretrained(out_dir)
    vocab_file = os.path.join(out_dir, "vocab.json")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump({lang: {t: i for i, t in enumerate(v)} for lang, v in vocabs.items()}, f,
                  ensure_ascii=False)
    tok = transformers.Wav2Vec2CTCTokenizer(vocab_file, target_lang=first)
    fe = transformers.Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000,
                                               padding_value=0.0, do_normalize=True,
                                               return_attention_mask=True)
    transformers.Wav2Vec2Processor(feature_extractor=fe, tokenizer=tok).save_pretrained(out_dir)
    if default is None:           # tokenizer_config.json without a language
        path = os.path.join(out_dir, "tokenizer_config.json")
        with open(path, encoding="utf-8") as f:
            tok_cfg = json.load(f)
        tok_cfg.pop("target_lang", None)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(tok_cfg, f, indent=2)
    return out_dir
