"""A user who writes no config of their own: every stage on a small ImageFolder tree they made, from command-line
overrides alone. What they get wrong first must be refused in one line that names the setting to change."""

import shlex

import pytest
import torch
from helpers import image_tree, reset_accelerate, tiny_overrides

from finetune.config import FinetuneConfig
from finetune.models import build_classifier
from finetune.train import main as finetune
from pretrain.train import main as pretrain
from vit.config import load_config
from vit.models.encoder import VisionTransformer, create_model
from vit.store.checkpoint import save_encoder


@pytest.fixture(autouse=True)
def _fresh_accelerate():
    yield
    reset_accelerate()


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def own_tree_overrides(tmp_path, *extra: str) -> list[str]:
    """The tiny run's overrides on a 3-class tree (27 training images), 3 of them val, then `extra`; data.dataset is left
    at its default, as a user who never read about it leaves it."""
    root = image_tree(tmp_path / "tree")
    base = [o for o in tiny_overrides(tmp_path, **{"data.val_size": 3}) if not o.startswith("data.dataset=")]
    return [*base, f"data.root={root}", *extra]


def test_an_own_tree_under_the_default_dataset_names_data_dataset(tmp_path, capsys):
    # data.dataset defaults to cifar10: a user's 3-class tree was refused as 'not the 10 CIFAR-10 classes', with no word
    # of the setting that reads it.
    assert pretrain(own_tree_overrides(tmp_path)) == 2
    line = one_error_line(capsys)
    assert "holds 3 class folders" in line and "set data.dataset=imagefolder" in line, line


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_a_training_split_smaller_than_the_batch_names_optim_batch_size_and_what_fits(tmp_path, capsys, stage):
    # 27 training images, 3 of them carved for val, and the tiny run's batch of 32: the error said 'fewer than a batch of
    # 32' and named no setting (the cached probe's path said 'lower optim.batch_size').
    argv = own_tree_overrides(tmp_path, "data.dataset=imagefolder")
    code = pretrain(argv) if stage == "pretrain" else finetune(argv + ["finetune.init=scratch"])
    assert code == 2
    line = one_error_line(capsys)
    assert "fewer than a batch of 32" in line and "lower optim.batch_size to 24 or less" in line, line


def test_an_encoder_of_another_shape_names_the_model_overrides_that_load_it(tmp_path, capsys):
    # Pretrained with a preset or sizes the fine-tune's command forgot: the error listed 'embed_dim: 32 != 64; ...' and
    # left the user to work out which model.* keys to set (the run's model.name is not in encoder.pt).
    encoder = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, qkv_bias=False)
    save_encoder(encoder, tmp_path / "encoder.pt")
    init = f"finetune.init={tmp_path / 'encoder.pt'}"
    assert finetune(tiny_overrides(tmp_path, **{"model.embed_dim": 64, "model.depth": 3}) + [init]) == 2
    line = one_error_line(capsys)
    hint = "; to load it set model.embed_dim=32 model.depth=2 model.mlp_ratio=2.0 model.qkv_bias=false"
    assert line.endswith(hint), line
    # The overrides it names are what loads it.
    cfg = load_config(FinetuneConfig, None, tiny_overrides(tmp_path) + shlex.split(hint.split(" set ", 1)[1]) + [init])
    loaded = build_classifier(cfg, num_classes=3).model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in encoder.state_dict().items() if not k.startswith("head."))


def test_an_encoder_of_a_preset_s_sizes_names_that_preset(tmp_path, capsys):
    """Pretrained as vit_cifar_small, fine-tuned as vit_cifar_tiny: the line names the preset first, then the sizes (which
    load it even where the run sets sizes of its own)."""
    save_encoder(create_model("vit_cifar_small"), tmp_path / "encoder.pt")
    argv = tiny_overrides(tmp_path) + ["model.name=vit_cifar_tiny", f"finetune.init={tmp_path / 'encoder.pt'}"]
    argv = [a for a in argv if not a.startswith(("model.embed_dim=", "model.depth=", "model.num_heads=", "model.patch_size=", "model.mlp_ratio="))]
    assert finetune(argv) == 2
    line = one_error_line(capsys)
    assert line.endswith("; to load it set model.name=vit_cifar_small (or model.embed_dim=256 model.depth=8 model.num_heads=8)"), line
