"""Run identity: the fingerprint of what determines a run's result, and the folder lock that keeps
one writer per experiment folder.

The fingerprint holds the stream manifest's content (sha1), the content of the audio files it
names (``audio_sha1``; a run recorded before it was is taken to match), the source model's
identity (sha1 of its files for a local directory, the name and cached commit for a hub model),
the toolkit version and every resolved hyperparameter except where the run is written and how
often it checkpoints (:data:`LOCATION_KEYS`); ``device`` counts by its type (cpu / cuda), not its index. The yaml's
nested values (the method's and model's blocks, the selectors, the optimiser) count by a digest
of each as written (``structure``: a class, a selector or ``!ref <lr> * 2`` changed there is
another run); a fingerprint recorded before digests were is taken to match them. It is stored in
``fingerprint.json`` when a run starts, in every checkpoint and in ``summary.json``; a folder is
only resumed or skipped by a run with the same fingerprint.
"""
import fcntl
import functools
import hashlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Dict, List, Optional

from tta_brain.data.cache import (HASH_CACHE_NAME, HashCache, file_identity, file_sha1,
                                  replaced_when_written, same_source, source_identity)
from tta_brain.data.manifest import expand_path
from tta_brain.hparams import rules

__all__ = ["LOCATION_KEYS", "CONTENT_KEYS", "fingerprint", "audio_sha1", "stream_fingerprint",
           "differences", "FolderLock", "LockedError", "FINGERPRINT_FILE", "LOCK_FILE"]

#: Keys that say where a run is written or read from and how often it checkpoints, not what it
#: computes (the stream's content is fingerprinted instead of its path).
LOCATION_KEYS = ("output_folder", "stream_csv", "data_root", "ckpt_every")
#: Keys that only name a run in reports (the grid names a run with options by its folder tag):
#: not part of what it computes, ignored in fingerprints old and new.
LABEL_KEYS = ("method_tag", "stream_name")
#: Keys added to the packaged yamls after runs were fingerprinted without them, with the value
#: that computes what those runs computed (by the run's device type where that differs): a
#: fingerprint without the key matches that value (a folder decoded before the key existed is
#: resumed or skipped, not refused as different). ``tf32``: runs on CUDA ran with SpeechBrain's
#: TF32 matmuls ("on"); on CPU it has no effect.
ADDED_KEYS = {"cuda_graph_buckets": 0.0, "tf32": {"cpu": "torch", "cuda": "on"},
              "convolutions": "native", "reset_test_size": 0, "param_collection": "clean",
              "target_lang": ""}
#: Added keys that a packaged yaml's nested block references (``convolutions: !ref
#: <convolutions>`` in the run block's ``runtime``) since the blocks' digests (``structure``)
#: were fingerprinted: the digest leaves that reference out, so the block digests as before (the
#: key's plain value counts by itself, above)
ADDED_TO_BLOCKS = ("convolutions", "reset_test_size", "target_lang")
#: Block digests a packaged yaml had before a change that computes what it computed, as
#: ``{structure key: {old digest: today's}}``: cea.yaml's ``adapt_params`` gained the item
#: ``- param_collection: !ref <param_collection>`` (11691bf; its value ``clean``, what CEA ran
#: before, is the ``param_collection`` of :data:`ADDED_KEYS`). The same item was in suta's,
#: csuta's, dsuta's and sdpl's from the start, so it cannot be left out of every digest as
#: :data:`ADDED_TO_BLOCKS` are.
RENAMED_DIGESTS = {"structure.adapt_params": {"f7addc96ee81": "05ffdd77049c"}}
#: CUDA-only keys whose ``auto`` computes on CPU what the value here did before ``auto`` became
#: their default (nothing is captured on CPU): a CPU run's fingerprint keeps that value, so CPU
#: folders decoded before stay this run's. On CUDA ``auto`` is fingerprinted as ``auto``.
CPU_AUTO = {"cuda_graph_buckets": 0.0, "cuda_graph_cache": 1}
#: Keys whose value is an input file, fingerprinted by its content (the source model is by
#: ``source_identity``): a run is redone when the file changes, not when it moves.
CONTENT_KEYS = ("source_stats", "lm_path", "lm_unigrams")
#: Content keys that runs fingerprinted by path before: such a run's path matches a content
#: that the path holds now (all that can be known of what it read).
PATH_BEFORE = ("lm_path", "lm_unigrams")
FINGERPRINT_FILE = "fingerprint.json"
LOCK_FILE = ".lock"
logger = logging.getLogger(__name__)


def audio_sha1(rows: List[Dict], stream_csv) -> str:
    """One digest of the audio a stream's rows read, in stream order: the stream manifest names
    its files, this is what they hold (a noisy set mixed again with another seed or noise keeps
    its paths). Hashing is cached by :class:`~tta_brain.data.cache.HashCache` in the manifest's
    folder (``.sha1_cache.json``; only in memory where that folder is not writable): a file is
    read again only when its ``stat`` changed. A missing file counts as missing (the run
    records it as a reject)."""
    folder = Path(stream_csv).resolve().parent
    cache = _HASH_CACHES.get(folder)
    if cache is None:
        cache = _HASH_CACHES[folder] = HashCache(folder / HASH_CACHE_NAME)
    digest, seen = hashlib.sha1(), {}
    for row in rows:
        path = os.path.abspath(row["wav"])
        if path not in seen:
            try:
                seen[path] = cache.sha1(path)
            except OSError:         # missing or unreadable: the run says so when it reaches it
                seen[path] = "missing"
        digest.update(f"{seen[path]}\n".encode())
    try:
        cache.save()
    except OSError as e:            # a read-only data folder: hashed again by the next run
        logger.debug("hash cache %s not written: %s", cache.path, e)
    if cache.n_read:
        logger.info("%s: hashed its audio (%s)", stream_csv, cache.stats())
    cache.n_read = cache.n_cached = 0
    return digest.hexdigest()


_HASH_CACHES: Dict[Path, HashCache] = {}


def missing_audio(rows: List[Dict]) -> List[str]:
    """The audio files the rows name that are no file now, each once, in stream order: an
    ``audio_sha1`` that differs for these is a wrong ``data_root`` or a moved corpus (the run
    would skip them), not audio mixed again."""
    seen, out = set(), []
    for row in rows:
        path = row["wav"]
        if path not in seen:
            seen.add(path)
            if not os.path.isfile(path):
                out.append(path)
    return out


def explain_missing_audio(diffs: List[str], rows: List[Dict]) -> List[str]:
    """``diffs`` with an ``audio_sha1`` difference said as the audio files now missing, where
    some are (else as they were)."""
    if not any(d.startswith("audio_sha1:") for d in diffs):
        return diffs
    missing = missing_audio(rows)
    if not missing:
        return diffs
    n = len({row["wav"] for row in rows})
    said = (f"{len(missing)} of the {n} audio files the stream names are not found now (first: "
            f"{missing[0]}): a wrong --data_root or a moved corpus, not audio mixed again; fix "
            f"the path (--overwrite would delete this run's records and skip those files)")
    return [f"audio_sha1: {said}" if d.startswith("audio_sha1:") else d for d in diffs]


@functools.lru_cache(maxsize=1)
def _installed() -> Dict[str, List[str]]:
    """Top-level import names of the installed distributions (asked once a process: 0.1 s)."""
    import importlib.metadata
    return importlib.metadata.packages_distributions()


def your_code(values) -> Dict[str, Dict[str, str]]:
    """The user's own code a resolved yaml's objects come from: the top-level modules and
    packages of ``tta_brain.hparams.imported_modules`` that are ``your_file`` and no installed
    distribution's (a method of one's own on ``PYTHONPATH``; not this package, the standard
    library, or anything pip installed, editable installs included: those are versions):
    ``{name: {"file": its file or folder, "sha1": of its text (a package: of every .py file under
    it, with their relative paths)}}``. A run's fingerprint holds the digests: the method's code
    edited, the same command decodes again instead of skipping as finished."""
    import importlib.util
    from tta_brain.hparams import imported_modules, your_file
    installed = _installed()                    # versioned as distributions, editable ones too
    out = {}
    for name in dict.fromkeys(m.split(".")[0] for m in imported_modules(values)):
        if name in installed:
            continue
        try:                     # a module the yaml's build cannot import says so itself
            spec = importlib.util.find_spec(name)
        except Exception:       # noqa: BLE001 - a package whose import raises anything
            continue
        origin = getattr(spec, "origin", None)
        if not origin or not os.path.isfile(origin) or not your_file(origin):
            continue
        files = [Path(origin)]
        roots = list(spec.submodule_search_locations or [])
        if roots:                               # a package: every module of it
            files = sorted(p for d in roots for p in Path(d).rglob("*.py"))
        digest = hashlib.sha1()
        for f in files:
            digest.update(os.path.relpath(f, roots[0] if roots else f.parent).encode() + b"\0")
            digest.update(f.read_bytes() + b"\0")
        out[name] = {"file": str(roots[0] if roots else origin), "sha1": digest.hexdigest()}
    return out


def fingerprint(hparams: Dict, stream_csv, n_rows: int,
                structure: Optional[Dict[str, str]] = None, audio: Optional[str] = None,
                code: Optional[Dict[str, Dict[str, str]]] = None) -> Dict:
    """The fingerprint of a run from its resolved plain hparams, the digests of its yaml's nested
    values (``structure``: ``tta_brain.hparams.structure``), its stream manifest, the audio
    the manifest names (``audio``: :func:`audio_sha1`) and the user's own code its yaml imports
    (``code``: :func:`your_code`)."""
    import tta_brain
    hp = {k: v for k, v in sorted(hparams.items()) if k not in LOCATION_KEYS + LABEL_KEYS}
    if "device" in hp:
        hp["device"] = str(hp["device"]).split(":")[0]
    for key, value in CPU_AUTO.items():
        if hp.get(key) == "auto" and hp.get("device", "cpu") == "cpu":
            hp[key] = value
    if "source" in hp:
        hp["source"] = source_identity(str(hp["source"]))
    for key in CONTENT_KEYS:       # an input file counts by its content, as the model does
        if hp.get(key):
            hp[key] = file_identity(expand_path(hp[key], hparams.get("data_root", "")))
    out = {"stream_sha1": file_sha1(stream_csv), "n_rows": n_rows,
           "tta_brain": tta_brain.__version__, "hparams": hp}
    if audio:
        out["audio_sha1"] = audio
    if structure:
        out["structure"] = dict(structure)
    if code:
        out["code"] = {name: f"sha1:{c['sha1']}" for name, c in sorted(code.items())}
    return out


def stream_fingerprint(stream_csv, n_rows: int, tag: str) -> Dict:
    """A minimal fingerprint (stream content and method tag) for a Brain used without decode."""
    return {"stream_sha1": file_sha1(stream_csv), "n_rows": n_rows, "method": tag}


def _flat(d: Dict, prefix: str = "") -> Dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def differences(old: Optional[Dict], new: Dict, recorded: bool = False) -> List[str]:
    """``key: old != new`` for every key that differs (hparams flattened). ``new`` is this
    run's; ``recorded=True``: both are recorded runs', either of which may predate a key."""
    if not old:
        return ["no fingerprint recorded (a folder written by an older tta_brain, or not a run)"]
    labels = {f"hparams.{k}" for k in LABEL_KEYS}
    a, b = ({k: v for k, v in _flat(fp).items() if k not in labels} for fp in (old, new))
    for fp in (a, b) if recorded else (a,):
        other = b if fp is a else a             # (a key of one block: only where the other
        for key, default in ADDED_KEYS.items():   # run's yaml has it, e.g. the reset block)
            if f"hparams.{key}" not in fp and "hparams.seed" in fp and f"hparams.{key}" in other:
                if isinstance(default, dict):
                    default = default.get(str(fp.get("hparams.device", "cpu")))
                fp[f"hparams.{key}"] = default
    for fp in (a, b):       # a key the run does not read (reset_K under reset none) is no part
        hp = {k[len("hparams."):]: v for k, v in fp.items() if k.startswith("hparams.")}
        for key in [k for k in rules.NEEDS if rules.unused(k, hp)]:      # of what it is
            del fp[f"hparams.{key}"]
    for old_fp, new_fp in ((a, b), (b, a)) if recorded else ((a, b),):
        if "audio_sha1" not in old_fp and "audio_sha1" in new_fp:   # recorded before the audio
            old_fp["audio_sha1"] = new_fp["audio_sha1"]              # was: not known either
        for part in ("structure.", "code."):   # recorded before the yaml's nested values or
            if not any(k.startswith(part) for k in old_fp):         # one's own code were: not
                old_fp.update({k: v for k, v in new_fp.items()      # known, so not a difference
                               if k.startswith(part)})
    for key, renamed in RENAMED_DIGESTS.items():
        for old_fp, new_fp in ((a, b), (b, a)) if recorded else ((a, b),):
            if key in new_fp and renamed.get(old_fp.get(key)) == new_fp[key]:
                old_fp[key] = new_fp[key]
    if not any(k.startswith("code.") for k in b):   # one's own code not found here (a grid's
        b.update({k: v for k, v in a.items() if k.startswith("code.")})   # host): not known
    for key in (f"hparams.{k}" for k in PATH_BEFORE):
        for old_fp, new_fp in ((a, b), (b, a)) if recorded else ((a, b),):
            was = old_fp.get(key)
            if isinstance(was, str) and not was.startswith(("sha1:", "missing:")) \
                    and file_identity(expand_path(was, "")) == new_fp.get(key):
                old_fp[key] = new_fp[key]
    if same_source(a.get("hparams.source"), b.get("hparams.source")):
        a["hparams.source"] = b.get("hparams.source")   # a hub name recorded without its commit
    return [f"{k}: {a.get(k, '(unset)')!r} != {b.get(k, '(unset)')!r}"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def read_fingerprint(folder) -> Optional[Dict]:
    path = Path(folder) / FINGERPRINT_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_fingerprint(folder, fp: Dict) -> None:
    path = Path(folder) / FINGERPRINT_FILE
    with replaced_when_written(path, path.with_name(f".{FINGERPRINT_FILE}.tmp")) as tmp:
        tmp.write_text(json.dumps(fp, indent=1, sort_keys=True), encoding="utf-8")


class LockedError(RuntimeError):
    """Another process is writing the folder."""


class FolderLock:
    """An exclusive ``flock`` on ``<folder>/.lock`` for the whole run: one writer per folder.

    The kernel drops the lock when its process ends, however it ends (``kill -9`` included), so a
    lock never outlives its holder. The file names the holder (pid, host, start, command) for the
    message a second writer gets.
    """

    def __init__(self, folder):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.fd: Optional[int] = None

    def acquire(self, command: str = "") -> "FolderLock":
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        for attempt in range(5):       # a probe (:meth:`busy`) holds it for microseconds
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt < 4:
                    time.sleep(0.05)
        else:
            os.close(fd)
            raise LockedError(f"{self.folder} is being written by {self.holder()}; wait for it to "
                              f"finish or use another --output_folder") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                                 "command": command}).encode())
        os.fsync(fd)
        self.fd = fd
        return self

    def busy(self) -> Optional[str]:
        """Who holds the lock now (:meth:`holder`), or None: nobody (the folder or its lock file
        not there, or free). Takes nothing and creates nothing."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        except BlockingIOError:
            return self.holder()
        except OSError:                # no locks on this file system (ENOLCK): not known
            return None
        finally:
            os.close(fd)

    def holder(self) -> str:
        try:
            info = json.loads(self.path.read_text(encoding="utf-8"))
            return (f"pid {info['pid']} on {info['host']} (since {info['since']}"
                    + (f": {info['command'][:120]}" if info.get("command") else "") + ")")
        except (OSError, ValueError, KeyError):
            return "another process"

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)          # no holder named once it is released
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
