"""The figures of `scripts/gpu_check.sh`, read back from its folder into one table: `report(folder) -> str`.

The folder holds the bench's JSON (`bench_pipeline_256.json`, with the defaults; `bench_pipeline_<what>.json`, other
batches and settings; `bench_refs.json`, `bench_timm_compiled.json`), the budgeted runs (`runs/pretrain`,
`runs/finetune`), nvidia-smi's samples beside them (`nvidia_smi_<stage>.csv`) and the loss-curve runs (`runs/curve_off`:
eager steps; `runs/curve_graph`: the eager model's step as one CUDA graph; `runs/curve_auto`: the defaults). What is
missing reads "not measured"; an input that is there and cannot be read (not JSON, not UTF-8, a field missing or not of
its type) is listed under the table with its path and what is wrong, its rows read "damaged", and the rest of the table
prints; a folder that does not exist is a UserError. `curves(folder)` gives the loss curves (and `report` writes them to
`curves.json`), read by `vit.store.runs.read_metrics` (a cut-off line is counted and skipped); two curves of different
lengths are compared over the steps both have, and the row says how many of each there were.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from vit.errors import UserError
from vit.store.runs import METRICS_FILE, SUMMARY_FILE, read_json, read_metrics, read_summary, to_json
from vit.store.values import is_count, is_finite, is_number
from vit.tools.reading import brief, is_text
from vit.tools.records import host_label

NOT_MEASURED = "not measured"
DAMAGED = "damaged (named below)"  # a row whose input is damaged: the input and what is wrong are listed under the table


def _goal(value: float | None, goal: float | None) -> str:
    if value is None:
        return NOT_MEASURED
    return "" if goal is None else ("met" if value >= goal else "missed")


def smi_mean(path: Path) -> float | None:
    """Mean utilization.gpu (%) of an nvidia-smi CSV (`timestamp, utilization`), None when it has no sample. A line
    without a percentage ('[N/A]', a note, bytes that are not text) is not a sample."""
    values = []
    for line in path.read_bytes().decode(errors="replace").splitlines() if path.is_file() else []:
        try:
            value = float(line.rsplit(",", 1)[1])
        except (IndexError, ValueError):
            continue
        if is_finite(value) and 0 <= value <= 100:
            values.append(value)
    return sum(values) / len(values) if values else None


CURVES = ("off", "graph", "auto")  # eager steps; the eager model's step replayed as one CUDA graph; the defaults (compiled, graphed)


def read_curves(folder: Path) -> tuple[dict[str, list[float]], dict[str, int], dict[str, str]]:
    """`curves(folder)`, {mode: lines of its metrics.jsonl that could not be read} where there were some, and {mode: why}
    for a curve left out: a loss that is not a number (text, true: a hand edit) or a file that cannot be read. A null
    loss (a skipped step) is NaN, and kept: the curves are compared step by step, so a step dropped would shift the rest."""
    out, bad, damaged = {}, {}, {}
    for mode in CURVES:
        run = Path(folder) / "runs" / f"curve_{mode}"
        try:
            records, unreadable = read_metrics(run)
        except OSError as e:
            damaged[mode] = f"{run / METRICS_FILE} cannot be read ({e.strerror or e})"
            continue
        if wrong := next((r for r in records if "loss" in r and not is_number(r["loss"])), None):
            damaged[mode] = f"{run / METRICS_FILE} step {wrong['step']:g}: loss is {brief(wrong['loss'])}, not a number"
        elif records or unreadable:
            out[mode] = [float(r["loss"]) for r in records if "loss" in r]
        if unreadable:
            bad[mode] = unreadable
    return out, bad, damaged


def curves(folder: Path) -> dict[str, list[float]]:
    """{"off": [loss per step], "graph": [...], "auto": [...]}: the loss-curve runs that exist (the same masks)."""
    return read_curves(folder)[0]


def relative_difference(eager: float, other: float) -> float:
    """|other - eager| / |eager|: 0 where both are 0, infinite where only the eager loss is, NaN where one is not finite."""
    if not (math.isfinite(eager) and math.isfinite(other)):
        return math.nan
    if eager == 0:
        return 0.0 if other == 0 else math.inf
    return abs(other - eager) / abs(eager)


def curve_difference(c: dict[str, list[float]], first: int | None = None, other: str = "auto") -> float | None:
    """The largest |other - eager| / eager over the first `first` steps (all by default) that both curves have, None
    without both curves, NaN where a loss compared is not finite (`max` would pass over it or not, by its place)."""
    if not c.get("off") or not c.get(other):
        return None
    differences = [relative_difference(a, b) for a, b in list(zip(c["off"], c[other]))[:first]]
    return math.nan if any(map(math.isnan, differences)) else max(differences)


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
    """The report's rows: (figure, value, goal, met / missed / not measured / damaged), and the damaged inputs, each
    named with what is wrong, listed under them."""

    def __init__(self):
        self.rows: list[tuple[str, str, str, str]] = []
        self.damaged: list[str] = []

    def damage(self, why: str) -> str:
        """Name a damaged input (`why`: its path and what is wrong) under the table; returns what its rows read."""
        if why not in self.damaged:
            self.damaged.append(why)
        return DAMAGED

    def add(self, what: str, value: float | str | None, fmt: str, goal: float | None = None, goal_text: str = "") -> None:
        """A figure; None reads "not measured", and a text (DAMAGED) reads as it is."""
        if value is None or isinstance(value, str):
            self.rows.append((what, value or NOT_MEASURED, goal_text, value or NOT_MEASURED))
        else:
            self.rows.append((what, fmt.format(value), goal_text, _goal(value, goal)))

    def text(self, what: str, value: str, goal: str = "", met: str = "") -> None:
        self.rows.append((what, value, goal, met))

    def markdown(self) -> str:
        lines = ["| figure | value | goal | |", "|---|---:|---|---|"]
        lines += [f"| {what} | {value} | {goal} | {met} |" for what, value, goal, met in self.rows]
        if self.damaged:
            lines += ["", f"Damaged inputs ({len(self.damaged)}), whose rows read {DAMAGED!r}:", *(f"- {why}" for why in self.damaged)]
        return "\n".join(lines)


def unreadable(path: Path, e: UserError | OSError) -> str:
    """Why the file `path` could not be read (`read_json`'s or `read_summary`'s UserError, or the OSError), with its path."""
    return str(e) if isinstance(e, UserError) else f"{path} cannot be read ({e.strerror or e})"


# A bench case's fields that the table reads (`vit.tools.bench`'s JSON): field -> (what it must be, whether it is, whether
# it must be there). A case with one that is not is named under the table and left out: read as it is, it would stop the
# report with a traceback or print a number it is not.
CASE_FIELDS = {"name": ("text", is_text, True), "batch": ("a whole number > 0", lambda v: is_count(v) and v > 0, True),
               "ratio": ("a finite number", is_finite, True), "ours": ("a mapping", lambda v: isinstance(v, dict), True),
               "host_reads": ("a whole number >= 0", is_count, False), "host_read_steps": ("a whole number >= 0", is_count, False),
               "flops_per_image": ("a finite number", is_finite, False), "compile": ("text", is_text, False),
               "cuda_graph": ("a mapping or text", lambda v: isinstance(v, (dict, str)), False)}  # fmt: skip
OURS_FIELDS = {"median_images_per_s": ("a finite number", is_finite, True),
               "gpu_busy_percent": ("a percentage (0 to 100)", lambda v: is_finite(v) and 0 <= v <= 100, False)}  # fmt: skip


def case_damage(case: Any) -> str | None:
    """What keeps a bench case from the table (a field of `CASE_FIELDS` or `OURS_FIELDS` missing or not of its type), else None."""
    if not isinstance(case, dict):
        return f"is {brief(case)}, not a mapping"
    for fields, prefix in ((CASE_FIELDS, ""), (OURS_FIELDS, "ours.")):
        record = case["ours"] if prefix else case  # ours is a mapping by now: CASE_FIELDS checked it
        for key, (what, fits, required) in fields.items():
            value = record.get(key)
            if value is None and required:
                return f"has no {prefix}{key}"
            if value is not None and not fits(value):
                return f"{prefix}{key} is {brief(value)}, not {what}"
    return None


def bench_cases(t: Table, path: Path) -> tuple[list[dict], str | None]:
    """The cases of a bench JSON that the table can read, and what a case that is not there reads: None (not measured),
    or DAMAGED where the file, or one of its cases, is (each named in `t`). A missing file has no cases."""
    if not path.exists():
        return [], None
    try:
        report = read_json(path)
    except (UserError, OSError) as e:
        return [], t.damage(unreadable(path, e))
    if not isinstance(report, dict):
        return [], t.damage(f"{path} holds {brief(report)}, not a report of scripts/bench.py (a mapping with its cases)")
    if not isinstance(report.get("cases"), list):
        return [], t.damage(f"{path} cases is {brief(report.get('cases'))}, not a list (of scripts/bench.py's cases)")
    kept, gap = [], None
    for i, case in enumerate(report["cases"], 1):
        if why := case_damage(case):
            name = case.get("name") if isinstance(case, dict) and is_text(case.get("name")) else None
            gap = t.damage(f"{path} case {i}{f' ({name})' if name else ''} {why}")
        else:
            kept.append(case)
    return kept, gap


def _case(cases: list[dict], prefix: str) -> dict | None:
    return next((c for c in cases if c["name"].startswith(prefix)), None)


def pipeline_rows(t: Table, folder: Path) -> None:
    """Each stage's loop with the defaults at batch 256, then every other pipeline file (batches, settings)."""
    cases, gap = bench_cases(t, folder / "bench_pipeline_256.json")
    for stage in ("pretrain", "finetune"):
        c = _case(cases, f"pipeline/{stage}/")
        ours, batch = (c["ours"], c["batch"]) if c else (dict.fromkeys(OURS_FIELDS, gap), 256)
        t.add(f"{stage} loop, batch {batch}: img/s", ours["median_images_per_s"], "{:,.0f}", 38_000 if stage == "pretrain" else None,
              ">= 38,000" if stage == "pretrain" else "")  # fmt: skip
        t.add(f"{stage} loop / its bare step, batch {batch}", c["ratio"] if c else gap, "{:.2f}x", 0.9, ">= 0.9x")
        t.add(f"{stage} loop, batch {batch}: GPU busy (NVML, %)", ours.get("gpu_busy_percent"), "{:.0f}", 90, ">= 90")
        reads, steps = (c.get("host_reads"), c.get("host_read_steps")) if c else (gap, None)
        what = f"{stage} loop: host reads in the {'?' if steps is None else steps} steps between two records"
        if is_count(reads):
            t.text(what, str(reads), "0", "met" if reads == 0 else "missed")
        else:
            t.text(what, reads or NOT_MEASURED, "0", reads or NOT_MEASURED)
        if c:
            t.text(f"{stage} loop, batch {batch}: how it ran", variant(c))
    for path in sorted(p for p in folder.glob("bench_pipeline_*.json") if p.name != "bench_pipeline_256.json"):
        for c in bench_cases(t, path)[0]:
            stage = c["name"].split("/")[1] if c["name"].startswith("pipeline/") else ""
            if not stage:
                t.damage(f"{path} case {c['name']} is not a pipeline case (pipeline/<stage>/...)")
                continue
            how, large = variant(c), stage == "pretrain" and c["batch"] >= 1024
            t.add(f"{stage} loop, batch {c['batch']}, {how}: img/s", c["ours"]["median_images_per_s"], "{:,.0f}", 100_000 if large else None,
                  ">= 100,000" if large else "")  # fmt: skip
            t.add(f"{stage} loop / its bare step, batch {c['batch']}, {how}", c["ratio"], "{:.2f}x", 0.9, ">= 0.9x")
            t.add(f"{stage} loop, batch {c['batch']}, {how}: GPU busy (NVML, %)", c["ours"].get("gpu_busy_percent"), "{:.0f}", 90, ">= 90")


def is_amount(value: Any) -> bool:
    return is_finite(value) and value >= 0


# The fields of a stage's summary.json that the table reads ("budget.stage_seconds": summary["budget"]["stage_seconds"]):
# field -> (what it must be, whether it is); absent or null reads "not measured".
SUMMARY_FIELDS = {"images_per_sec": ("a number >= 0", is_amount),
                  "gpu_busy_percent": ("a percentage (0 to 100)", lambda v: is_finite(v) and 0 <= v <= 100),
                  "compile.first_step_sec": ("seconds (a number >= 0)", is_amount),
                  "budget.budget_minutes": ("minutes (a number > 0)", lambda v: is_finite(v) and v > 0),
                  "budget.stage_seconds": ("seconds (a number >= 0)", is_amount),
                  "final_val_top1": ("a fraction (0 to 1)", lambda v: is_finite(v) and 0 <= v <= 1),
                  "final_test_top1": ("a fraction (0 to 1)", lambda v: is_finite(v) and 0 <= v <= 1)}  # fmt: skip


def read_stage(t: Table, run: Path) -> dict[str, Any]:
    """{field of `SUMMARY_FIELDS`: its value in the run's summary, None where absent}; every value DAMAGED, and the
    summary named in `t`, where the summary does not read or one of those fields is not of its type."""
    path = run / SUMMARY_FILE
    try:
        summary = read_summary(run) or {}
    except (UserError, OSError) as e:
        return dict.fromkeys(SUMMARY_FIELDS, t.damage(unreadable(path, e)))
    values = {}
    for key, (what, fits) in SUMMARY_FIELDS.items():
        section, _, field = key.rpartition(".")
        holder = summary.get(section) if section else summary
        if holder is not None and not isinstance(holder, dict):
            return dict.fromkeys(SUMMARY_FIELDS, t.damage(f"{path} {section} is {brief(holder)}, not a mapping"))
        values[key] = (holder or {}).get(field)
        if values[key] is not None and not fits(values[key]):
            return dict.fromkeys(SUMMARY_FIELDS, t.damage(f"{path} {key} is {brief(values[key])}, not {what}"))
    return values


def gpu_samples(t: Table, path: Path) -> float | str | None:
    """`smi_mean(path)`, DAMAGED (named in `t`) when the file cannot be read."""
    try:
        return smi_mean(path)
    except OSError as e:
        return t.damage(f"{path} cannot be read ({e.strerror or e})")


def stage_rows(t: Table, folder: Path) -> None:
    """The budgeted pretraining and fine-tuning runs."""
    for stage in ("pretrain", "finetune"):
        s = read_stage(t, folder / "runs" / stage)
        minutes = s["budget.budget_minutes"]
        label = f"{stage}, {minutes:g}-min budget" if is_number(minutes) else f"{stage} run"
        t.add(f"{label}: img/s over its training time", s["images_per_sec"], "{:,.0f}")
        t.add(f"{label}: GPU busy after the first step (run's NVML, %)", s["gpu_busy_percent"], "{:.0f}", 90, ">= 90")
        t.add(f"{label}: GPU busy over the whole stage (nvidia-smi, %)", gpu_samples(t, folder / f"nvidia_smi_{stage}.csv"), "{:.0f}")
        t.add(f"{label}: first step, compilation included (s)", s["compile.first_step_sec"], "{:.1f}")
        budget = f" (budget {60 * minutes:g})" if is_number(minutes) else ""
        t.add(f"{label}: stage seconds{budget}", s["budget.stage_seconds"], "{:.1f}")
        if stage == "finetune":
            for split in ("val", "test"):
                top1 = s[f"final_{split}_top1"]
                t.add(f"{label}: {split} top-1 (%)", 100 * top1 if is_number(top1) else top1, "{:.1f}")


def reference_rows(t: Table, folder: Path) -> None:
    """Our MAE and encoder steps against the references, eager and compiled."""
    refs, gap = bench_cases(t, folder / "bench_refs.json")
    for prefix, what, goal in (("mae-hf/", "MAE step / Hugging Face ViTMAE (eager)", 1.5), ("mae/", "MAE step / official-style MAE (eager)", None),
                               ("encoder/", "encoder step / timm ViT (eager)", 1.3)):  # fmt: skip
        c = _case(refs, prefix)
        t.add(f"{what}, {c['name'].split('/')[1]}" if c else what, c["ratio"] if c else gap, "{:.2f}x", goal, f">= {goal}x" if goal else "")
        if c and c.get("flops_per_image") and prefix != "mae/":
            t.add("  ours, TFLOP/s (matmul FLOPs x img/s)", c["flops_per_image"] * c["ours"]["median_images_per_s"] / 1e12, "{:.0f}")
    timm_compiled, gap = bench_cases(t, folder / "bench_timm_compiled.json")
    c = _case(timm_compiled, "encoder/")
    t.add("encoder step / torch.compile'd timm ViT", c["ratio"] if c else gap, "{:.2f}x")


def curve_rows(t: Table, folder: Path) -> None:
    """The loss curves against the eager one; written to curves.json and, with the defaults' curve, to curves.png."""
    cv, bad, damaged = read_curves(folder)
    for why in damaged.values():
        t.damage(why)
    for other, first, what in (("graph", None, "one CUDA graph / eager steps, loss"), ("auto", 20, "compiled and graphed / eager loss"),
                               ("auto", None, "compiled and graphed / eager loss")):  # fmt: skip
        if {"off", other} & damaged.keys():
            t.add(f"{what}, largest relative difference, {f'first {first}' if first else 'all'} steps", DAMAGED, "")
            continue
        difference, label = curve_difference(cv, first, other), f"{what}, largest relative difference, {compared(cv, other, first)}"
        if difference is not None and math.isnan(difference):
            t.text(label, "a loss compared is not finite (null in metrics.jsonl: a skipped step)")
        elif difference == math.inf:
            t.text(label, "infinite: an eager loss is 0 where the other is not")
        else:
            t.add(label, difference, "{:.2e}")
    for mode, n in bad.items():
        t.text(f"curve_{mode}: unreadable lines of its metrics, skipped", str(n))
    if cv:
        (folder / "curves.json").write_text(to_json(cv) + "\n")  # a NaN loss as null: json.dumps would write NaN, which is not JSON
    if cv.get("off") and cv.get("auto"):
        if not all(math.isfinite(a) and math.isfinite(b) and a != 0 for a, b in zip(cv["off"], cv["auto"])):  # the figure divides by them
            t.text("curves.png", "not drawn: a loss compared is not finite, or an eager loss is 0")
            return
        from vit.tools.plots import plot_compiled_vs_eager

        plot_compiled_vs_eager(cv["off"], cv["auto"], folder / "curves.png", "pretraining loss, eager and compiled")


def measured_on(folder: Path) -> list[str]:
    """Where each input was measured, as the bench JSON's `machine` and each stage's and curve's summary `host` record it, in one
    line; above it, a warning where they name more than one device, or a device that is no GPU: the table's figures
    are a GPU check's only when every input is of one GPU (a folder of an earlier check, or a CPU run, mixes in unsaid)."""
    found: dict[str, str] = {}  # input -> its device ("NVIDIA H100 80GB HBM3", or "cpu: <CPU model>")
    lines = []
    for path in sorted(folder.glob("bench_*.json")):
        try:
            machine = read_json(path).get("machine")
        except (UserError, OSError, AttributeError):  # not JSON, or not a mapping: its rows name it
            continue
        if isinstance(machine, dict):
            found[path.name] = str(machine.get("device_name") or f"{machine.get('device', '?')}: {machine.get('cpu', '?')}")
            lines.append(f"{path.name}: {found[path.name]}, torch {machine.get('torch', '?')}")
    for stage in ("pretrain", "finetune", *(f"curve_{mode}" for mode in CURVES)):  # the loss curves' rows are figures too
        try:
            summary = read_summary(folder / "runs" / stage) or {}
        except (UserError, OSError):
            continue
        host = summary.get("host") if isinstance(summary.get("host"), dict) else None
        if summary:
            found[f"runs/{stage}"] = str(host.get("gpu") or f"cpu: {host.get('cpu', '?')}") if host else "not recorded"
            lines.append(f"runs/{stage}: {host_label(host, summary.get('precision')) if host else 'host not recorded'}")
    devices = sorted(set(found.values()))
    warn = [f"**Not one GPU's figures**: the inputs name {len(devices)} devices ({'; '.join(devices)})"] if len(devices) > 1 else []
    warn += [f"**Not measured on a GPU**: {', '.join(k for k, d in found.items() if d.startswith('cpu'))}"] if any(
        d.startswith("cpu") for d in devices) else []  # fmt: skip
    return [*warn, f"Measured on: {'; '.join(lines)}"] if lines else []


def report(folder: str | Path) -> str:
    """The table, under where its inputs were measured (`measured_on`); a UserError when `folder` is not a folder (every
    row would read "not measured")."""
    folder, t = Path(folder), Table()
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder (the OUT of scripts/gpu_check.sh)")
    for rows in (pipeline_rows, stage_rows, reference_rows, curve_rows):
        rows(t, folder)
    where = measured_on(folder)
    return "\n".join([*where, ""] if where else []) + t.markdown()
