"""Comparing runs from their folders alone: table rows, the markdown table, the CSV, the figures and report.md.

    result = compare(["runs/mae", "runs/ft"], out=Path("report"), csv_path=Path("report/runs.csv"))
    print(result["table"])                           # also result["rows"], ["figures"], ["report"], ["csv"]

Runs are found and their curves read by `vit.tools.reading`, through `vit.store.runs` (`RunFolder`: config, summary,
metric records; a run without a summary is unfinished and shows what its metrics hold so far); figures are drawn by
`vit.tools.plots`.
No tracker, no network. `scripts/compare_runs.py` is its command line.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Callable

from vit.errors import UserError
from vit.store.lineage import PARENT_RUN_ID, RUN_ID, parent_changed
from vit.store.runs import CLASSIFICATION, CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, RunFolder, is_run_folder
from vit.store.values import is_finite
from vit.tools import plots
from vit.tools.reading import Series, drop_out_of_range, last_value, load_runs, mistyped_host_field, series
from vit.tools.records import host_label

REPORT_FILE = "report.md"  # in the report folder, beside the figures
REPORT_TITLE = "# Run comparison\n"  # how the report.md this module writes begins: the only one --out may replace
CSV_HEADER = "name,status,"  # how the CSVs this module writes begin: the only existing files --csv may replace

# --------------------------------------------------------------------------- the table


def short_run(ref: str | None) -> str | None:
    """A run reference (folder, encoder.pt or classifier.pt path) as its run folder's name."""
    if not ref:
        return None
    if ref == "scratch" or ref.startswith("timm:"):
        return ref
    path = Path(ref)
    return path.parent.name if path.suffix in (".pt", ".pth", ".safetensors") else path.name


def model_label(run: RunFolder) -> str | None:
    """The preset name plus the architecture fields the run's config overrode, e.g. `vit_cifar_tiny depth=1` (`timm ...` for timm's ViT)."""
    s = run.summary or {}
    model_cfg = run.config.get("model") or {}
    name = s.get("model") or model_cfg.get("name")
    if name is None or name == "resnet18":
        return name
    if s.get("arch") == "timm_vit":
        name = f"timm {name}"  # the baseline that runs timm's ViT code on the same configuration
    changed = [
        f"{k}={model_cfg[k]}"
        for k in ("img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio")
        if model_cfg.get(k) is not None
    ]
    if any(p.startswith(CONFIG_FILE) for p in run.problems):
        changed.append("(config unreadable: overrides unknown)")
    return " ".join([name, *changed])


def host_text(info: dict | None) -> str | None:
    """'NVIDIA H100 80GB HBM3; AMD EPYC 9R14 (avx2 avx512f), 16 cores': the GPU if any, then the CPU (None: not recorded)."""
    if not info:
        return None
    cpu = host_label({k: v for k, v in info.items() if k != "gpu"})
    return f"{info['gpu']}; {cpu}" if info.get("gpu") else cpu


def first(*values):
    return next((v for v in values if v is not None), None)


NUMBER_KEYS = ("epochs", "steps", "wall_time_sec", "feature_images_per_sec", "images_per_sec", "processes", "final_loss",
               "final_val_loss", "val_loss", "final_val_top1", "val_top1", "best_val_top1", "final_test_top1", "test_top1",
               "final_knn_top1", "trained_weights_val_top1")  # fmt: skip
TEXT_KEYS = ("stage", "job_type", "model", "arch", "init", "parent", "precision")
CONFIG_SECTIONS = ("model", "data", "run", "finetune", "meta")


def drop_mistyped(run: RunFolder) -> None:
    """Drop the values of summary.json and config.yaml that the table reads and that are not of their type (a hand edit,
    another tool's file), and name them in `run.problems`: a damaged run is a flagged row, not a traceback."""

    def fits(value: Any, kind: Any) -> bool:
        return value is None or (isinstance(value, kind) and not isinstance(value, bool))

    def drop(values: dict[str, Any], kinds: dict[str, Any], label: str) -> list[str]:
        wrong = [k for k, kind in kinds.items() if not fits(values.get(k), kind)]
        for key in wrong:
            del values[key]
        return [f"{label}{key}" for key in wrong]

    bad = drop(run.config, dict.fromkeys(CONFIG_SECTIONS, dict), f"{CONFIG_FILE} ")
    for section, key in (("model", "name"), ("finetune", "init"), ("run", "precision"), ("data", "dataset")):
        bad += drop(run.config.get(section) or {}, {key: str}, f"{CONFIG_FILE} {section}.")
    bad += drop(run.config.get("finetune") or {}, {"ema_decay": (int, float)}, f"{CONFIG_FILE} finetune.")
    bad += drop(run.meta, dict.fromkeys(TEXT_KEYS, str), f"{CONFIG_FILE} meta.")
    kinds = {"host": dict, "data": dict, **dict.fromkeys(NUMBER_KEYS, (int, float)), **dict.fromkeys(TEXT_KEYS, str)}
    bad += drop(run.summary or {}, kinds, f"{SUMMARY_FILE} ")
    host = (run.summary or {}).get("host")
    if host and mistyped_host_field(host):
        del run.summary["host"]  # a machine made up from parts that are not what was recorded ("a v x 2") would be another host
        bad.append(f"{SUMMARY_FILE} host")
    if bad:
        run.problems.append(f"not of the expected type, left out: {', '.join(bad)}")
    drop_out_of_range(run, NUMBER_KEYS)


def weight_average_decay(config: dict) -> float | None:
    """The decay of the weight average whose weights a classification run evaluated and saved (`finetune.ema_decay`, read by
    full fine-tuning only), from its config.yaml; None where it trained none: its val and test top-1 are its trained weights'."""
    ft = config.get("finetune") if isinstance(config.get("finetune"), dict) else {}
    decay = ft.get("ema_decay") if ft.get("mode") == "full" else None
    return decay if isinstance(decay, (int, float)) and not isinstance(decay, bool) else None


def row(run: RunFolder) -> dict[str, Any]:
    """Raw values of one run for the table and the CSV; None where the run does not have the value."""
    drop_mistyped(run)
    s = run.summary or {}
    meta = run.meta
    data = s.get("data") or {}
    run_cfg = run.config.get("run") or {}
    last = run.metrics[-1] if run.metrics else {}
    val_top1 = series(run, "val_top1").values
    init = (s.get("init") or (run.config.get("finetune") or {}).get("init")) if run.group == CLASSIFICATION else None
    parent = s.get("parent") or meta.get("parent")
    init_label = short_run(init)
    if parent and short_run(parent) != init_label:
        init_label = f"{init_label} ({short_run(parent)})" if init_label else short_run(parent)
    values = {
        "name": run.name,
        "status": None,  # below: the values name what they leave out
        "host": host_text(s.get("host")),
        "stage": run.stage,
        "init": init_label,
        "model": model_label(run),
        # the epochs trained, a budget's last one in part (0.31, not the 0 whole ones summary.json counts): its records' last
        "epochs": first(last_value(run, "epoch"), s.get("epochs")),
        "steps": first(s.get("steps"), last.get("step")),
        "wall_time_sec": first(s.get("wall_time_sec"), last_value(run, "time")),
        # A cached probe's (or kNN's) cost is its frozen encoder's rate over the images; RESULTS.md quotes that one, not the head's.
        "images_per_sec": first(s.get("feature_images_per_sec"), s.get("images_per_sec")),
        "precision": first(s.get("precision"), run_cfg.get("precision")),
        "processes": first(s.get("processes"), meta.get("processes")),
        "final_loss": first(s.get("final_loss"), last_value(run, "loss")),
        "val_loss": first(s.get("final_val_loss"), s.get("val_loss"), last_value(run, "val_loss")),
        "val_top1": first(s.get("final_val_top1"), s.get("val_top1"), val_top1[-1] if val_top1 else None),
        "best_val_top1": first(s.get("best_val_top1"), max(val_top1) if val_top1 else None),
        "test_top1": first(s.get("final_test_top1"), s.get("test_top1")),
        # a weight average's run: its val and test top-1 are the average's, beside its trained weights' own val top-1
        "ema_decay": weight_average_decay(run.config) if run.group == CLASSIFICATION else None,
        "trained_val_top1": s.get("trained_weights_val_top1"),
        "knn_top1": first(s.get("final_knn_top1"), last_value(run, "knn_top1")),
        "dataset": data.get("dataset") or (run.config.get("data") or {}).get("dataset"),
        "train_images": data.get("train"),
        "val_images": data.get("val"),
        "test_images": data.get("test"),
        "seed": first(s.get("seed"), meta.get("seed")),
        "device": first(s.get("device"), meta.get("device")),
        "git_commit": first(s.get("git_commit"), meta.get("git_commit")),
        "parent": parent,
        "command": meta.get("command"),
        "path": str(run.path),
        "warnings": "; ".join(w for w in as_list(s.get("warnings")) if isinstance(w, str)) or None,  # what the run warned of
    }
    values["status"] = "; ".join(["finished" if run.finished else "unfinished", *run.problems])
    return values


def as_list(value: Any) -> list:
    return value if isinstance(value, list) else []


def fmt_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def fmt_percent(x: float) -> str:
    return f"{100 * x:.1f}%"


def fmt_number(x: float) -> str:
    return f"{x:g}" if isinstance(x, int) or float(x).is_integer() else f"{x:.2f}"


# (row key, header, formatter) of the markdown table; the CSV has every key of `row`.
COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("name", "run", str),
    ("stage", "stage", str),
    ("init", "init (parent)", str),
    ("model", "model", str),
    ("epochs", "epochs", fmt_number),
    ("wall_time_sec", "wall time", fmt_duration),
    ("images_per_sec", "img/s", lambda x: f"{x:.0f}"),
    ("precision", "precision", str),
    ("processes", "procs", str),
    ("final_loss", "loss", lambda x: f"{x:.4f}"),
    ("val_loss", "val loss", lambda x: f"{x:.4f}"),
    ("val_top1", "val top-1", fmt_percent),
    ("best_val_top1", "best val top-1", fmt_percent),
    ("test_top1", "test top-1", fmt_percent),
    ("knn_top1", "kNN top-1", fmt_percent),
]


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def host_keys(rows: list[dict[str, Any]]) -> dict[str, str]:
    """{host: 'A', ...} when the finished runs span more than one host (one that recorded none counts as another), else {}:
    speeds of two machines must not sit side by side unmarked."""
    hosts = list(dict.fromkeys(r["host"] or "host not recorded" for r in rows if r["status"].startswith("finished")))
    return {h: chr(ord("A") + i) if i < 26 else str(i) for i, h in enumerate(hosts)} if len(hosts) > 1 else {}


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The table of the runs; a column of host keys (and their legend under it) when the runs span several hosts."""
    keys = host_keys(rows)
    columns = COLUMNS[:1] + [("host", "host", lambda h: keys.get(h, "?"))] + COLUMNS[1:] if keys else COLUMNS
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            value = r.get(key)
            if key == "host" and value is None and r["status"].startswith("finished"):
                value = "host not recorded"
            if isinstance(value, float) and not math.isfinite(value):  # an older summary's NaN: said, not formatted as a number
                text = str(value)
            else:
                text = "-" if value is None else fmt(value)
            if key in ("val_top1", "test_top1") and value is not None and r.get("ema_decay") is not None:
                text += averaged(r, key)
            if key == "name" and not r["status"].startswith("finished"):
                text += " (unfinished)"
            elif key == "name" and "; " in r["status"]:  # finished, but a file of it is damaged: its row may be wrong
                text += f" ({r['status'].split('; ', 1)[1]})"
            cells.append(cell(text))
        lines.append("| " + " | ".join(cells) + " |")
    legend = [f"host {k}: {h}" for h, k in keys.items()]
    if any(r.get("ema_decay") is not None for r in rows):
        legend.append("EMA d: the val and test top-1 of a run with finetune.ema_decay=d are its weight average's; "
                      "trained: its trained weights' own val top-1")  # fmt: skip
    # "unfinished" alone would hide a run whose summary (or config) does not read: one that crashed while writing it, or
    # was damaged after it finished. A cut-off last line of metrics.jsonl is what a run being written looks like.
    damaged = [f"{r['name']} (unfinished): {'; '.join(why)}" for r in rows if not r["status"].startswith("finished")
               and (why := [p for p in r["status"].split("; ")[1:] if not p.endswith(f"line(s) in {METRICS_FILE}")])]  # fmt: skip
    return "\n".join(lines + ([""] + legend if legend else []) + ([""] + damaged if damaged else []))


def averaged(r: dict[str, Any], key: str) -> str:
    """' (EMA 0.9998; trained 71.2%)' after a weight average's val top-1, ' (EMA 0.9998)' after its test top-1."""
    trained = r.get("trained_val_top1") if key == "val_top1" else None
    return f" (EMA {r['ema_decay']:g}" + (f"; trained {fmt_percent(trained)})" if is_finite(trained) else ")")


def check_outputs(out: Path | None, csv_path: Path | None) -> None:
    """Refuse, in one line and before any work, outputs that cannot be written or would overwrite what is not ours: a
    --csv that is a folder, lies in a run folder, or exists without being a CSV this module wrote; an --out that is a
    file or a run folder (or lies in one)."""
    for path, what in ((csv_path, "--csv"), (out, "--out")):
        if path is not None and (inside := next((p for p in [path, *path.absolute().parents] if is_run_folder(p)), None)):
            raise UserError(f"{what} {path} {'is' if inside == path else 'is inside'} the run folder {inside}; write it elsewhere")
    if out is not None:
        plots.check_output_folder(out, "--out")
        report = out / REPORT_FILE
        if report.is_dir() or report.exists() and not report.read_bytes().startswith(REPORT_TITLE.encode()):
            raise UserError(
                f"--out {out} holds a {REPORT_FILE} that compare_runs.py did not write; it is left as it is (choose another --out)"
            )
    if csv_path is None:
        return
    if csv_path.is_dir():
        raise UserError(f"--csv {csv_path} is a folder; name a file, e.g. {csv_path / 'runs.csv'}")
    plots.check_output_folder(csv_path.parent, "--csv")
    if csv_path.exists():
        with open(csv_path, errors="replace") as f:
            ours = csv_path.suffix == ".csv" and f.readline().startswith(CSV_HEADER)
        if not ours:
            raise UserError(f"--csv {csv_path} exists and is not a CSV that compare_runs.py wrote; it is left as it is")


def write_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


# --------------------------------------------------------------------------- figures (drawn by vit.tools.plots)

LOSS_TITLES = {"pretrain": "MAE pretraining: masked-patch loss", CLASSIFICATION: "classification: cross-entropy"}


def loss_panels(runs: list[RunFolder]) -> dict[str, dict[str, tuple[Series, Series]]]:
    """{panel title: {run: (loss, val_loss)}}: a panel for MAE runs and one for classifiers, where a run of it logged a loss."""
    groups = [g for g in ("pretrain", CLASSIFICATION) if any(r.group == g and series(r, "loss").values for r in runs)]
    return {LOSS_TITLES[g]: {r.name: (series(r, "loss"), series(r, "val_loss")) for r in runs if r.group == g} for g in groups}


def pretraining_points(runs: list[RunFolder], rows: list[dict[str, Any]]) -> dict[str, dict[float, list[float]]]:
    """Final val top-1 of the probes and fine-tunes, keyed by the pretraining time (minutes) of the encoder they start from.

    Returns {job type: {minutes: [val top-1 of each run, e.g. one per seed]}}. The parent must be one
    of the finished pretraining runs given; a linear probe of a random encoder (init scratch) is the
    point at 0 minutes. A run whose parent folder holds another training now (its run id differs) is left out: its
    encoder's minutes are not known.
    """
    pretraining = {r.name: r for r in runs if r.group == "pretrain" and r.finished and r.summary.get("wall_time_sec") is not None}
    by_name = {r.name: r for r in runs}
    points: dict[str, dict[float, list[float]]] = {}
    for r in rows:
        if r["stage"] not in ("linprobe", "finetune") or r["val_top1"] is None or not r["status"].startswith("finished"):
            continue
        parent = pretraining.get(short_run(r["parent"]))
        recorded = by_name[r["name"]].meta.get(PARENT_RUN_ID) if r["name"] in by_name else None
        if parent is not None and not parent_changed(recorded, parent.meta.get(RUN_ID)):
            x = parent.summary["wall_time_sec"] / 60
        elif r["stage"] == "linprobe" and r["init"] == "scratch":
            x = 0.0
        else:
            continue
        points.setdefault(r["stage"], {}).setdefault(x, []).append(r["val_top1"])
    return points


FIGURES = [  # file stem, title in report.md
    ("loss_by_step", "Loss against step"),
    ("loss_by_time", "Loss against training time"),
    ("accuracy_by_step", "Validation accuracy against step"),
    ("accuracy_by_time", "Validation accuracy against training time"),
    ("knn_by_step", "kNN top-1 of the encoder during pretraining, against step"),
    ("knn_by_time", "kNN top-1 of the encoder during pretraining, against training time"),
    ("lr_by_step", "Learning rate against step"),
    ("lr_by_time", "Learning rate against training time"),
    ("final_accuracy", "Final accuracy"),
    ("accuracy_vs_pretraining", "Accuracy against the pretraining length of the encoder"),
]


def make_figures(runs: list[RunFolder], rows: list[dict[str, Any]], out: Path) -> dict[str, Path | None]:
    """Every figure of FIGURES written into `out`; None for one no run has data for."""
    colour = plots.colours([r.name for r in runs])
    figures: dict[str, Path | None] = {}
    losses = loss_panels(runs)
    accuracy = {r.name: series(r, "val_top1") for r in runs}
    knn = {r.name: series(r, "knn_top1") for r in runs}
    lr = {r.name: series(r, "lr") for r in runs}
    for axis in ("step", "time"):
        figures[f"loss_by_{axis}"] = plots.plot_loss(losses, axis, out / f"loss_by_{axis}.png", colour)
        figures[f"accuracy_by_{axis}"] = plots.plot_curves(accuracy, axis, out / f"accuracy_by_{axis}.png", colour,
                                                           "val top-1 (%)", "validation top-1 accuracy", percent=True)  # fmt: skip
        figures[f"knn_by_{axis}"] = plots.plot_curves(knn, axis, out / f"knn_by_{axis}.png", colour, "val kNN top-1 (%)",
                                                      "pretraining: weighted kNN top-1 on val images", percent=True)  # fmt: skip
        figures[f"lr_by_{axis}"] = plots.plot_curves(lr, axis, out / f"lr_by_{axis}.png", colour,
                                                     "learning rate", "learning rate (log scale)", log=True)  # fmt: skip
    figures["final_accuracy"] = plots.plot_final_accuracy(rows, out / "final_accuracy.png")
    points = pretraining_points(runs, rows)
    figures["accuracy_vs_pretraining"] = plots.plot_accuracy_vs_pretraining(points, out / "accuracy_vs_pretraining.png")
    return figures


# --------------------------------------------------------------------------- report


def report_markdown(rows: list[dict[str, Any]], figures: dict[str, Path | None], command: str) -> str:
    unfinished = sum(not r["status"].startswith("finished") for r in rows)
    lines = [
        REPORT_TITLE.rstrip("\n"),
        "",
        f"Made by `{command}` from {len(rows)} run folder(s)" + (f", {unfinished} of them unfinished." if unfinished else "."),
        "Wall time and images/s count training only (no evaluation, no start-up); accuracies are top-1 on the splits below.",
        "",
        markdown_table(rows),
        "",
        "## Figures",
        "",
    ]
    for stem, title in FIGURES:
        path = figures.get(stem)
        lines.append(f"### {title}\n\n![{title}]({path.name})\n" if path else f"### {title}\n\nNo run logged the data for this figure.\n")
    lines += [
        "## Runs",
        "",
        "| run | folder | data (train / val / test) | seed | device | host | git commit | command |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        split = " / ".join("-" if r[k] is None else str(r[k]) for k in ("train_images", "val_images", "test_images"))
        data = f"{r['dataset'] or '?'} {split}"
        command = f"`{r['command']}`" if r["command"] else "-"
        lines.append(
            "| "
            + " | ".join(
                cell(str(x if x is not None else "-"))
                for x in (r["name"], r["path"], data, r["seed"], r["device"], r["host"], r["git_commit"], command)
            )
            + " |"
        )
    warned = [f"- {r['name']}: {cell(r['warnings'])}" for r in rows if r["warnings"]]
    if warned:  # what qualifies a number above (a learning rate that never peaked, a budget run over): said where it is read
        lines += ["", "## Warnings the runs gave", "", *warned]
    problems = [f"- {r['name']}: {r['status']}" for r in rows if not r["status"].startswith("finished") or ";" in r["status"]]
    if problems:
        lines += ["", "## Unfinished or damaged runs", "", *problems]
    return "\n".join(lines) + "\n"


def compare(paths: list[str], out: Path | None = None, csv_path: Path | None = None, patterns: list[str] | None = None,
            command: str = "compare_runs.py") -> dict[str, Any]:  # fmt: skip
    """Read the runs, and write the CSV, the figures and report.md where asked. Returns {"runs", "rows", "table", "figures", "report",
    "csv"}.

    `command` is the command line quoted at the top of report.md.
    """
    check_outputs(out, csv_path)
    runs = load_runs(paths, patterns)
    rows = [row(r) for r in runs]
    table = markdown_table(rows)
    result: dict[str, Any] = {"runs": runs, "rows": rows, "table": table, "figures": {}, "report": None, "csv": None}
    try:
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)  # first: a folder that cannot be made stops it before anything is written
        if csv_path is not None:
            result["csv"] = write_csv(rows, csv_path)
        if out is not None:
            result["figures"] = make_figures(runs, rows, out)
            result["report"] = out / REPORT_FILE
            result["report"].write_text(report_markdown(rows, result["figures"], command))
    except OSError as e:
        raise UserError(f"cannot write {e.filename or out or csv_path}: {e.strerror}") from None
    return result
