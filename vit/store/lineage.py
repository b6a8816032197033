"""A run's identity: the id that tells one training of a run folder from another, and the id of the run another started from.

    config.yaml     meta.run_id, meta.parent_run_id     written when the run starts (fresh, or replacing another); a resume keeps them
    summary.json    run_id, parent_run_id
    encoder.pt, mae.pt    meta.run_id;    classifier.pt    run_id, parent_run_id
    wandb           the run's id (`wandb.init(id=...)`): every session of one run logs into one wandb run, two runs never share one

A path says where a run lies, not which training of it: a pretraining folder trained again (run.overwrite) holds new weights
under the same path, and a fine-tune recorded only the path. `parent_run_id` is the id in the `encoder.pt` a run started
from; where the folder it names now holds another run's id, the run is refused as a resume (`vit.train.resumes.check_recorded`)
and not kept by a sweep or quickstart (`vit.tools.kept`). A run folder moved keeps its id; one copied and resumed beside its
original is given an id of its own (`resumed_id`).

Run folders from before ids record none. They load, resume, export and compare as before; a resumed one is given an id,
written into its config.yaml once it trains, which its next checkpoints carry. A fine-tune that recorded no parent id is
held to its encoder by path alone, as before: which training of that path it started from cannot be told.
"""

from __future__ import annotations

import math
import re
import secrets
import subprocess
from pathlib import Path
from typing import Any

import yaml

from vit.errors import UserError
from vit.store.runs import read_config, read_metrics, read_summary

RUN_ID = "run_id"
PARENT_RUN_ID = "parent_run_id"
HERE = Path(__file__).parent  # git asks about the checkout this code runs from
ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what wandb takes as a run id (no / \ # ? % :), and a file name takes


def new_run_id() -> str:
    """16 lowercase hex digits (64 random bits): unique without a registry, and a valid wandb run id."""
    return secrets.token_hex(8)


def valid_id(value: Any) -> str | None:
    """`value` when it is a run id as this module writes them (a hand-edited record may hold a number or a path), else None."""
    return value if isinstance(value, str) and ID_PATTERN.fullmatch(value) else None


def run_id_of(run_dir: Path) -> str | None:
    """The id of the run that holds `run_dir` now (its config.yaml, else its summary.json); None for a folder from before
    run ids, a damaged record, or no run folder."""
    try:
        meta = (read_config(run_dir) or {}).get("meta")
        found = valid_id(meta.get(RUN_ID)) if isinstance(meta, dict) else None
        summary = read_summary(run_dir) if found is None else None
    except (UserError, OSError):
        return None
    return found or (valid_id(summary.get(RUN_ID)) if summary else None)


def recorded_folder(recorded: dict[str, Any]) -> Path | None:
    """The run folder a config.yaml says it was written for (`run.dir` / `run.name`, a relative run.dir taken from here)."""
    run = recorded.get("run")
    if not isinstance(run, dict) or not isinstance(run.get("dir"), str) or not isinstance(run.get("name"), str):
        return None
    try:
        return (Path(run["dir"]).expanduser() / run["name"]).absolute()
    except RuntimeError:  # `~someone` of a user this machine does not have: written elsewhere
        return None


def session(run_dir: Path, resumed: bool) -> tuple[str, str | None, int | None, str | None]:
    """A run's id (new, or the one a resume continues: `resumed_id`), a line where that is not the recorded one, a resumed
    run's last step logged before (its trackers got the steps to it then: each step is sent once, never a step back), and
    the config.yaml text that records a resume's new id (for `Run` to write once the resume is under way)."""
    if not resumed:
        return new_run_id(), None, None, None
    run_id, note, record = resumed_id(run_dir)
    steps = [r["step"] for r in read_metrics(run_dir)[0] if math.isfinite(r["step"])]  # a hand-edited 1e999 reads as inf
    return run_id, note, max(steps, default=None), record


def resumed_id(run_dir: Path) -> tuple[str, str | None, str | None]:
    """The id a resume of `run_dir`'s recorded run continues under, and where that is not the recorded id, a line saying
    why and the folder's config.yaml text with the new id (written by the run once it trains: a resume refused later, its
    state past the schedule say, leaves the folder as it was). Main process; config.yaml is the record `check_resume` keeps.

    The recorded id, unless the record has none (a run from before run ids, or one edited by hand): a new id; or unless
    the folder is a copy of a run that still lies where its config.yaml says, under the same id: the copy continues as a
    run of its own (a new id, and `copied_from` the one it was copied from), so wandb keeps the two apart."""
    recorded = read_config(run_dir) or {}
    meta = recorded.get("meta")
    damaged, meta = not isinstance(meta, dict), meta if isinstance(meta, dict) else {}
    run_id, original = valid_id(meta.get(RUN_ID)), recorded_folder(recorded)
    if run_id is not None:
        if original is None or not original.is_dir() or original.resolve() == Path(run_dir).resolve() or run_id_of(original) != run_id:
            return run_id, None, None
        note = (f"resume: {run_dir} is a copy of the run {original}, which lies where its config.yaml says under the same run id "
                f"{run_id}: this run continues the copy as a run of its own")  # fmt: skip
        meta = {**meta, "copied_from": {"run": str(original), RUN_ID: run_id}}
    else:
        why = "its meta is no mapping" if damaged else "written before run ids" if RUN_ID not in meta else f"{meta[RUN_ID]!r} is no run id"
        note = f"resume: {run_dir} records no run id ({why}): this run continues it"
    run_id = new_run_id()
    # As dump_config writes it: the record as it was, with its new id.
    record = yaml.safe_dump({**recorded, "meta": {**meta, RUN_ID: run_id}}, sort_keys=False)
    return run_id, f"{note} as run id {run_id} (its config.yaml records it once the run trains)", record


def parent_changed(recorded: Any, now: str | None) -> bool:
    """Whether the run a run started from (`recorded`: its `parent_run_id`) is not the run its init holds now. A run that
    recorded no parent id (from before run ids, or started from no run of ours) cannot tell: False."""
    return valid_id(recorded) is not None and recorded != now


def parent_change(recorded: str, now: str | None) -> str:
    """Why `parent_changed`, in words: 'run <id> then, now run <id>'."""
    return f"run {recorded} then, now {f'run {now}' if now else 'a run that records no run id'}"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], check=False, capture_output=True, text=True, cwd=HERE, timeout=5)
        commit = out.stdout.strip() if out.returncode == 0 else "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], check=False, capture_output=True, text=True,
                               cwd=HERE, timeout=5)  # fmt: skip
        return commit + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
