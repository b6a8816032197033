"""A kNN run's records count what it featurised: with the stream loader skipping broken training images, its rate
divided the listed split (images_per_sec too high by the share skipped) and its summary had no bad_images."""

import json

from helpers import image_tree, tiny_overrides

from finetune.train import main as finetune_main


def test_a_knn_runs_rate_and_bad_images_count_the_images_it_read(tmp_path, monkeypatch):
    import finetune.knn

    ticks = iter(range(100))
    monkeypatch.setattr(finetune.knn, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: float(next(ticks)))}))
    root = image_tree(tmp_path / "tree", bad=lambda split, label, i: split == "train" and i < 3)  # 9 of 27 training files
    args = tiny_overrides(tmp_path, "knn", **{"data.dataset": "imagefolder", "data.root": str(root), "data.loader": "stream",
                                              "data.skip_bad_images": True, "data.val_size": 0, "model.img_size": 16,
                                              "model.patch_size": 8, "optim.batch_size": 4, "finetune.mode": "knn",
                                              "finetune.init": "scratch", "finetune.knn_k": 3, "data.workers": 0})  # fmt: skip
    assert finetune_main(args) == 0
    s = json.loads((tmp_path / "runs" / "knn" / "summary.json").read_text())
    assert s["bad_images"] == 9 and s["knn"]["bank"] == 18 and s["data"]["test"] == 6
    # the stage's clock ticks one second a reading: its features took 1 s, for the bank's 18 images and the 6 test images
    assert s["feature_time_sec"] == 1.0 and s["images_per_sec"] == s["feature_images_per_sec"] == 24.0
