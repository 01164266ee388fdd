"""Method tags (``<method>[+<reset policy>]``), their paper order and plot colours: the one list the
registry, the report and the plots share (no torch import, so the report stays light)."""
import re
from typing import Tuple

#: Tags in the paper's table order; a tag not listed sorts after these, alphabetically.
ORDER = ("source", "suta", "sgem", "sdpl", "csuta", "csuta+dynamic", "csuta+fixed", "csuta+oracle",
         "awmc", "awmc+dynamic", "awmc+fixed", "awmc+oracle", "dsuta", "dsuta+dynamic",
         "dsuta+fixed", "dsuta+oracle",
         "tent", "eata", "eata+dynamic", "eata+fixed", "eata+oracle", "sar", "sar+dynamic",
         "sar+fixed", "sar+oracle", "cotta", "cotta+dynamic", "cotta+fixed", "cotta+oracle", "cea",
         "lame", "t3a", "t3a+dynamic", "t3a+fixed", "t3a+oracle", "foa", "foa+dynamic", "foa+fixed",
         "foa+oracle", "ebats", "ebats+dynamic", "ebats+fixed", "ebats+oracle")
COLORS = {"source": "black", "suta": "tab:blue", "sgem": "tab:orange", "sdpl": "tab:olive",
          "csuta": "tab:brown", "awmc": "tab:purple", "dsuta": "tab:green",
          "dsuta+dynamic": "tab:red", "dsuta+fixed": "tab:pink", "dsuta+oracle": "tab:cyan",
          "tent": "steelblue", "eata": "darkorange", "sar": "crimson", "cotta": "darkgreen",
          "cea": "orchid", "lame": "gold", "t3a": "teal", "foa": "navy", "ebats": "magenta"}
OTHER_COLORS = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d",
                "#386cb0")


def method_tag(name: str, reset: str = "none") -> str:
    """Results tag of a method + reset policy, e.g. ``dsuta+dynamic`` (``suta`` without one)."""
    return name if reset in (None, "", "none") else f"{name}+{reset}"


def without_steps(tag: str) -> str:
    """A grid's tag without its steps option (``suta_steps10_lr0.1`` -> ``suta_lr0.1``): the
    runs of a steps sweep are one method at several step counts."""
    return re.sub(r"_steps\d+(?=_|$)", "", tag)


def sort_key(tag: str) -> Tuple[int, str]:
    """Known tags in paper order (source first), others after them alphabetically."""
    return (ORDER.index(tag), "") if tag in ORDER else (len(ORDER), tag)


def color(tag: str) -> str:
    """One colour per tag, stable across plots and runs (grey is kept for boundaries)."""
    return COLORS.get(tag) or OTHER_COLORS[sum(map(ord, tag)) % len(OTHER_COLORS)]
