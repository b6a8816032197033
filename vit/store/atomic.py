"""Atomic file writes: a reader sees the old file or the whole new one, never a torn one; and where a folder can be made.

No model import here, so loading data or writing a summary does not import the ViT.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from vit.errors import STORAGE_ERRNOS, StorageError

LOW_SPACE = 64 * 2**20  # bytes: less free space than this after a failed write means the disk is what refused it


def nearest_existing(path: Path) -> Path:
    """`path`, or the nearest folder above it that exists: where making `path` as a folder starts. Where that is a file,
    no folder can be made there (mkdir's own error, "File exists" or "Not a directory", names no reason to act on)."""
    return next((p for p in (path, *path.absolute().parents) if p.exists()), path)  # the root always exists


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call `write(tmp_path)` on a temporary file next to `path`, fsync it, then rename it over `path`.

    A crash mid-write leaves the old file intact: the rename is atomic on POSIX. A write the disk refuses (full, over
    quota) removes the temporary file and is a StorageError naming `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:  # a read-only folder, a full disk: its error names the random temporary name, not the file
        reason = storage_failure(e, path.parent)
        if reason is not None:
            raise StorageError(f"cannot write {path}: {reason}") from None
        raise OSError(e.errno, e.strerror, str(path)) from None
    os.close(fd)
    try:
        write(tmp)
        usual_permissions(tmp)  # after `write`: some writers (safetensors) replace the file with a 0600 one of their own
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        reason = storage_failure(e, path.parent) if isinstance(e, Exception) else None  # before the partial file frees its space
        Path(tmp).unlink(missing_ok=True)
        if reason is not None:
            raise StorageError(f"cannot write {path}: {reason}") from None
        raise


def storage_failure(error: BaseException, folder: str | os.PathLike) -> str | None:
    """What a failed write says about the storage ("No space left on device", ...); None when it is not about storage.

    Writers that wrap the OS error are read from their message: safetensors' names it ("os error 28"), torch's zip
    writer does not ("unexpected pos ..."), so for it the free space left in `folder` decides.
    """
    if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS:
        return error.strerror or os.strerror(error.errno)
    text = str(error)
    code = re.search(r"os error (\d+)", text)
    if code and int(code.group(1)) in STORAGE_ERRNOS:
        return os.strerror(int(code.group(1)))
    if isinstance(error, RuntimeError) and ("PytorchStreamWriter" in text or "inline_container" in text):
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            return None
        if free < LOW_SPACE:
            return f"{os.strerror(STORAGE_ERRNOS[0])} ({free / 2**20:.0f} MiB free)"
    return None


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
    import torch  # here alone: the run folder's readers and the table tools start without torch (tests/test_runs.py)

    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
