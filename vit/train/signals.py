"""Pre-emption: SIGTERM / SIGINT become a flag the training loop reads between steps, so that it saves a resume state
and stops cleanly (`Preempted`) instead of dying mid-step."""

from __future__ import annotations

import signal
import time
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
        raise KeyboardInterrupt  # a second signal: stop now

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
