"""Run records kept in git: a finished run's config, summary and budget (and metrics), copied without the machine's paths
under <dest>/<host>/<run>, grouped by the kind of machine whose minutes they spent.

    hosts = by_host(read_run(p) for p in folders)         # {host label: {run name: run}}; the same name twice is refused
    archive(hosts, Path("docs/results/budget"))           # records that `scripts/results_table.py` and `compare_runs.py` read again

`vit.tools.results` (the equal-compute table) and `scripts/compare_runs.py --archive` keep their runs' records so.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vit.errors import UserError
from vit.store.runs import CONFIG_FILE, METRICS_FILE, RECORD_FILES, SUMMARY_FILE, RunFolder, copy_record

REPO = Path(__file__).resolve().parents[2]  # the checkout, whose path a run's recorded command starts with


def host_label(info: dict | None, precision: str | None = None) -> str:
    """'AMD EPYC (avx2 avx512f avx512_bf16), 2 cores, bf16': the machine class a time-budgeted result belongs to."""
    if not info:
        return "host not recorded"
    text = info.get("gpu") or f"{info.get('cpu', '?')} ({' '.join(info.get('cpu_flags') or []) or 'no AVX2'}), {info.get('cores', '?')} cores"
    return text + (f", {'fp32' if precision in (None, 'no') else precision}" if precision is not None else "")


def host_of(run: RunFolder) -> str:
    """The kind of machine a run's minutes were spent on, from its summary ('host not recorded' for older runs)."""
    s = run.summary or {}
    return host_label(s.get("host"), s.get("precision")) if s.get("host") else host_label(None)


def by_host(runs: Iterable[RunFolder]) -> dict[str, dict[str, RunFolder]]:
    """The finished ones among `runs`, by the host their summary names: {host label: {run folder name: run}}. The same
    name twice on one host is a UserError."""
    hosts: dict[str, dict[str, RunFolder]] = {}
    for run in runs:
        if not run.finished:
            continue
        host, name = host_of(run), Path(run.path).name
        same_host = hosts.setdefault(host, {})
        if name in same_host:
            raise UserError(f"{same_host[name].path} and {run.path} are both {name} on {host}: keep one of them")
        same_host[name] = run
    return hosts


def host_slug(host: str) -> str:
    """A folder name for a host label: 'amd-epyc-avx2-avx512f-avx512-bf16-2-cores-bf16'."""
    return re.sub(r"[^a-z0-9]+", "-", host.lower()).strip("-")


def machine_paths(run: RunFolder) -> dict[str, str]:
    """The paths of the machine a run's record names, and what an archive writes instead: the data folder given as an
    absolute path becomes 'PATH' (as RESULTS.md writes it), an absolute run.dir becomes runs/<its name>, and the
    checkout's folder is left out of the command."""
    root = (run.config.get("data") or {}).get("root")
    paths = {str(root): "PATH"} if root and Path(str(root)).is_absolute() else {}
    # a sweep's --out given as an absolute path: the folder's own name under runs/, as the sweep files write it
    out = (run.config.get("run") or {}).get("dir")
    if out and Path(str(out)).is_absolute():
        paths[str(out)] = f"runs/{Path(str(out)).name}"
    # every other absolute path of the record (data.cache_dir, an init outside run.dir): a placeholder named after its key
    for key, value in absolute_paths([run.config, run.summary or {}]):
        if not any(value == known or value.startswith(known.rstrip("/") + "/") for known in [*paths, str(REPO)]):
            name, path = key.upper(), Path(value)
            paths[value] = name if key.endswith(("dir", "root")) else "/".join([name, *([path.parent.name] if path.suffix else []), path.name])
    # a path that appears only inside a warning's text (summary.json `warnings`: a file the run could not read, say)
    warnings = (run.summary or {}).get("warnings")
    for warning in warnings if isinstance(warnings, list) else []:
        for value in re.findall(r"(?<![\w./-])(/[^\s'\"(),;:]+)", str(warning)):
            if not any(value.startswith(known.rstrip("/")) for known in [*paths, str(REPO)]):
                paths[value] = "PATH"
    # longest first: a path inside another is replaced by its own placeholder, not by its parent's
    return {**dict(sorted(paths.items(), key=lambda kv: -len(kv[0]))), str(REPO) + "/": ""}


def absolute_paths(tree: Any, key: str = "") -> Iterable[tuple[str, str]]:
    """(key, value) of every string in a config or summary that is an absolute path (a command is not one)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k != "command":
                yield from absolute_paths(v, str(k))
    elif isinstance(tree, list):
        for v in tree:
            yield from absolute_paths(v, key)
    elif isinstance(tree, str) and len(tree) > 1 and tree.startswith("/") and "\n" not in tree:
        yield key, tree.rstrip("/")


def archivable(run: RunFolder) -> bool:
    """Whether a run's record can be archived: finished, with a config and summary that read and hold the types their
    readers expect (a damaged one is left out: a host that does not read would file it under another machine).
    `run.problems` names the mistyped values once `vit.tools.compare.row` has read the run."""
    return run.finished and not any(CONFIG_FILE in p or SUMMARY_FILE in p for p in run.problems)


def archive(hosts: dict[str, dict[str, RunFolder]], dest: Path, metrics: bool = False) -> list[Path]:
    """Copy each run's record (config, summary, budget; with `metrics`, its metrics.jsonl too) to dest/<host slug>/<name>,
    where `read_budget_runs(dest)` finds it once the run folders are gone, without the machine's paths; returns the
    records written (the same one is kept)."""
    written = []
    files = RECORD_FILES + ((METRICS_FILE,) if metrics else ())
    for host, runs in hosts.items():
        for name, run in runs.items():
            target = Path(dest) / host_slug(host) / name
            try:
                if copy_record(run.path, target, replace=machine_paths(run), files=files):
                    written.append(target)
            except OSError as e:
                raise UserError(f"cannot write {e.filename or target}: {e.strerror} ({len(written)} record(s) written before)") from None
            except UserError as e:  # a different record there: kept; say what this archive wrote before it
                raise UserError(f"{e} ({len(written)} record(s) written before)") from None
    return written

