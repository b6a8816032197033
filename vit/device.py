"""Which torch device a command runs on, waiting for it, and what the machine is: `pick_device("auto")`,
`synchronize(device)`, `host(device)`."""

from __future__ import annotations

import contextlib
import os
import platform
import threading
import traceback
import warnings
from pathlib import Path
from typing import Iterator

import torch

from vit.errors import ConfigError


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask (a `taskset`, a cluster scheduler's allocation), which
    `os.cpu_count()` ignores (it counts the machine's: 128 threads on a node of which the job was given 8)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# DataLoader workers hand each batch's tensors over as file descriptors, through a Unix socket that multiprocessing
# makes in the temporary folder (`<tmp>/pymp-XXXXXXXX/listener-XXXXXXXX`); Linux refuses a socket path of more than 107
# bytes, and the workers then never deliver a batch: the run hangs at its first one, without a word.
SOCKET_PATH_MAX = 107
SOCKET_SUFFIX = os.path.join("pymp-XXXXXXXX", "listener-XXXXXXXX")


def check_worker_socket_dir(workers: int, setting: str = "data.workers") -> None:
    """Refuse, in one line, data workers whose temporary folder is too long a path for the socket they pass batches by."""
    import tempfile

    folder = tempfile.gettempdir()
    if workers > 0 and platform.system() == "Linux" and len(os.fsencode(os.path.join(folder, SOCKET_SUFFIX))) > SOCKET_PATH_MAX:
        raise ConfigError(f"{setting}={workers}: data workers pass batches through a Unix socket in the temporary folder {folder}, "
                          f"whose path would pass the {SOCKET_PATH_MAX} bytes Linux allows and hang the run: set TMPDIR to a "
                          f"shorter folder (TMPDIR=/tmp), or {setting}=0")  # fmt: skip


def mps_available() -> bool:
    return hasattr(torch.backends, "mps") and torch.backends.mps.is_available()


def pick_device(name: str, option: str = "--device") -> torch.device:
    """`auto` (CUDA, else MPS, else CPU), `cpu`, `cuda` or `mps`; a device that is not there is a ConfigError naming `option`."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps") if mps_available() else torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{option} cuda: no CUDA device is available")
    if name == "mps" and not mps_available():
        raise ConfigError(f"{option} mps: MPS is not available")
    if name not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"{option} {name}: expected auto, cpu, cuda or mps")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait until `device` has finished the work queued on it (a no-op on the CPU), so a clock read after it is honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (made on the CPU) on `device` without making the host wait: a CUDA copy goes through pinned memory,
    asynchronously (a plain `.to("cuda")` of pageable memory blocks until the GPU has run everything queued before it)."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class BusySampler:
    """How busy a CUDA device is while a run trains: NVML's utilisation (the share of time a kernel was running, as
    `nvidia-smi` shows it) read every `interval` seconds in a background thread. `mean()` is None off CUDA or where NVML
    cannot be read (no `nvidia-ml-py`)."""

    def __init__(self, device: torch.device, interval: float = 0.2):
        self.device, self.interval = device, interval
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "BusySampler":
        if self.device.type != "cuda" or self._thread is not None:
            return self
        try:
            torch.cuda.utilization(self.device)
        except Exception:  # no NVML here: nothing to sample
            return self
        self._thread = threading.Thread(target=self._run, name="gpu-busy", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.samples.append(float(torch.cuda.utilization(self.device)))
            except Exception:
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def mean(self) -> float | None:
        return round(sum(self.samples) / len(self.samples), 1) if self.samples else None


# The CPU flags that decide a training step's speed: AVX2 (fp32 only), AVX-512, native bf16 (AVX512-BF16, AMX).
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_model_and_flags(cpuinfo: str | None = None) -> tuple[str, list[str]]:
    """The CPU's model name and which of SPEED_FLAGS it has, from /proc/cpuinfo (or `cpuinfo`'s text);
    platform's description and no flags where there is none (macOS, Windows)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    first: dict[str, str] = {}  # the first processor's lines
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    model = first.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in first and "model" in first:
        # A hypervisor may show one name ("AMD EPYC") for CPU generations whose speed differs: the family and model tell them apart
        model += f" (family {first['cpu family']} model {first['model']})"
    flags = set(first.get("flags", "").split())
    return model, [f for f in SPEED_FLAGS if f in flags]


def host(device: torch.device) -> dict:
    """What a run's speed depends on, for its summary: CPU model and speed flags, torch's CPU kernels, cores, GPU name.
    Minutes (a time budget) only compare between runs whose `vit.tools.records.host_label` is the same."""
    cpu, flags = cpu_model_and_flags()
    info = {"cpu": cpu, "cpu_flags": flags, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
            "usable_cores": usable_cores(), "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__}  # fmt: skip
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def caller_outside_torch(filename: str, lineno: int) -> str:
    """`file:line` of the innermost frame on the current stack outside torch (the code that made torch wait), else
    the warning's own `filename:lineno`."""
    torch_dir = str(Path(torch.__file__).parent)
    frames = [f for f in traceback.extract_stack()[:-2] if not f.filename.startswith(torch_dir) and "warnings" not in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else f"{filename}:{lineno}"


@contextlib.contextmanager
def count_host_reads(device: torch.device) -> Iterator[dict]:
    """Counts what makes the host wait for `device` inside the block, into the yielded dict's "reads" (final at exit;
    on CUDA its "where" lists the lines that waited).

    CUDA: every synchronising call, as torch's sync debug mode reports it. Elsewhere (no device to wait for, so
    the calls that would wait on one are counted): `.item()`, `.tolist()`, `.numpy()`, `.cpu()`, a tensor's truth or
    number value (an index too: `x[:n]`, `range(n)` of a tensor `n`) and `torch.equal` / `allclose` / `is_nonzero`."""
    counter = {"reads": 0}
    if device.type == "cuda":
        where: list[str] = []

        def seen(message, category, filename, lineno, file=None, line=None) -> None:
            if "synchroniz" in str(message):
                where.append(caller_outside_torch(filename, lineno))

        before = torch.cuda.get_sync_debug_mode()  # a caller's own mode ("error" in a test) is given back, not reset
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = seen  # called in the waiting thread, so its stack names the caller
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield counter
            finally:
                torch.cuda.set_sync_debug_mode(before)
        counter["reads"] = len(where)
        counter["where"] = sorted(set(where))
        return
    # A tensor used as an index (`__index__`) or compared whole (`equal`) is read as surely as by `.item()`: a step
    # that sliced by a device tensor counted no read here and waited for the GPU every step there.
    methods = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "__complex__", "is_nonzero",
               "equal", "allclose")  # fmt: skip
    read_by = [(torch.Tensor, name) for name in methods] + [(torch, name) for name in ("equal", "allclose", "is_nonzero")]
    # (owner, name, what to put back: None where the name was inherited, as most of the Tensor's are, and is deleted again)
    originals = [(owner, name, vars(owner).get(name)) for owner, name in read_by]

    def counting(original):
        def read(*args, **kwargs):
            counter["reads"] += 1
            return original(*args, **kwargs)

        return read

    for owner, name, _ in originals:
        setattr(owner, name, counting(getattr(owner, name)))
    try:
        yield counter
    finally:
        for owner, name, original in originals:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
