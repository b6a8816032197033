"""The main job in one command: MAE pretraining -> linear probe -> fine-tuning -> comparison report.

    python scripts/quickstart.py --data PATH                    # CIFAR-10 at PATH (cifar-10-batches-py, a train/<class>/ tree or a .tar.gz)
    VIT_DATA=PATH python scripts/quickstart.py --fast           # a fifth of the training images, one epoch per stage
    python scripts/quickstart.py --data PATH -- optim.batch_size=128 run.seed=1    # overrides for every stage

The stages run the best CPU recipe found (RESULTS.md, row 2: about an hour on 2 cores); --fast
is a few-minute smoke run of the same pipeline.

Each stage is the ordinary entry point, run as a subprocess and printed first, so every
command can be copied and rerun alone:

    python -m pretrain --config configs/pretrain/cpu.yaml data.root=PATH run.dir=OUT run.name=mae run.group=<OUT's name> run.resume=auto
    python -m finetune --config configs/finetune/linprobe_cpu.yaml ... run.name=linprobe finetune.init=OUT/mae
    python -m finetune --config configs/finetune/cpu.yaml ... run.name=finetune finetune.init=OUT/mae

With --budget-minutes M, pretraining and fine-tuning share M minutes of wall time
(`--pretrain-share f` of it for pretraining, the rest for fine-tuning), each stage fixing its
step count with `schedule.budget_minutes` on the machine it runs on; the linear probe
measures the encoder and runs its own recipe outside the budget.
    python scripts/compare_runs.py OUT/mae OUT/linprobe OUT/finetune --out OUT/report --csv OUT/report/runs.csv

The pretraining run sets the wandb group (the --out folder's name); the probe and the fine-tune
join it because their encoder comes from it, so wandb shows the three as one pipeline, and their
offline runs all land in OUT/wandb (`wandb sync OUT/wandb` uploads them).

Without --data or VIT_DATA the stages download CIFAR-10 (data.download=true) where the
network allows it. Every stage gets run.resume=auto, so running the same command again
continues an interrupted stage and keeps the finished ones. What a stage would refuse (its
settings, its run folder, the report's folder) is refused before the first stage starts; the first
stage that fails stops the quickstart with one line and its exit code.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from finetune.config import FinetuneConfig
from pretrain.config import PretrainConfig
from vit.cli import split_overrides
from vit.config import override_key
from vit.errors import exit_on_user_error
from vit.tools.quickstart import DATA_ENV, RESERVED, check_plan, plan, quickstart

REPORT_SCRIPT = Path(__file__).resolve().with_name("compare_runs.py")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Options before `--`; dotted overrides for every stage after it."""
    argv, extra = split_overrides(argv)
    parser = argparse.ArgumentParser(prog="quickstart.py", description="MAE pretraining -> linear probe -> fine-tuning -> comparison report",
                                     epilog="Overrides after -- go to every stage, e.g. -- optim.batch_size=128 run.seed=1")  # fmt: skip
    parser.add_argument("--data", help=f"CIFAR-10 location (default: ${DATA_ENV}, else a torchvision download)")
    parser.add_argument(
        "--out",
        default="runs/quickstart",
        help="folder for the three run folders and the report (default runs/quickstart)",
    )
    parser.add_argument(
        "--budget-minutes", type=float, help="wall minutes for pretraining + fine-tuning together (schedule.budget_minutes per stage)"
    )
    parser.add_argument("--pretrain-share", type=float, help="the share of --budget-minutes that pretraining gets (default 0.5)")
    parser.add_argument("--fast", action="store_true", help="a fifth of the training images, 1000 validation images, one epoch (probe: 10)")
    args = parser.parse_args(argv)
    # An unset shell variable (`--out "$OUT"`): the runs and the report went into the current folder, and `--data ""`
    # fell back to $VIT_DATA or a download instead of the data named.
    for flag, value, hint in (
        ("--out", args.out, "name the folder for the runs"),
        ("--data", args.data, "name CIFAR-10's folder or archive"),
    ):
        if value is not None and not value.strip():
            parser.error(f"{flag} is empty: {hint}")
    args.out = Path(args.out)
    # argparse's float takes nan and inf: nan passed `<= 0` and reached the first stage as its budget
    if args.budget_minutes is not None and not (math.isfinite(args.budget_minutes) and args.budget_minutes > 0):
        parser.error("--budget-minutes must be a positive number")
    if args.pretrain_share is not None and args.budget_minutes is None:
        parser.error("--pretrain-share splits --budget-minutes: give --budget-minutes too")  # else it was unused, unsaid
    args.pretrain_share = 0.5 if args.pretrain_share is None else args.pretrain_share
    if not 0 < args.pretrain_share < 1:
        parser.error("--pretrain-share must be between 0 and 1")
    for item in extra:
        key = override_key(item)  # as the stages read it: ` run.dir =x` sets run.dir
        if "=" not in item or "." not in key or key.startswith("-"):  # `-x.y=1` was an unknown option to each stage
            parser.error(f"override {item!r} after -- must look like section.key=value")
        if key in RESERVED:
            parser.error(f"{key} is set by quickstart for each stage; choose the folder with --out")
        if key == "schedule.budget_minutes" and args.budget_minutes is not None:
            # given last, it replaced both stages' shares and gave the linear probe a budget too
            parser.error("schedule.budget_minutes after -- and --budget-minutes both set the stages' budgets: give one")
        if key == "data.root" and args.data is not None:  # given last, it replaced --data in every stage, unsaid
            parser.error("data.root after -- and --data both name the data: give one")
    return args, extra


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    data = args.data or os.environ.get(DATA_ENV) or None
    commands = plan(args.out, data, extra, REPORT_SCRIPT, args.fast, args.budget_minutes, args.pretrain_share)
    check_plan(args.out, commands, {"pretrain": PretrainConfig, "finetune": FinetuneConfig})
    try:
        return quickstart(args.out, data, extra, REPORT_SCRIPT, args.fast, args.budget_minutes, args.pretrain_share)
    except KeyboardInterrupt:  # between two stages (a stage's own Ctrl-C is waited for): a traceback, not a line
        print("quickstart: interrupted between stages; run the same command again to go on", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
