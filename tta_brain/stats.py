"""Compute source statistics (``tta_brain.methods.source_stats``) into one file::

    python -m tta_brain.stats --source <model> [--target_lang LANG] --manifest <clean csv> \\
        [--data_root DIR] --kinds fisher --out <file> [--max_utts N] [--device cpu] \\
        [--key=value ...]

Use clean speech that is in no test stream (the recipes render or name such a set). Extra
``--key=value`` options go to the kinds (``--params=layernorm,cnn``: the parameters whose Fisher
information is kept). Errors are one line naming the file or option.
"""
import argparse
import os
import sys

from tta_brain.methods import source_stats as ss


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m tta_brain.stats", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="HF CTC checkpoint: directory or hub name")
    p.add_argument("--target_lang", default="", help="a checkpoint with language adapters "
                   "(MMS): the language whose adapter and vocabulary load (decode's target_lang)")
    p.add_argument("--manifest", required=True, help="clean manifest (ID,duration,wav,...)")
    p.add_argument("--data_root", default="", help="replaces $data_root in the wav paths")
    p.add_argument("--kinds", default="fisher", help="comma/space separated kinds: fisher "
                   "(eata), hidden (foa; ebats with tokens), tokens (ebats)")
    p.add_argument("--out", required=True, type=os.path.expanduser,
                   help="the statistics file to write")
    p.add_argument("--max_utts", type=int, default=0, help="first N utterances (0: all)")
    p.add_argument("--max_duration", type=float, default=20.0, help="longer ones are left out")
    p.add_argument("--device", default="cpu")
    p.add_argument("--reuse", action="store_true",
                   help="keep --out when it holds these kinds and options of this model on this "
                        "manifest's content and these audio files (paths and sizes)")
    args, extra = p.parse_known_args(argv)
    if not args.max_duration > 0:
        p.error(f"--max_duration {args.max_duration}: must be > 0 seconds")
    if os.path.isdir(args.out):             # before the statistics are computed, not after
        p.error(f"--out {args.out}: is a folder; it names the statistics file")
    options = {}
    for a in extra:
        key, eq, value = a[2:].partition("=") if a.startswith("--") else ("", "", "")
        if not key or not eq:
            p.error(f"unrecognized argument {a!r} (kind options are --key=value)")
        options[key] = value
    return args, options


def main(argv=None) -> int:
    args, options = parse_args(argv)
    kinds = [k for k in args.kinds.replace(",", " ").split() if k]
    if args.reuse and (why := current(args, kinds, options)) is None:
        print(f"{args.out}: up to date (same manifest content, audio files, model, kinds and "
              f"options), kept")
        return 0
    if args.reuse:
        print(f"{args.out}: {why}, computing")
    try:
        from tta_brain.hparams import check_device
        check_device(args.device)           # decode's one line for a device this machine lacks
        record = ss.compute(args.source, args.manifest, kinds, data_root=args.data_root,
                            max_utts=args.max_utts, device=args.device,
                            max_duration=args.max_duration, options=options,
                            target_lang=args.target_lang)
    except (ss.SourceStatsError, ValueError, OSError, RuntimeError) as e:
        print(f"ERROR: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    try:
        ss.save(record, args.out)
    except OSError as e:
        print(f"ERROR: cannot write {args.out}: {e.strerror} (--out)", file=sys.stderr)
        return 1
    sizes = ", ".join(f"{k}: {len(v)} tensors" for k, v in record.stats.items())
    print(f"{args.out}: {sizes} from {record.n_utts} utterances of {args.manifest} "
          f"(model {record.model})")
    return 0


def current(args, kinds, options):
    """None when ``--out`` holds ``kinds`` computed with these inputs and options, else why not."""
    from tta_brain.data.cache import file_sha1, same_source, source_identity
    if not os.path.isfile(args.out):
        return "no file yet"
    try:
        rec = ss.load(args.out)
    except ss.SourceStatsError as e:
        return str(e)
    if not os.path.isfile(args.manifest) or rec.manifest_sha1 != file_sha1(args.manifest):
        return "another manifest content"
    if not same_source(rec.model, source_identity(args.source)):
        return "another model"
    if rec.target_lang != (args.target_lang or ""):
        return "another language (--target_lang)"
    if set(kinds) - set(rec.kinds) or rec.options != options:
        return "other kinds or options"
    try:
        rows = ss.clean_rows(args.manifest, args.data_root, args.max_utts, args.max_duration)
    except (ValueError, OSError):           # computing says what is wrong with it, in one line
        return "the manifest cannot be read"
    if rec.n_utts != len(rows):
        return "another number of utterances"
    if rec.audio_sha1 != ss.audio_sha1(rows):   # another --data_root, --max_duration, or older
        return ("other audio files (--data_root, --max_duration)" if rec.audio_sha1
                else "no record of its audio files (made by an older tta_brain)")
    return None


if __name__ == "__main__":
    sys.exit(main())
