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


def test_text_to_labels_spells_the_text_in_the_models_characters(tmp_path):
    """A character vocabulary of upper-case letters: lower-case text is spelled in them (its
    case is not the model's), a space is the word delimiter."""
    vocab = ("<pad>", "<s>", "</s>", "<unk>", "|") + tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ'")
    lobe = HFCTCLobe(_model(tmp_path / "m", vocab))
    ids = {t: i for i, t in enumerate(vocab)}
    assert lobe.text_to_labels("it's a cab") == [ids[c] for c in "IT'S|A|CAB"]
    assert lobe.labels_to_text(lobe.text_to_labels("it's a cab")) == "IT'S A CAB"
