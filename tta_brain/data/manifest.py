"""CSV manifests, SpeechBrain style.

Utterance manifest columns: ``ID,duration,wav,spk_id,wrd`` (+ optional columns). ``wav`` may start
with the ``$data_root`` placeholder, resolved at read time (as
``DynamicItemDataset.from_csv(..., replacements={"data_root": ...})`` does).

Stream manifest = utterance manifest + ``domain,segment,position`` (+ ``snr``, ``source_id``); rows
are in stream order, ``position`` is the 0-based index, ``segment`` the index of the contiguous
domain block (a true boundary is a position where ``segment`` changes).

Manifests are read as UTF-8, with or without a byte order mark (spreadsheet exports), and with
the :mod:`csv` module (a quoted value may hold commas or newlines). A record with fewer or more
fields than the header (e.g. a truncated last line) or malformed quoting raises
:class:`ManifestError` naming ``<file>:<line>``.

Preparation steps keep a cache record next to their output (``<file>.opts.json``); see
:mod:`tta_brain.data.cache` for the content-keyed format. :func:`is_up_to_date`,
:func:`stored_options` and :func:`save_options` are the options-only interface (format 1).
"""
import csv
import io
import json
import math
import os
import re
from pathlib import Path
from typing import Optional

from .cache import RECORD_FORMAT, record_path, replaced_when_written

UTT_COLUMNS = ("ID", "duration", "wav", "spk_id", "wrd")
STREAM_COLUMNS = UTT_COLUMNS + ("domain", "segment", "position")
#: Columns written right after the stream columns when present, in this order.
OPTIONAL_COLUMNS = ("snr", "source_id")
PLACEHOLDER = "$data_root"
_VARIABLE = re.compile(r"\$([\w.]+)")


class ManifestError(ValueError):
    """A manifest that is missing, malformed or lacks required columns."""


class ManifestNotFoundError(ManifestError, FileNotFoundError):
    """The manifest file does not exist."""


def _ordered_columns(rows, columns=None):
    if columns is not None:
        return list(columns)
    seen = []
    for row in rows:
        for key in row:
            if key not in seen:
                seen.append(key)
    first = [c for c in STREAM_COLUMNS + OPTIONAL_COLUMNS if c in seen]
    return first + [c for c in seen if c not in first]


def write_manifest(path, rows, columns=None):
    """Write ``rows`` (dicts) as CSV. Column order: the standard columns first, then the others in
    first-seen order (or exactly ``columns``). Written atomically (temporary file + rename)."""
    path, rows = Path(path), list(rows)
    text = manifest_text(rows, columns)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:    # a name read from a folder in another encoding (Latin-1 é)
        bad = next((str(v) for row in rows for v in row.values() if isinstance(v, str)
                    and not _is_utf8(v)), "?")
        raise ValueError(f"{path}: cannot write {bad!r} as UTF-8 text (a file or folder name in "
                         f"another encoding than UTF-8: rename it, e.g. with convmv)") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    with replaced_when_written(path, path.with_name(f".{path.name}.tmp")) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
    return path


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def manifest_text(rows, columns=None):
    """The exact text :func:`write_manifest` writes for ``rows`` (to compare without writing)."""
    rows = list(rows)
    cols = _ordered_columns(rows, columns)
    known = set(cols)
    out = io.StringIO(newline="")
    writer = csv.writer(out)
    writer.writerow(cols)
    for row in rows:
        if columns is not None and not known.issuperset(row):
            extra = ", ".join(repr(k) for k in row if k not in known)
            raise ValueError(f"row has fields not in the columns: {extra}")
        writer.writerow([_format_value(row.get(c, "")) for c in cols])
    return out.getvalue()


def _format_value(value):
    if isinstance(value, float):
        return f"{value:.6g}" if abs(value) < 1e6 else repr(value)
    return value


def read_manifest(path, replacements=None, lines=None):
    """Read a manifest into a list of dicts (all values strings, ``duration`` as float).

    With ``replacements`` (e.g. ``{"data_root": "/data"}``) every ``$name`` of a replacement in a
    value is replaced; ``$data_root`` without a value raises :class:`ManifestError`, and any other
    ``$`` is the value's own text (a folder or a transcript with ``$`` in it). Without it values are left as
    written, which keeps ``$data_root`` placeholders when rows are copied into a new manifest.
    With a list ``lines``, each row's line number in the file is appended to it.
    """
    path = Path(path)
    records = _records(path)
    try:
        return _read_rows(path, records, replacements, lines)
    finally:
        records.close()


def _read_rows(path, records, replacements, lines=None):
    """The rows; with a list ``lines``, each row's line number appended to it."""
    header = _header(path, records)
    if len(set(header)) != len(header):
        dup = next(c for c in header if header.count(c) > 1)
        raise ManifestError(f"{path}:1: column {dup!r} appears twice in the header")
    rows = []
    for line_no, fields in records:
        if not fields:  # a blank line
            continue
        if len(fields) != len(header):
            hint = ("truncated or malformed line" if len(fields) < len(header)
                    else "malformed line: a value with an unquoted comma?")
            raise ManifestError(f"{path}:{line_no}: {len(fields)} fields, the header has "
                                f"{len(header)} ({hint})")
        row = dict(zip(header, fields))
        if replacements is not None:
            row = {k: _substitute(v, replacements, path, line_no) for k, v in row.items()}
        if "duration" in row and row["duration"] != "":
            try:
                row["duration"] = float(row["duration"])
            except ValueError:
                raise ManifestError(
                    f"{path}:{line_no}: duration {row['duration']!r} is not a number") from None
            if not 0 <= row["duration"] < math.inf:      # nan too: every filter would drop it
                raise ManifestError(f"{path}:{line_no}: duration {row['duration']!r} is not a "
                                    f"length in seconds (a number >= 0)")
        rows.append(row)
        if lines is not None:
            lines.append(line_no)
    return rows


def first_non_utf8_line(path) -> int:
    """The number of the first line of ``path`` that is not UTF-8 (1 if none is)."""
    with open(path, "rb") as f:
        for i, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return i
    return 1


def _records(path):
    """``(line number, fields)`` of each CSV record of ``path``, the header first.

    The line number is the physical line where the record starts (a quoted value may span lines).
    UTF-8 with an optional byte order mark; strict quoting. Raises :class:`ManifestError` for a
    missing file, text that is not UTF-8 or malformed CSV (e.g. a quote left open by truncation).
    """
    if path.is_dir():
        raise ManifestError(f"{path}: a directory, not a manifest (a CSV file)")
    if not path.is_file():
        raise ManifestNotFoundError(f"manifest not found: {path}")
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f, strict=True)
        start = 1
        try:
            for fields in reader:
                yield start, fields
                start = reader.line_num + 1
        except csv.Error as err:
            hint = (" (truncated file?)" if "unexpected end of data" in str(err) else "")
            raise ManifestError(f"{path}:{reader.line_num}: malformed CSV: {err}{hint}") from None
        except UnicodeDecodeError as err:
            raise ManifestError(f"{path}:{first_non_utf8_line(path)}: not UTF-8 text "
                                f"({err.reason})") from None


def _header(path, records):
    first = next(records, None)
    if first is None or not first[1]:
        raise ManifestError(f"{path}: empty manifest (no header)")
    return first[1]


def _substitute(value, replacements, path, line_no):
    """``$name`` replaced where ``name`` is a replacement given or ``data_root`` (a manifest's
    placeholder: without a value, an error); any other ``$`` is the value's own text (a corpus
    folder named ``$5 set``, a transcript ``COSTS $5``: they were errors asking for ``--5=...``)."""
    if value is None or "$" not in value:
        return value

    def lookup(match):
        name = match.group(1)
        if name not in replacements and name != PLACEHOLDER[1:]:
            return match.group(0)
        if replacements.get(name) in (None, ""):
            raise ManifestError(f"{path}:{line_no}: value {value!r} needs ${name}; "
                                f"pass a replacement for {name!r} (e.g. --{name}=...)")
        return str(replacements[name])

    return _VARIABLE.sub(lookup, value)


def read_header(path):
    """Column names of a manifest."""
    path = Path(path)
    records = _records(path)
    try:
        return _header(path, records)
    finally:
        records.close()


def read_with_columns(path, required, replacements=None):
    """``(rows, line numbers)`` of manifest ``path`` (:func:`read_manifest`), a column of
    ``required`` that its header lacks being one :class:`ManifestError` naming them."""
    header = read_header(path)
    missing = [c for c in required if c not in header]
    if missing:
        raise ManifestError(f"{path}: missing required column(s) {', '.join(missing)} "
                            f"(found: {', '.join(header)})")
    lines = []
    return read_manifest(path, replacements=replacements, lines=lines), lines


def validate_manifest(path, required=UTT_COLUMNS, stream: Optional[bool] = None):
    """Check a manifest and return its rows (placeholders kept).

    Checks: the file exists; every column in ``required`` is present; it has rows; ``ID`` values are
    non-empty (and unique unless the manifest is a stream, where an utterance may recur);
    ``duration`` is numeric; for a stream (``stream=True``, or by default when ``position`` is
    required) positions (if present) are 0..n-1 in row order and ``segment`` (if present) starts
    at 0 and only grows by 1 where the block changes.
    Raises :class:`ManifestError` naming the file and the problem.
    """
    path = Path(path)
    rows, lines = read_with_columns(path, required)
    if not rows:
        raise ManifestError(f"{path}: manifest has a header but no rows")
    ids = [r.get("ID", "") for r in rows] if "ID" in rows[0] else []
    if any(not i for i in ids):
        raise ManifestError(f"{path}:{lines[ids.index('')]}: empty ID")
    is_stream = "position" in required if stream is None else stream
    if ids and not is_stream and len(set(ids)) != len(ids):
        first, seen = {}, None
        for i, utt in enumerate(ids):
            if utt in first:
                seen = i
                break
            first[utt] = i
        raise ManifestError(f"{path}:{lines[seen]}: duplicate ID {ids[seen]!r} (first at line "
                            f"{lines[first[ids[seen]]]})")
    if is_stream:
        _check_stream_order(path, rows, lines)
    return rows


def _check_stream_order(path, rows, lines):
    where = lambda i: f"{path}:{lines[i]}: ID {rows[i].get('ID', '')!r}"
    for i, row in enumerate(rows if "position" in rows[0] else ()):
        if str(row.get("position")) != str(i):
            raise ManifestError(f"{where(i)} has position {row.get('position')!r}, its row's "
                                f"index is {i}; stream rows must be in order with positions "
                                f"0..n-1")
    if "segment" in rows[0]:
        prev = -1
        for i, row in enumerate(rows):
            try:
                seg = int(row["segment"])
            except ValueError:               # was int()'s traceback
                raise ManifestError(f"{where(i)} has segment {row['segment']!r}; segments "
                                    f"are integers (the domain block's index)") from None
            if seg not in (prev, prev + 1) or (i == 0 and seg != 0):
                raise ManifestError(f"{where(i)} has segment {seg} after {prev}; "
                                    "segments must start at 0 and increase by 1 per block")
            prev = seg


def audio_duration(path):
    """Duration in seconds from the audio file header (soundfile, no decoding); a file it cannot
    read (empty, cut, not audio) is a ``ValueError`` naming it."""
    import soundfile as sf

    try:
        info = sf.info(str(path))
    except (RuntimeError, OSError) as e:     # soundfile.LibsndfileError is a RuntimeError
        why = (getattr(e, "error_string", None) or " ".join(str(e).split())).rstrip(".")
        raise ValueError(f"{path}: not readable as audio ({why}); a corpus file: extract it "
                         f"again") from None
    if not info.samplerate or info.frames <= 0:
        raise ValueError(f"{path}: no audio in it ({info.frames} frames); a corpus file: "
                         f"extract it again")
    return info.frames / float(info.samplerate)


def to_placeholder(path, data_root=None):
    """``$data_root/<relative path>`` if ``path`` is under ``data_root``, else the absolute path."""
    path = Path(path).resolve()
    if data_root:
        try:
            rel = path.relative_to(Path(data_root).resolve())
            return f"{PLACEHOLDER}/{rel.as_posix()}"
        except ValueError:
            pass
    return str(path)


_PATH_VARIABLE = re.compile(r"\$(?:(\w+)|\{(\w+)\})")


def expand_path(value, data_root="") -> str:
    """A path option outside a manifest (e.g. ``source_stats``): ``$data_root`` / ``${data_root}``
    and environment variables (``$TTA_SOURCE_STATS``) replaced, in one pass: a ``$`` in the data
    root's own path (``/data/$HOME run``) is not expanded again; unknown ones stay as written."""
    root = str(data_root or "")

    def lookup(match):
        name = match.group(1) or match.group(2)
        return root if name == "data_root" else os.environ.get(name, match.group(0))

    return _PATH_VARIABLE.sub(lookup, str(value or ""))


def resolve_path(value, data_root=None):
    """Inverse of :func:`to_placeholder` for one value."""
    if value.startswith(PLACEHOLDER):
        if not data_root:
            raise ManifestError(f"{value!r} uses {PLACEHOLDER} but no data_root was given")
        return str(Path(data_root) / value[len(PLACEHOLDER):].lstrip("/"))
    return value


def _opts_path(path):
    return record_path(path)


def stored_options(path):
    """Options recorded for ``path`` (cache record of format 1 or 2), or None."""
    opts = _opts_path(path)
    if not opts.is_file():
        return None
    try:
        data = json.loads(opts.read_text(encoding="utf-8"))
    except ValueError:
        return None
    if isinstance(data, dict) and data.get("format") == RECORD_FORMAT:
        return data.get("options")
    return data


def is_up_to_date(path, options):
    """True when ``path`` exists and its cache record has the same ``options`` (a JSON-able dict).

    Options only: steps whose output depends on file contents use :mod:`tta_brain.data.cache`.
    """
    if not Path(path).exists():
        return False
    stored = stored_options(path)
    return stored is not None and stored == json.loads(json.dumps(options))


def save_options(path, options):
    """Record the options that produced ``path`` (an options-only record, format 1)."""
    opts = _opts_path(path)
    opts.parent.mkdir(parents=True, exist_ok=True)
    with replaced_when_written(opts, opts.with_name(opts.name + ".tmp")) as tmp:
        tmp.write_text(json.dumps(options, indent=1, sort_keys=True) + "\n", encoding="utf-8")
