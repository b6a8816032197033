"""Resume states: where training stands (`Progress`), written with Accelerate's `save_state` under a temporary name and
renamed when complete, so `run.resume=auto` never picks up a half-written one; their manifest
(`vit.store.runs.check_state`) is verified before one is loaded, so a file damaged since is not loaded either.

Beside the progress, `trainer.json` records the run that saved the state (under `RECORD_KEY`: its stage, processes and
settings): a state resumed away from its run folder (a copy) is held to them, as `run.resume=auto` is to the folder's
config.yaml (`vit.train.resumes.check_recorded`). It records the data loader the run used too, which `data.loader=auto`
keeps on a resume (`resumed_loader`, read before the stage opens its data)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vit.config import DataConfig, flat_keys, to_dict
from vit.data.loaders import Data, open_data
from vit.errors import CheckpointError, ConfigError, StorageError, UserError
from vit.store.atomic import storage_failure
from vit.store.runs import (
    CONFIG_FILE,
    METRICS_FILE,
    PARTIAL_PREFIX,
    STATE_DIR,
    STATE_FILE,
    check_state,
    complete_state,
    is_complete_state,
    newest_state,
    partial_state_path,
    read_config,
    read_metrics,
    read_state_progress,
    state_dirs,
    state_path,
    trim_metrics,
    trim_states,
)
from vit.store.values import is_count, is_finite
from vit.train.accelerator import main_first
from vit.train.resumes import setting_differences
from vit.train.run import Run, StepRecords

RECORD_KEY = "saved_by"  # trainer.json's record of the run that saved the state; no field of `Progress`
RNG_FILES = "random_states_*.pkl"  # Accelerate writes one per process: a state without a record still says how many saved it
LOADERS = (None, "memory", "stream")  # a record's data loader; None: saved before records held it, or by a stage that did not say


@dataclass
class Progress:
    """Where training stands; saved with every resume state."""

    step: int = 0  # optimiser steps done
    epoch: int = 0  # current epoch
    batch: int = 0  # micro-batches of the current epoch already consumed
    images: int = 0  # training images seen, all processes
    train_time: float = 0.0  # seconds spent in training, summed over restarts
    feature_time: float = 0.0  # a cached probe's seconds computing its features, summed over restarts (each computes them)
    nan_skips: int = 0  # steps whose non-finite loss the guard skipped
    scaler_skips: int = 0  # steps fp16's GradScaler skipped (their gradients overflowed at its scale)
    best: dict[str, float] = field(default_factory=dict)
    planned_steps: int | None = None  # the step count a time budget fixed (kept across resumes)
    plan: dict[str, Any] | None = None  # that budget's whole plan (`vit.train.budget.BudgetPlan`), for the summary
    # metrics records of `step` logged when the state was saved: a resume drops those logged after it (a finished run's
    # final evaluation, logged again by a resume from its last state), as it drops the records of later steps
    logged: int | None = None
    # each process's training images (rank order), whole at every record and so in every state; None until the first record,
    # and for good in a run resumed from a state saved before states held them (its images were counted as a sum alone)
    rank_images: list[int] | None = None

    def add_images(self, each: list[int], mine: int) -> None:
        """Count a record's window: `each` process's images in it (rank order), `mine` this one's, which its steps added
        to `images` already."""
        if self.rank_images is None and self.images == mine:  # nothing counted before this window: a fresh run
            self.rank_images = [0] * len(each)
        self.images += sum(each) - mine
        if self.rank_images is not None:
            self.rank_images = [n + m for n, m in zip(self.rank_images, each)]

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
            progress.logged = logged_at(run, progress.step)
            complete_state(tmp, final, {**progress.__dict__, RECORD_KEY: state_record(run)})
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
        drop_later_states(run, final)
        trim_states(run.dir, run.cfg.run.keep_states)
    acc.wait_for_everyone()
    return final


def logged_at(run: Run, step: int) -> int:
    """The records of `step` in metrics.jsonl (main process), as `run.log` counted them; the file is read only where that
    count cannot say (`StepRecords.exact`), which no run of the training loop meets."""
    counted = run.step_records.at(step)
    return counted if counted is not None else sum(1 for record in read_metrics(run.dir)[0] if record["step"] == step)


def drop_later_states(run: Run, saved: Path) -> None:
    """Delete the states of steps after the one just `saved`: those of a run this one resumed before (an unreadable newest
    state passed over, or an older state named by run.resume), whose records were trimmed. Kept, they counted as the
    newest for `run.keep_states`, which deleted the states this run saves (all of them under keep_states=1), and a later
    `run.resume=auto` tried them first: the unreadable one again, or a sound one of the other run's steps."""
    later = [path for path in state_dirs(run.dir) if path.name > saved.name]  # state_dirs orders by name, which is by step
    for path in later:
        shutil.rmtree(path, ignore_errors=True)
    if later:
        run.print(f"resume: removed {len(later)} state(s) of the run before this one, after its step: {', '.join(p.name for p in later)}")


def state_record(run: Run) -> dict[str, Any]:
    """What a state is held to when resumed: the stage, the number of processes, and the settings (`settings`); the
    kind of device it ran on, which a resume may change and says (`say_how_it_runs`); the data loader it served its
    batches with ("memory" | "stream", None where the stage did not say), which `data.loader=auto` keeps (`resumed_loader`);
    and the fingerprint and number of its training images, which a resume must read again wherever `data.root` now is
    (`check_data`)."""
    return {"stage": run.stage, "processes": run.accelerator.num_processes, "settings": settings(run.cfg),
            "device": run.accelerator.device.type, "loader": run.data_loader, "data": run.data_fingerprint,
            "train_images": run.train_images}


def settings(cfg: Any) -> dict[str, Any]:
    """The config as dotted keys, each value as JSON writes and reads it back (so that a saved record and a live config
    compare alike)."""
    return read_back(flat_keys(to_dict(cfg)))


def read_back(flat: dict[str, Any]) -> dict[str, Any]:
    """Dotted settings as JSON writes and reads them back: a state's record, a live config and config.yaml compare alike."""
    return json.loads(json.dumps(flat, default=str))


def load_state(run: Run) -> Progress | None:
    """Restore the state named by `run.resume` ('auto': newest complete one that loads); None for a fresh run.

    A state that loads but is not this run's to continue (saved with other settings or processes, past this run's
    schedule, a copy continued over another run, the step a finished run ended at) is refused in one line before a step
    is trained or a file written, never passed over for an older one."""
    resume = run.cfg.run.resume
    if not resume:
        return None
    candidates = resume_candidates(run, resume)
    if not candidates:
        run.print(f"resume: no saved state in {run.dir / STATE_DIR}; starting fresh")
        return None
    for path in candidates:
        try:
            progress, record = load_one(run, path)
        except Exception as e:
            if isinstance(e, UserError) and not isinstance(e, CheckpointError):  # a sound state this run is not to continue
                raise
            if resume != "auto":
                raise ConfigError(f"run.resume={resume}: the state does not load ({load_failure(e)})") from None
            run.warn(f"resume state {path} is unreadable ({load_failure(e)}); trying the one before")
            continue
        run.print(f"resume: from {path} at step {progress.step} (epoch {progress.epoch}, batch {progress.batch})")
        say_how_it_runs(run, path, record or {})
        # The stage's clock (a time budget's stage_seconds) counts the training the processes before this one did; their
        # setup and the steps lost after the state are not counted.
        run.started -= progress.train_time
        if run.is_main:
            dropped = trim_metrics(run.dir / METRICS_FILE, progress.step, math.inf if progress.logged is None else progress.logged)
            # The count `save_state` reads starts from what the resume left in the file (records of this step among them).
            run.step_records = StepRecords.of(record["step"] for record in read_metrics(run.dir)[0])
            if dropped:
                run.print(f"resume: dropped {dropped} metrics record(s) logged after step {progress.step}; they are logged again")
        return progress
    raise ConfigError(f"run.resume=auto: none of the saved states in {run.dir / STATE_DIR} loads")


def resumed_record(run: Run) -> tuple[Path, dict[str, Any]] | None:
    """(the state, the record of the run that saved it) that `run.resume` continues, read before anything loads (the
    stage's data and average depend on it): under `auto` the newest state whose trainer.json reads, as `load_state` tries
    them; a state saved before states had a record gives {}. None for a fresh run or where no state reads (`load_state`
    names it, or passes it over)."""
    resume = run.cfg.run.resume
    try:
        candidates = resume_candidates(run, resume) if resume else []
    except UserError:
        return None  # `load_state` says what the path is instead
    for path in candidates:
        try:
            record = read_progress(path)[1]
        except (OSError, ValueError, CheckpointError):
            continue
        return path, record or {}
    return None


def resumed_loader(run: Run) -> str | None:
    """The data loader ("memory" | "stream") recorded by the state `run.resume` continues (`resumed_record`), which
    `vit.data.loaders.open_data` keeps under `data.loader=auto`; None for a fresh run or a state saved before states
    recorded it (`check_loader` refuses an older state of another loader that `auto` falls back to)."""
    resumed = resumed_record(run)
    return resumed[1].get("loader") if resumed is not None else None


def open_stage_data(run: Run, cfg: DataConfig, out_size: int | None, need_labels: bool = False) -> Data:
    """A stage's data (`vit.data.loaders.open_data`: the main process decodes or scans first, the others then read its
    cache), under `data.loader=auto` with the loader the resume state recorded (`resumed_loader`); the run's states
    record the loader it opened (`Run.data_loader`)."""
    acc = run.accelerator
    data = main_first(acc, lambda: open_data(cfg, out_size=out_size, device=acc.device, rank=acc.process_index, world_size=acc.num_processes,
                                             threads=run.threads, local_processes=run.local_processes, need_labels=need_labels,
                                             resumed=resumed_loader(run), say=run.print))  # fmt: skip
    run.data_loader = data.kind
    run.data_fingerprint = data.splits.source.fingerprint if data.splits.source is not None else None
    run.train_images = len(data.splits.train)
    return data


def say_how_it_runs(run: Run, path: Path, record: dict[str, Any]) -> None:
    """Warn where the run goes on at another precision or on another kind of device than the state was saved at: a resume
    may (another machine), but its steps from here compute otherwise than those before, which config.yaml (its first
    process's) and the summary (this one's) each record as the whole run's."""
    was = {"run.precision": record.get("settings", {}).get("run.precision"), "device": record.get("device")}  # no device: saved before it was
    now = {"run.precision": run.cfg.run.precision, "device": run.accelerator.device.type}
    changed = [f"{key} {was[key]} -> {now[key]}" for key in was if was[key] is not None and was[key] != now[key]]
    if changed:
        run.warn(f"resume: this run continues the state {path.name} with {', '.join(changed)}: its steps compute otherwise than "
                 "those before it, and the run's weights are those of neither setting")  # fmt: skip


def load_one(run: Run, path: Path) -> tuple[Progress, dict[str, Any] | None]:
    """Load one state into the run's model, optimiser and random streams, checked: its files against its manifest first
    (Accelerate only logs an RNG state it cannot load, and the run would go on from another random state), then its
    progress, and, once loaded (a state of another model fails there, naming the first tensor that differs), that this
    run is the one to continue it (`check_fits`) and that its weights are finite. Nothing is written before. Returns its
    progress and the record of the run that saved it (None for a state saved before states had one)."""
    check_state(path)
    progress, record = read_progress(path)
    run.accelerator.load_state(str(path))
    check_fits(run, path, progress, record)
    check_finite(run.accelerator)
    return progress, record


def resume_candidates(run: Run, resume: str) -> list[Path]:
    """The states to try, first first: the run folder's, newest first, for `auto`; else the one named, which must be a
    complete state (the message says what the path is instead)."""
    if resume == "auto":
        return list(reversed(state_dirs(run.dir)))
    path = Path(resume).expanduser()
    if is_complete_state(path):
        return [path]
    newest = newest_state(path) or newest_state(path.parent)
    if not path.exists():
        instead = f"{path} does not exist" + ("" if path.is_absolute() else f" in the current folder {Path.cwd()}")
    elif path.name.startswith(PARTIAL_PREFIX):
        instead = "it is a state left half-written by a run stopped while saving it; name a step_* state beside it"
    elif newest is not None and newest.parent == path / STATE_DIR:
        instead = f"it is a run folder: resume it with run.name={path.name} run.resume=auto, or name one of its states, as {newest}"
    elif newest is not None:
        instead = f"it is a folder of states: name one of them, as {newest}"
    else:
        instead = "expected auto, or a <run folder>/states/step_* folder"
    raise ConfigError(f"run.resume={resume}: not a complete resume state (no {STATE_FILE} inside): {instead}")


PROGRESS_FIELDS = {f.name: f for f in dataclasses.fields(Progress)}
COUNTS = ("step", "epoch", "batch", "images", "nan_skips", "scaler_skips")


def holds_position(run_dir: Path, progress: Progress) -> bool:
    """Whether `run_dir` has a complete state of `progress.step` saved where the run stands now: not one saved before that
    step's epoch ended (a signal at the epoch's last step, then a resume that closed the epoch), which would close it again."""
    path = state_path(run_dir, progress.step)
    if not is_complete_state(path):
        return False
    try:
        saved = read_state_progress(path)
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and (saved.get("epoch"), saved.get("batch")) == (progress.epoch, progress.batch)


def read_progress(path: Path) -> tuple[Progress, dict[str, Any] | None]:
    """The progress in a state's trainer.json, checked field by field (a CheckpointError naming the first one that no
    run writes), and the record of the run that saved it (None in a state saved before records)."""
    saved = read_state_progress(path)
    if not isinstance(saved, dict):
        raise CheckpointError(f"{STATE_FILE} holds a {type(saved).__name__}, not a JSON object")
    record = saved.pop(RECORD_KEY, None)
    checks = {**{name: lambda v: is_count(v) for name in COUNTS}, "best": lambda v: isinstance(v, dict),
              "train_time": lambda v: is_finite(v) and v >= 0, "feature_time": lambda v: is_finite(v) and v >= 0,
              "planned_steps": lambda v: v is None or (is_count(v) and v > 0), "plan": lambda v: v is None or isinstance(v, dict),
              "logged": lambda v: v is None or is_count(v),
              "rank_images": lambda v: v is None or (isinstance(v, list) and len(v) > 0 and all(map(is_count, v)))}  # fmt: skip
    for name, value in saved.items():
        if name not in PROGRESS_FIELDS:
            raise CheckpointError(f"{STATE_FILE} has a field {name!r} that no state of this project holds")
        if not checks[name](value):
            raise CheckpointError(f"{STATE_FILE} holds {name}={value!r}, which no run writes")
    sound = isinstance(record, dict) and isinstance(record.get("settings"), dict) and is_count(record.get("processes")) \
        and record.get("loader") in LOADERS
    if record is not None and not sound:
        raise CheckpointError(f"{STATE_FILE}'s {RECORD_KEY!r} is damaged")
    progress = Progress(**saved)
    if progress.rank_images is not None and sum(progress.rank_images) != progress.images:  # a state closes a record: whole counts
        raise CheckpointError(f"{STATE_FILE} holds rank_images={progress.rank_images!r}, whose sum is not its images={progress.images!r}")
    return progress, record


def check_fits(run: Run, path: Path, progress: Progress, record: dict[str, Any] | None) -> None:
    """Refuse a sound state that this run is not to continue (see `load_state`): a ConfigError naming what differs. (A
    copy continued over another run, and a finished run's last step, are refused before: `vit.train.resumes.check_resume`.)"""
    named = f"run.resume={run.cfg.run.resume}: the state {path}"
    now = run.accelerator.num_processes
    then = record["processes"] if record is not None else len(list(path.glob(RNG_FILES))) or now
    if then != now:  # the effective batch, and with it the data order, the steps and the learning rate
        raise ConfigError(f"{named} was saved by {then} process(es), this run has {now}: resume it with {then} (its effective "
                          "batch and schedule), or start a fresh run without run.resume")  # fmt: skip
    if record is not None:
        check_settings(run, named, record, path)
        check_loader(run, named, record, path)
        check_data(run, named, record)
    check_schedule(run, named, progress)


def check_loader(run: Run, named: str, record: dict[str, Any], path: Path) -> None:
    """Refuse a state saved with the other data loader than this run opened its data with (it serves other batches): under
    `data.loader=auto` the stage opened it with the loader of the newest state (`resumed_loader`), and this older one,
    loaded where that one did not, was saved by a run that used the other."""
    was, now = record.get("loader"), run.data_loader
    if was is not None and now is not None and was != now:
        raise ConfigError(f"{named} was saved by a run that read its data with the {was} loader, and this run opened it with the "
                          f"{now} loader, which serves other batches: resume this state by naming it, run.resume={path}")  # fmt: skip


def check_data(run: Run, named: str, record: dict[str, Any]) -> None:
    """Refuse a state saved by a run that trained on other images than this run's data settings find: `data.root` may
    move (another disk, an archive of the same tree), but a root of other images went on silently, and the encoder's
    record then named only the data of the steps after the resume. A state saved before states recorded it passes."""
    was, now = record.get("data"), run.data_fingerprint
    if was is not None and now is not None and was != now:
        root = record.get("settings", {}).get("data.root")
        raise ConfigError(f"{named} was saved by a run that trained on other images (fingerprint {was}, data.root={root}) than "
                          f"data.root={run.cfg.data.root} holds (fingerprint {now}): resume it on the images it trained on, or "
                          "start a fresh run without run.resume")  # fmt: skip
    # Shards hash as one set, val samples included: where the val split came from decides which of them trained (the
    # first data.val_size samples of the last shards, held out, or every sample where data.val_root names val shards).
    was, now = record.get("train_images"), run.train_images
    if isinstance(was, int) and now is not None and was != now:
        val_root = record.get("settings", {}).get("data.val_root")
        raise ConfigError(f"{named} was saved by a run that trained on {was} of its images, and these data settings leave {now} "
                          f"to train on (data.val_root {val_root} -> {run.cfg.data.val_root}): "
                          "resume it with the val split it started with, or start a fresh run without run.resume")  # fmt: skip


def check_settings(run: Run, named: str, record: dict[str, Any], path: Path | None = None) -> None:
    """Refuse a state saved by another stage or with settings other than `RESUMABLE_CHANGES`, naming what differs; where
    the run folder's config.yaml, which `vit.train.resumes.check_recorded` holds the run to first, was edited since the
    state was saved, that is what the line names (each check asked for the other's settings: no resume passed both)."""
    if record.get("stage", run.stage) != run.stage:
        raise ConfigError(f"{named} was saved by a {record['stage']} run, not a {run.stage} one; start a fresh run without run.resume")
    shown = setting_differences(record["settings"], settings(run.cfg))  # both as JSON reads them back
    edited = edited_config(run.dir, record) if path is not None and path.resolve().parent.parent == Path(run.dir).resolve() else None
    if shown and edited:
        raise ConfigError(f"{named} was saved with other settings than {Path(run.dir) / CONFIG_FILE} records ({edited}): the file was "
                          "edited since; put the state's values back in it, then resume with them, or start a fresh run without run.resume")  # fmt: skip
    if shown:
        raise ConfigError(f"{named} was saved by a run with other settings ({shown}); resume it with those settings, or start "
                          "a fresh run without run.resume")  # fmt: skip


def edited_config(run_dir: Path, record: dict[str, Any]) -> str | None:
    """`key state's -> config.yaml's, ...` where `run_dir`'s config.yaml differs from a state's record in settings a
    resume may not change; None where it does not, or cannot be read."""
    try:
        recorded = read_config(run_dir) or {}
    except UserError:
        return None
    recorded.pop("meta", None)
    return setting_differences(record["settings"], read_back(flat_keys(recorded)))


def check_schedule(run: Run, named: str, progress: Progress) -> None:
    """Refuse a state past this run's end (schedule.max_steps, the epochs), or of a time budget this run does not have:
    the loop would train no step, or one of another schedule, and write the run's results again."""
    schedule = run.cfg.schedule
    if schedule.max_steps is not None and progress.step > schedule.max_steps:
        raise ConfigError(f"{named} is at step {progress.step}, past schedule.max_steps={schedule.max_steps}: there is nothing to "
                          "train; raise schedule.max_steps (or leave it unset) to go on")  # fmt: skip
    planned = (progress.plan or {}).get("budget_minutes")
    if progress.planned_steps is not None and planned != schedule.budget_minutes:
        raise ConfigError(f"{named} follows the plan of schedule.budget_minutes={planned} ({progress.planned_steps} steps), this run "
                          f"has schedule.budget_minutes={schedule.budget_minutes}; resume it with {planned}")  # fmt: skip
    if schedule.budget_minutes is None and (progress.epoch, progress.batch) > (schedule.epochs, 0):
        raise ConfigError(f"{named} is at step {progress.step}, in epoch {progress.epoch + 1}, past schedule.epochs={schedule.epochs}; "
                          "resume it with the epochs it was saved with")  # fmt: skip


def check_finite(accelerator: Any) -> None:
    """A CheckpointError naming the weight and optimiser tensors of the loaded state that are not finite: every step
    from it has a non-finite loss (a state saved by a step whose update went non-finite on a finite loss)."""
    from vit.store.checkpoint import non_finite  # here: the loop starts without importing the model (tests/test_runs.py)

    tensors = {}
    for i, model in enumerate(getattr(accelerator, "_models", [])):
        tensors.update({f"{'model' if i == 0 else f'model_{i}'} {k}": v for k, v in model.state_dict().items()})
    for optimizer in getattr(accelerator, "_optimizers", []):
        for index, state in optimizer.state_dict()["state"].items():
            tensors.update({f"optimizer state {index} {k}": v for k, v in state.items()})
    if bad := non_finite(tensors):
        raise CheckpointError(f"it holds non-finite values in {bad}")


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
