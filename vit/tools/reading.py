"""Reading runs for a comparison: the run folders that paths name (a run folder, or a folder of them one level down),
each named so two of one name stay apart (`a/mae`, `b/mae`), kept by `--runs` patterns, and their metric curves.

    runs = load_runs(["runs/mae", "runs"], ["ft_*"])        # RunFolder each (vit.store.runs), in the order named
    loss = series(runs[0], "loss")                          # (step, training time, value), the later line of a step winning

`vit.tools.compare` makes the table, figures and report from them.
"""

from __future__ import annotations

import bisect
import fnmatch
import sys
from dataclasses import dataclass
from pathlib import Path

from vit.errors import UserError
from vit.store.runs import METRICS_FILE, RUN_MARKERS, SUMMARY_FILE, RunFolder, is_run_folder, read_run
from vit.store.values import in_bounds, is_finite, is_number, pop_out_of_range


def find_runs(paths: list[str]) -> list[Path]:
    """Run folders named by `paths`: each is a run folder or holds run folders (one level down). Order kept, no repeats."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise UserError(f"{path} does not exist")
        if is_run_folder(path):
            candidates = [path]
        elif path.is_dir():
            candidates = sorted(p for p in path.iterdir() if is_run_folder(p))
            if not candidates:
                print(f"note: {path} is not a run folder and holds none; skipped", file=sys.stderr)
        else:
            print(f"note: {path} is not a run folder; skipped", file=sys.stderr)
            candidates = []
        for c in candidates:
            if c.resolve() not in {f.resolve() for f in found}:
                found.append(c)
    return found


def run_names(paths: list[Path]) -> list[str]:
    """Folder names, with as many parent folders prepended as it takes to tell apart runs that share a name (`a/mae`,
    `b/mae`; `a/x/run`, `b/x/run`): the table, the CSV and the figures' legends key runs by these names."""
    names = []
    for path in paths:
        twins = [q.absolute().parts for q in paths if q.name == path.name]
        parts, depth = path.absolute().parts, 1
        while sum(t[-depth:] == parts[-depth:] for t in twins) > 1 and depth < len(parts):
            depth += 1
        names.append(str(Path(*parts[-depth:])))
    return names


def load_runs(paths: list[str], patterns: list[str] | None = None) -> list[RunFolder]:
    """The runs under `paths`, kept where their names match one of `patterns` (all when None)."""
    folders = find_runs(paths)
    if not folders:
        raise UserError(f"no run folders (with {', '.join(RUN_MARKERS)}) under {' '.join(paths)}")
    runs = [read_run(p, n) for p, n in zip(folders, run_names(folders))]
    for run in runs:
        drop_stepless(run)
    if patterns:

        def matches(run: RunFolder, pattern: str) -> bool:  # the folder's name, or the table's (`x/mae` where two share one)
            return fnmatch.fnmatchcase(run.path.name, pattern) or fnmatch.fnmatchcase(run.name, pattern)

        for pattern in patterns:
            if not any(matches(r, pattern) for r in runs):
                raise UserError(f"--runs {pattern!r} matches none of the runs: {', '.join(r.name for r in runs)}")
        runs = [r for r in runs if any(matches(r, p) for p in patterns)]
    return runs


def brief(value: object) -> str:
    """`value` as repr shows it, cut to 40 characters: for a message naming a value that is not what it should be."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def is_text(value: object) -> bool:
    return isinstance(value, str)


# A summary's `host` (`vit.device.host`): field -> (what it must be, whether it is). A host made up of values that are
# not what was recorded (flags written as text read as "a v x 2") would file a run under another machine.
HOST_FIELDS = {"gpu": ("text", is_text), "cpu": ("text", is_text), "cores": ("a number", is_number),
               "cpu_flags": ("a list of text", lambda v: isinstance(v, list) and all(map(is_text, v)))}  # fmt: skip


def mistyped_host_field(host: dict) -> str | None:
    """The first field of a summary's `host` that is there and not of its type (`HOST_FIELDS`), else None."""
    return next((k for k, (_, fits) in HOST_FIELDS.items() if host.get(k) is not None and not fits(host[k])), None)


def drop_out_of_range(run: RunFolder, keys: tuple[str, ...]) -> None:
    """Drop the values of summary.json's `keys` that are out of their bounds (`in_bounds`: a kNN top-1 of 170%, minus 5 s)
    and its image counts (`data.train`, `val`, `test`) that are no count (-100, "many"), named in `run.problems`."""
    far = pop_out_of_range(run.summary or {}, keys)
    if far:
        said = [f"{SUMMARY_FILE} {k} {brief(v) if k.startswith('data.') else format(v, 'g')}" for k, v in far]
        run.problems.append(f"out of range, left out: {', '.join(said)}")


def note_out_of_range(run: RunFolder, key: str, value: float, step: float) -> None:
    """Name in `run.problems`, once, a metric value left out for being out of its bounds (`in_bounds`)."""
    if (said := f"out of range, left out: {METRICS_FILE} {key} {value:g} at step {step:g}") not in run.problems:
        run.problems.append(said)


def drop_stepless(run: RunFolder) -> None:
    """Drop the metric records whose step is not a finite number >= 0 (NaN, Infinity, true, -7: a hand edit, another tool's
    file), named in `run.problems`: sorted among the others, such a step would pass its loss or time off as the run's last."""
    kept = [rec for rec in run.metrics if is_finite(rec["step"]) and in_bounds("step", rec["step"])]
    if len(kept) < len(run.metrics):
        run.problems.append(f"{len(run.metrics) - len(kept)} line(s) of {METRICS_FILE} without a finite step >= 0")
        run.metrics = kept


# --------------------------------------------------------------------------- curves


@dataclass
class Series:
    steps: list[float]
    times: list[float | None]
    values: list[float]


def series(run: RunFolder, key: str) -> Series:
    """One metric over the run: (step, training time, value), sorted by step.

    A resumed run logs the steps after its last state again; the later line wins. Epoch-end
    lines that carry no time take the time of the latest line at or before their step.
    """
    clock: dict[float, float] = {}
    values: dict[float, float] = {}
    for rec in run.metrics:
        step = rec["step"]
        if is_finite(rec.get("time")):
            clock[step] = rec["time"]
        value = rec.get(key)
        if is_finite(value) and in_bounds(key, value):
            values[step] = float(value)
        elif is_finite(value):
            note_out_of_range(run, key, value, step)
    timed = sorted(clock)
    steps = sorted(values)
    times = []
    for s in steps:
        i = bisect.bisect_right(timed, s)  # the timed lines at or before this step
        times.append(clock[timed[i - 1]] if i else None)
    return Series(steps, times, [values[s] for s in steps])


def last_value(run: RunFolder, key: str) -> float | None:
    """`key` at the latest step that logged it (the later line of a step wins), NaN where it was not finite there: a run
    whose loss went non-finite (metrics.jsonl's null) must not show an earlier finite loss as its last. One out of bounds
    (`in_bounds`) is None, and named in `run.problems`."""
    last: tuple[float, float] | None = None
    for rec in run.metrics:
        value = rec.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and (last is None or rec["step"] >= last[0]):
            last = (rec["step"], float(value))
    if last and not in_bounds(key, last[1]):
        note_out_of_range(run, key, last[1], last[0])
        return None
    return last[1] if last else None
