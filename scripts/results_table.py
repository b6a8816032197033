"""The equal-compute table of RESULTS.md from the run folders of the budget sweeps: test top-1 per budget and arm.

    python scripts/results_table.py runs/budget                                  # the table and the val search, on stdout
    python scripts/results_table.py runs/budget --plot docs/figures/equal_compute.png
    python scripts/results_table.py runs/budget --archive docs/results/budget      # keep the runs' records (KBs) in git
    python scripts/results_table.py docs/results/budget                            # the same tables from the records

Minutes compare only on one kind of machine: one table per host that the runs' summaries record.

The runs come from `configs/sweeps/budget_table.yaml` (`python scripts/sweep.py ... --out runs/budget`). Every choice is
made on val with seed 0 (the split of each budget, the probe's pretraining); test is read for the chosen runs only.
A run of the sweep without a readable summary (unfinished, crashed, damaged) is listed under each table, and the rows
and seeds it belongs to say so: its absence can change a choice. The reading and the choices are `vit.tools.results`.
"""

from __future__ import annotations

import argparse
import sys

from vit.cli import path_arg
from vit.errors import UserError, exit_on_user_error
from vit.tools.plots import check_output_folder, equal_compute_plot, png_path
from vit.tools.records import archive
from vit.tools.results import budget_table, markdown, read_budget_sweep


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="results_table.py", description="The equal-compute table of RESULTS.md from run folders")
    parser.add_argument("folder", type=path_arg, help="the --out folder of the budget sweeps, or an archive of their records")
    parser.add_argument("--archive", type=path_arg, help="also copy the runs' records (config, summary, budget) under this folder")
    parser.add_argument("--plot", type=path_arg, help="also draw test top-1 against the budget into this PNG")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        raise UserError(f"{args.folder} is not a folder of run folders")
    plot_to = png_path(args.plot) if args.plot else None  # bad outputs are refused before any work
    if args.archive:
        check_output_folder(args.archive, "--archive")
        if args.archive.resolve().is_relative_to(args.folder.resolve()):  # read again next time: every run twice
            raise UserError(f"--archive {args.archive} is inside {args.folder}, whose runs the next reading would find twice: "
                            "choose a folder outside it")  # fmt: skip
    hosts, unfinished = read_budget_sweep(args.folder)
    if not hosts:
        raise UserError(f"{args.folder} holds no finished run of the budget sweeps (scratch_m*, mae_*min_s*, ft_m*, random_probe_s*)"
                        + (f"; {len(unfinished)} unfinished: {', '.join(sorted(unfinished))}" if unfinished else ""))  # fmt: skip
    tables = {host: budget_table(runs, unfinished) for host, runs in hosts.items()}
    for host, (rows, random) in tables.items():
        print(f"Host: {host}\n\n{markdown(rows, random, unfinished)}\n")
    if plot_to:
        print(f"plot: {equal_compute_plot(tables, plot_to)}")
    if args.archive:
        written = archive(hosts, args.archive)
        left = f"; {len(unfinished)} unfinished run(s) left out: {', '.join(sorted(unfinished))}" if unfinished else ""
        print(f"archive: {len(written)} new record(s) under {args.archive}{left}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
