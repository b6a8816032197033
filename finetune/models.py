"""The classifiers the classification stage trains: our ViT (any init), timm's ViT, a CIFAR ResNet-18, a linear probe.

Every classifier is saved as `classifier.pt` with what it takes to rebuild it:
    {"format": "vit-classifier/1", "arch", "build": {...}, "state_dict", "classes", "data": {...}}
"""

from __future__ import annotations

from dataclasses import dataclass
from inspect import signature
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from finetune.inits import load_init, resolve_checkpoint_path
from vit.config import NAMED_WEIGHTS
from vit.errors import ConfigError
from vit.eval.knn import pooled
from vit.models.encoder import PatchDropout, VisionTransformer, check_config, create_model
from vit.store.atomic import atomic_save
from vit.store.checkpoint import CLASSIFIER_FORMAT, CheckpointError, misfits, non_finite, read_checkpoint, wrong_kind
from vit.store.hub import is_model_folder
from vit.store.runs import CLASSIFIER_FILE
from vit.tools.reference import timm_vit


class LinearProbe(nn.Module):
    """A frozen encoder and a trainable `BatchNorm1d(affine=False) + Linear` head on its pooled features.

    x: (B, C, H, W) -> logits (B, num_classes). `features(x)` -> (B, D) is what the cached probe stores.
    """

    def __init__(self, encoder: VisionTransformer, num_classes: int, pool: str = "token"):
        super().__init__()
        if pool not in ("token", "avg"):  # any other word pooled [CLS], unsaid (a classifier.pt's 'build' edited by hand)
            raise ValueError(f"pool must be 'token' or 'avg', got {pool!r}")
        self.encoder = encoder
        self.pool = pool
        self.encoder.requires_grad_(False)
        d = encoder.embed_dim
        # The BatchNorm without affine whitens the features, so one learning rate suits any encoder (MAE).
        self.head = nn.Sequential(nn.BatchNorm1d(d, affine=False, eps=1e-6), nn.Linear(d, num_classes))
        nn.init.trunc_normal_(self.head[1].weight, std=0.01)
        nn.init.zeros_(self.head[1].bias)

    def train(self, mode: bool = True) -> "LinearProbe":
        super().train(mode)
        self.encoder.eval()  # frozen: no dropout, no drop path, ever
        return self

    @torch.no_grad()
    def features(self, x: torch.Tensor) -> torch.Tensor:
        return pooled(self.encoder, x, self.pool)  # (B, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.features(x).float()  # (B, D)
        if self.training and features.shape[0] == 1:
            # One image has no batch statistics (BatchNorm raised a ValueError mid-run): a training batch that the stream
            # loader left one image of (the others did not decode, data.skip_bad_images) is normalised by the running
            # ones, as in evaluation, and still trains the Linear.
            norm, linear = self.head
            return linear(F.batch_norm(features, norm.running_mean, norm.running_var, training=False, eps=norm.eps))
        return self.head(features)


def cifar_resnet18(num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 with the CIFAR stem: a 3x3 stride-1 first conv and no max-pool (32x32 inputs)."""
    from torchvision.models import resnet18

    model = resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    # As torchvision initialises every other conv of the network: the stem replaced after construction kept PyTorch's
    # default (kaiming_uniform, a=sqrt(5)), about twice the scale.
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.maxpool = nn.Identity()
    return model


@dataclass
class Built:
    model: nn.Module
    arch: str
    build: dict[str, Any]  # what `rebuild` needs
    parent: str | None = None  # the pretraining run the encoder came from
    encoder_config: dict[str, Any] | None = None


def build_classifier(cfg, num_classes: int, device=None, say=None) -> Built:
    """The classifier that `cfg.finetune` asks for, initialised as asked; `say` gets a line about any resampling."""
    ft = cfg.finetune
    if ft.arch == "resnet18":
        return Built(cifar_resnet18(num_classes), "resnet18", {"num_classes": num_classes})

    init = ft.init
    # Patch dropout (training only) is a feature of the encoder, run the same way by our ViT and timm's.
    kwargs = dict(cfg.model.encoder_kwargs(device), num_classes=0 if ft.mode in ("linear", "knn") else num_classes, patch_drop_rate=1.0 - ft.patch_keep)
    try:
        encoder = create_model(cfg.model.name, **kwargs)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None

    parent = load_init(encoder, init, ft.init_file, say)

    if init != "scratch" and ft.mode == "full":
        # The new head starts near zero, as MAE's fine-tuning initialises it, so its first steps do not disturb the encoder.
        nn.init.trunc_normal_(encoder.head.weight, std=2e-5)
        nn.init.zeros_(encoder.head.bias)
    if ft.arch == "timm_vit":
        model = timm_vit(encoder.config)
        model.load_state_dict(encoder.state_dict(), strict=True)  # the same initial weights, run by timm's code
        return Built(model, "timm_vit", {"config": encoder.config}, parent, encoder.config)
    if ft.mode in ("linear", "knn"):  # knn uses the probe's frozen encoder and its features, not its head
        probe = LinearProbe(encoder, num_classes, pool=ft.probe_pool)
        return Built(probe, "linear_probe", {"config": encoder.config, "num_classes": num_classes, "pool": ft.probe_pool}, parent, encoder.config)
    return Built(encoder, "vit", {"config": encoder.config}, parent, encoder.config)


ARCHS = ("vit", "timm_vit", "linear_probe", "resnet18")  # what `rebuild` builds


# What our encoder takes for a field a saved config lacks (a classifier.pt older than the field), to check a timm_vit's config.
ENCODER_DEFAULTS = {name: p.default for name, p in signature(VisionTransformer).parameters.items()}


def rebuild(arch: str, build: dict[str, Any]) -> nn.Module:
    """An empty classifier of the saved kind, ready for `load_state_dict(strict=True)`; a `build` that makes none is a
    KeyError, TypeError or ValueError (`load_classifier` says the file is damaged)."""
    if arch in ("resnet18", "linear_probe") and not (type(build["num_classes"]) is int and build["num_classes"] > 0):
        # A negative count was a RuntimeError traceback from the Linear ("negative dimension"), not a damaged file.
        raise ValueError(f"num_classes must be a positive integer, got {build['num_classes']!r}")
    if arch == "resnet18":
        return cifar_resnet18(build["num_classes"])
    if arch == "timm_vit":
        # timm builds what our encoder refuses, without a word: global_pool 'max' or '' (logits per token), a drop rate
        # above 1, a table 'sin' it freezes; and asserts on patch dropout 1 (a traceback). Our encoder's checks refuse them.
        check_config({**ENCODER_DEFAULTS, **build["config"]})
        PatchDropout(build["config"].get("patch_drop_rate", 0.0))
        return timm_vit(build["config"])
    if arch == "linear_probe":
        return LinearProbe(VisionTransformer(**build["config"]), build["num_classes"], build["pool"])
    if arch == "vit":
        return VisionTransformer(**build["config"])
    raise CheckpointError(f"unknown classifier architecture {arch!r}")


def save_classifier(path: Path, built: Built, model: nn.Module, classes: list[str], data: dict[str, Any], step: int,
                    lineage: dict[str, Any] | None = None) -> None:  # fmt: skip
    """`lineage`: the run's id and its pretraining run's (`run_id`, `parent_run_id`: vit.store.lineage)."""
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    atomic_save({"format": CLASSIFIER_FORMAT, "arch": built.arch, "build": built.build, "state_dict": state,
                 "classes": list(classes), "data": data, "step": step, "parent": built.parent, **(lineage or {})}, path)  # fmt: skip


def load_classifier(init: str, key: str | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """A finished classifier from its run folder or `classifier.pt`, loaded strictly; `key` names the setting that gave
    the path in the message about a path to something else (a pretraining run, a kNN run, an encoder.pt, a timm / Hub
    model), and a damaged file (a field lost, weights that do not fit its own architecture) is one CheckpointError."""
    expected = f"a finished classification run folder or its {CLASSIFIER_FILE}"
    named = f"{key}={init}" if key else str(init)
    if str(init).startswith(NAMED_WEIGHTS):
        raise CheckpointError(f"{named} is a timm / Hub model, not a classifier this project trained: expected {expected}")
    if is_model_folder(init):
        raise CheckpointError(f"{named} is a timm / Hub model folder (an export), not a classification run: expected {expected}")
    try:
        payload = read_checkpoint(init, CLASSIFIER_FILE, CLASSIFIER_FORMAT, "classifier")
    except CheckpointError as e:
        raise (wrong_kind(str(init), CLASSIFIER_FILE, expected, key) or e) from None
    path = resolve_checkpoint_path(init, CLASSIFIER_FILE)
    check_classifier_fields(path, payload)
    if payload["arch"] not in ARCHS:
        raise CheckpointError(f"{path} holds a classifier of an unknown architecture {payload['arch']!r} (expected one of {', '.join(ARCHS)})")
    try:
        model = rebuild(payload["arch"], payload["build"])
    except (KeyError, TypeError, ValueError) as e:  # a field lost from "build", or one the model does not take
        raise CheckpointError(f"{path} is damaged: its 'build' makes no {payload['arch']} classifier ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160]})") from None  # fmt: skip
    build, classes = payload["build"], payload["classes"]
    outputs = build.get("num_classes", (build.get("config") or {}).get("num_classes"))
    if outputs != len(classes):  # eval would compare the wrong class list with the data's, an export label the logits wrongly
        raise CheckpointError(f"{path} is damaged: it names {len(classes)} classes, and its {payload['arch']} classifier has {outputs} outputs")
    state = payload["state_dict"]
    missing, unexpected = sorted(set(model.state_dict()) - set(state)), sorted(set(state) - set(model.state_dict()))
    wrong = misfits(state, model)
    if missing or unexpected or wrong:  # load_state_dict would raise a RuntimeError listing every tensor
        found = [f"missing {missing[:3]}" if missing else "", f"unexpected {unexpected[:3]}" if unexpected else "", wrong]
        raise CheckpointError(f"{path} does not match the {payload['arch']} classifier it records (checkpoint != classifier): "
                              f"{'; '.join(f for f in found if f)}")  # fmt: skip
    if bad := non_finite(state):  # eval scored its NaN logits as one hit in C classes (topk ranks NaN first), and exit 0
        raise CheckpointError(f"{path} holds weights that are not finite (NaN or inf): {bad}: the classifier diverged or the file "
                              "is damaged; nothing was written")  # fmt: skip
    model.load_state_dict(state, strict=True)
    return model, payload


# What a classifier.pt holds besides its state_dict, and of what type: `rebuild`, the exporter and `finetune.mode=eval` read them.
CLASSIFIER_FIELDS = {"arch": str, "build": dict, "classes": list, "data": dict}
DATA_FIELDS = {"image_size": (int, type(None)), "mean": (list, tuple), "std": (list, tuple)}
SPLIT_FIELDS = {"dataset": str, "val_size": int, "split_seed": int, "train_fraction": (int, float)}  # `vit.data.provenance.SPLIT_KEYS`


def check_classifier_fields(path: Path, payload: dict[str, Any]) -> None:
    """Refuse, naming the field, a classifier.pt with a field lost or of another type (damaged, or edited by hand): a
    KeyError or TypeError came out later as a traceback. An older classifier without `data.split` is no error."""
    split = payload["data"].get("split") if isinstance(payload.get("data"), dict) else None
    checks = [("", payload, CLASSIFIER_FIELDS), ("data.", payload.get("data"), DATA_FIELDS)]
    if split is not None:
        checks.append(("data.split.", split, SPLIT_FIELDS))
    for where, held, fields in checks:
        for name, kind in fields.items():
            value = held.get(name) if isinstance(held, dict) else None
            if not isinstance(value, kind) or isinstance(value, bool) or (isinstance(held, dict) and name not in held):
                raise CheckpointError(f"{path} is damaged: its '{where}{name}' is missing or not of type {type_names(kind)}")


def type_names(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("None" if k is type(None) else k.__name__ for k in kinds)


@torch.no_grad()
def classifier_as_vit(model: nn.Module, payload: dict[str, Any]) -> VisionTransformer:
    """A ViT classifier as one `VisionTransformer` with its head, timm's layout, giving the same logits in eval mode.

    A linear probe's BatchNorm (no affine, running statistics) folds into its Linear:
    W (x - mean) / sqrt(var + eps) + b = (W * s) x + (b - W (mean * s)), s = 1 / sqrt(var + eps).
    """
    arch, build = payload["arch"], payload["build"]
    if arch in ("vit", "timm_vit"):
        vit = VisionTransformer(**build["config"])
        vit.load_state_dict(model.state_dict(), strict=True)  # timm's ViT has our key names
        return vit.eval()
    if arch != "linear_probe":
        raise CheckpointError(f"a {arch} classifier is not a ViT: only ViT classifiers export to a timm ViT folder")
    vit = VisionTransformer(**{**build["config"], "num_classes": build["num_classes"], "global_pool": build["pool"]})
    bn, fc = model.head[0], model.head[1]
    scale = (bn.running_var.double() + bn.eps).rsqrt()  # (D,)
    weight = fc.weight.double() * scale  # (C, D)
    bias = fc.bias.double() - weight @ bn.running_mean.double()  # (C,)
    state = {**model.encoder.state_dict(), "head.weight": weight.float(), "head.bias": bias.float()}
    vit.load_state_dict(state, strict=True)
    return vit.eval()
