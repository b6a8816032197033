"""A Hub / local model folder loaded at another image or patch size says what it resampled, as `timm:` weights and an MAE
encoder do: its table was interpolated (or its patch kernel resampled) without a word."""

import torch
from helpers import TINY_VIT as TINY
from helpers import saved_for_hub, tiny_overrides, tiny_timm_vit

from finetune.config import FinetuneConfig
from finetune.models import build_classifier
from vit.config import load_config
from vit.models.encoder import VisionTransformer
from vit.store.hub import load_hub_weights


def saved_timm(folder, **kw):
    return saved_for_hub(tiny_timm_vit(**kw), folder)


def test_a_folder_at_another_size_says_what_it_resampled_and_one_that_fits_says_nothing(tmp_path):
    folder = saved_timm(tmp_path / "vit32")
    said = []
    load_hub_weights(VisionTransformer(**TINY), f"local-dir:{folder}", said.append)
    assert said == []
    load_hub_weights(VisionTransformer(**{**TINY, "img_size": 48, "patch_size": 8}), f"local-dir:{folder}", said.append)
    assert said == [f"finetune.init=local-dir:{folder}: patch embedding resampled from 4x4 to 8x8 pixels, positional embeddings "
                    "interpolated (bicubic) from a 8x8 to a 6x6 patch grid"]  # fmt: skip


def test_a_table_of_a_non_square_grid_is_named_by_that_grid_though_its_length_fits(tmp_path):
    """16x64 px at 4 px patches: a 4x16 grid, 64 positions like our 8x8 one; resampled (not loaded as it is), so said."""
    folder = saved_timm(tmp_path / "oblong", img_size=(16, 64))
    said = []
    load_hub_weights(VisionTransformer(**TINY), f"local-dir:{folder}", said.append)
    assert said == [f"finetune.init=local-dir:{folder}: positional embeddings interpolated (bicubic) from a 4x16 to a 8x8 patch grid"]


def test_the_fine_tune_stage_passes_the_line_on(tmp_path):
    folder = saved_timm(tmp_path / "vit16", img_size=16)
    model = {"model.embed_dim": 32, "model.depth": 1, "model.num_heads": 2, "model.patch_size": 4, "model.img_size": 32}
    cfg = load_config(FinetuneConfig, None, tiny_overrides(tmp_path, **model) + [f"finetune.init=local-dir:{folder}"])
    said = []
    built = build_classifier(cfg, 10, say=said.append)
    assert said == [f"finetune.init=local-dir:{folder}: positional embeddings interpolated (bicubic) from a 4x4 to a 8x8 patch grid"]
    assert built.model.pos_embed.shape == (1, 65, 32) and torch.isfinite(built.model.pos_embed).all()
