"""A classification whose test images none decode (data.skip_bad_images) stops in one line: its top-1 was 0 of
max(0, 1), recorded as a test accuracy of 0.00% with exit 0."""

import json

import pytest
from helpers import image_tree, tiny_overrides

from finetune.train import main as finetune_main


@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_a_test_split_of_which_no_image_decoded_is_no_accuracy_of_zero(tmp_path, capsys, loader):
    root = image_tree(tmp_path / "tree", bad=lambda split, label, i: split == "test")
    args = tiny_overrides(tmp_path, "ft", **{"data.dataset": "imagefolder", "data.root": str(root), "data.loader": loader,
                                             "data.skip_bad_images": True, "data.val_size": 3, "model.img_size": 16,
                                             "model.patch_size": 8, "optim.batch_size": 4, "schedule.epochs": 1, "finetune.init": "scratch",
                                             "data.workers": 0})  # fmt: skip
    code = finetune_main(args)
    out, err = capsys.readouterr()
    summary = tmp_path / "runs" / "ft" / "summary.json"
    recorded = json.loads(summary.read_text()).get("test_top1") if summary.exists() else None
    assert recorded is None, (code, recorded, err[-500:])
    if loader == "stream":  # the memory loader decodes up front: an empty test split is evaluated on none
        assert code == 2 and err.strip().splitlines()[-1].startswith("error: no image of the test split decoded"), err[-500:]
