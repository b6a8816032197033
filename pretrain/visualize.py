"""Figures of what a trained encoder does, for `scripts/visualize.py`: the checkpoint, the images to show, every figure.

    written = visualize("runs/mae_cpu", [], Path("figures/mae"))   # {figure name: its PNG, or None where skipped}

A checkpoint is an `encoder.pt`, a `classifier.pt`, or the run folder holding one; the images are
a folder of image files or the run's own data config with dotted overrides. The figures are
drawn by `vit.tools.plots` (attention, rollout, positional embeddings, patch grid) and
`pretrain.figures` (the reconstruction).

It lives in `pretrain/` because the reconstruction rebuilds the whole MAE from the `mae.pt` beside
an `encoder.pt`; a `classifier.pt`'s encoder and any run's data section are read through `vit`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pretrain.figures import save_reconstruction_figure
from pretrain.model import mae_from_checkpoint
from vit.store.checkpoint import CLASSIFIER_FORMAT, ENCODER_FORMAT, classifier_encoder, encoder_from_checkpoint, read_payload
from vit.data.sources import IMAGENET_MEAN, IMAGENET_STD, NORMALIZATION
from vit.errors import CheckpointError, DataError, UserError
from vit.models.encoder import VisionTransformer
from vit.tools.plots import check_output_folder, figure_attention_heads, figure_patch_grid, figure_pos_similarity, figure_rollout
from vit.tools.plots import figure_sincos_table
from vit.store.runs import CLASSIFIER_FILE, CONFIG_FILE, ENCODER_FILE, FIGURES_DIR, MAE_FILE, is_run_folder, read_config


# --------------------------------------------------------------------------- the checkpoint


@dataclass
class Loaded:
    """An encoder to inspect, with where it came from."""

    encoder: VisionTransformer
    kind: str  # "encoder" or "classifier"
    path: Path  # the checkpoint file
    run_dir: Path | None  # the run folder with its config.yaml, when one is found
    run_config: dict[str, Any] | None
    norm: tuple[tuple[float, ...], tuple[float, ...]] | None  # (mean, std) the classifier was trained with


def find_run_dir(*candidates: Path | str | None) -> Path | None:
    for c in candidates:
        if c and (Path(c) / CONFIG_FILE).is_file():
            return Path(c)
    return None


def load_checkpoint(checkpoint: str) -> Loaded:
    """An `encoder.pt`, a `classifier.pt`, or a run folder holding one -> the encoder, its run folder and config."""
    path = Path(checkpoint).expanduser()
    if path.is_dir():
        found = [path / name for name in (ENCODER_FILE, CLASSIFIER_FILE) if (path / name).is_file()]
        if not found:
            raise CheckpointError(f"{path} holds neither {ENCODER_FILE} nor {CLASSIFIER_FILE}")
        path = found[0]
    payload = read_payload(path)
    fmt = payload.get("format")
    if fmt == ENCODER_FORMAT:
        encoder = encoder_from_checkpoint(path)
        run_dir = find_run_dir(path.parent, payload.get("meta", {}).get("run"))
        return Loaded(encoder, "encoder", path, run_dir, read_config(run_dir) if run_dir else None, None)
    if fmt == CLASSIFIER_FORMAT:
        encoder, payload = classifier_encoder(path)
        run_dir = find_run_dir(path.parent)
        data = payload.get("data") or {}
        norm = (tuple(data["mean"]), tuple(data["std"])) if "mean" in data and "std" in data else None
        return Loaded(encoder, "classifier", path, run_dir, read_config(run_dir) if run_dir else None, norm)
    raise CheckpointError(f"{path} is not an {ENCODER_FILE} or {CLASSIFIER_FILE} (format {fmt!r})")


def load_mae(loaded: Loaded):
    """The whole MAE of a pretraining run, from the mae.pt beside its encoder.pt; (mae, None) or (None, why not)."""
    if loaded.kind != "encoder":
        return None, f"{loaded.path} is a classifier: it has no MAE decoder"
    path = loaded.path.parent / MAE_FILE
    if not path.is_file():
        return None, f"no {MAE_FILE} beside {loaded.path}, which holds the encoder alone (a run pretrained before {MAE_FILE} existed?)"
    return mae_from_checkpoint(path).eval(), None


# --------------------------------------------------------------------------- the images


def spread(n_total: int, n: int) -> torch.Tensor:
    """`n` indices spread evenly over `n_total` items (so over a split's classes): -> (min(n, n_total),) int64."""
    return torch.linspace(0, n_total - 1, min(n, n_total)).round().long().unique()


def images_from_folder(folder: Path, size: int, n: int) -> torch.Tensor:
    """Image files under `folder` (or one file), sorted by path, `n` spread over them: -> (n, 3, size, size) in [0, 1]."""
    from vit.data.decode import decode_image

    if folder.is_file():
        files = [folder]
    else:
        files = sorted(p for p in folder.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
                       and p.suffix.lower() in (".png", ".jpg", ".jpeg", ".bmp", ".webp"))  # fmt: skip
    if not files:
        raise DataError(f"no image files (.png, .jpg, .jpeg, .bmp, .webp) under {folder}")
    picked = [files[i] for i in spread(len(files), n).tolist()]
    arrays = [decode_image(p.read_bytes(), str(p), image_size=size) for p in picked]  # (size, size, 3) uint8 each
    return torch.stack([torch.from_numpy(a.copy()).permute(2, 0, 1) for a in arrays]).float() / 255  # (n, 3, S, S)


def images_from_data(loaded: Loaded, overrides: list[str], size: int, n: int):
    """`n` images of the run's data config with `overrides`: -> (images (n, 3, size, size) in [0, 1], mean, std, description)."""
    from vit.config import DataOnly, load_config
    from vit.data.loaders import open_data

    overrides = [o if o.startswith("data.") else f"data.{o}" for o in overrides]
    config_file = loaded.run_dir / CONFIG_FILE if loaded.run_dir is not None else None
    cfg = load_config(DataOnly, config_file, overrides, only=("data",))  # any stage's run: its data section alone
    data = open_data(cfg.data, out_size=size, say=lambda line: None)  # folders and shards too big for memory are streamed
    splits = data.splits
    for name, split in (("val", splits.val), ("test", splits.test), ("train", splits.train)):
        if split is not None and len(split):
            break
    images = data.pixels(split, spread(len(split), n), size).float() / 255  # (n, 3, S, S) in [0, 1]
    return images, splits.mean, splits.std, f"{len(images)} images of the {splits.name} {name} split"


def get_images(loaded: Loaded, spec: list[str], n: int):
    """The images to show: (images (n, 3, S, S) in [0, 1], mean, std, description)."""
    size = loaded.encoder.patch_embed.img_size
    if len(spec) == 1 and "=" not in spec[0]:
        folder = Path(spec[0]).expanduser()
        if not folder.exists():
            raise DataError(f"--images {folder} does not exist (give a folder of images or data.key=value overrides)")
        images = images_from_folder(folder, size, n)
        norm = loaded.norm or NORMALIZATION.get(((loaded.run_config or {}).get("data") or {}).get("dataset"))
        note = ""
        if norm is None:
            norm, note = (IMAGENET_MEAN, IMAGENET_STD), " (no run config found: ImageNet normalisation assumed)"
        return images, norm[0], norm[1], f"{images.shape[0]} images from {folder}{note}"
    bad = [s for s in spec if "=" not in s]
    if bad:
        raise UserError(f"--images {bad[0]!r}: give one folder of images, or data overrides like data.root=PATH")
    if loaded.run_dir is None and not spec:
        raise UserError(
            f"no run folder with {CONFIG_FILE} found for {loaded.path}: say which images with --images FOLDER or data.dataset=... data.root=..."
        )
    return images_from_data(loaded, spec, size, n)


# --------------------------------------------------------------------------- the figures


@torch.no_grad()
def visualize(checkpoint: str, image_spec: list[str], out: Path, num_images: int = 8, seed: int = 0) -> dict[str, Path | None]:
    """Every figure for `checkpoint` into `out`; returns {name: path, or None where skipped}. Prints one line per figure."""
    check_output_folder(out, "--out")  # before any work; and not a run folder, whose own reconstruction.png it would replace
    if is_run_folder(out):
        raise UserError(
            f"--out {out} is a run folder, whose own figures it would replace; write into one of its own, e.g. {out / FIGURES_DIR}"
        )
    loaded = load_checkpoint(checkpoint)
    encoder = loaded.encoder.eval()
    images, mean, std, described = get_images(loaded, image_spec, num_images)
    print(f"visualize: {loaded.kind} {loaded.path} ({encoder.config['embed_dim']}d x {encoder.config['depth']} blocks, "
          f"{encoder.config['num_heads']} heads, {encoder.patch_embed.grid_size}x{encoder.patch_embed.grid_size} patches); {described}")  # fmt: skip
    from vit.data.augment import normalize

    x = normalize(images, mean, std)  # (B, 3, S, S), as the encoder saw its training data
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path | None] = {}

    mae, why_not = load_mae(loaded)
    if mae is not None:
        written["reconstruction"] = save_reconstruction_figure(mae, x, mean, std, out / "reconstruction.png", seed=seed)
    else:
        written["reconstruction"] = None
        print(f"reconstruction: skipped ({why_not})")

    maps = encoder.attention_maps(x)  # depth x (B, heads, T, T)
    written["attention_heads"] = figure_attention_heads(images, maps[-1], out / "attention_heads.png")
    written["attention_rollout"] = figure_rollout(images, maps, out / "attention_rollout.png")
    written["pos_embed_similarity"] = figure_pos_similarity(encoder.pos_embed, out / "pos_embed_similarity.png")
    written["patch_grid"] = figure_patch_grid(images, encoder.patch_embed.patch_size, out / "patch_grid.png")
    written["sincos_table"] = figure_sincos_table(encoder, out / "sincos_table.png")
    if written["sincos_table"] is None:
        print(f"sincos_table: skipped (embed_dim={encoder.embed_dim} is not divisible by 4)")
    for name, path in written.items():
        if path is not None:
            print(f"{name}: {path}")
    return written
