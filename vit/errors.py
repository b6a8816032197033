"""User-facing errors: bad config, data, checkpoint or command line.

Entry points catch `UserError` and print its message as one line with a non-zero
exit, instead of a traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import os
import re
import sys
from typing import Callable


class UserError(Exception):
    """Something the user gave us is wrong; the message says what and where."""


class ConfigError(UserError):
    pass


class DataError(UserError):
    pass


class CheckpointError(UserError):
    pass


class StorageError(UserError):
    """The disk refused a write (full, over quota); the message names the path and what was kept."""


class NothingToDo(UserError):
    """What was asked is already done (a finished run resumed): the message says where its results are; exit 0."""


class SaidElsewhere(UserError):
    """Another process of the run stopped on a UserError and printed it: this one stops too, exit 2, without a line."""


# What a full disk, a quota or a file-size limit look like to a write.
STORAGE_ERRNOS = tuple(getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EFBIG") if hasattr(errno, name))


EXIT_USER_ERROR = 2

# What a run that ran out of memory can change: the images a step (a resume keeps them), or recomputing the blocks.
OUT_OF_MEMORY_ADVICE = ("a training run fits in less with fewer images a step (optim.batch_size, and optim.grad_accum_steps for the same "
                        "effective batch; data.eval_batch_size where it evaluated) or with run.grad_checkpointing=true, which a resume "
                        "(run.resume=auto, from its last state) may turn on")
# What torch says where a device (CUDA, MPS: "out of memory") or the host's allocator ("can't allocate memory") ran out.
OUT_OF_MEMORY_WORDS = ("out of memory", "can't allocate memory")


def out_of_memory(e: BaseException) -> str | None:
    """torch's first words where `e` is a device (or the host) running out of memory, else None: CUDA's
    `torch.OutOfMemoryError`, and the RuntimeErrors of MPS and of the CPU allocator. Up to three sentences, which say
    what was asked and what was free; from the first that names a PYTORCH_* variable on, it is allocator tuning."""
    text = str(e).strip()
    said = [line.strip() for line in text.splitlines() if any(words in line.lower() for words in OUT_OF_MEMORY_WORDS)]
    if type(e).__name__ != "OutOfMemoryError" and not said:
        return None
    # The last line that says it: a wrapper's first line is not torch's words. A DataLoader worker's error comes back as
    # "Caught OutOfMemoryError in DataLoader worker process 0." and the worker's traceback, which ends in the original.
    if said:
        line = re.sub(r"^[\w.]*(Error|Exception): ", "", said[-1])  # the traceback's last line names the class first
    else:
        line = text.splitlines()[0] if text else ""
    sentences = list(itertools.takewhile(lambda s: "PYTORCH_" not in s, line.split(". ")))[:3]
    # MPS's third sentence is "Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 ... (may cause system failure)": not the advice to give
    return ". ".join(sentences).rstrip(".") or "out of memory"


PEER_LOST = "another process of this run stopped (its own line above says why), so this one stops too"
# What gloo's collectives raise in the processes left when one of a run's processes has gone (its error, or a kill).
PEER_LOST_WORDS = ("Connection closed by peer", "Connection reset by peer")


def peer_lost(e: BaseException) -> bool:
    """Whether `e` is a collective of a run of several processes that failed because another process had stopped."""
    size = os.environ.get("WORLD_SIZE", "1").strip()
    return size.isdigit() and int(size) > 1 and any(words in str(e) for words in PEER_LOST_WORDS)


def exit_on_user_error(main: Callable[..., int | None]) -> Callable[..., int]:
    """Wrap an entry point so a `UserError` ends the program with one line and exit code 2; so does a write that the
    disk refused (full, over quota) wherever it happened, any other refused file operation that names its path
    (a folder where a file was expected, a missing parent, no permission): the path the user gave, and the reason;
    a device out of memory, with what a run can change; and, in a run of several processes, a collective that failed
    because another process had stopped (exit 1: that process says why)."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            code = main(*args, **kwargs)
        except SaidElsewhere:
            return EXIT_USER_ERROR
        except NothingToDo as e:
            print(e, flush=True)
            return 0
        except BrokenPipeError:
            # The reader of the output has gone (`... | head`): stop quietly, as command-line tools do. Python would
            # print a second error while flushing stdout at exit, so stdout points at nothing from here on.
            with contextlib.suppress(OSError, ValueError):  # a stdout without a file descriptor (a notebook's) has nothing to flush
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return EXIT_USER_ERROR
        except RuntimeError as e:
            if peer_lost(e):  # the process that stopped first printed why; a traceback here would bury its line
                print(f"error: {PEER_LOST}", file=sys.stderr, flush=True)
                return 1
            said = out_of_memory(e)
            if said is None:
                raise
            print(f"error: {said}; {OUT_OF_MEMORY_ADVICE}", file=sys.stderr, flush=True)
            return EXIT_USER_ERROR
        except OSError as e:
            if e.errno in STORAGE_ERRNOS:
                print(f"error: cannot write {e.filename or 'a file'}: {e.strerror}", file=sys.stderr, flush=True)
            elif e.filename is not None:
                paths = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else f"{e.filename}"
                print(f"error: {paths}: {e.strerror or type(e).__name__}", file=sys.stderr, flush=True)
            else:
                raise  # no path to name: not something the user can fix from the message
            return EXIT_USER_ERROR
        return 0 if code is None else code

    return wrapper
