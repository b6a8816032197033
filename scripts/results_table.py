"""The equal-compute table of RESULTS.md from the run folders of the budget sweeps: test top-1 per budget and arm.

    python scripts/results_table.py runs/budget                                  # the table and the val search, on stdout
    python scripts/results_table.py runs/budget --plot docs/figures/equal_compute.png

The runs come from `configs/sweeps/budget_*.yaml` (`python scripts/sweep.py ... --out runs/budget`). Every choice is
made on val with seed 0 (the split of each budget, the probe's pretraining); test is read for the chosen runs only.
The reading and the choices are `vit.results`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vit.errors import UserError, exit_on_user_error
from vit.results import budget_table, markdown, plot, read_budget_runs


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="results_table.py", description="The equal-compute table of RESULTS.md from run folders")
    parser.add_argument("folder", type=Path, help="the --out folder of the budget sweeps")
    parser.add_argument("--plot", type=Path, help="also draw test top-1 against the budget into this PNG")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        raise UserError(f"{args.folder} is not a folder of run folders")
    runs = read_budget_runs(args.folder)
    if not runs:
        raise UserError(f"{args.folder} holds no finished run of the budget sweeps (scratch_m*, pt_m*, ft_m*, probe_m*, random_probe_s*)")
    rows, random = budget_table(runs)
    print(markdown(rows, random))
    if args.plot:
        print(f"plot: {plot(rows, random, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
