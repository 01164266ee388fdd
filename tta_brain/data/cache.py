"""Content-keyed caching of the data preparation steps.

Every preparation output ``<file>`` has a *cache record* ``<file>.opts.json`` saying what it was
made from. A step redoes its work when an input's *content* changed, not only when a path or an
option did, and logs why (``AC_20dB: noise /x/ac.wav changed (sha1 1234abcd -> 9876fedc),
remixing ...``).

Record format 2 (JSON object)::

    {"format": 2, "step": "<step>", "options": {...}, ...}

``options`` are the step's options, as before; the other keys are step specific content keys, e.g.
``inputs`` (``{file key: sha1}`` of every input file, :func:`input_changes`) or, for the noisy
mixtures, ``audio`` and ``speech`` (see :func:`tta_brain.data.prep.ms_snsd.corrupt_manifest`).
Format 1, written by earlier versions, is the options object itself; it is still read by
:func:`tta_brain.data.manifest.stored_options`, and a step that finds one redoes its work once
(logging that the record is from an older version) and writes format 2.

Hashing is made cheap by :class:`HashCache`, a small JSON file ``{path: [size, mtime_ns,
ctime_ns, sha1]}`` next to the outputs: a file whose ``stat`` still matches is not read again.
The ``ctime`` is set by the kernel on every write or rename and cannot be set back by tools that
preserve the modification time (``cp -p``, ``rsync -t``, ``touch -d``), so a replaced file is
always noticed. Files changed less than :data:`RACY_MARGIN_NS` before they were hashed are not
stored (their timestamps could coincide with a later change: git's "racily clean" problem); they
are hashed again on the next run.
"""
import contextlib
import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

RECORD_FORMAT = 2
RECORD_SUFFIX = ".opts.json"
#: Name of the hash cache file written in an output folder.
HASH_CACHE_NAME = ".sha1_cache.json"
HASH_CACHE_VERSION = 1
#: Files whose mtime/ctime is this close to the time they were hashed are not cached on disk.
RACY_MARGIN_NS = 2_000_000_000


def file_sha1(path, chunk=1 << 20):
    """SHA-1 (hex) of a file's bytes."""
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def replaced_when_written(path, tmp):
    """The atomic write of ``path``: the block writes the temporary file ``tmp`` (yielded), which
    then replaces ``path`` in one rename (a reader sees the old file or the new one, never part
    of one); a block that fails leaves ``path`` as it was and removes ``tmp``."""
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


class _KeptError:
    """File ``f``'s writes, the OSError of a failed one kept (for :func:`save_to`)."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        self.f.flush()

    def __getattr__(self, name):            # the rest is the file's (seek, tell, truncate, ...)
        return getattr(self.f, name)


def save_to(obj, f) -> None:
    """``torch.save(obj, f)`` into open file ``f`` (the run checkpoints). A failed write (a full
    disk, a file size limit) is its OSError: torch.save says only "unexpected pos" (a
    RuntimeError)."""
    import torch
    writes = _KeptError(f)
    try:
        torch.save(obj, writes)
    except RuntimeError:
        if writes.error is None:
            raise
        raise writes.error from None


def save_torch(obj, path) -> None:
    """``torch.save`` to ``path`` atomically (a temporary file beside it, then a rename). A folder
    at ``path``, a missing parent or a failed write is an ``OSError`` naming ``path``, and the
    temporary file is removed (a rename onto a folder used to leave it behind)."""
    import errno
    import torch
    path = str(path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "is a folder, not a file name", path)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(errno.ENOENT, f"no folder {parent}", path)
    tmp = f"{path}.tmp{os.getpid()}"
    _remove_stale_temporaries(path)
    try:
        with replaced_when_written(path, tmp):
            torch.save(obj, tmp)    # (a path, not save_to: its zip names its members after
            #                         the file, so the bytes, and the sha1 fingerprints, stay)
    except (OSError, RuntimeError) as e:      # not writable, a full disk (torch: RuntimeError)
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise OSError(getattr(e, "errno", None) or errno.EIO, why, path) from None


def damaged_zip(path) -> Optional[str]:
    """Why the ``torch.save`` file at ``path`` is damaged (None: every member's CRC-32 checks, or
    it is no zip archive, which ``torch.load`` then says itself). ``torch.load`` reads a damaged
    member's bytes as they are: a flipped byte in a saved tensor loaded without an error."""
    import zipfile
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except zipfile.BadZipFile:
        return None
    except (OSError, EOFError, zipfile.LargeZipFile, RuntimeError) as e:
        return f"unreadable archive ({type(e).__name__}: {e})"
    return None if bad is None else f"member {bad} fails its CRC-32 check"


def _remove_stale_temporaries(path: str, age_s: float = 3600.0) -> None:
    """Temporary files of ``save_torch`` to ``path`` that a killed writer left (over an hour
    old: no live save takes that long)."""
    import glob
    now = time.time()
    for tmp in glob.glob(glob.escape(path) + ".tmp*"):
        try:
            if now - os.path.getmtime(tmp) > age_s:
                os.remove(tmp)
        except OSError:
            pass


#: Files of a model directory that decide its outputs (weights, config, processor).
MODEL_FILES = (".json", ".safetensors", ".bin", ".txt", ".model", ".pt")


@functools.lru_cache(maxsize=64)
def _dir_sha1(path: str, stamp: tuple) -> str:
    h = hashlib.sha1()
    for name, *_ in stamp:
        h.update(name.encode())
        h.update(file_sha1(os.path.join(path, name)).encode())
    return h.hexdigest()


def hub_snapshot(name: str, cache_dir=None) -> Optional[str]:
    """The folder of hub model ``name`` in the local Hugging Face cache (the snapshot its ``main``
    ref names), or None when the cache has none or ``name`` is no hub name. Never touches the
    network."""
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(str(name), cache_dir=cache_dir, local_files_only=True)
    except Exception:       # not cached, not a valid repo id, no huggingface_hub: not there
        return None


def hub_unreachable() -> Optional[str]:
    """Why the Hugging Face hub (``HF_ENDPOINT``) cannot be asked, found at once: its host name
    does not resolve (no network or no DNS here). None when it may be reachable (a proxy is set,
    or offline mode, where the hub library stops at once by itself); asking it otherwise retries
    for about 50 s before failing the same way."""
    import socket
    import urllib.parse
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    if constants.HF_HUB_OFFLINE:
        return None
    host = urllib.parse.urlparse(constants.ENDPOINT).hostname
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as e:
        return f"the hub's host {host} cannot be resolved here ({e.strerror})"
    except (OSError, UnicodeError):
        return None
    return None


def source_identity(source: str) -> str:
    """``sha1:<hex>`` of a local model directory's files; ``hub:<name>@<commit>`` for a hub model
    in the local HF cache (the commit of the snapshot it is loaded from), else ``hub:<name>``."""
    if os.path.isdir(source):
        names = sorted(n for n in os.listdir(source) if n.endswith(MODEL_FILES)
                       and os.path.isfile(os.path.join(source, n)))
        # hashed once a process while every file's stat (size, modification and change times:
        # a file copied in with its old mtime kept, cp -p or rsync -t, changes its ctime) stays
        # the same; a file changed in the last RACY_MARGIN_NS is hashed each time (file_identity)
        stats = [os.stat(os.path.join(source, n)) for n in names]
        stamp = tuple((n, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                      for n, st in zip(names, stats))
        recent = time.time_ns() - RACY_MARGIN_NS
        if any(max(st.st_mtime_ns, st.st_ctime_ns) >= recent for st in stats):
            return f"sha1:{_dir_sha1.__wrapped__(os.path.abspath(source), stamp)}"
        return f"sha1:{_dir_sha1(os.path.abspath(source), stamp)}"
    snapshot = hub_snapshot(source)
    return f"hub:{source}@{os.path.basename(snapshot)}" if snapshot else f"hub:{source}"


def same_source(recorded: str, current: str) -> bool:
    """Whether a recorded :func:`source_identity` is ``current``'s. ``hub:<name>`` without a
    commit (recorded before commits were, or before the model was in the cache) matches
    ``hub:<name>@<any commit>``: what it ran on is not known, so it is not refused."""
    if recorded == current:
        return True
    a, b = (str(x) for x in (recorded, current))
    return a.startswith("hub:") and b.startswith("hub:") and (
        a.split("@")[0] == b.split("@")[0] and ("@" not in a or "@" not in b))


def file_identity(path) -> str:
    """``sha1:<content>`` of a file, ``missing:<path>`` if there is none (a run's input file).
    Hashed once a process while its ``stat`` (size, modification and change times) stays the
    same (a file changed in the last :data:`RACY_MARGIN_NS` is hashed each time): a grid plans
    every run in one process, and SGEM's ``lm_path`` (a KenLM binary of a few GB) was read again
    for each of them (500 runs of a 3 GB LM: an hour before the first ran)."""
    try:
        st = os.stat(path)
    except OSError:
        return f"missing:{path}"
    if not os.path.isfile(path):
        return f"missing:{path}"
    if max(st.st_mtime_ns, st.st_ctime_ns) >= time.time_ns() - RACY_MARGIN_NS:
        return f"sha1:{file_sha1(path)}"     # just written: a change now could keep its stat
    return f"sha1:{_stamped_sha1(os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns)}"


@functools.lru_cache(maxsize=64)
def _stamped_sha1(path: str, size: int, mtime_ns: int, ctime_ns: int) -> str:
    return file_sha1(path)


def short(digest):
    """The first 8 characters of a hex digest (``None`` stays ``None``)."""
    return digest[:8] if digest else digest


class HashCache:
    """SHA-1 of files, remembered across runs by ``(size, mtime_ns, ctime_ns)``.

    ``path`` is the JSON file (``None``: in memory only). A missing, unreadable or foreign cache
    file is ignored (everything is hashed again). Call :meth:`save` after use; concurrent writers
    merge with what is on disk and the last one wins, which at worst costs a re-hash.
    """

    def __init__(self, path=None):
        self.path = Path(path) if path else None
        self._entries = {}  # absolute path -> [size, mtime_ns, ctime_ns, sha1]
        self._racy = set()  # hashed this run, too recently changed to be stored
        self.n_read = 0  # files read and hashed by this instance
        self.n_cached = 0  # answered from the stat cache
        self._dirty = False
        if self.path is not None:
            self._entries = self._load(self.path)

    @staticmethod
    def _load(path):
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            logger.warning("hash cache %s unreadable (%s); hashing files again", path, err)
            return {}
        if not isinstance(data, dict) or data.get("version") != HASH_CACHE_VERSION:
            return {}
        files = data.get("files")
        if not isinstance(files, dict):
            return {}
        return {k: v for k, v in files.items() if isinstance(v, list) and len(v) == 4}

    def sha1(self, path):
        """SHA-1 of ``path``'s content; reads the file only when its ``stat`` is not cached.

        Raises ``FileNotFoundError`` for a missing file.
        """
        key = os.path.abspath(path)
        st = os.stat(key)  # before reading: a change while hashing shows up in the next stat
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        entry = self._entries.get(key)
        if entry is not None and entry[:3] == stamp:
            self.n_cached += 1
            return entry[3]
        started = time.time_ns()
        digest = file_sha1(key)
        self.n_read += 1
        self._entries[key] = stamp + [digest]
        if max(st.st_mtime_ns, st.st_ctime_ns) >= started - RACY_MARGIN_NS:
            self._racy.add(key)
        else:
            self._racy.discard(key)
        self._dirty = True
        return digest

    def save(self):
        """Write the cache (atomically) if anything was hashed; entries of deleted files go."""
        if self.path is None or not self._dirty:
            return
        merged = self._load(self.path)
        merged.update({k: v for k, v in self._entries.items() if k not in self._racy})
        for k in list(merged):
            if k in self._racy:
                del merged[k]
        merged = {k: v for k, v in merged.items() if os.path.exists(k)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        with replaced_when_written(self.path, tmp):
            tmp.write_text(json.dumps({"version": HASH_CACHE_VERSION, "files": merged},
                                      separators=(",", ":")), encoding="utf-8")
        self._dirty = False

    def stats(self):
        """``"N read, M from the hash cache"``."""
        return f"{self.n_read} read, {self.n_cached} from the hash cache"


# ----------------------------------------------------------------------------------------------
# cache records
# ----------------------------------------------------------------------------------------------
def record_path(path):
    """``<path>.opts.json``."""
    path = Path(path)
    return path.with_name(path.name + RECORD_SUFFIX)


def load_record(path):
    """``(record, None)`` for a format-2 record of ``path``, else ``(None, why)``.

    ``why`` is a phrase for the log: no record, an unreadable one, or one from an older version
    (format 1: options only). Never raises for a bad record: the caller redoes the work.
    """
    rec = record_path(path)
    if not rec.is_file():
        return None, "no cache record"
    try:
        data = json.loads(rec.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return None, f"cache record {rec} unreadable ({type(err).__name__}: {err})"
    if not isinstance(data, dict):
        return None, f"cache record {rec} unreadable (not a JSON object)"
    if data.get("format") != RECORD_FORMAT or not isinstance(data.get("options"), dict):
        if "format" not in data:
            return None, (f"cache record {rec} is from an older version (options only, no "
                          "content hashes)")
        return None, f"cache record {rec} has unknown format {data.get('format')!r}"
    return data, None


def save_record(path, step, options, **content):
    """Write the format-2 record of ``path`` (atomically): ``options`` plus content keys."""
    rec = record_path(path)
    data = dict(content, format=RECORD_FORMAT, step=step, options=options)
    data = json.loads(json.dumps(data))  # JSON types, as compared on the next run
    rec.parent.mkdir(parents=True, exist_ok=True)
    with replaced_when_written(rec, rec.with_name(rec.name + ".tmp")) as tmp:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return data


def as_stored(value):
    """``value`` as it reads back from JSON (tuples become lists, int keys strings...)."""
    return json.loads(json.dumps(value))


def option_changes(old, new):
    """``["seed changed (1 -> 2)", ...]`` for the keys that differ between two option dicts."""
    old, new = as_stored(old or {}), as_stored(new)
    out = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            out.append(f"{key} changed ({_brief(old.get(key))} -> {_brief(new.get(key))})")
    return out


def _brief(value, limit=80):
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def input_changes(old, new, what="input file"):
    """Phrases describing how ``{key: sha1}`` maps differ (changed, added, removed files)."""
    old = old or {}
    changed = [k for k in new if k in old and old[k] != new[k]]
    added = [k for k in new if k not in old]
    removed = [k for k in old if k not in new]
    out = []
    if changed:
        k = changed[0]
        if len(changed) == 1:
            out.append(f"{what} {k} changed (sha1 {short(old[k])} -> {short(new[k])})")
        else:
            out.append(f"{len(changed)} {what}s changed (e.g. {k}: sha1 {short(old[k])} -> "
                       f"{short(new[k])})")
    if added:
        out.append(f"{len(added)} {what}(s) added (e.g. {added[0]})")
    if removed:
        out.append(f"{len(removed)} {what}(s) removed (e.g. {removed[0]})")
    return out


def why_redo(path, options, inputs, step=None):
    """``None`` when ``path`` exists and its record has these ``options`` and ``inputs``
    (``{key: sha1}``); else a phrase saying why it must be made again (for the log)."""
    path = Path(path)
    record, problem = load_record(path)
    if not path.exists():
        return "not written yet" if record is None else f"{path.name} is missing"
    if record is None:
        return problem
    if step is not None and record.get("step") != step:
        return f"cache record {record_path(path)} belongs to step {record.get('step')!r}"
    reasons = option_changes(record["options"], options)
    reasons += input_changes(record.get("inputs"), inputs)
    return "; ".join(reasons) if reasons else None


def hash_inputs(files, base, cache):
    """``{key: sha1}`` of ``files``; keys are paths relative to ``base`` when under it."""
    base = Path(base)
    out = {}
    for f in files:
        f = Path(f)
        try:
            key = f.relative_to(base).as_posix()
        except ValueError:
            key = str(f)
        out[key] = cache.sha1(f)
    return out


def manifest_inputs(out_csv, options, files, base, step, skip_existing=True):
    """The content record of a manifest made from ``files`` (hashed relative to ``base``, with a
    hash cache beside ``out_csv``) and whether it must be (re)written: ``(inputs, redo)``; an
    up-to-date manifest is logged and left alone (``redo`` False)."""
    out_csv = Path(out_csv)
    hashes = HashCache(out_csv.parent / HASH_CACHE_NAME)
    inputs = hash_inputs(files, base, hashes)
    hashes.save()
    why = why_redo(out_csv, options, inputs, step=step)
    if skip_existing and why is None:
        logger.info("%s: up to date (same options, %d input files unchanged; %s), skipping",
                    out_csv, len(inputs), hashes.stats())
        return inputs, False
    logger.info("%s: %s, writing the manifest", out_csv, why or "rewrite asked")
    return inputs, True
