"""Hostile tests of the classifiers, round 8: a saved timm_vit classifier whose config our encoder refuses, a class count
that no Linear takes; every architecture rebuilt from its classifier.pt gives the logits it was saved with; timm's ViT
grouped for layer decay as ours is; the probe's head built as MAE's `main_linprobe.py` builds it."""

import pytest
import torch
from helpers import tiny_overrides
from torch import nn

from finetune.config import FinetuneConfig
from finetune.models import Built, LinearProbe, build_classifier, load_classifier, save_classifier
from vit.config import load_config
from vit.errors import CheckpointError
from vit.models.encoder import create_model
from vit.train.optim import param_groups

DATA = {"dataset": "synthetic", "image_size": 32, "mean": [0.5] * 3, "std": [0.5] * 3}
CLASSES = [str(c) for c in range(10)]


def tiny_vit(num_classes: int = 10, **settings) -> nn.Module:
    return create_model("vit_cifar_tiny", embed_dim=32, depth=2, num_heads=2, patch_size=8, num_classes=num_classes, **settings)


def config(tmp_path, **overrides) -> FinetuneConfig:
    return load_config(FinetuneConfig, None, tiny_overrides(tmp_path, **overrides))


@pytest.mark.parametrize("setting, value, message", [
    ("global_pool", "max", "global_pool must be 'token' or 'avg', got 'max'"),  # timm pooled the maximum, unsaid
    ("global_pool", "", "global_pool must be 'token' or 'avg', got ''"),  # timm pooled nothing: logits per token
    ("pos_embed", "sin", "pos_embed must be 'learned' or 'sincos', got 'sin'"),  # timm froze the table as if sin-cos
    ("drop_path_rate", 2.0, "drop_path_rate must be in [0, 1], got 2.0"),
    ("patch_drop_rate", 1.0, r"patch_drop_rate must be in [0, 1), got 1.0"),  # timm's assert: a bare AssertionError
])  # fmt: skip
def test_a_timm_vit_classifier_whose_config_our_encoder_refuses_is_refused_as_damaged(tmp_path, setting, value, message):
    """A `vit` classifier.pt with such a config is refused (our encoder checks it); timm's ViT built them all but the last
    without a word, and eval scored (and export failed on) a classifier that is not the one its config records."""
    model = tiny_vit()
    path = tmp_path / "classifier.pt"
    save_classifier(path, Built(model, "timm_vit", {"config": {**model.config, setting: value}}), model, CLASSES, DATA, step=1)
    with pytest.raises(CheckpointError) as e:
        load_classifier(path)
    assert str(e.value) == f"{path} is damaged: its 'build' makes no timm_vit classifier (ValueError: {message})"


@pytest.mark.parametrize("arch", ["resnet18", "linear_probe"])
def test_a_negative_class_count_is_a_damaged_classifier_not_a_runtime_error(tmp_path, arch):
    # nn.Linear(d, -1) raised "Trying to create tensor with negative dimension" as a RuntimeError traceback.
    model = LinearProbe(tiny_vit(0), 10)  # its weights are never read: the build is refused before any weight loads
    build = {"num_classes": -1} if arch == "resnet18" else {"config": model.encoder.config, "num_classes": -1, "pool": "avg"}
    path = tmp_path / "classifier.pt"
    save_classifier(path, Built(model, arch, build), model, CLASSES, DATA, step=1)
    with pytest.raises(CheckpointError) as e:
        load_classifier(path)
    why = "ValueError: num_classes must be a positive integer, got -1"
    assert str(e.value) == f"{path} is damaged: its 'build' makes no {arch} classifier ({why})"


@pytest.mark.parametrize("overrides", [
    {"finetune.arch": "vit", "model.drop_path_rate": 0.2, "model.drop_rate": 0.1, "model.global_pool": "avg", "finetune.patch_keep": 0.5},
    {"finetune.arch": "timm_vit", "model.drop_path_rate": 0.2, "model.attn_drop_rate": 0.1, "model.pos_embed": "sincos",
     "finetune.patch_keep": 0.5},
    {"finetune.arch": "resnet18"},
    {"finetune.mode": "linear", "finetune.probe_pool": "avg", "model.global_pool": "avg", "model.drop_path_rate": 0.3},
])  # fmt: skip
def test_every_classifier_rebuilt_from_its_file_gives_the_logits_it_was_saved_with(tmp_path, overrides):
    """Its weights and BatchNorm statistics moved, saved, rebuilt: the same logits in eval mode, bit for bit."""
    torch.manual_seed(0)
    built = build_classifier(config(tmp_path, **overrides), 10)
    size = 8 if built.arch == "resnet18" else 32  # the ResNet pools whatever it is given: small images keep its step cheap
    model, x = built.model, torch.randn(4, 3, size, size)
    with torch.no_grad():  # weights away from their init, BatchNorm statistics moved by a batch in training mode
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.01)
        model.train()(x)
    expected = model.eval()(x)
    save_classifier(tmp_path / "classifier.pt", built, model, CLASSES, DATA, step=2)
    rebuilt, payload = load_classifier(tmp_path / "classifier.pt")
    assert payload["arch"] == built.arch and type(rebuilt) is type(model)
    assert torch.equal(rebuilt.eval()(x), expected)


def test_timms_vit_is_grouped_for_layer_decay_as_our_vit_is(tmp_path):
    """The same parameters, by name, in groups of the same layer, learning-rate scale and weight decay (BEiT / MAE)."""
    groups = {}
    for arch in ("vit", "timm_vit"):
        model = build_classifier(config(tmp_path, **{"finetune.arch": arch, "model.pos_embed": "sincos"}), 10).model
        names = {id(p): n for n, p in model.named_parameters()}
        groups[arch] = [(g["layer"], g["lr_scale"], g["weight_decay"], sorted(names[id(p)] for p in g["params"]))
                        for g in param_groups(model, 0.05, 0.75, 2)]  # fmt: skip
    assert groups["timm_vit"] == groups["vit"]
    layers = {name: (layer, scale) for layer, scale, _, names in groups["vit"] for name in names}
    assert layers["cls_token"] == (0, 0.75**3) and layers["blocks.1.mlp.fc2.weight"] == (2, 0.75) and layers["head.weight"] == (3, 1.0)
    assert "pos_embed" not in layers  # a fixed sin-cos table trains in neither


def test_the_probe_head_is_maes_linprobe_head_on_a_frozen_encoder():
    """main_linprobe.py: BatchNorm1d(D, affine=False, eps=1e-6) then the Linear, its weight trunc_normal_(std=0.01) and bias 0,
    drawn from the same generator state as a head built that way; the encoder has no trainable parameter."""
    torch.manual_seed(3)
    probe = LinearProbe(tiny_vit(0), 10, pool="avg")
    torch.manual_seed(3)
    tiny_vit(0)
    linear = nn.Linear(32, 10)
    nn.init.trunc_normal_(linear.weight, std=0.01)
    norm = probe.head[0]
    assert isinstance(norm, nn.BatchNorm1d) and not norm.affine and norm.eps == 1e-6 and norm.track_running_stats
    assert torch.equal(probe.head[1].weight, linear.weight) and torch.equal(probe.head[1].bias, torch.zeros(10))
    assert [n for n, p in probe.named_parameters() if p.requires_grad] == ["head.1.weight", "head.1.bias"]
    x = torch.randn(4, 3, 32, 32)
    tokens = probe.encoder.eval().forward_features(x)  # (B, 1 + N, D): the probe's feature is the mean of the patch tokens
    assert torch.equal(probe.eval().features(x), tokens[:, 1:].mean(1))
