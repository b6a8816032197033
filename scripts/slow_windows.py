"""Where a run's training time went between its metrics records: the windows of `--steps` steps that took more than
`--factor` times the median one, how much more in all, and at which steps they began (RESULTS.md, "One GPU: the
table", reads the 2.5-minute stages' resume states and evaluations off them).

    python scripts/slow_windows.py docs/results/gpu/table/nvidia-h100-80gb-hbm3-bf16/ft_m5_f50_s0 --every 500

A window runs from one record to the next (`time`, the training clock, and `step` of metrics.jsonl); `--every N` also
counts the slow windows that begin at a multiple of N steps (where `run.save_every=N` wrote a state). Prints one JSON
line per run folder.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from pathlib import Path

from vit.cli import path_arg, refuse_below
from vit.errors import UserError, exit_on_user_error
from vit.store.runs import BUDGET_FILE, METRICS_FILE, read_budget, read_metrics
from vit.store.values import is_count, is_finite, is_whole


def timed_records(run_dir: Path) -> tuple[list[dict], int]:
    """The records of `run_dir`'s metrics.jsonl that carry the training clock (`time`), and how many lines could not be read.

    A folder without metrics.jsonl, a step that is not a whole number, a clock that is not a number of seconds >= 0 or
    that runs back is a UserError naming the file: each would make windows up or leave them out unsaid.
    """
    path = run_dir / METRICS_FILE
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a folder (a run folder holding {METRICS_FILE})")
    if not path.is_file():
        raise UserError(f"{run_dir} holds no {METRICS_FILE}")
    records, unreadable = read_metrics(run_dir)
    timed = [r for r in records if "time" in r]  # a record without the clock (a final test's) is no window's end
    for r in timed:
        step, seconds = r["step"], r["time"]
        if not is_whole(step):
            raise UserError(f"{path}: step {step!r} is not a whole number")
        if not (is_finite(seconds) and seconds >= 0):
            raise UserError(f"{path}: the record of step {step} has time {seconds!r}, not a number of seconds >= 0")
    for p, q in itertools.pairwise(timed):
        if q["time"] < p["time"]:
            raise UserError(f"{path}: the clock runs back from {p['time']} s at step {p['step']} to {q['time']} s at step {q['step']}")
    return timed, unreadable


def measured_steps(run_dir: Path) -> int | None:
    """budget.json's measured_steps (the steps a time budget timed before its plan), None without a budget."""
    budget = read_budget(run_dir)  # not JSON, not UTF-8: a UserError naming it
    steps = budget.get("measured_steps") if isinstance(budget, dict) else None
    if budget is not None and not (steps is None or is_count(steps)):
        raise UserError(f"{run_dir / BUDGET_FILE}: measured_steps is {steps!r}, not a step count")
    return steps


def slow_windows(run_dir: Path, steps: int, factor: float, every: int | None, epoch: int | None = None) -> dict:
    records, unreadable = timed_records(run_dir)
    windows = [(p["step"], q["time"] - p["time"]) for p, q in itertools.pairwise(records) if q["step"] - p["step"] == steps]
    if not windows:
        raise UserError(f"{run_dir}: no window of {steps} steps between two records of its {METRICS_FILE}")
    median = statistics.median(seconds for _, seconds in windows)
    slow = [(step, seconds) for step, seconds in windows if seconds > factor * median]
    out = {"run": run_dir.name, "windows": len(windows), "median_seconds": round(median, 4), "slow": len(slow),
           "excess_seconds": round(sum(seconds - median for _, seconds in slow), 2), "slow_from_steps": [s for s, _ in slow]}  # fmt: skip
    if unreadable:  # a damaged line drops the windows on either side of it: say so
        out["unreadable_lines"] = unreadable
    if every:
        out[f"slow_from_a_multiple_of_{every}"] = sum(step % every == 0 for step, _ in slow)
    if epoch:  # the median epoch, its evaluation and end included, ending by or after the budget's measured steps
        ends = [r for r in records if r["step"] % epoch == 0]
        epochs = [(q["step"], q["time"] - p["time"]) for p, q in itertools.pairwise(ends) if q["step"] - p["step"] == epoch]
        planned = measured_steps(run_dir)
        key = "epoch_seconds_before_and_after_the_plan"
        if not planned:  # asked for and left out, it read as if the run had no such epochs
            out[key] = f"no plan: {run_dir.name} has no {BUDGET_FILE} with measured_steps (a run without schedule.budget_minutes)"
        elif not epochs:
            out[key] = f"no two records {epoch} steps apart at multiples of {epoch} steps (is --epoch a multiple of run.log_every?)"
        else:
            before, after = [t for s, t in epochs if s <= planned], [t for s, t in epochs if s > planned]
            out[key] = [round(statistics.median(x), 3) if x else None for x in (before, after)]
    return out


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=path_arg, help="run folders (or archived records) holding metrics.jsonl")
    p.add_argument("--steps", type=int, default=50, help="a window's steps: the run's run.log_every (default 50)")
    p.add_argument("--factor", type=float, default=1.2, help="slow: more than this times the median window (default 1.2)")
    p.add_argument("--every", type=int, help="also count the slow windows that begin at a multiple of this many steps")
    p.add_argument("--epoch", type=int, help="an epoch's steps: also the median epoch ending by, and after, the step count a "
                   "budget measured before its plan (budget.json's measured_steps)")
    args = p.parse_args(argv)
    refuse_below(p, args, {"steps": 1, "every": 1, "epoch": 1})  # step counts
    if not (math.isfinite(args.factor) and args.factor >= 1):  # below 1, windows faster than the median would count as slow
        p.error(f"--factor must be a number >= 1, not {args.factor}")
    for run_dir in args.runs:
        print(json.dumps(slow_windows(run_dir, args.steps, args.factor, args.every, args.epoch)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
