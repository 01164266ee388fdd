"""The checkpoint protocol of a run: what a resume needs (stream cursor, the method's whole state,
every RNG, the record files' byte lengths, time spent, the run's fingerprint), saved atomically
through SpeechBrain's ``Checkpointer`` and recovered only from complete checkpoints.

A checkpoint directory counts as complete once its ``stream.ckpt`` exists; that file is written
last, via a temporary file and a rename, so a ``kill -9`` mid-save leaves an incomplete directory
that :func:`recover` removes.
"""
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
from tta_brain import quirks  # noqa: F401  (first: SpeechBrain without its torch quirks)
from speechbrain.utils.checkpoints import (mark_as_loader, mark_as_saver,
                                          register_checkpoint_hooks)

from tta_brain.data.cache import damaged_zip, replaced_when_written, save_to
from tta_brain.run import identity
from tta_brain.run.envinfo import numerics

logger = logging.getLogger(__name__)

__all__ = ["StreamState", "ResumeError", "recover", "save", "get_rng_state", "set_rng_state",
           "checkpoint_files", "saved_fingerprint", "STATE_FILE"]

STATE_FILE = "stream.ckpt"


class ResumeError(RuntimeError):
    """The output folder's checkpoint does not fit this run (another stream or method, records
    missing or shorter than the checkpoint says)."""


def get_rng_state() -> Dict:
    """Every RNG a method may draw from: torch (CPU and CUDA), numpy, Python."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "python" in state:
        random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():   # GPUs this process has
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]][:torch.cuda.device_count()])


@register_checkpoint_hooks
class StreamState:
    """What a resumed run needs, saved and loaded by the checkpointer."""

    def __init__(self, method, fingerprint: Optional[Dict] = None):
        self.method = method
        self.cursor = 0                 # stream rows consumed (decoded or rejected)
        self.wall_time = 0.0
        self.audio_time = 0.0
        self.offsets: Dict[str, int] = {}   # record file -> bytes at the checkpoint
        self.fingerprint = fingerprint
        # the distinct numerics (envinfo.numerics: threads, versions; batched: a sweep's run,
        # whose batched passes round otherwise) the run's rows were decoded under, in order: more
        # than one is a run resumed under others (brain.start_stream says so)
        self.numerics = [self._numerics()]

    def _numerics(self) -> Dict:
        out = numerics()
        if getattr(self.method, "batch", None) is not None:     # a run of a batched sweep
            out["batched"] = True
        return out

    @mark_as_saver
    def _save(self, path):
        sd = {"cursor": self.cursor, "wall_time": self.wall_time, "audio_time": self.audio_time,
              "offsets": dict(self.offsets), "fingerprint": self.fingerprint,
              "method": self.method.state_dict(), "rng": get_rng_state(),
              "numerics": list(self.numerics)}
        path = Path(path)
        with replaced_when_written(path, path.with_name(path.name + ".tmp")) as tmp:
            try:
                with open(tmp, "wb") as f:
                    save_to(sd, f)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:            # (the close's flush may fail again: name the file)
                raise OSError(e.errno, e.strerror, str(tmp)) from None

    @mark_as_loader
    def _load(self, path, end_of_epoch=False):
        # the method's tensors go straight to the model's device (phi_D, DSUTA's buffer)
        device = getattr(getattr(self.method, "lobe", None), "device", "cpu")
        why = damaged_zip(path)           # torch.load would read a damaged tensor as it is
        if why:
            raise ResumeError(f"{path}: the checkpoint is damaged ({why}); delete "
                              f"{Path(path).parent.parent} to start over")
        try:        # cut short (no zip archive any more), empty, or not torch.save's
            sd = torch.load(path, map_location=device, weights_only=False)
        except Exception as e:
            raise ResumeError(f"{path}: the checkpoint cannot be read ({_said(e)}); delete "
                              f"{Path(path).parent.parent} to start over") from None
        if not isinstance(sd, dict) or "cursor" not in sd:
            raise ResumeError(f"{path}: not a checkpoint of a tta_brain run; delete "
                              f"{Path(path).parent.parent} to start over")
        old = sd.get("fingerprint")
        # the folder's rule (identity.differences): keys added since the checkpoint was written
        # take the values it computed with, so a checkpoint of an older tta_brain resumes
        diffs = (identity.differences(old, self.fingerprint)
                 if self.fingerprint is not None and old is not None else [])
        if diffs:
            raise ResumeError(
                f"{path}: the checkpoint is from another run ({'; '.join(diffs)}). Use another "
                f"--output_folder, or delete {Path(path).parent.parent} to start over.")
        if "offsets" not in sd:
            raise ResumeError(f"{path}: checkpoint written by an older version (no record "
                              f"offsets); delete {Path(path).parent.parent} to start over")
        self.cursor, self.wall_time, self.audio_time = sd["cursor"], sd["wall_time"], sd["audio_time"]
        self.offsets = sd["offsets"]
        self.method.load_state_dict(sd["method"])
        set_rng_state(sd["rng"])
        now = self._numerics()  # a checkpoint from before numerics were kept: not known
        self.numerics = list(sd.get("numerics") or [])
        if not self.numerics or self.numerics[-1] != now:
            self.numerics.append(now)


def recover(checkpointer) -> bool:
    """Load the newest complete checkpoint (incomplete ones are removed); True if one was loaded."""
    if checkpointer is None:
        return False
    ckpt_dir = Path(checkpointer.checkpoints_dir)
    if ckpt_dir.is_dir():
        for d in ckpt_dir.glob("CKPT+*"):
            if d.is_dir() and not (d / STATE_FILE).is_file():
                logger.warning("Removing incomplete checkpoint %s (interrupted while saving)", d)
                shutil.rmtree(d, ignore_errors=True)
        for d in sorted(ckpt_dir.glob("CKPT+*")):
            why = _unreadable_yaml(d)
            if why:
                raise ResumeError(f"{why}; delete {ckpt_dir} to start over")
    try:
        ckpt = checkpointer.recover_if_possible(
            ckpt_predicate=lambda c: (Path(c.path) / STATE_FILE).is_file())
    except ResumeError:
        raise
    except Exception as e:       # one line, whatever part of it SpeechBrain could not read
        raise ResumeError(f"{ckpt_dir}: the newest checkpoint cannot be read ({_said(e)}); "
                          f"delete {ckpt_dir} to start over") from e
    return ckpt is not None


#: SpeechBrain's yaml files in a checkpoint directory: its meta and the Brain's counters.
YAML_FILES = ("CKPT.yaml", "brain.ckpt")


def checkpoint_files(folder) -> List[Path]:
    """The state files of ``folder``'s complete checkpoints (``save/CKPT+*/stream.ckpt``; one
    being written has its ``.tmp`` name), oldest first."""
    return sorted(Path(folder).glob(f"save/CKPT+*/{STATE_FILE}"))


def saved_fingerprint(folder) -> Optional[Dict]:
    """The fingerprint in ``folder``'s newest complete checkpoint (:func:`checkpoint_files`);
    None without one, or when it cannot be read (its run says so when it recovers it)."""
    found = checkpoint_files(folder)
    if not found:
        return None
    try:
        sd = torch.load(found[-1], map_location="cpu", weights_only=False)
    except Exception:       # noqa: BLE001 - cut short or not torch's: recover() says which
        return None
    return sd.get("fingerprint") if isinstance(sd, dict) else None


def _unreadable_yaml(d: Path) -> Optional[str]:
    """Why one of a complete checkpoint's :data:`YAML_FILES` cannot be read (None: they can):
    SpeechBrain read a cut one with a traceback."""
    import yaml
    if not (d / STATE_FILE).is_file():
        return None
    for name in YAML_FILES:
        path = d / name
        if not path.is_file():
            continue
        try:
            value = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            return f"{path}: the checkpoint cannot be read ({_said(e)})"
        if not isinstance(value, dict):
            return f"{path}: the checkpoint cannot be read (no key: value mapping; cut short?)"
    return None


def _said(e: BaseException) -> str:
    """An exception as a short part of one line."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:160]}" if text else type(e).__name__


def save(checkpointer, state: StreamState, writer) -> None:
    """fsync the records, note their lengths in ``state`` and save one checkpoint (keep one)."""
    state.offsets = writer.sync()
    # importance_keys: a fresh list each call. SpeechBrain 1.1.2 appends ckpt_recency to the
    # list it is given, and its default is one list shared by every call in the process: each
    # save then weighed every earlier save's key (2 listings of the folder each), so the n-th
    # save of a process read its checkpoint's yaml ~4n times (a sweep's 20th tiny run: 4.6 s,
    # its 2nd: 2.1 s; a live stream saving every utterance grew quadratically)
    checkpointer.save_and_keep_only(meta={"cursor": state.cursor}, num_to_keep=1,
                                    importance_keys=[], verbosity=logging.DEBUG)
