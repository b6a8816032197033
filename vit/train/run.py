"""One training run: its accelerator, folder, trackers and summary.

    run = Run.start(cfg, stage="pretrain")   # accelerator, threads, seed, the run folder (locked for the run's life), trackers
    ...train...
    run.finish(summary)                       # summary.json with the run's facts; trackers closed; the folder unlocked

The run folder's files are `vit.store.runs`'s; a second run of a live folder refuses (`vit.store.lock.lock_run`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from vit.config import RunConfig, dump_config, flat_keys, to_dict
from vit.device import host
from vit.errors import ConfigError, NothingToDo, UserError
from vit.store.lock import RunLock, lock_run
from vit.store.runs import (
    METRICS_FILE,
    SUMMARY_FILE,
    append_metrics,
    clear_outputs,
    holds_run,
    is_complete_state,
    is_finished,
    last_logged,
    newest_state,
    read_config,
    read_state_progress,
    read_summary,
    state_dirs,
    state_run_folder,
    write_config,
    write_summary,
)
from vit.train import tracking
from vit.train.accelerator import make_accelerator, set_threads
from vit.train.budget import outcome


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
    cuda_graph: bool = False  # whether the loop captures its whole step as one CUDA graph (`compile_for_run` chose)
    graph_capture: dict | None = None  # that graph's eager warm-up steps and capture seconds, once captured
    first_step_seconds: float | None = None  # the first training step, compilation included, device drained
    gpu_busy: float | None = None  # mean GPU utilisation (%) over the training after the first step (CUDA with NVML)
    lock: RunLock | None = None  # the run folder's, held by the main process until `finish` (or the process's end)
    budget_plan: dict[str, Any] | None = None  # a time budget's plan, once the loop has made it (or resumed it)
    budget_spent: Any = None  # where that budget's time went after the plan (`vit.train.budget.Spent`), once training ended
    replacing: str | None = None  # run.overwrite: this run's config, written by `ready` when it clears the run it replaces
    used_encoder: Path | None = None  # the encoder.pt it starts from, told to wandb once trackers start (`ready`, replacing)

    @classmethod
    def start(cls, cfg: Any, stage: str, job_type: str | None = None, parent: str | None = None) -> "Run":
        from accelerate.utils import set_seed

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
        # The main process alone holds it; the other ranks of this run follow it.
        lock = lock_run(run_dir) if accelerator.is_main_process else None
        try:
            replacing = check_run_dir(run_dir, run_cfg, cfg)
            record = check_resume(run_dir, cfg, stage, accelerator.num_processes, parent)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        accelerator.wait_for_everyone()  # every rank checked the folder before the main one writes to it
        set_seed(run_cfg.seed, device_specific=True)  # each rank draws different dropout / masks
        meta = {
            "stage": stage,
            "job_type": job_type or stage,
            "git_commit": git_commit(),
            "seed": run_cfg.seed,
            "parent": parent,
            "processes": accelerator.num_processes,
            "device": str(accelerator.device),
            "threads_per_process": threads,
            "torch": str(torch.__version__),
            "command": " ".join(sys.argv),
        }
        run = cls(cfg=cfg, stage=stage, accelerator=accelerator, dir=run_dir, threads=threads, job_type=meta["job_type"], meta=meta,
                  lock=lock)  # fmt: skip
        if replacing or record == "replace":  # the run it replaces stays as it is until the stage is set up (`ready`): input
            run.replacing = dump_config(cfg, meta)  # it refuses loses nothing
        elif accelerator.is_main_process and record == "fresh":  # a resumed run keeps the record its first process wrote
            run_dir.mkdir(parents=True, exist_ok=True)
            write_config(run_dir, dump_config(cfg, meta))
        run.print(
            f"{stage}: run folder {run_dir} | device {accelerator.device} x {accelerator.num_processes} process(es), "
            f"{threads} thread(s) each | precision {run_cfg.precision} | seed {run_cfg.seed}"
        )
        if run.replacing is None:  # else `ready` starts them, once the run it replaces (its tensorboard/ too) is cleared
            run.start_trackers()
        return run

    def ready(self) -> None:
        """The stage is set up (data, model, init and schedule checked): a run that replaces another (run.overwrite, or
        run.resume=auto over a run that died before its first state) clears that one's outputs and writes its own config
        only now. Call it before the stage writes anything."""
        if self.replacing is None:
            return
        if self.is_main:
            clear_outputs(self.dir)
            write_config(self.dir, self.replacing)
        self.replacing = None
        self.accelerator.wait_for_everyone()
        self.start_trackers()
        if self.used_encoder is not None:
            self.use_encoder(self.used_encoder)

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

    def start_trackers(self) -> None:
        run_cfg = self.cfg.run
        if run_cfg.tracker == "none" or not self.accelerator.log_with:
            return
        init_kwargs: dict[str, Any] = {}
        if run_cfg.tracker == "wandb":
            os.environ.setdefault("WANDB_SILENT", "true")
            init_kwargs["wandb"] = tracking.wandb_init_kwargs(run_cfg, self.job_type)
            overridden = tracking.env_overridden(run_cfg, init_kwargs["wandb"])
            if overridden:
                self.warn(f"{', '.join(overridden)}; set those run keys instead")
        config = flatten({**to_dict(self.cfg), "meta": self.meta})
        try:
            self.accelerator.init_trackers(run_cfg.project, config=config, init_kwargs=init_kwargs)
            self.trackers_on = True
        except Exception as e:  # a tracker must never take a run down: the run folder is the record
            self.warn(f"tracker {run_cfg.tracker!r} failed to start ({type(e).__name__}: {str(e).splitlines()[0][:160]}); continuing with the run folder only")
            self.accelerator.log_with = []
            self.accelerator.trackers = []

    def log(self, record: dict[str, Any]) -> None:
        """Append one JSON line to metrics.jsonl and send it to the trackers (main process only)."""
        if not self.is_main:
            return
        append_metrics(self.dir, record)
        if self.trackers_on:
            try:
                self.accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record.get("step"))
            except Exception as e:
                self.warn(f"tracker log failed ({type(e).__name__}); metrics stay in {METRICS_FILE}")

    def last_logged(self, key: str) -> Any:
        """The last value of `key` in metrics.jsonl (main process), or None."""
        return last_logged(self.dir, key) if self.is_main else None

    def _wandb(self):
        """The live wandb run on the main process, or None."""
        return tracking.wandb_run(self.accelerator) if self.is_main and self.trackers_on else None

    def _to_wandb(self, what: str, send: Callable[..., None], *args) -> None:
        """`send(wandb_run, *args)` when wandb is on; a failure costs one warning, never the run."""
        wrun = self._wandb()
        if wrun is None:
            return
        try:
            send(wrun, *args)
        except Exception as e:
            first = (str(e).splitlines() or [""])[0][:160]
            self.warn(f"wandb {what} failed ({type(e).__name__}: {first}); the run folder keeps it")

    def log_images(self, images: dict[str, Path], step: int | None = None) -> None:
        """PNG figures to wandb; `step=None`: at the last logged step (a final figure)."""
        self._to_wandb("image log", tracking.log_images, images, step)

    def log_table(self, name: str, columns: list[str], rows: list[list]) -> None:
        self._to_wandb("table log", tracking.log_table, name, columns, rows)

    def log_encoder(self, path: Path) -> None:
        """This run's `encoder.pt` as a wandb model artifact (the start of the lineage)."""
        self._to_wandb("model artifact", tracking.log_encoder, Path(path))

    def use_encoder(self, path: Path) -> None:
        """Mark the `encoder.pt` this run starts from as its input (the lineage edge from the run that made it). A run that
        replaces another starts its trackers once that one is cleared (`ready`): the edge waits for them."""
        if self.replacing is not None:
            self.used_encoder = Path(path)
            return
        self._to_wandb("artifact use", tracking.use_encoder, Path(path))

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write summary.json (with the run's facts) and close the trackers, which get the same final values."""
        summary = {"stage": self.stage, "job_type": self.job_type, **summary, "processes": self.accelerator.num_processes,
                   "device": str(self.accelerator.device), "threads_per_process": self.threads, "precision": self.cfg.run.precision,
                   "seed": self.cfg.run.seed, "git_commit": self.meta["git_commit"], "run_dir": str(self.dir),
                   "host": host(self.accelerator.device), "memory": peak_memory(),
                   "compile": {"mode": self.compile_mode, "first_step_sec": self.first_step_seconds},
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
        if self.is_main:
            write_summary(self.dir, summary)
        self._to_wandb("summary", tracking.log_summary, summary)
        if self.trackers_on:
            try:
                self.accelerator.end_training()  # the trackers, then the process group
            except Exception as e:
                self.warn(f"tracker did not close cleanly ({type(e).__name__})")
        elif self.accelerator.num_processes > 1:
            # Left to the interpreter's exit, gloo's threads were once torn down joinable: "terminate called without an
            # active exception", a rank aborted (SIGABRT) after its run had finished (tests/test_ranks.py, in CI).
            self.accelerator.state.destroy_process_group()
        if self.lock is not None:
            self.lock.release()
        return summary


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


# Settings a resumed run may change: where things are and how it runs, not what it trains. The rest must be what the
# run recorded, or the result would be neither run (its config.yaml would say one thing while its first steps did another).
RESUMABLE_CHANGES = frozenset({
    "run.dir", "run.name", "run.resume", "run.overwrite", "run.device", "run.precision", "run.threads", "run.compile", "run.cuda_graph",
    "run.log_every", "run.save_every", "run.save_minutes", "run.keep_states", "run.figure_every", "run.tracker", "run.wandb_mode", "run.project",
    "run.group", "run.progress", "data.root", "data.val_root", "data.cache_dir", "data.download", "data.workers",
    "data.memory_budget_gb", "data.eval_batch_size", "finetune.init", "schedule.max_steps",  # where a run stops: a stopped run continues past it
})  # fmt: skip


def check_resume(run_dir: Path, cfg: Any, stage: str, processes: int, parent: str | None = None) -> str:
    """Before a resume touches the folder: refuse a finished run with no state to continue from (starting afresh would
    write over its results), a run recorded with other settings, by another stage or with another number of processes,
    naming what differs, and a state of another run folder (`run.resume=<run>/states/step_N`) continued in a folder that
    holds a run of its own; that state is held to its run's record, as `auto` is to this folder's. "keep" when the
    folder's record (config.yaml) is the one to keep; "fresh" when there is none to keep; "replace" when the folder holds
    a run that died before its first state, which this one replaces once its stage is set up (`Run.ready`)."""
    run_cfg = cfg.run
    if not run_cfg.resume:
        return "fresh"
    named = Path(run_cfg.resume).expanduser() if run_cfg.resume != "auto" else None
    source = state_run_folder(named) if named is not None else None
    if source is not None and source.resolve() != run_dir.resolve():
        # A state of another run folder continues that run here: it is held to that run's record, as `auto` is to this one's.
        check_recorded(source, cfg, stage, processes, instead="start a fresh run without run.resume", parent=parent)
    if named is not None and is_complete_state(named) and (source is None or source.resolve() != run_dir.resolve()) and holds_run(run_dir):
        # The other run's steps (or a copied state's) would write over this run's weights and summary, and mix their metrics.
        whose = f"continues the run {source}" if source is not None else "continues a state copied away from its run"
        raise ConfigError(f"run.resume={run_cfg.resume} {whose}, and run folder {run_dir} holds another run; "
                          f"continue it under a new run.name, or resume {run_dir} itself with run.resume=auto")  # fmt: skip
    if not holds_run(run_dir):
        return "fresh"
    if run_cfg.resume == "auto" and not state_dirs(run_dir):
        if is_finished(run_dir):  # starting afresh would write over its results
            raise ConfigError(f"run folder {run_dir} holds a finished run and no resume state to continue from; choose another "
                              "run.name, or pass run.overwrite=true (without run.resume) to run it again")  # fmt: skip
        return "replace"  # it died before its first state: its records would mix with this fresh run's
    if not check_recorded(run_dir, cfg, stage, processes, parent=parent):
        return "fresh"
    if run_cfg.resume == "auto" or is_complete_state(named):
        check_not_done(run_dir, cfg, named if run_cfg.resume != "auto" else None)
    return "keep"


def check_not_done(run_dir: Path, cfg: Any, state: Path | None = None) -> None:
    """NothingToDo for a finished run whose newest state (or `state`, a state of it named by run.resume) is the step it
    finished at, resumed with what it ran (`schedule.max_steps` too; a higher one goes on): the resume would only
    evaluate that step again and write over its records (summary.json's timings, a second record of the step)."""
    summary, which = read_summary(run_dir) if is_finished(run_dir) else None, "its newest state" if state is None else "this state's"
    state = state or newest_state(run_dir)
    if not summary or state is None or read_state_progress(state).get("step") != summary.get("steps"):
        return
    if ((read_config(run_dir) or {}).get("schedule") or {}).get("max_steps") == cfg.schedule.max_steps:
        raise NothingToDo(f"run.resume={cfg.run.resume}: {run_dir} finished at step {summary['steps']}, {which}: nothing to resume; "
                          f"its results are in {run_dir / SUMMARY_FILE} (run.overwrite=true without run.resume trains it again)")  # fmt: skip


def check_recorded(run_dir: Path, cfg: Any, stage: str, processes: int, instead: str = "choose another run.name",
                   parent: str | None = None) -> bool:  # fmt: skip
    """Refuse to continue the run recorded in `run_dir`'s config.yaml by another stage, with another number of processes,
    from another parent run (`parent`: the pretraining run of the encoder `finetune.init` names now) or with settings
    other than `RESUMABLE_CHANGES`, naming what differs (`instead`: the other way out the message offers). False when
    there is no record to compare."""
    try:
        recorded = read_config(run_dir)
    except UserError:
        recorded = None
    if recorded is None:
        return False  # no record to keep: this run writes one
    then = recorded.pop("meta", None) or {}
    if then.get("stage", stage) != stage:
        raise ConfigError(f"run.resume: {run_dir} holds a {then['stage']} run, not a {stage} one; {instead}")
    if then.get("processes", processes) != processes:  # the effective batch, and with it the schedule's steps and learning rate
        raise ConfigError(f"run.resume: the run in {run_dir} was started with {then['processes']} process(es), this one has {processes}: "
                          f"resume it with {then['processes']} (its effective batch and schedule), or {instead}")  # fmt: skip
    if then.get("parent", parent) != parent:  # finetune.init may name a moved folder, not another run's encoder
        was, now = (f"the encoder of {p}" if p else "no pretraining run's encoder" for p in (then["parent"], parent))
        raise ConfigError(f"run.resume: the run in {run_dir} was started from {was}, and finetune.init now names {now}; resume it "
                          f"with the init it recorded in config.yaml, or {instead}")  # fmt: skip
    # finetune.init may change on a resume where it names a moved folder; a name (scratch, timm:, hf-hub:) names weights
    was_init, init = (str((c.get("finetune") or {}).get("init") or "") for c in (recorded, to_dict(cfg)))
    if was_init != init and any(i == "scratch" or i.startswith(("timm:", "hf-hub:")) for i in (was_init, init)):
        raise ConfigError(f"run.resume: the run in {run_dir} was started from finetune.init={was_init}, and this one names {init}; "
                          f"resume it with the init it recorded in config.yaml, or {instead}")  # fmt: skip
    shown = setting_differences(flat_keys(recorded), flat_keys(to_dict(cfg)))
    if shown:
        raise ConfigError(f"run.resume: the run in {run_dir} was started with other settings ({shown}); resume it with "
                          f"the settings it recorded in config.yaml, or {instead}")  # fmt: skip
    return True


def setting_differences(before: dict[str, Any], now: dict[str, Any]) -> str | None:
    """`key old -> new, ...` for the dotted settings a resume may not change (all but `RESUMABLE_CHANGES`), the first
    five named; None where none differ."""
    differ = [f"{key} {before.get(key)!r} -> {now.get(key)!r}" for key in sorted(set(now) | set(before))
              if key not in RESUMABLE_CHANGES and now.get(key) != before.get(key)]  # fmt: skip
    return ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "") if differ else None


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5)
        commit = out.stdout.strip() if out.returncode == 0 else "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5)
        return commit + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
