"""The run folder: the name of everything in it, and the one module that reads and writes it by name.

    <run.dir>/<run.name>/
      config.yaml              the resolved config, with `meta` (stage, job type, git commit, seed, parent, command)
      metrics.jsonl            one JSON record per logged step and per epoch end (NaN and infinities as null, see `to_json`)
      summary.json             written when the run finishes: without it a run is unfinished
      encoder.pt, mae.pt       pretraining: the encoder, and the whole MAE (formats: vit/store/checkpoint.py)
      classifier.pt            classification: the classifier (format: finetune/models.py)
      reconstruction.png, figures/, confusion_<split>.png
      states/step_<8 digits>/  Accelerate resume states; `trainer.json` (the loop's progress) and `manifest.json`
                               (every file's size and hash), written last, mark one complete
      tensorboard/
      run.lock                 held by the live process that runs here (its PID and host inside); gone when it ends

What the checkpoint files hold belongs to their modules; where they lie, and what makes a
folder a run, finished or not, belongs here.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vit.errors import CheckpointError, ConfigError, StorageError, UserError
from vit.store.atomic import atomic_write_text, storage_failure, usual_permissions

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
BUDGET_FILE = "budget.json"  # the step count a time budget fixed, and what it was measured from
ENCODER_FILE = "encoder.pt"
MAE_FILE = "mae.pt"
CLASSIFIER_FILE = "classifier.pt"
RECONSTRUCTION_FILE = "reconstruction.png"
FIGURES_DIR = "figures"
TENSORBOARD_DIR = "tensorboard"
STATE_DIR = "states"
STATE_PREFIX = "step_"
PARTIAL_PREFIX = ".tmp_"  # a state being written; renamed to step_* once complete
STATE_FILE = "trainer.json"  # the loop's progress; with the manifest, written last: their presence marks a complete state
MANIFEST_FILE = "manifest.json"  # {path in the state: [bytes, sha256]} of every other file of a state
LOCK_FILE = "run.lock"  # see `lock_run`

RUN_OUTPUTS = (METRICS_FILE, SUMMARY_FILE, ENCODER_FILE, MAE_FILE, CLASSIFIER_FILE, STATE_DIR)  # what makes a folder hold a run
RUN_MARKERS = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE)  # what makes a folder a run folder to read
RECORD_FILES = (CONFIG_FILE, SUMMARY_FILE, BUDGET_FILE)  # a finished run's record: kilobytes that a results table reads
CLASSIFICATION = "classification"  # RunFolder.group of every run that is not pretraining


def epoch_figure_path(run_dir: Path, stem: str, epoch: int) -> Path:
    return Path(run_dir) / FIGURES_DIR / f"{stem}_epoch{epoch:04d}.png"


def confusion_path(run_dir: Path, split: str) -> Path:
    return Path(run_dir) / f"confusion_{split}.png"


# --------------------------------------------------------------------------- writing


def write_config(run_dir: Path, text: str) -> None:
    atomic_write_text(Path(run_dir) / CONFIG_FILE, text)


def to_json(obj: Any, indent: int | None = None) -> str:
    """`json.dumps` with every float that is not finite written as null. Python would write `NaN` and `Infinity`,
    which are not JSON: strict readers (JavaScript's `JSON.parse`, for one) refuse the whole line or file, and a run
    that skips a non-finite step (`run.nan_skip_budget`) logs a NaN loss."""
    return json.dumps(_finite(obj), indent=indent, allow_nan=False)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def append_metrics(run_dir: Path, record: dict[str, Any]) -> None:
    path = Path(run_dir) / METRICS_FILE
    try:
        with open(path, "a") as f:
            f.write(to_json(record) + "\n")
    except OSError as e:  # a write's error names no file: say which one the disk refused
        reason = storage_failure(e, path.parent)
        if reason is None:
            raise
        raise StorageError(f"cannot write {path}: {reason}; free some space, then resume with run.resume=auto") from None


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    atomic_write_text(Path(run_dir) / SUMMARY_FILE, to_json(summary, indent=2) + "\n")


def write_budget(run_dir: Path, plan: dict[str, Any]) -> None:
    atomic_write_text(Path(run_dir) / BUDGET_FILE, to_json(plan, indent=2) + "\n")


def read_budget(run_dir: Path) -> Any:  # None without one; a damaged one is a UserError (`read_json`)
    return read_json(path) if (path := Path(run_dir) / BUDGET_FILE).is_file() else None


def read_json(path: Path) -> Any:
    """What the JSON file `path` holds; not valid JSON or not UTF-8 is a UserError naming it (unreadable: the OSError)."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested deeper than the parser goes
        where = f" (line {e.lineno}, column {e.colno}: {e.msg})" if isinstance(e, json.JSONDecodeError) else ""
        raise UserError(f"{path} is not valid JSON{where}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text") from None


def holds_run(run_dir: Path) -> bool:
    """Whether a run has written outputs here (a folder with only config.yaml holds a run that failed to start)."""
    return any((Path(run_dir) / name).exists() for name in RUN_OUTPUTS)


def describe_folder(path: Path) -> str | None:
    """What a folder this project writes is, in words, for a message saying a path is the wrong kind of thing
    ("a classification run folder (classifier.pt)"): a run of either stage, finished or not, a kNN or eval run, a resume
    state, a run's states, a folder of runs; None for any other folder."""
    if (path / CLASSIFIER_FILE).is_file():
        return f"a classification run folder ({CLASSIFIER_FILE})"
    if (path / ENCODER_FILE).is_file():
        return f"a pretraining run folder ({ENCODER_FILE})"
    if path.parent.name == STATE_DIR and (path.parent.parent / CONFIG_FILE).is_file():
        return f"a resume state of the run {path.parent.parent}, which holds no weights file"
    if path.name == STATE_DIR and (path.parent / CONFIG_FILE).is_file():
        return f"the resume states of the run {path.parent}, which hold no weights file"
    try:
        meta = (read_config(path) or {}).get("meta") or {}
    except UserError:
        meta = {}
    # Its config alone: a run refused on its data or init after its folder was made (or one starting this instant).
    unfinished = "it writes it at its end" if holds_run(path) else f"it wrote nothing but its {CONFIG_FILE}: it stopped before training, or is starting"
    if meta.get("stage") == "pretrain":
        return f"a pretraining run without its {ENCODER_FILE} (unfinished: {unfinished})"
    if meta.get("job_type") in ("knn", "eval"):
        return f"a finetune.mode={meta['job_type']} run folder, which trains and saves no classifier"
    if meta.get("stage") == "finetune":
        return f"a classification run without its {CLASSIFIER_FILE} (unfinished: {unfinished})"
    runs = sorted(p.name for p in path.iterdir() if (p / CONFIG_FILE).is_file())
    if runs:
        return f"a folder of {len(runs)} run folders ({', '.join(runs[:3])}{', ...' if len(runs) > 3 else ''}), not one run"
    return None


def clear_outputs(run_dir: Path) -> None:
    """Delete a previous run's outputs, figures and TensorBoard events included, so they cannot be mistaken for the next
    run's (TensorBoard would draw both runs' events as one)."""
    figures = [p.name for p in Path(run_dir).glob(confusion_path(run_dir, "*").name)]
    for name in (*RUN_OUTPUTS, BUDGET_FILE, RECONSTRUCTION_FILE, FIGURES_DIR, TENSORBOARD_DIR, *figures):
        path = Path(run_dir) / name
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- reading


def is_run_folder(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in RUN_MARKERS)


def run_folder_of(path: Path) -> Path | None:
    """The run folder a checkpoint belongs to: `path` itself when a folder, else the folder beside the file when it holds a run's config."""
    path = Path(path)
    if path.is_dir():
        return path
    return path.parent if (path.parent / CONFIG_FILE).is_file() else None


def is_finished(run_dir: Path) -> bool:
    return (Path(run_dir) / SUMMARY_FILE).is_file()


def read_config(run_dir: Path) -> dict[str, Any] | None:
    """The run's config.yaml as a dict (with `meta`), None when there is none; a damaged one is a ConfigError."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        raise ConfigError(f"{path} is not valid YAML") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} does not hold a mapping")
    return config


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """The run's summary.json, None while the run is unfinished; a damaged one is a UserError."""
    path = Path(run_dir) / SUMMARY_FILE
    if not path.is_file():
        return None
    summary = read_json(path)
    if not isinstance(summary, dict):
        raise UserError(f"{path} does not hold a JSON object")
    return summary


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of metrics.jsonl that carry a step, and how many lines could not be read. A null value is read as
    NaN: `to_json` writes a metric that was not finite (a window of skipped steps) as null.

    A bad line is counted, not fatal: the last line of a run that is writing right now may be cut off.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return [], 0
    records, bad = [], 0
    for line in path.read_bytes().splitlines():  # bytes: a line that is not UTF-8 is one bad line, not an unreadable file
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            bad += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), (int, float)):
            records.append({k: math.nan if v is None else v for k, v in record.items()})
        else:
            bad += 1
    return records, bad


def last_logged(run_dir: Path, key: str) -> Any:
    """The last value of `key` in metrics.jsonl, or None."""
    values = [r[key] for r in read_metrics(run_dir)[0] if key in r]
    return values[-1] if values else None


def trim_metrics(path: Path, step: int, at_step: float = math.inf) -> int:
    """Drop the records of metrics.jsonl after `step`, those of `step` past the first `at_step`, and a line cut off by a kill; returns how many.

    A run resumed from the state of step S repeats the steps after S and logs them again, so
    without this the file would hold those steps twice.
    """
    if not path.is_file():
        return 0
    kept, dropped, seen = [], 0, 0  # seen: records of `step`
    for raw in path.read_bytes().splitlines():  # bytes, as read_metrics: a line that is not UTF-8 is one bad line, not a traceback
        try:
            record = json.loads(line := raw.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            dropped += 1
            continue
        if isinstance(record, dict) and isinstance(at := record.get("step"), int) and (at > step or (at == step and (seen := seen + 1) > at_step)):
            dropped += 1
            continue
        kept.append(line + "\n")
    if dropped:
        atomic_write_text(path, "".join(kept))
    return dropped


# --------------------------------------------------------------------------- resume states


def state_path(run_dir: Path, step: int) -> Path:
    """Where the complete resume state of `step` lies."""
    return Path(run_dir) / STATE_DIR / f"{STATE_PREFIX}{step:08d}"


def partial_state_path(run_dir: Path, step: int) -> Path:
    """Where the state of `step` is written before it is complete (a name `state_dirs` never lists)."""
    return Path(run_dir) / STATE_DIR / f"{PARTIAL_PREFIX}{STATE_PREFIX}{step:08d}"


def is_complete_state(path: Path) -> bool:
    return (Path(path) / STATE_FILE).is_file()


def state_dirs(run_dir: Path) -> list[Path]:
    """Complete resume states, oldest first."""
    root = Path(run_dir) / STATE_DIR
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.name.startswith(STATE_PREFIX) and is_complete_state(p)), key=lambda p: p.name)


def state_run_folder(state: Path) -> Path | None:
    """The run folder a resume state was saved in (`<run>/states/step_*`, beside that run's config.yaml), None for a state
    elsewhere (a copy)."""
    state = Path(state)
    run_dir = state.parent.parent
    return run_dir if state.parent.name == STATE_DIR and (run_dir / CONFIG_FILE).is_file() else None


def newest_state(run_dir: Path) -> Path | None:
    """The newest complete resume state, or None."""
    states = state_dirs(run_dir)
    return states[-1] if states else None


def complete_state(partial: Path, final: Path, progress: dict[str, Any]) -> Path:
    """Mark a fully written state complete and move it to its final name: the progress, then the manifest of every
    file (sizes and hashes, which `check_state` verifies before the state is loaded), are written last. Every file
    gets the usual permissions (safetensors writes 0600)."""
    (partial / STATE_FILE).write_text(json.dumps(progress))
    manifest = {}
    for path in sorted(p for p in partial.rglob("*") if p.is_file()):
        usual_permissions(path)
        manifest[path.relative_to(partial).as_posix()] = [path.stat().st_size, _sha256(path)]
    (partial / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    usual_permissions(partial / MANIFEST_FILE)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    return final


def check_state(path: Path) -> None:
    """Refuse (a CheckpointError naming the file) a state whose files are not those its manifest lists: one missing, cut
    short or changed. A state written before manifests has none and is taken as it is."""
    path = Path(path)
    if not (path / MANIFEST_FILE).is_file():
        return
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        entries = [(str(name), int(size), str(digest)) for name, (size, digest) in manifest.items()]
    except (ValueError, TypeError, AttributeError):
        raise CheckpointError(f"{MANIFEST_FILE} is damaged") from None
    for name, size, digest in entries:
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{name} is missing")
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(f"{name} holds {actual:,} bytes, {size:,} were written")
        if _sha256(file) != digest:
            raise CheckpointError(f"{name} differs from what was written")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_state_progress(path: Path) -> dict[str, Any]:
    """What the training loop saved beside a state (its marker's contents)."""
    return json.loads((Path(path) / STATE_FILE).read_text())


def copy_record(run_dir: Path, dest: Path, replace: dict[str, str] | None = None, files: tuple[str, ...] = RECORD_FILES) -> bool:
    """Copy a finished run's record (RECORD_FILES: config, summary, budget; no weights, states or metrics, unless `files`
    names them) into `dest`, so that a table computed from it can be computed again after the run folder is gone.
    `replace` rewrites strings in the copy (a machine's paths, say). False when `dest` already holds the same record; a
    different one there is a UserError, never overwritten; a file the same record there lacks (metrics.jsonl archived
    later) is added. Bytes that are not UTF-8 are copied as they are."""
    run_dir, dest = Path(run_dir), Path(dest)
    if not (run_dir / SUMMARY_FILE).is_file():
        raise UserError(f"{run_dir} is not a finished run (no {SUMMARY_FILE})")
    record = {}
    for name in files:
        if (run_dir / name).is_file():
            text = (run_dir / name).read_text(errors="surrogateescape")
            for old, new in (replace or {}).items():
                text = text.replace(old, new)
            record[name] = text
    if dest.exists():
        held = {name: (dest / name).read_text(errors="surrogateescape") for name in record if (dest / name).is_file()}
        if SUMMARY_FILE not in held or any(held[name] != record[name] for name in held):
            raise UserError(f"{dest} already holds a different record of a run named {run_dir.name}; move it away or archive elsewhere")
        record = {name: text for name, text in record.items() if name not in held}
        if not record:
            return False
    dest.mkdir(parents=True, exist_ok=True)
    for name, text in record.items():
        (dest / name).write_text(text, errors="surrogateescape")
    return True


def trim_states(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete states; returns the deleted ones."""
    states = state_dirs(run_dir)
    old = states[: max(0, len(states) - keep)]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


# --------------------------------------------------------------------------- a run, finished or not


@dataclass
class RunFolder:
    """What one run folder holds: its config (with `meta`), summary (None while unfinished) and metric records."""

    name: str
    path: Path
    config: dict[str, Any]
    summary: dict[str, Any] | None
    metrics: list[dict[str, Any]]
    problems: list[str] = field(default_factory=list)  # unreadable files, skipped lines

    @property
    def meta(self) -> dict[str, Any]:
        return self.config.get("meta") or {}

    @property
    def finished(self) -> bool:
        return self.summary is not None

    @property
    def stage(self) -> str:
        """pretrain, finetune, linprobe, baseline or eval (the job type), else the stage."""
        s = self.summary or {}
        return s.get("job_type") or self.meta.get("job_type") or s.get("stage") or self.meta.get("stage") or "?"

    @property
    def group(self) -> str:
        """'pretrain' or 'classification': runs whose losses share a scale."""
        stage = (self.summary or {}).get("stage") or self.meta.get("stage")
        return "pretrain" if stage == "pretrain" else CLASSIFICATION


def read_run(path: Path, name: str | None = None) -> RunFolder:
    """Read a run folder; an unreadable file is noted in `problems`, never fatal (a run may be mid-write)."""
    path = Path(path)
    problems = []
    try:
        config = read_config(path) or {}
    except ConfigError:
        config = {}
        problems.append(f"{CONFIG_FILE} unreadable")
    try:
        summary = read_summary(path)
    except UserError:
        summary = None
        problems.append(f"{SUMMARY_FILE} unreadable")
    metrics, bad = read_metrics(path)
    if bad:
        problems.append(f"{bad} unreadable line(s) in {METRICS_FILE}")
    return RunFolder(name or path.name, path, config, summary, metrics, problems)
