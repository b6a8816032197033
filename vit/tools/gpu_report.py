"""The figures of `scripts/gpu_check.sh`, read back from its folder into one table: `report(folder) -> str`.

The folder holds the bench's JSON (`bench_pipeline_256.json`, with the defaults; `bench_pipeline_<what>.json`, other
batches and settings; `bench_refs.json`, `bench_timm_compiled.json`), the budgeted runs (`runs/pretrain`,
`runs/finetune`), nvidia-smi's samples beside them (`nvidia_smi_<stage>.csv`) and the loss-curve runs (`runs/curve_off`:
eager steps; `runs/curve_graph`: the eager model's step as one CUDA graph; `runs/curve_auto`: the defaults). What is
missing reads "not measured"; a folder that does not exist is a UserError. `curves(folder)` gives the loss curves (and
`report` writes them to `curves.json`), read by `vit.store.runs.read_metrics` (a cut-off line is counted and skipped); two
curves of different lengths are compared over the steps both have, and the row says how many of each there were.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vit.errors import UserError
from vit.store.runs import SUMMARY_FILE, read_metrics

NOT_MEASURED = "not measured"


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _case(report: dict | None, prefix: str) -> dict | None:
    return next((c for c in (report or {}).get("cases", []) if c["name"].startswith(prefix)), None)


def _goal(value: float | None, goal: float | None) -> str:
    if value is None:
        return NOT_MEASURED
    return "" if goal is None else ("met" if value >= goal else "missed")


def smi_mean(path: Path) -> float | None:
    """Mean utilization.gpu (%) of an nvidia-smi CSV (`timestamp, utilization`), None when it has no sample."""
    values = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            values.append(float(line.rsplit(",", 1)[1]))
        except (IndexError, ValueError):
            continue
    return sum(values) / len(values) if values else None


CURVES = ("off", "graph", "auto")  # eager steps; the eager model's step replayed as one CUDA graph; the defaults (compiled, graphed)


def read_curves(folder: Path) -> tuple[dict[str, list[float]], dict[str, int]]:
    """`curves(folder)`, and {mode: lines of its metrics.jsonl that could not be read} where there were some."""
    out, bad = {}, {}
    for mode in CURVES:
        run = Path(folder) / "runs" / f"curve_{mode}"
        records, unreadable = read_metrics(run)
        if records or unreadable:
            out[mode] = [r["loss"] for r in records if "loss" in r]
        if unreadable:
            bad[mode] = unreadable
    return out, bad


def curves(folder: Path) -> dict[str, list[float]]:
    """{"off": [loss per step], "graph": [...], "auto": [...]}: the loss-curve runs that exist (the same masks)."""
    return read_curves(folder)[0]


def curve_difference(c: dict[str, list[float]], first: int | None = None, other: str = "auto") -> float | None:
    """The largest |other - eager| / eager over the first `first` steps (all by default) that both curves have, None
    without both curves."""
    if not c.get("off") or not c.get(other):
        return None
    pairs = list(zip(c["off"], c[other]))[:first]
    return max(abs(a - b) / abs(a) for a, b in pairs)


def compared(c: dict[str, list[float]], other: str, first: int | None = None) -> str:
    """Which steps `curve_difference` compares: 'all 100 steps', 'first 20 steps', or, when the curves differ in length,
    'first 10 steps only (eager 100, auto 10 steps)'."""
    n_off, n_other = len(c.get("off", [])), len(c.get(other, []))
    n = min(n_off, n_other, first or n_off)
    if n_off != n_other:
        return f"first {n} steps only (eager {n_off}, {other} {n_other} steps)"
    return f"first {n} steps" if first else f"all {n} steps"


def variant(case: dict) -> str:
    """How a pipeline case's loop ran its step: captured whole as one CUDA graph or not, compiled or not."""
    graph, mode = case.get("cuda_graph"), case.get("compile")
    if graph and "failed" not in graph:
        return "one CUDA graph, " + ("compiled" if mode else "eager model")
    return f"torch.compile {mode}" if mode else "eager"


class Table:
    """The report's rows: (figure, value, goal, met / missed / not measured)."""

    def __init__(self):
        self.rows: list[tuple[str, str, str, str]] = []

    def add(self, what: str, value: float | None, fmt: str, goal: float | None = None, goal_text: str = "") -> None:
        self.rows.append((what, NOT_MEASURED if value is None else fmt.format(value), goal_text, _goal(value, goal)))

    def text(self, what: str, value: str, goal: str = "", met: str = "") -> None:
        self.rows.append((what, value, goal, met))

    def markdown(self) -> str:
        lines = ["| figure | value | goal | |", "|---|---:|---|---|"]
        return "\n".join(lines + [f"| {what} | {value} | {goal} | {met} |" for what, value, goal, met in self.rows])


def pipeline_rows(t: Table, folder: Path) -> None:
    """Each stage's loop with the defaults at batch 256, then every other pipeline file (batches, settings)."""
    pipe = _json(folder / "bench_pipeline_256.json")
    for stage in ("pretrain", "finetune"):
        c = _case(pipe, f"pipeline/{stage}/")
        ours, batch = (c["ours"], c["batch"]) if c else ({}, 256)
        t.add(f"{stage} loop, batch {batch}: img/s", ours.get("median_images_per_s"), "{:,.0f}", 38_000 if stage == "pretrain" else None,
              ">= 38,000" if stage == "pretrain" else "")  # fmt: skip
        t.add(f"{stage} loop / its bare step, batch {batch}", c and c["ratio"], "{:.2f}x", 0.9, ">= 0.9x")
        t.add(f"{stage} loop, batch {batch}: GPU busy (NVML, %)", ours.get("gpu_busy_percent"), "{:.0f}", 90, ">= 90")
        reads = c.get("host_reads") if c else None
        t.text(f"{stage} loop: host reads in the {c['host_read_steps'] if c else '?'} steps between two records",
               NOT_MEASURED if reads is None else str(reads), "0", NOT_MEASURED if reads is None else ("met" if reads == 0 else "missed"))
        if c:
            t.text(f"{stage} loop, batch {batch}: how it ran", variant(c))
    for path in sorted(p for p in folder.glob("bench_pipeline_*.json") if p.name != "bench_pipeline_256.json"):
        for c in (_json(path) or {}).get("cases", []):
            stage, how = c["name"].split("/")[1], variant(c)
            large = stage == "pretrain" and c["batch"] >= 1024
            t.add(f"{stage} loop, batch {c['batch']}, {how}: img/s", c["ours"]["median_images_per_s"], "{:,.0f}", 100_000 if large else None,
                  ">= 100,000" if large else "")  # fmt: skip
            t.add(f"{stage} loop / its bare step, batch {c['batch']}, {how}", c["ratio"], "{:.2f}x", 0.9, ">= 0.9x")
            t.add(f"{stage} loop, batch {c['batch']}, {how}: GPU busy (NVML, %)", c["ours"].get("gpu_busy_percent"), "{:.0f}", 90, ">= 90")


def stage_rows(t: Table, folder: Path) -> None:
    """The budgeted pretraining and fine-tuning runs."""
    for stage in ("pretrain", "finetune"):
        s = _json(folder / "runs" / stage / SUMMARY_FILE) or {}
        minutes = (s.get("budget") or {}).get("budget_minutes")
        label = f"{stage}, {minutes:g}-min budget" if minutes else f"{stage} run"
        t.add(f"{label}: img/s over its training time", s.get("images_per_sec"), "{:,.0f}")
        t.add(f"{label}: GPU busy after the first step (run's NVML, %)", s.get("gpu_busy_percent"), "{:.0f}", 90, ">= 90")
        t.add(f"{label}: GPU busy over the whole stage (nvidia-smi, %)", smi_mean(folder / f"nvidia_smi_{stage}.csv"), "{:.0f}")
        t.add(f"{label}: first step, compilation included (s)", (s.get("compile") or {}).get("first_step_sec"), "{:.1f}")
        t.add(f"{label}: stage seconds (budget {60 * minutes:g})" if minutes else f"{label}: stage seconds",
              (s.get("budget") or {}).get("stage_seconds"), "{:.1f}")  # fmt: skip
        if stage == "finetune":
            t.add(f"{label}: val top-1 (%)", s.get("final_val_top1") and 100 * s["final_val_top1"], "{:.1f}")
            t.add(f"{label}: test top-1 (%)", s.get("final_test_top1") and 100 * s["final_test_top1"], "{:.1f}")


def reference_rows(t: Table, folder: Path) -> None:
    """Our MAE and encoder steps against the references, eager and compiled."""
    refs, timm_compiled = _json(folder / "bench_refs.json"), _json(folder / "bench_timm_compiled.json")
    for prefix, what, goal in (("mae-hf/", "MAE step / Hugging Face ViTMAE (eager)", 1.5), ("mae/", "MAE step / official-style MAE (eager)", None),
                               ("encoder/", "encoder step / timm ViT (eager)", 1.3)):  # fmt: skip
        c = _case(refs, prefix)
        t.add(f"{what}, {c['name'].split('/')[1]}" if c else what, c and c["ratio"], "{:.2f}x", goal, f">= {goal}x" if goal else "")
        if c and c.get("flops_per_image") and prefix != "mae/":
            t.add("  ours, TFLOP/s (matmul FLOPs x img/s)", c["flops_per_image"] * c["ours"]["median_images_per_s"] / 1e12, "{:.0f}")
    c = _case(timm_compiled, "encoder/")
    t.add("encoder step / torch.compile'd timm ViT", c and c["ratio"], "{:.2f}x")


def curve_rows(t: Table, folder: Path) -> None:
    """The loss curves against the eager one; written to curves.json and, with the defaults' curve, to curves.png."""
    cv, bad = read_curves(folder)
    t.add(f"one CUDA graph / eager steps, loss, largest relative difference, {compared(cv, 'graph')}", curve_difference(cv, other="graph"), "{:.2e}")
    t.add(f"compiled and graphed / eager loss, largest relative difference, {compared(cv, 'auto', 20)}", curve_difference(cv, 20), "{:.2e}")
    t.add(f"compiled and graphed / eager loss, largest relative difference, {compared(cv, 'auto')}", curve_difference(cv), "{:.2e}")
    for mode, n in bad.items():
        t.text(f"curve_{mode}: unreadable lines of its metrics, skipped", str(n))
    if cv:
        (folder / "curves.json").write_text(json.dumps(cv) + "\n")
    if cv.get("off") and cv.get("auto"):
        from vit.tools.plots import plot_compiled_vs_eager

        plot_compiled_vs_eager(cv["off"], cv["auto"], folder / "curves.png", "pretraining loss, eager and compiled")


def report(folder: str | Path) -> str:
    """The table; a UserError when `folder` is not a folder (every row would read "not measured")."""
    folder, t = Path(folder), Table()
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder (the OUT of scripts/gpu_check.sh)")
    for rows in (pipeline_rows, stage_rows, reference_rows, curve_rows):
        rows(t, folder)
    return t.markdown()
