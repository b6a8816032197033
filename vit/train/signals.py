"""Pre-emption: SIGTERM / SIGINT become a flag the training loop reads between steps, so that it saves a resume state
and stops cleanly (`Preempted`) instead of dying mid-step."""

from __future__ import annotations

import signal
from typing import Any


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
