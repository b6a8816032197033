"""MAE: masking, loss, patchify, and real pretraining runs on generated data."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import free_port, reset_accelerate, tiny_overrides
from pretrain.config import PretrainConfig
from pretrain.figures import reconstruct
from pretrain.model import MaskedAutoencoder, mae_from_checkpoint, patchify, random_masking, unpatchify
from pretrain.train import build_mae, main
from vit.store.checkpoint import encoder_from_checkpoint, save_encoder, save_mae
from vit.config import load_config
from vit.train.optim import lr_at
from vit.errors import CheckpointError
from vit.models.encoder import VisionTransformer
from vit.store.runs import state_path

ROOT = Path(__file__).resolve().parents[1]


def tiny_mae(**kw) -> MaskedAutoencoder:
    encoder = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=0)
    return MaskedAutoencoder(encoder, decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=2, **kw)


@pytest.mark.parametrize("ratio", [0.75, 0.5, 0.9])
def test_masking_keeps_exact_count_differs_per_sample_and_agrees_with_mask(ratio):
    torch.manual_seed(0)
    L = 64
    ids_keep, ids_restore, mask = random_masking(8, L, ratio)
    keep = int(L * (1 - ratio))
    assert ids_keep.shape == (8, keep)
    assert torch.all(mask.sum(1) == L - keep)
    for b in range(8):
        assert torch.all(mask[b, ids_keep[b]] == 0)  # kept = visible
        assert len(set(ids_keep[b].tolist())) == keep
    assert len({tuple(sorted(row.tolist())) for row in ids_keep}) == 8  # a different set per sample
    # ids_restore undoes the shuffle: the visible ids come first in shuffled order.
    shuffle = torch.argsort(ids_restore, dim=1)
    assert torch.equal(shuffle[:, :keep], ids_keep)


def test_unpatchify_inverts_patchify():
    x = torch.randn(3, 3, 32, 32)
    p = patchify(x, 8)
    assert p.shape == (3, 16, 8 * 8 * 3)
    assert torch.equal(unpatchify(p, 8), x)
    # Patch 1 is the second 8x8 tile of the first row.
    assert torch.equal(p[0, 1].reshape(8, 8, 3).permute(2, 0, 1), x[0, :, :8, 8:16])


@pytest.mark.parametrize("norm_pix_loss", [False, True])
def test_loss_ignores_visible_patch_pixels(norm_pix_loss):
    torch.manual_seed(0)
    mae = tiny_mae(norm_pix_loss=norm_pix_loss).eval()
    imgs = torch.randn(2, 3, 32, 32)
    pred = torch.randn(2, 16, 8 * 8 * 3)
    _, _, mask = random_masking(2, 16, 0.75)
    loss = mae.forward_loss(imgs, pred, mask)
    # Change only visible patches, in pixels and in predictions: the loss must not move.
    visible = (1 - mask).unsqueeze(-1)  # (B, L, 1)
    noisy = unpatchify(patchify(imgs, 8) + 5.0 * visible * torch.randn(2, 16, 192), 8)
    assert not torch.equal(noisy, imgs)
    loss2 = mae.forward_loss(noisy, pred + visible * torch.randn_like(pred), mask)
    torch.testing.assert_close(loss, loss2)
    # ...while changing a masked patch does move it.
    loss3 = mae.forward_loss(imgs, pred + mask.unsqueeze(-1), mask)
    assert not torch.isclose(loss, loss3)


def test_forward_shapes_and_encoder_sees_only_visible_tokens():
    mae = tiny_mae()
    seen = []
    mae.encoder.blocks[0].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    loss, pred, mask = mae(torch.randn(4, 3, 32, 32))
    assert loss.ndim == 0 and pred.shape == (4, 16, 192) and mask.shape == (4, 16)
    assert seen[0] == (4, 1 + 4, 32)  # [CLS] + 25% of 16 patches
    loss.backward()
    # The loss reaches the encoder through the visible patches and the mask token through the masked ones.
    assert mae.encoder.patch_embed.proj.weight.grad.abs().sum() > 0 and mae.mask_token.grad.abs().sum() > 0


def seeded_noise(batch: int, mae, seed: int) -> torch.Tensor:
    return torch.rand(batch, mae.num_patches, generator=torch.Generator().manual_seed(seed))


def test_fixed_noise_gives_fixed_masks():
    mae = tiny_mae().eval()
    x = torch.randn(2, 3, 32, 32)
    _, _, m1 = mae(x, noise=seeded_noise(2, mae, 3))
    _, _, m2 = mae(x, noise=seeded_noise(2, mae, 3))
    _, _, m3 = mae(x)
    assert torch.equal(m1, m2) and not torch.equal(m1, m3)


def test_validation_loss_is_the_same_however_many_processes_share_the_split():
    """Each rank evaluates a contiguous slice of the val split; the masks used to be drawn batch by batch on each rank,
    so an image's mask (and the loss) changed with the number of processes."""
    from types import SimpleNamespace

    from pretrain.train import validation_loss
    from vit.data.augment import BatchLoader
    from vit.data.splits import ImageSet

    torch.manual_seed(0)
    mae = tiny_mae(norm_pix_loss=True)
    images = ImageSet(torch.randint(0, 256, (21, 3, 32, 32), dtype=torch.uint8), torch.zeros(21, dtype=torch.int64), ["a"])
    acc = SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext, reduce=lambda t, reduction: t)
    run = SimpleNamespace(accelerator=acc)

    def loss(rank: int, world: int) -> tuple[float, int]:
        loader = BatchLoader(images, 4, train=False, device="cpu", mean=(0.5,) * 3, std=(0.5,) * 3, out_size=32, rank=rank, world_size=world)
        return validation_loss(mae, loader, run, seed=5), loader.shard[1] - loader.shard[0]

    one, _ = loss(0, 1)
    (a, na), (b, nb) = loss(0, 2), loss(1, 2)  # each rank's mean over its slice: the sum of both is what reduce gives
    assert abs((a * na + b * nb) / (na + nb) - one) < 1e-6


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_short_run_lowers_loss_and_leaves_a_complete_run_folder(tmp_path):
    overrides = tiny_overrides(tmp_path, **{"schedule.epochs": 6, "optim.lr": 2e-3, "mae.norm_pix_loss": False})
    assert main(overrides) == 0
    run_dir = tmp_path / "runs" / "run"
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "encoder.pt", "mae.pt", "reconstruction.png"):
        assert (run_dir / name).is_file(), name
    metrics = [m for m in read_metrics(run_dir) if "loss" in m]
    first = sum(m["loss"] for m in metrics[:3]) / 3
    last = sum(m["loss"] for m in metrics[-3:]) / 3
    assert last < 0.8 * first, (first, last)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 * (216 // 32) and summary["epochs"] == 6
    # The final validation loss is that of the last epoch's weights with the same fixed masks, and below the first epoch's.
    val = [m["val_loss"] for m in read_metrics(run_dir) if "val_loss" in m]
    assert len(val) == 6 and summary["final_val_loss"] == val[-1] < val[0] and summary["images_per_sec"] > 0
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["meta"]["seed"] == 0 and config["meta"]["git_commit"]
    assert config["optim"]["lr"] == 2e-3
    # The exported encoder loads strictly into a fresh encoder built from its stored config.
    payload = torch.load(run_dir / "encoder.pt", weights_only=True)
    fresh = VisionTransformer(**payload["config"])
    fresh.load_state_dict(payload["state_dict"], strict=True)
    encoder = encoder_from_checkpoint(run_dir / "encoder.pt")
    assert encoder.config["embed_dim"] == 32 and payload["step"] == summary["steps"]
    # mae.pt is the whole MAE training ended with: the model of the final resume state, rebuilt from the file alone.
    assert torch.load(run_dir / "mae.pt", weights_only=True)["step"] == summary["steps"]
    from safetensors.torch import load_file

    trained = build_mae(load_config(PretrainConfig, run_dir / "config.yaml"), torch.device("cpu"))  # attention as the run computed it
    trained.load_state_dict(load_file(state_path(run_dir, summary["steps"]) / "model.safetensors"), strict=True)
    rebuilt = mae_from_checkpoint(run_dir)
    x = torch.randn(4, 3, 32, 32)
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    assert torch.equal(reconstruct(rebuilt, x, mean, std, seed=1)[0], reconstruct(trained, x, mean, std, seed=1)[0])


def test_the_val_loss_is_evaluated_every_val_every_epochs_and_at_the_last(tmp_path):
    from vit.store.runs import read_metrics

    overrides = tiny_overrides(tmp_path, **{"schedule.epochs": 5, "mae.val_every": 2, "mae.knn_every": 0, "data.synthetic_size": 128,
                                            "mae.figure_images": 0})  # fmt: skip
    assert main(overrides) == 0
    run_dir = tmp_path / "runs" / "run"
    assert [m["epoch"] for m in read_metrics(run_dir)[0] if "val_loss" in m] == [2, 4, 5]
    assert json.loads((run_dir / "summary.json").read_text())["final_val_loss"] is not None


def test_mae_checkpoint_holds_plain_tensors_and_its_configs_and_refuses_other_files(tmp_path):
    torch.manual_seed(0)
    mae = tiny_mae(mask_ratio=0.6, norm_pix_loss=True)
    save_mae(mae, tmp_path / "mae.pt", step=4, meta={"stage": "pretrain"})
    payload = torch.load(tmp_path / "mae.pt", weights_only=True)
    assert payload["format"] == "vit-mae/1" and payload["step"] == 4 and payload["config"]["embed_dim"] == 32
    assert payload["mae"] == {"decoder_embed_dim": 32, "decoder_depth": 1, "decoder_num_heads": 2, "mlp_ratio": 4.0,
                              "mask_ratio": 0.6, "norm_pix_loss": True}  # fmt: skip
    rebuilt = mae_from_checkpoint(tmp_path)  # the mae.pt of a run folder
    assert rebuilt.mask_ratio == 0.6 and rebuilt.norm_pix_loss
    x = torch.randn(2, 3, 32, 32)
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    assert torch.equal(reconstruct(rebuilt, x, mean, std, seed=2)[0], reconstruct(mae, x, mean, std, seed=2)[0])
    save_encoder(mae.encoder, tmp_path / "encoder.pt")
    with pytest.raises(CheckpointError, match=r"encoder.pt is not a masked autoencoder checkpoint \(expected format 'vit-mae/1'\)"):
        mae_from_checkpoint(tmp_path / "encoder.pt")
    (tmp_path / "old_run").mkdir()  # a run pretrained before mae.pt was written
    with pytest.raises(CheckpointError, match=r"masked autoencoder checkpoint .*old_run/mae.pt does not exist"):
        mae_from_checkpoint(tmp_path / "old_run")


@pytest.mark.slow
def test_resumed_run_reaches_same_step_and_continues_the_lr_schedule(tmp_path):
    full = tiny_overrides(tmp_path, name="full", **{"run.save_every": 3})
    assert main(full) == 0
    # Stop a second run at step 5 (mid-epoch: 6 steps an epoch), then resume it to the end.
    part = tiny_overrides(tmp_path, name="part", **{"run.save_every": 3, "schedule.max_steps": 5})
    assert main(part) == 0
    states = sorted(p.name for p in (tmp_path / "runs" / "part" / "states").iterdir())
    assert states[-1] == "step_00000005"
    resumed = tiny_overrides(tmp_path, name="part", **{"run.save_every": 3, "run.resume": "auto"})
    assert main(resumed) == 0
    a = read_metrics(tmp_path / "runs" / "full")
    b = read_metrics(tmp_path / "runs" / "part")
    lr_a = {m["step"]: m["lr"] for m in a if "lr" in m}
    lr_b = {m["step"]: m["lr"] for m in b if "lr" in m}
    assert max(lr_b) == max(lr_a) == 12
    for step in range(1, 13):
        assert lr_b[step] == pytest.approx(lr_a[step]), step
    # The same schedule function, checked at its landmarks.
    assert lr_at(0, 100, 10, 1.0) == 0 and lr_at(10, 100, 10, 1.0) == 1.0 and lr_at(100, 100, 10, 1.0, 0.1) == pytest.approx(0.1)
    # On CPU with the same seed, data order and RNG resume exactly: the final weights agree.
    wa = torch.load(tmp_path / "runs" / "full" / "encoder.pt", weights_only=True)["state_dict"]
    wb = torch.load(tmp_path / "runs" / "part" / "encoder.pt", weights_only=True)["state_dict"]
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.slow
def test_two_process_cpu_run_uses_both_ranks_in_sync(tmp_path):
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()), "-m", "pretrain"]
    # No run.device: the README's command leaves the device to Accelerate, which must honour ACCELERATE_USE_CPU.
    cmd += [o for o in tiny_overrides(tmp_path, name="ddp", **{"schedule.epochs": 1, "optim.batch_size": 16}) if not o.startswith("run.device")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "ddp" / "summary.json").read_text())
    assert summary["processes"] == 2
    ranks = summary["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["images"] == ranks[1]["images"] > 0
    assert ranks[0]["first_batch_sum"] != ranks[1]["first_batch_sum"]  # each rank trained on its own shard
    assert ranks[0]["param_checksum"] == ranks[1]["param_checksum"]  # and the weights stayed identical
    assert summary["steps"] == 216 // (16 * 2)


@pytest.mark.slow
def test_unsynchronised_launch_is_refused(tmp_path):
    # --multi_gpu on a machine without GPUs (and without ACCELERATE_USE_CPU) starts two processes
    # that would each train alone: WORLD_SIZE=2 but the accelerator sees one process.
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()), "-m", "pretrain"]
    cmd += [o for o in tiny_overrides(tmp_path) if not o.startswith("run.device")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode != 0
    assert "error: WORLD_SIZE=2 but the accelerator runs 1 process(es)" in out.stderr
    assert not (tmp_path / "runs" / "run").exists()


def nan_after(calls: int):
    """A forward_loss that turns non-finite from its `calls`-th call on."""
    original = MaskedAutoencoder.forward_loss
    count = {"n": 0}

    def forward_loss(self, imgs, pred, mask):
        count["n"] += 1
        loss = original(self, imgs, pred, mask)
        return loss * float("nan") if count["n"] >= calls else loss

    return forward_loss


def test_non_finite_loss_stops_with_one_line_and_keeps_the_last_good_state(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(MaskedAutoencoder, "forward_loss", nan_after(4))
    assert main(tiny_overrides(tmp_path, **{"run.save_every": 2})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    # the 4th step, as metrics.jsonl numbers them (its records of steps 1-3 are finite): it said "step 3", the ring's index
    assert err[0].startswith("error: non-finite loss (nan) at step 4, lr ") and "precision no" in err[0] and "stage pretrain" in err[0]
    assert [r["step"] for r in map(json.loads, (tmp_path / "runs" / "run" / "metrics.jsonl").read_text().splitlines())] == [1, 2, 3]
    run_dir = tmp_path / "runs" / "run"
    assert [p.name for p in (run_dir / "states").iterdir()] == ["step_00000002"]
    assert not (run_dir / "summary.json").exists()


def test_a_non_finite_loss_before_any_state_says_none_was_kept(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(MaskedAutoencoder, "forward_loss", nan_after(1))
    assert main(tiny_overrides(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "at step 1," in err[0] and err[0].endswith("no resume state was saved before it"), err
    assert not (tmp_path / "runs" / "run" / "states").exists()


def test_non_finite_steps_can_be_skipped_within_a_budget(tmp_path, monkeypatch, capsys):
    calls = {"n": 0}
    original = MaskedAutoencoder.forward_loss

    def one_bad(self, imgs, pred, mask):
        calls["n"] += 1
        loss = original(self, imgs, pred, mask)
        return loss * float("inf") if calls["n"] == 3 else loss

    monkeypatch.setattr(MaskedAutoencoder, "forward_loss", one_bad)
    assert main(tiny_overrides(tmp_path, **{"run.nan_skip_budget": 1, "schedule.epochs": 1})) == 0
    assert "step skipped (1/1)" in capsys.readouterr().err
    summary = json.loads((tmp_path / "runs" / "run" / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["skipped_steps"] == 1  # 6 batches, one of them a step without an update


def test_training_mode_predicts_masked_patches_exactly_as_eval_mode():
    torch.manual_seed(0)
    mae = tiny_mae(norm_pix_loss=True)
    x = torch.randn(3, 3, 32, 32)
    mae.eval()
    loss_eval, pred_eval, mask = mae(x, noise=seeded_noise(x.shape[0], mae, 1))
    mae.train()
    loss_train, pred_train, mask_train = mae(x, noise=seeded_noise(x.shape[0], mae, 1))
    assert torch.equal(mask, mask_train)
    m = mask.bool()
    torch.testing.assert_close(pred_train[m], pred_eval[m], rtol=1e-5, atol=1e-5)
    assert torch.all(pred_train[~m] == 0)  # visible patches are not predicted in training
    torch.testing.assert_close(loss_train, loss_eval, rtol=1e-5, atol=1e-6)


def test_pretraining_decays_cls_and_mask_tokens_as_the_paper_does():
    from vit.train.optim import param_groups

    mae = tiny_mae(norm_pix_loss=True)
    decay = {id(p) for g in param_groups(mae, weight_decay=0.05) if g["weight_decay"] > 0 for p in g["params"]}
    assert id(mae.encoder.cls_token) in decay and id(mae.mask_token) in decay
    assert id(mae.encoder.blocks[0].norm1.weight) not in decay and id(mae.decoder_embed.bias) not in decay


def test_reconstruction_figure_labels_the_true_statistics_and_its_raw_row_uses_no_hidden_pixel():
    from pretrain.figures import reconstruct

    torch.manual_seed(0)
    mae = tiny_mae(norm_pix_loss=True)
    x = torch.randn(2, 3, 32, 32)
    rows, labels = reconstruct(mae, x, (0.5,) * 3, (0.25,) * 3, seed=1)
    assert rows.shape[:2] == (5, 2) and "TRUE mean and variance" in labels[2] and labels[4].startswith("raw output")
    _, _, mask = mae(x, noise=seeded_noise(x.shape[0], mae, 1))
    hidden = torch.nn.functional.interpolate(mask.view(2, 1, 4, 4), scale_factor=8) > 0  # (B, 1, 32, 32): pixels of masked patches
    changed = torch.where(hidden, x + 3.0 * torch.randn_like(x), x)  # new content in the hidden patches only
    rows2, _ = reconstruct(mae, changed, (0.5,) * 3, (0.25,) * 3, seed=1)
    torch.testing.assert_close(rows2[4], rows[4])  # the raw output cannot see the hidden patches
    assert not torch.allclose(rows2[2], rows[2])  # the reconstruction row borrows their statistics
    plain, plain_labels = reconstruct(tiny_mae(norm_pix_loss=False), x, (0.5,) * 3, (0.25,) * 3)
    assert plain.shape[0] == 4 and plain_labels[2] == "reconstruction"


@pytest.mark.parametrize(
    "overrides, message",
    [
        # 1 - 1e-17 is 1.0 in float64: every patch visible, none hidden, and the loss over hidden patches was 0/0 (NaN)
        ({"mae.mask_ratio": 1e-17}, "mae.mask_ratio 1e-17 hides none of the model's 16 patches: it must be at least 1/16"),
        ({"model.patch_size": 32}, "model.patch_size 32 leaves the model 1 patch: MAE needs at least 2"),
        # the decoder's fixed sin-cos table: the message named neither the key nor the value the user set
        ({"mae.decoder_embed_dim": 6, "mae.decoder_num_heads": 3}, "mae.decoder_embed_dim 6 is not a multiple of 4"),
    ],
)
def test_a_mask_or_decoder_that_cannot_train_is_a_one_line_error_naming_the_key(tmp_path, capsys, overrides, message):
    assert main(tiny_overrides(tmp_path, **overrides)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {message}"), err
    assert not (tmp_path / "runs" / "run" / "metrics.jsonl").exists()


def test_the_reconstruction_rows_are_laid_out_as_torchvisions_make_grid_lays_out_one_row():
    from torchvision.utils import make_grid

    from pretrain.figures import image_row

    images = torch.rand(5, 3, 8, 6)
    assert torch.equal(image_row(images), make_grid(images, nrow=5, padding=2, pad_value=1.0))


def test_a_non_finite_loss_after_resuming_a_copied_state_names_that_state(tmp_path, monkeypatch, capsys):
    """A run resumed from a state of another folder said "no resume state was saved before it", as if none existed."""
    assert main(tiny_overrides(tmp_path, name="src", **{"run.save_every": 2, "schedule.max_steps": 2})) == 0
    copy = tmp_path / "copy"
    shutil.copytree(max((tmp_path / "runs" / "src" / "states").iterdir()), copy)
    reset_accelerate()
    capsys.readouterr()
    monkeypatch.setattr(MaskedAutoencoder, "forward_loss", nan_after(1))
    assert main(tiny_overrides(tmp_path, name="fork", **{"run.save_every": 2, "schedule.max_steps": 4, "run.resume": str(copy)})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(f"no resume state was saved since it resumed from {copy}"), err
