"""Noise-corrupted copies of a speech manifest (LS-C: LibriSpeech test-other + MS-SNSD noises).

The domain table is data: a mapping ``code -> noise file name`` (relative to the noise folder),
where ``None`` (or ``"gaussian"``) means white Gaussian noise generated per utterance. The LS-C
table is :data:`LS_C_NOISES` (files of MS-SNSD's ``noise_test/`` folder); other recipes (e.g. the
synthetic one) pass their own table, as a dict or a YAML/JSON file, and their own noise folder.

Output layout, for each domain code and SNR::

    <out>/<snr>dB/<code>/<source ID>.wav
    <out>/manifests/<code>_<snr>dB.csv     ID,duration,wav,spk_id,wrd,domain,snr,source_id

Manifest IDs are ``<source ID>_<code>`` so that a multi-domain stream has distinct IDs; the
original ID is kept in ``source_id``. Mixing follows :func:`tta_brain.data.mixing.mix_at_snr`
(both at -25 dBFS, noise tiled from offset 0, true power SNR). Gaussian noise is seeded per
utterance from ``seed`` and the source ID, so files are reproducible one by one and the same
noise signal is used at every SNR.

Reruns are content keyed (:func:`corrupt_manifest`): a domain is remixed when its noise file's
content, a mixing option or the mixing code changed, one utterance when its speech file changed;
everything else is kept, and the log says what was redone and why. After an interrupted run,
every utterance that run was to (re)mix is mixed again, including those it had written before the
interruption: the cache record lists what was pending, not what got finished, and a file on disk
may still be one made from the inputs before the change. Mixing is deterministic, so a file the
interrupted run had finished is rewritten with the same bytes.
"""
import logging
import os
import time
from pathlib import Path

import numpy as np

from ..cache import (HASH_CACHE_NAME, HashCache, as_stored, load_record, option_changes,
                    record_path, save_record, short)
from ..manifest import manifest_text, read_with_columns, to_placeholder, write_manifest
from .noise_table import GAUSSIAN_NAMES, find_noise_dir, load_domain_table, noise_path, snr_tag

logger = logging.getLogger(__name__)

DEFAULT_SEED = 666  # the seed of the official preprocessing script
#: Version of the mixing recipe (:func:`~tta_brain.data.mixing.mix_at_snr`, tiling, Gaussian
#: noise). Bump it when that code changes: every existing mixture is then remade.
MIX_VERSION = 1


def manifest_path(out_dir, code, snr):
    """``<out>/manifests/<code>_<snr>dB.csv``."""
    return Path(out_dir) / "manifests" / f"{code}_{snr_tag(snr)}.csv"


#: The columns a manifest to corrupt needs (spk_id and others are copied when present).
MIX_COLUMNS = ("ID", "duration", "wav", "wrd")


def mixture_path(out_dir, code, snr, source_id):
    """``<out>/<snr>dB/<code>/<source ID>.wav``."""
    return Path(out_dir) / snr_tag(snr) / code / f"{source_id}.wav"


def domain_rows(rows, code, out_dir, snr, data_root=None):
    """The manifest rows of one domain and SNR for the source ``rows`` (no audio is touched)."""
    # the folder is resolved once (resolving 3,000 file paths per domain costs seconds)
    wav_dir = to_placeholder(mixture_path(out_dir, code, snr, "x").parent, data_root)
    if wav_dir.endswith("/."):  # the folder is data_root itself
        wav_dir = wav_dir[:-2]
    return [{
        "ID": f"{row['ID']}_{code}",
        "duration": row["duration"],
        "wav": f"{wav_dir}/{row['ID']}.wav",
        "spk_id": row.get("spk_id", ""),
        "wrd": row["wrd"],
        "domain": code,
        "snr": snr_tag(snr)[:-2],
        "source_id": row["ID"],
    } for row in rows]


def _silent_noise(lead, noise_file, code, rows, sample_rate, speech_file=None, n=None):
    """The one-line error for a noise that is silent where it is mixed (see corrupt_domain);
    ``lead``: its silent samples at the start (None: silent throughout)."""
    where = f"{noise_file} (noise of domain {code})" if noise_file else f"the noise of domain {code}"
    advice = f"or leave {code} out of --domains"
    if lead is None:
        return ValueError(f"{where}: silent (all-zero), it cannot be mixed at an SNR; replace the "
                          f"file, {advice}")
    short = sum(1 for r in rows if float(r.get("duration") or 0) * sample_rate <= lead)
    return ValueError(f"{where}: silent for its first {lead / sample_rate:.2f} s ({lead} samples), "
                      f"the part mixed into an utterance no longer than that (noise is taken from "
                      f"offset 0; here {speech_file}, {n / sample_rate:.2f} s; {short} of the "
                      f"{len(rows)} utterances are that short by their manifest duration), which "
                      f"then cannot be set to an SNR; trim the silence from the start of the "
                      f"file, {advice}")


def corrupt_domain(rows, code, noise, out_dir, snr, seed=DEFAULT_SEED, data_root=None,
                   sample_rate=16000, overwrite=False, only=None, noise_file=None):
    """Write the corrupted copies of ``rows`` for one domain and SNR; returns the manifest rows.

    ``rows`` have resolved ``wav`` paths. ``noise`` is a 1-D noise signal, or ``None`` for white
    Gaussian noise; ``noise_file`` names it in errors. Which files are written: those whose source
    ID is in ``only`` when it is given, else every file with ``overwrite``, else the missing ones.

    A silent (all-zero) speech file is an error naming it; so is a noise that is silent where it
    is mixed (all of it, or, as the noise is taken from offset 0, a silent start at least as long
    as the utterance): that error names the noise file, not the speech.
    """
    from tta_brain.data.prep.progress import progress

    from ..audio import load_audio, write_audio
    from ..mixing import gaussian_noise, mix_at_snr, utterance_seed

    # the noise is tiled from offset 0: an utterance of n samples gets a silent noise iff n is at
    # most the noise's silent start (``lead``)
    lead = None if noise is None or not np.any(noise) else int(np.flatnonzero(noise)[0])
    if noise is not None and lead is None:
        raise _silent_noise(None, noise_file, code, rows, sample_rate)

    def needed(row):
        if only is not None:
            return row["ID"] in only
        return overwrite or not mixture_path(out_dir, code, snr, row["ID"]).is_file()

    work = [row for row in rows if needed(row)]
    for i, row in enumerate(progress(work, desc=f"{code} {snr:g} dB", leave=False)):
        src_id = row["ID"]
        speech = load_audio(row["wav"], sample_rate)
        if noise is None:
            signal = gaussian_noise(speech.numel(), utterance_seed(seed, src_id))
        else:
            signal = noise
        speech = speech.numpy()
        if not np.any(speech):          # a silent utterance has no SNR: say which one
            raise ValueError(f"{row['wav']} (ID {src_id}, {code} at {snr:g} dB): cannot normalise "
                             f"a silent (all-zero) signal; remove it from the manifest")
        if lead is not None and speech.size <= lead:
            raise _silent_noise(lead, noise_file, code, rows, sample_rate, row["wav"], speech.size)
        mixed = mix_at_snr(speech, signal, float(snr))
        write_audio(mixture_path(out_dir, code, snr, src_id), mixed, sample_rate)
        if (i + 1) % 500 == 0:
            logger.info("%s %s: %d/%d", code, snr_tag(snr), i + 1, len(work))
    return domain_rows(rows, code, out_dir, snr, data_root)


def _audio_changes(old, new, old_options, options):
    """Phrases for the differences between two ``audio`` content keys (see corrupt_manifest)."""
    out = []
    if old.get("noise_sha1") != new.get("noise_sha1") or old.get("kind") != new.get("kind"):
        old_name = old_options.get("noise") if old.get("kind") == "file" else "gaussian"
        new_name = options.get("noise") if new.get("kind") == "file" else "gaussian"
        if old.get("kind") == new.get("kind") == "file" and old_name == new_name:
            out.append(f"noise {new_name} changed (sha1 {short(old.get('noise_sha1'))} -> "
                       f"{short(new.get('noise_sha1'))})")
        else:
            def label(name, digest):
                return name if digest is None else f"{name} sha1 {short(digest)}"
            out.append(f"noise changed ({label(old_name, old.get('noise_sha1'))} -> "
                       f"{label(new_name, new.get('noise_sha1'))})")
    if old.get("mix_version") != new.get("mix_version"):
        out.append(f"mixing code changed (version {old.get('mix_version')} -> "
                   f"{new.get('mix_version')})")
    for key in ("snr", "sample_rate", "seed"):
        if key in old and key in new and old[key] != new[key]:
            out.append(f"{key} changed ({old[key]} -> {new[key]})")
    return out or ["content key changed"]


def _plan_domain(record, options, audio, speech, speech_paths, wav_of):
    """``(source IDs to (re)mix, reasons)`` for one domain/SNR given its cache ``record``."""
    ids = list(speech)
    old_audio = record.get("audio") or {}
    if old_audio != as_stored(audio):
        return set(ids), _audio_changes(old_audio, audio, record.get("options") or {}, options)
    old_speech = record.get("speech") or {}
    changed = [i for i in ids if i in old_speech and old_speech[i] != speech[i]]
    added = [i for i in ids if i not in old_speech]
    removed = [i for i in old_speech if i not in speech]
    todo = set(changed) | set(added)
    unfinished = [i for i in ids if i in set(record.get("pending") or ()) and i not in todo]
    todo |= set(unfinished)
    missing = [i for i in ids if i not in todo and not os.path.isfile(wav_of(i))]
    todo |= set(missing)
    reasons = []
    if changed:
        i = changed[0]
        change = f"sha1 {short(old_speech[i])} -> {short(speech[i])}"
        reasons.append(f"speech {speech_paths[i]} changed ({change})" if len(changed) == 1 else
                       f"{len(changed)} speech files changed (e.g. {speech_paths[i]}: {change})")
    if added:
        reasons.append(f"{len(added)} new utterance(s) (e.g. {added[0]})")
    if unfinished:
        reasons.append(f"{len(unfinished)} utterance(s) pending in an interrupted run")
    if missing:
        reasons.append(f"{len(missing)} mixture file(s) missing (e.g. {wav_of(missing[0])})")
    if removed:
        reasons.append(f"{len(removed)} utterance(s) no longer in the source manifest (e.g. "
                       f"{removed[0]}; their mixture files are left on disk)")
    return todo, reasons


def _source_rows(manifest, source_data_root=None):
    """The rows of the source ``manifest`` to mix (``$data_root`` resolved with
    ``source_data_root``); a missing column, a path still holding a placeholder, a repeated ID
    or an ID that is no plain file name (a mixture is ``<ID>.wav``) is one error naming
    ``<file>:<line>``."""
    rows, lines = read_with_columns(manifest, MIX_COLUMNS, replacements={
        "data_root": source_data_root} if source_data_root else None)
    first = {}
    for line, row in zip(lines, rows):
        if row["wav"].startswith("$"):
            raise ValueError(f"{manifest}:{line}: {row['wav']!r} uses a placeholder; pass the "
                             "folder it stands for (--source_data_root)")
        if row["ID"] in first:
            raise ValueError(f"{manifest}:{line}: duplicate ID {row['ID']!r} (first at line "
                             f"{first[row['ID']]}; mixtures are named by ID)")
        if not row["ID"] or row["ID"] in (".", "..") or "/" in row["ID"] or "\\" in row["ID"]:
            raise ValueError(f"{manifest}:{line}: ID {row['ID']!r}: a mixture is the file "
                             "<ID>.wav in its domain's folder, so an ID must be a plain file name "
                             "(no / or \\, not . or ..)")
        first[row["ID"]] = line
    return rows


def _content(manifest, rows, noise_files, out_dir):
    """``({ID: sha1 of its speech}, {ID: speech path}, {code: sha1 of its noise file or None})``,
    the hashes cached in ``<out_dir>/.sha1_cache.json``; a missing speech file is one
    FileNotFoundError naming the manifest and the ID."""
    started = time.perf_counter()
    hashes = HashCache(Path(out_dir) / HASH_CACHE_NAME)
    speech, speech_paths = {}, {}
    for row in rows:
        try:
            speech[row["ID"]] = hashes.sha1(row["wav"])
        except FileNotFoundError:
            raise FileNotFoundError(f"{manifest}: audio of {row['ID']} not found: "
                                    f"{row['wav']}") from None
        speech_paths[row["ID"]] = row["wav"]
    noise_sha1 = {c: hashes.sha1(p) if p else None for c, p in noise_files.items()}
    hashes.save()
    logger.info("content check: %d speech and %d noise file(s) (%s) in %.2f s", len(speech),
                len({p for p in noise_files.values() if p}), hashes.stats(),
                time.perf_counter() - started)
    return speech, speech_paths, noise_sha1


def corrupt_manifest(manifest, out_dir, snrs=(5,), codes=None, noise_dir=None, table=None,
                     seed=DEFAULT_SEED, data_root=None, source_data_root=None, sample_rate=16000):
    """Corrupt every utterance of ``manifest`` with each domain in ``codes`` at each SNR.

    ``table`` is a domain table (see :func:`load_domain_table`; default LS-C), ``codes`` a subset
    of its codes (default: all). ``noise_dir`` is the folder of the noise files (an MS-SNSD clone
    or its ``noise_test``); it is only needed for non-Gaussian domains. ``data_root`` makes the
    written manifests use ``$data_root`` for audio under it; ``source_data_root`` resolves
    ``$data_root`` in the source manifest. Returns ``{(code, snr): manifest path}``.

    Content-keyed: each domain/SNR manifest has a cache record (``<manifest>.opts.json``, format 2,
    see :mod:`tta_brain.data.cache`) with

    - ``audio``: what every mixture of the domain depends on: ``kind`` (``file``/``gaussian``),
      ``noise_sha1``, ``snr``, ``sample_rate``, ``mix_version`` (:data:`MIX_VERSION`) and, for
      Gaussian noise only, ``seed``;
    - ``speech``: ``{source ID: sha1 of its speech file}``;
    - ``pending``: source IDs still to be (re)mixed, present only while a run is in progress.

    A changed ``audio`` key remixes the whole domain; a changed, new or unfinished utterance, or
    a missing mixture file, remixes only that utterance; a manifest whose rows changed (e.g.
    transcripts edited in the source, another ``data_root``) is rewritten without remixing. Each
    decision is logged with its reason. A missing, unreadable or older (options only) record
    remixes the domain. File hashes are cached in ``<out>/.sha1_cache.json``
    (:class:`~tta_brain.data.cache.HashCache`), so a rerun on unchanged files only ``stat`` s them.
    """
    table = load_domain_table(table)
    codes = list(table) if codes is None else list(codes)
    unknown = [c for c in codes if c not in table]
    if unknown:
        raise ValueError(f"unknown domain code(s) {unknown}; the table has {sorted(table)}")
    rows = _source_rows(manifest, source_data_root)
    needs_files = [c for c in codes if table[c] not in GAUSSIAN_NAMES]
    if needs_files:
        noise_dir = find_noise_dir(noise_dir)
    noise_files = {c: None if table[c] in GAUSSIAN_NAMES else noise_path(noise_dir, table[c])
                   for c in codes}

    speech, speech_paths, noise_sha1 = _content(manifest, rows, noise_files, out_dir)

    written = {}
    noises = {}  # code -> loaded noise signal, on first need
    for code in codes:
        path = noise_files[code]
        for snr in snrs:
            out_csv = manifest_path(out_dir, code, snr)
            label = out_csv.stem
            options = {"source": str(Path(manifest).resolve()), "n_utts": len(rows),
                       "noise": str(path.resolve()) if path else "gaussian",
                       "snr": float(snr), "seed": int(seed), "sample_rate": int(sample_rate),
                       "data_root": str(Path(data_root).resolve()) if data_root else None}
            audio = {"kind": "file" if path else "gaussian", "noise_sha1": noise_sha1[code],
                     "snr": float(snr), "sample_rate": int(sample_rate),
                     "mix_version": MIX_VERSION}
            if path is None:
                audio["seed"] = int(seed)  # the seed only matters for Gaussian noise
            new_rows = domain_rows(rows, code, out_dir, snr, data_root)
            text = manifest_text(new_rows).encode("utf-8")

            wav_dir = str(mixture_path(out_dir, code, snr, "x").parent)

            def wav_of(src_id, wav_dir=wav_dir):
                return os.path.join(wav_dir, f"{src_id}.wav")

            record, problem = load_record(out_csv)
            if record is not None and record.get("step") != "corrupt":
                record, problem = None, (f"cache record {record_path(out_csv)} belongs to step "
                                         f"{record.get('step')!r}")
            if record is None:
                todo = set(speech)
                verb = "remixing" if out_csv.exists() else "mixing"
                reasons = [problem]
            else:
                todo, reasons = _plan_domain(record, options, audio, speech, speech_paths,
                                             wav_of)
                verb = "remixing"
            manifest_same = out_csv.is_file() and out_csv.read_bytes() == text
            if not todo and record is not None:
                if manifest_same:
                    logger.info("%s: up to date (noise, %d speech file(s) and mixing options "
                                "unchanged), skipping", label, len(speech))
                    if record.get("options") != as_stored(options):
                        logger.debug("%s: %s (not used by these mixtures); record updated", label,
                                     "; ".join(option_changes(record.get("options"), options)))
                        save_record(out_csv, "corrupt", options, audio=audio, speech=speech)
                else:
                    why = "; ".join(reasons) or ("manifest rows differ (source manifest edited, "
                                                 "or another data_root)")
                    logger.info("%s: %s, rewriting the manifest only (the audio is up to date)",
                                label, why)
                    write_manifest(out_csv, new_rows)
                    save_record(out_csv, "corrupt", options, audio=audio, speech=speech)
                written[(code, snr)] = out_csv
                continue
            n_all = len(speech)
            amount = (f"all {n_all} utterances" if len(todo) == n_all
                      else f"{len(todo)} of {n_all} utterances")
            logger.info("%s: %s, %s %s", label, "; ".join(reasons), verb, amount)
            # Saved first: an interrupted run leaves a record saying what is still to do.
            save_record(out_csv, "corrupt", options, audio=audio, speech=speech,
                        pending=sorted(todo))
            if path is not None and code not in noises:
                from ..audio import load_audio  # torch: imported only when mixing

                noises[code] = load_audio(path, sample_rate).numpy()
            corrupt_domain(rows, code, noises.get(code), out_dir, snr, seed=seed,
                           data_root=data_root, sample_rate=sample_rate, only=todo,
                           noise_file=path)
            if not manifest_same:
                write_manifest(out_csv, new_rows)
            save_record(out_csv, "corrupt", options, audio=audio, speech=speech)
            logger.info("wrote %s: %d utterances (%d mixed)", out_csv, n_all, len(todo))
            written[(code, snr)] = out_csv
    return written
