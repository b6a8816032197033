"""The Accelerator a run trains with: its device and precision (`run.precision=auto`: bf16 where the device computes
it natively), the CPU threads of each process, and `torch.compile` as `run.compile` asks for it on that device."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from vit.config import RunConfig
from vit.errors import ConfigError, UserError
from vit.store.runs import TENSORBOARD_DIR

if TYPE_CHECKING:
    from vit.train.run import Run


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 in hardware. A CPU without AVX512-BF16 or AMX (AVX2-only
    laptops and servers) has CPU autocast emulate it, many times slower than fp32 (docs/running.md)."""
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
