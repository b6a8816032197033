"""The Accelerator a run trains with: its device and precision (`run.precision=auto`: bf16 where the device computes
it natively), the CPU threads of each process, and `torch.compile` as `run.compile` asks for it on that device."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.nn as nn

from vit.config import SHARED_BY_ENV, RunConfig
from vit.device import usable_cores
from vit.errors import ConfigError, SaidElsewhere, UserError
from vit.store.runs import TENSORBOARD_DIR
from vit.train.graph import graph_unfit

if TYPE_CHECKING:
    from vit.train.run import Run


T = TypeVar("T")


def main_first(accelerator, work: Callable[[], T]) -> T:
    """`work()` on the main process, then on the others (which read what it cached), as Accelerate's
    `main_process_first`; but a UserError of the main process (a bad data.root) stops the others too, quietly, where
    they waited in a barrier it never reached until the launcher's end of it gave them a traceback of their own."""
    if accelerator.num_processes == 1:
        return work()
    failure = None
    if accelerator.is_main_process:
        try:
            result = work()
        except UserError as e:
            failure = e
    said = [None if failure is None else str(failure)]
    torch.distributed.broadcast_object_list(said, src=0)  # the barrier: the main process is done, or has failed
    if failure is not None:
        raise failure
    if said[0] is not None:
        raise SaidElsewhere(said[0])
    return result if accelerator.is_main_process else work()


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 in hardware. A CPU without AVX512-BF16 or AMX (AVX2-only
    laptops and servers) has CPU autocast emulate it, many times slower than fp32 (docs/running.md)."""
    if device.type == "cuda":
        # Ampere (compute capability 8) and later, or ROCm. torch.cuda.is_bf16_supported() also says yes where bf16 is only
        # emulated (a V100, a T4: it counts a bf16 tensor that can be made), which made `auto` train there in emulated bf16.
        return bool(torch.version.hip) or torch.cuda.get_device_properties(device).major >= 8
    if device.type == "cpu":
        return any(getattr(torch.cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return False  # MPS and others: fp32 unless asked


def resolve_precision(requested: str, device: torch.device) -> str:
    """`run.precision` as Accelerate takes it: `auto` is bf16 where the device has it natively, else `no` (fp32)."""
    if requested == "auto":
        return "bf16" if native_bf16(device) else "no"
    if requested == "fp16" and device.type != "cuda":
        raise ConfigError(f"run.precision=fp16 needs a CUDA GPU, this run is on {device.type}; use run.precision=auto")
    return requested


# Whole numbers a launcher sets, which Accelerate and `set_threads` read with int(): anything else was a traceback.
LAUNCH_NUMBERS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# Accelerate's truth values (accelerate.utils.str_to_bool), which it reads ACCELERATE_USE_CPU with: anything else was a traceback.
TRUTH_VALUES = ("y", "yes", "t", "true", "on", "1", "n", "no", "f", "false", "off", "0")


def check_launch_env(env=os.environ) -> None:
    """A ConfigError naming the environment variable a launcher reads that holds what it cannot read."""
    for name in LAUNCH_NUMBERS:
        if name in env and not env[name].strip().isdigit():
            raise ConfigError(f"environment variable {name}={env[name]!r} must be a whole number (it is a launcher's; unset it)")
        if name.endswith("SIZE") and name in env and int(env[name]) == 0:  # set_threads divides the cores by it
            raise ConfigError(f"environment variable {name}={env[name]!r} must be at least 1 (it is a launcher's; unset it)")
    if env.get("ACCELERATE_USE_CPU", "").lower() not in ("",) + TRUTH_VALUES:
        raise ConfigError(f"environment variable ACCELERATE_USE_CPU={env['ACCELERATE_USE_CPU']!r} must be 1 or 0 (true or false)")


def ignored_launch_settings(precision: str, env=os.environ) -> list[str]:
    """Warnings for what `accelerate launch` (its flags, or `accelerate config`) asked for in the environment that the run
    does not use: run.precision and run.compile decide."""
    said = []
    # `accelerate launch` without --multi_gpu (with --cpu, or on a machine without GPUs) starts one process however many
    # --num_processes asks for; it still sets MASTER_ADDR for them, and each process started by a launcher of several
    # has WORLD_SIZE. One process trains with 1/N of the batch asked for. A warning, not a refusal: a cluster's job script
    # may export MASTER_ADDR itself around a launch of one process.
    if "ACCELERATE_DYNAMO_BACKEND" in env and "MASTER_ADDR" in env and "WORLD_SIZE" not in env:
        said.append("warning: accelerate launch set MASTER_ADDR, as for several processes, and started this one alone: without "
                    "--multi_gpu it starts one however many --num_processes asks for. On CPUs: ACCELERATE_USE_CPU=1 accelerate "
                    "launch --multi_gpu --num_processes N")  # fmt: skip
    asked = env.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if asked not in ("", "no") and asked != precision:
        said.append(f"warning: ACCELERATE_MIXED_PRECISION={asked} (accelerate launch --mixed_precision, or accelerate config) is "
                    f"not used: run.precision decides, and {'fp32' if precision == 'no' else precision} runs")  # fmt: skip
    backend = env.get("ACCELERATE_DYNAMO_BACKEND", "no").strip().lower()
    if backend not in ("", "no"):
        said.append(f"warning: ACCELERATE_DYNAMO_BACKEND={backend} (accelerate launch --dynamo_backend, or accelerate config) is not "
                    "used: run.compile decides whether the model is compiled")  # fmt: skip
    return said


def make_accelerator(run_cfg: RunConfig, log_with: str | None = None):
    """An Accelerator on the requested device; refuses a device that is not there and a broken launch.

    `run.precision=auto` is resolved for the device here (`accelerator.mixed_precision` says what
    runs; `run_cfg` is left as asked). A tracker that cannot be set up (say tensorboard is not
    installed) costs one warning, not the run.
    """
    from accelerate import Accelerator, PartialState
    from accelerate.utils import ProjectConfiguration, parse_flag_from_env

    check_launch_env()
    check_compile_cache()
    device = run_cfg.device
    if device == "cuda" and not torch.cuda.is_available():
        hidden = " (CUDA_VISIBLE_DEVICES is empty)" if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "" else ""
        raise ConfigError(f"run.device=cuda was requested but no CUDA device is available{hidden}")
    if device == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ConfigError("run.device=mps was requested but MPS is not available")
    # Accelerate's own choice of device decides the precision. The Accelerator reads ACCELERATE_USE_CPU
    # (a multi-process CPU launch) itself; the state made first must see it too, or it starts one process.
    cpu = device == "cpu" or parse_flag_from_env("ACCELERATE_USE_CPU")
    if cpu and device in ("cuda", "mps"):  # a leftover variable or `accelerate launch --cpu` would train on the CPU unsaid
        raise ConfigError(f"run.device={device} was requested, but ACCELERATE_USE_CPU is set (accelerate launch --cpu, or the "
                          f"environment): unset it to train on {device}, or set run.device=cpu")  # fmt: skip
    state = PartialState(cpu=cpu)
    requested = run_cfg.precision
    precision = resolve_precision(requested, state.device)
    if requested == "bf16" and not native_bf16(state.device) and state.is_main_process:
        print(f"warning: run.precision=bf16 on a {state.device.type} without native bf16 is emulated and can be many times slower "
              "than fp32; run.precision=auto chooses for the device", file=sys.stderr)  # fmt: skip
    if state.is_main_process:
        for line in ignored_launch_settings(precision):
            print(line, file=sys.stderr)
    project = ProjectConfiguration(project_dir=str(run_cfg.path), logging_dir=str(run_cfg.path / TENSORBOARD_DIR))
    # dynamo_backend "no": else `prepare` compiles the model as ACCELERATE_DYNAMO_BACKEND says, whatever run.compile says
    kwargs = dict(cpu=cpu, mixed_precision=precision, project_config=project, dynamo_backend="no")
    try:
        accelerator = Accelerator(log_with=log_with, **kwargs)
    except (ValueError, ImportError) as e:
        if log_with is None:
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"warning: tracker {log_with!r} is not available ({str(e).splitlines()[0][:160]}); continuing with the run folder only", file=sys.stderr)
        accelerator = Accelerator(**kwargs)
    if log_with is not None and not accelerator.log_with and accelerator.is_main_process:  # not installed: Accelerate drops it
        print(f"warning: tracker {log_with!r} is not installed (pip install {log_with}); continuing with the run folder only",
              file=sys.stderr)  # fmt: skip
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != accelerator.num_processes:
        raise UserError(
            f"WORLD_SIZE={world} but the accelerator runs {accelerator.num_processes} process(es): the processes would train "
            "unsynchronised copies. On CPU launch with ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N"
        )
    return accelerator


def compile_mode(requested: str, device: torch.device, num_processes: int = 1, graphed: bool = False) -> str | None:
    """The torch.compile mode `run.compile` asks for on `device` (None: not compiled). `auto` on CUDA: the default mode
    where the whole step is one CUDA graph of ours (`graphed`: inductor's kernels are captured in it), else CUDA graphs
    of the compiler's own (`reduce-overhead`) for one process, where the step is otherwise launch-bound, and the
    default mode for several (graphs under DDP are untested here); nothing on CPUs and MPS, where compiling cost more
    time than it saved."""
    if requested == "auto":
        if device.type != "cuda":
            return None
        return "default" if graphed or num_processes > 1 else "reduce-overhead"
    if requested == "reduce-overhead" and device.type != "cuda":
        return "default"  # its CUDA graphs are CUDA's: torch.compile drops them elsewhere, unsaid (compile_for_run says it)
    return {"off": None, "on": "default"}.get(requested, requested)


def step_graph_for(run: "Run", optimizer, recomputed: bool = False) -> bool:
    """Whether the run's training step is captured as one CUDA graph (`run.cuda_graph`; vit/train/graph.py); `recomputed`:
    the model's blocks recompute their activations (`recompute_blocks`)."""
    acc, rc = run.accelerator, run.cfg.run
    if rc.cuda_graph == "off":
        return False
    unfit = graph_unfit(acc.device, acc.num_processes, run.cfg.optim.grad_accum_steps, optimizer, getattr(acc, "scaler", None))
    if unfit is None and rc.compile == "reduce-overhead":
        unfit = "run.compile=reduce-overhead captures graphs of its own"
    if unfit is None and recomputed:  # a recomputed block replays the forward's random draws from the generator's saved state
        unfit = "run.grad_checkpointing saves and restores the random generator's state, which a graph capture cannot"
    if unfit is not None and rc.cuda_graph == "on":
        run.warn(f"run.cuda_graph=on: the step runs without a CUDA graph: {unfit}")
    return unfit is None


def recompute_blocks(run: "Run", module: nn.Module) -> bool:
    """`run.grad_checkpointing`: the training model's blocks recompute their activations in the backward pass, where the
    model can (our ViT and MAE, timm's ViT: `set_grad_checkpointing`); whether they do. A model that cannot (a CNN, a
    probe's frozen encoder, which records no gradient) is said at the start (`unused`)."""
    model = run.accelerator.unwrap_model(module)
    if not run.cfg.run.grad_checkpointing or not hasattr(model, "set_grad_checkpointing"):
        return False
    model.set_grad_checkpointing(True)
    run.print("grad checkpointing: the blocks recompute their activations in the backward pass (run.grad_checkpointing)")
    return True


def check_compile_cache() -> None:
    """A ConfigError where TORCHINDUCTOR_CACHE_DIR cannot be torch's compile cache folder. Every run imports the compiler
    (an optimiser does), compiled or not, which made the folder or failed, after the run folder was written, with
    '<path>: File exists' and no word of the variable."""
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not cache:
        return
    try:
        Path(cache).expanduser().mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file, not a folder" if Path(cache).expanduser().is_file() else e.strerror
        raise ConfigError(f"environment variable TORCHINDUCTOR_CACHE_DIR={cache} cannot be torch.compile's cache folder ({why}): "
                          "point it at a folder, or unset it") from None  # fmt: skip


def compile_cache_state() -> str:
    """"empty" where torch.compile's cache folder (TORCHINDUCTOR_CACHE_DIR, else torch's default) holds nothing yet, so
    every kernel of this run compiles inside its time; "used" where it holds what earlier compilations left; "unknown"
    where it cannot be listed."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # torch's own resolution of the folder (and makes it)

    try:
        return "used" if any(Path(cache_dir()).iterdir()) else "empty"
    except OSError:  # a folder this process cannot list: the compiler says so itself when it writes there
        return "unknown"


def compile_for_run(run: "Run", module: nn.Module, optimizer, compile: bool = True) -> nn.Module:
    """`module` compiled as `run.compile` asks (the training forward only: evaluation runs the plain module), and
    whether the loop captures its whole step (`run.cuda_graph`), which the compile mode depends on. `compile=False`:
    never compiled (a cached probe's head)."""
    acc = run.accelerator
    recomputed = recompute_blocks(run, module)
    run.cuda_graph = step_graph_for(run, optimizer, recomputed)
    # Recomputed blocks: none of the compiler's CUDA graphs either (`auto` takes the default mode, as inside a graph).
    mode = compile_mode(run.cfg.run.compile, acc.device, acc.num_processes, run.cuda_graph or recomputed) if compile else None
    run.compile_mode = mode
    if mode == "default" and run.cfg.run.compile == "reduce-overhead":
        run.print(f"compile: run.compile=reduce-overhead adds CUDA graphs, which a {acc.device.type} run has none of: torch.compile's default mode")
    graph = "; the whole step is captured as one CUDA graph after its first steps (run.cuda_graph)" if run.cuda_graph else ""
    if mode is None:
        if graph:
            run.print(f"cuda graph: the whole step is captured as one CUDA graph after its first steps (run.cuda_graph={run.cfg.run.cuda_graph})")
        if compile and run.cfg.run.compile_scope == "blocks":
            run.print(f"compile: off (run.compile={run.cfg.run.compile} on {acc.device.type}): run.compile_scope=blocks compiles nothing")
        return module
    run.compile_cache = compile_cache_state()
    scope = run.cfg.run.compile_scope
    forward, blocks = compile_module(module, mode, scope, acc.unwrap_model(module))
    what = f"each of its {blocks} transformer blocks alone" if blocks else "the training forward"
    if scope == "blocks" and not blocks:
        what += " (run.compile_scope=blocks: the model has no transformer blocks of ours, vit.models.encoder.Block)"
    run.print(f"compile: torch.compile mode {mode} (run.compile={run.cfg.run.compile}), {what}{graph}; the first steps compile, and count "
              f"in the stage's time (its cache folder: {run.compile_cache})")  # fmt: skip
    return forward


def compile_module(module: nn.Module, mode: str, scope: str = "model", inner: nn.Module | None = None) -> tuple[nn.Module, int]:
    """`module` compiled in torch.compile's `mode`, as `run.compile_scope` says: whole (`model`), or each transformer block
    of ours in `inner` (the model inside a wrapper such as DDP; default `module`) alone (`blocks`), the block running its
    compiled forward in training mode only (`Block.compiled`), so that one compilation serves every block of the same
    shapes and evaluation runs eagerly. A model without our blocks compiles whole. Returns the module to train with and
    how many blocks were compiled alone (0: the whole module was)."""
    from vit.models.encoder import Block  # not at the top: the loop's modules stay free of the model (tests/test_runs.py)

    model = module if inner is None else inner  # not `inner or module`: a Sequential (or ModuleList) model is falsy when empty
    blocks = [m for m in model.modules() if isinstance(m, Block)] if scope == "blocks" else []
    for block in blocks:
        block.compiled = torch.compile(block.compute, mode=mode)
    return (module, len(blocks)) if blocks else (torch.compile(module, mode=mode), 0)


# A GPU process's CPU threads for torch's own operations (where `run.threads` is not set): its host only launches kernels
# and draws each chunk of crops. On a 16-core H100 host, 16 threads made that draw take ~150 ms (thread contention, once
# torch.compile had run in the process) and halved the compiled pretraining loop; 1 and 4 threads kept it at 0.95x its
# bare step (docs/performance.md).
GPU_HOST_THREADS = 4




def set_threads(run_cfg: RunConfig, accelerator) -> int:
    """CPU threads per process: `run.threads`, else the cores shared among this machine's processes, and among the
    jobs a sweep runs beside this one (`SHARED_BY_ENV`), at most `GPU_HOST_THREADS` on a GPU."""
    cores = usable_cores()  # a job given 8 of a node's 128 cores shares its 8, not the node's
    if run_cfg.threads is not None:
        threads = run_cfg.threads
        # Beyond a few per core the threads only contend; far beyond, torch cannot allocate their pools (a traceback).
        if threads > 4 * cores:
            raise ConfigError(f"run.threads={threads} is more than 4 per core of this machine's {cores} (that this process may use): "
                              "leave it unset (the cores shared among the processes) or name at most as many as the cores")  # fmt: skip
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes if accelerator.num_processes > 1 else 1))
        shared = os.environ.get(SHARED_BY_ENV, "").strip()
        if shared and not shared.isdigit():
            raise ConfigError(f"environment variable {SHARED_BY_ENV}={shared!r} must be a whole number (the jobs a sweep runs side by side)")
        jobs = max(1, int(shared or 1))
        threads = max(1, cores // (max(1, local) * jobs))
        if accelerator.device.type != "cpu":
            threads = min(threads, GPU_HOST_THREADS)
    torch.set_num_threads(threads)
    return threads
