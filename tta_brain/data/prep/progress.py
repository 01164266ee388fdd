"""Progress bars for the long loops (synthesis, corruption, training; decoding uses SpeechBrain's
``--noprogressbar``). ``TTA_NOPROGRESSBAR=1`` (or a CLI's ``--noprogressbar``) turns them off."""
import os

from tqdm import tqdm

ENV = "TTA_NOPROGRESSBAR"


def disable_progressbars() -> None:
    os.environ[ENV] = "1"


def progress(iterable=None, **kwargs):
    """``tqdm`` unless progress bars are turned off."""
    kwargs.setdefault("disable", os.environ.get(ENV, "") not in ("", "0"))
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, **kwargs)
