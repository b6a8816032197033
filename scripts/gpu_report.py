"""The table of `scripts/gpu_check.sh`'s figures: `python scripts/gpu_report.py runs/gpu_check`."""

from __future__ import annotations

import argparse
import sys

from vit.errors import exit_on_user_error
from vit.tools.gpu_report import report


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_report.py", description="The table of scripts/gpu_check.sh's figures")
    parser.add_argument("folder", help="the OUT folder of scripts/gpu_check.sh")
    folder = parser.parse_args(argv).folder
    if folder == "":  # Path("") is the current folder: its runs would be read, and curves.json written there
        parser.error("the folder is empty: name the OUT folder of scripts/gpu_check.sh")
    print(report(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
