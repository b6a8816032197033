"""The classification stage's optimiser defaults are MAE's fine-tuning ones (AdamW, betas 0.9/0.999, base_lr 5e-4), as
its augmentation defaults are: they were the pretraining's (betas 0.95, base_lr 1.5e-4) for a fine-tune written
without an `optim` section."""

from finetune.config import FinetuneConfig
from pretrain.config import PretrainConfig
from vit.config import load_config


def test_a_fine_tune_without_an_optim_section_gets_mae_fine_tuning_defaults_and_pretraining_keeps_its_own(tmp_path):
    config = tmp_path / "ft.yaml"
    config.write_text("model:\n  name: vit_cifar_tiny\nfinetune:\n  init: scratch\n")
    optim = load_config(FinetuneConfig, config).optim
    assert (optim.name, optim.base_lr, tuple(optim.betas), optim.weight_decay) == ("adamw", 5e-4, (0.9, 0.999), 0.05)
    optim = load_config(PretrainConfig, None).optim
    assert (optim.base_lr, tuple(optim.betas)) == (1.5e-4, (0.9, 0.95))


def test_settings_another_optimiser_ignores_are_said_against_the_stage_s_own_defaults():
    """SGD does not read betas: said when they differ from the stage's default, and only then (compared with the
    pretraining's 0.95, a fine-tune's own default would be said as a change nobody made)."""
    assert load_config(FinetuneConfig, None, ["optim.name=sgd"]).unused() == []
    said = load_config(FinetuneConfig, None, ["optim.name=sgd", "optim.betas=[0.9,0.95]"]).unused()
    assert said == ["optim.betas=[0.9, 0.95] (optim.name=sgd reads optim.momentum)"]
    assert load_config(PretrainConfig, None, ["optim.name=lars"]).unused() == []
