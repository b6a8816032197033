"""What a value read from a run's JSON or YAML must be (summary.json, trainer.json, budget.json, a bench's JSON, a
checkpoint's data record): the checks every reader shares. JSON's numbers come back as int or float, and a bool is an
int to Python, so `true` would pass for 1 without them."""

from __future__ import annotations

import math


def is_number(value: object) -> bool:  # NaN is one: a top-1 of an older summary, read as none
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite(value: object) -> bool:
    return is_number(value) and math.isfinite(value)


def is_whole(value: object) -> bool:  # a step as JSON writes it: 3, not 3.0 or true
    return isinstance(value, int) and not isinstance(value, bool)


def is_count(value: object) -> bool:
    return is_whole(value) and value >= 0


def per_channel(values: object, channels: int, positive: bool = False) -> bool:
    """Whether `values` is an input normalisation's mean (or, `positive`, its std): one finite number per channel."""
    return (isinstance(values, (list, tuple)) and len(values) == channels and all(map(is_finite, values))
            and (not positive or min(values) > 0))  # fmt: skip
