"""The line refusing a Hub folder of another shape names overrides one can type, and only settings that exist."""

import pytest
from helpers import TINY_VIT, saved_for_hub, tiny_timm_vit

from vit.config import ModelConfig
from vit.errors import CheckpointError
from vit.models.encoder import VisionTransformer
from vit.store.hub import load_hub_weights


def refusal(tmp_path, **kw) -> str:
    folder = saved_for_hub(tiny_timm_vit(**kw), tmp_path / "vit")
    with pytest.raises(CheckpointError) as e:
        load_hub_weights(VisionTransformer(**TINY_VIT), f"local-dir:{folder}")
    return str(e.value)


def test_a_boolean_setting_is_spelled_as_the_command_line_takes_it(tmp_path):
    line = refusal(tmp_path, qkv_bias=False)
    assert line.endswith("is a different encoder; to load it set model.qkv_bias=false (this run: true)"), line


def test_other_channels_are_said_without_a_setting_that_does_not_exist(tmp_path):
    assert "in_chans" not in ModelConfig.__dataclass_fields__  # every run reads 3-channel images
    line = refusal(tmp_path, in_chans=1, embed_dim=48)
    assert line.endswith(
        "is a different encoder; it takes 1-channel images (this run: 3); to load it set model.embed_dim=48 (this run: 32)"
    ), line
    assert "model.in_chans" not in line
