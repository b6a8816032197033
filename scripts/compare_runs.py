"""Compare run folders: a markdown table (and CSV), overlaid training curves, and a report, from the folders alone.

    python scripts/compare_runs.py runs/*                                   # print the table
    python scripts/compare_runs.py runs/* --csv runs.csv --out report       # + CSV, figures and report/report.md
    python scripts/compare_runs.py runs --runs 'mae*' ft_cpu --out report
    python scripts/compare_runs.py runs/gpu1 --archive docs/results/gpu/search1 --with-metrics   # keep the records in git

A path is a run folder (it holds config.yaml, metrics.jsonl or summary.json) or a folder
of run folders. `--runs` keeps the runs whose folder names match (shell patterns).
Runs without summary.json are unfinished: listed as such, with what metrics.jsonl holds
so far. Everything is read from the run folders: no tracker, no network.

`--archive DEST` copies each finished run's record (config, summary, budget; `--with-metrics` adds metrics.jsonl) to
DEST/<host>/<run>, without the machine's paths, never over a different record (`vit.tools.records.archive`; adding
metrics.jsonl to the same record is allowed); the same command reads the records back: `compare_runs.py DEST/*`. The
runs left out (unfinished, or a config or summary that does not read) are named.

Runs of more than one host get a host column (a key, with the hosts under the table); the CSV always has the host.
`--csv` never replaces a file that is not a CSV this tool wrote, nor writes into a run folder; bad output paths are
refused in one line before anything is read or written.

Figures (in `--out`, each `vit.tools.plots.FIGSIZE` at `vit.tools.plots.DPI`): loss, accuracy and learning
rate against the optimiser step and against training time, a bar chart of the final accuracies,
and the accuracy of probes and fine-tunes against the pretraining time of their encoders.

The reading, the table and the report are `vit.tools.compare`; the figures are drawn by `vit.tools.plots`.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from vit.cli import path_arg
from vit.errors import UserError, exit_on_user_error
from vit.tools.compare import compare
from vit.tools.plots import check_output_folder
from vit.tools.records import archivable, archive, by_host


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="compare_runs.py", description="Compare run folders: table, CSV, curves and report.md")
    parser.add_argument("paths", nargs="+", help="run folders, or folders holding run folders (e.g. runs/*)")
    parser.add_argument("--csv", type=path_arg, help="also write the table, with every raw value, as CSV here")
    parser.add_argument("--out", type=path_arg, help="write the figures and report.md into this folder")
    parser.add_argument("--runs", nargs="+", metavar="NAME", help="keep only the runs whose folder names match (shell patterns)")
    parser.add_argument("--archive", type=path_arg, metavar="DEST", help="also copy the finished runs' records to DEST/<host>/<run>")
    parser.add_argument("--with-metrics", action="store_true", help="with --archive: copy metrics.jsonl too (the curves)")
    return parser.parse_args(argv)


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.with_metrics and not args.archive:
        raise UserError("--with-metrics goes with --archive DEST")
    if args.archive:
        check_output_folder(args.archive, "--archive")  # before the table: a bad destination is told before any work
    command = shlex.join(["python", "scripts/compare_runs.py", *(sys.argv[1:] if argv is None else argv)])
    result = compare(args.paths, args.out, args.csv, args.runs, command)
    print(result["table"])
    if result["csv"]:
        print(f"csv: {result['csv']}")
    if result["report"]:
        made = [p for p in result["figures"].values() if p]
        print(f"report: {result['report']} ({len(made)} figures in {args.out})")
    if args.archive:
        kept = [r for r in result["runs"] if archivable(r)]
        written = archive(by_host(kept), args.archive, metrics=args.with_metrics)
        left = [f"{r.name} ({'; '.join(['unfinished'] * (not r.finished) + r.problems)})" for r in result["runs"] if not archivable(r)]
        print(f"archive: {len(written)} new record(s) under {args.archive}" + (f"; left out, not finished or damaged: {', '.join(left)}" if left else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
