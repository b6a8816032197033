"""User-facing errors: bad config, data, checkpoint or command line.

Entry points catch `UserError` and print its message as one line with a non-zero
exit, instead of a traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
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


EXIT_USER_ERROR = 2


def exit_on_user_error(main: Callable[..., int | None]) -> Callable[..., int]:
    """Wrap an entry point so a `UserError` ends the program with one line and exit code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            code = main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return EXIT_USER_ERROR
        return 0 if code is None else code

    return wrapper
