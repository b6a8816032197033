"""One live run per run folder: the folder's lock (`run.lock`), held for the run's life by the process that writes it.

    lock = lock_run(run_dir)   # or a UserError naming the process that holds it; None where the OS has no flock
    ...
    lock.release()
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

from vit.errors import UserError
from vit.store.atomic import nearest_existing
from vit.store.runs import LOCK_FILE


class RunLock:
    """The run folder's lock (`run.lock`, an `flock`), held for the run's life by the one process that writes the
    folder. The OS releases it when that process ends, however it ends (a kill, a crash), so a dead run never
    keeps its folder locked."""

    def __init__(self, path: Path, file, made: bool = False):
        self.path, self.file = path, file
        self.pid = os.getpid()  # the process that took it: a forked child (a data worker) inherits this object too
        self.made = made  # whether taking it made the run folder: one that holds nothing when released goes with it

    def release(self) -> None:
        if self.file is None:
            return
        _HELD.pop(str(self.path), None)
        # Removed while still held: a process that opened the file before the removal finds it gone once it holds
        # the lock, and takes the new one (see `lock_run`).
        self.path.unlink(missing_ok=True)
        self.file.close()
        self.file = None
        if self.made:  # a run refused before it wrote anything leaves no empty folder (rmdir removes only an empty one)
            with contextlib.suppress(OSError):
                self.path.parent.rmdir()


_HELD: dict[str, RunLock] = {}  # this process's locks: a later run here (tests, a notebook) takes its folder's over


@atexit.register
def _release_at_exit() -> None:
    """A run that stopped on an error (bad data, a refused init) never reaches `finish`: the OS frees its lock at exit,
    and this removes its file, whose PID would name a process that is gone. Not in a forked child (a data worker), whose
    exit must not remove the file its parent still holds."""
    for lock in list(_HELD.values()):
        if lock.pid == os.getpid():
            lock.release()


def lock_run(run_dir: Path) -> RunLock | None:
    """Hold `run_dir`'s lock, or refuse in one line naming the process that holds it (a UserError).

    None where the OS or file system has no `flock` (Windows, some network mounts): the run goes on unlocked,
    after one warning."""
    try:
        import fcntl
    except ImportError:  # Windows
        print(f"warning: no file locks on this system: nothing stops a second run from writing {run_dir} at the same time",
              file=sys.stderr, flush=True)  # fmt: skip
        return None
    run_dir = Path(run_dir)
    made = make_run_folder(run_dir)
    # The real path: the same folder named another way (relative, through a link, after a chdir) is the same lock, which
    # a second flock by this process would find taken, refusing this process for itself.
    path = Path(os.path.realpath(run_dir / LOCK_FILE))
    if (held := _HELD.get(str(path))) is not None:  # a run of this process refused before: its folder is this run's now
        made, held.made = made or held.made, False
        held.release()
    while True:
        f = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o666), "r+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(f)
            f.close()
            raise UserError(f"run folder {run_dir} is in use by {_describe_holder(holder)}: two runs would write the same "
                            "states and metrics; wait for it to end (or stop it), or choose another run.name") from None  # fmt: skip
        except OSError as e:  # a file system without locks
            f.close()
            print(f"warning: cannot lock {path} ({e.strerror}): nothing stops a second run from writing {run_dir} at the same time",
                  file=sys.stderr, flush=True)  # fmt: skip
            return None
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(os.fstat(f.fileno()), current):
            break
        f.close()  # the last holder removed the file between our open and our lock: lock the one there now
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    f.flush()
    lock = _HELD[str(path)] = RunLock(path, f, made)
    return lock


def make_run_folder(run_dir: Path) -> bool:
    """Create `run_dir` (True where it was not there), or refuse in one line a file where it or a folder above it should
    be (mkdir's own error, "File exists", names no reason the user can act on)."""
    if not (folder := nearest_existing(run_dir)).is_dir():
        raise UserError(f"run folder {run_dir}: {folder} is a file, not a folder; choose another run.dir or run.name")
    made = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    return made


def _read_holder(f, wait: float = 1.0) -> str:
    """What the lock's holder wrote in it: a holder that took the lock this instant writes its PID just after, so an empty
    or half-written file is read again for up to `wait` seconds (the message then names the process, not "another")."""
    deadline = time.monotonic() + wait
    while True:
        f.seek(0)
        text = f.read()
        if text.endswith("\n") or time.monotonic() > deadline:
            return text
        time.sleep(0.01)


def _describe_holder(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"process {holder['pid']} on {holder['host']} (since {holder['since']})"
    except (ValueError, KeyError, TypeError):  # written this instant, or by something else
        return "another process"
