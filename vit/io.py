"""Atomic file writes: a reader sees the old file or the whole new one, never a torn one.

No model import here, so loading data or writing a summary does not import the ViT.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call `write(tmp_path)` on a temporary file next to `path`, fsync it, then rename it over `path`.

    A crash mid-write leaves the old file intact: the rename is atomic on POSIX.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        usual_permissions(tmp)  # after `write`: some writers (safetensors) replace the file with a 0600 one of their own
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def usual_permissions(path: str | os.PathLike) -> None:
    """Give a file the permissions `open(path, "w")` would: 0666 less the umask. A file made through a temporary one
    (mkstemp, safetensors' `save_file`) is 0600, unreadable by the others the umask lets read it."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """`torch.save(obj, path)`, atomically."""
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
