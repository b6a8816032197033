"""The training-loop pieces every stage shares.

    run = Run.start(cfg, stage="pretrain")           # accelerator, threads, seed, run folder, trackers
    model, optimizer = run.accelerator.prepare(model, optimizer)
    result = fit(run, model, optimizer, loader, loss_fn, on_epoch_end=...)
    run.finish(summary)

`fit` owns the schedule (learning rate set per optimiser step, never a scheduler
handed to `prepare`, which would step once per process), gradient accumulation,
clipping, mixed precision, the non-finite-loss guard, metrics, resume states and
pre-emption signals. Resume states are Accelerate `save_state` folders written
under a temporary name and renamed when complete, so `run.resume=auto` never
picks up a half-written one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from vit.checkpoint import atomic_write_text
from vit.config import RunConfig, dump_config, to_dict
from vit.errors import ConfigError, UserError

STATE_DIR = "states"
STATE_FILE = "trainer.json"  # written last: its presence marks a complete state
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "encoder.pt", "classifier.pt", STATE_DIR)  # what makes a folder hold a run


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
    from vit.lars import LARS

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

    `run.precision=auto` is resolved for the device here, and `run_cfg.precision` is set to the
    result, so the run folder records what ran. A tracker that cannot be set up (say tensorboard
    is not installed) costs one warning, not the run.
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
    run_cfg.precision = resolve_precision(requested, state.device)
    if requested == "bf16" and not native_bf16(state.device) and state.is_main_process:
        print(f"warning: run.precision=bf16 on a {state.device.type} without native bf16 is emulated and can be many times slower "
              "than fp32; run.precision=auto chooses for the device", file=sys.stderr)  # fmt: skip
    project = ProjectConfiguration(project_dir=str(run_cfg.path), logging_dir=str(run_cfg.path / "tensorboard"))
    kwargs = dict(cpu=cpu, mixed_precision=run_cfg.precision, project_config=project)
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

    @classmethod
    def start(cls, cfg: Any, stage: str, job_type: str | None = None, parent: str | None = None) -> "Run":
        from accelerate.utils import set_seed

        run_cfg: RunConfig = cfg.run
        accelerator = make_accelerator(run_cfg, log_with=None if run_cfg.tracker == "none" else run_cfg.tracker)
        threads = set_threads(run_cfg, accelerator)
        run_dir = run_cfg.path
        check_run_dir(run_dir, run_cfg)
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
        run = cls(cfg=cfg, stage=stage, accelerator=accelerator, dir=run_dir, threads=threads, job_type=meta["job_type"], meta=meta)
        if accelerator.is_main_process:
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(run_dir / "config.yaml", dump_config(cfg, meta))
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
            init_kwargs["wandb"] = {
                "name": run_cfg.name,
                "group": run_cfg.group,
                "job_type": self.job_type,
                "dir": str(self.dir),
                "mode": run_cfg.wandb_mode,
            }
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
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.trackers_on:
            try:
                self.accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record.get("step"))
            except Exception as e:
                self.warn(f"tracker log failed ({type(e).__name__}); metrics stay in metrics.jsonl")

    def log_images(self, images: dict[str, Path], step: int) -> None:
        if not (self.is_main and self.trackers_on):
            return
        try:
            for tracker in self.accelerator.trackers:
                if tracker.name == "wandb":
                    import wandb

                    tracker.log({k: wandb.Image(str(p)) for k, p in images.items()}, step=step)
        except Exception as e:
            self.warn(f"tracker image log failed ({type(e).__name__})")

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        summary = {"stage": self.stage, **summary, "processes": self.accelerator.num_processes, "device": str(self.accelerator.device),
                   "threads_per_process": self.threads, "precision": self.cfg.run.precision, "seed": self.cfg.run.seed,
                   "git_commit": self.meta["git_commit"], "run_dir": str(self.dir)}  # fmt: skip
        if self.is_main:
            atomic_write_text(self.dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        if self.trackers_on:
            try:
                self.accelerator.end_training()
            except Exception as e:
                self.warn(f"tracker did not close cleanly ({type(e).__name__})")
        return summary


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
    if not any((run_dir / name).exists() for name in RUN_OUTPUTS):
        return  # an empty folder, or one holding only the config of a run that failed to start
    if not run_cfg.overwrite:
        raise ConfigError(
            f"run folder {run_dir} already holds a run; resume it with run.resume=auto, "
            "choose another run.name, or pass run.overwrite=true to replace it"
        )
    # Overwrite: clear the previous run's outputs so they cannot be mistaken for this one's.
    if int(os.environ.get("RANK", "0")) == 0:
        for name in RUN_OUTPUTS:
            path = run_dir / name
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


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


def state_dirs(run_dir: Path) -> list[Path]:
    """Complete resume states, oldest first."""
    root = run_dir / STATE_DIR
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.name.startswith("step_") and (p / STATE_FILE).is_file()), key=lambda p: p.name)


def save_state(run: Run, progress: Progress) -> Path:
    """Write an Accelerate resume state atomically and keep the newest `run.keep_states`."""
    acc = run.accelerator
    root = run.dir / STATE_DIR
    final = root / f"step_{progress.step:08d}"
    tmp = root / f".tmp_step_{progress.step:08d}"
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    acc.save_state(str(tmp))
    acc.wait_for_everyone()
    if acc.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(progress.__dict__))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in state_dirs(run.dir)[: -run.cfg.run.keep_states]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return final


def trim_metrics(path: Path, step: int) -> int:
    """Drop the records of metrics.jsonl logged after `step` (and a line cut off by a kill); returns how many.

    A run resumed from the state of step S repeats the steps after S and logs them again, so
    without this the file would hold those steps twice.
    """
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step:
            dropped += 1
            continue
        kept.append(line + "\n")
    if dropped:
        atomic_write_text(path, "".join(kept))
    return dropped


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
        if not (path / STATE_FILE).is_file():
            raise ConfigError(f"run.resume={resume}: not a complete resume state (no {STATE_FILE} inside)")
        candidates = [path]
    for path in candidates:
        try:
            progress = Progress(**json.loads((path / STATE_FILE).read_text()))
            run.accelerator.load_state(str(path))
        except Exception as e:
            if resume != "auto":
                raise ConfigError(f"run.resume={resume}: the state does not load ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
            run.warn(f"resume state {path} is unreadable ({type(e).__name__}); trying the one before")
            continue
        run.print(f"resume: from {path} at step {progress.step} (epoch {progress.epoch}, batch {progress.batch})")
        if run.is_main:
            dropped = trim_metrics(run.dir / "metrics.jsonl", progress.step)
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

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch


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
    )


LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def fit(
    run: Run,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader,
    loss_fn: LossFn,
    spec: LoopSpec,
    progress: Progress | None = None,
    on_epoch_end: Callable[[int, Progress], dict[str, float] | None] | None = None,
    train_mode: Callable[[nn.Module], None] | None = None,
) -> Progress:
    """Train `model` for `spec.epochs` epochs of `loader` (resuming from `progress`); returns the final progress.

    `loss_fn(model, images, labels) -> (loss, extras)` runs under autocast; extras are
    scalar tensors averaged into the logged metrics. `on_epoch_end(epoch, progress)`
    may evaluate and return metrics to log. `train_mode(model)` puts the model in
    training mode (a linear probe keeps its encoder in eval mode).
    """
    acc = run.accelerator
    run_cfg: RunConfig = run.cfg.run
    accum = run.cfg.optim.grad_accum_steps
    clip = run.cfg.optim.clip_grad
    progress = progress or Progress()
    train_mode = train_mode or (lambda m: m.train())
    stop_at = spec.total_steps if spec.max_steps is None else min(spec.total_steps, spec.max_steps)
    bar = make_bar(run, stop_at, progress.step)
    window: dict[str, torch.Tensor] = {}
    window_steps, window_images, window_start = 0, 0, time.perf_counter()
    segment_start = time.perf_counter()
    images_per_step = loader.batch_size * accum * acc.num_processes

    def record(extra: dict[str, float] | None = None) -> dict[str, Any]:
        nonlocal window, window_steps, window_images, window_start
        elapsed = time.perf_counter() - window_start
        metrics = {k: (v / max(1, window_steps)).item() for k, v in window.items()}
        rec = {"step": progress.step, "epoch": round(progress.epoch + progress.batch / max(1, len(loader)), 4),
               "lr": lr, **metrics, "images_per_sec": window_images / elapsed if elapsed > 0 else 0.0,
               "time": round(progress.train_time + time.perf_counter() - segment_start, 2)}  # fmt: skip
        rec.update(extra or {})
        window, window_steps, window_images, window_start = {}, 0, 0, time.perf_counter()
        return rec

    lr = lr_at(progress.step, spec.total_steps, spec.warmup_steps, spec.peak_lr, spec.min_lr)
    with SignalGuard() as signals:
        while progress.epoch < spec.epochs and progress.step < stop_at:
            train_mode(model)
            batches = loader.epoch(progress.epoch, start_batch=progress.batch)
            steps_left_in_epoch = (len(loader) - progress.batch) // accum
            for i in range(steps_left_in_epoch):
                if progress.step >= stop_at:
                    break
                lr = lr_at(progress.step, spec.total_steps, spec.warmup_steps, spec.peak_lr, spec.min_lr)
                set_lr(optimizer, lr)
                loss_sum = None
                for micro in range(accum):
                    images, labels = next(batches)
                    # No gradient all-reduce until the last micro-batch of the step.
                    sync = micro == accum - 1
                    context = acc.no_sync(model) if not sync and acc.num_processes > 1 else contextlib.nullcontext()
                    with context:
                        with acc.autocast():
                            loss, extras = loss_fn(model, images, labels)
                        acc.backward(loss / accum)
                    loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
                    for k, v in extras.items():
                        window[k] = window.get(k, 0) + v.detach().float() / accum
                progress.batch += accum
                step_loss = loss_sum / accum
                bad_loss = _non_finite_on_any_rank(acc, step_loss)
                if bad_loss is not None:
                    optimizer.zero_grad(set_to_none=True)
                    progress.nan_skips += 1
                    where = f"step {progress.step}, lr {lr:.3g}, precision {run_cfg.precision}, loss {run.stage}"
                    if progress.nan_skips > run_cfg.nan_skip_budget:
                        raise NonFiniteLoss(f"non-finite loss ({bad_loss}) at {where}; the last good resume state is kept in {run.dir / STATE_DIR}")
                    run.warn(f"non-finite loss at {where}; step skipped ({progress.nan_skips}/{run_cfg.nan_skip_budget})")
                    continue
                if clip is not None:
                    acc.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                progress.step += 1
                progress.images += images_per_step
                window["loss"] = window.get("loss", 0) + step_loss.float()
                window_steps += 1
                window_images += images_per_step
                if bar is not None:
                    bar.update(1)
                if progress.step % run_cfg.log_every == 0 or progress.step == stop_at:
                    rec = record()
                    run.log(rec)
                    if bar is not None:
                        bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{lr:.2e}", img_s=f"{rec['images_per_sec']:.0f}")
                preempted = _any_rank(acc, signals.received is not None)
                # The last step of an epoch is saved after its evaluation (below), so that a state at step S
                # always follows every metrics record of steps <= S (see trim_metrics).
                if (progress.step % run_cfg.save_every == 0 and i < steps_left_in_epoch - 1) or preempted:
                    progress.train_time += time.perf_counter() - segment_start
                    segment_start = time.perf_counter()
                    save_state(run, progress)
                if preempted:
                    if bar is not None:
                        bar.close()
                    raise Preempted(f"stopped by signal at step {progress.step}; resume with run.resume=auto")
            else:
                # The epoch ran to its end (not cut by max_steps).
                progress.epoch += 1
                progress.batch = 0
                extra = on_epoch_end(progress.epoch, progress) if on_epoch_end else None
                if window_steps:
                    run.log(record(extra))
                elif extra:
                    run.log({"step": progress.step, "epoch": progress.epoch, **extra})
                progress.train_time += time.perf_counter() - segment_start
                segment_start = time.perf_counter()
                save_state(run, progress)
                continue
            break  # max_steps reached mid-epoch
    if bar is not None:
        bar.close()
    progress.train_time += time.perf_counter() - segment_start
    if window_steps:
        run.log(record())
    if not (run.dir / STATE_DIR / f"step_{progress.step:08d}" / STATE_FILE).is_file():
        save_state(run, progress)  # the end of training is always resumable (e.g. to extend it)
    return progress


def _non_finite_on_any_rank(acc, loss: torch.Tensor) -> float | None:
    """The first non-finite loss of any rank (the same on every rank), else None: all ranks skip or stop together,
    where a per-rank decision would let one rank step while another skips, and desynchronise them."""
    losses = acc.gather(loss.detach().float().reshape(1)) if acc.num_processes > 1 else loss.detach().reshape(1)
    bad = losses[~torch.isfinite(losses)]
    return bad[0].item() if bad.numel() else None


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
