"""What the equal-compute table (`vit.tools.results`) reads of each run of the budget sweep: whether its records can be
read at all (`damage`), the minutes its stage took and was given, its top-1 per split, and the settings that make its
recipe (`recipe_settings`), which every seed of one recipe must share (`vit.train.resumes.setting_differences` names
what differs).

    if (why := damage(run)) is None:
        minutes, val = stage_minutes(run), top1(run, "val")
"""

from __future__ import annotations

from typing import Any

from vit.config import flat_keys
from vit.store.runs import CONFIG_FILE, SUMMARY_FILE, RunFolder
from vit.store.values import is_finite, is_number
from vit.tools.reading import HOST_FIELDS, brief, is_text
from vit.train.resumes import RESUMABLE_CHANGES

# What the seeds of one recipe may run otherwise: the seed, and what a resume may change (where things are, how they run:
# data.root, run.device, run.compile, ..., finetune.init, which names each seed's own pretraining).
SEED_MAY_CHANGE = RESUMABLE_CHANGES | {"run.seed"}


def damage(run: RunFolder) -> str | None:
    """Why a finished run cannot be read into the table, else None: a config.yaml that does not read, or a value the table
    reads that is not of its type (a hand edit, another tool's file), named with its file and key. Such a run is listed
    beside the table as one without a summary is: read as it is, it would stop the table with a traceback, file its
    minutes under a made-up host, or drop out of a choice unsaid."""
    if problem := next((p for p in run.problems if p.startswith(CONFIG_FILE)), None):
        return problem
    config, summary = run.config, run.summary or {}
    sections = {f"{CONFIG_FILE} {k}": config.get(k) for k in ("schedule", "finetune", "data", "run")}
    sections |= {f"{SUMMARY_FILE} {k}": summary.get(k) for k in ("budget", "host")}
    for label, value in sections.items():
        if value is not None and not isinstance(value, dict):
            return f"{label} is {brief(value)}, not a mapping"
    host = summary.get("host") or {}
    expected = {  # label: (value, what it must be, whether it is); None (absent) always reads
        f"{CONFIG_FILE} schedule.budget_minutes": ((config.get("schedule") or {}).get("budget_minutes"), "a finite number", is_finite),
        f"{CONFIG_FILE} finetune.init": ((config.get("finetune") or {}).get("init"), "a path", is_text),
        f"{SUMMARY_FILE} budget.stage_seconds": ((summary.get("budget") or {}).get("stage_seconds"), "seconds (a number >= 0)", is_seconds),
        f"{SUMMARY_FILE} wall_time_sec": (summary.get("wall_time_sec"), "seconds (a number >= 0)", is_seconds),
        **{f"{SUMMARY_FILE} {k}": (summary.get(k), "a number", is_number) for k in ("val_top1", "test_top1", "final_knn_top1", "epochs")},
        **{f"{SUMMARY_FILE} {k}": (summary.get(k), "text", is_text) for k in ("model", "precision")},
        **{f"{SUMMARY_FILE} host.{k}": (host.get(k), what, fits) for k, (what, fits) in HOST_FIELDS.items()},
    }  # fmt: skip
    for label, (value, what, fits) in expected.items():
        if value is not None and not fits(value):
            return f"{label} is {brief(value)}, not {what}"
    steps, planned = summary.get("steps"), (summary.get("budget") or {}).get("total_steps")
    if is_number(steps) and is_number(planned) and steps < planned:  # its minutes and accuracy are of part of its budget
        return f"{SUMMARY_FILE} steps is {steps} of the {planned} its time budget planned (stopped by schedule.max_steps; run.resume=auto finishes it)"
    if (summary.get("budget") or {}).get("stage_seconds") is None and summary.get("wall_time_sec") is None:
        # read as 0 minutes, it would fit any budget (a probe chosen as fitting) and pull its arm's minutes down
        return f"{SUMMARY_FILE} records no minutes (neither budget.stage_seconds nor wall_time_sec)"
    return None


def is_seconds(value: Any) -> bool:
    return is_finite(value) and value >= 0


def stage_minutes(run: RunFolder) -> float:
    """The minutes a stage took from its start to its summary (a time budget's `stage_seconds`), else its training time."""
    s = run.summary
    seconds = (s.get("budget") or {}).get("stage_seconds") or s.get("wall_time_sec") or 0.0
    return seconds / 60


def budget_minutes(run: RunFolder) -> float | None:
    return (run.config.get("schedule") or {}).get("budget_minutes")


def top1(run: RunFolder, split: str) -> float | None:
    value = run.summary.get(f"{split}_top1")  # an older summary's NaN would win or lose every choice on val at random: None
    return float(value) if is_finite(value) else None


def recipe_settings(config: dict[str, Any]) -> dict[str, Any]:
    """A run's config.yaml as dotted keys, without `meta` and what the seeds of one recipe may run otherwise (`SEED_MAY_CHANGE`)."""
    return {k: v for k, v in flat_keys({k: v for k, v in config.items() if k != "meta"}).items() if k not in SEED_MAY_CHANGE}
