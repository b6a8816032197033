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
import json
import statistics
from pathlib import Path

from vit.errors import UserError, exit_on_user_error
from vit.store.runs import read_metrics


def slow_windows(run_dir: Path, steps: int, factor: float, every: int | None, epoch: int | None = None) -> dict:
    records = [r for r in read_metrics(run_dir)[0] if isinstance(r.get("time"), (int, float))]
    windows = [(p["step"], q["time"] - p["time"]) for p, q in zip(records, records[1:]) if q["step"] - p["step"] == steps]
    if not windows:
        raise UserError(f"{run_dir}: no window of {steps} steps between two records of its metrics.jsonl")
    median = statistics.median(seconds for _, seconds in windows)
    slow = [(step, seconds) for step, seconds in windows if seconds > factor * median]
    out = {"run": run_dir.name, "windows": len(windows), "median_seconds": round(median, 4), "slow": len(slow),
           "excess_seconds": round(sum(seconds - median for _, seconds in slow), 2), "slow_from_steps": [s for s, _ in slow]}  # fmt: skip
    if every:
        out[f"slow_from_a_multiple_of_{every}"] = sum(step % every == 0 for step, _ in slow)
    if epoch:  # the median epoch, its evaluation and end included, ending by or after the budget's measured steps
        ends = [r for r in records if r["step"] % epoch == 0]
        epochs = [(q["step"], q["time"] - p["time"]) for p, q in zip(ends, ends[1:]) if q["step"] - p["step"] == epoch]
        planned = (json.loads((run_dir / "budget.json").read_text()).get("measured_steps") if (run_dir / "budget.json").is_file() else None)
        if epochs and planned:
            before, after = [t for s, t in epochs if s <= planned], [t for s, t in epochs if s > planned]
            out["epoch_seconds_before_and_after_the_plan"] = [round(statistics.median(x), 3) if x else None for x in (before, after)]
    return out


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run folders (or archived records) holding metrics.jsonl")
    p.add_argument("--steps", type=int, default=50, help="a window's steps: the run's run.log_every (default 50)")
    p.add_argument("--factor", type=float, default=1.2, help="slow: more than this times the median window (default 1.2)")
    p.add_argument("--every", type=int, help="also count the slow windows that begin at a multiple of this many steps")
    p.add_argument("--epoch", type=int, help="an epoch's steps: also the median epoch ending by, and after, the step count a "
                   "budget measured before its plan (budget.json's measured_steps)")
    args = p.parse_args(argv)
    for run_dir in args.runs:
        print(json.dumps(slow_windows(run_dir, args.steps, args.factor, args.every, args.epoch)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
