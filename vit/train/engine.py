"""The training-loop pieces every stage shares.

    run = Run.start(cfg, stage="pretrain")           # accelerator, threads, seed, run folder, trackers
    model, optimizer = run.accelerator.prepare(model, optimizer)
    spec = loop_spec(cfg, len(loader), run.accelerator.num_processes)
    progress = fit(run, model, optimizer, loader, loss_fn, spec, load_state(run), on_epoch_end=...)
    run.finish(summary)

`fit` owns the schedule (learning rate set per optimiser step, never a scheduler
handed to `prepare`, which would step once per process), gradient accumulation,
clipping, mixed precision, the non-finite-loss guard, metrics, resume states and
pre-emption signals. Resume states are Accelerate `save_state` folders written
under a temporary name and renamed when complete, so `run.resume=auto` never
picks up a half-written one; their manifest (`vit.store.runs.check_state`) is verified
before one is loaded, so a file damaged since is not loaded either. The run folder
is locked for the run's life (`vit.store.runs.lock_run`): a second run of it refuses.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from vit.train import tracking
from vit.train.budget import FORWARD_SHARE, BudgetPlan, StepMeter, eval_seconds_estimate, measure_seconds, plan_steps
from vit.config import RunConfig, dump_config, to_dict
from vit.device import BusySampler, host, synchronize
from vit.errors import CheckpointError, ConfigError, StorageError, UserError
from vit.train.guard import LossRing
from vit.store.atomic import storage_failure
from vit.store.runs import (
    METRICS_FILE,
    STATE_DIR,
    STATE_FILE,
    TENSORBOARD_DIR,
    RunLock,
    append_metrics,
    check_state,
    clear_outputs,
    complete_state,
    holds_run,
    is_complete_state,
    partial_state_path,
    read_state_progress,
    state_dirs,
    state_path,
    last_logged,
    lock_run,
    newest_state,
    trim_metrics,
    read_budget,
    write_budget,
    trim_states,
    write_config,
    write_summary,
)

# --------------------------------------------------------------------------- schedule and optimiser


def lr_at(step: int, total_steps: int, warmup_steps: int, peak_lr: float, min_lr: float = 0.0) -> float:
    """Linear warmup from 0 to `peak_lr` over `warmup_steps`, then cosine decay to `min_lr` at `total_steps`."""
    if step < warmup_steps:
        return peak_lr * step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float | None = None, num_layers: int | None = None) -> list[dict]:
    """Optimiser groups: no decay on 1-D tensors (norms, biases) and on `model.no_weight_decay()` names.

    With `layer_decay`, each group carries `lr_scale = layer_decay ** (num_layers + 1 - layer_id)`:
    embeddings are layer 0, block i is layer i + 1, everything after the blocks (norm, head)
    is layer num_layers + 1 with scale 1 (BEiT / MAE fine-tuning).
    """
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    groups: dict[tuple[int, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = p.ndim >= 2 and name not in skip
        layer = layer_id(name, num_layers) if layer_decay is not None else 0
        key = (layer, decay)
        if key not in groups:
            scale = layer_decay ** (num_layers + 1 - layer) if layer_decay is not None else 1.0
            groups[key] = {"params": [], "weight_decay": weight_decay if decay else 0.0, "lr_scale": scale, "layer": layer}
        groups[key]["params"].append(p)
    return [groups[k] for k in sorted(groups)]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate to `lr` times its `lr_scale` (layer-wise decay)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def layer_id(name: str, num_layers: int) -> int:
    """Depth of a parameter for layer-wise decay: 0 embeddings, i + 1 for blocks.i, num_layers + 1 after."""
    for prefix in ("", "encoder.", "module."):
        if name.startswith(prefix + "blocks."):
            return int(name[len(prefix) + len("blocks.") :].split(".")[0]) + 1
        if any(name.startswith(prefix + k) for k in ("cls_token", "pos_embed", "patch_embed")):
            return 0
    return num_layers + 1


def make_optimizer(groups: list[dict], optim_cfg, device: torch.device) -> torch.optim.Optimizer:
    if optim_cfg.name == "adamw":
        fused = optim_cfg.fused
        if fused is None:
            fused = device.type in ("cuda", "cpu")
        return torch.optim.AdamW(groups, lr=0.0, betas=optim_cfg.betas, fused=fused)
    if optim_cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=0.0, momentum=optim_cfg.momentum)
    from vit.train.lars import LARS

    return LARS(groups, lr=0.0, momentum=optim_cfg.momentum)


# --------------------------------------------------------------------------- the run


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5)
        commit = out.stdout.strip() if out.returncode == 0 else "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5)
        return commit + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 in hardware. A CPU without AVX512-BF16 or AMX (AVX2-only
    laptops and servers) has CPU autocast emulate it, measured over 100x slower than fp32 in a matmul."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return any(getattr(torch.cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return False  # MPS and others: fp32 unless asked


def resolve_precision(requested: str, device: torch.device) -> str:
    """`run.precision` as Accelerate takes it: `auto` is bf16 where the device has it natively, else `no` (fp32)."""
    if requested == "auto":
        return "bf16" if native_bf16(device) else "no"
    if requested == "fp16" and device.type != "cuda":
        raise ConfigError(f"run.precision=fp16 needs a GPU, this run is on {device.type}; use run.precision=auto")
    return requested


def make_accelerator(run_cfg: RunConfig, log_with: str | None = None):
    """An Accelerator on the requested device; refuses a device that is not there and a broken launch.

    `run.precision=auto` is resolved for the device here (`accelerator.mixed_precision` says what
    runs; `run_cfg` is left as asked). A tracker that cannot be set up (say tensorboard is not
    installed) costs one warning, not the run.
    """
    from accelerate import Accelerator, PartialState
    from accelerate.utils import ProjectConfiguration, parse_flag_from_env

    device = run_cfg.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device=cuda was requested but no CUDA device is available")
    if device == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ConfigError("run.device=mps was requested but MPS is not available")
    # Accelerate's own choice of device decides the precision. The Accelerator reads ACCELERATE_USE_CPU
    # (a multi-process CPU launch) itself; the state made first must see it too, or it starts one process.
    cpu = device == "cpu" or parse_flag_from_env("ACCELERATE_USE_CPU")
    state = PartialState(cpu=cpu)
    requested = run_cfg.precision
    precision = resolve_precision(requested, state.device)
    if requested == "bf16" and not native_bf16(state.device) and state.is_main_process:
        print(f"warning: run.precision=bf16 on a {state.device.type} without native bf16 is emulated and can be many times slower "
              "than fp32; run.precision=auto chooses for the device", file=sys.stderr)  # fmt: skip
    project = ProjectConfiguration(project_dir=str(run_cfg.path), logging_dir=str(run_cfg.path / TENSORBOARD_DIR))
    kwargs = dict(cpu=cpu, mixed_precision=precision, project_config=project)
    try:
        accelerator = Accelerator(log_with=log_with, **kwargs)
    except (ValueError, ImportError) as e:
        if log_with is None:
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"warning: tracker {log_with!r} is not available ({str(e).splitlines()[0][:160]}); continuing with the run folder only", file=sys.stderr)
        accelerator = Accelerator(**kwargs)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != accelerator.num_processes:
        raise UserError(
            f"WORLD_SIZE={world} but the accelerator runs {accelerator.num_processes} process(es): the processes would train "
            "unsynchronised copies. On CPU launch with ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N"
        )
    return accelerator


def compile_mode(requested: str, device: torch.device, num_processes: int = 1) -> str | None:
    """The torch.compile mode `run.compile` asks for on `device` (None: not compiled). `auto`: CUDA graphs
    (`reduce-overhead`) for one CUDA process, where the step is otherwise launch-bound; the default mode for several
    (graphs under DDP are untested here); nothing on CPUs and MPS, where compiling cost more time than it saved."""
    if requested == "auto":
        if device.type != "cuda":
            return None
        return "reduce-overhead" if num_processes == 1 else "default"
    return {"off": None, "on": "default"}.get(requested, requested)


def compile_for_run(run: "Run", module: nn.Module) -> nn.Module:
    """`module` compiled as `run.compile` asks (the training forward only: evaluation runs the plain module)."""
    acc = run.accelerator
    mode = compile_mode(run.cfg.run.compile, acc.device, acc.num_processes)
    run.compile_mode = mode
    if mode is None:
        return module
    run.print(f"compile: torch.compile mode {mode} (run.compile={run.cfg.run.compile}); the first steps compile, and count in the stage's time")
    return torch.compile(module, mode=mode)


def set_threads(run_cfg: RunConfig, accelerator) -> int:
    """CPU threads per process: `run.threads`, else the cores shared among this machine's processes."""
    if run_cfg.threads is not None:
        threads = run_cfg.threads
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes if accelerator.num_processes > 1 else 1))
        threads = max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(threads)
    return threads


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
    first_step_seconds: float | None = None  # the first training step, compilation included, device drained
    gpu_busy: float | None = None  # mean GPU utilisation (%) over the training after the first step (CUDA with NVML)
    lock: RunLock | None = None  # the run folder's, held by the main process until `finish` (or the process's end)

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
        # Before anything reads or clears the folder (an overwrite, a resume's trimming): a live run of it refuses this one.
        # The main process alone holds it; the other ranks of this run follow it.
        lock = lock_run(run_dir) if accelerator.is_main_process else None
        try:
            check_run_dir(run_dir, run_cfg)
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
        if accelerator.is_main_process:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_config(run_dir, dump_config(cfg, meta))
        run.print(
            f"{stage}: run folder {run_dir} | device {accelerator.device} x {accelerator.num_processes} process(es), "
            f"{threads} thread(s) each | precision {run_cfg.precision} | seed {run_cfg.seed}"
        )
        run.start_trackers(parent)
        return run

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

    def start_trackers(self, parent: str | None) -> None:
        run_cfg = self.cfg.run
        if run_cfg.tracker == "none" or not self.accelerator.log_with:
            return
        init_kwargs: dict[str, Any] = {}
        if run_cfg.tracker == "wandb":
            os.environ.setdefault("WANDB_SILENT", "true")
            init_kwargs["wandb"] = tracking.wandb_init_kwargs(run_cfg, self.job_type)
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
        """Mark the `encoder.pt` this run starts from as its input (the lineage edge from the run that made it)."""
        self._to_wandb("artifact use", tracking.use_encoder, Path(path))

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write summary.json (with the run's facts) and close the trackers, which get the same final values."""
        summary = {"stage": self.stage, "job_type": self.job_type, **summary, "processes": self.accelerator.num_processes,
                   "device": str(self.accelerator.device), "threads_per_process": self.threads, "precision": self.cfg.run.precision,
                   "seed": self.cfg.run.seed, "git_commit": self.meta["git_commit"], "run_dir": str(self.dir),
                   "host": host(self.accelerator.device), "memory": peak_memory(),
                   "compile": {"mode": self.compile_mode, "first_step_sec": self.first_step_seconds}, "gpu_busy_percent": self.gpu_busy}  # fmt: skip
        schedule = getattr(self.cfg, "schedule", None)
        if schedule is not None and schedule.budget_minutes is not None:
            # The plan beside what the stage took, so an estimate that missed shows.
            summary["budget"] = {**(read_budget(self.dir) or {}), "stage_seconds": round(time.perf_counter() - self.started, 1)}
        wrun = self._wandb()
        if wrun is not None:
            summary["wandb_run"] = tracking.wandb_run_dir(wrun)
        if self.is_main:
            write_summary(self.dir, summary)
        self._to_wandb("summary", tracking.log_summary, summary)
        if self.trackers_on:
            try:
                self.accelerator.end_training()
            except Exception as e:
                self.warn(f"tracker did not close cleanly ({type(e).__name__})")
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


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
    return out


def check_run_dir(run_dir: Path, run_cfg: RunConfig) -> None:
    """Refuse to start a fresh run over an existing one unless told to overwrite."""
    if run_cfg.resume or not run_dir.exists():
        return
    if not holds_run(run_dir):
        return  # an empty folder, or one holding only the config of a run that failed to start
    if not run_cfg.overwrite:
        raise ConfigError(
            f"run folder {run_dir} already holds a run; resume it with run.resume=auto, "
            "choose another run.name, or pass run.overwrite=true to replace it"
        )
    # Overwrite: clear the previous run's outputs so they cannot be mistaken for this one's.
    if int(os.environ.get("RANK", "0")) == 0:
        clear_outputs(run_dir)


# --------------------------------------------------------------------------- resume states


@dataclass
class Progress:
    """Where training stands; saved with every resume state."""

    step: int = 0  # optimiser steps done
    epoch: int = 0  # current epoch
    batch: int = 0  # micro-batches of the current epoch already consumed
    images: int = 0  # training images seen, all processes
    train_time: float = 0.0  # seconds spent in training, summed over restarts
    nan_skips: int = 0
    best: dict[str, float] = field(default_factory=dict)
    planned_steps: int | None = None  # the step count a time budget fixed (kept across resumes)


def save_state(run: Run, progress: Progress) -> Path:
    """Write an Accelerate resume state atomically and keep the newest `run.keep_states`.

    A write the disk refuses (full, over quota) removes the half-written state, which would keep the disk full, and
    stops the run with one line (a StorageError) naming it; the states saved before are kept."""
    acc = run.accelerator
    final = state_path(run.dir, progress.step)
    tmp = partial_state_path(run.dir, progress.step)
    try:
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        acc.wait_for_everyone()
        if acc.is_main_process:
            complete_state(tmp, final, progress.__dict__)
    except Exception as e:
        reason = storage_failure(e, tmp.parent)  # before the partial state frees its space
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        if reason is None:
            raise
        last = newest_state(run.dir)
        kept = f"the last good state {last} is kept" if last is not None else "no earlier state was saved"
        raise StorageError(f"cannot write the resume state {tmp}: {reason}; it is removed and {kept}; free some space, "
                           "then resume with run.resume=auto") from None  # fmt: skip
    if acc.is_main_process:
        trim_states(run.dir, run.cfg.run.keep_states)
    acc.wait_for_everyone()
    return final


def load_state(run: Run) -> Progress | None:
    """Restore the state named by `run.resume` ('auto': newest complete one that loads); None for a fresh run."""
    resume = run.cfg.run.resume
    if not resume:
        return None
    if resume == "auto":
        candidates = list(reversed(state_dirs(run.dir)))
        if not candidates:
            run.print(f"resume: no saved state in {run.dir / STATE_DIR}; starting fresh")
            return None
    else:
        path = Path(resume).expanduser()
        if not is_complete_state(path):
            raise ConfigError(f"run.resume={resume}: not a complete resume state (no {STATE_FILE} inside)")
        candidates = [path]
    for path in candidates:
        try:
            # Every file is checked against the state's manifest first: Accelerate only logs an RNG state it cannot
            # load, and the run would go on from another random state.
            check_state(path)
            progress = Progress(**read_state_progress(path))
            run.accelerator.load_state(str(path))
        except Exception as e:
            why = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"
            if resume != "auto":
                raise ConfigError(f"run.resume={resume}: the state does not load ({why})") from None
            run.warn(f"resume state {path} is unreadable ({why}); trying the one before")
            continue
        run.print(f"resume: from {path} at step {progress.step} (epoch {progress.epoch}, batch {progress.batch})")
        # The stage's clock (a time budget's stage_seconds) counts the training the processes before this one did; their
        # setup and the steps lost after the state are not counted.
        run.started -= progress.train_time
        if run.is_main:
            dropped = trim_metrics(run.dir / METRICS_FILE, progress.step)
            if dropped:
                run.print(f"resume: dropped {dropped} metrics record(s) logged after step {progress.step}; they are logged again")
        return progress
    raise ConfigError(f"run.resume=auto: none of the saved states in {run.dir / STATE_DIR} loads")


# --------------------------------------------------------------------------- the loop


class NonFiniteLoss(UserError):
    pass


class Preempted(Exception):
    """SIGTERM / SIGINT arrived; a resume state has been saved."""


class SignalGuard:
    """Turns SIGTERM / SIGINT into a flag the loop checks between steps, so it can save and exit cleanly."""

    def __init__(self):
        self.received: int | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.previous[sig] = signal.signal(sig, self.handle)
            except ValueError:  # not the main thread
                pass
        return self

    def handle(self, signum, frame) -> None:
        if self.received is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self.received = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


@dataclass
class LoopSpec:
    """What `fit` needs to know about the schedule, from the stage's config."""

    epochs: int
    steps_per_epoch: int
    peak_lr: float
    min_lr: float
    warmup_steps: int
    max_steps: int | None = None
    budget: Budget | None = None  # `schedule.budget_minutes`: the step count is fixed by measuring the step time
    planned_steps: int | None = None  # set once by a budget (and restored from the resume state)

    @property
    def total_steps(self) -> int:
        """The schedule's length: the budget's plan, else `epochs`."""
        if self.planned_steps is not None:
            return self.planned_steps
        if self.budget is not None:
            return sys.maxsize  # measuring: warmup, then the peak rate until the plan fixes the length
        return self.epochs * self.steps_per_epoch

    @property
    def epoch_limit(self) -> int:
        if self.budget is None:
            return self.epochs
        if self.planned_steps is None:
            return sys.maxsize  # measuring: the plan decides
        return math.ceil(self.planned_steps / self.steps_per_epoch)

    @property
    def stop_step(self) -> int:
        """Where training stops: the schedule's end, or `max_steps` (the schedule still spans every epoch)."""
        return self.total_steps if self.max_steps is None else min(self.total_steps, self.max_steps)

    def lr(self, step: int) -> float:
        return lr_at(step, self.total_steps, self.warmup_steps, self.peak_lr, self.min_lr)


@dataclass
class Budget:
    """`schedule.budget_minutes` and what the stage will evaluate, for `vit.train.budget.plan_steps`."""

    minutes: float
    eval_images: int = 0  # images each evaluation during training looks at (0: none)
    eval_every: int = 1  # epochs between those evaluations
    final_images: int = 0  # images evaluated once after the last step
    eval_cost: float = FORWARD_SHARE  # an evaluated image's cost, in training images


def loop_spec(cfg: Any, batches_per_epoch: int, num_processes: int) -> LoopSpec:
    """Steps and learning rate from `optim` and `schedule`: lr = base_lr * effective batch / 256 unless `optim.lr` is set."""
    accum = cfg.optim.grad_accum_steps
    steps_per_epoch = batches_per_epoch // accum
    if steps_per_epoch < 1:
        raise ConfigError(
            f"optim.batch_size={cfg.optim.batch_size} x grad_accum_steps={accum} x {num_processes} process(es) "
            f"is larger than the training set; lower optim.batch_size"
        )
    effective = cfg.optim.batch_size * accum * num_processes
    peak = cfg.optim.lr if cfg.optim.lr is not None else cfg.optim.base_lr * effective / 256
    return LoopSpec(
        epochs=cfg.schedule.epochs,
        steps_per_epoch=steps_per_epoch,
        peak_lr=peak,
        min_lr=cfg.optim.min_lr,
        warmup_steps=round(cfg.schedule.warmup_epochs * steps_per_epoch),
        max_steps=cfg.schedule.max_steps,
        budget=Budget(cfg.schedule.budget_minutes) if cfg.schedule.budget_minutes is not None else None,
    )


# Steps between the exchanges through which several processes agree on a host fact (a signal, the budget's measurement):
# each exchange is a host read, which a step otherwise never makes.
AGREE_EVERY = 10

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
EpochEnd = Callable[[int, Progress], dict[str, float] | None]


def fit(
    run: Run,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader,
    loss_fn: LossFn,
    spec: LoopSpec,
    progress: Progress | None = None,
    on_epoch_end: EpochEnd | None = None,
) -> Progress:
    """Train `model` on `loader` up to `spec.stop_step` (resuming from `progress`); returns the final progress.

    `loss_fn(model, images, labels) -> (loss, extras)` runs under autocast; extras are scalar
    tensors averaged into the logged metrics. Every epoch starts with `model.train()` (a linear
    probe's `train` keeps its frozen encoder in eval mode). `on_epoch_end(epoch, progress)` may
    evaluate and return metrics, logged with the epoch's last record. SIGTERM / SIGINT save a
    resume state and raise `Preempted`.
    """
    loop = TrainLoop(run, model, optimizer, loader, loss_fn, spec, progress or Progress())
    with SignalGuard() as signals:
        while loop.progress.epoch < spec.epoch_limit and loop.progress.step < spec.stop_step:
            if not loop.train_epoch(signals):
                break  # stop_step reached mid-epoch
            loop.end_epoch(on_epoch_end)
    return loop.finish()


@dataclass
class MetricWindow:
    """The optimiser steps since the last record: their count and images, and the loss function's extras summed on the
    device over the steps whose loss was finite (the loss itself stays in the loop's `LossRing`)."""

    first_step: int  # the window's first step
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    finite: torch.Tensor | int = 0  # steps with a finite loss, on the device once extras were added
    steps: int = 0
    images: int = 0
    start: float = field(default_factory=time.perf_counter)

    def add_step(self, extras: dict[str, torch.Tensor], bad: torch.Tensor, images: int) -> None:
        """One step: its extras (device scalars) unless its loss was not finite (`bad`, a device bool)."""
        if extras:
            for key, value in extras.items():
                self.sums[key] = self.sums.get(key, 0) + torch.where(bad, 0.0, value)
            self.finite = self.finite + ~bad
        self.steps += 1
        self.images += images

    def extra_means(self) -> dict[str, float]:
        """{key: mean over the finite steps} of the extras (nan when none was finite), in one host read."""
        if not self.sums:
            return {}
        keys = list(self.sums)
        return dict(zip(keys, (torch.stack([self.sums[k] for k in keys]) / self.finite).tolist()))


class TrainLoop:
    """The parts of `fit`, in the order it calls them, around the state they share: `progress`
    (saved with every resume state), the metrics window, the learning rate and the clock.

    A training step never waits for the device: its loss stays there (`vit.train.guard.LossRing`, which also decides the
    non-finite guard there), and the host reads the losses at check points only (a metrics record every
    `run.log_every` steps, a resume state, the end). Processes agree on host facts (a signal, the budget's
    measurement) every `AGREE_EVERY` steps."""

    def __init__(self, run: Run, model: nn.Module, optimizer: torch.optim.Optimizer, loader, loss_fn: LossFn, spec: LoopSpec, progress: Progress):
        self.run, self.model, self.optimizer, self.loader, self.loss_fn, self.spec = run, model, optimizer, loader, loss_fn, spec
        self.progress = progress
        self.accum = run.cfg.optim.grad_accum_steps
        self.images_per_step = loader.batch_size * self.accum * run.accelerator.num_processes
        self.lr = spec.lr(progress.step)  # the last step's learning rate, logged with each record
        self.window = MetricWindow(progress.step)
        self.losses = LossRing(run.accelerator, optimizer, slots=run.cfg.run.log_every)  # records come at most log_every steps apart
        self.checked = progress.step  # steps before this one were checked for non-finite losses
        self.read_at: tuple[int, dict[int, list[float]]] | None = None  # (step, the ring as read then)
        self.segment_start = time.perf_counter()  # progress.train_time counts the time up to here
        spec.planned_steps = progress.planned_steps  # a resumed budget run keeps its plan
        device = run.accelerator.device
        self.meter = StepMeter(min_seconds=measure_seconds(spec.budget.minutes), sync=lambda: synchronize(device)) \
            if spec.budget is not None and spec.planned_steps is None else None  # fmt: skip
        self.bar = make_bar(run, spec.stop_step if spec.stop_step < sys.maxsize else None, progress.step)
        self.busy = BusySampler(device)
        self.epoch_ends: list[float] = []  # seconds each epoch's end took while the budget was being measured
        self.first = True  # this process's first step: timed apart (compilation), then the GPU's busy share is sampled

    def train_epoch(self, signals: SignalGuard) -> bool:
        """The optimiser steps left in the current epoch; False when `spec.stop_step` cut it short."""
        p = self.progress
        self.model.train()
        batches = self.loader.epoch(p.epoch, start_batch=p.batch)
        steps_left = (len(self.loader) - p.batch) // self.accum
        for i in range(steps_left):
            if p.step >= self.spec.stop_step:
                return False
            # The last step of an epoch is saved after its evaluation (end_epoch), so that a state at step S
            # always follows every metrics record of steps <= S (see trim_metrics).
            self.advance(batches, signals, may_save=i < steps_left - 1)
        return True

    def advance(self, batches: Iterator, signals: SignalGuard, may_save: bool = True) -> None:
        """One step of the loop as a run takes it: the optimiser step, its record, and the resume state that
        `run.save_every` or a signal asks for (`may_save=False`: none but the signal's)."""
        p = self.progress
        if self.first:
            self.first_step(batches)
        else:
            self.step(batches)
        self.log_step()
        preempted = self.agreed(signals.received is not None)
        if preempted or (may_save and p.step % self.run.cfg.run.save_every == 0):
            self.save()
        if preempted:
            self.close_bar()
            raise Preempted(f"stopped by signal at step {p.step}; resume with run.resume=auto")

    def first_step(self, batches: Iterator) -> None:
        """The first step of this process, timed with the device drained on both sides: it holds torch.compile's
        compilation. The GPU's busy share is sampled from its end on."""
        device = self.run.accelerator.device
        synchronize(device)
        start = time.perf_counter()
        self.step(batches)
        synchronize(device)
        self.run.first_step_seconds = round(time.perf_counter() - start, 2)
        if self.run.compile_mode is not None:
            self.run.print(f"compile: the first step took {self.run.first_step_seconds:.1f} s (compilation included)")
        self.first = False
        self.busy.start()

    def agreed(self, flag: bool) -> bool:
        """`flag` as every process sees it: true on all if true on any. One process: `flag` itself, every step. Several:
        they exchange it every `AGREE_EVERY` steps (a host read each time), and it reads False in between."""
        acc = self.run.accelerator
        if acc.num_processes == 1:
            return flag
        if self.progress.step % AGREE_EVERY:
            return False
        return _any_rank(acc, flag)

    def step(self, batches: Iterator) -> None:
        """One optimiser step over `grad_accum_steps` micro-batches. A non-finite loss skips the update (see `vit.train.guard`)."""
        acc, p, accum = self.run.accelerator, self.progress, self.accum
        self.lr = self.spec.lr(p.step)
        set_lr(self.optimizer, self.lr)
        loss_sum = None
        extras_sum: dict[str, torch.Tensor] = {}
        for micro in range(accum):
            images, labels = next(batches)
            # No gradient all-reduce until the last micro-batch of the step.
            sync = micro == accum - 1
            with acc.no_sync(self.model) if not sync and acc.num_processes > 1 else contextlib.nullcontext():
                with acc.autocast():
                    loss, extras = self.loss_fn(self.model, images, labels)
                acc.backward(loss / accum if accum > 1 else loss)
            # Only copies of the loss are kept: a CUDA-graphed model reuses its output's memory at the next call.
            loss = loss.detach() / accum if accum > 1 else loss.detach()
            loss_sum = loss if loss_sum is None else loss_sum + loss
            for k, v in extras.items():
                extras_sum[k] = extras_sum.get(k, 0) + v.detach().float() / accum
        p.batch += accum
        stepped, bad = self.losses.put(loss_sum, p.step)
        if stepped:
            clip = self.run.cfg.optim.clip_grad
            if clip is not None:
                acc.clip_grad_norm_(self.model.parameters(), clip)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        p.step += 1
        p.images += self.images_per_step
        self.window.add_step(extras_sum, bad, self.images_per_step)
        if self.bar is not None:
            self.bar.update(1)
        if self.meter is not None:
            self.meter.tick()
            if self.agreed(self.meter.done):
                self.plan_budget()

    def plan_budget(self) -> None:
        """Fix the step count from the measured step time, once, identically on every rank; it goes into every resume state."""
        acc, spec, p, budget = self.run.accelerator, self.spec, self.progress, self.spec.budget
        measured = torch.tensor([self.meter.seconds_per_step, time.perf_counter() - self.run.started], device=acc.device)
        seconds_per_step, elapsed = (acc.reduce(measured, reduction="max") if acc.num_processes > 1 else measured).tolist()
        rate = self.images_per_step / seconds_per_step
        # Every rank evaluates its share of the images, so an evaluation takes its images / processes.
        per_rank = max(1, acc.num_processes)
        eval_s = eval_seconds_estimate(budget.eval_images // per_rank, rate / per_rank, budget.eval_cost)
        if self.epoch_ends:
            # Epochs already closed: what their ends took (evaluation, figures, weights, states) outweighs the estimate
            # where epochs are short (a GPU closes one a second, each with work that does not run at the training rate).
            eval_s = max(eval_s, sum(self.epoch_ends) / len(self.epoch_ends) * budget.eval_every)
        final_s = eval_seconds_estimate(budget.final_images // per_rank, rate / per_rank, budget.eval_cost)
        steps = plan_steps(budget.minutes * 60, elapsed, p.step, seconds_per_step, spec.steps_per_epoch, eval_s, budget.eval_every, final_s)
        spec.planned_steps = p.planned_steps = steps
        plan = BudgetPlan(budget.minutes, steps, round(seconds_per_step, 4), round(eval_s, 1), round(final_s, 1), round(elapsed, 1),
                          self.meter.steps)  # fmt: skip
        self.meter = None
        if self.run.is_main:
            write_budget(self.run.dir, plan.to_dict())
        if self.bar is not None:
            self.bar.reset(total=min(spec.stop_step, steps))
            self.bar.update(p.step)
        self.run.print(f"budget: {budget.minutes:g} min -> {steps} steps ({steps / spec.steps_per_epoch:.2f} epochs) at {seconds_per_step:.3f} s/step "
                       f"measured over {plan.measured_steps} steps, {elapsed:.0f} s spent, evaluations ~{eval_s:.0f} s each + {final_s:.0f} s at the end")

    def host_losses(self) -> dict[int, list[float]]:
        """{step: every process's loss} of the steps since the last record, read from the device once per step."""
        step = self.progress.step
        if self.read_at is None or self.read_at[0] != step:
            self.read_at = (step, self.losses.read(self.window.first_step, step))
        return self.read_at[1]

    def check_finite(self) -> None:
        """A check point: say which steps since the last one had a non-finite loss (their updates were skipped); stop once
        more than `run.nan_skip_budget` were."""
        run, p, budget = self.run, self.progress, self.run.cfg.run.nan_skip_budget
        bad = [(s, next(v for v in row if not math.isfinite(v))) for s, row in self.host_losses().items()
               if s >= self.checked and not all(math.isfinite(v) for v in row)]  # fmt: skip
        self.checked = p.step
        if not bad:
            return
        p.nan_skips += len(bad)
        first, loss = bad[0]
        where = f"step {first}, lr {self.spec.lr(first):.3g}, precision {run.cfg.run.precision}, loss {run.stage}"
        if p.nan_skips > budget:
            last = newest_state(run.dir)
            kept = f"the last good resume state is kept in {last.parent}" if last is not None else "no resume state was saved before it"
            raise NonFiniteLoss(f"non-finite loss ({loss}) at {where}; {kept}")
        what = "step skipped" if len(bad) == 1 else f"{len(bad)} steps skipped from there to step {bad[-1][0]}"
        run.warn(f"non-finite loss at {where}; {what} ({p.nan_skips}/{budget})")

    def log_step(self) -> None:
        """A metrics record every `run.log_every` steps and at the last one."""
        step = self.progress.step
        if step % self.run.cfg.run.log_every and step != self.spec.stop_step:
            return
        self.check_finite()
        rec = self.record()
        self.run.log(rec)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{self.lr:.2e}", img_s=f"{rec['images_per_sec']:.0f}")

    def record(self, extra: dict[str, float] | None = None) -> dict[str, Any]:
        """The record of the steps since the last one (metrics are their means over finite steps); starts a new window."""
        p, w = self.progress, self.window
        rank = self.run.accelerator.process_index
        finite = [row[rank] for row in self.host_losses().values() if all(math.isfinite(v) for v in row)]
        metrics = {"loss": sum(finite) / len(finite) if finite else float("nan"), **w.extra_means()}
        elapsed = time.perf_counter() - w.start  # after the host read: the device has finished the window's steps
        self.window = MetricWindow(p.step)
        return {"step": p.step, "epoch": round(p.epoch + p.batch / max(1, len(self.loader)), 4), "lr": self.lr, **metrics,
                "images_per_sec": w.images / elapsed if elapsed > 0 else 0.0,
                "time": round(p.train_time + time.perf_counter() - self.segment_start, 2), **(extra or {})}  # fmt: skip

    def end_epoch(self, on_epoch_end: EpochEnd | None) -> None:
        """Close the epoch: its evaluation, its last record (with the evaluation's metrics), and the resume state of its
        last step when `run.save_every` falls there (a GPU epoch can take a second: a state per epoch would cost more
        than the steps it guards)."""
        p = self.progress
        p.epoch += 1
        p.batch = 0
        start = time.perf_counter()
        self.check_finite()
        extra = on_epoch_end(p.epoch, p) if on_epoch_end else None
        if self.window.steps:
            self.run.log(self.record(extra))
        elif extra:
            self.run.log({"step": p.step, "epoch": p.epoch, **extra})
        if p.step % self.run.cfg.run.save_every == 0:
            self.save()
        if self.meter is not None:
            self.epoch_ends.append(time.perf_counter() - start)
            self.meter.pause()  # the evaluation and the state are not a training step's time (the plan estimates evaluations apart)

    def save(self) -> None:
        self.check_finite()  # a state never holds a step past a non-finite loss the run stops at
        self.count_time()
        save_state(self.run, self.progress)

    def count_time(self) -> None:
        """Add the time since the last call to `progress.train_time` (which resume states carry)."""
        now = time.perf_counter()
        self.progress.train_time += now - self.segment_start
        self.segment_start = now

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def finish(self) -> Progress:
        """The end of training is always resumable (e.g. to extend it): saved unless the last epoch's state is that step."""
        self.close_bar()
        self.busy.stop()
        self.run.gpu_busy = self.busy.mean()
        self.check_finite()
        self.losses.close()
        self.count_time()
        p = self.progress
        if not is_complete_state(state_path(self.run.dir, p.step)):
            save_state(self.run, p)
        return p


def _any_rank(acc, flag: bool) -> bool:
    """True on every rank if it is true on any (so all ranks save and stop together)."""
    if acc.num_processes == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=acc.device)
    return bool(acc.reduce(t, reduction="sum").item() > 0)


def make_bar(run: Run, total: int, initial: int):
    if not (run.is_main and run.cfg.run.progress):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=run.stage, dynamic_ncols=True, mininterval=1.0, file=sys.stderr)


def batches_forever(loader, start_epoch: int = 0) -> Iterator:
    epoch = start_epoch
    while True:
        yield from loader.epoch(epoch)
        epoch += 1
