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
continues an interrupted stage and redoes only the summaries of finished ones. The first
stage that fails stops the quickstart with one line and its exit code.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from vit.cli import split_overrides

ROOT = Path(__file__).resolve().parents[1]
DATA_ENV = "VIT_DATA"
RESERVED = ("run.dir", "run.name", "finetune.init")  # quickstart sets these itself: each stage must find the last


@dataclass(frozen=True)
class Stage:
    title: str
    module: str  # python -m <module>
    config: str  # relative to the repository
    run_name: str
    fast: tuple[str, ...]  # overrides added by --fast
    needs_encoder: bool = False  # gets finetune.init=<the pretraining run>


FAST_DATA = ("data.train_fraction=0.2", "data.val_size=1000")
STAGES = (
    Stage("MAE pretraining", "pretrain", "configs/pretrain/cpu.yaml", "mae", FAST_DATA + ("schedule.epochs=1", "schedule.warmup_epochs=0.2")),
    Stage(
        "linear probe",
        "finetune",
        "configs/finetune/linprobe_cpu.yaml",
        "linprobe",
        FAST_DATA + ("schedule.epochs=10", "schedule.warmup_epochs=1"),
        needs_encoder=True,
    ),  # fmt: skip
    Stage("fine-tuning", "finetune", "configs/finetune/cpu.yaml", "finetune", FAST_DATA + ("schedule.epochs=1", "schedule.warmup_epochs=0.2"), needs_encoder=True),
)


def shown_python() -> str:
    """`python` where that is the interpreter running us, else its full path (so the printed command is the one run)."""
    found = shutil.which("python")
    return "python" if found and Path(found).resolve() == Path(sys.executable).resolve() else sys.executable


def shown_path(path: Path) -> str:
    """`path` relative to the working directory when it lies below it (shorter commands), else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def budget_overrides(stage: Stage, minutes: float | None, pretrain_share: float) -> list[str]:
    """`schedule.budget_minutes` for the stages the budget covers: pretraining and fine-tuning."""
    if minutes is None or stage.run_name not in ("mae", "finetune"):
        return []
    share = pretrain_share if stage.run_name == "mae" else 1 - pretrain_share
    return [f"schedule.budget_minutes={round(minutes * share, 3):g}"]


def stage_command(stage: Stage, out: Path, data: str | None, fast: bool, extra: list[str]) -> list[str]:
    """The argv of one stage: `python -m <module> --config <yaml> data.root=... run.dir=... run.name=... ...`."""
    argv = [sys.executable, "-m", stage.module, "--config", shown_path(ROOT / stage.config)]
    argv += [f"data.root={data}"] if data else ["data.download=true"]
    argv += [f"run.dir={out}", f"run.name={stage.run_name}"]
    if stage.needs_encoder:
        argv.append(f"finetune.init={out / STAGES[0].run_name}")  # the run's group comes with its encoder
    else:
        argv.append(f"run.group={out.resolve().name}")
    argv.append("run.resume=auto")
    if fast:
        argv += list(stage.fast)
    return argv + extra


def compare_command(out: Path) -> list[str]:
    report = out / "report"
    runs = [str(out / s.run_name) for s in STAGES]
    return [
        sys.executable,
        shown_path(ROOT / "scripts" / "compare_runs.py"),
        *runs,
        "--out",
        str(report),
        "--csv",
        str(report / "runs.csv"),
    ]


def run_command(argv: list[str]) -> int:
    """Run one stage in the foreground and return its exit code.

    Ctrl-C reaches the stage too (same process group): the stage saves a resume state and
    exits, and we wait for it instead of killing it halfway through the save.
    """
    process = subprocess.Popen(argv)
    while True:
        try:
            return process.wait()
        except KeyboardInterrupt:
            continue


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Options before `--`; dotted overrides for every stage after it."""
    argv, extra = split_overrides(argv)
    parser = argparse.ArgumentParser(prog="quickstart.py", description="MAE pretraining -> linear probe -> fine-tuning -> comparison report",
                                     epilog="Overrides after -- go to every stage, e.g. -- optim.batch_size=128 run.seed=1")  # fmt: skip
    parser.add_argument("--data", help=f"CIFAR-10 location (default: ${DATA_ENV}, else a torchvision download)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/quickstart"),
        help="folder for the three run folders and the report (default runs/quickstart)",
    )
    parser.add_argument("--budget-minutes", type=float, help="wall minutes for pretraining + fine-tuning together (schedule.budget_minutes per stage)")
    parser.add_argument("--pretrain-share", type=float, default=0.5, help="the share of --budget-minutes that pretraining gets (default 0.5)")
    parser.add_argument("--fast", action="store_true", help="a fifth of the training images, 1000 validation images, one epoch (probe: 10)")
    args = parser.parse_args(argv)
    if args.budget_minutes is not None and args.budget_minutes <= 0:
        parser.error("--budget-minutes must be positive")
    if not 0 < args.pretrain_share < 1:
        parser.error("--pretrain-share must be between 0 and 1")
    for item in extra:
        key = item.split("=", 1)[0]
        if "=" not in item or "." not in key:
            parser.error(f"override {item!r} after -- must look like section.key=value")
        if key in RESERVED:
            parser.error(f"{key} is set by quickstart for each stage; choose the folder with --out")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    data = args.data or os.environ.get(DATA_ENV) or None
    if data is None and not any(o.startswith(("data.root=", "data.dataset=")) for o in extra):
        print(f"quickstart: no --data and no ${DATA_ENV}: the stages download CIFAR-10 into data.cache_dir if it is not there yet")
    out = args.out
    commands = [(s.title, stage_command(s, out, data, args.fast, budget_overrides(s, args.budget_minutes, args.pretrain_share) + extra))
                for s in STAGES]  # fmt: skip
    commands.append(("comparison report", compare_command(out)))
    for i, (title, command) in enumerate(commands, 1):
        print(f"\n[{i}/{len(commands)}] {title}\n$ {shlex.join([shown_python(), *command[1:]])}", flush=True)
        code = run_command(command)
        if code != 0:
            hint = "rerun the same command to resume it" if code in (130, 143) else "its message is above"
            print(f"quickstart: stopped: the {title} stage exited with code {code} ({hint})", file=sys.stderr, flush=True)
            return code
    print(f"\nquickstart: done. Report: {out / 'report' / 'report.md'} (figures and runs.csv beside it)")
    print(f"Look inside the encoder: python scripts/visualize.py --checkpoint {out / STAGES[0].run_name} --out {out / 'figures'}")
    print(f"Share it: python -m vit.export {out / STAGES[0].run_name} --out {out / 'export'} [--push USER/NAME]")
    if (out / "wandb").is_dir():
        print(f"The runs in wandb: browse them with `wandb leet {out / 'wandb'}`, upload them with `wandb sync {out / 'wandb'}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
