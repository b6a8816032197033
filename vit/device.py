"""Which torch device a command runs on, and waiting for it: `pick_device("auto")`, `synchronize(device)`."""

from __future__ import annotations

import torch

from vit.errors import ConfigError


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
