"""Checkpoints record the data split they were trained on; later runs refuse to evaluate on images they trained on."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from finetune.train import main as finetune
from helpers import reset_accelerate, tiny_overrides
from pretrain.train import main as pretrain
from vit.config import DataConfig
from vit.data.sources import load_splits


def summary(tmp_path, name) -> dict:
    return json.loads((tmp_path / "runs" / name / "summary.json").read_text())


def test_encoder_records_its_data_split_and_the_images_it_trained_on(mae_run, tmp_path):
    record = torch.load(mae_run / "encoder.pt", weights_only=True)["meta"]["data"]
    assert {k: record[k] for k in ("dataset", "val_size", "split_seed", "train_fraction", "source_size")} == {
        "dataset": "synthetic", "val_size": 40, "split_seed": 0, "train_fraction": 1.0, "source_size": 256}  # fmt: skip
    splits = load_splits(DataConfig(dataset="synthetic", synthetic_size=256, val_size=40, cache_dir=str(tmp_path)))
    assert record["fingerprint"] == splits.source.fingerprint
    trained = np.unpackbits(record["trained_on"].numpy(), count=256).astype(bool)
    assert trained.sum() == 216 and trained[splits.source.train.numpy()].all() and not trained[splits.source.val.numpy()].any()


def test_probing_on_val_images_the_encoder_was_pretrained_on_is_refused_unless_allowed(mae_run, tmp_path, capsys):
    bigger_val = tiny_overrides(tmp_path, name="knn", **{"data.val_size": 80}) + ["finetune.mode=knn", f"finetune.init={mae_run}"]
    assert finetune(bigger_val) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "val images were training images of the encoder" in err[0]
    assert "data.val_size=40" in err[0] and "finetune.allow_overlap=true" in err[0]
    assert not (tmp_path / "runs" / "knn" / "summary.json").exists()
    assert finetune(bigger_val + ["finetune.allow_overlap=true", "run.overwrite=true"]) == 0
    assert "40 of this run's 80 val images were training images" in capsys.readouterr().err
    reset_accelerate()
    # The pretraining's own split: nothing to refuse, nothing to warn about.
    assert finetune(tiny_overrides(tmp_path, name="same") + ["finetune.mode=knn", f"finetune.init={mae_run}"]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.fixture(scope="module")
def probe_run(mae_run, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("probe")
    args = tiny_overrides(tmp, name="probe", **{"schedule.epochs": 2, "optim.name": "sgd", "optim.lr": 0.05})
    args += ["finetune.mode=linear", f"finetune.init={mae_run}"]
    assert finetune(args) == 0
    reset_accelerate()
    return tmp / "runs" / "probe"


def test_eval_mode_evaluates_on_the_split_the_classifier_was_trained_with(probe_run, tmp_path, capsys):
    trained = json.loads((probe_run / "summary.json").read_text())
    # The command line asks for another split; the classifier's own is used, and the run says so.
    assert finetune(tiny_overrides(tmp_path, name="eval", **{"data.val_size": 80, "data.split_seed": 3})
                    + ["finetune.mode=eval", f"finetune.init={probe_run}"]) == 0  # fmt: skip
    assert "data.val_size=40 (not 80)" in capsys.readouterr().out
    e = summary(tmp_path, "eval")
    assert e["data"]["val"] == 40 and e["val_top1"] == trained["final_val_top1"]
    assert e["val_loss"] == pytest.approx(trained["val_loss"], abs=1e-6)


def test_eval_refuses_a_val_split_that_holds_the_classifiers_training_images(probe_run, tmp_path, capsys):
    payload = torch.load(probe_run / "classifier.pt", weights_only=True)
    record = payload["data"]["split"]
    record["trained_on"] = torch.full_like(record["trained_on"], 255)  # as if it had trained on every image
    torch.save(payload, tmp_path / "classifier.pt")
    assert finetune(tiny_overrides(tmp_path, name="eval") + ["finetune.mode=eval", f"finetune.init={tmp_path / 'classifier.pt'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "40 of this run's 40 val images were training images of the classifier" in err[0]


def test_shards_streamed_in_order_record_no_positions_and_say_the_overlap_is_not_checked(tmp_path):
    from test_stream import write_shards

    from vit.data.loaders import open_data
    from vit.data.provenance import check_overlap, split_record

    pattern = write_shards(tmp_path / "shards", shards=2, per_shard=6)
    for val_size in (0, 3):
        cfg = DataConfig(dataset="webdataset", root=pattern, loader="stream", val_size=val_size, cache_dir=str(tmp_path / "cache"))
        splits = open_data(cfg, out_size=16, say=lambda line: None).splits
        record = split_record(cfg, splits)
        assert record["trained_on"] is None and record["source_size"] == 12 - val_size
        warning = check_overlap(record, splits, "the encoder", "finetune.allow_overlap", False)
        assert "read in order with no positions recorded" in warning


@pytest.mark.slow
def test_pretraining_on_streamed_shards_without_a_val_split_then_probing_them(tmp_path, capsys):
    from test_stream import write_shards

    pattern = write_shards(tmp_path / "shards", shards=2, per_shard=8)
    shards = {"data.dataset": "webdataset", "data.root": pattern, "data.loader": "stream", "data.workers": 0, "optim.batch_size": 4,
              "schedule.epochs": 1}  # fmt: skip
    assert pretrain(tiny_overrides(tmp_path, name="mae", **shards, **{"data.val_size": 0})) == 0
    assert torch.load(tmp_path / "runs" / "mae" / "encoder.pt", weights_only=True)["meta"]["data"]["trained_on"] is None
    reset_accelerate()
    capsys.readouterr()
    # probe_cache=false: a cached probe would read the training shards as an evaluation set, which shards are not
    probe = tiny_overrides(tmp_path, name="probe", **shards, **{"data.val_size": 3})
    probe += ["finetune.mode=linear", "finetune.probe_cache=false", f"finetune.init={tmp_path / 'runs' / 'mae'}"]
    assert finetune(probe) == 0
    assert "trained on these shards, read in order" in capsys.readouterr().err
