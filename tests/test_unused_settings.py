"""Settings a run will not read are said once at its start: a probe's aug and layer decay, the other optimiser's terms."""

import pytest
from helpers import ROOT, tiny_overrides

from finetune.config import FinetuneConfig
from pretrain.config import PretrainConfig
from vit.config import OptimConfig, load_config
from vit.train.run import Run

RECIPES = sorted(
    p.relative_to(ROOT).as_posix() for d in ("pretrain", "finetune", "baselines") for p in (ROOT / "configs" / d).glob("*.yaml")
)


def finetune_config(*overrides: str, path: str | None = None) -> FinetuneConfig:
    return load_config(FinetuneConfig, ROOT / path if path else None, list(overrides))


def test_the_optimiser_says_the_other_optimisers_terms():
    assert OptimConfig(name="adamw", momentum=0.5).unused() == ["optim.momentum=0.5 (optim.name=adamw reads optim.betas)"]
    assert OptimConfig(name="lars", betas=(0.9, 0.999)).unused() == ["optim.betas=[0.9, 0.999] (optim.name=lars reads optim.momentum)"]
    assert OptimConfig(name="sgd", momentum=0.5).unused() == OptimConfig(name="adamw", betas=(0.9, 0.999)).unused() == []


def test_a_probe_says_the_augmentation_and_layer_decay_it_does_not_read():
    cfg = finetune_config(
        "optim.batch_size=8", "aug.mixup=0.2", "aug.policy=randaug", "finetune.layer_decay=0.65", path="configs/finetune/linprobe_cpu.yaml"
    )
    said = cfg.unused()
    assert [s.split(" ")[0] for s in said] == ["aug.policy=randaug", "aug.mixup=0.2", "finetune.layer_decay=0.65"]
    assert "crop and flip" in said[0]
    # The same settings in a fine-tune are read.
    assert finetune_config("aug.mixup=0.2", "aug.policy=randaug", "finetune.layer_decay=0.65").unused() == []


def test_knn_and_the_baselines_say_what_they_do_not_read():
    knn = finetune_config("finetune.mode=knn", "aug.random_erase=0.5", "optim.momentum=0.5", "finetune.probe_cache=false")
    assert [s.split(" ")[0] for s in knn.unused()] == ["aug.random_erase=0.5", "finetune.probe_cache=False"]  # kNN has no optimiser
    resnet = finetune_config("finetune.arch=resnet18", "finetune.layer_decay=0.5", "finetune.knn_k=5", "model.drop_path_rate=0.1")
    said = [s.split(" ")[0] for s in resnet.unused()]
    assert said == ["model.drop_path_rate=0.1", "finetune.layer_decay=0.5", "finetune.knn_k=5"]
    # Eval mode says its own (finetune.train.unused_in_eval): the classifier is rebuilt as it was saved.
    assert finetune_config("finetune.mode=eval", "finetune.init=runs/x", "aug.mixup=0.2").unused() == []


@pytest.mark.parametrize("path", RECIPES)
def test_every_recipe_reads_all_it_sets(path):
    cls = PretrainConfig if path.startswith("configs/pretrain/") else FinetuneConfig
    assert load_config(cls, ROOT / path).unused() == []
    if cls is FinetuneConfig and "linprobe" in path:  # the README's kNN command is the probe's config in knn mode
        assert load_config(cls, ROOT / path, ["finetune.mode=knn"]).unused() == []


def test_the_run_says_them_once_at_its_start(tmp_path, capsys):
    cfg = load_config(PretrainConfig, None, tiny_overrides(tmp_path, **{"optim.momentum": 0.5}))
    Run.start(cfg, stage="pretrain").lock.release()
    said = [line for line in capsys.readouterr().err.splitlines() if "not used by this run" in line]
    assert said == ["warning: not used by this run: optim.momentum=0.5 (optim.name=adamw reads optim.betas)"]


def test_what_a_run_warned_of_is_in_its_summary_and_in_the_comparison_report(tmp_path, capsys):
    """A warning printed in a scrolled log (a progress bar's) was easy to miss, and nothing in the run folder kept it."""
    from vit.store.runs import read_summary
    from vit.tools.compare import compare

    cfg = load_config(PretrainConfig, None, tiny_overrides(tmp_path, **{"optim.momentum": 0.5}))
    run = Run.start(cfg, stage="pretrain")
    run.warn("schedule.warmup_epochs spans 9 steps, more than the 4 the run trains")
    run.finish({"epochs": 1})
    said = ["not used by this run: optim.momentum=0.5 (optim.name=adamw reads optim.betas)",
            "schedule.warmup_epochs spans 9 steps, more than the 4 the run trains"]  # fmt: skip
    assert read_summary(run.dir)["warnings"] == said
    report = compare([str(run.dir)], out=tmp_path / "report")["report"].read_text()
    assert f"## Warnings the runs gave\n\n- run: {'; '.join(said)}\n" in report


def test_an_archived_record_keeps_no_machine_path_a_warning_named():
    """summary.json now keeps the run's warnings, whose text may name a path of the machine; the archive replaced only the
    paths that are values of the record."""
    from types import SimpleNamespace

    from vit.tools.records import machine_paths

    summary = {"warnings": ["cannot read /home/someone/.cache/x.png (skipped); 3/4 images, train/cat kept", 7]}
    replace = machine_paths(SimpleNamespace(config={"data": {"root": "/data/cifar10"}}, summary=summary))
    assert replace["/home/someone/.cache/x.png"] == "PATH" and replace["/data/cifar10"] == "PATH"
    assert not any(k in replace for k in ("/4", "/cat"))


def test_a_base_lr_beside_an_absolute_lr_is_said():
    """optim.lr sets the peak itself: a base_lr given beside it was ignored without a word."""
    assert OptimConfig(lr=0.1, base_lr=3e-3).unused() == ["optim.base_lr=0.003 (optim.lr=0.1 is the peak learning rate itself)"]
    assert OptimConfig(lr=0.1).unused() == OptimConfig(base_lr=3e-3).unused() == []
