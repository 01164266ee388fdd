"""Run identity: the fingerprint of what determines a run's result, stored in its checkpoint (and
summary) so that a folder is only ever resumed by the run that started it."""
import hashlib
from typing import Dict

__all__ = ["file_sha1", "fingerprint"]


def file_sha1(path) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(stream_csv, n_rows: int, tag: str) -> Dict:
    """The stream manifest's content and the method tag."""
    return {"stream_sha1": file_sha1(stream_csv), "n_rows": n_rows, "method": tag}
