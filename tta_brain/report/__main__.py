"""``python -m tta_brain.report --exp_dir <root>``: RESULTS.md and plots of a tree of runs."""
import sys

from tta_brain.report.results import main

if __name__ == "__main__":
    sys.exit(main())
