"""A tree read as CIFAR holds CIFAR's classes. A 10-class tree of one's own under the default data.dataset=cifar10 trained
with CIFAR-10's normalisation, and its records and results tables said CIFAR-10: it is refused in one line that names the
setting reading it as it is. CIFAR's own trees (its class names in any case, or the label numbers) are read as before."""

import pytest
from helpers import reset_accelerate, tiny_overrides
from test_hostile_sources_r8 import png
from test_stream import assert_one_line_naming, data_cfg, open_quiet

from pretrain.train import main as pretrain
from vit.data.sources.arrays import CIFAR10_CLASSES, CIFAR100_CLASSES
from vit.errors import DataError

OWN = ("apple", "bear", "cup", "dog", "egg", "fig", "goat", "hat", "ink", "jam")  # "dog" is a CIFAR-10 class too


def tree(root, classes, per_class=2):
    for c in classes:
        (root / "train" / c).mkdir(parents=True)
        for i in range(per_class):
            (root / "train" / c / f"{i}.png").write_bytes(png(i, 32))
    return root


@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_a_ten_class_tree_of_ones_own_is_refused_as_cifar10_by_both_loaders(tmp_path, loader):
    root = tree(tmp_path / "tree", OWN)
    with pytest.raises(DataError) as e:
        open_quiet(data_cfg(tmp_path, dataset="cifar10", root=str(root), loader=loader, workers=0), out_size=32)
    assert_one_line_naming(e, root, "not CIFAR-10's (apple, bear, cup and 6 more;", "set data.dataset=imagefolder")
    assert "dog" not in str(e.value).split("(")[1].split(";")[0]  # a CIFAR-10 class is not named among the others


@pytest.mark.parametrize("classes", [CIFAR10_CLASSES, tuple(c.upper() for c in CIFAR10_CLASSES), tuple(map(str, range(10)))],
                         ids=["names", "upper-case", "numbers"])  # fmt: skip
def test_cifar10_trees_of_its_names_in_any_case_or_its_label_numbers_are_read(tmp_path, classes):
    root = tree(tmp_path / "tree", classes)
    data, _ = open_quiet(data_cfg(tmp_path, dataset="cifar10", root=str(root), loader="memory", workers=0), out_size=32)
    assert data.splits.train.classes == sorted(classes) and len(data.splits.train) == 20


def test_cifar100_trees_are_checked_against_its_hundred_names(tmp_path):
    root = tree(tmp_path / "good", CIFAR100_CLASSES, per_class=1)
    data, _ = open_quiet(data_cfg(tmp_path, dataset="cifar100", root=str(root), loader="memory", workers=0), out_size=32)
    assert len(data.splits.train.classes) == 100
    bad = tree(tmp_path / "bad", ("aquarium-fish", *CIFAR100_CLASSES[:1], *CIFAR100_CLASSES[2:]), per_class=1)
    with pytest.raises(DataError) as e:
        open_quiet(data_cfg(tmp_path, dataset="cifar100", root=str(bad), loader="stream", workers=0), out_size=32)
    assert_one_line_naming(e, bad, "not CIFAR-100's (aquarium-fish;", "data.dataset=cifar100")


def test_the_command_line_says_it_in_one_line_with_exit_code_2(tmp_path, capsys):
    root = tree(tmp_path / "tree", OWN)
    argv = [o for o in tiny_overrides(tmp_path, **{"data.val_size": 2}) if not o.startswith("data.dataset=")]
    try:
        assert pretrain([*argv, f"data.root={root}"]) == 2
    finally:
        reset_accelerate()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err and "set data.dataset=imagefolder" in lines[0], err
    assert not any((tmp_path / "runs").glob("*/summary.json"))
