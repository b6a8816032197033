"""Hostile input to the figures of a trained encoder (pretrain/visualize.py, scripts/visualize.py): each bad checkpoint,
image set or output folder ends in one line naming what is wrong, before anything is written, and no figure shows
another model, other images or other normalisation than the one asked for."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from pretrain.model import MaskedAutoencoder
from pretrain.visualize import get_images, load_checkpoint, main, visualize
from vit.errors import CheckpointError, UserError
from vit.models.encoder import VisionTransformer
from vit.store.checkpoint import save_encoder, save_mae

ROOT = Path(__file__).resolve().parents[1]
RUN_MEAN, RUN_STD = [0.1, 0.2, 0.3], [0.4, 0.5, 0.6]  # not any data set's: where they show up, they came from encoder.pt


def tiny_mae(seed: int = 0, embed_dim: int = 16) -> MaskedAutoencoder:
    torch.manual_seed(seed)
    encoder = VisionTransformer(img_size=16, patch_size=4, embed_dim=embed_dim, depth=1, num_heads=2, num_classes=0)
    return MaskedAutoencoder(encoder, decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2).eval()


def write_run(folder: Path, mae: MaskedAutoencoder, config: dict | None = None, meta: dict | None = None) -> Path:
    """A pretraining run folder as `python -m pretrain` leaves it, by hand: config.yaml, encoder.pt and mae.pt (untrained)."""
    folder.mkdir(parents=True)
    data = {"dataset": "synthetic", "synthetic_size": 64, "val_size": 10, "cache_dir": str(folder.parent / "cache")}
    (folder / "config.yaml").write_text(yaml.safe_dump(config or {"data": data, "meta": {"stage": "pretrain"}}))
    meta = (
        meta
        if meta is not None
        else {"run": str(folder), "stage": "pretrain", "data": {"dataset": "synthetic", "mean": RUN_MEAN, "std": RUN_STD}}
    )
    save_encoder(mae.encoder, folder / "encoder.pt", meta=meta)
    save_mae(mae, folder / "mae.pt", meta=meta)
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One run folder shared by the tests that only read it."""
    return write_run(tmp_path_factory.mktemp("runs") / "mae", tiny_mae())


@pytest.fixture
def photos(tmp_path) -> Path:
    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(3):
        Image.new("RGB", (40, 24), (80 * i, 120, 200)).save(folder / f"p{i}.png")
    return folder


def one_line(e: pytest.ExceptionInfo, *parts: str) -> None:
    message = str(e.value)
    assert "\n" not in message and all(p in message for p in parts), message


def test_python_m_pretrain_visualize_is_the_same_command_line_as_the_script(tmp_path):
    """`python -m pretrain.visualize --checkpoint ... --out ...` exited 0 doing nothing: the module had no __main__."""
    proc = subprocess.run([sys.executable, "-m", "pretrain.visualize", "--checkpoint", str(tmp_path / "missing"), "--out",
                           str(tmp_path / "figures")], check=False, capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "does not exist" in proc.stderr and not (tmp_path / "figures").exists()


def test_an_empty_out_is_refused_instead_of_filling_the_current_folder(run, tmp_path, monkeypatch, capsys):
    """--out "" is Path("."): six PNGs landed in whatever folder the command was run from."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", str(run), "--out", "", "--num-images", "1"])
    assert e.value.code == 2 and "--out is empty" in capsys.readouterr().err
    assert list(tmp_path.glob("*.png")) == []


@pytest.mark.parametrize("argv, message", [(["--num-images", "100000"], "--num-images must be between 1 and 64"),
                                           (["--seed", str(2**70)], "--seed must be a 64-bit integer")])  # fmt: skip
def test_a_num_images_or_seed_out_of_range_is_one_line_before_any_work(run, tmp_path, capsys, argv, message):
    """--num-images 100000 loaded the whole split and drew figures 100 000 columns wide for minutes; --seed 2**70 was a
    ValueError traceback from torch.Generator after the model and images were loaded."""
    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", str(run), "--out", str(tmp_path / "figures"), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err and not (tmp_path / "figures").exists()
    with pytest.raises(UserError):  # the function a notebook calls says so too
        visualize(str(run), [], tmp_path / "figures", num_images=65)


def test_an_out_inside_the_images_folder_is_refused(run, photos):
    """The figures written into the --images folder were read back as input images by the next call."""
    for out in (photos, photos / "figures"):
        with pytest.raises(UserError) as e:
            visualize(str(run), [str(photos)], out, 2)
        one_line(e, "lies in the --images folder")
    assert sorted(p.name for p in photos.iterdir()) == ["p0.png", "p1.png", "p2.png"]


def test_a_folder_where_a_figure_goes_is_refused_before_any_figure_is_written(run, photos, tmp_path):
    """A folder named attention_rollout.png in --out stopped the call after two figures were written."""
    out = tmp_path / "figures"
    (out / "attention_rollout.png").mkdir(parents=True)
    with pytest.raises(UserError) as e:
        visualize(str(run), [str(photos)], out, 1)
    one_line(e, "attention_rollout.png is a folder")
    assert [p.name for p in out.iterdir()] == ["attention_rollout.png"]


@pytest.mark.parametrize("other", [tiny_mae(seed=1), tiny_mae(embed_dim=32)], ids=["other weights", "other architecture"])
def test_a_mae_pt_of_another_encoder_draws_no_reconstruction(run, photos, tmp_path, capsys, other):
    """A mae.pt beside encoder.pt from another run (or step) was drawn as this encoder's reconstruction."""
    mixed = shutil.copytree(run, tmp_path / "mixed")
    save_mae(other, mixed / "mae.pt")
    written = visualize(str(mixed), [str(photos)], tmp_path / "figures", 1)
    stdout = capsys.readouterr().out
    assert written["reconstruction"] is None and not (tmp_path / "figures" / "reconstruction.png").exists()
    assert f"reconstruction: skipped ({mixed / 'mae.pt'} holds another encoder than {mixed / 'encoder.pt'}" in stdout
    assert written["attention_heads"].is_file()  # the encoder's own figures are still drawn


def test_a_damaged_mae_pt_stops_before_the_out_folder_is_made(run, photos, tmp_path):
    broken = shutil.copytree(run, tmp_path / "broken")
    (broken / "mae.pt").write_bytes((run / "mae.pt").read_bytes()[:2000])
    with pytest.raises(CheckpointError) as e:
        visualize(str(broken), [str(photos)], tmp_path / "figures", 1)
    one_line(e, "mae.pt is not a readable checkpoint")
    assert not (tmp_path / "figures").exists()


@pytest.mark.parametrize("meta, message", [("x", "its 'meta' is not a mapping"), ({"run": 5}, "its 'meta' is not a mapping"),
                                           ({"data": {"mean": [0.5] * 3, "std": [0.5, 0.5, 0.0]}}, "std above zero"),
                                           ({"data": {"mean": "x", "std": [1, 1, 1]}}, "are not 3 numbers")])  # fmt: skip
def test_an_encoder_pt_with_a_damaged_meta_is_one_line(tmp_path, photos, meta, message):
    """A meta that is not a mapping, or a run path that is not a string, was an AttributeError / TypeError traceback; a std of 0
    drew figures of infinities."""
    folder = tmp_path / "damaged"
    folder.mkdir()
    save_encoder(tiny_mae().encoder, folder / "encoder.pt", meta=meta)
    with pytest.raises(CheckpointError) as e:
        visualize(str(folder), [str(photos)], tmp_path / "figures", 1)
    one_line(e, str(folder / "encoder.pt"), "is damaged", message)
    assert not (tmp_path / "figures").exists()


def test_an_encoder_alone_is_normalised_as_its_own_training_data_not_as_imagenet(run, photos, tmp_path):
    """encoder.pt copied out of its run (the run gone) records its data's mean and std; ImageNet's were assumed instead."""
    alone = tmp_path / "alone"
    alone.mkdir()
    save_encoder(tiny_mae().encoder, alone / "encoder.pt", meta={"run": str(tmp_path / "gone"), "data": {"mean": RUN_MEAN, "std": RUN_STD}})
    loaded = load_checkpoint(str(alone))
    assert loaded.run_dir is None
    _, mean, std, described = get_images(loaded, [str(photos)], 2)
    assert (list(mean), list(std)) == (RUN_MEAN, RUN_STD) and "ImageNet" not in described


def test_images_of_another_data_set_are_normalised_as_the_encoders_training_data(run):
    """With --images data.* overrides, the shown data set's mean and std were used, not those the encoder was trained with."""
    images, mean, std, described = get_images(load_checkpoint(str(run)), ["data.synthetic_size=80"], 3)
    assert images.shape == (3, 3, 16, 16) and "synthetic val split" in described
    assert (list(mean), list(std)) == (RUN_MEAN, RUN_STD)  # the synthetic set's own are 0.5 and 0.5


def test_an_override_of_another_section_names_the_key_given(run, tmp_path):
    """--images model.depth=3 said: unknown config key 'data.model', a key nobody wrote."""
    with pytest.raises(UserError) as e:
        visualize(str(run), ["model.depth=3"], tmp_path / "figures", 1)
    one_line(e, "'model.depth=3'", "only the data section")


def test_a_run_config_whose_data_is_not_a_mapping_is_no_traceback_with_an_image_folder(tmp_path, photos, capsys):
    """config.yaml with `data: 5` beside an encoder.pt without recorded normalisation: an AttributeError traceback."""
    run = write_run(tmp_path / "odd", tiny_mae(), config={"data": 5}, meta={})
    visualize(str(run), [str(photos)], tmp_path / "figures", 1)
    assert "ImageNet normalisation assumed" in capsys.readouterr().out


def test_an_encoder_of_other_than_rgb_images_is_refused(tmp_path, photos):
    """An encoder of 1-channel images met the RGB images with a RuntimeError from its patch convolution."""
    folder = tmp_path / "grey"
    folder.mkdir()
    save_encoder(
        VisionTransformer(img_size=16, patch_size=4, in_chans=1, embed_dim=16, depth=1, num_heads=2, num_classes=0), folder / "encoder.pt"
    )
    with pytest.raises(CheckpointError) as e:
        visualize(str(folder), [str(photos)], tmp_path / "figures", 1)
    one_line(e, "1-channel images", "need RGB")
    assert not (tmp_path / "figures").exists()


@pytest.mark.parametrize("where", ["encoder", "decoder"])
def test_non_finite_weights_are_refused_not_drawn_as_blank_maps(run, photos, tmp_path, where):
    """An encoder with a NaN drew every attention map as nothing over the input, and a decoder with one a blank reconstruction,
    as if the model looked nowhere."""
    damaged = shutil.copytree(run, tmp_path / "nan")
    mae = tiny_mae()
    with torch.no_grad():
        (mae.encoder.blocks[0].attn.qkv.weight if where == "encoder" else mae.decoder_pred.weight)[0, 0] = float("nan")
    save_mae(mae, damaged / "mae.pt")
    if where == "encoder":  # an encoder.pt alone (a run from before mae.pt): nothing else looks at its weights
        save_encoder(mae.encoder, damaged / "encoder.pt")
        (damaged / "mae.pt").unlink()
    with pytest.raises(CheckpointError) as e:
        visualize(str(damaged), [str(photos)], tmp_path / "figures", 1)
    one_line(e, "holds non-finite weights", "blocks.0.attn.qkv.weight" if where == "encoder" else "decoder_pred.weight")
    assert not (tmp_path / "figures").exists()
