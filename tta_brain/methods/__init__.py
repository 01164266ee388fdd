"""TTA methods, one short file each, registered by name in ``METHODS`` (see ``registry``)."""
from tta_brain.methods.base import DEFAULT_PARAMS, Event, TTAMethod, UttInfo
from tta_brain.methods.registry import METHODS, build_method, register
from tta_brain.methods.source import Source
from tta_brain.methods.suta import SUTA
from tta_brain.methods.sdpl import SDPL
from tta_brain.methods.sgem import SGEM
from tta_brain.methods.csuta import CSUTA
from tta_brain.methods.awmc import AWMC
from tta_brain.methods.dsuta import DSUTA
from tta_brain.methods.lame import LAME
from tta_brain.methods.t3a import T3A
from tta_brain.methods.foa import FOA
from tta_brain.methods.ebats import EBATS
from tta_brain.methods.tent import Tent
from tta_brain.methods.eata import EATA
from tta_brain.methods.sar import SAR
from tta_brain.methods.cotta import CoTTA
from tta_brain.methods.cea import CEA

__all__ = ["METHODS", "TTAMethod", "UttInfo", "Event", "DEFAULT_PARAMS", "build_method",
           "register", "Source", "SUTA", "SDPL", "SGEM", "CSUTA", "AWMC", "DSUTA",
           "Tent", "EATA", "SAR", "CoTTA", "CEA", "LAME", "T3A", "FOA", "EBATS"]
