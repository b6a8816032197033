"""The measured GPU recipes are the runs RESULTS.md reports: each file's settings against its archived record's."""

import pytest
import yaml
from helpers import ROOT

from finetune.config import FinetuneConfig
from pretrain.config import PretrainConfig
from vit.config import load_config, to_dict

RECORDS = ROOT / "docs/results/gpu/table/nvidia-h100-80gb-hbm3-bf16"
# Where a run was, what it was called and how it was watched, not what it trained: these may differ from the record.
# (`data.root` and the paths under it; the device, and `precision: auto`, which the record holds resolved; the run's
# folder, trackers and resume states; `schedule.epochs`, which a time budget replaces; `finetune.init`, a folder.)
NOT_RECIPE = {
    "data": {"root", "download", "cache_dir"},
    "schedule": {"epochs"},
    "finetune": {"init"},
    "run": {"name", "dir", "resume", "overwrite", "device", "precision", "threads", "tracker", "wandb_mode", "project",
            "group", "progress", "save_every", "save_minutes", "keep_states"},
}

RECIPES = [
    ("configs/pretrain/gpu_5min.yaml", PretrainConfig, "mae_2.5min_s0"),
    ("configs/finetune/gpu_5min.yaml", FinetuneConfig, "ft_m5_f50_crop_s0"),
    ("configs/baselines/vit_scratch_gpu_5min.yaml", FinetuneConfig, "scratch_m5_crop_s0"),
    ("configs/pretrain/gpu_10min.yaml", PretrainConfig, "mae_7.5min_s0"),
    ("configs/finetune/gpu_10min.yaml", FinetuneConfig, "ft_m10_f75_mix_s0"),
]


def differences(recipe: dict, record: dict) -> list[str]:
    """Every setting of the record (but NOT_RECIPE's) that the recipe lacks or sets otherwise, as `section.key`."""
    found = []
    for section, settings in record.items():
        if section == "meta":
            continue
        for key, value in settings.items():
            if key in NOT_RECIPE.get(section, ()):
                continue
            mine = recipe.get(section, {}).get(key, "<missing>")
            if mine != value:
                found.append(f"{section}.{key}: recipe {mine!r}, record {value!r}")
    return found


@pytest.mark.parametrize("path, cls, run", RECIPES, ids=[r[2] for r in RECIPES])
def test_each_measured_gpu_recipe_sets_what_its_reported_run_trained_with(path, cls, run):
    recipe = to_dict(load_config(cls, ROOT / path))
    record = yaml.safe_load((RECORDS / run / "config.yaml").read_text())
    assert differences(recipe, record) == []
    assert recipe["run"]["precision"] == "auto" and record["run"]["precision"] == "bf16"  # auto is bf16 on that GPU


def test_a_recipe_that_drifts_from_its_record_is_named_setting_by_setting():
    record = yaml.safe_load((RECORDS / "ft_m5_f50_crop_s0" / "config.yaml").read_text())
    recipe = to_dict(load_config(FinetuneConfig, ROOT / "configs/finetune/gpu_5min.yaml", ["model.drop_path_rate=0.2", "run.seed=1"]))
    assert differences(recipe, record) == ["model.drop_path_rate: recipe 0.2, record 0.1", "run.seed: recipe 1, record 0"]
