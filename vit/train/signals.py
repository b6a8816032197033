"""Pre-emption: SIGTERM / SIGINT become a flag the training loop reads between steps, so that it saves a resume state
and stops cleanly (`Preempted`) instead of dying mid-step. Outside its loop a stage ends on a Ctrl-C in one line
(`ctrl_c_in_one_line`), and one that comes while it imports is held until it can (`hold_ctrl_c`)."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

# A signal this soon after the first is the same stop delivered twice, not a second one: a launcher or a script that
# passes SIGTERM on to its stage (quickstart, torchrun's agent) while the scheduler or systemd also sends it to every
# process of the job, or of its control group. Taken as "stop now", it left the stage without a resume state.
REPEAT_SECONDS = 1.0


class Preempted(Exception):
    """SIGTERM / SIGINT arrived; a resume state has been saved."""


class SignalGuard:
    """Turns SIGTERM / SIGINT into a flag the loop checks between steps, so it can save and exit cleanly."""

    def __init__(self):
        self.received: int | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self.previous: dict[int, Any] = {}

    def __enter__(self):
        _CTRL_C["looped"] = True
        if _CTRL_C["signal"] is not None:  # a Ctrl-C before the loop that Python dropped: the loop stops at once
            self.received, self.received_at = _CTRL_C["signal"], time.monotonic()
            _CTRL_C["signal"] = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.previous[sig] = signal.signal(sig, self.handle)
            except ValueError:  # not the main thread
                pass
        return self

    def handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self.received_at = signum, now
            return
        if now - self.received_at < REPEAT_SECONDS:  # the first one, delivered again by another path
            return
        _CTRL_C["at_once"] = signum
        raise KeyboardInterrupt  # a second signal: stop now

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


# --------------------------------------------------------------------------- a Ctrl-C outside the loop

# A Ctrl-C (SIGINT) to a stage outside its loop: the signal, whether a loop has run since the stage started, and the
# signal that stopped a loop at once (SignalGuard's second). Reset by each `ctrl_c_in_one_line` call.
_CTRL_C: dict[str, Any] = {"signal": None, "looped": False, "at_once": None}


def _hold(signum, frame) -> None:
    _CTRL_C["signal"] = signum


def _stop(signum, frame) -> None:
    _CTRL_C["signal"] = signum
    raise KeyboardInterrupt


def hold_ctrl_c() -> None:
    """For a stage's `__main__`, before its imports: a Ctrl-C is recorded, not raised, until `ctrl_c_in_one_line` ends the
    run on it as the stage starts. Raised during the imports, Python dropped it when it fell in a callback (an import
    lock's: the run then trained to its end), and an extension being imported aborted on it ("terminate called after
    throwing an instance of 'pybind11::error_already_set'"). A Ctrl-C that the parent process ignores stays ignored."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _hold)


def ctrl_c_said(signum: int) -> str:
    """The line a stage ends with on a Ctrl-C outside its loop, or on a second signal in it (`_CTRL_C` says which)."""
    if _CTRL_C["at_once"] is not None:
        return (f"stopped at once by a second {signal.Signals(_CTRL_C['at_once']).name}: the steps since the last resume "
                "state are lost; run.resume=auto goes on from that state")  # fmt: skip
    name = f"Ctrl-C ({signal.Signals(signum).name})"
    if _CTRL_C["looped"]:
        return f"stopped by {name} after training, before the run finished: run.resume=auto finishes it from its last resume state"
    return f"stopped by {name} before training: no resume state was saved; the same command starts the run again"


def ctrl_c_in_one_line(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap a stage's entry point: a Ctrl-C outside its training loop (setting up, or evaluating after it) ends the run
    with one line (`ctrl_c_said`) and exit code 130 instead of a traceback, and so does one held while the stage
    imported (`hold_ctrl_c`), as it starts, and a second signal in the loop, which stops it at once. One that Python
    dropped (raised in a callback) is still recorded: the loop's `SignalGuard` then stops at its first step, saving a
    resume state (exit 143). In the loop, the guard's rules hold."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs) -> int:
        previous = signal.getsignal(signal.SIGINT)
        ours = threading.current_thread() is threading.main_thread() and previous in (signal.default_int_handler, _hold)
        held = _CTRL_C["signal"] if previous is _hold else None
        _CTRL_C.update(signal=held, looped=False, at_once=None)
        try:
            if ours:
                signal.signal(signal.SIGINT, _stop)
            if held is not None:
                raise KeyboardInterrupt
            return main(*args, **kwargs)
        except KeyboardInterrupt:
            signum = _CTRL_C["at_once"] or _CTRL_C["signal"]
            if signum is None:  # not a signal's (raised by the code itself): as Python ends on one
                raise
            if os.environ.get("RANK", "0") == "0":  # each process of a run got it; the first one says it
                print(ctrl_c_said(signum), flush=True)
            return 128 + signal.SIGINT  # 130, interrupted, whichever signal: 143 is the loop's "its state saved"
        finally:
            if ours:
                signal.signal(signal.SIGINT, previous)
            _CTRL_C.update(signal=None, looped=False, at_once=None)

    return wrapper
