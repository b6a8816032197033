"""The equal-compute table of RESULTS.md, computed from the run folders of the budget sweeps (`configs/sweeps/budget_*.yaml`).

    for host, runs in read_budget_runs(Path("runs/budget")).items():    # one table per kind of machine
        print(host, markdown(*budget_table(runs)))
    archive(hosts, Path("docs/results/budget"))                         # the runs' records, to compute it again later

Run names follow the sweeps: `scratch_m{M}_s{S}` (a ViT from scratch for M minutes), `pt_m{M}_f{F}_s{S}`
(MAE pretraining for F% of M), `ft_m{M}_f{F}_s{S}` (its fine-tuning for the rest), `probe_m{M}_f{F}_s{S}`
(its linear probe), `random_probe_s{S}`. Minutes buy four times the steps on a CPU with native bf16 that they buy on
an AVX2-only one, so runs are grouped by the host their summary records and never mixed in one table. Every choice is made on val, with seed 0: the split F of each row
is the one whose fine-tune has the best val top-1; the probe column takes, among the pretraining runs of the
row whose pretraining and probe together fit in M minutes, the one whose probe has the best val top-1.
Test numbers are read only for what was chosen. `scripts/results_table.py` is the command line.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vit.device import host_label
from vit.errors import UserError
from vit.runs import RunFolder, copy_record, is_run_folder, read_run

NAME = re.compile(r"^(scratch|pt|ft|probe)_m(\d+)(?:_f(\d+))?_s(\d+)$|^random_probe_s(\d+)$")


@dataclass
class Arm:
    """One column's result in one row: per seed, the test and val top-1 and the minutes its stages took."""

    test: dict[int, float] = field(default_factory=dict)
    val: dict[int, float] = field(default_factory=dict)
    minutes: dict[int, float] = field(default_factory=dict)
    share: int | None = None  # the pretraining share (%) chosen on val

    def mean(self) -> float | None:
        return statistics.mean(self.test.values()) if self.test else None

    def spread(self) -> tuple[float, float] | None:
        return (min(self.test.values()), max(self.test.values())) if self.test else None


@dataclass
class Row:
    minutes: int
    scratch: Arm
    mae: Arm
    probe: Arm
    search: list[dict[str, Any]]  # per share, seed 0: minutes, fine-tune val, probe val, last kNN top-1


def host_of(run: RunFolder) -> str:
    """The kind of machine a run's minutes were spent on, from its summary ('host not recorded' for older runs)."""
    s = run.summary or {}
    return host_label(s.get("host"), s.get("precision")) if s.get("host") else host_label(None)


def read_budget_runs(folder: Path) -> dict[str, dict[str, RunFolder]]:
    """The finished runs under `folder`, at any depth (a sweep's --out, or an archive of records from several machines),
    whose names follow the budget sweeps: {host label: {run name: run}}. The same name twice on one host is a UserError."""
    hosts: dict[str, dict[str, RunFolder]] = {}
    for path in sorted(p for p in Path(folder).rglob("*") if NAME.match(p.name)):
        if not is_run_folder(path):
            continue
        run = read_run(path)
        if not run.finished:
            continue
        host = host_of(run)
        runs = hosts.setdefault(host, {})
        if path.name in runs:
            raise UserError(f"{runs[path.name].path} and {path} are both {path.name} on {host}: keep one of them")
        runs[path.name] = run
    return hosts


def host_slug(host: str) -> str:
    """A folder name for a host label: 'amd-epyc-avx2-avx512f-avx512-bf16-2-cores-bf16'."""
    return re.sub(r"[^a-z0-9]+", "-", host.lower()).strip("-")


def archive(hosts: dict[str, dict[str, RunFolder]], dest: Path) -> list[Path]:
    """Copy each run's record (config, summary, budget) to dest/<host slug>/<name>, where `read_budget_runs(dest)` finds it
    once the run folders are gone; returns the records written (the same record already there is kept)."""
    written = []
    for host, runs in hosts.items():
        for name, run in runs.items():
            target = Path(dest) / host_slug(host) / name
            if copy_record(run.path, target):
                written.append(target)
    return written


def stage_minutes(run: RunFolder) -> float:
    """The minutes a stage took from its start to its summary (a time budget's `stage_seconds`), else its training time."""
    s = run.summary
    seconds = (s.get("budget") or {}).get("stage_seconds") or s.get("wall_time_sec") or 0.0
    return seconds / 60


def top1(run: RunFolder, split: str) -> float | None:
    return run.summary.get(f"{split}_top1")


def budget_table(runs: dict[str, RunFolder]) -> tuple[list[Row], Arm]:
    """The rows (one per budget, ascending) and the random-encoder probe (budget-free)."""
    random = Arm()
    for name, run in runs.items():
        m = NAME.match(name)
        if m.group(5) is not None:
            seed = int(m.group(5))
            random.test[seed], random.val[seed], random.minutes[seed] = top1(run, "test"), top1(run, "val"), stage_minutes(run)
    budgets = sorted({int(NAME.match(n).group(2)) for n in runs if NAME.match(n).group(2)})
    rows = [budget_row(runs, minutes) for minutes in budgets]
    return rows, random


def budget_row(runs: dict[str, RunFolder], budget: int) -> Row:
    def get(kind: str, share: int | None, seed: int) -> RunFolder | None:
        return runs.get(f"{kind}_m{budget}_s{seed}" if share is None else f"{kind}_m{budget}_f{share}_s{seed}")

    seeds = sorted({int(NAME.match(n).group(4)) for n in runs if NAME.match(n).group(2) == str(budget)})
    shares = sorted({int(NAME.match(n).group(3)) for n in runs if NAME.match(n).group(2) == str(budget) and NAME.match(n).group(3)})
    scratch = Arm()
    for seed in seeds:
        run = get("scratch", None, seed)
        if run is not None:
            scratch.test[seed], scratch.val[seed], scratch.minutes[seed] = top1(run, "test"), top1(run, "val"), stage_minutes(run)
    search = []
    for share in shares:
        pt, ft, probe = get("pt", share, 0), get("ft", share, 0), get("probe", share, 0)
        search.append({
            "share": share,
            "pretrain_min": stage_minutes(pt) if pt else None,
            "finetune_min": stage_minutes(ft) if ft else None,
            "probe_min": stage_minutes(probe) if probe else None,
            "finetune_val": top1(ft, "val") if ft else None,
            "probe_val": top1(probe, "val") if probe else None,
            "knn_top1": pt.summary.get("final_knn_top1") if pt else None,
            "pretrain_epochs": pt.summary.get("epochs") if pt else None,
            "finetune_epochs": ft.summary.get("epochs") if ft else None,
        })  # fmt: skip
    mae, probe = Arm(), Arm()
    done = [s for s in search if s["finetune_val"] is not None]
    if done:
        mae.share = max(done, key=lambda s: s["finetune_val"])["share"]
        for seed in seeds:
            pt, ft = get("pt", mae.share, seed), get("ft", mae.share, seed)
            if pt is not None and ft is not None:
                mae.test[seed], mae.val[seed] = top1(ft, "test"), top1(ft, "val")
                mae.minutes[seed] = stage_minutes(pt) + stage_minutes(ft)
    fits = [s for s in search if s["probe_val"] is not None and s["pretrain_min"] + s["probe_min"] <= budget]
    if fits:
        probe.share = max(fits, key=lambda s: s["probe_val"])["share"]
        for seed in seeds:
            pt, run = get("pt", probe.share, seed), get("probe", probe.share, seed)
            if pt is not None and run is not None:
                probe.test[seed], probe.val[seed] = top1(run, "test"), top1(run, "val")
                probe.minutes[seed] = stage_minutes(pt) + stage_minutes(run)
    return Row(budget, scratch, mae, probe, search)


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def cell(arm: Arm, share: bool = False) -> str:
    """'74.1% (73.5-74.6, 3 seeds; f 0.50)' or '-'."""
    if not arm.test:
        return "-"
    n = len(arm.test)
    text = pct(arm.mean())
    if n > 1:
        lo, hi = arm.spread()
        text += f" ({100 * lo:.1f}-{100 * hi:.1f}, {n} seeds)"
    if share and arm.share is not None:
        text += f"; pretraining {arm.share / 100:.2f} of the budget"
    return text


def difference(row: Row) -> str:
    """MAE then fine-tune minus scratch, mean over the seeds both have, with each arm's spread beside it."""
    seeds = sorted(set(row.mae.test) & set(row.scratch.test))
    if not seeds:
        return "-"
    d = statistics.mean(row.mae.test[s] - row.scratch.test[s] for s in seeds)
    if len(seeds) == 1:
        return f"{100 * d:+.1f} points (1 seed)"
    spread = max(max(a.test[s] for s in seeds) - min(a.test[s] for s in seeds) for a in (row.mae, row.scratch))
    return f"{100 * d:+.1f} points ({len(seeds)} seeds; largest seed spread {100 * spread:.1f})"


def markdown(rows: list[Row], random: Arm) -> str:
    """The equal-compute table (test top-1) and the val search behind it."""
    lines = ["| budget (all stages) | scratch ViT | MAE then fine-tune | MAE linear probe | random-encoder probe | MAE - scratch |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r.minutes} min | {cell(r.scratch)} | {cell(r.mae, True)} | {cell(r.probe, True)} | {cell(random)} | {difference(r)} |")
    lines += ["", "The search, on val (seed 0): for each split of the budget, the minutes each stage took, the fine-tune's and the probe's val top-1, the last kNN top-1 of the pretraining.", "",
              "| budget | pretraining share | pretraining | fine-tuning | probe | fine-tune val | probe val | kNN val (last) |",
              "|---|---:|---|---|---|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        for s in r.search:
            def mins(x, epochs=None):
                return "-" if x is None else f"{x:.1f} min" + (f" ({epochs} ep)" if epochs is not None else "")

            lines.append(f"| {r.minutes} min | {s['share'] / 100:.2f} | {mins(s['pretrain_min'], s['pretrain_epochs'])} | "
                         f"{mins(s['finetune_min'], s['finetune_epochs'])} | {mins(s['probe_min'])} | {pct(s['finetune_val'])} | "
                         f"{pct(s['probe_val'])} | {pct(s['knn_top1'])} |")  # fmt: skip
    return "\n".join(lines)


def plot(tables: dict[str, tuple[list[Row], Arm]], path: Path) -> Path:
    """Test top-1 against the budget for each arm (mean over seeds, min-max bars), one line style per host."""
    from vit.plots import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    arms = (("ViT from scratch", lambda r: r.scratch, "o", "C0"), ("MAE then fine-tune", lambda r: r.mae, "s", "C1"),
            ("MAE linear probe", lambda r: r.probe, "^", "C2"))  # fmt: skip
    ticks = set()
    for (host, (rows, random)), line in zip(tables.items(), ("-", "--", ":", "-.")):
        suffix = f" ({host})" if len(tables) > 1 else ""
        for label, pick, marker, color in arms:
            pts = [(r.minutes, pick(r)) for r in rows if pick(r).test]
            if not pts:
                continue
            xs = [m for m, _ in pts]
            ys = [100 * a.mean() for _, a in pts]
            lo = [100 * (a.mean() - a.spread()[0]) for _, a in pts]
            hi = [100 * (a.spread()[1] - a.mean()) for _, a in pts]
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt=marker + line, color=color, capsize=3, label=label + suffix)
            ticks.update(xs)
        if random.test:
            ax.axhline(100 * random.mean(), color="grey", ls=line, label=f"random-encoder probe ({len(random.test)} seeds){suffix}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
    ax.set_xlabel("minutes for all stages")
    ax.set_ylabel("CIFAR-10 test top-1 (%)")
    title = "Equal compute: MAE against training from scratch"
    ax.set_title(title + (f"\n{next(iter(tables))}" if len(tables) == 1 else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save(fig, path)
