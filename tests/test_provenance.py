"""Checkpoints record the data split they were trained on; later runs refuse to evaluate on images they trained on."""

import json
import shutil
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


# --------------------------------------------------------------------------- encoders from exported folders, the Hub and timm


@pytest.fixture(scope="module")
def mae_export(mae_run, tmp_path_factory) -> Path:
    from pretrain.export import main as export_encoder

    out = tmp_path_factory.mktemp("export") / "mae"
    assert export_encoder([str(mae_run), "--out", str(out)]) == 0
    return out


def test_an_export_carries_the_record_of_its_encoder(mae_run, mae_export):
    from vit.data.provenance import record_from_json

    stored = torch.load(mae_run / "encoder.pt", weights_only=True)["meta"]["data"]
    record = record_from_json(json.loads((mae_export / "config.json").read_text())["pretrained_on"], "config.json")
    assert torch.equal(record.pop("trained_on"), stored["trained_on"])
    assert record == {k: stored[k] for k in record}


def test_probing_an_exported_encoder_on_val_images_it_was_pretrained_on_is_refused(mae_export, tmp_path, capsys):
    init = f"finetune.init=local-dir:{mae_export}"
    bigger_val = tiny_overrides(tmp_path, name="knn", **{"data.val_size": 80}) + ["finetune.mode=knn", init]
    assert finetune(bigger_val) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"40 of this run's 80 val images were training images of the encoder local-dir:{mae_export}" in err[0]
    reset_accelerate()
    assert finetune(tiny_overrides(tmp_path, name="same") + ["finetune.mode=knn", f"finetune.init=local-dir:{mae_export}"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_classifier_export_carries_the_images_it_and_its_encoder_trained_on(mae_run, tmp_path, capsys):
    """finetune.export wrote no record: a kNN run from the export on val images the classifier (and its encoder) had
    trained on got one warning calling it "not a vit-mae encoder export" and went on, where one from the run folder is refused."""
    from finetune.export import main as export_classifier
    from vit.data.provenance import record_from_json

    # A probe on half the training split: its own record holds 109 images, its encoder's all 216.
    probe = tiny_overrides(tmp_path, name="probe", **{"data.val_size": 40, "data.train_fraction": 0.5, "schedule.epochs": 1})
    assert finetune(probe + ["finetune.mode=linear", f"finetune.init={mae_run}"]) == 0
    reset_accelerate()
    out = tmp_path / "hub" / "probe"
    assert export_classifier([str(tmp_path / "runs" / "probe"), "--out", str(out)]) == 0
    record = record_from_json(json.loads((out / "config.json").read_text())["pretrained_on"], "config.json")
    encoder = torch.load(mae_run / "encoder.pt", weights_only=True)["meta"]["data"]
    own = torch.load(tmp_path / "runs" / "probe" / "classifier.pt", weights_only=False)["data"]["split"]["trained_on"]
    assert np.unpackbits(own.numpy()).sum() == 109 and torch.equal(record["trained_on"], encoder["trained_on"])
    capsys.readouterr()
    bigger_val = tiny_overrides(tmp_path, name="knn", **{"data.val_size": 80}) + ["finetune.mode=knn", f"finetune.init=local-dir:{out}"]
    assert finetune(bigger_val) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"40 of this run's 80 val images were training images of the encoder local-dir:{out}" in err[0], err


def test_an_encoder_that_records_no_data_is_used_with_one_warning_saying_why(mae_run, mae_export, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    bare = tmp_path / "bare"  # an export without the record: older, or not ours
    bare.mkdir()
    config = json.loads((mae_export / "config.json").read_text())
    del config["pretrained_on"]
    (bare / "config.json").write_text(json.dumps(config))
    (bare / "model.safetensors").write_bytes((mae_export / "model.safetensors").read_bytes())
    weights = tmp_path / "weights.safetensors"  # timm's weights, from a file
    save_file(load_file(mae_export / "model.safetensors"), weights)
    for name, init, why in (("bare", f"finetune.init=local-dir:{bare}", "its config.json has no pretrained_on"),
                            ("timm", f"finetune.init=timm:vit_tiny_patch16_224 finetune.init_file={weights}",
                             "timm's pretrained weights do not record their training images")):  # fmt: skip
        assert finetune(tiny_overrides(tmp_path, name=name, **{"data.val_size": 80}) + ["finetune.mode=knn", *init.split()]) == 0
        reset_accelerate()
        warnings = [line for line in capsys.readouterr().err.splitlines() if "not checked" in line]
        assert len(warnings) == 1 and why in warnings[0] and "records no data split" in warnings[0]


@pytest.mark.parametrize("damage, why", [({"trained_on": "!!"}, "not base64"), ({"trained_on": "AAAA"}, "holds 3 bytes"),
                                         ({"fingerprint": None}, "no fingerprint")])  # fmt: skip
def test_a_damaged_record_in_an_export_is_one_line(mae_export, tmp_path, capsys, damage, why):
    folder = tmp_path / "damaged"
    shutil.copytree(mae_export, folder)
    config = json.loads((folder / "config.json").read_text())
    config["pretrained_on"].update(damage)
    (folder / "config.json").write_text(json.dumps(config))
    assert finetune(tiny_overrides(tmp_path, name="knn") + ["finetune.mode=knn", f"finetune.init=local-dir:{folder}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pretrained_on is damaged" in err and why in err


@pytest.mark.parametrize("later", [{"loader": "stream"}, {"image_size": 8}, {"archive": True, "image_size": 8}],
                         ids=["stream", "other-size", "archive-other-size"])
def test_a_later_run_reading_the_same_files_another_way_is_checked_for_overlap(tmp_path, imagefolder_tree, imagefolder_tar, later):
    """The record's fingerprint names the files, not their decoded pixels: a fine-tune that streams the tree, decodes it
    at another size or reads its archive still finds the val images the pretraining trained on (it said "other data")."""
    from vit.data.loaders import open_data
    from vit.data.provenance import check_overlap, split_record
    from vit.errors import DataError

    def opened(root, **kw):
        cfg = DataConfig(dataset="imagefolder", root=str(root), cache_dir=str(tmp_path / "cache"), val_size=3, workers=0, **kw)
        return cfg, open_data(cfg, out_size=16, say=lambda line: None).splits

    cfg, splits = opened(imagefolder_tree.root, loader="memory", image_size=16)
    record = split_record(cfg, splits)
    root = imagefolder_tar.path if later.pop("archive", False) else imagefolder_tree.root
    _, other = opened(root, split_seed=1, **{"loader": "memory", **later})
    assert other.source.fingerprint == record["fingerprint"]
    with pytest.raises(DataError, match=r"^\d+ of this run's 3 val images were training images of the encoder"):
        check_overlap(record, other, "the encoder", "finetune.allow_overlap", False)


def test_the_recorded_command_is_one_a_user_can_type():
    """config.yaml, the report and the model card quoted the stage's __main__.py path: pasted, it ran nothing."""
    from vit.train.run import command_line

    argv = ["/somewhere/checkout/pretrain/__main__.py", "--config", "configs/pretrain/cpu.yaml", "data.crop_scale=[0.35, 1.0]"]
    assert command_line(argv) == "python -m pretrain --config configs/pretrain/cpu.yaml 'data.crop_scale=[0.35, 1.0]'"
    assert command_line(["scripts/bench.py", "--quick"]) == "scripts/bench.py --quick"
