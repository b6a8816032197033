"""Hostile round 13: a shard run resumed with another val split, seeds of one table row that ran other recipes, and
impossible values in model cards and comparisons."""

import json
import shutil
import tempfile

import pytest
import yaml
from helpers import image_tree, reset_accelerate, tiny_overrides
from test_hostile_export import encoder_run
from test_hostile_gpu_report import curve, write
from test_hostile_results_r8 import table
from test_hostile_tables import compare_run, sweep_run, thirty_minute_row
from test_stream import write_shards

from finetune.config import FinetuneConfig
from finetune.train import main as finetune
from pretrain.config import PretrainConfig
from pretrain.export import main as export_encoder
from pretrain.train import main as pretrain
from vit.config.loading import load_config
from vit.errors import ConfigError, UserError
from vit.store.lock import _release_at_exit
from vit.store.runs import LOCK_FILE
from vit.tools import compare
from vit.tools.gpu_report import report


def test_a_shard_run_resumed_with_val_shards_of_its_own_is_refused_where_its_val_samples_would_train(tmp_path, capsys):
    """Shards hash as one set: a run that held out the first samples of its last shard as val, resumed with
    data.val_root naming val shards, went on training on those held-out samples (56 training images became 64)."""
    train = write_shards(tmp_path / "shards", 4, 16, size=(16, 16))
    val = write_shards(tmp_path / "vshards", 1, 16, size=(16, 16), seed=5, prefix="val")
    data = {"data.dataset": "webdataset", "data.loader": "stream", "data.workers": 0, "data.val_size": 8, "data.root": train,
            "model.img_size": 16, "optim.batch_size": 8, "mae.knn_every": 0, "mae.figure_images": 0, "run.save_every": 1}  # fmt: skip
    assert pretrain(tiny_overrides(tmp_path, name="src", **data, **{"schedule.max_steps": 2})) == 0
    reset_accelerate()
    run_dir = tmp_path / "runs" / "src"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != LOCK_FILE}
    capsys.readouterr()
    resumed = {**data, "data.val_root": val, "schedule.max_steps": 4, "run.resume": "auto"}
    assert pretrain(tiny_overrides(tmp_path, name="src", **resumed)) == 2
    reset_accelerate()
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "trained on 56 of its images" in err[0] and "leave 64" in err[0] and f"data.val_root None -> {val}" in err[0]
    ), err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != LOCK_FILE} == before
    # val shards of another place (the same training samples) may change, as a moved data.root may
    other = write_shards(tmp_path / "vshards2", 1, 16, size=(16, 16), seed=6, prefix="val")
    assert pretrain(tiny_overrides(tmp_path, name="both", **{**data, "data.val_root": val, "schedule.max_steps": 2})) == 0
    reset_accelerate()
    assert pretrain(tiny_overrides(tmp_path, name="both", **{**data, "data.val_root": other, "schedule.max_steps": 3,
                                                             "run.resume": "auto"})) == 0  # fmt: skip
    assert json.loads((tmp_path / "runs" / "both" / "summary.json").read_text())["steps"] == 3


def pretraining_config(lr, mask_ratio, seed):
    return {"schedule": {"budget_minutes": 15}, "mae": {"mask_ratio": mask_ratio}, "optim": {"lr": lr}, "run": {"seed": seed}}


@pytest.mark.parametrize("probe", [False, True], ids=["fine-tune", "probe"])
def test_seeds_whose_pretrainings_ran_other_recipes_are_refused_not_averaged(tmp_path, probe):
    """The MAE and probe columns compared the seeds' fine-tune or probe settings alone: a seed 1 pretrained at mask ratio
    0.3 and a learning rate of 0.1 was averaged with seed 0 as '2 seeds' of one recipe."""
    sweep = thirty_minute_row(tmp_path / "budget")
    (sweep / "mae_15min_s0" / "config.yaml").write_text(yaml.safe_dump(pretraining_config(1e-3, 0.75, 0)))
    sweep_run(sweep, "scratch_m30_s1", 0.60, 0.61, 1790, budget=30)
    sweep_run(sweep, "mae_15min_s1", None, None, 900, config={**pretraining_config(1e-3, 0.75, 1), "run": {"seed": 1, "device": "cuda"}})
    sweep_run(sweep, "ft_m30_f50_s1", 0.70, 0.90, 900, budget=15, init="runs/budget/mae_15min_s1")
    sweep_run(sweep, "mae_15min_s1_probe", 0.40, 0.90, 180, init="runs/budget/mae_15min_s1")
    (rows, _), _ = table(sweep)  # where the seed's pretraining ran and its seed may differ
    assert (rows[0].probe if probe else rows[0].mae).test == ({0: 0.41, 1: 0.90} if probe else {0: 0.71, 1: 0.90})
    (sweep / "mae_15min_s1" / "config.yaml").write_text(yaml.safe_dump(pretraining_config(0.1, 0.3, 1)))
    if probe:  # the fine-tunes come first; without seed 1's the probes meet the pretraining first
        shutil.rmtree(sweep / "ft_m30_f50_s1")
    with pytest.raises(UserError) as e:
        table(sweep)
    assert "mae_15min_s1 ran other settings than the pretrainings of the seeds before it of its recipe (mae.mask_ratio 0.75 -> 0.3, " \
           "optim.lr 0.001 -> 0.1)" in str(e.value)  # fmt: skip


def test_a_seed_stopped_by_max_steps_before_its_budget_s_plan_is_left_out_and_named(tmp_path):
    """schedule.max_steps was among what a seed may run otherwise: a 3-step, 10-second seed went into the mean as a
    30-minute one (78.0%, 61.0-95.0, 2 seeds)."""
    sweep = thirty_minute_row(tmp_path / "budget")
    path = sweep_run(sweep, "scratch_m30_s1", 0.94, 0.95, config={"schedule": {"budget_minutes": 30, "max_steps": 3}})
    (path / "summary.json").write_text(json.dumps({"val_top1": 0.94, "test_top1": 0.95, "steps": 3,
                                                   "budget": {"stage_seconds": 10, "total_steps": 900}}))  # fmt: skip
    (rows, _), unfinished = table(sweep)
    why = "summary.json steps is 3 of the 900 its time budget planned (stopped by schedule.max_steps; run.resume=auto finishes it)"
    assert unfinished == {"scratch_m30_s1": why} and rows[0].scratch.test == {0: 0.61}
    rewrite = json.loads((sweep / "scratch_m30_s1" / "summary.json").read_text())
    (sweep / "scratch_m30_s1" / "summary.json").write_text(
        json.dumps({**rewrite, "steps": 900, "budget": {"stage_seconds": 1790, "total_steps": 900}})
    )
    (rows, _), unfinished = table(sweep)  # finished by a resume without it: its config.yaml keeps the first process's max_steps
    assert unfinished == {} and rows[0].scratch.test == {0: 0.61, 1: 0.95}


def test_a_model_card_leaves_out_accuracies_and_times_no_run_writes(tmp_path):
    """A fine-tune beside the encoder whose summary.json was edited to a val top-1 of 1.7, a test top-1 of -0.4 and a wall
    time of -50 s: the card's model-index said 170.0 and -40.0, and its table '-50 s | 170.0% | -40.0%'."""
    run = encoder_run(tmp_path / "runs" / "mae", summary={"epochs": 1, "wall_time_sec": -5, "data": {"train": -100, "val": 8}})
    (tmp_path / "runs" / "ft").mkdir()
    (tmp_path / "runs" / "ft" / "config.yaml").write_text(yaml.safe_dump({"meta": {"parent": str(run)}}))
    summary = {
        "job_type": "finetune",
        "epochs": 2,
        "val_top1": 1.7,
        "test_top1": -0.4,
        "wall_time_sec": -50,
        "data": {"val": -3, "test": 6},
    }
    (tmp_path / "runs" / "ft" / "summary.json").write_text(json.dumps(summary))
    assert export_encoder([str(run), "--out", str(tmp_path / "out")]) == 0
    _, header, body = (tmp_path / "out" / "README.md").read_text().split("---\n", 2)
    assert "model-index" not in yaml.safe_load(header)  # no accuracy of it is one a run writes
    assert "| ft | finetune | 2 | - | - | - | - / 6 |" in body
    assert "| data | synthetic: - train, 8 val, - test images |" in body  # the encoder's own: -100 images, -5 s
    assert not [line for line in body.splitlines() if line.startswith("| wall time |")]


def test_compare_leaves_out_what_no_run_writes_from_the_metrics_and_the_image_counts(tmp_path):
    """compare_runs left out a summary's impossible top-1 but then showed the metrics' val top-1 of 160% in its place, a
    metrics step of -7 as the run's steps, and image counts of -100 and "many"."""
    compare_run(tmp_path / "runs", "valboth", {"final_val_top1": 1.5, "data": {"train": -100, "val": "many", "test": 10}},
                '{"step": 1, "val_top1": 0.5}\n{"step": 2, "val_top1": 1.6}\n{"step": -7, "loss": 3.0}\n')  # fmt: skip
    (r,) = compare.compare([str(tmp_path / "runs")])["rows"]
    assert r["val_top1"] == r["best_val_top1"] == 0.5 and r["steps"] == 2
    assert (r["train_images"], r["val_images"], r["test_images"]) == (None, None, 10)
    assert r["status"] == ("finished; 1 line(s) of metrics.jsonl without a finite step >= 0; out of range, left out: summary.json "
                           "final_val_top1 1.5, summary.json data.train -100, summary.json data.val 'many'; out of range, left out: "
                           "metrics.jsonl val_top1 1.6 at step 2")  # fmt: skip


def test_the_gpu_report_says_where_its_loss_curves_ran(tmp_path):
    """Loss curves of CPU runs in a check's folder went into the report's loss rows while its first line named only the
    GPU stage: no warning said that some of its figures were not a GPU's."""
    host = {"cpu": "Intel Xeon", "cpu_flags": ["avx2"], "cores": 16, "gpu": "NVIDIA H200"}
    write(tmp_path, "runs/pretrain/summary.json", {"host": host, "precision": "bf16", "images_per_sec": 9000.0})
    for mode in ("off", "auto"):
        curve(tmp_path, mode, [2.0, 1.5, 1.0])
        write(tmp_path, f"runs/curve_{mode}/summary.json", {"host": {"cpu": "AMD EPYC", "cpu_flags": [], "cores": 2}, "precision": "no"})
    lines = report(tmp_path).splitlines()
    assert lines[0] == "**Not one GPU's figures**: the inputs name 2 devices (NVIDIA H200; cpu: AMD EPYC)"
    assert lines[1] == "**Not measured on a GPU**: runs/curve_off, runs/curve_auto"
    assert lines[2].endswith("runs/curve_auto: AMD EPYC (no AVX2), 2 cores, fp32")


def refused() -> None:
    """What the end of a refused stage's process does: its run folder's lock is released (`vit.store.lock`, at exit)."""
    _release_at_exit()
    reset_accelerate()


def test_a_run_refused_at_set_up_leaves_no_run_folder_behind(tmp_path, capsys):
    """A run refused once its stage began (a data.root that is not there, an encoder of another size) left a folder holding
    its config.yaml: compare_runs listed each such attempt as an unfinished run of settings that never trained."""
    assert pretrain(tiny_overrides(tmp_path, name="bad", **{"data.dataset": "imagefolder", "data.root": tmp_path / "none"})) == 2
    refused()
    assert pretrain(tiny_overrides(tmp_path, name="mae", **{"schedule.max_steps": 1, "mae.knn_every": 0})) == 0
    reset_accelerate()
    init = f"finetune.init={tmp_path / 'runs' / 'mae'}"
    assert finetune(tiny_overrides(tmp_path, name="ft", **{"model.embed_dim": 64}) + [init]) == 2
    refused()
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(err) == 2 and "does not exist" in err[0] and "embed_dim: 32 != 64" in err[1], err
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["mae"]
    # the same names then start as fresh runs, and a run folder that was there before a refusal stays
    (tmp_path / "runs" / "ft").mkdir()
    (tmp_path / "runs" / "ft" / "notes.txt").write_text("mine")
    assert finetune(tiny_overrides(tmp_path, name="ft", **{"model.embed_dim": 64}) + [init]) == 2
    refused()
    assert [p.name for p in (tmp_path / "runs" / "ft").iterdir()] == ["notes.txt"]
    assert finetune(tiny_overrides(tmp_path, name="ft2", **{"schedule.max_steps": 1}) + [init]) == 0
    assert (tmp_path / "runs" / "ft2" / "config.yaml").is_file() and (tmp_path / "runs" / "ft2" / "summary.json").is_file()


@pytest.mark.parametrize("config, override, message", [
    (PretrainConfig, "mae.mask_ratio=1", "mae.mask_ratio must be in (0, 1), not 1.0"),
    (FinetuneConfig, "finetune.patch_keep=0", "finetune.patch_keep must be in (0, 1], not 0.0"),
    (FinetuneConfig, "optim.batch_size=0", "optim.batch_size must be positive, not 0"),
    (PretrainConfig, "data.val_size=-3", "data.val_size must be >= 0, not -3"),
    (PretrainConfig, "run.save_every=0", "run.save_every must be positive, or null (states by run.save_minutes), not 0"),
])  # fmt: skip
def test_a_setting_out_of_its_bounds_is_refused_naming_the_value_given(config, override, message):
    """A value inside a bound's range that cannot train was named (mae.mask_ratio 0.999 leaves no visible patch), but one
    at or past the bound was not: 'mae.mask_ratio must be in (0, 1)', whatever was typed."""
    with pytest.raises(ConfigError) as e:
        load_config(config, None, [override])
    assert str(e.value) == message


def test_data_workers_whose_temporary_folder_is_too_long_a_socket_path_are_refused_not_left_to_hang(tmp_path, monkeypatch, capsys):
    """DataLoader workers pass batches through a Unix socket in TMPDIR (pymp-*/listener-*): past 107 bytes Linux refuses it,
    and a stream run with workers hung at its first batch, without a word (the bench's smoke test did, under a deep
    pytest folder). With data.workers=0 nothing passes through the socket, and the run trains."""
    tree = image_tree(tmp_path / "tree")
    deep = tmp_path / ("t" * 60)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    data = {"data.dataset": "imagefolder", "data.root": tree, "data.loader": "stream", "data.val_size": 3, "model.img_size": 16,
            "optim.batch_size": 4, "mae.knn_every": 0, "mae.figure_images": 0, "schedule.max_steps": 1}  # fmt: skip
    assert pretrain(tiny_overrides(tmp_path, name="deep", **data, **{"data.workers": 1})) == 2
    refused()
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(err) == 1 and f"data.workers=1: data workers pass batches through a Unix socket in the temporary folder {deep}" in err[0]
    assert not (tmp_path / "runs" / "deep").exists()
    assert pretrain(tiny_overrides(tmp_path, name="deep", **data, **{"data.workers": 0})) == 0
