"""Source models whose character vocabulary is not wav2vec2-base-960h's: tiny random
``Wav2Vec2ForCTC`` models with their own ``vocab.json`` (``save_char_processor``)."""
import pytest
import torch

from tta_brain.lobes.hf_ctc import HFCTCLobe, save_char_processor
from tta_brain.lobes.testing import TINY, save_random_ctc_model
from tta_brain.methods import build_method

#: a character vocabulary without the tokenizer's word delimiter "|" (a script written without
#: spaces; or a vocab.json whose space is " " while tokenizer_config.json keeps "|")
NO_DELIMITER = ("<pad>", "<s>", "</s>", "<unk>", " ") + tuple("的一是不了人我在有他这中大来")


def _model(path, vocab, **config):
    save_random_ctc_model(str(path), arch="wav2vec2", vocab_size=len(vocab), **dict(TINY, **config))
    save_char_processor(str(path), vocab=vocab)
    return str(path)


def _processor_text(tokenizer, frame_labels):
    """transformers' own CTC decoding of frame labels, special tokens left out (as the lobe)."""
    text = tokenizer.batch_decode(frame_labels)
    for special in set(tokenizer.all_special_tokens) - {tokenizer.pad_token}:
        text = [t.replace(special, "") for t in text]
    return [" ".join(t.split()) for t in text]


def test_a_character_vocabulary_without_its_word_delimiter_decodes(tmp_path):
    """Its tokenizer (``Wav2Vec2CTCTokenizer``) names "|" but the vocabulary has no such token:
    every decode stopped with ``AttributeError: 'dict' object has no attribute 'split'`` (it was
    taken for word pieces, whose ``convert_tokens_to_string`` returns a dict here and groups
    repeats), so every method's run stopped at its first utterance with a traceback."""
    lobe = HFCTCLobe(_model(tmp_path / "m", NO_DELIMITER))
    assert lobe.word_delimiter_id is None and not lobe.word_pieces
    # what it can write: its characters, not the letters of its blank's or specials' names
    assert lobe.alphabet() == set(NO_DELIMITER[5:])
    ids = {t: i for i, t in enumerate(NO_DELIMITER)}
    assert lobe.labels_to_text([ids["我"], ids["我"], ids[" "], ids["在"], ids["<unk>"]]) == "我我 在"
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 60, len(NO_DELIMITER), generator=g)
    logits[..., lobe.blank_id] += 1.0
    want = _processor_text(lobe.tokenizer, logits.argmax(-1))
    assert lobe.decode(logits) == want and all(want)


def test_sgems_word_lm_refuses_a_vocabulary_without_a_delimiter_in_one_line(tmp_path):
    lm = tmp_path / "lm.arpa"
    lm.write_text("\\data\\\nngram 1=1\n\n\\1-grams:\n-1.0 the\n\n\\end\\\n")
    with pytest.raises(ValueError, match=r"lm_path: the word n-gram LM needs a character "
                                         r"vocabulary with a word delimiter \('\|'\); this "
                                         r"model's vocabulary has no such token"):
        build_method("sgem", model=HFCTCLobe(_model(tmp_path / "m", NO_DELIMITER)),
                     lm_path=str(lm))


def test_a_blank_other_than_the_tokenizers_pad_token_is_warned(tmp_path, caplog):
    """config.json's pad_token_id (the blank the model was fine-tuned with by transformers'
    CTC loss) against the tokenizer's pad token (the blank of the processor's batch_decode):
    where they differ, one of the two drops a real token (here the word delimiter: one word per
    utterance); the lobe keeps config.json's, and says so (it was silent)."""
    vocab = ("|",) + tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ'") + ("<unk>", "<pad>")
    lobe = HFCTCLobe(_model(tmp_path / "last", vocab, pad_token_id=len(vocab) - 1))
    assert lobe.blank_id == len(vocab) - 1 and "pad_token_id" not in caplog.text
    ids = {t: i for i, t in enumerate(vocab)}
    assert lobe.labels_to_text([ids["A"], ids["|"], ids["B"], lobe.blank_id]) == "A B"
    src = _model(tmp_path / "mismatch", vocab, pad_token_id=0)
    with caplog.at_level("WARNING", logger="tta_brain.lobes.hf_ctc"):
        lobe = HFCTCLobe(src)
    assert lobe.blank_id == 0
    assert (f"{src}: config.json's pad_token_id 0 ('|'), the CTC blank used here, is not the "
            f"tokenizer's pad token '<pad>' (id 29)") in caplog.text


def test_references_with_characters_the_model_cannot_write_are_a_warning(tmp_path):
    """A vocabulary without ``Z``, ``Ë`` or digits scores ``ZOË`` and ``2`` as errors whatever
    any method does (a floor under the WER no adaptation lowers): the run was silent about it.
    Now one warning at the start, in the log and ``summary.json``'s ``warnings`` (the report's
    Warnings), says which characters and in how many references."""
    import csv
    import json
    from fake_corpora import write_stream
    from tta_brain import decode
    vocab = ("<pad>", "<s>", "</s>", "<unk>", "|") + tuple("ABCDEFGHIJKLMNOPQRSTUVWXY'")
    model = _model(tmp_path / "m", vocab)
    assert HFCTCLobe(model).alphabet() == set("ABCDEFGHIJKLMNOPQRSTUVWXY'")
    bytes_too = _model(tmp_path / "b", vocab + ("<0xC3>", "<0xA9>"))    # byte fallback: any
    assert HFCTCLobe(bytes_too).alphabet() is None                      # character, no check
    root = write_stream(tmp_path / "s", n=3)
    rows = list(csv.DictReader(open(root / "stream.csv")))
    for row, ref in zip(rows, ("zoë was here 2", "HE SAW IT", "don\u2019t")):
        row["wrd"] = ref
    with open(root / "stream.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    out = tmp_path / "exp"
    decode.main(["source", f"--source={model}", f"--stream_csv={root / 'stream.csv'}",
                 f"--output_folder={out}", f"--data_root={root}", "--noprogressbar"])
    want = "1 of 3 references hold characters the model cannot write (2 Z Ë)"
    assert [w for w in json.loads((out / "summary.json").read_text())["warnings"]
            if "cannot write" in w] == [want + ": each word that holds one is an error "
                                        "whatever the method"]
    assert want in (out / "log.txt").read_text()


def test_a_warning_of_unwritable_characters_shows_twelve_and_counts_the_rest():
    """TTABrain's warning lists the first 12 characters the model cannot write and counts the
    rest (a vocabulary of another script misses hundreds: one line, not all of them); twelve
    are listed whole; a lobe without an alphabet (byte fallback) is not checked (mutation
    audit: the cut at 13 passed)."""
    from types import SimpleNamespace
    from tta_brain.run.brain import TTABrain

    def warned(alphabet, *refs):
        brain = SimpleNamespace(method=SimpleNamespace(lobe=SimpleNamespace(
            alphabet=lambda: alphabet)))
        return TTABrain._unwritable(brain, [{"wrd": r} for r in refs])
    tail = ": each word that holds one is an error whatever the method"
    assert warned(set("ABC"), "ab cdefghijklmnop", "cab") == [
        "1 of 2 references hold characters the model cannot write (D E F G H I J K L M N O and 1 "
        "more)" + tail]
    assert warned(set("ABC"), "ab cdefghijklmno", "cab") == [
        "1 of 2 references hold characters the model cannot write (D E F G H I J K L M N O)"
        + tail]
    assert warned(set("ABC"), "cab") == [] and warned(None, "ab cdefghijklmnop") == []


def test_text_to_labels_spells_the_text_in_the_models_characters(tmp_path):
    """A character vocabulary of upper-case letters: lower-case text is spelled in them (its
    case is not the model's), a space is the word delimiter."""
    vocab = ("<pad>", "<s>", "</s>", "<unk>", "|") + tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ'")
    lobe = HFCTCLobe(_model(tmp_path / "m", vocab))
    ids = {t: i for i, t in enumerate(vocab)}
    assert lobe.text_to_labels("it's a cab") == [ids[c] for c in "IT'S|A|CAB"]
    assert lobe.labels_to_text(lobe.text_to_labels("it's a cab")) == "IT'S A CAB"


def test_greedy_decoding_of_one_utterance_or_a_batch(tmp_path):
    """``decode`` / ``decode_labels`` take one utterance (``[F, V]`` logits, ``[F]`` frame labels)
    as a batch of one: repeats merge, a blank between two stays two, the word delimiter is a
    space, one between words (mutation audit: a 1-D ``decode_labels`` was read as a batch of
    frames; spaces were left as the delimiters fell)."""
    vocab = ("<pad>", "<s>", "</s>", "<unk>", "|") + tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ'")
    lobe = HFCTCLobe(_model(tmp_path / "m", vocab))
    ids = {t: i for i, t in enumerate(vocab)}
    frames = torch.tensor([0, ids["A"], ids["A"], 0, ids["|"], ids["C"], 0, ids["C"], ids["A"],
                           ids["B"], ids["B"], 0])
    assert lobe.decode_labels(frames) == lobe.decode_labels(frames[None]) == ["A CCAB"]
    logits = torch.nn.functional.one_hot(frames, len(vocab)).float()
    assert lobe.decode(logits) == lobe.decode(logits[None]) == ["A CCAB"]
    assert lobe.decode(torch.stack([logits, logits.flip(0)])) == ["A CCAB", "BACC A"]
    # delimiters at either end, or two apart (a blank between): one space between words only
    d = ids["|"]
    assert lobe.decode_labels(torch.tensor([d, ids["A"], d, 0, d, ids["B"], d])) == ["A B"]


# ------------------------------------------------------------- MMS: one adapter per language
@pytest.fixture(scope="module")
def mms_dir(tmp_path_factory):
    """A tiny MMS-like checkpoint (``save_random_mms_model``): adapters and vocabularies of eng
    (the default, in model.safetensors too) and fra."""
    from tta_brain.lobes.testing import save_random_mms_model
    return save_random_mms_model(str(tmp_path_factory.mktemp("mms")))


def test_target_lang_loads_the_languages_adapter_and_vocabulary(mms_dir):
    """facebook/mms-1b-all and its kin: one wav2vec2 with an attention adapter per layer and a
    CTC head per language (``adapter.<lang>.safetensors``), vocab.json one vocabulary per
    language. ``target_lang`` loads that language's adapter (the saved tensors, the head sized
    to its vocabulary) and vocabulary; there was no way to ask for any language but the
    checkpoint's own (``HFCTCLobe`` took no such argument, run.yaml no such key)."""
    from safetensors.torch import load_file
    from tta_brain.lobes.testing import MMS_VOCABS
    eng, fra = HFCTCLobe(mms_dir), HFCTCLobe(mms_dir, target_lang="fra")
    assert (eng.target_lang, fra.target_lang) == ("eng", "fra")
    assert (eng.vocab_size, fra.vocab_size) == (len(MMS_VOCABS["eng"]), len(MMS_VOCABS["fra"]))
    for lobe, lang in ((eng, "eng"), (fra, "fra"), (HFCTCLobe(mms_dir, target_lang="eng"), "eng")):
        saved = load_file(f"{mms_dir}/adapter.{lang}.safetensors")
        assert any(".adapter_layer." in k for k in saved)
        state = lobe.model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in saved.items()), lang
        assert lobe.id_to_token == dict(enumerate(MMS_VOCABS[lang]))
    x = eng.prepare(torch.randn(8000, generator=torch.Generator().manual_seed(0)))
    with torch.no_grad():
        assert eng.logits(x).shape[-1] == 32 and fra.logits(x).shape[-1] == 36
    ids = {t: i for i, t in enumerate(MMS_VOCABS["fra"])}
    labels = [ids["\u00e7"], ids["a"], ids["|"], ids["\u00e9"]]
    assert fra.labels_to_text(labels) == "\u00e7a \u00e9"
    assert fra.alphabet() - eng.alphabet() == set("\u00c0\u00c7\u00c8\u00c9")


def test_text_to_labels_spells_the_text_in_an_mms_languages_lower_case(mms_dir):
    """MMS's vocabularies are lower case: text (a reference, upper case as the scoring writes
    it, or lower case) is spelled in the language's letters; it was upper-cased into ``<unk>``
    for every letter."""
    from tta_brain.lobes.testing import MMS_VOCABS
    fra = HFCTCLobe(mms_dir, target_lang="fra")
    ids = {t: i for i, t in enumerate(MMS_VOCABS["fra"])}
    want = [ids[c] for c in "\u00e7a|\u00e9t\u00e9"]
    upper, lower = "\u00c7A \u00c9T\u00c9", "\u00e7a \u00e9t\u00e9"
    assert fra.text_to_labels(upper) == fra.text_to_labels(lower) == want
    assert fra.labels_to_text(want) == "\u00e7a \u00e9t\u00e9"


def test_target_lang_that_the_checkpoint_has_not_is_one_line(mms_dir, tmp_path):
    """A language without a vocabulary or an adapter, a checkpoint without adapters, and an MMS
    checkpoint whose tokenizer names no language (its vocab.json then loaded as one vocabulary:
    "requires the protobuf library") are each one line naming ``target_lang`` and what there
    is."""
    import shutil
    from tta_brain.lobes.testing import save_random_mms_model
    with pytest.raises(ValueError, match=r"^target_lang: 'deu' is not a language of .*mms\w*'s "
                                         r"vocab.json \(eng, fra\)$"):
        HFCTCLobe(mms_dir, target_lang="deu")
    plain = _model(tmp_path / "plain", ("<pad>", "<s>", "</s>", "<unk>", "|") + tuple("AB"))
    assert HFCTCLobe(plain).target_lang is None
    with pytest.raises(ValueError, match=r"^target_lang: .*plain has no language adapters \(its "
                                         r"config.json sets no adapter_attn_dim\): leave "
                                         r"target_lang out$"):
        HFCTCLobe(plain, target_lang="fra")
    no_fra = shutil.copytree(mms_dir, tmp_path / "no_fra")
    (no_fra / "adapter.fra.safetensors").unlink()
    with pytest.raises(ValueError, match=r"^target_lang: .*no_fra has no adapter for 'fra' "
                                         r"\(adapter.fra.safetensors; its adapters: eng\)$"):
        HFCTCLobe(str(no_fra), target_lang="fra")
    from safetensors.torch import load_file      # an adapter saved by torch (.bin) is one
    as_bin = shutil.copytree(mms_dir, tmp_path / "as_bin")
    torch.save(load_file(as_bin / "adapter.fra.safetensors"), as_bin / "adapter.fra.bin")
    (as_bin / "adapter.fra.safetensors").unlink()
    assert HFCTCLobe(str(as_bin), target_lang="fra").vocab_size == 36
    unnamed = save_random_mms_model(str(tmp_path / "unnamed"), default=None)
    with pytest.raises(ValueError, match=r"^target_lang: .*unnamed's vocab.json holds one "
                                         r"vocabulary per language \(eng, fra\) and "
                                         r"tokenizer_config.json names none: set target_lang$"):
        HFCTCLobe(unnamed)
    assert HFCTCLobe(unnamed, target_lang="fra").vocab_size == 36


def test_decode_with_target_lang_transcribes_in_that_language(mms_dir, tmp_path):
    """``--target_lang=fra`` end to end: the run's transcripts are the fra model's (adapter and
    vocabulary), not the default eng one's, its fingerprint holds the language, and SUTA and
    DSUTA adapt the model with its adapters (their LayerNorms among LayerNorms)."""
    import csv
    import json
    from fake_corpora import write_stream
    from tta_brain import decode
    from tta_brain.asr.metrics import normalize_text
    from tta_brain.data.audio import load_audio
    root = write_stream(tmp_path / "s", n=3)
    out = tmp_path / "exp"
    decode.main(["source", f"--source={mms_dir}", "--target_lang=fra", f"--output_folder={out}",
                 f"--stream_csv={root / 'stream.csv'}", f"--data_root={root}", "--noprogressbar"])
    hyps = [r["hyp"] for r in csv.DictReader(open(out / "transcripts.csv", encoding="utf-8"))]
    wavs = [load_audio(str(root / "wav" / f"u{i:03d}.wav"), 16000) for i in range(3)]

    def transcripts(lobe):
        with torch.no_grad():
            return [normalize_text(lobe.decode(lobe.logits(lobe.prepare(w)))[0]) for w in wavs]
    fra = HFCTCLobe(mms_dir, target_lang="fra")
    assert hyps == transcripts(fra) != transcripts(HFCTCLobe(mms_dir))
    assert json.loads((out / "fingerprint.json").read_text())["hparams"]["target_lang"] == "fra"
    for name in ("suta", "dsuta"):
        method = build_method(name, model=HFCTCLobe(mms_dir, target_lang="fra"), steps=2)
        adapters = [i for i, n in enumerate(method.param_names) if ".adapter_layer.norm." in n]
        assert len(adapters) == 4, method.param_names      # 2 layers' weight and bias
        before = [method.params[i].detach().clone() for i in adapters]
        assert [normalize_text(method.process(w)) for w in wavs[:2]]
        if name == "dsuta":                                  # continual: the state it keeps
            assert all(not torch.equal(method.params[i], b) for i, b in zip(adapters, before))


def test_a_live_streams_state_of_another_language_is_refused(mms_dir, tmp_path, utterances):
    """A ``TTAStream`` state adapted on one language's adapter (the same checkpoint, the same
    adapted shapes) was loaded into a stream of another language with only a logged settings
    difference; the stream's identity holds its language."""
    import re
    from tta_brain.stream import StreamStateError, TTAStream
    ov = {"steps": 1, "buffer_size": 2}
    fra = TTAStream.from_hparams("dsuta", source=mms_dir, overrides={**ov, "target_lang": "fra"})
    fra.transcribe(utterances[0])
    state = tmp_path / "fra.pt"
    fra.save(state)
    eng = TTAStream.from_hparams("dsuta", source=mms_dir, overrides=ov)
    with pytest.raises(StreamStateError, match=re.escape(
            f"{state}: saved by another stream: target_lang 'fra' (file) != 'eng' (this stream)")):
        eng.load(state)
    again = TTAStream.from_hparams("dsuta", source=mms_dir, overrides={**ov, "target_lang": "fra"})
    again.load(state)
    assert again.position == 1
