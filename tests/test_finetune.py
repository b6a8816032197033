"""Classification: MAE encoder loading, layer decay, linear probes (cached and not), baselines, eval mode."""

import json
from pathlib import Path

import pytest
import timm
import torch

from finetune.config import FinetuneConfig
from finetune.models import LinearProbe, build_classifier, load_classifier
from finetune.train import main as finetune
from helpers import reset_accelerate, tiny_overrides
from vit.config import load_config
from vit.train.optim import param_groups, set_lr
from vit.models.encoder import VisionTransformer

ROOT = Path(__file__).resolve().parents[1]


def summary(tmp_path, name) -> dict:
    return json.loads((tmp_path / "runs" / name / "summary.json").read_text())


def test_mae_encoder_loads_strictly_only_the_head_is_new(mae_run, tmp_path):
    cfg = load_config(FinetuneConfig, None, tiny_overrides(tmp_path) + [f"finetune.init={mae_run}"])
    built = build_classifier(cfg, num_classes=10)
    stored = torch.load(mae_run / "encoder.pt", weights_only=True)["state_dict"]
    mine = built.model.state_dict()
    assert set(mine) - set(stored) == {"head.weight", "head.bias"}
    for k, v in stored.items():
        assert torch.equal(mine[k], v), k
    assert built.parent == str(mae_run)


def test_mismatched_encoder_is_refused_naming_the_fields(mae_run, tmp_path, capsys):
    code = finetune(tiny_overrides(tmp_path, **{"model.depth": 3, "model.embed_dim": 64}) + [f"finetune.init={mae_run}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "depth: 2 != 3" in err and "embed_dim: 32 != 64" in err
    assert not (tmp_path / "runs" / "run" / "metrics.jsonl").exists()


def test_layer_decay_scales_first_and_last_block_and_head():
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=4, num_heads=2, num_classes=10)
    groups = param_groups(model, weight_decay=0.05, layer_decay=0.5, num_layers=4)
    scale = {}
    for g in groups:
        for p in g["params"]:
            scale[p] = (g["lr_scale"], g["weight_decay"])
    named = dict(model.named_parameters())
    assert scale[named["pos_embed"]] == (0.5**5, 0.0)  # embeddings: layer 0, no decay
    assert scale[named["patch_embed.proj.weight"]] == (0.5**5, 0.05)
    assert scale[named["blocks.0.attn.qkv.weight"]] == (0.5**4, 0.05)
    assert scale[named["blocks.3.mlp.fc2.weight"]] == (0.5**1, 0.05)
    assert scale[named["blocks.3.norm1.weight"]] == (0.5**1, 0.0)
    assert scale[named["head.weight"]] == (1.0, 0.05)
    assert scale[named["head.bias"]] == (1.0, 0.0)
    optimizer = torch.optim.AdamW(groups)
    set_lr(optimizer, 1e-3)
    lrs = {p: g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert lrs[named["blocks.0.attn.qkv.weight"]] == pytest.approx(1e-3 * 0.5**4)
    assert lrs[named["head.weight"]] == pytest.approx(1e-3)


@pytest.mark.slow
def test_short_finetune_beats_chance_and_eval_mode_reproduces_it(mae_run, tmp_path, capsys):
    args = tiny_overrides(tmp_path, name="ft", **{"schedule.epochs": 3, "optim.lr": 2e-3}) + [f"finetune.init={mae_run}", "aug.mixup=0.2"]
    assert finetune(args) == 0
    s = summary(tmp_path, "ft")
    assert s["job_type"] == "finetune" and s["parent"] == str(mae_run)
    assert s["final_val_top1"] > 0.3 and s["final_test_top1"] > 0.3  # chance is 0.1
    assert s["data"]["val"] == 40 and s["data"]["test"] == 64
    for name in ("classifier.pt", "confusion_val.png", "confusion_test.png", "config.yaml", "metrics.jsonl"):
        assert (tmp_path / "runs" / "ft" / name).is_file(), name
    assert len(s["val_per_class"]) == 10
    reset_accelerate()
    # with a training recipe's patch dropout on the command line, which eval mode accepts and leaves unused
    eval_args = tiny_overrides(tmp_path, name="ft_eval") + ["finetune.mode=eval", f"finetune.init={tmp_path / 'runs' / 'ft'}", "finetune.patch_keep=0.5"]
    assert finetune(eval_args) == 0
    e = summary(tmp_path, "ft_eval")
    assert e["val_top1"] == s["final_val_top1"] and e["test_top1"] == s["final_test_top1"]
    reset_accelerate()
    # generated data is rebuilt at the size it was trained at (it was built at the default 1024 images, another set)
    bare = [a for a in tiny_overrides(tmp_path, name="ft_eval2") if not a.startswith("data.synthetic_size")]
    # model settings on the command line: the classifier is rebuilt as saved, and a line says they go unused
    capsys.readouterr()
    assert finetune(bare + ["finetune.mode=eval", f"finetune.init={tmp_path / 'runs' / 'ft'}", "model.name=vit_cifar_small",
                            "finetune.probe_pool=avg"]) == 0
    said = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("eval: the classifier is rebuilt"))
    assert said.startswith("eval: the classifier is rebuilt as it was saved (vit); model.name=vit_cifar_small, ")
    assert said.endswith(", finetune.probe_pool=avg not used")
    e = summary(tmp_path, "ft_eval2")
    assert e["data"]["test"] == 64 and e["val_top1"] == s["final_val_top1"] and e["test_top1"] == s["final_test_top1"]


def probe(tmp_path, name, init, cached, epochs=3):
    no_aug = {"data.crop_scale": "[1.0,1.0]", "data.crop_ratio": "[1.0,1.0]", "data.hflip": False}
    args = tiny_overrides(tmp_path, name=name, **{"schedule.epochs": epochs, "optim.lr": 0.05, **no_aug}) + [
        "finetune.mode=linear", f"finetune.init={init}", f"finetune.probe_cache={cached}", "optim.name=sgd", "optim.weight_decay=0",
        "finetune.label_smoothing=0",
    ]
    assert finetune(args) == 0
    reset_accelerate()
    return summary(tmp_path, name)


def test_a_resumed_cached_probe_counts_the_features_of_every_session(mae_run, tmp_path):
    """Each session of a cached probe computes its features again, but the summary counted the last session's alone: its
    wall_time_sec (a probe's minutes in the equal-compute table, which checks it fits its budget) was short, its rates high."""
    args = tiny_overrides(tmp_path, name="probe", **{"run.save_every": 1}) + ["finetune.mode=linear", f"finetune.init={mae_run}"]
    assert finetune(args + ["schedule.max_steps=2"]) == 0
    reset_accelerate()
    states = tmp_path / "runs" / "probe" / "states"
    first = json.loads((sorted(states.iterdir())[-1] / "trainer.json").read_text())["feature_time"]
    assert finetune(args + ["schedule.max_steps=4", "run.resume=auto"]) == 0
    reset_accelerate()
    last = json.loads((sorted(states.iterdir())[-1] / "trainer.json").read_text())
    s = summary(tmp_path, "probe")
    assert 0 < first < last["feature_time"] and s["feature_time_sec"] == round(last["feature_time"], 2)
    # the training time the summary adds is the run's own clock at its end, which the last state read a moment before
    assert s["wall_time_sec"] == pytest.approx(last["train_time"] + last["feature_time"], abs=0.1)


@pytest.mark.slow
def test_cached_and_uncached_probes_agree_and_encoder_stays_frozen(mae_run, tmp_path):
    cached = probe(tmp_path, "cached", mae_run, True)
    uncached = probe(tmp_path, "uncached", mae_run, False)
    assert cached["cached_features"] and not uncached["cached_features"]
    # A cached probe has two rates, named for what they count; `images_per_sec`, the stage's rate in every summary, is the
    # encoder's (what its images cost). An uncached one has the one. (Which is faster is a timing, not asserted: a
    # loaded machine can slow the head's few tiny steps more than the feature pass.)
    assert cached["feature_images_per_sec"] > 0 and cached["head_images_per_sec"] > 0
    assert cached["images_per_sec"] == cached["feature_images_per_sec"]
    assert uncached["images_per_sec"] > 0 and "feature_images_per_sec" not in uncached
    assert cached["final_val_top1"] == uncached["final_val_top1"]
    assert cached["final_test_top1"] == uncached["final_test_top1"]
    a, _ = load_classifier(tmp_path / "runs" / "cached")
    b, _ = load_classifier(tmp_path / "runs" / "uncached")
    torch.testing.assert_close(a.head[1].weight, b.head[1].weight, rtol=1e-3, atol=1e-4)
    # The frozen encoder left both probes exactly as it came from pretraining.
    stored = torch.load(mae_run / "encoder.pt", weights_only=True)["state_dict"]
    for model in (a, b):
        assert isinstance(model, LinearProbe)
        for k, v in model.encoder.state_dict().items():
            assert torch.equal(v, stored[k]), k
        assert model.head[0].running_mean.abs().sum() > 0  # the head's own BatchNorm did learn its statistics


@pytest.mark.slow
def test_random_encoder_probe_is_a_supported_baseline(tmp_path):
    s = probe(tmp_path, "random", "scratch", True)
    assert s["job_type"] == "linprobe" and s["init"] == "scratch"
    # Colour alone separates the synthetic classes, so even random features carry them: well above chance (0.1).
    assert s["final_val_top1"] > 0.3 and s["final_test_top1"] > 0.3


def test_data_eval_batch_size_sets_every_batch_where_nothing_trains(tmp_path, monkeypatch):
    from vit.data.loaders import Data

    sizes, loader = [], Data.loader
    monkeypatch.setattr(Data, "loader", lambda self, images, batch, **kw: sizes.append((kw["train"], batch)) or loader(self, images, batch, **kw))
    args = tiny_overrides(tmp_path, name="ev", **{"schedule.max_steps": 2, "data.eval_batch_size": 7}) + ["finetune.mode=linear", "finetune.init=scratch"]
    assert finetune(args) == 0
    assert sorted(set(sizes)) == [(False, 7)]  # a cached probe: the features of every split, no augmented batch
    sizes.clear()
    reset_accelerate()
    assert finetune(tiny_overrides(tmp_path, name="ev_ft", **{"schedule.max_steps": 2, "data.eval_batch_size": 7})) == 0
    assert sorted(set(sizes)) == [(False, 7), (True, 32)]


def test_local_timm_weights_file_loads_with_resampling_and_gives_timms_outputs(tmp_path):
    torch.manual_seed(0)
    # A "pretrained" timm ViT at another resolution, saved as a local weights file.
    source = timm.models.vision_transformer.VisionTransformer(img_size=64, patch_size=16, embed_dim=32, depth=2, num_heads=2, num_classes=1000)
    weights = tmp_path / "vit.pth"
    torch.save(source.state_dict(), weights)
    overrides = tiny_overrides(tmp_path, **{"model.patch_size": 8}) + ["finetune.init=timm:vit_tiny_patch16_224", f"finetune.init_file={weights}"]
    cfg = load_config(FinetuneConfig, None, overrides)
    ours = build_classifier(cfg, num_classes=10).model.eval()
    # timm itself, loading the same file at our resolution (it resamples pos and patch embeddings too).
    theirs = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10)
    from timm.models.vision_transformer import checkpoint_filter_fn

    state = checkpoint_filter_fn(torch.load(weights, weights_only=True), theirs)
    state = {k: v for k, v in state.items() if not k.startswith("head.")}
    theirs.load_state_dict(state, strict=False)
    theirs.head.load_state_dict(ours.head.state_dict())
    theirs.eval()
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-4)


def test_our_own_checkpoint_given_as_timm_weights_is_refused_naming_the_init_that_reads_it(tmp_path, capsys):
    """An encoder.pt passed as finetune.init_file loaded as "timm weights": no parent, no overlap check, job type baseline."""
    weights = tmp_path / "encoder.pt"
    torch.save({"format": "vit-encoder/1", "config": {"embed_dim": 32}, "state_dict": {"cls_token": torch.zeros(1, 1, 32)}, "meta": {}}, weights)
    code = finetune(tiny_overrides(tmp_path) + ["finetune.init=timm:vit_tiny_patch16_224", f"finetune.init_file={weights}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "vit-encoder/1 checkpoint, not a timm weights file" in err and f"finetune.init={weights}" in err


def test_unreachable_hub_and_missing_file_are_one_line_errors(tmp_path, capsys, monkeypatch):
    code = finetune(tiny_overrides(tmp_path) + ["finetune.init=timm:vit_tiny_patch16_224", f"finetune.init_file={tmp_path / 'nope.pth'}"])
    assert code == 2 and "nope.pth does not exist" in capsys.readouterr().err
    # No weights file and no hub: refused at once with one line, no retry loop.
    import vit.store.hub

    monkeypatch.setattr(vit.store.hub, "hub_host", lambda: ("127.0.0.1", 9))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty hub cache
    code = finetune(tiny_overrides(tmp_path, name="hub") + ["finetune.init=timm:vit_tiny_patch16_224"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "unreachable" in err and "finetune.init_file" in err


@pytest.mark.parametrize("config", ["vit_scratch_cpu", "timm_vit_scratch_cpu", "resnet18_cpu", "timm_vit_pretrained"])
@pytest.mark.slow
def test_every_baseline_config_runs(tmp_path, config):
    fewer = {"data.synthetic_size": 104} if config == "resnet18_cpu" else {}  # a full ResNet-18: 2 steps, not 6
    overrides = tiny_overrides(tmp_path, name=config, **{"schedule.epochs": 1, **fewer})
    if config == "timm_vit_pretrained":
        # No hub here: a local timm weights file of the tiny size at another resolution stands in for the download.
        source = timm.models.vision_transformer.VisionTransformer(img_size=64, patch_size=16, embed_dim=32, depth=2, num_heads=2)
        torch.save(source.state_dict(), tmp_path / "weights.pth")
        overrides += [f"finetune.init_file={tmp_path / 'weights.pth'}", "model.img_size=32"]
    path = ROOT / "configs" / "baselines" / f"{config}.yaml"
    assert finetune(["--config", str(path)] + overrides) == 0
    s = summary(tmp_path, config)
    assert s["job_type"] == "baseline" and s["epochs"] == 1 and s["steps"] == s["data"]["train"] // 32
    # One epoch at the recipe's warmup is too short to learn; what must hold is that classifier.pt is the model
    # the summary measured: evaluating it again gives the same accuracies.
    reset_accelerate()
    assert finetune(tiny_overrides(tmp_path, name="eval", **fewer) + ["finetune.mode=eval", f"finetune.init={tmp_path / 'runs' / config}"]) == 0
    e = summary(tmp_path, "eval")
    assert (e["val_top1"], e["test_top1"]) == (s["final_val_top1"], s["final_test_top1"])
    model, payload = load_classifier(tmp_path / "runs" / config)
    assert payload["arch"] == {"vit_scratch_cpu": "vit", "timm_vit_scratch_cpu": "timm_vit", "resnet18_cpu": "resnet18", "timm_vit_pretrained": "vit"}[config]


@pytest.mark.parametrize("arch", ["vit", "timm_vit"])
@pytest.mark.slow
def test_patch_dropout_trains_on_the_kept_fraction_and_evaluates_on_every_patch(tmp_path, monkeypatch, arch):
    import timm.layers

    seen = []  # patch tokens per image that reach the blocks, and whether the model was training
    if arch == "vit":
        original = VisionTransformer.forward_features

        def spy(self, x, ids_keep=None):
            out = original(self, x, ids_keep)
            seen.append((out.shape[1] - 1, self.training))
            return out

        monkeypatch.setattr(VisionTransformer, "forward_features", spy)
    else:
        original = timm.layers.PatchDropout.forward

        def spy(self, x):
            out = original(self, x)
            seen.append((out.shape[1] - self.num_prefix_tokens, self.training))
            return out

        monkeypatch.setattr(timm.layers.PatchDropout, "forward", spy)
    overrides = tiny_overrides(tmp_path, **{"schedule.epochs": 3, "optim.lr": 2e-3, "finetune.patch_keep": 0.5, "finetune.arch": arch, "finetune.layer_decay": "null"})
    assert finetune(overrides) == 0
    patches = (32 // 8) ** 2  # tiny_overrides: 32 px, patch 8
    assert {n for n, training in seen if training} == {patches // 2}
    assert {n for n, training in seen if not training} == {patches}
    assert summary(tmp_path, "run")["final_val_top1"] > 0.3  # it learns on half the patches (chance is 0.1)


@pytest.mark.parametrize("extra", [{"finetune.arch": "resnet18"}, {"finetune.mode": "linear"}, {"finetune.patch_keep": 0.0}])
def test_patch_dropout_where_it_cannot_apply_is_a_one_line_error(tmp_path, capsys, extra):
    overrides = tiny_overrides(tmp_path, **{"finetune.patch_keep": 0.5, **extra})
    assert finetune(overrides) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: finetune.patch_keep")


@pytest.mark.parametrize("extra, message", [
    # The probe's BatchNorm1d in training: a traceback ("Expected more than 1 value per channel") at the first step.
    ({"optim.batch_size": 1, "finetune.mode": "linear"}, "error: optim.batch_size must be at least 2 for finetune.mode=linear"),
    # Mixup and cutmix skipped every (always full, odd) batch: the run trained without the mixing its config records.
    ({"optim.batch_size": 7}, "error: optim.batch_size is odd (7): mixup and cutmix (aug.mixup=0.8, aug.cutmix=1) mix pairs"),
])  # fmt: skip
def test_a_batch_the_classifier_cannot_train_on_as_configured_is_a_one_line_error(tmp_path, capsys, extra, message):
    assert finetune(tiny_overrides(tmp_path, **extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
    # Without the mixing (or in the modes that do not mix), an odd batch is fine.
    from finetune.config import FinetuneConfig
    from vit.config import load_config

    for fine in ({"optim.batch_size": 7, "aug.mix_prob": 0}, {"optim.batch_size": 7, "finetune.mode": "linear"}):
        load_config(FinetuneConfig, None, tiny_overrides(tmp_path, **fine))


def test_cached_features_are_extracted_in_eval_mode_even_with_dropout_and_drop_path():
    from vit.models.encoder import create_model
    from finetune.features import extract_features
    from vit.data.augment import BatchLoader
    from vit.data.sources.arrays import make_synthetic
    from accelerate import Accelerator

    torch.manual_seed(0)
    encoder = create_model("vit_cifar_tiny", embed_dim=32, depth=2, num_heads=2, patch_size=8, num_classes=0,
                           drop_rate=0.3, drop_path_rate=0.5)  # fmt: skip
    probe = LinearProbe(encoder, num_classes=10)  # freshly built: in training mode, as the cached probe gets it
    assert probe.training and probe.encoder.training
    images = make_synthetic(64, 0)["train"]
    loader = BatchLoader(images, 16, train=False, device="cpu", mean=(0.5,) * 3, std=(0.5,) * 3, out_size=32)
    acc = Accelerator(cpu=True)
    first, labels = extract_features(probe, loader, acc)
    second, _ = extract_features(probe, loader, acc)
    probe.eval()
    reference = torch.cat([probe.features(x) for x, _ in loader.epoch(0)])
    assert torch.equal(first, second) and torch.equal(first, reference) and torch.equal(labels, images.labels)


def test_mae_fine_tuning_starts_from_a_head_near_zero(mae_run, tmp_path):
    cfg = load_config(FinetuneConfig, None, tiny_overrides(tmp_path) + [f"finetune.init={mae_run}"])
    head = build_classifier(cfg, num_classes=10).model.head
    assert 1e-5 < head.weight.std().item() < 4e-5 and not head.bias.any()  # std 2e-5, as MAE initialises it
    scratch = build_classifier(load_config(FinetuneConfig, None, tiny_overrides(tmp_path)), num_classes=10).model.head
    assert scratch.weight.std().item() > 0.05  # a scratch model keeps its own initialisation


def test_an_init_of_the_wrong_kind_is_one_line_saying_what_it_is(mae_run, tmp_path, capsys, monkeypatch):
    from vit.store.checkpoint import CLASSIFIER_FORMAT

    classification = tmp_path / "ft"  # what a classification run folder holds for this purpose: a classifier.pt
    classification.mkdir()
    torch.save({"format": CLASSIFIER_FORMAT}, classification / "classifier.pt")
    unfinished = tmp_path / "unfinished"  # a pretraining run that has not written encoder.pt yet
    unfinished.mkdir()
    (unfinished / "config.yaml").write_text((mae_run / "config.yaml").read_text())
    state = next((mae_run / "states").iterdir())
    cases = {
        classification: "is a classification run folder (classifier.pt): expected a pretraining run folder or its encoder.pt",
        classification / "classifier.pt": "is a classifier checkpoint: expected a pretraining run folder",
        mae_run / "mae.pt": "is a whole masked autoencoder (mae.pt): expected a pretraining run folder or its encoder.pt",
        unfinished: "is a pretraining run without its encoder.pt (unfinished",
        state: f"is a resume state of the run {mae_run}",
        mae_run.parent: "is a folder of 1 run folders (mae), not one run",
    }
    for init, message in cases.items():
        assert finetune(tiny_overrides(tmp_path) + [f"finetune.init={init}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"error: finetune.init={init} {message}" in err, err
    # eval mode names a pretraining run as such; a relative path that is not there names the folder it was looked in
    assert finetune(tiny_overrides(tmp_path) + ["finetune.mode=eval", f"finetune.init={mae_run}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"finetune.init={mae_run} is a pretraining run folder (encoder.pt): expected a finished classification run" in err
    monkeypatch.chdir(tmp_path)
    assert finetune(tiny_overrides(tmp_path) + ["finetune.init=runs/mae"]) == 2
    assert f"finetune.init=runs/mae does not exist in the current folder {tmp_path}" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "run").exists()  # refused before the run folder was made


def test_an_encoder_of_an_unfinished_pretraining_run_is_used_with_a_warning(mae_run, tmp_path, capsys):
    import shutil

    unfinished = tmp_path / "mae"  # a pretraining run still training (or stopped): encoder.pt refreshed, no summary yet
    unfinished.mkdir()
    for name in ("config.yaml", "encoder.pt"):
        shutil.copy(mae_run / name, unfinished / name)
    step = torch.load(unfinished / "encoder.pt", weights_only=True)["step"]
    for name, init in (("finished", mae_run), ("unfinished", unfinished / "encoder.pt")):
        assert finetune(tiny_overrides(tmp_path, name=name) + ["finetune.mode=knn", f"finetune.init={init}"]) == 0
        reset_accelerate()
        err = capsys.readouterr().err
        if name == "finished":
            assert "has not finished" not in err
        else:
            assert f"warning: the pretraining run {unfinished} has not finished" in err
            assert f"the encoder of step {step}, not its final one" in err


def test_a_baseline_config_evaluates_its_finished_run_in_eval_mode(tmp_path):
    # eval mode takes the classifier's own arch, so the resnet18 recipe's `arch` and `init: scratch` rule must not refuse it
    # (as a training recipe's patch_keep is accepted there)
    config = ROOT / "configs" / "baselines" / "resnet18_cpu.yaml"
    cfg = load_config(FinetuneConfig, config, ["finetune.mode=eval", f"finetune.init={tmp_path / 'runs' / 'resnet18'}"])
    assert cfg.finetune.arch == "resnet18" and cfg.finetune.mode == "eval"
    from vit.errors import ConfigError

    with pytest.raises(ConfigError, match="finetune.init must be scratch for the resnet18 baseline"):
        load_config(FinetuneConfig, config, [f"finetune.init={tmp_path / 'runs' / 'mae'}"])  # training from an encoder: refused


def test_a_resume_from_another_pretraining_run_s_encoder_is_refused(mae_run, tmp_path, capsys):
    # finetune.init may change on a resume (a moved folder), and did so for any encoder: the run continued its state
    # while summary.json named the new init's run as its parent, and config.yaml the first one's.
    import shutil

    moved = tmp_path / "moved"  # the same pretraining run in another folder: its encoder records where it was trained
    shutil.copytree(mae_run, moved)
    args = tiny_overrides(tmp_path, name="ft", **{"schedule.max_steps": 1, "run.save_every": 1}) + ["finetune.mode=linear", "finetune.probe_cache=false"]
    assert finetune(args + [f"finetune.init={mae_run}"]) == 0
    reset_accelerate()
    capsys.readouterr()
    assert finetune(args + ["finetune.init=scratch", "run.resume=auto", "schedule.max_steps=2"]) == 2
    reset_accelerate()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"was started from the encoder of {mae_run}, and finetune.init now names no pretraining run's encoder" in err
    assert summary(tmp_path, "ft")["steps"] == 1
    assert finetune(args + [f"finetune.init={moved}", "run.resume=auto", "schedule.max_steps=2"]) == 0
    reset_accelerate()
    assert summary(tmp_path, "ft")["steps"] == 2 and summary(tmp_path, "ft")["parent"] == str(mae_run)
    # weights named rather than found in a run folder have no parent to compare: the names are (scratch -> timm: went on)
    scratch = tiny_overrides(tmp_path, name="scratch", **{"schedule.max_steps": 1, "run.save_every": 1}) + ["finetune.init=scratch"]
    assert finetune(scratch) == 0
    reset_accelerate()
    capsys.readouterr()
    assert finetune(scratch + ["finetune.init=timm:vit_tiny_patch16_224", "run.resume=auto", "schedule.max_steps=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was started from finetune.init=scratch, and this one names timm:vit_tiny_patch16_224" in err, err
