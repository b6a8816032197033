"""The table of `scripts/gpu_check.sh`'s figures: `python scripts/gpu_report.py runs/gpu_check`."""

from __future__ import annotations

import sys

from vit.tools.gpu_report import report

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/gpu_report.py FOLDER (the OUT of scripts/gpu_check.sh)")
    print(report(sys.argv[1]))
