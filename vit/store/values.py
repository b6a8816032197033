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


# What no run writes outside these bounds: a top-1 is a fraction; a time, a rate or a count is >= 0. A finite value outside
# them is a hand edit or another tool's file, left out of a table or a model card and named (NaN keeps its meaning: not finite).
FRACTIONS = ("final_val_top1", "val_top1", "best_val_top1", "final_test_top1", "test_top1", "final_knn_top1", "knn_top1",
             "trained_weights_val_top1")  # fmt: skip
AMOUNTS = ("wall_time_sec", "time", "images_per_sec", "feature_images_per_sec", "epochs", "epoch", "steps", "step", "processes")


def in_bounds(key: str, value: object) -> bool:
    """Whether `value` of `key` is within what a run writes (`FRACTIONS`, `AMOUNTS`); any value of another key is."""
    if not is_finite(value):
        return True
    return 0 <= value <= 1 if key in FRACTIONS else value >= 0 if key in AMOUNTS else True


def pop_out_of_range(summary: dict, keys: tuple[str, ...] | None = None) -> list[tuple[str, object]]:
    """Take out of a summary.json mapping the values no run writes, and return them as (dotted key, value): those of
    `keys` (default every key) out of their bounds (`in_bounds`), and image counts of its `data` (train, val, test)
    that are no count (-100, "many")."""
    far = [(k, summary.pop(k)) for k in [k for k in (summary if keys is None else keys) if k in summary and not in_bounds(k, summary[k])]]
    data = summary.get("data")
    if isinstance(data, dict):
        far += [(f"data.{k}", data.pop(k)) for k in [k for k in ("train", "val", "test") if k in data and not is_count(data[k])]]
    return far
