"""Encoder and MAE checkpoints (`encoder.pt`, `mae.pt`) and timm weights.

Both hold plain tensors and dicts only, so they load with `torch.load(weights_only=True)`:

    encoder.pt: {"format": "vit-encoder/1", "config": {...VisionTransformer kwargs...},
                 "state_dict": {...timm key names...}, "step": int, "meta": {...}}
    mae.pt:     {"format": "vit-mae/1", "config": {...the encoder's kwargs...},
                 "mae": {...MaskedAutoencoder kwargs: decoder size, mask_ratio, norm_pix_loss...},
                 "state_dict": {...encoder.* and decoder keys...}, "step": int, "meta": {...}}

`mae.pt` is what figures rebuild the whole MAE from, so they never depend on resume states
(which are pruned); `pretrain.model.mae_from_checkpoint` builds the model from it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vit.errors import CheckpointError
from vit.models.encoder import VisionTransformer
from vit.models.pos_embed import resample_patch_embed, resample_pos_embed, sincos_2d
from vit.models.presets import PRESETS
from vit.store.atomic import atomic_save
from vit.store.runs import CLASSIFIER_FILE, ENCODER_FILE, MAE_FILE, describe_folder

ENCODER_FORMAT = "vit-encoder/1"
MAE_FORMAT = "vit-mae/1"
CLASSIFIER_FORMAT = "vit-classifier/1"  # written by the classification stage (finetune.models), read here for its encoder
FILE_FORMATS = {ENCODER_FILE: ENCODER_FORMAT, MAE_FILE: MAE_FORMAT, CLASSIFIER_FILE: CLASSIFIER_FORMAT}

# Fields that change the meaning of the weights: a checkpoint must agree on all of them. `pos_embed`
# (learned or fixed sin-cos) is not one: the table is stored either way, and fine-tuning a sin-cos
# pretrained encoder with a learned table that starts from it is MAE's own recipe (the other way, a learned table
# would load frozen where the run says sin-cos: `load_encoder` refuses it).
ARCHITECTURE_FIELDS = ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias")


def encoder_state_dict(model: VisionTransformer) -> dict[str, torch.Tensor]:
    """The encoder's weights without the head, detached and on the CPU."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if not k.startswith("head.")}


def save_encoder(model: VisionTransformer, path: str | os.PathLike, step: int = 0, meta: dict | None = None) -> None:
    config = {**model.config, "num_classes": 0}
    payload = {"format": ENCODER_FORMAT, "config": config, "state_dict": encoder_state_dict(model), "step": step, "meta": meta or {}}
    atomic_save(payload, path)


def save_mae(mae: nn.Module, path: str | os.PathLike, step: int = 0, meta: dict | None = None) -> None:
    """Write the whole MAE (a `pretrain.model.MaskedAutoencoder`: encoder and decoder) as `mae.pt`."""
    mae_kwargs = {**mae.decoder_config, "mask_ratio": mae.mask_ratio, "norm_pix_loss": mae.norm_pix_loss}
    state = {k: v.detach().cpu().clone() for k, v in mae.state_dict().items()}
    payload = {"format": MAE_FORMAT, "config": {**mae.encoder.config, "num_classes": 0}, "mae": mae_kwargs, "state_dict": state,
               "step": step, "meta": meta or {}}  # fmt: skip
    atomic_save(payload, path)


def read_payload(path: str | os.PathLike, what: str = "") -> dict[str, Any]:
    """The dict a checkpoint file holds, read with `weights_only=True`; a missing or corrupt file is a `CheckpointError`."""
    path = Path(path).expanduser()
    if not path.is_file():
        said = "is not a regular file" if path.exists() else "does not exist"  # /dev/null "did not exist"
        raise CheckpointError(f"{what + ' ' if what else ''}checkpoint {path} {said}")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes), not a checkpoint")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  torch raises many types for a bad file; all mean the same to the user
        detail = (str(e).strip().splitlines() or [""])[0][:120]
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}{': ' + detail if detail else ''})") from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path} is not a checkpoint of this project (it holds a {type(payload).__name__})")
    return payload


def read_checkpoint(path: str | os.PathLike, file_name: str, fmt: str, what: str) -> dict[str, Any]:
    """Load a checkpoint of format `fmt` from a file, or `file_name` inside a run folder.

    A missing, corrupt or foreign file is a `CheckpointError` naming the path.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / file_name
    payload = read_payload(path, what)
    if payload.get("format") != fmt:
        if other_version(payload.get("format"), fmt):  # a file of a later (or edited) release: not "a weights file"
            raise CheckpointError(f"{path} records format {payload['format']!r}, another version of {fmt!r}, the one this "
                                  "version of the project reads: load it with the version that wrote it")  # fmt: skip
        article = "an" if what[0] in "aeiou" else "a"
        raise CheckpointError(f"{path} is not {article} {what} checkpoint (expected format {fmt!r})")
    # A file of the right format with a field lost or of another type is damaged: say so here, not as a KeyError later.
    state = payload.get("state_dict")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} is damaged: its 'state_dict' is missing or not a mapping of names to tensors")
    payload["state_dict"] = unwrapped_keys(state, path)
    if fmt != CLASSIFIER_FORMAT and not isinstance(payload.get("config"), dict):
        raise CheckpointError(f"{path} is damaged: its encoder 'config' is missing or not a mapping")
    return payload


def other_version(recorded: Any, fmt: str) -> bool:
    """Whether `recorded` (a file's "format") is `fmt`'s kind at another version: "vit-encoder/2" for "vit-encoder/1"."""
    return isinstance(recorded, str) and recorded != fmt and recorded.split("/")[0] == fmt.split("/")[0]


def describe(path: Path) -> str | None:
    """What a checkpoint file or a folder of this project's is, in words ("a whole masked autoencoder (mae.pt)", "a
    classification run folder (classifier.pt)"); None when it is nothing this project writes."""
    if path.is_dir():
        return describe_folder(path)
    kinds = {ENCODER_FORMAT: "an MAE encoder checkpoint", MAE_FORMAT: f"a whole masked autoencoder ({MAE_FILE})",
             CLASSIFIER_FORMAT: "a classifier checkpoint"}  # fmt: skip
    return kinds.get(format_of(path))


def format_of(path: Path) -> str | None:
    """The "format" a checkpoint file of this project records; None for any other file."""
    try:
        return read_payload(path).get("format")
    except CheckpointError:
        return None


def wrong_kind(given: str, file_name: str, expected: str, key: str | None = None) -> CheckpointError | None:
    """The one-line error for the path `given` (by the setting `key`), which is not `file_name` nor a folder holding
    one, naming what it is instead of `expected`; None when it cannot tell, or the folder holds `file_name`, or `given`
    is a damaged file of that kind (then that file is at fault, and its reader's message stands). A relative path that
    does not exist names the folder it was looked in."""
    path = Path(given).expanduser()
    named = f"{key}={given}" if key else given
    if not path.exists():
        if path.is_absolute():
            return None
        return CheckpointError(f"{named} does not exist in the current folder {Path.cwd()}: expected {expected}")
    if (path / file_name).exists():
        return None
    if path.is_file() and format_of(path) == FILE_FORMATS.get(file_name):  # the right kind of file, damaged
        return None
    what = describe(path)
    return None if what is None else CheckpointError(f"{named} is {what}: expected {expected}")


def read_encoder(path: str | os.PathLike) -> dict[str, Any]:
    """Load and check an `encoder.pt` (or the one in a run folder)."""
    return read_checkpoint(path, ENCODER_FILE, ENCODER_FORMAT, "encoder")


def read_mae(path: str | os.PathLike) -> dict[str, Any]:
    """Load and check a `mae.pt` (or the one in a run folder)."""
    return read_checkpoint(path, MAE_FILE, MAE_FORMAT, "masked autoencoder")


def classifier_encoder(path: str | os.PathLike) -> tuple[VisionTransformer, dict[str, Any]]:
    """The ViT inside a `classifier.pt` (or the one in a run folder), loaded strictly, and the checkpoint's payload: our
    ViT or timm's (the same keys), or a linear probe's frozen encoder. A classifier without one is refused, and a damaged
    one (a field lost, a config that builds no encoder, weights that do not fit it) is one CheckpointError."""
    payload = read_checkpoint(path, CLASSIFIER_FILE, CLASSIFIER_FORMAT, "classifier")
    arch, build, state = payload.get("arch"), payload.get("build"), payload["state_dict"]
    if not isinstance(arch, str) or not isinstance(build, dict) or not isinstance(build.get("config"), dict):
        raise CheckpointError(f"{path} is damaged: its 'arch' or its 'build' with the encoder's 'config' is missing or of another type")
    if arch == "linear_probe":
        state = {k[len("encoder.") :]: v for k, v in state.items() if k.startswith("encoder.")}
    elif arch not in ("vit", "timm_vit"):
        raise CheckpointError(f"{path} holds a {arch} classifier: it has no ViT encoder")
    try:
        encoder = VisionTransformer(**build["config"])
    except (TypeError, ValueError) as e:  # an unknown, missing or impossible field
        raise CheckpointError(f"{path}: its encoder config builds no encoder ({str(e).splitlines()[0][:160]})") from None
    missing, unexpected = sorted(set(encoder.state_dict()) - set(state)), sorted(set(state) - set(encoder.state_dict()))
    wrong = misfits(state, encoder)
    if missing or unexpected or wrong:  # load_state_dict would raise a RuntimeError listing every tensor
        found = [f"missing {missing[:3]}" if missing else "", f"unexpected {unexpected[:3]}" if unexpected else "", wrong]
        raise CheckpointError(f"{path} does not match the encoder it records (checkpoint != encoder): {'; '.join(f for f in found if f)}")
    encoder.load_state_dict(state, strict=True)
    return encoder, payload


def config_mismatch(stored: dict, wanted: dict, fields=ARCHITECTURE_FIELDS) -> list[str]:
    """Names of the architecture fields on which two encoder configs differ, as 'field: stored != wanted'."""
    return [f"{k}: {stored.get(k)!r} != {wanted.get(k)!r}" for k in fields if stored.get(k) != wanted.get(k)]


# Fields that must agree between timm's ViT (a Hub folder, `timm:` weights) and our encoder; image and patch size are resampled.
MATCHED_FIELDS = ("in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias")


def typed(value: Any) -> str:
    """A setting's value as one types it on the command line (`false`, where Python prints `False`)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def refuse_other_encoder(stored: dict[str, Any], model: VisionTransformer, init: str) -> None:
    """A CheckpointError where the timm ViT `init` names (its `stored` MATCHED_FIELDS) is not `model`'s shape, naming the
    `model.*` settings that would make it fit (the channels are no setting: every run reads 3-channel images)."""
    settable = [k for k in MATCHED_FIELDS if k != "in_chans" and stored[k] != model.config[k]]
    found = []
    if stored["in_chans"] != model.config["in_chans"]:
        found.append(f"it takes {stored['in_chans']}-channel images (this run: {model.config['in_chans']})")
    if settable:
        found.append("to load it set " + " ".join(f"model.{k}={typed(stored[k])} (this run: {typed(model.config[k])})" for k in settable))
    if found:
        raise CheckpointError(f"finetune.init={init} is a different encoder; {'; '.join(found)}")


def preset_of(config: dict[str, Any]) -> str | None:
    """The `model.name` preset whose sizes an encoder config has (its image size aside: it is resampled), or None."""
    for name, sizes in PRESETS.items():
        if config.get("qkv_bias", True) is True and all(config.get(k) == v for k, v in sizes.items() if k != "img_size"):
            return name
    return None


def load_encoder(model: VisionTransformer, path: str | os.PathLike, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Load an `encoder.pt` into `model` strictly (the head alone may be new); returns the payload.

    Refuses a checkpoint whose stored encoder config differs from the model's (or a learned positional table for a
    model with a fixed sin-cos one), except in image size:
    an encoder pretrained at one size loads into a model of another (same patch size), its positional
    embeddings resampled to the new patch grid (a fixed sin-cos table is recomputed for it, a learned
    one interpolated bicubically), which `say` reports in one line.
    """
    payload = read_encoder(path)
    stored = payload["config"]
    diff = config_mismatch(stored, model.config, tuple(f for f in ARCHITECTURE_FIELDS if f != "img_size"))
    if diff:
        # The fields alone left the user to work out the overrides (a run's model.name is not in encoder.pt, but its sizes
        # may be a preset's); in_chans is no setting, and img_size is resampled.
        settable = [k for k in ARCHITECTURE_FIELDS if k not in ("img_size", "in_chans") and stored.get(k) not in (None, model.config[k])]
        fits = " ".join(f"model.{k}={typed(stored[k])}" for k in settable)
        preset = preset_of(stored)  # the overrides always load it; the preset name does where the run sets no sizes of its own
        named = f"model.name={preset} (or {fits})" if preset not in (None, preset_of(model.config)) and fits else fits
        hint = f"; to load it set {named}" if named else ""
        raise CheckpointError(f"{path} was saved from a different encoder (checkpoint != this run): {'; '.join(diff)}{hint}")
    state = payload["state_dict"]
    if model.config["pos_embed"] == "sincos" and stored.get("pos_embed", "learned") != "sincos":
        raise learned_table(str(path))
    if stored.get("img_size") != model.config["img_size"] and "pos_embed" in state:
        try:
            state = {**state, "pos_embed": resampled_pos_embed(state["pos_embed"], stored, model)}
        except ValueError as e:  # a table that is no square patch grid
            raise CheckpointError(f"{path} does not match the encoder: its pos_embed {tuple(state['pos_embed'].shape)}: {e}") from None
        old, new = stored["img_size"] // stored["patch_size"], model.patch_embed.grid_size
        if say is not None:
            how = "recomputed (sin-cos)" if stored.get("pos_embed") == "sincos" else "interpolated (bicubic)"
            say(f"encoder {path}: pretrained at {stored['img_size']} px, loaded at {model.config['img_size']} px: "
                f"positional embeddings {how} from a {old}x{old} to a {new}x{new} patch grid")  # fmt: skip
    wrong = misfits(state, model)
    if wrong:  # weights that disagree with the checkpoint's own config; load_state_dict would raise a RuntimeError
        raise CheckpointError(f"{path} does not match the encoder (checkpoint != encoder): {wrong}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    head_keys = {k for k in model.state_dict() if k.startswith("head.")}
    if unexpected or set(missing) != head_keys:
        lost = some(sorted(set(missing) - head_keys))
        raise CheckpointError(f"{path} does not match the encoder: missing {lost}, unexpected {some(sorted(unexpected))}")
    return payload


def learned_table(where: str) -> CheckpointError:
    """A learned positional table given to a model whose table is a fixed sin-cos one (an encoder.pt's or a timm / Hub
    folder's): it would load into the frozen parameter, a learned table fixed where the run says sin-cos."""
    return CheckpointError(f"{where} holds a learned positional table: model.pos_embed=sincos would load it frozen, not a sin-cos "
                           "table; set model.pos_embed=learned to fine-tune it")  # fmt: skip


def resampled_pos_embed(table: torch.Tensor, stored: dict, model: VisionTransformer) -> torch.Tensor:
    """A checkpoint's positional table (1, 1 + G*G, D) for `model`'s patch grid: a sin-cos table is recomputed exactly,
    a learned one interpolated (the [CLS] row kept)."""
    grid = model.patch_embed.grid_size
    if stored.get("pos_embed") == "sincos":
        return sincos_2d(table.shape[-1], grid).unsqueeze(0).to(table.dtype)
    return resample_pos_embed(table, grid, model.num_prefix_tokens)


def encoder_from_checkpoint(path: str | os.PathLike, **overrides) -> VisionTransformer:
    """A fresh `VisionTransformer` built from the config stored in `encoder.pt`, with its weights loaded."""
    payload = read_encoder(path)
    try:
        model = VisionTransformer(**{**payload["config"], **overrides})
    except (TypeError, ValueError) as e:  # an unknown, missing or impossible field
        raise CheckpointError(f"{path}: its encoder config builds no encoder ({str(e).splitlines()[0][:160]})") from None
    load_encoder(model, path)
    return model


def adapt_timm_state_dict(state_dict: dict[str, torch.Tensor], model: VisionTransformer,
                          grid: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """Make a timm ViT state_dict fit `model`: resample positional and patch embeddings, drop a mismatched head.
    `grid`: the (H, W) patch grid the weights' table was trained on, where their config says (None: square, from its length).

    Returns a new dict that `model.load_state_dict(..., strict=False)` takes with only the head missing
    (when the number of classes differs) and nothing unexpected.
    """
    out = dict(state_dict)
    for key in [k for k in out if k.startswith("fc_norm.") or k == "norm_pre.weight" or k == "norm_pre.bias"]:
        raise CheckpointError(f"timm weights with {key!r} (fc_norm / norm_pre) do not fit this encoder")
    target = model.state_dict()
    # Only a square kernel (D, C, p, p) and a (1, 1 + G*G, D) table resample; any other shape is refused by the caller.
    w = out.get("patch_embed.proj.weight")
    if w is not None and w.ndim == 4 and w.shape[-2] == w.shape[-1] != model.patch_embed.patch_size:
        out["patch_embed.proj.weight"] = resample_patch_embed(w, model.patch_embed.patch_size)
    pos = out.get("pos_embed")
    square = (model.patch_embed.grid_size,) * 2
    # A 4x16 table has the length of an 8x8 one: read as square it would load (or resample) with every position moved.
    if pos is not None and pos.ndim == 3 and (pos.shape != target["pos_embed"].shape or grid not in (None, square)):
        try:
            out["pos_embed"] = resample_pos_embed(pos, square[0], model.num_prefix_tokens, grid)
        except ValueError as e:  # no [CLS] row (timm's no_embed_class), register tokens, a cut table
            raise CheckpointError(f"timm weights do not fit this encoder: their pos_embed {tuple(pos.shape)} is not a [CLS] "
                                  f"row followed by a square patch grid ({e})") from None  # fmt: skip
    head_w = out.get("head.weight")
    if head_w is not None and ("head.weight" not in target or head_w.shape != target["head.weight"].shape):
        out.pop("head.weight")
        out.pop("head.bias", None)
    return out


def resampling(state: dict[str, torch.Tensor], model: VisionTransformer, grid: tuple[int, int] | None = None) -> str | None:
    """What loading timm weights `state` into `model` resampled, in words; None when both fit as they are. `grid`: as for
    `adapt_timm_state_dict` (the (H, W) grid of the weights' table; None: square, from its length)."""
    done = []
    kernel, table = state.get("patch_embed.proj.weight"), state.get("pos_embed")
    patch, new = model.patch_embed.patch_size, model.patch_embed.grid_size
    if kernel is not None and kernel.ndim == 4 and kernel.shape[-1] != patch:
        done.append(f"patch embedding resampled from {kernel.shape[-2]}x{kernel.shape[-1]} to {patch}x{patch} pixels")
    if table is not None and table.ndim == 3:
        old = tuple(grid) if grid is not None else (math.isqrt(max(table.shape[1] - 1, 0)),) * 2
        if table.shape[1] != model.pos_embed.shape[1] or old != (new, new):  # a 4x16 table has an 8x8 one's length
            how = "recomputed (sin-cos)" if model.config["pos_embed"] == "sincos" else "interpolated (bicubic)"
            done.append(f"positional embeddings {how} from a {old[0]}x{old[1]} to a {new}x{new} patch grid")
    return ", ".join(done) or None


def load_timm_weights(model: VisionTransformer, state_dict: dict[str, torch.Tensor], grid: tuple[int, int] | None = None) -> list[str]:
    """Load timm ViT weights into our encoder; returns the missing keys (only the head may be missing). `grid`: as for
    `adapt_timm_state_dict`."""
    adapted = adapt_timm_state_dict(state_dict, model, grid)
    wrong = misfits(adapted, model)
    if wrong:  # load_state_dict would raise a RuntimeError listing every tensor
        raise CheckpointError(f"timm weights do not fit this encoder (weights != encoder): {wrong}")
    missing, unexpected = model.load_state_dict(adapted, strict=False)
    allowed = {k for k in model.state_dict() if k.startswith("head.")}
    if unexpected or not set(missing) <= allowed:
        raise CheckpointError(f"timm weights do not fit this encoder: missing {some(sorted(set(missing) - allowed))}, "
                              f"unexpected {some(sorted(unexpected))}")  # fmt: skip
    return list(missing)


def some(keys: list[str]) -> str:
    """The first three of `keys` and how many more: a ResNet's weights given as a ViT's listed hundreds, in one line of KB."""
    return f"{keys[:3]}{f' and {len(keys) - 3} more' if len(keys) > 3 else ''}"


def misfits(state: dict[str, torch.Tensor], model: nn.Module) -> str:
    """The first tensors of `state` that do not fit `model`'s: of another shape ('key (stored) != (model)'), or of integers or
    booleans where the model has floats (load_state_dict would cast them without a word); '' when all fit."""
    target = model.state_dict()
    wrong = []
    for k, v in state.items():
        if k in target and v.shape != target[k].shape:
            wrong.append(f"{k} {tuple(v.shape)} != {tuple(target[k].shape)}")
        elif k in target and target[k].is_floating_point() and not v.is_floating_point():
            wrong.append(f"{k} holds {v.dtype} != {target[k].dtype}")
    return "; ".join(wrong[:3]) + (" ..." if len(wrong) > 3 else "")


def non_finite(tensors: dict[str, Any]) -> str:
    """The first floating-point tensors of `tensors` that hold a NaN or an infinity, named ('a, b, c, d, ...'), with one
    host read for all of them; '' when every one is finite. A diverged run's weights: a model from them gives NaN."""
    named = {k: v for k, v in tensors.items() if torch.is_tensor(v) and v.is_floating_point() and v.numel()}
    flags = [torch.isfinite(v).all() for v in named.values()]
    finite = torch.stack([f.to(flags[0].device) for f in flags]).tolist() if flags else []  # a CPU step count beside CUDA weights
    bad = [k for k, ok in zip(named, finite) if not ok]
    return ", ".join(bad[:4]) + (", ..." if len(bad) > 4 else "")


def read_weights_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A state_dict from a `.safetensors`, `.pth`/`.pt`/`.bin` file (a bare dict, or under 'model' / 'state_dict')."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"weights file {path} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(path))
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  as in `read_payload`: every type torch raises means a file it cannot read
        raise CheckpointError(f"{path} is not a readable weights file ({type(e).__name__})") from None
    if isinstance(sd, dict) and sd.get("format") in FILE_FORMATS.values():  # loaded as timm's, it would lose its config and run
        raise CheckpointError(f"{path} is this project's {sd['format']} checkpoint, not a timm weights file: pass it as finetune.init={path}")
    for key in ("model", "state_dict"):
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path} holds no state_dict of tensors")
    return unwrapped_keys(sd, path)


WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP's and torch.compile's, in either order (timm's `clean_state_dict`)


def unwrapped_keys(state: dict[str, torch.Tensor], path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """`state` with the key prefixes of a wrapped module's state_dict removed: weights saved from a DDP or compiled model
    (`_orig_mod.blocks.0...`) load as timm loads them, not as hundreds of missing and unexpected keys."""
    out = {}
    for key, value in state.items():
        name = key
        while name.startswith(WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        if name in out:
            raise CheckpointError(f"{path} holds the weight {name!r} twice (also as {key!r}): the weights of two models in one file")
        out[name] = value
    return out


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP and torch.compile wrappers (their keys gain prefixes otherwise)."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        else:
            return model
