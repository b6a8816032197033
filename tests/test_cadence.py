"""When a run evaluates (`finetune.eval_every`) and draws figures (`run.figure_every`), read from its run folder."""

import json
from pathlib import Path

import pytest
from PIL import Image

from finetune.train import main as finetune
from helpers import tiny_overrides
from pretrain.train import main as pretrain


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.slow
def test_val_metrics_are_logged_every_eval_every_epochs_and_after_the_last(tmp_path, cached):
    overrides = tiny_overrides(tmp_path, **{"schedule.epochs": 5, "finetune.eval_every": 2, "run.log_every": 100}) + [
        "finetune.mode=linear", "finetune.init=scratch", f"finetune.probe_cache={cached}", "optim.name=sgd", "optim.lr=0.1",
    ]  # fmt: skip
    assert finetune(overrides) == 0
    run_dir = tmp_path / "runs" / "run"
    evals = [m for m in metrics(run_dir) if "val_top1" in m]
    assert [m["epoch"] for m in evals] == [2, 4, 5]  # every 2nd epoch, and the last one whatever the cadence
    assert [m["step"] for m in evals] == [12, 24, 30]  # 6 steps an epoch
    assert all(set(m) >= {"val_top1", "val_top5", "val_loss"} for m in evals)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best_val_top1"] == max(m["val_top1"] for m in evals)
    # The final evaluation is of the weights the last epoch's evaluation saw: the same number.
    assert summary["final_val_top1"] == evals[-1]["val_top1"]


@pytest.mark.parametrize("figure_every, epochs, expected", [(2, 5, [2, 4]), (1, 2, [1, 2]), (0, 2, [])])
@pytest.mark.slow
def test_reconstruction_figures_are_drawn_every_figure_every_epochs(tmp_path, figure_every, epochs, expected):
    small = {"data.synthetic_size": 96, "data.val_size": 16, "optim.batch_size": 16, "mae.figure_images": 4}
    overrides = tiny_overrides(tmp_path, **{"schedule.epochs": epochs, "run.figure_every": figure_every, **small})
    assert pretrain(overrides) == 0
    run_dir = tmp_path / "runs" / "run"
    figures = sorted(p.name for p in (run_dir / "figures").glob("*")) if (run_dir / "figures").exists() else []
    assert figures == [f"reconstruction_epoch{e:04d}.png" for e in expected]
    # The final figure is drawn whatever the cadence; each figure is a real image.
    for path in [run_dir / "reconstruction.png"] + [run_dir / "figures" / f for f in figures]:
        with Image.open(path) as image:
            assert image.format == "PNG" and min(image.size) > 32, path


@pytest.mark.slow
def test_a_run_that_ends_mid_epoch_records_its_final_evaluation_on_the_curve(tmp_path):
    """A time budget (here schedule.max_steps) ends mid-epoch, where no epoch end evaluates: the final weights' val
    figures are still a point of the curve at the last step, count for the best, and are the kNN the summary reports."""
    cut = {"schedule.epochs": 2, "schedule.max_steps": 9, "run.log_every": 100}  # 6 steps an epoch: the cut is mid-epoch 2
    overrides = tiny_overrides(tmp_path, name="ft", **cut, **{"finetune.eval_every": 1})
    assert finetune(overrides + ["finetune.init=scratch", "optim.lr=0.01"]) == 0
    run_dir = tmp_path / "runs" / "ft"
    evals = [m for m in metrics(run_dir) if "val_top1" in m]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [m["step"] for m in evals] == [6, 9] and evals[-1]["epoch"] == 1.5
    assert summary["final_val_top1"] == evals[-1]["val_top1"] and summary["val_loss"] == evals[-1]["val_loss"]
    assert summary["best_val_top1"] == max(m["val_top1"] for m in evals)

    assert pretrain(tiny_overrides(tmp_path, name="mae", **cut, **{"mae.knn_every": 1, "mae.val_every": 1, "run.figure_every": 0})) == 0
    run_dir = tmp_path / "runs" / "mae"
    knn = [m for m in metrics(run_dir) if "knn_top1" in m]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [m["step"] for m in knn] == [6, 9] and knn[-1]["val_loss"] == summary["final_val_loss"]
    assert summary["final_knn_top1"] == knn[-1]["knn_top1"]


def test_the_last_epoch_ends_evaluation_is_the_final_one_not_run_again(tmp_path, monkeypatch):
    """The last epoch's end evaluates the final weights on val; the final evaluation ran the same pass again (a second
    val pass at every stage's end), and now takes its numbers. A run cut mid-epoch still evaluates at its last step."""
    import finetune.train as finetune_stage
    import pretrain.train as pretrain_stage

    passes = {"val_loss": 0, "evaluate": 0}
    val_loss, evaluate = pretrain_stage.validation_loss, finetune_stage.evaluate

    def counted(name, fn):
        def call(*args, **kwargs):
            passes[name] += 1
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(pretrain_stage, "validation_loss", counted("val_loss", val_loss))
    monkeypatch.setattr(finetune_stage, "evaluate", counted("evaluate", evaluate))
    assert pretrain(tiny_overrides(tmp_path, name="mae", **{"mae.val_every": 1, "mae.knn_every": 0, "run.figure_every": 0})) == 0
    summary = json.loads((tmp_path / "runs" / "mae" / "summary.json").read_text())
    assert passes["val_loss"] == 2 and summary["final_val_loss"] == [m for m in metrics(tmp_path / "runs" / "mae") if "val_loss" in m][-1]["val_loss"]
    assert finetune(tiny_overrides(tmp_path, name="ft", **{"finetune.eval_every": 1}) + ["finetune.init=scratch"]) == 0
    assert passes["evaluate"] == 2 + 1  # val at both epochs' ends, then test alone
    passes.update(val_loss=0, evaluate=0)
    cut = {"schedule.max_steps": 9, "run.figure_every": 0, "mae.knn_every": 0}  # 6 steps an epoch: mid-epoch 2
    assert pretrain(tiny_overrides(tmp_path, name="mae_cut", **cut)) == 0
    assert passes["val_loss"] == 1 + 1  # epoch 1's end, and the last step
