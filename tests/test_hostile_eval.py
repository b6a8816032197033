"""Wrong input to `finetune.mode=eval`, `finetune.mode=knn` and the exporters: a damaged classifier.pt, a timm / Hub model
where a classifier or a run folder is expected, an empty `--out`. Each is one line and exit 2, and nothing is written."""

import re

import pytest
import torch
from helpers import tiny_overrides

from finetune.export import main as export_classifier
from finetune.models import Built, load_classifier, save_classifier
from finetune.train import main as finetune
from pretrain.export import main as export_encoder
from vit.data.sources import SYNTHETIC_MEAN, SYNTHETIC_STD
from vit.data.sources.arrays import SYNTHETIC_CLASSES
from vit.errors import CheckpointError
from vit.models.encoder import create_model

CLASSES = list(SYNTHETIC_CLASSES)


def tiny_classifier(path):
    """A classifier.pt as the classification stage writes it (a 1-block, 32-wide ViT with a 10-class head), no training."""
    model = create_model("vit_cifar_tiny", embed_dim=32, depth=1, num_heads=2, patch_size=8, num_classes=10)
    split = {"dataset": "synthetic", "val_size": 40, "split_seed": 0, "train_fraction": 1.0, "fingerprint": None,
             "source_size": 256, "trained_on": None}  # fmt: skip
    data = {"dataset": "synthetic", "image_size": 32, "mean": list(SYNTHETIC_MEAN), "std": list(SYNTHETIC_STD), "split": split}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_classifier(path, Built(model, "vit", {"config": model.config}), model, CLASSES, data, step=6)
    return path


def damage(payload, case):
    if case == "head_of_another_size":
        payload["state_dict"]["head.weight"] = torch.zeros(5, 32)
        payload["state_dict"]["head.bias"] = torch.zeros(5)
    elif case == "a_tensor_lost":
        payload["state_dict"].pop("norm.weight")
    elif case == "deeper_build":
        payload["build"]["config"]["depth"] = 2
    elif case == "unknown_build_field":
        payload["build"]["config"]["bogus"] = 1
    elif case == "no_data":
        payload.pop("data")
    elif case == "no_image_size":
        payload["data"].pop("image_size")
    elif case == "fewer_classes":
        payload["classes"] = CLASSES[:5]
    elif case == "split_of_another_type":
        payload["data"]["split"]["val_size"] = "forty"
    elif case == "unknown_arch":
        payload["arch"] = "convnext"


@pytest.mark.parametrize(
    "case, message",
    [
        ("head_of_another_size", "does not match the vit classifier it records (checkpoint != classifier): head.weight (5, 32) != (10, 32)"),
        ("a_tensor_lost", "does not match the vit classifier it records (checkpoint != classifier): missing ['norm.weight']"),
        ("deeper_build", "does not match the vit classifier it records (checkpoint != classifier): missing ['blocks.1."),
        ("unknown_build_field", "is damaged: its 'build' makes no vit classifier (TypeError: "),
        ("no_data", "is damaged: its 'data' is missing or not of type dict"),
        ("no_image_size", "is damaged: its 'data.image_size' is missing or not of type int or None"),
        ("fewer_classes", "is damaged: it names 5 classes, and its vit classifier has 10 outputs"),
        ("split_of_another_type", "is damaged: its 'data.split.val_size' is missing or not of type int"),
        ("unknown_arch", "holds a classifier of an unknown architecture 'convnext'"),
    ],
)  # fmt: skip
def test_a_damaged_classifier_pt_is_one_line_for_eval_and_export(tmp_path, capsys, case, message):
    """A classifier.pt of the right format whose fields or weights disagree with each other: load_state_dict's
    RuntimeError, a KeyError or a TypeError came out as a traceback from eval and export alike (exit 1), or, with fewer
    class names than outputs, eval compared the wrong list with the data's and an export labelled the logits wrongly."""
    path = tiny_classifier(tmp_path / "classifier.pt")
    payload = torch.load(path, weights_only=True)
    damage(payload, case)
    torch.save(payload, path)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_classifier(path)
    assert finetune(tiny_overrides(tmp_path, name="eval") + ["finetune.mode=eval", f"finetune.init={path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}") and message in err, err
    assert not (tmp_path / "runs" / "eval").exists()  # refused before the run folder was made
    assert export_classifier([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and not (tmp_path / "out").exists(), err


def test_the_undamaged_classifier_loads_and_evaluates(tmp_path):
    """The control for the cases above: the same file, undamaged, loads strictly and evaluates."""
    path = tiny_classifier(tmp_path / "classifier.pt")
    model, payload = load_classifier(path)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10) and payload["classes"] == CLASSES
    assert finetune(tiny_overrides(tmp_path, name="eval") + ["finetune.mode=eval", f"finetune.init={path}"]) == 0


def test_a_timm_or_hub_model_given_to_eval_or_as_a_run_folder_says_what_it_is(tmp_path, capsys):
    """Eval mode read `local-dir:`, `hf-hub:` and `timm:` inits as paths ("does not exist in the current folder"), and an
    export folder named without `local-dir:` was "checkpoint .../classifier.pt (or encoder.pt) does not exist"."""
    folder = tmp_path / "hub"
    assert export_classifier([str(tiny_classifier(tmp_path / "clf" / "classifier.pt")), "--out", str(folder)]) == 0
    capsys.readouterr()
    for init in (f"local-dir:{folder}", "hf-hub:someone/tiny", "timm:vit_tiny_patch16_224"):
        assert finetune(tiny_overrides(tmp_path, name="eval") + ["finetune.mode=eval", f"finetune.init={init}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"error: finetune.init={init} is a timm / Hub model, not a classifier this project trained" in err, err
    assert finetune(tiny_overrides(tmp_path, name="eval") + ["finetune.mode=eval", f"finetune.init={folder}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"finetune.init={folder} is a timm / Hub model folder (an export), not a classification run" in err, err
    for mode in ("knn", "full"):
        assert finetune(tiny_overrides(tmp_path, name="from_folder") + [f"finetune.mode={mode}", f"finetune.init={folder}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"is a timm / Hub model folder, not a run folder: name it finetune.init=local-dir:{folder}" in err, err
    assert export_encoder([str(folder), "--out", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {folder} is a timm / Hub model folder, already an export" in err, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "again").exists()


def test_an_empty_out_is_refused_and_the_current_folder_keeps_its_files(tmp_path, monkeypatch, capsys):
    """`--out ""` was the current folder: with --overwrite the export replaced the README.md of whatever folder the
    command ran in (a project's own), and without it the message listed every file there."""
    path = tiny_classifier(tmp_path / "clf" / "classifier.pt")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text("my project\n")
    for out in ("", " "):
        with pytest.raises(SystemExit) as e:
            export_classifier([str(path), "--out", out, "--overwrite"])
        assert e.value.code == 2 and "--out is empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "clf"] and (tmp_path / "README.md").read_text() == "my project\n"


def test_an_eval_with_no_split_to_evaluate_is_one_line(tmp_path, capsys):
    """A classifier trained with data.val_size=0 (which eval keeps) on an image tree without test/: eval printed "eval: "
    with nothing after it, wrote a summary without a number, and exited 0."""
    from PIL import Image

    for c in CLASSES:
        (tmp_path / "tree" / "train" / c).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (32, 32), (40 * i, 0, 0)).save(tmp_path / "tree" / "train" / c / f"{i}.png")
    path = tiny_classifier(tmp_path / "classifier.pt")
    payload = torch.load(path, weights_only=True)
    payload["data"]["split"].update(dataset="imagefolder", val_size=0)
    payload["classes"] = sorted(CLASSES)  # as an image tree lists its class folders
    torch.save(payload, path)
    given = ["data.dataset=imagefolder", f"data.root={tmp_path / 'tree'}", "finetune.mode=eval", f"finetune.init={path}"]
    assert finetune(tiny_overrides(tmp_path, name="eval") + given) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]  # (a warning before it: the record has no fingerprint)
    assert len(errors) == 1 and errors[0].startswith(f"error: nothing to evaluate: the classifier {path} was trained with no val split"), err
    assert not (tmp_path / "runs" / "eval" / "summary.json").exists()
