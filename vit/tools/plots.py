"""The matplotlib set-up every figure shares, and the figures of runs: training curves and accuracies (the views
inside an encoder: `vit.tools.views`). No torch import, so the table and comparison tools start at once.

    plt = pyplot()                                   # matplotlib on the Agg backend (no display needed)
    save(fig, path)                                  # PNG at DPI, figure closed
    png_path(Path("out/fig"))                        # out/fig.png: the file a figure is written to; a bad path is a UserError
    plot_curves({"run": curve}, "step", path, ...)   # one metric of several runs, overlaid
    equal_compute_plot(tables, path)                 # RESULTS.md's equal-compute figure, from `vit.tools.results` tables

A curve is anything with `steps`, `times` (None where not timed) and `values`, one entry per logged point.
`scripts/compare_runs.py` and `scripts/results_table.py` choose what to draw; this module draws it.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from vit.errors import UserError
from vit.store.atomic import nearest_existing

FIGSIZE = (10.0, 4.0)  # inches, of the curve and bar figures: FIGSIZE * DPI pixels
DPI = 100
XLABEL = {"step": "optimiser step", "time": "training time (s)"}


class Curve(Protocol):
    steps: list[float]
    times: list[float | None]
    values: list[float]


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    """Write `fig` as a PNG at DPI and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)  # no bbox_inches="tight": a figure keeps its set size in pixels
    pyplot().close(fig)
    return path


def check_output_folder(path: Path, what: str) -> None:
    """A UserError (one line) unless `path` is a folder, or one that can be made: no file on the way, a folder to write in."""
    p = nearest_existing(Path(path))
    if not p.is_dir():
        raise UserError(f"{what} {path}: {p} is a file, not a folder")
    if not os.access(p, os.W_OK | os.X_OK):
        raise UserError(f"{what} {path}: cannot write in {p}")


def check_output_file(path: Path, what: str, example: str, kind: str, ours: Callable[[bytes], bool]) -> None:
    """A UserError (one line) unless the file `path` can be written once a long run is over: not a folder, in a folder
    that is there or can be made, and not a file already there that `ours` does not recognise as `kind` (an earlier
    output of the same tool may be written over; anything else is left as it is)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder; name a file, e.g. {path / example}")
    check_output_folder(path.parent, what)
    if path.exists() and not ours(path.read_bytes()):
        raise UserError(f"{what} {path} exists and is not {kind}; it is left as it is")


def png_path(path: Path, what: str = "--plot") -> Path:
    """The PNG file a figure asked for at `path` is written to: `path` with .png added when it has no suffix; another
    suffix, or a folder on the way that is a file, is a UserError."""
    path = Path(path)
    if path.suffix.lower() not in ("", ".png"):
        raise UserError(f"{what} {path}: a figure is written as PNG; name a .png file")
    path = path if path.suffix else path.with_name(path.name + ".png")
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder; name a .png file")
    check_output_folder(path.parent, what)
    return path


def colours(names: Sequence[str]) -> dict[str, Any]:
    """One colour per name, so a run has the same colour in every figure."""
    cmap = pyplot().get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {name: cmap(i % cmap.N) for i, name in enumerate(names)}


def xy(curve: Curve, axis: str) -> tuple[list[float], list[float]]:
    """The points of a curve against 'step' or 'time' (points without a time are dropped)."""
    if axis == "step":
        return curve.steps, curve.values
    pts = [(t, v) for t, v in zip(curve.times, curve.values) if t is not None]
    return [t for t, _ in pts], [v for _, v in pts]


def finish(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


# --------------------------------------------------------------------------- training curves and accuracies


def plot_loss(panels: dict[str, dict[str, tuple[Curve, Curve]]], axis: str, path: Path, colour: dict) -> Path | None:
    """One panel per title, each {run: (training loss, validation loss)}: training solid, validation dashed with markers.

    None when there is no panel, or no point to draw on this axis (runs that logged no training time, against time).
    """
    if not any(xy(curve, axis)[0] for runs in panels.values() for pair in runs.values() for curve in pair):
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=FIGSIZE, squeeze=False)
    for ax, (title, runs) in zip(axes[0], panels.items()):
        for name, (train, val) in runs.items():
            x, y = xy(train, axis)
            if x:
                ax.plot(x, y, color=colour[name], label=name, linewidth=1.2)
            x, y = xy(val, axis)
            if x:
                ax.plot(x, y, color=colour[name], linestyle="--", marker="o", markersize=3, linewidth=1.0, label=f"{name} (val)")
        finish(ax, title, XLABEL[axis], "loss")
    fig.tight_layout()
    return save(fig, path)


def plot_curves(curves: dict[str, Curve], axis: str, path: Path, colour: dict, ylabel: str, title: str,
                percent: bool = False, log: bool = False) -> Path | None:  # fmt: skip
    """One metric of several runs ({run: curve}), overlaid; None when no curve has a point to draw."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    drawn = 0
    for name, curve in curves.items():
        x, y = xy(curve, axis)
        if log:
            x, y = [a for a, b in zip(x, y) if b > 0], [b for b in y if b > 0]
        if not x:
            continue
        y = [100 * v for v in y] if percent else y
        style = {"marker": "o", "markersize": 3} if len(x) < 30 else {}
        ax.plot(x, y, color=colour[name], label=name, linewidth=1.2, **style)
        drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    if log:
        ax.set_yscale("log")
    finish(ax, title, XLABEL[axis], ylabel)
    fig.tight_layout()
    return save(fig, path)


def plot_compiled_vs_eager(eager: list[float], compiled: list[float], path: Path, title: str) -> Path:
    """The training loss per step of the eager and the compiled step (the same data and masks), and their relative
    difference |compiled - eager| / eager on a log scale."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=FIGSIZE)
    steps = list(range(1, len(eager) + 1))
    left.plot(steps, eager, label="eager", linewidth=2.4, color="tab:blue")
    left.plot(steps[: len(compiled)], compiled, label="compiled", linewidth=1.0, linestyle="--", color="tab:orange")
    finish(left, title, "step", "training loss")
    diff = [abs(c - e) / abs(e) for e, c in zip(eager, compiled)]
    right.plot(steps[: len(diff)], [max(d, 1e-12) for d in diff], color="tab:red", linewidth=1.0, label="relative difference")
    right.set_yscale("log")
    finish(right, f"largest {max(diff):.1e} (equal steps drawn at 1e-12)", "step", "|compiled - eager| / eager")
    fig.tight_layout()
    return save(fig, path)


def plot_final_accuracy(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Grouped bars of final val top-1, best val top-1 and test top-1 (keys of each row, fractions) per row `name`."""
    bars = [("val_top1", "val top-1 (final)"), ("best_val_top1", "val top-1 (best)"), ("test_top1", "test top-1")]
    rows = [r for r in rows if any(r.get(k) is not None for k, _ in bars)]
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    width = 0.8 / len(bars)
    for i, (key, label) in enumerate(bars):
        xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(rows))]
        heights = [100 * r[key] if r.get(key) is not None else 0.0 for r in rows]
        drawn = ax.bar(xs, heights, width, label=label)
        for rect, r in zip(drawn, rows):
            if r.get(key) is not None:
                ax.annotate(
                    f"{100 * r[key]:.1f}", (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center", va="bottom", fontsize=7
                )
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=15 if len(rows) > 4 else 0, fontsize=8)
    ax.set_ylabel("top-1 accuracy (%)")
    ax.set_ylim(0, 105)
    ax.set_title("final accuracy", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save(fig, path)


def plot_accuracy_vs_pretraining(points: dict[str, dict[float, list[float]]], path: Path) -> Path | None:
    """Val top-1 against the encoder's pretraining minutes, {job type: {minutes: [top-1 per run]}}: mean, range over runs."""
    if not points:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    labels = {"linprobe": "linear probe (0 min: a random encoder)", "finetune": "full fine-tuning"}
    for stage, by_x in sorted(points.items()):
        xs = sorted(by_x)
        means = [100 * statistics.mean(by_x[x]) for x in xs]
        low = [m - 100 * min(by_x[x]) for m, x in zip(means, xs)]
        high = [100 * max(by_x[x]) - m for m, x in zip(means, xs)]
        ax.errorbar(xs, means, yerr=[low, high], marker="o", markersize=4, capsize=3, linewidth=1.2, label=labels[stage])
        for x, m in zip(xs, means):
            n = len(by_x[x])
            ax.annotate(f"{m:.1f}" + (f" (n={n})" if n > 1 else ""), (x, m), textcoords="offset points", xytext=(4, 4), fontsize=7)
    finish(ax, "accuracy against MAE pretraining length", "pretraining time of the encoder (min)", "val top-1 (%)")
    fig.tight_layout()
    return save(fig, path)


DATASET_TITLES = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100", "mnist": "MNIST", "fashionmnist": "Fashion-MNIST"}


def accuracy_label(tables: dict[str, tuple[list, dict]]) -> str:
    """The y-axis: 'CIFAR-10 test top-1 (%)', the title of the runs' dataset (their data.dataset names where several)."""
    arms = [arm for rows, randoms in tables.values() for arm in (*randoms.values(), *(a for r in rows for a in (r.scratch, r.mae, r.probe)))]
    names = sorted(set().union(*(arm.datasets for arm in arms)))
    return " ".join([" / ".join(DATASET_TITLES.get(name, f"data.dataset={name}") for name in names), "test top-1 (%)"]).strip()


def equal_compute_plot(tables: dict[str, tuple[list, dict]], path: Path) -> Path:
    """The equal-compute table's figure (`vit.tools.results`: {host: (rows, {tag: random-encoder probe arm})}): test top-1
    against the budget for each arm (mean over seeds, min-max bars), one line style per host; a random-encoder probe is a
    level line, named after its model where there are several."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    arms = (("ViT from scratch", lambda r: r.scratch, "o", "C0"), ("MAE then fine-tune", lambda r: r.mae, "s", "C1"),
            ("MAE linear probe", lambda r: r.probe, "^", "C2"))  # fmt: skip
    ticks = set()
    # One line style per host, as many as there are hosts: zip over four named styles dropped the fifth host unsaid
    styles = ["-", "--", ":", "-.", *((0, (1 + i, 1, 1, 1)) for i in range(1, len(tables)))]
    for (host, (rows, randoms)), line in zip(tables.items(), styles):
        suffix = f" ({host})" if len(tables) > 1 else ""
        for label, pick, marker, color in arms:
            pts = [(r.minutes, pick(r)) for r in rows if pick(r).test]
            if not pts:
                continue
            xs = [m for m, _ in pts]
            ys = [100 * a.mean() for _, a in pts]
            lo = [100 * (a.mean() - a.spread()[0]) for _, a in pts]
            hi = [100 * (a.spread()[1] - a.mean()) for _, a in pts]
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt=marker, linestyle=line, color=color, capsize=3, label=label + suffix)
            ticks.update(xs)
        for random in randoms.values():
            if n := len(random.test):
                model = f", {random.model}" if len(randoms) > 1 and random.model else ""
                ax.axhline(100 * random.mean(), color="grey", ls=line, label=f"random-encoder probe ({n} seed{'s' if n > 1 else ''}{model}){suffix}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
    ax.set_xlabel("minutes for all stages")
    ax.set_ylabel(accuracy_label(tables))
    title = "Equal compute: MAE against training from scratch"
    ax.set_title(title + (f"\n{next(iter(tables))}" if len(tables) == 1 else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    try:
        return save(fig, png_path(path))
    except OSError as e:
        raise UserError(f"cannot write the plot {e.filename or path}: {e.strerror}") from None
