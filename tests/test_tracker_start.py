"""A run's trackers start once its stage is set up (`Run.ready`), not when the run starts (`Run.start`).

Started at `Run.start`, a run refused at set-up (an empty data folder, a val split larger than the data) had already made
a wandb run (offline: a `wandb/offline-run-*` folder holding only its config), which a user syncs later and sees as a
failed run with no data. What the stage tells the trackers before `ready` (the encoder it starts from, a metric, a figure)
waits for them. wandb runs offline (conftest) and is read back with its own reader, `wandb leet inspect`.
"""

import json
import subprocess
import sys

import accelerate
import pytest
from helpers import reset_accelerate, tiny_overrides

from finetune.config import FinetuneConfig
from finetune.train import main as finetune
from pretrain.train import main as pretrain
from vit.config import load_config
from vit.train import tracking
from vit.train.run import Run

WANDB = {"run.tracker": "wandb", "run.wandb_mode": "offline"}
SMALL = {"schedule.epochs": 1, "model.depth": 1, "data.synthetic_size": 64, "data.val_size": 10}


def stage_run(stage, tmp_path, **extra) -> int:
    small = {**SMALL, "mae.knn_every": 0} if stage is pretrain else SMALL
    try:
        return stage(tiny_overrides(tmp_path, **{**WANDB, **small, **extra}))
    finally:
        reset_accelerate()


def wandb_folders(tmp_path) -> list:
    return sorted((tmp_path / "runs" / "wandb").glob("offline-run-*"))


@pytest.mark.parametrize(
    ("stage", "extra", "said"),
    [
        (pretrain, {"data.dataset": "folder", "data.root": "{empty}"}, "holds no image files"),
        (finetune, {"finetune.init": "scratch", "data.val_size": 10000}, "data.val_size=10000"),
        (finetune, {"finetune.init": "scratch", "finetune.mode": "knn", "data.dataset": "folder", "data.root": "{empty}"}, "holds no image files"),
    ],
    ids=["pretrain-empty-folder", "finetune-val-too-large", "knn-empty-folder"],
)
def test_a_run_refused_at_set_up_leaves_no_tracker_run(tmp_path, capsys, stage, extra, said):
    (tmp_path / "empty").mkdir()
    extra = {k: v.format(empty=tmp_path / "empty") if isinstance(v, str) else v for k, v in extra.items()}
    assert stage_run(stage, tmp_path, **extra) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and said in errors[0]
    assert not (tmp_path / "runs" / "wandb").exists()  # no wandb run, not even an empty wandb folder


def test_a_run_set_up_after_a_refused_one_is_the_one_wandb_run_with_its_config_and_metrics(tmp_path, capsys):
    """The user fixes the data and starts the run again: wandb holds that run alone, not an empty one beside it."""
    (tmp_path / "empty").mkdir()
    assert stage_run(pretrain, tmp_path, **{"data.dataset": "folder", "data.root": tmp_path / "empty"}) == 2
    assert stage_run(pretrain, tmp_path) == 0
    capsys.readouterr()
    [folder] = wandb_folders(tmp_path)
    summary = json.loads((tmp_path / "runs" / "run" / "summary.json").read_text())
    assert summary["wandb_run"] == str(folder)
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(folder)], capture_output=True, text=True,
                         timeout=120, check=True).stdout  # fmt: skip
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert next(r["run"] for r in records if r["type"] == "run")["run_id"] == summary["run_id"]
    config = {k: v for r in records if r["type"] == "config" for k, v in r["config"]["update"].items()}
    assert config["run.name"] == "run" and config["meta.run_id"] == summary["run_id"]
    logged = [json.loads(line) for line in (tmp_path / "runs" / "run" / "metrics.jsonl").read_text().splitlines()]
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [(h["_step"], h["loss"]) for h in history if "loss" in h] == [(m["step"], m["loss"]) for m in logged if "loss" in m] != []


def test_what_the_stage_tells_the_trackers_before_they_start_reaches_them_once_they_do(tmp_path, monkeypatch):
    """A fresh run (not only one that replaces another): the encoder it starts from, a metric, a figure and a table told
    before `ready` are sent once, after the trackers start there; a second `ready` (the training loop calls it again)
    starts nothing and sends nothing again."""
    sent = []
    monkeypatch.setattr(accelerate.Accelerator, "init_trackers", lambda self, project, config=None, init_kwargs=None: sent.append("start"))
    monkeypatch.setattr(accelerate.Accelerator, "log", lambda self, values, step=None, log_kwargs=None: sent.append(("log", step, values)))
    monkeypatch.setattr(tracking, "wandb_run", lambda accelerator: "the wandb run")
    monkeypatch.setattr(tracking, "use_encoder", lambda wrun, path: sent.append(("use", wrun, path.name)))
    monkeypatch.setattr(tracking, "log_images", lambda wrun, images, step: sent.append(("images", wrun, step)))
    monkeypatch.setattr(tracking, "log_table", lambda wrun, name, columns, rows: sent.append(("table", wrun, name)))
    cfg = load_config(FinetuneConfig, None, tiny_overrides(tmp_path, **WANDB))
    run = Run.start(cfg, stage="finetune")
    try:
        run.use_encoder(tmp_path / "encoder.pt")
        run.log({"step": 0, "val_top1": 0.5, "note": "text"})
        run.log_images({"confusion_val": tmp_path / "confusion.png"}, step=0)
        run.log_table("per_class_val", ["class", "accuracy"], [["a", 1.0]])
        assert sent == []  # no tracker yet
        run.ready()
        assert sent == ["start", ("use", "the wandb run", "encoder.pt"), ("log", 0, {"step": 0, "val_top1": 0.5}),
                        ("images", "the wandb run", 0), ("table", "the wandb run", "per_class_val")]  # fmt: skip
        run.ready()
        run.log({"step": 1, "val_top1": 0.75})
        assert sent[5:] == [("log", 1, {"step": 1, "val_top1": 0.75})]
    finally:
        run.lock.release()
