"""Progress bars for the long loops (synthesis, corruption, training; decoding uses SpeechBrain's
``--noprogressbar``). ``TTA_NOPROGRESSBAR=1`` (or a CLI's ``--noprogressbar``) turns them off;
a decode's ``--noprogressbar`` turns them off while its components are built (:func:`hidden`:
KenLM's reading bar, :mod:`tta_brain.asr.lm`)."""
import os
from contextlib import contextmanager

from tqdm import tqdm

ENV = "TTA_NOPROGRESSBAR"


def disable_progressbars() -> None:
    os.environ[ENV] = "1"


def shown() -> bool:
    """Whether progress bars are shown (``TTA_NOPROGRESSBAR`` unset or 0)."""
    return os.environ.get(ENV, "") in ("", "0")


@contextmanager
def hidden(when: bool = True):
    """Progress bars off inside the block when ``when`` (as before it after)."""
    before = os.environ.get(ENV)
    if when:
        os.environ[ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def progress(iterable=None, **kwargs):
    """``tqdm`` unless progress bars are turned off."""
    kwargs.setdefault("disable", not shown())
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, **kwargs)
