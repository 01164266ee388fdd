#!/usr/bin/env python3
"""Train the synthetic benchmark's tiny CTC source model on clean synthetic speech (CPU).

The result is a ``transformers.Wav2Vec2ForCTC`` saved with its ``Wav2Vec2Processor`` (the exact
wav2vec2-base-960h vocabulary), so it loads through the same
``AutoModelForCTC.from_pretrained(dir)`` / ``AutoProcessor.from_pretrained(dir)`` path as
``facebook/wav2vec2-base-960h``.

Usage::

    python recipes/synthetic/train_source.py --data_root /data/synth \
        --output_dir recipes/synthetic/source_model --seed 1 --max_minutes 65

``data_root`` holds ``LibriSpeech/train-synth`` and ``LibriSpeech/test-synth`` written by
``python -m tta_brain.data.prep.synthetic corpus``. A checkpoint is written after every epoch to
``--ckpt_dir`` (default ``<output_dir>_ckpt``) and training resumes from it when rerun.
Greedy-decoded WER/CER on the test split are logged after each epoch (monitoring only: the final
model is the last epoch, no selection on test data).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import sys
import time

import numpy as np
import torch
import yaml

from tta_brain.data.audio import load_audio
from tta_brain.data.prep.librispeech import read_transcripts
from tta_brain.lobes.hf_ctc import W2V2_CHAR_VOCAB, normalize_waveforms
from tta_brain.asr.metrics import corpus_error_rate
from tta_brain.data.prep.progress import disable_progressbars, progress

# The exact vocabulary of facebook/wav2vec2-base-960h.
VOCAB = {t: i for i, t in enumerate(W2V2_CHAR_VOCAB)}
SAMPLE_RATE = 16000
log = logging.getLogger("train_source")


# ------------------------------------------------------------------------------------- data
def read_split(split_dir: str):
    """[(utt_id, flac_path, TEXT)] of a LibriSpeech-layout split (the package's reader)."""
    texts = read_transcripts(split_dir)
    if not texts:
        raise FileNotFoundError(f"no LibriSpeech-style transcripts under {split_dir}")
    return [(utt, os.path.join(split_dir, *utt.split("-")[:2], utt + ".flac"), text)
            for utt, text in sorted(texts.items())]


def load_split_audio(items):
    """[(utt_id, waveform, TEXT)] read with the package's loader (16 kHz mono float32)."""
    return [(utt, load_audio(path, SAMPLE_RATE), text) for utt, path, text in items]


def make_batches(lengths, batch_seconds: float, rng: random.Random):
    """Length-sorted buckets whose padded size stays under ``batch_seconds``; shuffled order."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    limit = batch_seconds * SAMPLE_RATE
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > limit:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(data, idx, encode):
    wavs = [normalize_waveforms(data[i][1]) for i in idx]
    lens = torch.tensor([len(w) for w in wavs])
    x = torch.zeros(len(wavs), int(lens.max()))
    for k, w in enumerate(wavs):
        x[k, : len(w)] = w  # zero padding, no attention mask (like wav2vec2-base-960h)
    labels = [torch.tensor(encode(data[i][2])) for i in idx]
    return x, lens, labels


def error_rates(refs, hyps):
    """Pooled (WER, CER) in % (the package's metric)."""
    pairs = list(zip(refs, hyps))
    return corpus_error_rate(pairs, "word"), corpus_error_rate(pairs, "char")


@torch.no_grad()
def transcribe(model, processor, data, batch_seconds=60.0):
    model.eval()
    hyps = [None] * len(data)
    for idx in make_batches([len(d[1]) for d in data], batch_seconds, random.Random(0)):
        x, _, _ = collate(data, idx, lambda t: [0])
        ids = model(x).logits.argmax(-1)
        for k, text in zip(idx, processor.batch_decode(ids)):
            hyps[k] = text
    return hyps


# ------------------------------------------------------------------------------------- model
def build_processor():
    from transformers import Wav2Vec2CTCTokenizer, Wav2Vec2FeatureExtractor, Wav2Vec2Processor
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        vocab_file = os.path.join(tmp, "vocab.json")
        with open(vocab_file, "w") as f:
            json.dump(VOCAB, f)
        tokenizer = Wav2Vec2CTCTokenizer(vocab_file, unk_token="<unk>", pad_token="<pad>",
                                         bos_token="<s>", eos_token="</s>",
                                         word_delimiter_token="|", do_lower_case=False)
    fe = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=SAMPLE_RATE, padding_value=0.0,
                                  do_normalize=True, return_attention_mask=False)
    return Wav2Vec2Processor(feature_extractor=fe, tokenizer=tokenizer)


def build_model(model_cfg):
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    cfg = Wav2Vec2Config(vocab_size=len(VOCAB), pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         **model_cfg)
    return Wav2Vec2ForCTC(cfg)


def make_encoder():
    def encode(text):
        return [VOCAB.get(c, VOCAB["<unk>"]) for c in text.upper().replace(" ", "|")]
    return encode


# ------------------------------------------------------------------------------------- main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--data_root", required=True)
    p.add_argument("--output_dir", default=os.path.join(here, "source_model"))
    p.add_argument("--config", default=os.path.join(here, "conf", "source_model.yaml"))
    p.add_argument("--ckpt_dir", default=None, help="default: <output_dir>_ckpt")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max_minutes", type=float, default=None,
                   help="wall-time budget: the schedule is shortened to fit it")
    p.add_argument("--epochs", type=int, default=None,
                   help="override train.epochs (also when resuming: re-plans the lr schedule)")
    p.add_argument("--max_train_utts", type=int, default=None, help="debug: subsample training set")
    p.add_argument("--train_split", default="train-synth")
    p.add_argument("--test_split", default="test-synth")
    p.add_argument("--log_file", default=None, help="default: <output_dir>_ckpt/train.log")
    p.add_argument("--noprogressbar", action="store_true", help="no tqdm progress bars")
    args = p.parse_args(argv)
    if args.noprogressbar:
        disable_progressbars()

    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    tcfg = cfg["train"]
    if args.epochs:
        tcfg["epochs"] = args.epochs
    ckpt_dir = args.ckpt_dir or args.output_dir.rstrip("/") + "_ckpt"
    os.makedirs(ckpt_dir, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout),
                                  logging.FileHandler(args.log_file or os.path.join(ckpt_dir, "train.log"))])
    torch.set_num_threads(int(tcfg.get("num_threads", 2)))
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    t_start = time.time()
    base = os.path.join(args.data_root, "LibriSpeech")
    train_items = read_split(os.path.join(base, args.train_split))
    if args.max_train_utts:
        train_items = random.Random(args.seed).sample(train_items, min(args.max_train_utts, len(train_items)))
    test_items = read_split(os.path.join(base, args.test_split))
    train = load_split_audio(train_items)
    test = load_split_audio(test_items)
    dev = test[: tcfg["dev_utts"]]
    train_hours = sum(len(w) for _, w, _ in train) / SAMPLE_RATE / 3600
    log.info("train %d utts (%.2f h), test %d utts; loaded in %.0f s", len(train), train_hours,
             len(test), time.time() - t_start)

    processor = build_processor()
    encode = make_encoder()
    model = build_model(cfg["model"])
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %.2fM parameters", n_params / 1e6)
    opt = torch.optim.AdamW(model.parameters(), lr=tcfg["lr"], betas=tuple(tcfg["betas"]),
                            weight_decay=tcfg["weight_decay"])
    lengths = [len(w) for _, w, _ in train]
    steps_per_epoch = len(make_batches(lengths, tcfg["batch_seconds"], random.Random(0)))
    sched = {"total_epochs": int(tcfg["epochs"])}

    def lr_factor(step):
        total = sched["total_epochs"] * steps_per_epoch
        if step < tcfg["warmup_steps"]:
            return (step + 1) / tcfg["warmup_steps"]
        prog = min(1.0, (step - tcfg["warmup_steps"]) / max(1, total - tcfg["warmup_steps"]))
        lo = tcfg["final_lr_ratio"]
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * prog))

    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    history, start_epoch, train_seconds = [], 0, 0.0
    ckpt_file = os.path.join(ckpt_dir, "last.pt")
    if os.path.isfile(ckpt_file):
        state = torch.load(ckpt_file, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.update(state["sched"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, history, train_seconds = state["epoch"], state["history"], state["train_seconds"]
        random.setstate(state["py_rng"])
        torch.set_rng_state(state["torch_rng"])
        if "np_rng" in state:  # SpecAugment's time masks (a checkpoint of before it: not saved)
            np.random.set_state(state["np_rng"])
        if args.epochs:  # an explicit --epochs re-plans the schedule of a resumed run
            sched["total_epochs"] = args.epochs
        log.info("resumed from %s after epoch %d (schedule: %d epochs)", ckpt_file, start_epoch,
                 sched["total_epochs"])

    budget = args.max_minutes * 60 if args.max_minutes else None
    epoch = start_epoch
    while epoch < sched["total_epochs"]:
        model.train()
        t0 = time.time()
        rng = random.Random(args.seed * 1000 + epoch)
        batches = make_batches(lengths, tcfg["batch_seconds"], rng)
        run_loss, n_seen = 0.0, 0
        for b, idx in enumerate(progress(batches, desc=f"epoch {epoch + 1}", leave=False)):
            x, lens, labels = collate(train, idx, encode)
            logits = model(x).logits  # [B, T, V]
            out_lens = model._get_feat_extract_output_lengths(lens).clamp(max=logits.shape[1])
            log_probs = logits.float().log_softmax(-1).transpose(0, 1)
            loss = torch.nn.functional.ctc_loss(
                log_probs, torch.cat(labels), out_lens, torch.tensor([len(l) for l in labels]),
                blank=0, reduction="mean", zero_infinity=True)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg["max_grad_norm"])
            opt.step()
            scheduler.step()
            run_loss += loss.item()
            n_seen += 1
            if (b + 1) % 100 == 0:
                log.info("epoch %d step %d/%d loss %.3f lr %.2e (%.0f s)", epoch + 1, b + 1,
                         len(batches), run_loss / n_seen, scheduler.get_last_lr()[0], time.time() - t0)
                run_loss, n_seen = 0.0, 0
        epoch += 1
        epoch_time = time.time() - t0
        train_seconds += epoch_time
        wer, cer = error_rates([d[2] for d in dev], transcribe(model, processor, dev))
        history.append(dict(epoch=epoch, dev_wer=wer, dev_cer=cer, epoch_s=epoch_time))
        log.info("epoch %d done in %.0f s: dev WER %.2f CER %.2f", epoch, epoch_time, wer, cer)
        if budget is not None:  # shorten the cosine schedule so that it ends within budget
            elapsed = time.time() - t_start
            fit = epoch + int((budget - elapsed - 120) // (epoch_time * 1.05))
            if fit < sched["total_epochs"]:
                sched["total_epochs"] = max(epoch, fit)
                log.info("time budget: schedule shortened to %d epochs", sched["total_epochs"])
        torch.save(dict(model=model.state_dict(), opt=opt.state_dict(), sched=sched,
                        scheduler=scheduler.state_dict(), epoch=epoch, history=history,
                        train_seconds=train_seconds, py_rng=random.getstate(),
                        torch_rng=torch.get_rng_state(), np_rng=np.random.get_state()),
                   ckpt_file + ".tmp")
        os.replace(ckpt_file + ".tmp", ckpt_file)

    # final evaluation on the whole test split and export
    refs = [d[2] for d in test]
    hyps = transcribe(model, processor, test)
    wer, cer = error_rates(refs, hyps)
    log.info("final clean test WER %.2f CER %.2f (%d utts)", wer, cer, len(test))
    for r, h in list(zip(refs, hyps))[:5]:
        log.info("REF: %s\nHYP: %s", r, h)
    tmp_out = args.output_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp_out, ignore_errors=True)
    model.eval()
    model.save_pretrained(tmp_out, safe_serialization=True)
    processor.save_pretrained(tmp_out)
    stamp_file = os.path.join(base, ".synthetic_stamp.json")
    data_options = json.load(open(stamp_file))["options"] if os.path.isfile(stamp_file) else None
    info = dict(seed=args.seed, data_options=data_options, epochs=epoch,
                train_utts=len(train), train_hours=round(train_hours, 3),
                test_split=args.test_split, test_utts=len(test),
                clean_test_wer=round(wer, 2), clean_test_cer=round(cer, 2),
                n_params=n_params, train_minutes=round(train_seconds / 60, 1),
                config=cfg, history=history, torch=torch.__version__,
                transformers=__import__("transformers").__version__)
    with open(os.path.join(tmp_out, "training_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    shutil.rmtree(args.output_dir, ignore_errors=True)
    os.replace(tmp_out, args.output_dir)
    log.info("saved to %s (%.1f min total)", args.output_dir, (time.time() - t_start) / 60)


if __name__ == "__main__":
    main()
