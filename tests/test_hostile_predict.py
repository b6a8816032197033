"""`python -m finetune.predict` given what users give: file names that are not UTF-8, a --csv that is an input image or
starts with `~`, and files in a folder that cannot be read."""

import csv
import os

import numpy as np
import pytest
import torch
from PIL import Image

from finetune.models import Built, save_classifier
from finetune.predict import main as predict
from vit.models.encoder import VisionTransformer

CLASSES = ["a, one", 'b "two"', "c"]  # a comma and quotes: the CSV must keep each a single field


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A classifier.pt of a tiny ViT (untrained: what it predicts is not under test here, how the files are read is)."""
    torch.manual_seed(0)
    config = {"img_size": 16, "patch_size": 8, "in_chans": 3, "num_classes": 3, "embed_dim": 16, "depth": 1, "num_heads": 2}
    model = VisionTransformer(**config)
    path = tmp_path_factory.mktemp("classifier") / "classifier.pt"
    data = {"dataset": "imagefolder", "image_size": 16, "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}
    save_classifier(path, Built(model, "vit", {"config": model.config}), model, CLASSES, data, step=1)
    return path


def png(path, seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(path)
    return path


def test_a_name_that_is_not_utf8_is_printed_and_written_to_the_csv(classifier, tmp_path, capsys):
    folder = tmp_path / "photos"
    png(folder / os.fsdecode(b"caf\xe9.png"))
    png(folder / "ok.png", seed=1)
    out = tmp_path / "predictions.csv"
    assert predict([str(classifier), str(folder), "--csv", str(out), "--precision", "no"]) == 0
    rows = list(csv.reader(out.read_text(encoding="utf-8").splitlines()))
    assert [r[0] for r in rows[1:]] == [f"{folder}/caf\\xe9.png", f"{folder}/ok.png"]
    assert all(len(r) == 7 and sorted(r[1::2]) == sorted(CLASSES) for r in rows[1:]), rows  # each class name one field
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"{folder}/caf\\xe9.png  ") and printed[0].encode("utf-8")  # encodes on a strict stdout
    assert printed[-1] == f"wrote {out}"


def test_a_csv_that_is_an_input_image_is_refused_before_anything_is_written(classifier, tmp_path, capsys):
    image = png(tmp_path / "photos" / "cat.png")
    before = image.read_bytes()
    # The same file spelled through another path: the table replaced the image.
    other = tmp_path / "link"
    other.symlink_to(tmp_path / "photos")
    assert predict([str(classifier), str(tmp_path / "photos"), "--csv", str(other / "cat.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --csv ") and "is one of the images to classify" in err and err.count("\n") == 1, err
    assert image.read_bytes() == before


def test_a_csv_that_names_a_saved_file_is_refused_and_the_file_kept(classifier, tmp_path, capsys):
    image = png(tmp_path / "cat.png")
    # The run's own classifier.pt: the table replaced the weights it had just read (and a summary.json, a run's record).
    summary = tmp_path / "summary.json"
    summary.write_text('{"test_top1": 0.5}\n')
    pipe = tmp_path / "pipe.csv"
    os.mkfifo(pipe)  # not a regular file: the table's rename replaced it (as root, /dev/null so)
    for target, said in ((classifier, "is not a table that finetune.predict wrote"), (summary, "is not a table"), (pipe, "not a regular file")):
        before = None if target == pipe else target.read_bytes()
        assert predict([str(classifier), str(image), "--csv", str(target), "--precision", "no"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --csv {target} exists and ") and said in err and err.count("\n") == 1, err
        assert target.is_fifo() if target == pipe else target.read_bytes() == before


def test_a_csv_it_wrote_before_and_an_empty_file_are_replaced(classifier, tmp_path, capsys):
    image = png(tmp_path / "cat.png")
    out, empty = tmp_path / "p.csv", tmp_path / "empty.csv"
    empty.touch()
    assert predict([str(classifier), str(image), "--csv", str(out), "--top", "1", "--precision", "no"]) == 0
    for target in (out, empty):  # again, with another --top: a wider table over the narrower one
        assert predict([str(classifier), str(image), "--csv", str(target), "--top", "2", "--precision", "no"]) == 0
        rows = list(csv.reader(target.read_text().splitlines()))
        assert rows[0] == ["path", "class_1", "prob_1", "class_2", "prob_2"] and len(rows) == 2


def test_a_csv_under_home_is_written_there(classifier, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    image = png(tmp_path / "cat.png")
    assert predict([str(classifier), str(image), "--csv=~/out/p.csv"]) == 0  # bash leaves `~` after `--csv=` as it is
    assert (tmp_path / "home" / "out" / "p.csv").is_file() and not (tmp_path / "~").exists()


@pytest.fixture
def unreadable(tmp_path):
    """A folder of 2 images, a link to nothing and a pipe, each named like an image, in that sorted order."""
    folder = tmp_path / "photos"
    png(folder / "a.png")
    (folder / "b.png").symlink_to(folder / "gone.png")
    png(folder / "c.png", seed=1)
    os.mkfifo(folder / "d.png")  # read, it blocked until something wrote to it: forever
    return folder


def test_files_that_cannot_be_read_are_bad_images_that_skip_bad_skips(classifier, unreadable, capsys):
    assert predict([str(classifier), str(unreadable), "--batch-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot read image {unreadable}/b.png") and "--skip-bad" in err and err.count("\n") == 1, err
    assert predict([str(classifier), str(unreadable), "--batch-size", "2", "--skip-bad"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0] for line in out if not line.startswith("warning: ")] == [f"{unreadable}/a.png", f"{unreadable}/c.png"]
    assert sum(line.startswith("warning: skipped: cannot read image") for line in out) == 2, out


def test_a_pipe_named_as_an_image_is_said_to_be_no_regular_file(classifier, unreadable, capsys):
    assert predict([str(classifier), str(unreadable / "d.png")]) == 2
    err = capsys.readouterr().err
    assert f"{unreadable}/d.png: not a regular file" in err and "does not exist" not in err, err
