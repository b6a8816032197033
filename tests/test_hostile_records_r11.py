"""summary.json's numbers against what the run did: images that do not decode (data.skip_bad_images) left out of the
streamed splits are left out of the counts and rates that summary.json records, and counted in `bad_images`."""

import json
import time

from helpers import image_tree, tiny_overrides

import finetune.train as finetune_train
from finetune.train import main as finetune


def some_train_and_one_test(split: str, label: str, i: int) -> bool:
    return (split == "train" and i in (0, 1)) or (split, label, i) == ("test", "a", 0)


def streamed_tree_overrides(tmp_path, name: str, bad=some_train_and_one_test) -> list[str]:
    """A tiny classification run of a 3-class image tree read by the stream loader, the `bad` files undecodable (skipped
    with data.skip_bad_images)."""
    root = image_tree(tmp_path / "tree", bad=bad)
    return tiny_overrides(tmp_path, name, **{"data.dataset": "imagefolder", "data.root": str(root), "data.loader": "stream",
                                             "data.workers": 0, "data.skip_bad_images": True, "data.val_size": 6, "model.img_size": 16,
                                             "model.patch_size": 8, "optim.batch_size": 4, "schedule.epochs": 1,
                                             "finetune.init": "scratch"})  # fmt: skip


def summary(tmp_path, name: str) -> dict:
    return json.loads((tmp_path / "runs" / name / "summary.json").read_text())


def test_a_cached_probes_feature_rate_counts_the_images_it_featurised_not_those_skipped(tmp_path, monkeypatch):
    """A cached probe's images_per_sec (its frozen encoder's rate) divided every image of the splits, the skipped ones
    (data.skip_bad_images) too, by the features' time: 33 images where 27 were featurised, a rate 22% too high."""
    rows = []

    def timed_features(*args, **kwargs):
        features, labels = extract(*args, **kwargs)
        rows.append(features.shape[0])
        time.sleep(0.25)  # a feature time long enough that summary.json's rounding of it is small
        return features, labels

    extract = finetune_train.extract_features
    monkeypatch.setattr(finetune_train, "extract_features", timed_features)
    args = streamed_tree_overrides(tmp_path, "probe")
    assert finetune(args + ["finetune.mode=linear", "finetune.probe_cache=true"]) == 0
    s = summary(tmp_path, "probe")
    featurised = sum(rows)
    counted = sum(s["data"][split] for split in ("train", "val", "test"))
    assert s["bad_images"] == counted - featurised == 7
    assert s["images_per_sec"] == s["feature_images_per_sec"]
    rate, seconds = s["feature_images_per_sec"], s["feature_time_sec"]
    assert abs(rate * seconds - featurised) < 0.5, (rate, seconds, featurised)


def test_an_evaluation_runs_summary_counts_the_images_it_skipped(tmp_path):
    """finetune.mode=eval skipped undecodable val and test images (a warning each) and its summary.json held no
    bad_images: its test top-1 read as of the split's 6 images, it was of the 4 that decoded."""
    args = streamed_tree_overrides(tmp_path, "probe", bad=lambda split, label, i: split == "test" and i == 0 and label != "c")
    assert finetune(args + ["finetune.mode=linear", "finetune.probe_cache=true"]) == 0
    trained = summary(tmp_path, "probe")
    assert trained["bad_images"] == 2
    eval_args = [a for a in args if not a.startswith(("run.name=", "finetune.init="))]
    assert finetune(eval_args + ["run.name=eval", "finetune.mode=eval", f"finetune.init={tmp_path / 'runs' / 'probe'}"]) == 0
    s = summary(tmp_path, "eval")
    assert s["test_top1"] == trained["test_top1"] and s["data"]["test"] == 6
    assert s.get("bad_images") == 2  # test/a/0.png and test/b/0.png, each once
