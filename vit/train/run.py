"""One training run: its accelerator, folder, trackers and summary.

    run = Run.start(cfg, stage="pretrain")   # accelerator, threads, seed, the run folder (locked for the run's life)
    ...set up the stage (data, model, init)...
    run.ready()                               # the trackers start: a run that fails to set up leaves no tracker run
    ...train...
    run.finish(summary)                       # summary.json with the run's facts; trackers closed; the folder unlocked

The run folder's files are `vit.store.runs`'s; a second run of a live folder refuses (`vit.store.lock.lock_run`).
"""

from __future__ import annotations

import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from vit.config import RunConfig, dump_config, flat_keys, to_dict
from vit.device import host
from vit.errors import ConfigError
from vit.store.lineage import PARENT_RUN_ID, RUN_ID, git_commit, session, valid_id
from vit.store.lock import RunLock, lock_run
from vit.store.runs import (
    METRICS_FILE,
    SUMMARY_FILE,
    append_metrics,
    clear_outputs,
    holds_run,
    last_logged,
    write_config,
    write_summary,
)
from vit.train import tracking
from vit.train.accelerator import main_first, make_accelerator, set_threads
from vit.train.budget import outcome
from vit.train.resumes import check_resume


@dataclass
class StepRecords:
    """How many records of metrics.jsonl carry the step of the last one, counted as `Run.log` appends them: a resume
    state says how many records of its step were logged before it (`vit.train.states.save_state`), and reading the whole
    file for that at every save made a long run's saves cost more and more. A step counts as `read_metrics` reads it back,
    and `==` compares it with a state's step as that count did (3.0 is step 3; a non-finite step is written as null)."""

    step: int | float | None = None  # the last counted record's step; None before one
    count: int = 0  # the records of that step logged since the step last changed
    # False where records of one step may lie apart (a step went back) or the file holds records this count never saw:
    # only the file says how many then
    exact: bool = True

    def add(self, step: Any) -> None:
        if not (isinstance(step, int) or (isinstance(step, float) and math.isfinite(step))):
            return  # read back as no step (a null), or not a number: `read_metrics` counts it for no step
        if self.step is not None and step < self.step:
            self.exact = False
        self.count = self.count + 1 if step == self.step else 1
        self.step = step

    def at(self, step: int) -> int | None:
        """The records of `step` in metrics.jsonl; None where this count cannot say (see `exact`, and a step before the last)."""
        if not self.exact or (self.step is not None and step < self.step):
            return None
        return self.count if step == self.step else 0

    @classmethod
    def of(cls, steps: Iterable[Any]) -> StepRecords:
        counted = cls()
        for step in steps:
            counted.add(step)
        return counted


@dataclass
class Run:
    """One training run: its config, accelerator, folder and metric sinks."""

    cfg: Any
    stage: str
    accelerator: Any
    dir: Path
    threads: int
    trackers_on: bool = False
    job_type: str = ""
    meta: dict[str, Any] = field(default_factory=dict)  # written under `meta` in config.yaml
    started: float = field(default_factory=time.perf_counter)  # the stage's clock, for time budgets
    compile_mode: str | None = None  # what `compile_for_run` chose
    compile_cache: str | None = None  # compiled: torch.compile's cache folder as it began ("empty", "used"; `compile_cache_state`)
    cuda_graph: bool = False  # whether the loop captures its whole step as one CUDA graph (`compile_for_run` chose)
    data_loader: str | None = None  # "memory" or "stream": what the stage's data opened with; its resume states record it
    data_fingerprint: str | None = None  # its training images' (`vit.data.splits.SourceIndex`), and their number, which
    train_images: int | None = None  # its resume states record
    graph_capture: dict | None = None  # that graph's eager warm-up steps and capture seconds, once captured
    first_step_seconds: float | None = None  # the first training step, compilation included, device drained
    gpu_busy: float | None = None  # mean GPU utilisation (%) over the training after the first step (CUDA with NVML)
    lock: RunLock | None = None  # the run folder's, held by the main process until `finish` (or the process's end)
    budget_plan: dict[str, Any] | None = None  # a time budget's plan, once the loop has made it (or resumed it)
    budget_spent: Any = None  # where that budget's time went after the plan (`vit.train.budget.Spent`), once training ended
    replacing: str | None = None  # run.overwrite: this run's config, written by `ready` when it clears the run it replaces
    fresh: str | None = None  # a new run's config, written by `ready`: a run refused at set-up leaves no run folder behind
    set_up: bool = False  # the stage called `ready`: the trackers started then, not at `start`
    held: list[Callable[[], None]] = field(default_factory=list)  # tracker calls made before `ready`, sent once the trackers start
    resumed: bool = False  # it continues the run its folder records (a wandb run of the same id)
    logged_to: int | None = None  # a resumed run's last step logged before it: its trackers have the steps up to it already
    tracker_failures: int = 0  # tracker calls that failed (the first is a warning; summary.json counts them)
    warnings: list[str] = field(default_factory=list)  # what `warn` said in this process, for summary.json
    new_record: str | None = None  # a resume's config.yaml with the id it continues under where that is new, written at its first record
    # metrics.jsonl's records of its last step (main process): set from the file where a resume trimmed it (`load_state`)
    # and cleared with it (`ready`); a file found here and neither resumed nor cleared is one this count never read
    step_records: StepRecords = field(default_factory=StepRecords)

    def __post_init__(self) -> None:
        self.step_records.exact = not (Path(self.dir) / METRICS_FILE).exists()

    @classmethod
    def start(cls, cfg: Any, stage: str, job_type: str | None = None, parent: str | None = None,
              parent_run_id: str | None = None) -> "Run":  # fmt: skip
        """`parent`, `parent_run_id`: the folder and id of the pretraining run whose encoder this run starts from, as its
        encoder.pt records them (`vit.store.lineage`; an id edited into something else is no id)."""
        from accelerate.utils import set_seed

        parent_run_id = valid_id(parent_run_id)

        run_cfg: RunConfig = cfg.run
        accelerator = make_accelerator(run_cfg, log_with=None if run_cfg.tracker == "none" else run_cfg.tracker)
        # The run holds a copy of the config with the precision that runs, so the run folder, the trackers
        # and the summary record what ran, not `auto`; the caller's config is left as it was.
        run_cfg = replace(run_cfg, precision=accelerator.mixed_precision)
        cfg = replace(cfg, run=run_cfg)
        threads = set_threads(run_cfg, accelerator)
        run_dir = run_cfg.path
        check_outside_inputs(run_dir, getattr(cfg, "data", None))
        # Before anything reads or clears the folder (an overwrite, a resume's trimming): a live run of it refuses this one.
        # The main process alone holds it; the other ranks of this run follow it, and stop quietly where it is refused
        # (they waited for its id in `identity`, and printed a gloo traceback of their own once it had exited).
        lock = main_first(accelerator, lambda: lock_run(run_dir) if accelerator.is_main_process else None)
        try:
            replacing = check_run_dir(run_dir, run_cfg, cfg)
            record = check_resume(run_dir, cfg, stage, accelerator.num_processes, parent, parent_run_id)
            run_id, note, logged_to, new_record = identity(accelerator, run_dir, resumed=record == "keep")
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        accelerator.wait_for_everyone()  # every rank checked the folder before the main one writes to it
        set_seed(run_cfg.seed, device_specific=True)  # each rank draws different dropout / masks
        meta = run_meta(stage, job_type, run_cfg, accelerator, threads, parent, {RUN_ID: run_id, PARENT_RUN_ID: parent_run_id})
        run = cls(cfg=cfg, stage=stage, accelerator=accelerator, dir=run_dir, threads=threads, job_type=meta["job_type"], meta=meta,
                  lock=lock, resumed=record == "keep", logged_to=logged_to, new_record=new_record)  # fmt: skip
        if replacing or record == "replace":  # the run it replaces stays as it is until the stage is set up (`ready`): input
            run.replacing = dump_config(cfg, meta)  # it refuses loses nothing
        elif accelerator.is_main_process and record == "fresh":  # a resumed run keeps the record its first process wrote
            run.fresh = dump_config(cfg, meta)
        run.print(f"{stage}: run folder {run_dir} | run id {run_id} | device {accelerator.device} x {accelerator.num_processes} "
                  f"process(es), {threads} thread(s) each | precision {run_cfg.precision} | seed {run_cfg.seed}")  # fmt: skip
        if note:
            run.print(note)
        unused = getattr(cfg, "unused", list)()  # settings this run will not read: said once, in the log, not refused
        if unused:
            run.warn(f"not used by this run: {'; '.join(unused)}")
        # No trackers yet: `ready` starts them once the stage is set up. Started here, a run refused at set-up (an empty
        # data folder, a missing init) left a wandb run holding only its config, synced later as a failed run with no data.
        return run

    def ready(self) -> None:
        """The stage is set up (data, model, init and schedule checked): the trackers start only now, and get what the stage
        sent them before (`held`), and a new run writes its config.yaml; one that replaces another (run.overwrite, or
        run.resume=auto over a run that died before its first state) first clears that one's outputs (tensorboard/ too).
        Call it before the stage writes anything; a second call does nothing."""
        if self.set_up:
            return
        self.set_up = True
        if self.replacing is not None:
            if self.is_main:
                clear_outputs(self.dir)
                self.step_records = StepRecords()  # records logged before (held for the trackers) went with the file
                write_config(self.dir, self.replacing)
            self.replacing = None
            self.accelerator.wait_for_everyone()
        if self.fresh is not None:  # (`set_up` keeps a second call from writing it again)
            self.dir.mkdir(parents=True, exist_ok=True)
            write_config(self.dir, self.fresh)
        self.start_trackers()
        held, self.held = self.held, []
        for send in held:
            send()

    # ------------------------------------------------------------------ output

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def local_processes(self) -> int:
        """Processes of this run on this machine (they share its cores)."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.accelerator.num_processes))

    def print(self, *args) -> None:
        if self.is_main:
            print(*args, flush=True)

    def warn(self, message: str) -> None:
        if self.is_main:
            print(f"warning: {message}", file=sys.stderr, flush=True)
            # Kept for summary.json: a line in a scrolled log (a progress bar's) is easy to miss, and a result read from the
            # run folder (a report, a table) should carry what qualifies it.
            self.warnings.append(message)

    def start_trackers(self) -> None:
        run_cfg = self.cfg.run
        if run_cfg.tracker == "none" or not self.accelerator.log_with:
            return
        init_kwargs: dict[str, Any] = {}
        if run_cfg.tracker == "wandb":
            os.environ.setdefault("WANDB_SILENT", "true")
            init_kwargs["wandb"] = tracking.wandb_init_kwargs(run_cfg, self.job_type, self.meta[RUN_ID], self.resumed)
            overridden = tracking.env_overridden(run_cfg, init_kwargs["wandb"])
            if overridden:
                self.warn(f"{', '.join(overridden)}; set those run keys instead")
        config = flatten({**to_dict(self.cfg), "meta": self.meta})
        try:
            self.accelerator.init_trackers(run_cfg.project, config=config, init_kwargs=init_kwargs)
            self.trackers_on = True
        except Exception as e:  # a tracker must never take a run down: the run folder is the record
            self.warn(f"tracker {run_cfg.tracker!r} failed to start ({failure(e)}); continuing with the run folder only")
            self.accelerator.log_with = []
            self.accelerator.trackers = []

    def tracker_failed(self, what: str, e: Exception) -> None:
        """A tracker call failed mid-run (its service gone, its disk full): the first failure is one warning, later ones are
        counted in summary.json, not repeated at every step; the run goes on, its folder keeps everything."""
        self.tracker_failures += 1
        if self.tracker_failures == 1:
            self.warn(f"{what} failed ({failure(e)}); the run goes on and its folder keeps everything (later tracker failures "
                      f"are counted in {SUMMARY_FILE}, not repeated)")  # fmt: skip

    def write_record(self) -> None:
        """A resume's config.yaml with the id it continues under, where that is new (`vit.store.lineage.resumed_id`), written
        before the run's first record of its own: a resume refused before it trains leaves the folder as it was."""
        if self.new_record is not None and self.is_main:
            write_config(self.dir, self.new_record)
        self.new_record = None

    def sent_before(self, step: Any) -> bool:
        """Whether the trackers got `step` before this resumed run began (logged after its state, by the run it continues):
        sent again it would step wandb back, which drops it with a warning each time."""
        return self.logged_to is not None and isinstance(step, (int, float)) and step <= self.logged_to

    def log(self, record: dict[str, Any]) -> None:
        """Append one JSON line to metrics.jsonl and send it to the trackers (main process only)."""
        if not self.is_main:
            return
        self.write_record()
        append_metrics(self.dir, record)
        self.step_records.add(record.get("step"))
        if self.sent_before(record.get("step")):
            return
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float))}
        if self.set_up:
            self._send_metrics(numbers, record.get("step"))
        else:  # the trackers start at `ready`
            self.held.append(partial(self._send_metrics, numbers, record.get("step")))

    def _send_metrics(self, metrics: dict[str, int | float], step: Any) -> None:
        if not self.trackers_on:
            return
        try:
            self.accelerator.log(metrics, step=step)
        except Exception as e:
            self.tracker_failed(f"tracker log (metrics stay in {METRICS_FILE})", e)

    def last_logged(self, key: str) -> Any:
        """The last value of `key` in metrics.jsonl (main process), or None."""
        return last_logged(self.dir, key) if self.is_main else None

    def _wandb(self):
        """The live wandb run on the main process, or None."""
        return tracking.wandb_run(self.accelerator) if self.is_main and self.trackers_on else None

    def _to_wandb(self, what: str, send: Callable[..., None], *args) -> None:
        """`send(wandb_run, *args)` when wandb is on (once `ready` started it); a failure costs one warning, never the run."""
        if not self.set_up:
            self.held.append(partial(self._to_wandb, what, send, *args))
            return
        wrun = self._wandb()
        if wrun is None:
            return
        try:
            send(wrun, *args)
        except Exception as e:
            self.tracker_failed(f"wandb {what}", e)

    def log_images(self, images: dict[str, Path], step: int | None = None) -> None:
        """PNG figures to wandb; `step=None`: at the last logged step (a final figure)."""
        if not self.sent_before(step):
            self._to_wandb("image log", tracking.log_images, images, step)

    def log_table(self, name: str, columns: list[str], rows: list[list]) -> None:
        self._to_wandb("table log", tracking.log_table, name, columns, rows)

    def log_encoder(self, path: Path) -> None:
        """This run's `encoder.pt` as a wandb model artifact (the start of the lineage)."""
        self._to_wandb("model artifact", tracking.log_encoder, Path(path))

    def use_encoder(self, path: Path) -> None:
        """Mark the `encoder.pt` this run starts from as its input (the lineage edge from the run that made it). The stage
        says it before `ready` starts the trackers: the edge waits for them (`_to_wandb`)."""
        self._to_wandb("artifact use", tracking.use_encoder, Path(path))

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write summary.json (with the run's facts) and close the trackers, which get the same final values."""
        summary = {"stage": self.stage, "job_type": self.job_type, RUN_ID: self.meta[RUN_ID], PARENT_RUN_ID: self.meta[PARENT_RUN_ID],
                   **summary, "processes": self.accelerator.num_processes,
                   "device": str(self.accelerator.device), "threads_per_process": self.threads, "precision": self.cfg.run.precision,
                   "seed": self.cfg.run.seed, "git_commit": self.meta["git_commit"], "run_dir": str(self.dir),
                   "host": host(self.accelerator.device), "memory": peak_memory(),
                   "compile": {"mode": self.compile_mode, "first_step_sec": self.first_step_seconds, "cache": self.compile_cache},
                   "cuda_graph": self.graph_capture if self.cuda_graph else None, "gpu_busy_percent": self.gpu_busy}  # fmt: skip
        schedule = getattr(self.cfg, "schedule", None)
        if schedule is not None and schedule.budget_minutes is not None:
            # The plan beside what the stage took, so an estimate that missed shows.
            now = time.perf_counter()
            spent = self.budget_spent.to_dict(now) if self.budget_spent is not None else {}
            stage = round(now - self.started, 1)  # and whether that was within the budget, said, not left to the reader
            summary["budget"] = {**(self.budget_plan or {}), "stage_seconds": stage} | outcome(schedule.budget_minutes, stage) | ({"spent": spent} if spent else {})
        wrun = self._wandb()
        if wrun is not None:
            summary["wandb_run"] = tracking.wandb_run_dir(wrun)
        if self.tracker_failures:
            summary["tracker_failures"] = self.tracker_failures
        if self.warnings:
            summary["warnings"] = list(self.warnings)  # this process's (a resumed run's earlier processes said theirs in their logs)
        if self.is_main:
            self.write_record()
            write_summary(self.dir, summary)
        self._to_wandb("summary", tracking.log_summary, summary)
        if self.trackers_on:
            try:
                self.accelerator.end_training()  # the trackers, then the process group
            except Exception as e:
                self.tracker_failed("tracker close", e)
                if self.accelerator.num_processes > 1:  # end_training stopped before it (see below)
                    self.accelerator.state.destroy_process_group()
        elif self.accelerator.num_processes > 1:
            # Left to the interpreter's exit, gloo's threads were once torn down joinable: "terminate called without an
            # active exception", a rank aborted (SIGABRT) after its run had finished (tests/test_ranks.py, in CI).
            self.accelerator.state.destroy_process_group()
        if self.lock is not None:
            self.lock.release()
        return summary


def identity(accelerator, run_dir: Path, resumed: bool) -> tuple[str, str | None, int | None, str | None]:
    """`vit.store.lineage.session`, decided on the main process (which alone reads and writes the folder); the other ranks
    take its id, note and step (the record is the main process's to write)."""
    found = session(run_dir, resumed) if accelerator.is_main_process else (None, None, None, None)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        found = (*broadcast_object_list([found[:3]])[0], found[3])
    return found


def run_meta(stage: str, job_type: str | None, run_cfg: RunConfig, accelerator, threads: int, parent: str | None,
             ids: dict[str, str | None]) -> dict[str, Any]:  # fmt: skip
    """What config.yaml records under `meta`: the run's stage, identity (`ids`: its id and its parent's), and where it ran."""
    return {"stage": stage, "job_type": job_type or stage, "git_commit": git_commit(), "seed": run_cfg.seed, "parent": parent, **ids,
            "processes": accelerator.num_processes, "device": str(accelerator.device), "threads_per_process": threads,
            "torch": str(torch.__version__), "command": command_line(sys.argv)}  # fmt: skip


def command_line(argv: list[str]) -> str:
    """The command as a user types it, shell-quoted: a stage started as a module (`python -m`, `accelerate launch -m`) is
    `python -m <stage> ...`; its argv[0], the path of the stage's __main__.py, pasted elsewhere was no command."""
    head = ["python", "-m", Path(argv[0]).parent.name] if argv and Path(argv[0]).name == "__main__.py" else argv[:1]
    return shlex.join([*head, *argv[1:]])


def failure(e: BaseException) -> str:
    """'Type: first line of its message' (160 characters at most); an exception without a message is its type alone."""
    first = (str(e).splitlines() or [""])[0][:160]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def peak_memory() -> dict[str, float] | None:
    """Peak resident memory of this (main) process and of its largest finished child (data workers), in MiB; None where
    the OS does not report it. What a run needed, for summary.json and for planning the next one."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    unit = 1.0 if sys.platform == "darwin" else 1024.0  # ru_maxrss: bytes on macOS, KiB on Linux
    this = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit / 2**20
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * unit / 2**20
    return {"peak_rss_mib": round(this, 1), "children_peak_rss_mib": round(children, 1)}


def param_checksum(model) -> torch.Tensor:
    """The sum of `model`'s parameters, () float32 on their device (MPS has no float64): ranks that hold the same
    weights give the same bits, which summary.json's per-rank record shows."""
    return torch.stack([p.detach().float().sum() for p in model.parameters()]).sum()


def flatten(d: dict) -> dict:
    """Dotted keys (`flat_keys`) with the values trackers take: numbers, strings, booleans and None; anything else as text."""
    return {k: v if isinstance(v, (int, float, str, bool)) or v is None else str(v) for k, v in flat_keys(d).items()}


def check_outside_inputs(run_dir: Path, data: Any) -> None:
    """Refuse a run folder inside the folder of a `data.dataset=folder` source: read at any depth, it would read the run's
    figures as images next time."""
    if getattr(data, "dataset", None) != "folder":
        return
    for key in ("root", "val_root"):
        root = Path(str(getattr(data, key, None) or "")).expanduser()
        if str(root) != "." and root.is_dir() and root.resolve() in run_dir.resolve().parents:
            raise ConfigError(f"run.dir puts the run folder {run_dir} inside data.{key} {root}, whose images the next run would read "
                              "with the run's figures among them; choose a run.dir outside it")  # fmt: skip


def check_run_dir(run_dir: Path, run_cfg: RunConfig, cfg: Any) -> bool:
    """Refuse to start a fresh run over an existing one unless told to overwrite, and an overwrite that would delete
    what this run reads (its encoder in the folder it replaces, say). True when this run replaces one (`Run.ready`
    clears it once the stage is set up)."""
    if run_cfg.resume or not run_dir.exists():
        return False
    if not holds_run(run_dir):
        return False  # an empty folder, or one holding only the config of a run that failed to start
    if not run_cfg.overwrite:
        raise ConfigError(
            f"run folder {run_dir} already holds a run; resume it with run.resume=auto, "
            "choose another run.name, or pass run.overwrite=true to replace it"
        )
    inside = run_dir.resolve()
    for key, value in flat_keys(to_dict(cfg)).items():
        path = Path(str(value).split(":", 1)[-1]).expanduser() if isinstance(value, str) and value and key != "run.dir" else None
        if path is not None and path.exists() and (path.resolve() == inside or inside in path.resolve().parents):
            raise ConfigError(f"run.overwrite=true would delete {path}, which {key} reads; choose another run.name")
    return True
