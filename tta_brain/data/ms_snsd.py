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
noise signal is used at every SNR. A domain whose manifest exists with the same options is
skipped; after an interrupted run, files already written are kept.
"""
import json
import logging
from pathlib import Path

from .manifest import (is_up_to_date, read_manifest, save_options, stored_options,
                       to_placeholder, write_manifest)

logger = logging.getLogger(__name__)

#: LS-C domains: MS-SNSD ``noise_test/`` files; GS = white Gaussian noise.
LS_C_NOISES = {
    "AA": "AirportAnnouncements_2.wav",
    "AC": "AirConditioner_6.wav",
    "BA": "Babble_4.wav",
    "CM": "CopyMachine_2.wav",
    "GS": None,
    "MU": "Munching_3.wav",
    "NB": "Neighbor_6.wav",
    "SD": "ShuttingDoor_6.wav",
    "TP": "Typing_2.wav",
    "VC": "VacuumCleaner_1.wav",
}
GAUSSIAN_NAMES = (None, "", "gaussian", "GAUSSIAN", "white_gaussian")
DEFAULT_SEED = 666  # the seed of the official preprocessing script


def load_domain_table(spec=None):
    """A domain table from a dict, a YAML/JSON file path, or ``None`` (the LS-C table)."""
    if spec is None:
        return dict(LS_C_NOISES)
    if isinstance(spec, dict):
        return dict(spec)
    import yaml  # PyYAML, a dependency of hyperpyyaml

    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"domain table not found: {path}")
    table = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{path}: a domain table must map domain codes to noise file names")
    return {str(k): v for k, v in table.items()}


def snr_tag(snr):
    """``5`` -> ``"5dB"``, ``2.5`` -> ``"2.5dB"``, ``-5`` -> ``"-5dB"``."""
    snr = float(snr)
    return f"{int(snr)}dB" if snr.is_integer() else f"{snr:g}dB"


def find_noise_dir(root):
    """The folder holding the noise files: ``<root>/noise_test`` (MS-SNSD clone) or ``root``."""
    if not root:
        raise FileNotFoundError("noise folder not set: set MS_SNSD=/path/to/MS-SNSD (the clone "
                                "that contains noise_test/) in the environment or in db.sh")
    root = Path(root)
    for cand in (root / "noise_test", root):
        if cand.is_dir() and (any(cand.glob("*.wav")) or any(cand.glob("*.flac"))):
            return cand
    raise FileNotFoundError(f"no noise files in {root} or {root / 'noise_test'}; set MS_SNSD to "
                            "a clone of https://github.com/microsoft/MS-SNSD")


def noise_path(noise_dir, name):
    """Path of a table entry's noise file (``.wav`` added when the name has no extension)."""
    path = Path(noise_dir) / name
    if not path.suffix:
        path = path.with_suffix(".wav")
    if not path.is_file():
        raise FileNotFoundError(f"noise file {path} not found (domain table entry {name!r}); "
                                "check MS_SNSD / the noise folder")
    return path


def manifest_path(out_dir, code, snr):
    """``<out>/manifests/<code>_<snr>dB.csv``."""
    return Path(out_dir) / "manifests" / f"{code}_{snr_tag(snr)}.csv"


def corrupt_domain(rows, code, noise, out_dir, snr, seed=DEFAULT_SEED, data_root=None,
                   sample_rate=16000, overwrite=False):
    """Write the corrupted copies of ``rows`` for one domain and SNR; returns the manifest rows.

    ``rows`` have resolved ``wav`` paths. ``noise`` is a 1-D noise signal, or ``None`` for white
    Gaussian noise. Existing output files are kept unless ``overwrite``.
    """
    from .audio import load_audio, write_audio
    from .mixing import gaussian_noise, mix_at_snr, utterance_seed

    wav_dir = Path(out_dir) / snr_tag(snr) / code
    out_rows = []
    from tta_brain.progress import progress
    for i, row in enumerate(progress(rows, desc=f"{code} {snr:g} dB", leave=False)):
        src_id = row["ID"]
        out_wav = wav_dir / f"{src_id}.wav"
        if overwrite or not out_wav.is_file():
            speech = load_audio(row["wav"], sample_rate)
            if noise is None:
                signal = gaussian_noise(speech.numel(), utterance_seed(seed, src_id))
            else:
                signal = noise
            write_audio(out_wav, mix_at_snr(speech.numpy(), signal, float(snr)), sample_rate)
        out_rows.append({
            "ID": f"{src_id}_{code}",
            "duration": row["duration"],
            "wav": to_placeholder(out_wav, data_root),
            "spk_id": row.get("spk_id", ""),
            "wrd": row["wrd"],
            "domain": code,
            "snr": snr_tag(snr)[:-2],
            "source_id": src_id,
        })
        if (i + 1) % 500 == 0:
            logger.info("%s %s: %d/%d", code, snr_tag(snr), i + 1, len(rows))
    return out_rows


def corrupt_manifest(manifest, out_dir, snrs=(5,), codes=None, noise_dir=None, table=None,
                     seed=DEFAULT_SEED, data_root=None, source_data_root=None, sample_rate=16000):
    """Corrupt every utterance of ``manifest`` with each domain in ``codes`` at each SNR.

    ``table`` is a domain table (see :func:`load_domain_table`; default LS-C), ``codes`` a subset
    of its codes (default: all). ``noise_dir`` is the folder of the noise files (an MS-SNSD clone
    or its ``noise_test``); it is only needed for non-Gaussian domains. ``data_root`` makes the
    written manifests use ``$data_root`` for audio under it; ``source_data_root`` resolves
    ``$data_root`` in the source manifest. Returns ``{(code, snr): manifest path}``.
    """
    from .audio import load_audio

    table = load_domain_table(table)
    codes = list(table) if codes is None else list(codes)
    unknown = [c for c in codes if c not in table]
    if unknown:
        raise ValueError(f"unknown domain code(s) {unknown}; the table has {sorted(table)}")
    rows = read_manifest(manifest, replacements={"data_root": source_data_root}
                         if source_data_root else None)
    for row in rows:
        if row["wav"].startswith("$"):
            raise ValueError(f"{manifest}: {row['wav']!r} uses a placeholder; pass its data root")
    needs_files = [c for c in codes if table[c] not in GAUSSIAN_NAMES]
    if needs_files:
        noise_dir = find_noise_dir(noise_dir)
    written = {}
    for code in codes:
        name = table[code]
        path = None if name in GAUSSIAN_NAMES else noise_path(noise_dir, name)
        noise = None if path is None else load_audio(path, sample_rate).numpy()
        for snr in snrs:
            out_csv = manifest_path(out_dir, code, snr)
            options = {"source": str(Path(manifest).resolve()), "n_utts": len(rows),
                       "noise": str(path.resolve()) if path else "gaussian",
                       "snr": float(snr), "seed": int(seed), "sample_rate": int(sample_rate),
                       "data_root": str(Path(data_root).resolve()) if data_root else None}
            if is_up_to_date(out_csv, options):
                logger.info("%s exists with the same options, skipping", out_csv)
            else:
                previous = stored_options(out_csv)
                options = json.loads(json.dumps(options))  # compare as stored (JSON types)
                # Files of an interrupted run (no options stored yet) are reused; files made with
                # other options (e.g. another noise file or seed) are rewritten.
                overwrite = previous is not None and previous != options
                out_rows = corrupt_domain(rows, code, noise, out_dir, snr, seed=seed,
                                          data_root=data_root, sample_rate=sample_rate,
                                          overwrite=overwrite)
                write_manifest(out_csv, out_rows)
                save_options(out_csv, options)
                logger.info("wrote %d utterances to %s", len(out_rows), out_csv)
            written[(code, snr)] = out_csv
    return written
