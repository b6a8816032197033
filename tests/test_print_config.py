"""`--print-config`: every setting a stage would run with, as YAML that `--config` reads back; nothing runs or is written."""

import pytest
import yaml
from helpers import ROOT

from finetune.config import FinetuneConfig
from finetune.train import main as finetune
from pretrain.config import PretrainConfig
from pretrain.train import main as pretrain
from vit.config import dump_config, load_config, to_dict


@pytest.mark.parametrize("main, cls, config", [(pretrain, PretrainConfig, "configs/pretrain/cpu.yaml"),
                                               (finetune, FinetuneConfig, "configs/finetune/linprobe_cpu.yaml")])  # fmt: skip
def test_the_printed_config_is_the_resolved_one_and_reads_back(main, cls, config, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a run would write runs/ here
    overrides = ["optim.base_lr=0.002", "run.name=shown"]
    with pytest.raises(SystemExit) as stop:
        main(["--config", str(ROOT / config), *overrides, "--print-config"])
    assert stop.value.code == 0 and not list(tmp_path.iterdir())  # nothing ran, nothing was written
    printed = capsys.readouterr().out
    expected = load_config(cls, ROOT / config, overrides)
    assert yaml.safe_load(printed) == to_dict(expected)
    (tmp_path / "printed.yaml").write_text(printed)
    assert to_dict(load_config(cls, tmp_path / "printed.yaml", [])) == to_dict(expected)  # --config reads it back as it was


def test_a_bad_setting_is_still_one_line_before_anything_is_printed(capsys):
    assert pretrain(["optim.base_lr=-1", "--print-config"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: optim.base_lr must be positive") and err.count("\n") == 1, err


RECIPES = [(cls, p.relative_to(ROOT).as_posix()) for d, cls in (("pretrain", PretrainConfig), ("finetune", FinetuneConfig), ("baselines", FinetuneConfig))
           for p in sorted((ROOT / "configs" / d).glob("*.yaml"))]  # fmt: skip


@pytest.mark.parametrize("cls, config", RECIPES, ids=[c for _, c in RECIPES])
def test_every_recipe_reads_back_from_its_printed_config(cls, config, tmp_path):
    """Text that looks like a number, a path with a space and a `~`, null: YAML keeps each as it was."""
    cfg = load_config(cls, ROOT / config, ["run.name=0.10", "data.root=~/my data", "run.group=null"])
    (tmp_path / "printed.yaml").write_text(dump_config(cfg))
    assert to_dict(load_config(cls, tmp_path / "printed.yaml", [])) == to_dict(cfg)
