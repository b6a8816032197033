"""A user's own ImageFolder tree, end to end: what reads it (class folders named as people name them) and what takes the
trained classifier elsewhere (the exported timm config), each checked at the function a stage calls."""

import io
import tarfile
import unicodedata

import numpy as np
import pytest
import timm
import torch
from PIL import Image

from vit.data.decode import decode_image
from vit.data.files import tree_files
from vit.data.sources.trees import read_tree
from vit.errors import DataError
from vit.models.encoder import create_model
from vit.store.hub import hub_config

SPLITS = ("train", "val", "test")
NFC, NFD = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")


def png(seed: int, size=(48, 40)) -> bytes:
    """A noisy RGB PNG: noise is what tells resampling filters apart."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def make_tree(root, layout: dict[str, list[str]]):
    for split, classes in layout.items():
        for i, name in enumerate(classes):
            (root / split / name).mkdir(parents=True)
            (root / split / name / "0.png").write_bytes(png(i, (8, 8)))
    return root


def test_the_exported_configs_eval_transform_gives_the_images_the_run_was_tested_on(tmp_path):
    # A user loads the export with timm and preprocesses as timm's config says; evaluation here (and finetune.predict)
    # resamples bilinearly, and the config said bicubic: 31 levels off on this noisy image, logits other than predict's.
    model = create_model("vit_cifar_tiny", embed_dim=32, depth=1, num_heads=2, patch_size=8, num_classes=3)
    config = hub_config(model, [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], ["a", "b", "c"])
    data = timm.data.resolve_data_config(config["pretrained_cfg"])
    transform = timm.data.create_transform(**data)
    (tmp_path / "x.png").write_bytes(png(0))
    theirs = transform(Image.open(tmp_path / "x.png").convert("RGB")) * 255  # (3, 32, 32), unit mean and std
    ours = torch.from_numpy(decode_image((tmp_path / "x.png").read_bytes(), "x.png", 32).copy()).permute(2, 0, 1).float()
    assert (theirs - ours).abs().max() <= 1.0


@pytest.mark.parametrize("as_archive", [False, True])
def test_a_class_folder_in_another_unicode_form_than_train_is_said_to_be_one(tmp_path, as_archive):
    # train/ written on Linux, test/ copied from a Mac: both print 'café', and the error said test/café had no counterpart
    # among train classes listing 'café'.
    root = make_tree(tmp_path / "tree", {"train": [NFC, "9_dogs"], "test": [NFD, "9_dogs"]})
    source = root
    if as_archive:
        source = tmp_path / "tree.tar.gz"
        with tarfile.open(source, "w:gz") as tar:
            tar.add(root, arcname=".")
    with pytest.raises(DataError) as e:
        tree_files(source, SPLITS) if not as_archive else read_tree(source, 8)
    message = str(e.value)
    assert "two Unicode forms (NFD and NFC)" in message and f"test/{NFD}" in message and f"train/{NFC}" in message
    assert "\n" not in message


def test_a_class_folder_train_lacks_still_lists_the_train_classes(tmp_path):
    root = make_tree(tmp_path, {"train": ["10_cats", "9_dogs"], "test": ["cats"]})
    with pytest.raises(DataError, match=r"class folder test/cats has no counterpart in train/ \(train classes: 10_cats, 9_dogs\)"):
        tree_files(root, SPLITS)
