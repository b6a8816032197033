"""Resume states: where training stands (`Progress`), written with Accelerate's `save_state` under a temporary name and
renamed when complete, so `run.resume=auto` never picks up a half-written one; their manifest
(`vit.store.runs.check_state`) is verified before one is loaded, so a file damaged since is not loaded either."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vit.errors import CheckpointError, ConfigError, StorageError
from vit.store.atomic import storage_failure
from vit.store.runs import (METRICS_FILE, STATE_DIR, STATE_FILE, check_state, complete_state, is_complete_state, newest_state,
                            partial_state_path, read_state_progress, state_dirs, state_path, trim_metrics, trim_states)  # fmt: skip

if TYPE_CHECKING:
    from vit.train.run import Run


@dataclass
class Progress:
    """Where training stands; saved with every resume state."""

    step: int = 0  # optimiser steps done
    epoch: int = 0  # current epoch
    batch: int = 0  # micro-batches of the current epoch already consumed
    images: int = 0  # training images seen, all processes
    train_time: float = 0.0  # seconds spent in training, summed over restarts
    nan_skips: int = 0
    best: dict[str, float] = field(default_factory=dict)
    planned_steps: int | None = None  # the step count a time budget fixed (kept across resumes)
    plan: dict[str, Any] | None = None  # that budget's whole plan (`vit.train.budget.BudgetPlan`), for the summary

    def epochs_done(self, batches_per_epoch: int) -> float:
        """The epochs trained, the current one's consumed micro-batches counted: a metrics record's `epoch`."""
        return round(self.epoch + self.batch / max(1, batches_per_epoch), 4)


def save_state(run: Run, progress: Progress) -> Path:
    """Write an Accelerate resume state atomically and keep the newest `run.keep_states`.

    A write the disk refuses (full, over quota) removes the half-written state, which would keep the disk full, and
    stops the run with one line (a StorageError) naming it; the states saved before are kept."""
    acc = run.accelerator
    final = state_path(run.dir, progress.step)
    tmp = partial_state_path(run.dir, progress.step)
    try:
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        acc.wait_for_everyone()
        if acc.is_main_process:
            complete_state(tmp, final, progress.__dict__)
    except Exception as e:
        reason = storage_failure(e, tmp.parent)  # before the partial state frees its space
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        if reason is None:
            raise
        last = newest_state(run.dir)
        kept = f"the last good state {last} is kept" if last is not None else "no earlier state was saved"
        raise StorageError(f"cannot write the resume state {tmp}: {reason}; it is removed and {kept}; free some space, "
                           "then resume with run.resume=auto") from None  # fmt: skip
    if acc.is_main_process:
        trim_states(run.dir, run.cfg.run.keep_states)
    acc.wait_for_everyone()
    return final


def load_state(run: Run) -> Progress | None:
    """Restore the state named by `run.resume` ('auto': newest complete one that loads); None for a fresh run."""
    resume = run.cfg.run.resume
    if not resume:
        return None
    if resume == "auto":
        candidates = list(reversed(state_dirs(run.dir)))
        if not candidates:
            run.print(f"resume: no saved state in {run.dir / STATE_DIR}; starting fresh")
            return None
    else:
        path = Path(resume).expanduser()
        if not is_complete_state(path):
            raise ConfigError(f"run.resume={resume}: not a complete resume state (no {STATE_FILE} inside)")
        candidates = [path]
    for path in candidates:
        try:
            # Every file is checked against the state's manifest first: Accelerate only logs an RNG state it cannot
            # load, and the run would go on from another random state.
            check_state(path)
            progress = Progress(**read_state_progress(path))
            run.accelerator.load_state(str(path))
        except Exception as e:
            why = load_failure(e)
            if resume != "auto":
                raise ConfigError(f"run.resume={resume}: the state does not load ({why})") from None
            run.warn(f"resume state {path} is unreadable ({why}); trying the one before")
            continue
        run.print(f"resume: from {path} at step {progress.step} (epoch {progress.epoch}, batch {progress.batch})")
        # The stage's clock (a time budget's stage_seconds) counts the training the processes before this one did; their
        # setup and the steps lost after the state are not counted.
        run.started -= progress.train_time
        if run.is_main:
            dropped = trim_metrics(run.dir / METRICS_FILE, progress.step)
            if dropped:
                run.print(f"resume: dropped {dropped} metrics record(s) logged after step {progress.step}; they are logged again")
        return progress
    raise ConfigError(f"run.resume=auto: none of the saved states in {run.dir / STATE_DIR} loads")


def load_failure(e: Exception) -> str:
    """Why a state did not load, in one line. A state of another model (another size, or the other stage's) fails in
    `load_state_dict`, whose first line names only the class ("Error(s) in loading state_dict for MaskedAutoencoder:"):
    its first detail says what differs."""
    if isinstance(e, CheckpointError):
        return str(e)
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [""]
    if lines[0].startswith("Error(s) in loading state_dict") and len(lines) > 1:
        return f"it holds another model than this run builds: {lines[1][:160]}"
    return f"{type(e).__name__}: {lines[0][:120]}"
