"""The noise domains of a corruption: the domain table (``code -> noise file name`` relative to the
noise folder; ``None`` or ``"gaussian"`` = white Gaussian noise made per utterance), the LS-C table
(:data:`LS_C_NOISES`, files of MS-SNSD's ``noise_test/``), finding the noise folder and files, and
SNR tags. Used by :mod:`tta_brain.data.prep.ms_snsd` (the mixing) and the recipes."""
from pathlib import Path

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
    text = path.read_text(encoding="utf-8")
    try:
        table = yaml.safe_load(text)
    except yaml.YAMLError as e:             # was a traceback at "<unicode string>"
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        why = getattr(e, "problem", None) or " ".join(str(e).split())
        raise ValueError(f"{path}: not a YAML domain table ({why}{where})") from None
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{path}: a domain table must map domain codes to noise file names")
    keys = [k for k, _ in yaml.compose(text).value]
    codes = [k.value for k in keys]
    twice = next((c for i, c in enumerate(codes) if c in codes[:i]), None)
    if twice is not None:                   # YAML keeps the last one, silently
        raise ValueError(f"{path}: domain code {twice} given twice")
    if any(isinstance(k, bool) for k in table):     # NO: ... was the domain "False"
        code = next(k.value for k in keys if k.tag.endswith(":bool"))
        raise ValueError(f"{path}: domain code {code} reads as the YAML boolean "
                         f"{yaml.safe_load(code)}: quote it ('{code}': ...)")
    for code, name in table.items():
        if name is not None and not isinstance(name, str):      # was a TypeError of a path
            raise ValueError(f"{path}: domain {code}: {name!r} is no noise file name (a file "
                             f"name, or gaussian)")
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
