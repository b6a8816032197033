"""`python -m finetune.predict`: image files through a finished classifier, read as its evaluation read its split."""

import csv
import json
import math
from contextlib import nullcontext

import pytest
from helpers import image_tree, reset_accelerate, tiny_overrides

from finetune.predict import main as predict
from finetune.train import main as finetune


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A classifier fine-tuned (fp32) on a folder of 3 classes, and that folder: its test/ split is 2 images a class. The
    memory loader keeps the images at 24 px (data.image_size) and evaluation resizes them to the model's 16."""
    tmp_path = tmp_path_factory.mktemp("predict")
    root = image_tree(tmp_path / "tree")
    reset_accelerate()
    args = tiny_overrides(tmp_path, name="ft", **{"data.dataset": "imagefolder", "data.root": root, "data.val_size": 3,
                                                  "model.img_size": 16, "model.patch_size": 4, "optim.batch_size": 8, "data.image_size": 24,
                                                  "schedule.epochs": 3, "run.precision": "no", "run.tracker": "none"})  # fmt: skip
    assert finetune(args) == 0
    reset_accelerate()
    return tmp_path / "runs" / "ft", root


def test_its_probabilities_give_the_runs_own_test_accuracy_and_loss(trained, tmp_path, capsys):
    run_dir, root = trained
    out = tmp_path / "predictions.csv"
    assert predict([str(run_dir), str(root / "test"), "--top", "3", "--csv", str(out), "--precision", "no"]) == 0
    printed = capsys.readouterr().out.splitlines()
    rows = list(csv.reader(out.read_text().splitlines()))
    assert rows[0] == ["path", "class_1", "prob_1", "class_2", "prob_2", "class_3", "prob_3"] and len(rows) == 7 and len(printed) == 7
    probs = []  # each image's probability of each class
    for path, *pairs in rows[1:]:
        names, values = pairs[0::2], [float(v) for v in pairs[1::2]]
        assert sorted(names) == ["a", "b", "c"] and values == sorted(values, reverse=True) and sum(values) == pytest.approx(1, abs=1e-3)
        probs.append((path.split("/")[-2], dict(zip(names, values))))  # the folder an image is in is its class
    summary = json.loads((run_dir / "summary.json").read_text())
    assert sum(max(p, key=p.get) == label for label, p in probs) / 6 == pytest.approx(summary["test_top1"])
    # The run's test loss is the mean cross-entropy of these very probabilities (to the CSV's 4 decimals).
    assert sum(-math.log(p[label]) for label, p in probs) / 6 == pytest.approx(summary["test_loss"], abs=2e-3)


def test_a_file_that_does_not_decode_is_one_line_unless_skipped(trained, tmp_path, capsys):
    run_dir, root = trained
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    good = root / "test" / "a" / "0.png"
    assert predict([str(run_dir), str(good), str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and str(bad) in err and "--skip-bad" in err, err
    assert predict([str(run_dir), str(good), str(bad), "--skip-bad"]) == 0
    out = capsys.readouterr().out
    assert "warning: skipped: " in out and out.splitlines()[-1].startswith(f"{good}  ")


@pytest.mark.parametrize("given, said", [
    (lambda tmp_path, run_dir: [str(run_dir), str(tmp_path / "missing.jpg")], "missing.jpg does not exist"),
    (lambda tmp_path, run_dir: [str(run_dir), str(tmp_path)], "is a folder with no image file in it"),
    (lambda tmp_path, run_dir: [str(tmp_path), str(tmp_path)], "classifier.pt does not exist"),  # no classifier there
    (lambda tmp_path, run_dir: [str(run_dir), str(tmp_path), "--top", "0"], "--top must be >= 1"),
])  # fmt: skip
def test_what_it_cannot_classify_is_one_line(trained, tmp_path, capsys, given, said):
    run_dir, _ = trained
    with pytest.raises(SystemExit) if "--top" in given(tmp_path, run_dir) else nullcontext():
        assert predict(given(tmp_path, run_dir)) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err


def test_an_image_over_the_pixel_limit_is_refused_from_its_header_naming_the_option(trained, tmp_path, capsys):
    from PIL import Image

    run_dir, _ = trained
    big = tmp_path / "big.png"
    Image.new("RGB", (100, 60)).save(big)
    assert predict([str(run_dir), str(big), "--max-image-pixels", "5000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "100x60" in err and "over --max-image-pixels=5,000" in err and "data.max_image_pixels" not in err, err
    assert predict([str(run_dir), str(big), "--max-image-pixels", "6000"]) == 0


def test_its_probabilities_are_those_of_the_memory_loaders_evaluation_batches(trained, tmp_path):
    """Images the run's loader kept at 24 px are evaluated resized to 16: predict decodes them at 24 too (classifier.pt's
    `stored_size`) and resizes them as the loader does, not straight to 16 (a mean of 2 levels off, up to 27)."""
    import torch

    from finetune.models import load_classifier
    from vit.config import DataConfig
    from vit.data.loaders import open_data

    run_dir, root = trained
    model, payload = load_classifier(str(run_dir))
    assert (payload["data"]["image_size"], payload["data"]["stored_size"]) == (16, 24)
    cfg = DataConfig(dataset="imagefolder", root=str(root), image_size=24, val_size=3, cache_dir=str(run_dir.parent / "cache"))
    data = open_data(cfg, out_size=16, say=lambda line: None)
    inputs = torch.cat([x for x, _ in data.loader(data.splits.test, 4, train=False).epoch(0)])  # (6, 3, 16, 16), test/'s order
    with torch.no_grad():
        expected = model.eval()(inputs).softmax(dim=-1)
    out = tmp_path / "p.csv"
    assert predict([str(run_dir), str(root / "test"), "--top", "3", "--csv", str(out), "--precision", "no"]) == 0
    for row, probs in zip(list(csv.reader(out.read_text().splitlines()))[1:], expected.tolist(), strict=True):
        given = dict(zip(row[1::2], map(float, row[2::2])))
        assert [given[name] for name in payload["classes"]] == pytest.approx(probs, abs=6e-5)  # the CSV's 4 decimals


def test_eval_mode_reads_the_images_at_the_size_the_run_kept_them(trained, tmp_path):
    """finetune.mode=eval decoded straight to the model's 16 px where the run had kept its images at 24 and evaluated
    them resized from there: its test loss was not the run's. It now takes classifier.pt's `stored_size`."""
    run_dir, root = trained
    reset_accelerate()
    args = tiny_overrides(tmp_path, name="eval", **{"data.dataset": "imagefolder", "data.root": root, "run.precision": "no",
                                                    "run.tracker": "none", "finetune.mode": "eval", "finetune.init": run_dir})  # fmt: skip
    assert finetune(args) == 0
    reset_accelerate()
    run, again = (json.loads((d / "summary.json").read_text()) for d in (run_dir, tmp_path / "runs" / "eval"))
    assert again["test_loss"] == pytest.approx(run["test_loss"], abs=1e-6) and again["test_top1"] == run["test_top1"]
