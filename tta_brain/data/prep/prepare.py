"""Command line for the data preparation steps of the recipes.

Usage::

    python -m tta_brain.data.prep.prepare librispeech --root $LIBRISPEECH --out data/test_other.csv
    python -m tta_brain.data.prep.prepare corrupt --manifest data/test_other.csv --noise_dir $MS_SNSD \\
        --out data/ls_c --snrs 5 --domains AA AC BA CM GS MU NB SD TP VC --data_root data
    python -m tta_brain.data.prep.prepare streams --manifest_dir data/ls_c/manifests --snr 5 \\
        --out data/snr5 --names AC md_easy md_hard_s20 md_long --max_duration 20
    python -m tta_brain.data.prep.prepare chime3 --root $CHIME3 --out data/et05.csv --data_root $CHIME3
    python -m tta_brain.data.prep.prepare streams --manifest data/et05.csv --out data \\
        --names chime3=random
    python -m tta_brain.data.prep.prepare validate data/snr5/streams/md_easy.csv --stream

Every step skips work whose output exists with the same options and the same input *contents*
(cache records ``<output>.opts.json``, see :mod:`tta_brain.data.cache`); when something changed,
the log says what and only the outputs that depend on it are redone. Stream manifests are written
once: when a stream's options or source manifests changed and a rebuild would differ from the
existing file, rebuilding is refused unless ``--force`` is given, because experiments refer to
streams by name (the other streams are still written; the refusal names every stream that would
differ, and ``--rebuild_hint`` lets a caller such as a recipe give its own advice). Errors about
missing data exit with status 1 and a message saying what to set.
"""
import argparse
import logging
import sys
from pathlib import Path

logger = logging.getLogger("tta_brain.data.prep.prepare")

DEFAULT_STREAMS = ("md_easy", "md_hard", "md_easy_s100", "md_easy_s20", "md_hard_s100",
                   "md_hard_s20", "md_long")
#: What the refusal to overwrite differing streams advises (the recipes pass their own words).
DEFAULT_REBUILD_HINT = "use another --out, or pass --force"


def _librispeech(args):
    from .librispeech import prepare_librispeech

    prepare_librispeech(args.root, args.out, split=args.split, data_root=args.data_root)


def _corrupt(args):
    from .ms_snsd import corrupt_manifest

    corrupt_manifest(args.manifest, args.out, snrs=args.snrs, codes=args.domains,
                     noise_dir=args.noise_dir, table=args.domain_table, seed=args.seed,
                     data_root=args.data_root, source_data_root=args.source_data_root,
                     sample_rate=args.sample_rate)


def _chime3(args):
    from .chime3 import prepare_chime3

    prepare_chime3(args.root, args.out, splits=args.splits, include_ped_real=args.include_ped_real,
                   data_root=args.data_root, audio_subdir=args.audio_subdir,
                   clean_text=not args.keep_raw_text)


def _load_domains(args):
    """``({domain: rows}, {domain: source description})`` from the streams sub-command inputs."""
    from ..manifest import read_manifest
    from .noise_table import snr_tag
    from ..streams import filter_by_duration, group_by_domain

    sources = {}
    if args.manifest:
        rows = read_manifest(args.manifest)
        if not rows:             # was "stream random: random_order: no utterances", no file
            raise ValueError(f"{args.manifest}: a header but no rows (no utterance to build a "
                             f"stream of)")
        if "domain" not in rows[0]:
            raise ValueError(f"{args.manifest}: needs a 'domain' column for stream building")
        domain_rows = group_by_domain(rows)
        sources = {d: str(Path(args.manifest).resolve()) for d in domain_rows}
    else:
        suffix = f"_{snr_tag(args.snr)}.csv"
        files = sorted(Path(args.manifest_dir).glob(f"*{suffix}"))
        if not files:
            raise FileNotFoundError(f"no domain manifests *{suffix} in {args.manifest_dir}; "
                                    "run the corrupt step (stage 1) first")
        domain_rows = {}
        for f in files:
            domain_rows[f.name[:-len(suffix)]] = read_manifest(f)
            sources[f.name[:-len(suffix)]] = str(f.resolve())
    kept = {}
    for d, r in domain_rows.items():
        try:
            kept[d] = filter_by_duration(r, args.max_duration)
        except ValueError as e:           # which manifest (the utterance alone was named)
            raise ValueError(f"{sources[d]}: {e}") from None
    for d in kept:
        if len(kept[d]) < len(domain_rows[d]):
            logger.info("%s: %d of %d utterances longer than %g s left out", d,
                        len(domain_rows[d]) - len(kept[d]), len(domain_rows[d]), args.max_duration)
    return kept, sources


def _stream_overrides(args, preset):
    """Size options given on the command line that apply to ``preset``."""
    from ..streams import PRESETS

    if preset not in PRESETS:
        return {}
    keys = {"multi_domain": ("per_domain",), "md_long": ("total", "min_len", "max_len")}
    out = {k: getattr(args, k) for k in keys.get(PRESETS[preset]["kind"], ())
           if getattr(args, k) is not None}
    if args.md_long_domains and PRESETS[preset]["kind"] == "md_long":
        out["domains"] = list(args.md_long_domains)
    for family in ("md_easy", "md_hard"):
        order = getattr(args, f"{family}_order", None)
        if order and (preset == family or preset.startswith(family + "_")):
            out["order"] = list(order)
    return out


def _domains_used(preset, domain_rows, overrides):
    """Domains a stream draws from (recorded with it, so adding a domain later keeps it valid)."""
    from ..streams import PRESETS

    if preset not in PRESETS:
        return [preset]
    params = dict(PRESETS[preset], **overrides)
    if params["kind"] == "multi_domain":
        return list(params["order"])
    return sorted(params.get("domains") or domain_rows)


def _streams(args):
    from ..cache import file_sha1, save_record, why_redo
    from ..manifest import manifest_text, write_manifest
    from ..streams import MissingDomain, TooFewUtterances, build_stream, recurrence, runs

    domain_rows, sources = _load_domains(args)
    if args.names:
        names = list(args.names)
    elif args.manifest:
        names = ["random"]
    else:
        names = sorted(domain_rows) + list(DEFAULT_STREAMS)
    out_dir = Path(args.out) / "streams"
    digests = {}  # source manifest -> sha1
    refused = []  # (out_csv, why): streams that exist and whose rebuild differs
    sized = set()  # the size options some stream of --names takes
    for spec in names:
        name, _, preset = spec.partition("=")
        preset = preset or name
        overrides = _stream_overrides(args, preset)
        sized.update(overrides)
        used = _domains_used(preset, domain_rows, overrides)
        options = {"preset": preset, "seed": args.seed, "max_duration": args.max_duration,
                   "overrides": overrides, "sources": {d: sources.get(d) for d in used}}
        for src in options["sources"].values():
            if src and src not in digests:
                digests[src] = file_sha1(src)
        inputs = {src: digests[src] for src in options["sources"].values() if src}
        out_csv = out_dir / f"{name}.csv"
        why = why_redo(out_csv, options, inputs, step="streams")
        if why is None:
            logger.info("%s: up to date (same options and source manifests), skipping", out_csv)
            continue
        try:
            stream = build_stream(preset, domain_rows, seed=args.seed, **overrides)
        except MissingDomain as e:     # which stream, and where its domains come from
            raise ValueError(f"stream {name}: {e}; its noisy sets are made by `corrupt "
                             f"--domains` (the recipes' --domains)") from None
        except TooFewUtterances as e:  # what to pass instead
            kept = f" of at most {args.max_duration:g} s (--max_duration)" \
                if args.max_duration else ""
            raise ValueError(f"stream {name}: domain {e.domain!r} has {e.count} utterances"
                             f"{kept}, fewer than per_domain={e.per_domain}; "
                             f"{e.advice('--per_domain')}") from None
        except ValueError as e:        # which stream
            raise ValueError(f"stream {name}: {e}") from None
        if out_csv.is_file():
            # Streams are written once; what matters is whether the stream itself would change.
            if out_csv.read_bytes() == manifest_text(stream).encode("utf-8"):
                save_record(out_csv, "streams", options, inputs=inputs)
                logger.info("%s: %s, but a rebuild gives the same stream; record updated, "
                            "skipping", out_csv, why)
                continue
            if not args.force:
                refused.append((out_csv, why))   # all of them are named at the end
                continue
            logger.info("%s: %s; rebuilding (--force)", out_csv, why)
        write_manifest(out_csv, stream)
        save_record(out_csv, "streams", options, inputs=inputs)
        segs = runs(stream)
        logger.info("wrote stream %s: %d utterances, %d segment(s) of %d domain(s) (%s) -> %s",
                    name, len(stream), len(segs), len(used), " ".join(used), out_csv)
        distinct, mean, most = recurrence(stream)
        logger.info("%s: %d distinct clean utterances, each %.1f times on average (at most %d)",
                    name, distinct, mean, most)
    unused = [k for k in ("per_domain", "total", "min_len", "max_len")
              if getattr(args, k) is not None and k not in sized]
    if unused:      # e.g. --per_domain with only single-domain or random-order streams
        logger.warning("--%s: no stream of %s takes it (per_domain: md_easy/md_hard streams; "
                       "total, min_len, max_len: md_long); those streams are written without it",
                       " --".join(unused), " ".join(names))
    if refused:
        first, why = refused[0]
        if len(refused) == 1:
            what = f"{first} exists and a rebuild differs from it ({why})"
        else:
            names = [p.stem for p, _ in refused]
            shown = ", ".join(names) if len(names) <= 20 else \
                ", ".join(names[:10]) + f", ... ({len(names) - 10} more)"
            what = (f"{len(refused)} streams in {out_dir} exist and a rebuild differs from them "
                    f"({shown}; e.g. {first.name}: {why})")
        raise ValueError(f"{what}; streams are written once (every method must decode the same "
                         f"stream): delete {'it' if len(refused) == 1 else 'them'}, "
                         f"{args.rebuild_hint or DEFAULT_REBUILD_HINT}")


def _validate(args):
    from ..loader import STREAM_REQUIRED, load_stream
    from ..manifest import UTT_COLUMNS, read_header, validate_manifest

    failed = []
    for path in args.manifests:     # each one checked, all problems reported
        try:
            if args.stream and args.data_root:   # as decode reads it, $data_root replaced
                rows = load_stream(path, args.data_root)
            elif args.stream:       # what decode needs: ID,duration,wav,wrd (+ stream order)
                rows = validate_manifest(path, required=STREAM_REQUIRED + (
                    ("position",) if "position" in read_header(path) else ()), stream=True)
            else:                   # a corpus manifest (the prep steps' output)
                rows = validate_manifest(path, required=UTT_COLUMNS)
        except (FileNotFoundError, ValueError) as err:
            print(f"ERROR: {err}", file=sys.stderr)
            failed.append(path)
            continue
        print(f"{path}: OK, {len(rows)} rows")
    if failed:
        raise ValueError(f"{len(failed)} of {len(args.manifests)} manifest(s) failed the check")


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m tta_brain.data.prep.prepare",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    parser.add_argument("--noprogressbar", action="store_true", help="no tqdm progress bars")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("librispeech", help="LibriSpeech split -> manifest")
    p.add_argument("--root", required=True, help="folder containing LibriSpeech/<split>")
    p.add_argument("--out", required=True, help="output manifest (.csv)")
    p.add_argument("--split", default="test-other")
    p.add_argument("--data_root", default=None, help="write wav paths under it as $data_root/...")
    p.set_defaults(func=_librispeech)

    p = sub.add_parser("corrupt", help="noise-corrupted copies of a manifest (LS-C)")
    p.add_argument("--manifest", required=True, help="clean utterance manifest")
    p.add_argument("--out", required=True,
                   help="output folder (<out>/<snr>dB/<domain>/, <out>/manifests/)")
    p.add_argument("--snrs", nargs="+", type=float, default=[5.0])
    p.add_argument("--domains", nargs="+", default=None, help="domain codes (default: all)")
    p.add_argument("--noise_dir", default=None, help="MS-SNSD clone or its noise_test folder")
    p.add_argument("--domain_table", default=None,
                   help="YAML/JSON mapping code -> noise file (default: the LS-C table)")
    p.add_argument("--seed", type=int, default=666, help="seed of the Gaussian noise")
    p.add_argument("--sample_rate", type=int, default=16000)
    p.add_argument("--data_root", default=None, help="write wav paths under it as $data_root/...")
    p.add_argument("--source_data_root", default=None,
                   help="resolves $data_root in the input manifest")
    p.set_defaults(func=_corrupt)

    p = sub.add_parser("streams", help="named streams -> <out>/streams/<name>.csv")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--manifest_dir", help="folder of <domain>_<snr>dB.csv domain manifests")
    src.add_argument("--manifest", help="one manifest with a domain column (e.g. CHiME-3)")
    p.add_argument("--snr", type=float, default=5.0, help="which SNR's domain manifests to use")
    p.add_argument("--out", required=True)
    p.add_argument("--names", nargs="+", default=None,
                   help="streams to write: domain codes (single domain), presets, or "
                        "NAME=PRESET (default: every domain + all MD presets; 'random' for "
                        "--manifest)")
    p.add_argument("--seed", type=int, default=0, help="stream seed")
    p.add_argument("--max_duration", type=float, default=None,
                   help="leave out utterances longer than this (s; 0: no limit); the paper uses 20 "
                        "for LS-C")
    p.add_argument("--per_domain", type=int, default=None, help="MD-Easy/Hard size per domain")
    p.add_argument("--total", type=int, default=None, help="MD-Long length")
    p.add_argument("--min_len", type=int, default=None, help="MD-Long shortest run")
    p.add_argument("--max_len", type=int, default=None, help="MD-Long longest run")
    p.add_argument("--md_long_domains", nargs="+", default=None, help="MD-Long domains")
    p.add_argument("--md_easy_order", nargs="+", default=None,
                   help="domain order of md_easy* (default: AC CM TP AA SD)")
    p.add_argument("--md_hard_order", nargs="+", default=None,
                   help="domain order of md_hard* (default: GS MU VC BA NB)")
    p.add_argument("--force", action="store_true",
                   help="rewrite streams whose rebuild differs from the written file (refused "
                        "otherwise, naming every such stream)")
    p.add_argument("--rebuild_hint", default=None,
                   help="the advice of that refusal, for a caller with other options (the "
                        f"recipes pass theirs), after 'delete them, ' (default: "
                        f"{DEFAULT_REBUILD_HINT})")
    p.set_defaults(func=_streams)

    p = sub.add_parser("chime3", help="CHiME-3 et05 enhanced audio -> manifest")
    p.add_argument("--root", required=True, help="CHiME-3 root (contains data/)")
    p.add_argument("--out", required=True)
    p.add_argument("--splits", nargs="+", default=None, help="e.g. bus_real caf_simu")
    p.add_argument("--include_ped_real", action="store_true", help="all 8 splits")
    p.add_argument("--audio_subdir", default="data/audio/16kHz/enhanced")
    p.add_argument("--keep_raw_text", action="store_true",
                   help="keep verbalised punctuation / markers in transcripts")
    p.add_argument("--data_root", default=None, help="write wav paths under it as $data_root/...")
    p.set_defaults(func=_chime3)

    p = sub.add_parser("validate", help="check manifests")
    p.add_argument("manifests", nargs="+")
    p.add_argument("--stream", action="store_true",
                   help="check as decode reads a stream (ID,duration,wav,wrd; the order of "
                        "position/segment where present); without: a corpus manifest "
                        "(ID,duration,wav,spk_id,wrd, unique IDs)")
    p.add_argument("--data_root", default=None,
                   help="with --stream: replace $data_root as decode's --data_root does "
                        "(without: the placeholders are kept)")
    p.set_defaults(func=_validate)
    return parser


#: The widest SNR (dB) ``corrupt`` takes: float32 keeps about 144 dB between a sample and the
#: smallest change to it, so a mixture beyond that holds nothing of the weaker signal.
MAX_ABS_SNR = 150


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "seed", 0) < 0:         # numpy's generators take none (after work began)
        parser.error(f"{args.command} --seed {args.seed}: must be an integer >= 0")
    bad = [x for x in getattr(args, "snrs", None) or () if not abs(x) <= MAX_ABS_SNR]
    if bad:           # nan: every mixture NaN; 1e6: an overflow; beyond 150: float32 rounding
        parser.error(f"corrupt --snrs {bad[0]:g}: must be a number of dB from -{MAX_ABS_SNR} to "
                     f"{MAX_ABS_SNR} (beyond, the weaker signal is lost in float32 rounding)")
    limit = getattr(args, "max_duration", None)
    if limit is not None and not 0 <= limit < float("inf"):   # -1 left out every utterance
        parser.error(f"{args.command} --max_duration {limit}: must be a number of seconds >= 0 "
                     f"(0 or left out: no limit)")
    if args.command == "validate" and args.data_root is not None and not args.stream:
        parser.error("validate --data_root: read with --stream only (a corpus manifest is checked "
                     "with its placeholders kept)")      # it was silently not read
    if args.noprogressbar:
        from tta_brain.data.prep.progress import disable_progressbars
        disable_progressbars()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except (FileNotFoundError, ValueError) as err:  # data problems: a message, not a traceback
        print(f"ERROR: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
