"""Hostile tests of the MAE pretraining stage around the model: its evaluations, figures and the files it leaves."""

import json

import torch
from helpers import tiny_overrides

from pretrain.model import MaskedAutoencoder
from pretrain.train import main
from vit.models.encoder import VisionTransformer
from vit.store.runs import read_metrics

# 54 train images in one batch of 32: one optimiser step an epoch
ONE_STEP_EPOCHS = {"data.synthetic_size": 64, "data.val_size": 10, "mae.figure_images": 0, "run.figure_every": 0}


def test_a_run_cut_by_max_steps_at_an_epoch_end_evaluates_its_final_encoder(tmp_path):
    """schedule.max_steps=2 of 3 one-step epochs stops at epoch 2's end, which was not the schedule's last. That end
    evaluated one of the two (its cadence's), and the final evaluation took it as the final one: with mae.knn_every=3 the
    kNN monitor never saw the encoder that encoder.pt holds (final_knn_top1 None); with mae.val_every=3 the final val
    loss was computed after training but never joined the curve."""
    for name, cadence in (("knn3", {"mae.knn_every": 3, "mae.val_every": 1}), ("val3", {"mae.knn_every": 1, "mae.val_every": 3})):
        assert main(tiny_overrides(tmp_path, name, **ONE_STEP_EPOCHS, **cadence, **{"schedule.epochs": 3, "schedule.max_steps": 2})) == 0
        run_dir = tmp_path / "runs" / name
        summary = json.loads((run_dir / "summary.json").read_text())
        final = [m for m in read_metrics(run_dir)[0] if "val_loss" in m or "knn_top1" in m][-1]
        assert summary["steps"] == final["step"] == 2, name
        assert final.get("val_loss") == summary["final_val_loss"] and final.get("knn_top1") == summary["final_knn_top1"] is not None, name


def test_the_figure_says_how_many_patches_the_mask_leaves_visible_not_the_ratios_share():
    """0.9 of 16 patches leaves floor(1.6) = 1 visible (6%): the masked-input row said "10% of the patches"."""
    from pretrain.figures import reconstruct

    encoder = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=0)
    mae = MaskedAutoencoder(encoder, decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=2, mask_ratio=0.9)
    rows, labels = reconstruct(mae, torch.randn(1, 3, 32, 32), (0.5,) * 3, (0.25,) * 3)
    shown = (rows[1, 0] != 0.5).any(0).float().sum().item() / 64  # the masked-input row's pixels not greyed, in patches
    assert shown == 1 and labels[1] == "masked input\n(1 of 16 patches visible)", labels[1]
