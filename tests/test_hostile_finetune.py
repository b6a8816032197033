"""Hostile tests of the classification stage's models and training: mixup / cutmix and label smoothing held to timm's
`Mixup` and `SoftTargetCrossEntropy`, our ViT held to timm's `VisionTransformer` step for step, the linear probe's
frozen encoder and its BatchNorm, a training stage's set-up errors against a run it would replace, the pooling each
mode reads, and the rank synchronisation of a classifier that is not on the accelerator's device yet."""

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import image_tree, reset_accelerate, tiny_overrides
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy

from finetune.config import FinetuneConfig
from finetune.loss import make_loss
from finetune.models import Built, LinearProbe, build_classifier, load_classifier, save_classifier
from finetune.train import main as finetune
from vit.config import load_config
from vit.errors import CheckpointError, ConfigError
from vit.models.encoder import create_model
from vit.tools.reference import timm_vit
from vit.train.optim import param_groups, set_lr

ROOT = Path(__file__).resolve().parents[1]


def config(tmp_path, *overrides: str) -> FinetuneConfig:
    return load_config(FinetuneConfig, None, tiny_overrides(tmp_path) + list(overrides))


# --------------------------------------------------------------------------- mixing and smoothing, against timm


@pytest.mark.parametrize("mixup, cutmix, prob, switch, smoothing", [
    (0.8, 1.0, 1.0, 0.5, 0.1),  # MAE's fine-tuning recipe: both, switching
    (0.0, 1.0, 1.0, 0.5, 0.1),  # cutmix alone: lambda corrected for the box clipped at the border
    (0.8, 0.0, 0.6, 0.5, 0.0),  # mixup alone on some batches; the others keep their (soft) one-hot targets
])  # fmt: skip
def test_mixed_batches_and_their_loss_are_timms_mixup_and_soft_target_cross_entropy(tmp_path, mixup, cutmix, prob, switch, smoothing):
    cfg = config(tmp_path, f"aug.mixup={mixup}", f"aug.cutmix={cutmix}", f"aug.mix_prob={prob}", f"aug.switch_prob={switch}",
                 f"finetune.label_smoothing={smoothing}")  # fmt: skip
    loss_fn = make_loss(cfg, 10)
    reference = Mixup(mixup_alpha=mixup, cutmix_alpha=cutmix, prob=prob, switch_prob=switch, label_smoothing=smoothing, num_classes=10)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 10))
    for draw in range(12):
        x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 10, (6,))
        np.random.seed(draw)  # timm's Mixup draws its lambda, box and switch from numpy's global generator
        ours = loss_fn.prepare(x.clone(), y.clone())
        np.random.seed(draw)
        theirs = reference(x.clone(), y.clone())
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1]), draw
        loss, _ = loss_fn(model, *ours)
        torch.testing.assert_close(loss, SoftTargetCrossEntropy()(model(theirs[0]), theirs[1]))


def test_unmixed_label_smoothing_is_the_soft_target_loss_of_smoothed_one_hot_targets(tmp_path):
    loss_fn = make_loss(config(tmp_path, "aug.mixup=0", "aug.cutmix=0", "finetune.label_smoothing=0.2"), 10)
    assert not hasattr(loss_fn, "prepare")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 10))
    x, y = torch.randn(5, 3, 8, 8), torch.randint(0, 10, (5,))
    soft = torch.full((5, 10), 0.2 / 10).scatter_(1, y[:, None], 1 - 0.2 + 0.2 / 10)  # timm's mixup_target at lambda 1
    torch.testing.assert_close(loss_fn(model, x, y)[0], SoftTargetCrossEntropy()(model(x), soft))


# --------------------------------------------------------------------------- our ViT against timm's, training


@pytest.mark.parametrize("pool", ["token", "avg"])
def test_our_vit_and_timms_take_the_same_fine_tuning_steps_from_the_same_weights(tmp_path, pool):
    """The classifier `finetune.arch=vit` trains and the one `finetune.arch=timm_vit` trains, from one initialisation, with
    layer-wise decay, weight decay groups and label smoothing: the same weights after each AdamW step (no dropout)."""
    cfg = config(tmp_path, f"model.global_pool={pool}", "model.attn_impl=sdpa", "aug.mixup=0", "aug.cutmix=0")
    torch.manual_seed(0)
    ours = build_classifier(cfg, num_classes=10).model
    theirs = timm_vit(ours.config)
    theirs.load_state_dict(ours.state_dict())
    loss_fn, depth = make_loss(cfg, 10), ours.config["depth"]
    optimizers = [torch.optim.AdamW(param_groups(m, 0.05, 0.75, depth), betas=(0.9, 0.999)) for m in (ours, theirs)]
    for step in range(4):
        x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
        for model, optimizer in zip((ours, theirs), optimizers):
            set_lr(optimizer, 1e-3)
            optimizer.zero_grad()
            loss_fn(model, x, y)[0].backward()
            optimizer.step()
        for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name} after step {step}")


# --------------------------------------------------------------------------- the linear probe


def tiny_probe(**encoder) -> LinearProbe:
    torch.manual_seed(0)
    return LinearProbe(create_model("vit_cifar_tiny", embed_dim=32, depth=2, num_heads=2, patch_size=8, num_classes=0, **encoder), 10)


def test_a_probe_trains_its_head_alone_and_its_encoder_runs_as_in_evaluation():
    """Dropout, attention dropout and drop path are off in the frozen encoder while the head trains; the encoder's
    weights and buffers stay as they were, and it gets no gradient."""
    probe = tiny_probe(drop_rate=0.3, attn_drop_rate=0.3, drop_path_rate=0.5).train()
    before = {k: v.clone() for k, v in probe.encoder.state_dict().items()}
    assert probe.training and not any(m.training for m in probe.encoder.modules())
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    with torch.no_grad():
        reference = probe.eval().features(x)
    probe.train()
    optimizer = torch.optim.SGD(param_groups(probe, 0.05), lr=0.1, momentum=0.9)
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(probe(x), y).backward()
        optimizer.step()
        assert torch.equal(probe.features(x), reference)
    assert all(p.grad is None for p in probe.encoder.parameters())
    assert all(torch.equal(v, before[k]) for k, v in probe.encoder.state_dict().items())
    assert probe.head[0].num_batches_tracked == 3 and probe.head[1].weight.grad is not None


def test_a_training_batch_of_one_image_is_normalised_by_the_running_statistics_not_a_value_error():
    """BatchNorm1d raised 'Expected more than 1 value per channel when training' mid-run: the stream loader leaves a
    training batch short where images do not decode (data.skip_bad_images), one image at the least."""
    probe = tiny_probe().train()
    probe.head[0].running_mean.fill_(0.5)
    probe.head[0].running_var.fill_(4.0)
    x = torch.randn(1, 3, 32, 32)
    logits = probe(x)
    norm, linear = probe.head
    torch.testing.assert_close(logits, linear((probe.features(x) - 0.5) / (4.0 + norm.eps) ** 0.5))
    assert norm.num_batches_tracked == 0 and torch.all(norm.running_mean == 0.5)  # one image updates no statistic
    logits.sum().backward()
    assert linear.weight.grad is not None
    probe(torch.randn(2, 3, 32, 32))  # two or more: the batch's own statistics, as before
    assert norm.num_batches_tracked == 1


def test_a_probe_classifier_whose_pooling_is_no_pooling_is_refused_as_damaged(tmp_path):
    """A classifier.pt whose 'build' names another pooling (edited by hand) was evaluated and exported pooling [CLS]."""
    probe = tiny_probe()
    data = {"dataset": "synthetic", "image_size": 32, "mean": [0.5] * 3, "std": [0.5] * 3}
    path = tmp_path / "classifier.pt"
    save_classifier(path, Built(probe, "linear_probe", {"config": probe.encoder.config, "num_classes": 10, "pool": "max"}), probe,
                    [str(c) for c in range(10)], data, step=1)  # fmt: skip
    with pytest.raises(CheckpointError) as e:
        load_classifier(path)
    assert str(e.value) == (f"{path} is damaged: its 'build' makes no linear_probe classifier (ValueError: pool must be 'token' or "
                            "'avg', got 'max')")  # fmt: skip


def bad_image_tree(root: Path) -> Path:
    """3 classes x 9 training and 2 test images, 3 training files of each class undecodable."""
    return image_tree(root, bad=lambda split, label, i: split == "train" and i % 3 == 0)


def test_an_uncached_probe_of_streamed_images_with_some_undecodable_trains_to_its_end(tmp_path):
    root = bad_image_tree(tmp_path / "tree")
    args = tiny_overrides(tmp_path, name="probe", **{"data.dataset": "imagefolder", "data.root": root, "data.loader": "stream",
                                                     "data.workers": 1, "data.skip_bad_images": True, "data.val_size": 0,
                                                     "model.img_size": 16, "model.patch_size": 4, "optim.batch_size": 2,
                                                     "schedule.epochs": 1})  # fmt: skip
    assert finetune(args + ["finetune.mode=linear", "finetune.probe_cache=false"]) == 0
    assert (tmp_path / "runs" / "probe" / "classifier.pt").is_file()


# --------------------------------------------------------------------------- set-up errors and the run they would replace


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file of a run folder but the lock of the process that holds it (this one, until it exits)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "run.lock"}


@pytest.mark.parametrize("mode", [["finetune.mode=full"], ["finetune.mode=linear", "finetune.probe_cache=true"],
                                  ["finetune.mode=linear", "finetune.probe_cache=false"]])  # fmt: skip
def test_a_batch_larger_than_the_training_split_leaves_the_run_it_would_replace_whole(tmp_path, capsys, mode):
    """The stage cleared the finished run that run.overwrite=true replaces (classifier.pt, summary, metrics, states)
    before `train` built its loaders and schedule, and only then refused the batch: nothing was left of either run."""
    args = tiny_overrides(tmp_path, name="done", **{"schedule.max_steps": 1}) + mode
    assert finetune(args) == 0
    reset_accelerate()
    run_dir = tmp_path / "runs" / "done"
    before = snapshot(run_dir)
    assert "classifier.pt" in before and "summary.json" in before
    capsys.readouterr()
    assert finetune(args + ["optim.batch_size=512", "run.overwrite=true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "512" in err and ("fewer than a batch" in err or "larger than the training set" in err), err
    assert snapshot(run_dir) == before


# --------------------------------------------------------------------------- the pooling each mode reads


@pytest.mark.parametrize("overrides, message", [
    (["finetune.mode=linear", "model.global_pool=avg"],
     "model.global_pool=avg is unused by finetune.mode=linear, which pools by finetune.probe_pool=token: set finetune.probe_pool=avg"),
    (["finetune.mode=knn", "model.global_pool=avg"],
     "model.global_pool=avg is unused by finetune.mode=knn, which pools by finetune.probe_pool=token: set finetune.probe_pool=avg"),
    (["finetune.mode=full", "finetune.probe_pool=avg"],
     "finetune.probe_pool=avg is unused by finetune.mode=full, which pools by model.global_pool=token: set model.global_pool=avg"),
])  # fmt: skip
def test_a_pooling_the_mode_does_not_read_is_refused_when_it_differs_from_the_one_it_reads(tmp_path, overrides, message):
    """A probe pooled [CLS] under model.global_pool=avg, a fine-tune [CLS] under finetune.probe_pool=avg, unsaid, while
    config.yaml recorded the average."""
    with pytest.raises(ConfigError) as e:
        config(tmp_path, *overrides)
    assert str(e.value) == message


@pytest.mark.parametrize("overrides", [
    ["finetune.mode=linear", "finetune.probe_pool=avg"],
    ["finetune.mode=knn", "finetune.probe_pool=avg", "model.global_pool=avg"],
    ["finetune.mode=full", "model.global_pool=avg"],
    ["finetune.mode=full", "model.global_pool=avg", "finetune.probe_pool=avg"],
    ["finetune.mode=eval", "finetune.init=runs/ft", "finetune.probe_pool=avg"],  # eval says what it leaves unused
])  # fmt: skip
def test_poolings_that_agree_or_go_unset_are_accepted(tmp_path, overrides):
    config(tmp_path, *overrides)


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*/*.yaml")
                                        if p.parent.name in ("finetune", "baselines")))  # fmt: skip
def test_every_classification_config_reads_the_pooling_it_sets(path):
    load_config(FinetuneConfig, ROOT / path, [])
