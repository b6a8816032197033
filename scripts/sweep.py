"""Run a set of training jobs, several at a time on one machine, and print their comparison table.

    python scripts/sweep.py configs/sweeps/cifar10_round2.yaml --out runs/round2 --parallel 4 -- data.root=PATH run.device=cuda
    python scripts/sweep.py configs/sweeps/budget_table.yaml --out runs/budget --only ft_m15_f50_s0 -- data.root=PATH

The sweep file's format, the jobs' command lines and the scheduling are `vit.tools.sweep`. Jobs start
in file order (or --only's) as workers free up; a job whose `init` failed is skipped. Each job's output goes to
<out>/<name>.log. The sweep exits non-zero when any job failed or was skipped; the table covers
the jobs that finished. A job whose run folder already holds summary.json is not run again: the
same command continues an interrupted sweep (unfinished jobs resume with run.resume=auto); a finished run that recorded
other settings than its job now gives is refused (exit 2) before anything starts.

Jobs run in the current folder, as if typed there: a relative --out and relative paths after -- are the current
folder's; a job's relative `config` is the current folder's, else the checkout's. Ctrl-C or SIGTERM stops the sweep:
the running jobs are sent SIGTERM (one that trains saves a resume state and exits; one still starting up ends at once),
one line says what each was left as, and the exit code is 130 / 143.
"""

from __future__ import annotations

import argparse
import sys
import time

from finetune.config import FinetuneConfig
from pretrain.config import PretrainConfig
from vit.cli import path_arg, split_overrides
from vit.errors import exit_on_user_error
from vit.tools.compare import compare
from vit.tools.sweep import Stopped, check_overrides, read_sweep, run_sweep, select_jobs


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    argv, extra = split_overrides(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="sweep.py", description="Run the jobs of a sweep file, several at a time, and compare them",
                                     epilog="Overrides after -- go to every job, e.g. -- data.root=PATH run.device=cuda")  # fmt: skip
    parser.add_argument("sweep", type=path_arg, help="the sweep file (YAML: common, jobs)")
    parser.add_argument("--out", type=path_arg, required=True, help="folder for the jobs' run folders and logs (relative to the current folder)")
    parser.add_argument("--only", nargs="+", metavar="JOB", help="run these jobs, in this order (and the jobs they start from)")
    parser.add_argument("--parallel", type=int, default=1, help="jobs at once (default 1); each takes cores/parallel CPU threads unless run.threads says")
    args = parser.parse_args(argv)
    if args.parallel < 1:
        parser.error("--parallel must be >= 1")
    extra = check_overrides(extra, "overrides after --")
    common, jobs, compile_cache = read_sweep(args.sweep)
    if args.only:
        jobs = select_jobs(jobs, args.only)
    out = args.out.expanduser().absolute()  # the jobs' run.dir and the table's run folders: the same folder
    started = time.perf_counter()
    try:
        configs = {"pretrain": PretrainConfig, "finetune": FinetuneConfig}
        outcome = run_sweep(jobs, out, common, extra, args.parallel, configs=configs, compile_cache=compile_cache)
    except Stopped as e:
        print(e, flush=True)
        return e.code
    print(f"sweep: {sum(v == 'ok' for v in outcome.values())}/{len(outcome)} jobs ok in {time.perf_counter() - started:.0f}s")
    finished = [str(out / name) for name, v in outcome.items() if v == "ok"]
    if finished:
        print_table(finished)  # its failure is told in one line and leaves the sweep's exit code to the jobs
    return 0 if all(v == "ok" for v in outcome.values()) else 1


@exit_on_user_error
def print_table(runs: list[str]) -> int:
    """The table `scripts/compare_runs.py RUN...` prints, computed in this process (its packages are imported already:
    no second interpreter to start)."""
    print(compare(runs)["table"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
