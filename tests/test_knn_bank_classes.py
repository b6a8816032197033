"""The pretraining kNN monitor says when its bank lacks classes: from streamed shards it is their first samples, not a
seeded draw, and shards written class by class gave a bank of one class, whose kNN accuracy was logged without a word."""

import io

import numpy as np
from helpers import tiny_overrides
from PIL import Image

from pretrain.train import main as pretrain_main


def class_sorted_shards(folder, classes=3, per_class=8) -> str:
    """One shard per class, `per_class` 32 px PNGs each (`<key>.png`, `<key>.cls`); returns the brace pattern."""
    import webdataset as wds

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for c in range(classes):
        with wds.TarWriter(str(folder / f"train-{c:06d}.tar")) as sink:
            for i in range(per_class):
                png = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(png, "PNG")
                sink.write({"__key__": f"c{c}_{i:03d}", "png": png.getvalue(), "cls": str(c).encode()})
    return str(folder / f"train-{{000000..{classes - 1:06d}}}.tar")


def test_a_bank_of_the_shards_first_samples_that_misses_classes_is_said(tmp_path, capsys):
    pattern = class_sorted_shards(tmp_path / "shards")
    args = tiny_overrides(tmp_path, "sorted", **{"data.dataset": "webdataset", "data.root": pattern, "data.loader": "stream",
                                                 "data.val_size": 4, "mae.knn_bank_size": 4, "mae.knn_every": 1, "optim.batch_size": 4,
                                                 "schedule.epochs": 1, "schedule.max_steps": 1, "data.workers": 0})  # fmt: skip
    assert pretrain_main(args) == 0
    err = capsys.readouterr().err
    assert ("the kNN monitor's bank (4 training images, the shards' first samples, in their order) holds 1 of the 3 classes: its kNN "
            "accuracy cannot reach the images of the others; write shards that mix the classes, or raise mae.knn_bank_size") in err, err


def test_a_bank_that_holds_every_class_says_nothing(tmp_path, capsys):
    assert pretrain_main(tiny_overrides(tmp_path, "mixed", **{"mae.knn_every": 1, "schedule.max_steps": 1})) == 0
    assert "kNN monitor's bank" not in capsys.readouterr().err
