"""timm / Hugging Face Hub model folders: the one module that writes and reads them.

A folder holds what `timm.create_model("local-dir:DIR")` and the Hub read as they are:

    model.safetensors   the weights, timm key names (`patch_embed.proj.weight`, `blocks.0.attn.qkv.weight`, ...)
    config.json         timm's Hub config: {"architecture", "num_classes", "num_features", "global_pool",
                        "model_args": {...}, "pretrained_cfg": {"input_size", "mean", "std", "interpolation",
                        "crop_pct", ...}, "label_names": [...] (a classifier)}
    README.md           the model card (written by `vit.store.export`)
    model.safetensors.index.json and its shards: read in place of model.safetensors (a large model's Hub repo)

An encoder's config.json also holds `pretrained_on`: the data split it was pretrained on (`vit.data.provenance`,
as JSON), so fine-tuning from the folder checks val images against it as it does from the run folder; timm
ignores the key. Writing never replaces another folder's files or a run's (`write_hub_folder`).

`finetune.init=local-dir:DIR` and `finetune.init=hf-hub:USER/NAME` load such a folder, ours or any timm
ViT on the Hub, with the checks and resampling of `timm:` inits (`vit.store.checkpoint.load_timm_weights`).
"""

from __future__ import annotations

import json
import math
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import torch.nn as nn

from vit.config import HUB_PREFIXES
from vit.data.provenance import record_from_json
from vit.store.checkpoint import (CheckpointError, describe, learned_table, load_timm_weights, non_finite, read_weights_file,
                                  refuse_other_encoder, resampling)  # fmt: skip
from vit.store.atomic import atomic_write
from vit.store.runs import LOCK_FILE, holds_run, read_config
from vit.errors import ConfigError, UserError
from vit.models.encoder import VisionTransformer
from vit.models.pos_embed import sincos_2d

WEIGHTS_FILE = "model.safetensors"
LEGACY_WEIGHTS_FILE = "pytorch_model.bin"  # what older Hub repos hold instead
INDEX_FILE = "model.safetensors.index.json"  # weights sharded over several files: {"weight_map": {key: file name}}
CONFIG_FILE = "config.json"
CARD_FILE = "README.md"
PROVENANCE_KEY = "pretrained_on"  # config.json: the data split an encoder was pretrained on (`vit.data.provenance`)
# timm builds any ViT from a registered name plus `model_args` that override its sizes; this is the family's reference.
TEMPLATE_ARCHITECTURE = "vit_base_patch16_224"
# The `model_args` of a config.json that reach `timm.create_model`: a ViT's shape, and the parts `timm_architecture`
# refuses by name. Nothing else does: timm's own arguments there (`checkpoint_path`, `pretrained_cfg_overlay`,
# `cache_dir`, ...) would make it read other files.
VIT_ARGS = ("img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads", "mlp_ratio",
            "qkv_bias", "qk_norm", "init_values", "class_token", "reg_tokens", "no_embed_class", "pre_norm", "fc_norm", "act_layer")


def is_hub_init(init: str) -> bool:
    return init.startswith(HUB_PREFIXES)


def is_model_folder(path: str | os.PathLike) -> bool:
    """Whether `path` is a timm / Hub model folder (a config.json, as the exporters write), not a run folder (no run outputs)."""
    path = Path(path).expanduser()
    return path.is_dir() and (path / CONFIG_FILE).is_file() and not holds_run(path)


def check_repo_id(repo_id: str, where: str) -> None:
    """Refuse, naming `where`, a Hub repository id the Hub cannot hold (`a/b/c`, `../x`, spaces, ...), before any
    download or cache lookup turns it into the hub client's traceback."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ConfigError(f"{where}: {repo_id!r} is not a Hub model id (expected USER/NAME: letters, digits, '-', '_' and '.', "
                          "neither starting nor ending with '-' or '.', no '--' or '..')") from None  # fmt: skip


# --------------------------------------------------------------------------- writing


def hub_config(model: VisionTransformer, mean, std, label_names: list[str] | None = None,
               pretrained_on: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """timm's config.json for our encoder (headless) or classifier, with the input normalisation it was trained on and,
    given, the data split it was pretrained on (`vit.data.provenance.record_to_json`)."""
    c = model.config
    num_classes = c["num_classes"]
    model_args = {
        k: c[k] for k in ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias", "global_pool")
    }
    # Our average pooling normalises every token and then pools: timm's fc_norm=False.
    model_args.update(class_token=True, fc_norm=False, num_classes=num_classes)
    config = {
        "architecture": TEMPLATE_ARCHITECTURE,
        "num_classes": num_classes,
        "num_features": c["embed_dim"],
        "global_pool": c["global_pool"],
        "model_args": model_args,
        "pretrained_cfg": {
            "input_size": [c["in_chans"], c["img_size"], c["img_size"]],
            "fixed_input_size": True,
            "interpolation": "bilinear",  # evaluation's resampling (decode_image): timm's eval transform gives its inputs
            "crop_pct": 1.0,  # the whole image: evaluation here resizes, it does not crop
            "crop_mode": "center",
            "mean": [float(x) for x in mean],
            "std": [float(x) for x in std],
            "num_classes": num_classes,
            "pool_size": None,
            "first_conv": "patch_embed.proj",
            "classifier": "head",
            "custom_load": False,
        },
    }
    if label_names and num_classes:
        config["label_names"] = list(label_names)
    if pretrained_on:
        config[PROVENANCE_KEY] = pretrained_on
    return config


def write_hub_folder(out: str | os.PathLike, model: VisionTransformer, config: dict[str, Any], card: str,
                     overwrite: bool = False) -> list[str]:  # fmt: skip
    """Write model.safetensors, config.json and README.md into `out` (each file atomically); returns the names written.

    A folder that is not empty is refused unless all it holds equals what would be written (an earlier export of the
    same weights, config and card: only what is missing is written, often nothing) or `overwrite` (the three files are
    replaced, anything else there is left alone). A folder at or inside a run folder is refused, `overwrite` or not.
    """
    from safetensors.torch import save

    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a folder")
    if out.is_symlink() and not out.exists():  # mkdir said only "File exists"
        raise UserError(f"--out {out} is a link to {os.readlink(out)}, which does not exist: nothing was written")
    run = run_folder_holding(out)
    if run is not None:
        where = "is the run folder" if run == out.resolve() else f"is inside the run folder {run}"
        raise UserError(f"--out {out} {where}: an export goes into a folder of its own, outside every run folder")
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    files = {WEIGHTS_FILE: save(state, metadata={"format": "pt"}), CONFIG_FILE: (json.dumps(config, indent=2) + "\n").encode(),
             CARD_FILE: card.encode()}  # fmt: skip
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    # A folder where a file goes fails its write after the others were written: a half-replaced export.
    folders = [name for name in files if (out / name).is_dir() and not (out / name).is_symlink()]
    if folders:
        raise UserError(f"--out {out}: its {folders[0]} is a folder, where the export writes a file: nothing was written; "
                        "move it away or choose another --out")  # fmt: skip
    ordered = [name for name in files if name in present] + [name for name in present if name not in files]
    clashes = [name for name in ordered if name not in files or not same_bytes(out / name, files[name])]
    if clashes and not overwrite:
        same = WEIGHTS_FILE in present and WEIGHTS_FILE not in clashes
        reasons = [clash_reason(name, files, same) for name in clashes]
        raise UserError(f"--out {out} is not empty ({'; '.join(reasons)}): nothing was written; choose a new or empty folder, "
                        f"or pass --overwrite to replace {', '.join(files)} there")  # fmt: skip
    names = [name for name in files if name not in present or name in clashes]  # identical files stay untouched
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        atomic_write(out / name, lambda tmp, data=files[name]: Path(tmp).write_bytes(data))
    return names


def same_bytes(path: Path, data: bytes) -> bool:
    return path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data


def clash_reason(name: str, files: dict[str, bytes], same_weights: bool) -> str:
    if name not in files:
        return f"{name} is not a file of an export"
    if name == WEIGHTS_FILE:
        return f"its {name} holds other weights"
    same = " (the weights are the same: an earlier or edited export of them)" if same_weights else ""
    return f"its {name} differs from this export's{same}"


def run_folder_holding(path: Path) -> Path | None:
    """`path`, or the folder above it, that is a run folder (a run's outputs, lock, or config.yaml with `meta`); else None."""
    path = path.resolve()
    for folder in (path, *path.parents):
        if holds_run(folder) or (folder / LOCK_FILE).exists():
            return folder
        try:
            if isinstance((read_config(folder) or {}).get("meta"), dict):
                return folder
        except (UserError, OSError):
            continue  # a config.yaml that is no run's
    return None


# --------------------------------------------------------------------------- the hub


def hub_host() -> tuple[str, int]:
    """Host and port of the Hub endpoint huggingface_hub talks to (HF_ENDPOINT, else huggingface.co)."""
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


def hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the Hub answers a TCP connection within `timeout` seconds (False at once under HF_HUB_OFFLINE=1).

    Probing once up front gives an offline machine one clear line instead of the hub client's retries.
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    try:
        socket.create_connection(hub_host(), timeout=timeout).close()
        return True
    except OSError:
        return False


def unreachable(what: str) -> str:
    from huggingface_hub import constants

    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "no connection"
    return f"{what}: the model hub ({hub_host()[0]}) is unreachable ({why})"


def push_folder(folder: Path, repo_id: str) -> str:
    """Upload `folder` to the Hub model repository `repo_id` (created if needed); returns the repository URL."""
    if not hub_reachable():
        raise UserError(f"{unreachable(f'--push {repo_id}')}; the folder is written: upload it later with "
                        f"`hf upload {repo_id} {folder}`")  # fmt: skip
    from huggingface_hub import HfApi

    api = HfApi(library_name="vit-mae")
    try:
        repo = api.create_repo(repo_id, repo_type="model", exist_ok=True)
        api.upload_folder(repo_id=repo.repo_id, folder_path=str(folder), commit_message="Upload a vit-mae export")
    except Exception as e:  # auth, permissions, quota: all one line for the user
        raise UserError(f"--push {repo_id}: upload failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                        "log in with `hf auth login` or set HF_TOKEN") from None  # fmt: skip
    return f"{hub_host()[0]}/{repo.repo_id}"


def hub_folder(init: str) -> Path:
    """The local folder that `local-dir:DIR` or `hf-hub:USER/NAME[@REVISION]` names (downloaded or cached)."""
    kind, _, ident = init.partition(":")
    if not ident:
        raise UserError(f"finetune.init={init}: expected {kind}:<{'folder' if kind == 'local-dir' else 'user/name'}>")
    if kind == "local-dir":
        return Path(ident).expanduser()
    repo_id, _, revision = ident.partition("@")
    check_repo_id(repo_id, f"finetune.init={init}")
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError

    files = []
    if hub_reachable():
        pending = [CONFIG_FILE, WEIGHTS_FILE, LEGACY_WEIGHTS_FILE, INDEX_FILE]
        while pending:
            name = pending.pop(0)
            try:
                files.append(hf_hub_download(repo_id, name, revision=revision or None))
            except Exception as e:
                if name in (WEIGHTS_FILE, LEGACY_WEIGHTS_FILE, INDEX_FILE) and isinstance(e, EntryNotFoundError):
                    continue  # the other weights file may be there
                raise CheckpointError(
                    f"finetune.init={init}: download of {name} failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
                ) from None
            if name == INDEX_FILE:  # sharded weights: its shards next, and nothing else
                pending = sorted(set(shard_map(Path(files[-1])).values()))
            elif name in (WEIGHTS_FILE, LEGACY_WEIGHTS_FILE):
                break
    else:
        found = try_to_load_from_cache(repo_id, CONFIG_FILE, revision=revision or None)
        if not isinstance(found, str):
            download = f"hf download {repo_id}{f' --revision {revision}' if revision else ''} --local-dir DIR"  # the revision asked for
            raise CheckpointError(f"{unreachable(f'finetune.init={init}')} and no cached copy exists; download it elsewhere "
                                  f"(`{download}`) and pass finetune.init=local-dir:DIR")  # fmt: skip
        files.append(found)
    return Path(files[0]).parent  # the hub cache keeps one snapshot folder per revision


# --------------------------------------------------------------------------- reading


def hub_provenance(init: str) -> dict[str, Any] | None:
    """The data split the encoder of `init` (`local-dir:...` or `hf-hub:...`) was pretrained on, None when its
    config.json records none (timm's and other Hub models, older exports); a damaged record is a CheckpointError."""
    folder = hub_folder(init)
    config, _ = read_hub_config(folder)
    if PROVENANCE_KEY not in config:
        return None
    return record_from_json(config[PROVENANCE_KEY], f"{folder / CONFIG_FILE}'s {PROVENANCE_KEY}")


def read_hub_config(folder: Path) -> tuple[dict[str, Any], Path]:
    """config.json of a timm / Hub folder and the path of its weights file; a missing or foreign folder is one CheckpointError."""
    if folder.is_file():  # said "does not exist"
        what = describe(folder)
        hint = f"{what}: name it without local-dir:" if what else "a timm model folder holds config.json and model.safetensors"
        raise CheckpointError(f"{folder} is a file, not a timm model folder ({hint})")
    if not folder.is_dir():
        raise CheckpointError(f"model folder {folder} does not exist")
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        if holds_run(folder):  # local-dir: in front of a run folder, which finetune.init takes as it is
            raise CheckpointError(f"{folder} is a run folder of this project, not a timm model folder (no {CONFIG_FILE}): "
                                  "name it without local-dir:")  # fmt: skip
        raise CheckpointError(f"{folder} is not a timm model folder (no {CONFIG_FILE})")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_path} is not readable JSON ({type(e).__name__})") from None
    if not isinstance(config, dict) or not isinstance(config.get("architecture"), str):
        raise CheckpointError(f"{config_path} is not a timm model config (no 'architecture')")
    weights = next((folder / n for n in (WEIGHTS_FILE, LEGACY_WEIGHTS_FILE, INDEX_FILE) if (folder / n).is_file()), None)
    if weights is None:
        raise CheckpointError(f"{folder} holds no weights ({WEIGHTS_FILE} or {LEGACY_WEIGHTS_FILE}), nor a sharded {INDEX_FILE}")
    return config, weights


def read_hub_folder(folder: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json and the weights of a timm / Hub folder; a missing, corrupt or foreign folder is one CheckpointError."""
    config, weights = read_hub_config(Path(folder))
    return config, read_shards(weights) if weights.name == INDEX_FILE else read_weights_file(weights)


def shard_map(index: Path) -> dict[str, str]:
    """{key: shard file name} of a sharded safetensors index; a damaged one, or a shard outside its folder, is a CheckpointError."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{index} is not readable JSON with a 'weight_map' ({type(e).__name__})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: its 'weight_map' is not a mapping of weight names to shard file names")
    for shard in weight_map.values():
        if Path(shard).name != shard or shard in (".", ".."):  # only files beside the index are read
            raise CheckpointError(f"{index} names the shard {shard!r}: expected a file name in the same folder")
    return weight_map


def read_shards(index: Path) -> dict[str, torch.Tensor]:
    """The weights a sharded safetensors index lists, each from the shard it names; a weight not where it says is refused."""
    weight_map, state = shard_map(index), {}
    for shard in sorted(set(weight_map.values())):
        tensors = read_weights_file(index.parent / shard)
        wanted = {k for k, v in weight_map.items() if v == shard}
        if lost := sorted(wanted - set(tensors)):
            raise CheckpointError(f"{index} lists {lost[0]!r} in {shard}, which does not hold it: the shards are incomplete")
        state.update((k, tensors[k]) for k in wanted)
    return state


def timm_architecture(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The encoder fields of the timm model that config.json describes, built on the meta device (no memory, no init cost)
    from its `model_args` of VIT_ARGS alone.

    Refuses, naming `where`, an unknown architecture, a model that is not a ViT, or a ViT with parts our
    encoder does not have (register tokens, layer scale, fc_norm, pre-norm, ...).
    """
    import timm
    import timm.models.vision_transformer as tv

    arch, args = config["architecture"], config.get("model_args") or {}
    if ":" in arch:  # timm reads `local-dir:` / `hf-hub:` names as another model's config.json, local or downloaded
        raise CheckpointError(f"{where}: config.json's architecture {arch!r} names another model ({arch.split(':')[0]}:), "
                              "not a timm architecture such as vit_base_patch16_224")  # fmt: skip
    if not isinstance(args, dict):
        raise CheckpointError(f"{where}: config.json's model_args is not a mapping")
    args = {k: v for k, v in args.items() if k in VIT_ARGS}
    try:
        with torch.device("meta"):
            m = timm.create_model(arch, pretrained=False, **args)
    except Exception as e:
        raise CheckpointError(
            f"{where}: timm cannot build architecture {arch!r} ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        ) from None
    if not isinstance(m, tv.VisionTransformer):
        raise CheckpointError(f"{where} holds a timm {type(m).__name__} ({arch}), not a ViT")
    block = m.blocks[0]
    unsupported = {
        "no class token": not m.has_class_token,
        "register tokens": m.num_reg_tokens > 0,
        "no_embed_class": m.no_embed_class,
        "fc_norm": not isinstance(m.fc_norm, nn.Identity),
        "norm_pre": not isinstance(m.norm_pre, nn.Identity),
        "layer scale": not isinstance(block.ls1, nn.Identity),
        "qk norm": not isinstance(block.attn.q_norm, nn.Identity),
        "an activation other than GELU": type(block.mlp.act) is not nn.GELU or block.mlp.act.approximate != "none",
        f"global_pool={m.global_pool!r}": m.global_pool not in ("token", "avg"),
    }
    parts = [name for name, present in unsupported.items() if present]
    if parts:
        raise CheckpointError(f"{where}: this timm ViT ({arch}) has {', '.join(parts)}, which this encoder does not")
    return {
        "in_chans": m.patch_embed.proj.in_channels,
        "embed_dim": m.embed_dim,
        "depth": len(m.blocks),
        "num_heads": block.attn.num_heads,
        "mlp_ratio": block.mlp.fc1.out_features / m.embed_dim,
        "qkv_bias": block.attn.qkv.bias is not None,
        "grid": tuple(m.patch_embed.grid_size),  # (H, W) patches: the layout of its positional table, where its weights agree
    }


def load_hub_weights(model: VisionTransformer, init: str, say: Callable[[str], None] | None = None) -> Path:
    """Load the folder that `init` (`local-dir:...` or `hf-hub:...`) names into `model`; returns the folder.

    The architecture must match field by field (naming the `model.*` overrides that would make it fit);
    image and patch size may differ and are resampled (said to `say`, as for `timm:`), and a head of another size is dropped.
    """
    folder = hub_folder(init)
    config, state = read_hub_folder(folder)
    stored = timm_architecture(config, f"finetune.init={init}")
    refuse_other_encoder(stored, model, init)
    if bad := non_finite(state):  # a fine-tune from them stops at its first non-finite loss, a kNN run reports 0% (as from an encoder.pt)
        raise CheckpointError(f"finetune.init={init} holds weights that are not finite (NaN or inf): {bad}: the folder is damaged")
    table, (height, width) = state.get("pos_embed"), stored["grid"]
    # The config's grid, unless the weights' table is of another length (a config.json that disagrees): then a square one.
    grid = stored["grid"] if table is not None and table.ndim == 3 and table.shape[1] == 1 + height * width else None
    fixed = fixed_pos_embed(model, state, init, grid)  # a sin-cos table recomputed for the model's own grid
    try:
        load_timm_weights(model, {**state, **fixed}, None if fixed else grid)
    except CheckpointError as e:  # its config.json describes this encoder (checked above): the weights disagree with it
        raise CheckpointError(f"finetune.init={init}: its weights are not the encoder its {CONFIG_FILE} describes: {e}") from None
    if say is not None and (note := resampling(state, model, grid)):
        say(f"finetune.init={init}: {note}")
    return folder


def fixed_pos_embed(model: VisionTransformer, state: dict[str, torch.Tensor], init: str,
                    grid: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """For a model with a fixed sin-cos table (model.pos_embed=sincos): {} where `state` holds none or a table that is no
    [CLS] row and square grid (load_timm_weights names that), the table recomputed for the model's grid where `state`
    holds a sin-cos one (not interpolated), and a learned table refused, as `load_encoder` does: it would load frozen.
    `grid`: the (H, W) grid of the table (its config's); a table of an H != W grid is no sin-cos table of this project."""
    table = state.get("pos_embed")
    if model.config["pos_embed"] != "sincos" or table is None or table.ndim != 3 or table.shape[-1] != model.embed_dim:
        return {}
    if grid is not None and grid[0] != grid[1]:
        raise learned_table(f"finetune.init={init}")
    grid = math.isqrt(max(table.shape[1] - 1, 0))
    if grid < 1 or grid * grid + 1 != table.shape[1]:
        return {}
    atol = 1e-4 if table.dtype in (torch.float32, torch.float64) else 1e-2  # a table saved in 16 bits
    if not torch.allclose(table[0].double(), sincos_2d(model.embed_dim, grid).double(), atol=atol):
        raise learned_table(f"finetune.init={init}")
    return {"pos_embed": sincos_2d(model.embed_dim, model.patch_embed.grid_size).unsqueeze(0).to(model.pos_embed.dtype)}
