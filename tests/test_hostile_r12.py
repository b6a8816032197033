"""A tree read as CIFAR is refused by its class folders before its images are decoded or cached, and the refusal names
the folders as they are (one class in two cases, a name with a space or a look-alike letter); a cache decoded before
the check is checked as it is read."""

import tarfile

import pytest
from test_cifar_tree_classes import OWN, tree
from test_stream import data_cfg, open_quiet

from vit.data.sources import arrays
from vit.data.sources.arrays import CIFAR10_CLASSES
from vit.errors import DataError


def refused(tmp_path, root, loader="memory") -> str:
    with pytest.raises(DataError) as e:
        open_quiet(data_cfg(tmp_path, dataset="cifar10", root=str(root), loader=loader, workers=0), out_size=32)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_tree_of_ones_own_is_refused_before_its_images_are_decoded_or_cached(tmp_path, capsys):
    """data.loader=memory decoded the whole tree (hours, for a large one) and cached it, then refused it."""
    root = tree(tmp_path / "own", OWN)
    assert "set data.dataset=imagefolder" in refused(tmp_path, root)
    assert "decoded" not in capsys.readouterr().out and not list((tmp_path / "cache").glob("*.pt"))


def test_an_archive_of_ones_own_leaves_no_cache_and_one_cached_before_the_check_is_refused_as_read(tmp_path, monkeypatch):
    """An archive's classes are known once it is decoded: refused before its images are cached; a cache written before
    the check (here with the check switched off) is refused as it is read."""
    archive = tmp_path / "own.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tree(tmp_path / "own", OWN), arcname="own")
    assert "not CIFAR-10's" in refused(tmp_path, archive)
    assert not list((tmp_path / "cache").glob("*.pt"))
    with monkeypatch.context() as patch:
        patch.setattr(arrays, "_check_classes", lambda cfg, classes: None)
        open_quiet(data_cfg(tmp_path, dataset="cifar10", root=str(archive), loader="memory", workers=0), out_size=32)
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 1
    assert "not CIFAR-10's" in refused(tmp_path, archive)


def test_one_class_in_two_cases_is_named_with_the_class_it_lacks(tmp_path):
    """'cat' and 'Cat' (truck left out) are ten CIFAR-10 folders, none a stranger: the message listed no folder, '()'."""
    root = tree(tmp_path / "twice", ("Cat", *CIFAR10_CLASSES[:-1]))
    message = refused(tmp_path, root)
    assert "class folders Cat and cat, one CIFAR-10 class in two cases, and none for truck" in message, message


@pytest.mark.parametrize(("name", "shown"), [(" cat", "' cat'"), ("cat ", "'cat '"), ("c\u0430t", "'c\\u0430t'")],
                         ids=["leading-space", "trailing-space", "cyrillic-a"])  # fmt: skip
def test_a_class_folder_that_prints_as_a_cifar_name_is_shown_as_it_is(tmp_path, name, shown):
    """' cat' or a 'cat' spelled with a Cyrillic letter printed as 'cat' among the names not CIFAR-10's."""
    root = tree(tmp_path / "tree", [name if c == "cat" else c for c in CIFAR10_CLASSES], per_class=1)
    assert f"not CIFAR-10's ({shown};" in refused(tmp_path, root, loader="stream")
