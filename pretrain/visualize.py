"""Figures of what a trained encoder does, for `scripts/visualize.py`: the checkpoint, the images to show, every figure.

    written = visualize("runs/mae_cpu", [], Path("figures/mae"))   # {figure name: its PNG, or None where skipped}
    python -m pretrain.visualize --checkpoint runs/mae_cpu --out figures/mae   # the same command line as the script

A checkpoint is an `encoder.pt`, a `classifier.pt`, or the run folder holding one; the images are
a folder of image files or the run's own data config with dotted overrides. The figures are
drawn by `vit.tools.plots` (attention, rollout, positional embeddings, patch grid) and
`pretrain.figures` (the reconstruction).

It lives in `pretrain/` because the reconstruction rebuilds the whole MAE from the `mae.pt` beside
an `encoder.pt`; a `classifier.pt`'s encoder and any run's data section are read through `vit`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pretrain.figures import save_reconstruction_figure
from pretrain.model import mae_from_checkpoint
from vit.data.sources import IMAGENET_MEAN, IMAGENET_STD, NORMALIZATION
from vit.errors import CheckpointError, DataError, UserError, exit_on_user_error
from vit.models.encoder import VisionTransformer
from vit.store.checkpoint import (
    ARCHITECTURE_FIELDS,
    CLASSIFIER_FORMAT,
    ENCODER_FORMAT,
    classifier_encoder,
    config_mismatch,
    encoder_from_checkpoint,
    encoder_state_dict,
    read_payload,
)
from vit.store.runs import CLASSIFIER_FILE, CONFIG_FILE, ENCODER_FILE, FIGURES_DIR, MAE_FILE, is_run_folder, read_config
from vit.store.values import per_channel
from vit.tools.plots import check_output_folder
from vit.tools.views import figure_attention_heads, figure_patch_grid, figure_pos_similarity, figure_rollout, figure_sincos_table

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
    pool: str = "token"  # what a classifier's head reads, [CLS] or the patch tokens' mean ("avg"); an encoder.pt: [CLS]


def find_run_dir(*candidates: Path | str | None) -> Path | None:
    for c in candidates:
        if c and (Path(c) / CONFIG_FILE).is_file():
            return Path(c)
    return None


def stored_norm(path: Path, data: Any, channels: int) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """The (mean, std) a checkpoint records of its training data (`data`: its "data" entry), None where it records none;
    one that is not `channels` finite numbers each, with every std above zero, is a damaged checkpoint."""
    if not isinstance(data, dict) or ("mean" not in data and "std" not in data):
        return None
    mean, std = data.get("mean"), data.get("std")

    if not (per_channel(mean, channels) and per_channel(std, channels, positive=True)):
        raise CheckpointError(f"{path} is damaged: its data mean {mean!r} and std {std!r} are not {channels} numbers each, std above zero")
    return tuple(float(x) for x in mean), tuple(float(x) for x in std)


def non_finite(path: Path, model: torch.nn.Module) -> None:
    """A CheckpointError naming the first weight of `model` that holds a NaN or an infinity: its figures would be blank."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(
                f"{path} holds non-finite weights (NaN or inf in {name}): a diverged or damaged model draws blank figures"
            )


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
        meta = payload.get("meta") or {}
        if not isinstance(meta, dict) or not isinstance(meta.get("run") or "", str):
            raise CheckpointError(f"{path} is damaged: its 'meta' is not a mapping with the run folder's path as 'run'")
        run_dir = find_run_dir(path.parent, meta.get("run"))
        norm = stored_norm(path, meta.get("data"), encoder.patch_embed.proj.in_channels)
        loaded = Loaded(encoder, "encoder", path, run_dir, read_config(run_dir) if run_dir else None, norm)
    elif fmt == CLASSIFIER_FORMAT:
        encoder, payload = classifier_encoder(path)
        run_dir = find_run_dir(path.parent)
        norm = stored_norm(path, payload.get("data"), encoder.patch_embed.proj.in_channels)
        # An avg-pool head never reads [CLS]: the attention figures follow what it reads (a probe's pooling is its own)
        pool = (payload.get("build") or {}).get("pool") if payload.get("arch") == "linear_probe" else encoder.global_pool
        loaded = Loaded(encoder, "classifier", path, run_dir, read_config(run_dir) if run_dir else None, norm,
                        pool if pool in ("token", "avg") else "token")  # fmt: skip
    else:
        raise CheckpointError(f"{path} is not an {ENCODER_FILE} or {CLASSIFIER_FILE} (format {fmt!r})")
    if encoder.patch_embed.proj.in_channels != 3:  # every figure here draws RGB images, and feeds them to the encoder
        raise CheckpointError(
            f"{path} holds an encoder of {encoder.patch_embed.proj.in_channels}-channel images; these figures need RGB (3)"
        )
    non_finite(path, encoder)
    return loaded


def load_mae(loaded: Loaded):
    """The whole MAE of a pretraining run, from the mae.pt beside its encoder.pt; (mae, None) or (None, why not).

    A mae.pt whose encoder is not the one in `loaded` (another run's, or saved at another step) is skipped: its
    reconstructions would be shown beside attention maps of a different model.
    """
    if loaded.kind != "encoder":
        return None, f"{loaded.path} is a classifier: it has no MAE decoder"
    path = loaded.path.parent / MAE_FILE
    if not path.is_file():
        return None, f"no {MAE_FILE} beside {loaded.path}, which holds the encoder alone (a run pretrained before {MAE_FILE} existed?)"
    mae = mae_from_checkpoint(path).eval()
    non_finite(path, mae)
    diff = config_mismatch(mae.encoder.config, loaded.encoder.config, ARCHITECTURE_FIELDS)
    if diff:
        return None, f"{path} holds another encoder than {loaded.path} ({'; '.join(diff)})"
    ours, theirs = encoder_state_dict(loaded.encoder), encoder_state_dict(mae.encoder)
    if ours.keys() != theirs.keys() or any(not torch.equal(ours[k], theirs[k]) for k in ours):
        return None, f"{path} holds another encoder than {loaded.path} (other weights: saved at another step, or by another run)"
    return mae, None


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
    # Normalised as the encoder's training data was (it may be another data set than the one shown), else as this one is.
    mean, std = loaded.norm or (splits.mean, splits.std)
    return images, mean, std, f"{len(images)} images of the {splits.name} {name} split"


def get_images(loaded: Loaded, spec: list[str], n: int):
    """The images to show: (images (n, 3, S, S) in [0, 1], mean, std, description)."""
    size = loaded.encoder.patch_embed.img_size
    if len(spec) == 1 and "=" not in spec[0]:
        folder = Path(spec[0]).expanduser()
        if not folder.exists():
            raise DataError(f"--images {folder} does not exist (give a folder of images or data.key=value overrides)")
        images = images_from_folder(folder, size, n)
        data = (loaded.run_config or {}).get("data")
        dataset = data.get("dataset") if isinstance(data, dict) else None
        norm = loaded.norm or (NORMALIZATION.get(dataset) if isinstance(dataset, str) else None)
        note = ""
        if norm is None:
            norm, note = (IMAGENET_MEAN, IMAGENET_STD), " (no run config found: ImageNet normalisation assumed)"
        return images, norm[0], norm[1], f"{images.shape[0]} images from {folder}{note}"
    bad = [s for s in spec if "=" not in s]
    if bad:
        raise UserError(f"--images {bad[0]!r}: give one folder of images, or data overrides like data.root=PATH")
    # A bare `root=...` means data.root; a dotted key of another section (model.depth=...) has no meaning here.
    other = [s for s in spec if "." in s.split("=", 1)[0] and not s.startswith("data.")]
    if other:
        raise UserError(f"--images {other[0]!r}: only the data section can be overridden here (data.key=value)")
    if loaded.run_dir is None and not spec:
        raise UserError(
            f"no run folder with {CONFIG_FILE} found for {loaded.path}: say which images with --images FOLDER or data.dataset=... data.root=..."
        )
    return images_from_data(loaded, spec, size, n)


# --------------------------------------------------------------------------- the figures

FIGURES = ("reconstruction", "attention_heads", "attention_rollout", "pos_embed_similarity", "patch_grid", "sincos_table")
MAX_IMAGES = 64  # a figure has a column (or a row) per image: beyond this it is too wide to read, and slow to draw
SEEDS = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


def check_out(out: Path, image_spec: list[str]) -> None:
    """A UserError (one line), before any work, for an `out` that cannot take the figures or would lose or mix up
    something: a file on the way, a run folder (its own reconstruction.png), a folder where a figure goes, or a place
    inside the --images folder (the figures would be read as input images by the next call)."""
    check_output_folder(out, "--out")
    if is_run_folder(out):
        raise UserError(
            f"--out {out} is a run folder, whose own figures it would replace; write into one of its own, e.g. {out / FIGURES_DIR}"
        )
    for name in FIGURES:
        if (out / f"{name}.png").is_dir():
            raise UserError(f"--out {out}: {out / name}.png is a folder, where that figure would be written")
    if len(image_spec) == 1 and "=" not in image_spec[0] and Path(image_spec[0]).expanduser().is_dir():
        folder = Path(image_spec[0]).expanduser().resolve()
        if out.resolve() == folder or folder in out.resolve().parents:
            raise UserError(f"--out {out} lies in the --images folder {image_spec[0]}: its figures would be read as "
                            "input images the next time; write them elsewhere")  # fmt: skip


@torch.no_grad()
def visualize(checkpoint: str, image_spec: list[str], out: Path, num_images: int = 8, seed: int = 0) -> dict[str, Path | None]:
    """Every figure for `checkpoint` into `out`; returns {name: path, or None where skipped}. Prints one line per figure."""
    if not 1 <= num_images <= MAX_IMAGES:
        raise UserError(f"--num-images {num_images}: give 1 to {MAX_IMAGES} (one column of each figure per image)")
    if not SEEDS[0] <= seed <= SEEDS[1]:
        raise UserError(f"--seed {seed} is out of range: a seed is a 64-bit integer")
    check_out(out, image_spec)
    loaded = load_checkpoint(checkpoint)
    encoder = loaded.encoder.eval()
    images, mean, std, described = get_images(loaded, image_spec, num_images)
    mae, why_not = load_mae(loaded)  # before anything is written: a damaged mae.pt leaves no half-filled --out
    print(f"visualize: {loaded.kind} {loaded.path} ({encoder.config['embed_dim']}d x {encoder.config['depth']} blocks, "
          f"{encoder.config['num_heads']} heads, {encoder.patch_embed.grid_size}x{encoder.patch_embed.grid_size} patches); {described}")  # fmt: skip
    from vit.data.augment import normalize

    x = normalize(images, mean, std)  # (B, 3, S, S), as the encoder saw its training data
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path | None] = {}

    if mae is not None:
        written["reconstruction"] = save_reconstruction_figure(mae, x, mean, std, out / "reconstruction.png", seed=seed)
    else:
        written["reconstruction"] = None
        print(f"reconstruction: skipped ({why_not})")

    maps = encoder.attention_maps(x)  # depth x (B, heads, T, T)
    written["attention_heads"] = figure_attention_heads(images, maps[-1], out / "attention_heads.png", pool=loaded.pool)
    written["attention_rollout"] = figure_rollout(images, maps, out / "attention_rollout.png", pool=loaded.pool)
    written["pos_embed_similarity"] = figure_pos_similarity(encoder.pos_embed, out / "pos_embed_similarity.png")
    written["patch_grid"] = figure_patch_grid(images, encoder.patch_embed.patch_size, out / "patch_grid.png")
    written["sincos_table"] = figure_sincos_table(encoder, out / "sincos_table.png")
    if written["sincos_table"] is None:
        print(f"sincos_table: skipped (embed_dim={encoder.embed_dim} is not divisible by 4)")
    for name, path in written.items():
        if path is not None:
            print(f"{name}: {path}")
    return written


# --------------------------------------------------------------------------- the command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="visualize.py", description="Reconstructions, attention maps and positional-embedding figures")
    parser.add_argument("--checkpoint", required=True, help="encoder.pt, classifier.pt, or the run folder holding one")
    parser.add_argument("--images", nargs="*", default=[], metavar="FOLDER | data.key=value",
                        help="a folder of images, or overrides of the run's data config; default: the run's data config")  # fmt: skip
    parser.add_argument("--out", required=True, help="folder for the PNG figures")
    parser.add_argument("--num-images", type=int, default=8, help=f"images to show, 1 to {MAX_IMAGES} (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the MAE masks in the reconstruction figure")
    args = parser.parse_args(argv)
    if not 1 <= args.num_images <= MAX_IMAGES:
        parser.error(f"--num-images must be between 1 and {MAX_IMAGES} (one column of each figure per image)")
    if not SEEDS[0] <= args.seed <= SEEDS[1]:
        parser.error("--seed must be a 64-bit integer")
    if not args.out.strip():  # Path("") is the current folder: the figures would land wherever the command was run
        parser.error("--out is empty: name a folder for the figures")
    args.out = Path(args.out)
    return args


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    """`python scripts/visualize.py ...` or `python -m pretrain.visualize ...`: every figure, or one line saying what is wrong."""
    args = parse_args(argv)
    visualize(args.checkpoint, args.images, args.out, args.num_images, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
