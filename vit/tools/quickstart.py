"""The quickstart pipeline: MAE pretraining -> linear probe -> fine-tuning -> comparison report, as the commands a person types.

    commands = plan(out, data, extra, report_script, fast=True)      # [(title, argv)], in order
    code = quickstart(out, data, extra, report_script)              # runs them, each printed first; the first failure stops it

Each stage is the ordinary entry point (`python -m pretrain|finetune --config configs/...`, run
folder OUT/<stage>, run.resume=auto), run as a subprocess and printed first, so every command can
be copied and rerun alone; run again, quickstart keeps the stages that finished with the same settings; the probe and the fine-tune start from the pretraining run's encoder
(and join its wandb group through it). A time budget is split between pretraining and
fine-tuning (`schedule.budget_minutes` each); the linear probe runs outside it. The report is
`report_script` (the compare_runs command line) over the three run folders.
`scripts/quickstart.py` is its command line.
"""

from __future__ import annotations

import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from vit.config import load_config
from vit.errors import EXIT_USER_ERROR, ConfigError, UserError
from vit.store.runs import holds_run, is_finished
from vit.tools.compare import REPORT_FILE, check_outputs
from vit.tools.kept import job_differences, job_inputs
from vit.tools.plots import check_output_folder
from vit.tools.sweep import Job

ROOT = Path(__file__).resolve().parents[2]  # the checkout: the stages' configs are named relative to it
DATA_ENV = "VIT_DATA"  # where the data is when --data is not given
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
    # Six significant digits, not three decimals: a stage's share under 0.0005 minutes was rounded to 0, which that stage
    # refused only once the stages before it had run.
    return [f"schedule.budget_minutes={minutes * share:.6g}"]


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


def compare_command(out: Path, report_script: Path) -> list[str]:
    """The argv of the report: `report_script` over the three run folders, figures and report.md into OUT/report."""
    report = out / "report"
    runs = [str(out / s.run_name) for s in STAGES]
    return [sys.executable, shown_path(report_script), *runs, "--out", str(report), "--csv", str(report / "runs.csv")]


def plan(out: Path, data: str | None, extra: list[str], report_script: Path, fast: bool = False,
         budget_minutes: float | None = None, pretrain_share: float = 0.5) -> list[tuple[str, list[str]]]:  # fmt: skip
    """(title, argv) of every step in order: the three stages, each with `extra` last, then the comparison report."""
    stages = [(s.title, stage_command(s, out, data, fast, budget_overrides(s, budget_minutes, pretrain_share) + extra)) for s in STAGES]
    return stages + [("comparison report", compare_command(out, report_script))]


def run_command(argv: list[str]) -> int:
    """Run one stage in the foreground and return its exit code.

    Ctrl-C reaches the stage too (same process group): the stage saves a resume state and exits, and we wait for it
    instead of killing it halfway through the save. A SIGTERM sent to quickstart alone (`kill PID`) is passed on to the
    stage, which does the same: before, the stage went on training with no quickstart waiting for it, and no report came.
    """
    process = subprocess.Popen(argv)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: process.send_signal(signum))
    try:
        while True:
            try:
                return process.wait()
            except KeyboardInterrupt:
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)


def check_plan(out: Path, commands: list[tuple[str, list[str]]], configs: dict[str, type]) -> None:
    """Refuse, before any stage runs, what would stop a later stage only once the ones before it had trained (an hour
    on CPU): its settings (`-- mae.mask_ratio=0.6` reached the linear probe, which has no `mae` section), its run folder
    (a file), the report's folder (a report.md compare_runs.py did not write), and a probe or fine-tune of an encoder
    that is trained again (quickstart kept them as finished, and the report paired them with the new encoder).
    configs: {stage module: the config class it parses} (the stages import this package, not it them)."""
    for (title, argv), folder in zip(commands, [out / s.run_name for s in STAGES] + [None]):
        try:
            if folder is not None:  # python -m STAGE --config YAML overrides...
                load_config(configs[argv[2]], argv[4], argv[5:])
                check_output_folder(folder, "run folder")
            else:
                check_outputs(Path(argv[argv.index("--out") + 1]), Path(argv[argv.index("--csv") + 1]))
        except UserError as e:
            raise ConfigError(f"the {title} stage would stop: {e}; nothing was run") from None
    encoder = out / STAGES[0].run_name
    started = [str(out / s.run_name) for s in STAGES if s.needs_encoder and holds_run(out / s.run_name)]
    if started and not is_finished(encoder):
        one = len(started) == 1
        raise ConfigError(f"{' and '.join(started)} {'holds a run' if one else 'hold runs'} from an encoder of {encoder}, which holds no "
                          f"finished run and is trained again now: delete {'that run folder' if one else 'those run folders'} too, or "
                          "choose another --out")  # fmt: skip


def finished_earlier(command: list[str]) -> Path | None:
    """The run folder of a stage command (`python -m STAGE --config YAML overrides...`) when it holds a run that finished
    with the settings the command gives: kept, not entered again (a finished run resumed would evaluate again and write
    its summary over the first one). None when there is none; a finished run of other settings is a ConfigError."""
    if command[1] != "-m":
        return None  # the report: written again from the runs
    given = dict(item.split("=", 1) for item in command if item.startswith(("run.dir=", "run.name=")))
    run_dir = Path(given["run.dir"]) / given["run.name"]
    if not is_finished(run_dir):
        return None
    differ = job_differences(job_inputs(Job(given["run.name"], command[2], command[4], command[5:]), [], []), run_dir)
    if differ:
        raise ConfigError(f"{run_dir} holds a finished run of other settings ({', '.join(differ[:4])}); "
                          "use another --out, or delete that run folder to run the stage again")  # fmt: skip
    return run_dir


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def run_stages(commands: list[tuple[str, list[str]]], runner: Callable[[list[str]], int] = run_command) -> int:
    """Run each command with `runner`, printed first as a person would type it; returns 0, or the exit code of the first
    that failed. A stage whose run finished earlier with the same settings is kept (`finished_earlier`)."""
    for i, (title, command) in enumerate(commands, 1):
        print(f"\n[{i}/{len(commands)}] {title}\n$ {shlex.join([shown_python(), *command[1:]])}", flush=True)
        try:
            kept = finished_earlier(command)
        except ConfigError as e:
            print(f"error: {e}\nquickstart: stopped at the {title} stage", file=sys.stderr, flush=True)
            return EXIT_USER_ERROR
        if kept is not None:
            print(f"quickstart: {kept} finished earlier with these settings: kept", flush=True)
            continue
        code = runner(command)
        if code < 0:  # ended by a signal before it could say anything (SIGTERM while it set up): the shell's code for it
            print(f"quickstart: stopped: the {title} stage was ended by {signal_name(-code)} (rerun the same command to go on)",
                  file=sys.stderr, flush=True)  # fmt: skip
            return 128 - code
        if code != 0:
            hint = "rerun the same command to resume it" if code in (130, 143) else "its message is above"
            print(f"quickstart: stopped: the {title} stage exited with code {code} ({hint})", file=sys.stderr, flush=True)
            return code
    return 0


def quickstart(out: Path, data: str | None, extra: list[str], report_script: Path, fast: bool = False, budget_minutes: float | None = None,
               pretrain_share: float = 0.5, runner: Callable[[list[str]], int] = run_command) -> int:  # fmt: skip
    """The whole pipeline into `out` (`data` None: the stages download CIFAR-10), then where to look next. Returns its exit code."""
    if data is None and not any(o.startswith(("data.root=", "data.dataset=")) for o in extra):
        print(f"quickstart: no --data and no ${DATA_ENV}: the stages download CIFAR-10 into data.cache_dir if it is not there yet")
    code = run_stages(plan(out, data, extra, report_script, fast, budget_minutes, pretrain_share), runner)
    if code != 0:
        return code
    print(f"\nquickstart: done. Report: {out / 'report' / REPORT_FILE} (figures and runs.csv beside it)")
    print(f"Look inside the encoder: python scripts/visualize.py --checkpoint {out / STAGES[0].run_name} --out {out / 'figures'}")
    print(f"Share it: python -m pretrain.export {out / STAGES[0].run_name} --out {out / 'export'} [--push USER/NAME]")
    if (out / "wandb").is_dir():
        print(f"The runs in wandb: browse them with `wandb leet {out / 'wandb'}`, upload them with `wandb sync {out / 'wandb'}`")
    return 0
