"""Where a classifier's encoder starts from (`finetune.init`): scratch, a pretraining run folder or its `encoder.pt`,
timm's pretrained weights (`timm:NAME`, or a weights file given as `finetune.init_file`) or a Hub / local model folder.
Each is read and checked here, and a path to something else is one line saying what it is."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from vit.config import NAMED_WEIGHTS
from vit.errors import ConfigError
from vit.models.encoder import VisionTransformer
from vit.store.checkpoint import (
    CheckpointError,
    format_of,
    load_encoder,
    load_timm_weights,
    non_finite,
    read_encoder,
    read_weights_file,
    refuse_other_encoder,
    resampling,
    wrong_kind,
)
from vit.store.hub import fixed_pos_embed, hub_reachable, is_hub_init, is_model_folder, load_hub_weights, timm_architecture, unreachable
from vit.store.runs import ENCODER_FILE, is_finished, run_folder_of


def resolve_checkpoint_path(init: str | Path, file_name: str) -> Path:
    """The checkpoint `init` names: the file itself, or `file_name` inside the run folder it names."""
    path = Path(init).expanduser()
    return path / file_name if path.is_dir() else path


def encoder_init(init: str) -> Path | None:
    """The MAE `encoder.pt` that `finetune.init` names; None for scratch, `timm:` and Hub folders."""
    if init == "scratch" or init.startswith(NAMED_WEIGHTS):
        return None
    return resolve_checkpoint_path(init, ENCODER_FILE)


def read_init_encoder(init: str) -> dict[str, Any] | None:
    """The payload of the MAE `encoder.pt` that `finetune.init` names (None for scratch, `timm:` and Hub folders); a
    path to something else (a classification run, mae.pt, a resume state, an unfinished run) is one line saying what it is."""
    path = encoder_init(init)
    if path is None:
        return None
    if is_model_folder(init):  # an export read as a run folder: "encoder.pt does not exist" named a file nobody wrote
        raise CheckpointError(f"finetune.init={init} is a timm / Hub model folder, not a run folder: name it finetune.init=local-dir:{init}")
    try:
        return read_encoder(path)
    except CheckpointError as e:
        expected = f"a pretraining run folder or its {ENCODER_FILE} (finetune.mode=eval evaluates a classifier)"
        better = wrong_kind(init, ENCODER_FILE, expected, "finetune.init") or weights_file_as_init(init, path)
        raise (better or e) from None


def weights_file_as_init(init: str, path: Path) -> CheckpointError | None:
    """The error for `finetune.init` naming a bare weights file (timm's, or one a training script saved): it said only
    "not an encoder checkpoint (expected format 'vit-encoder/1')", not how such a file loads. None for any other file."""
    if not path.is_file() or isinstance(format_of(path), str):  # a checkpoint that records a format says what it is
        return None
    try:
        state = read_init_file(path)
    except CheckpointError:
        return None
    if not state:  # a dict of nothing is no weights file either
        return None
    return CheckpointError(f"finetune.init={init} is a weights file ({len(state)} tensors, no encoder config), not an MAE "
                           f"{ENCODER_FILE}: load it as timm weights with finetune.init=timm:<model name> finetune.init_file={init}")  # fmt: skip


def check_finite_weights(init: str, payload: dict[str, Any]) -> None:
    """Refuse an MAE encoder whose weights are not all finite, before any run is set up: a fine-tune stopped at its first
    step's non-finite loss only after `Run.ready` had cleared a run it replaced (run.overwrite), and kNN mode reported 0%
    top-1 (every NaN vote counted for no class). payload: `read_init_encoder`'s ({} for other inits)."""
    if bad := non_finite(payload.get("state_dict", {})):
        raise CheckpointError(f"finetune.init={init} holds weights that are not finite (NaN or inf): {bad}: the pretraining diverged "
                              "or the file is damaged")  # fmt: skip


def unfinished_encoder(path: Path, payload: dict[str, Any]) -> str | None:
    """A warning when the `encoder.pt` at `path` lies in a pretraining run that has not finished: a run refreshes its
    encoder.pt every minute or so while it trains (or was stopped), so this one is an intermediate encoder."""
    run_dir = run_folder_of(path)
    if run_dir is None or is_finished(run_dir):
        return None
    return (f"the pretraining run {run_dir} has not finished (no summary: still training, or stopped): its {ENCODER_FILE} is the "
            f"encoder of step {payload.get('step')}, not its final one")  # fmt: skip


# What the training scripts of MAE (`misc.save_model`) and timm (`CheckpointSaver`) save beside the weights: their
# command line. torch.load(weights_only=True) refused the whole file for it ("not a readable weights file").
INIT_FILE_OBJECTS = (argparse.Namespace,)
# The parts of a whole MAE (MAE's own `models_mae.py`, as its pretraining checkpoints hold it) that no encoder has.
MAE_DECODER_KEYS = ("decoder_", "mask_token")


def read_init_file(init_file: str | Path) -> dict[str, torch.Tensor]:
    """The state_dict of `finetune.init_file` (`~` expanded): `read_weights_file`'s, from a checkpoint that also holds a
    training script's arguments; a folder, or a file of other pickled objects (a whole model), is one line saying so."""
    path = Path(init_file).expanduser()
    if path.is_dir():  # said "weights file ... does not exist"
        hint = "name the weights file in it"
        if is_model_folder(path):
            hint = f"load it with finetune.init=local-dir:{init_file} and no init_file"
        raise CheckpointError(f"finetune.init_file={init_file} is a folder, not a weights file: {hint}")
    try:
        with torch.serialization.safe_globals(list(INIT_FILE_OBJECTS)):
            return read_weights_file(path)
    except CheckpointError:
        if objects := pickled_objects(path):
            more = f" and {len(objects) - 3} more" if len(objects) > 3 else ""
            raise CheckpointError(f"{path} holds pickled Python objects besides tensors ({', '.join(objects[:3])}{more}), which "
                                  "are not loaded from a weights file: save its state_dict alone (torch.save(model.state_dict(), ...))"
                                  ) from None  # fmt: skip
        raise


def pickled_objects(path: Path) -> list[str]:
    """The classes (module.name) a torch.save file pickles that a weights-only load refuses; [] when none or not such a file."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001  not a zip checkpoint (safetensors, legacy, text): nothing to name
        return []
    allowed = {f"{c.__module__}.{c.__qualname__}" for c in INIT_FILE_OBJECTS}
    return sorted(set(found) - allowed)


def without_mae_decoder(state: dict[str, torch.Tensor], where: str, say=None) -> dict[str, torch.Tensor]:
    """`state` without the decoder of a whole MAE (its pretraining checkpoint), which fine-tuning leaves out as MAE's
    `main_finetune.py` does; they were refused as unexpected weights, so no checkpoint of MAE's own training loaded."""
    decoder = [k for k in state if k.startswith(MAE_DECODER_KEYS)]
    if decoder and say is not None:
        say(f"{where}: a whole MAE: its decoder ({len(decoder)} tensors: decoder_*, mask_token) is left out, the encoder loads")
    return {k: v for k, v in state.items() if k not in decoder}


def pretrained_cfg(name: str):
    """timm's pretrained config of `name` (`arch` or `arch.tag`): a name or tag it does not know is one ConfigError
    listing the tags it knows (a tag typo was timm's RuntimeError traceback)."""
    import timm
    from timm.models import get_pretrained_cfg

    arch = name.split(".", 1)[0]
    try:
        pretrained = get_pretrained_cfg(name)
    except RuntimeError:  # "Invalid pretrained tag (x) for arch."
        pretrained = None
    if pretrained is None or not pretrained.hf_hub_id:
        tags = timm.list_pretrained(f"{arch}.*") if timm.is_model(arch) else []
        known = f"; its pretrained weights are {', '.join(tags[:8])}{', ...' if len(tags) > 8 else ''}" if tags else ""
        hub = f"; a Hub model is finetune.init=hf-hub:{name.removeprefix('hf-hub:')}" if "/" in name else ""
        raise ConfigError(f"finetune.init=timm:{name}: timm knows no pretrained weights of that name{known}{hub}")
    return pretrained


def check_timm_architecture(name: str, model: VisionTransformer) -> None:
    """Refuse, before any weights are read or downloaded, a timm model that is no ViT of this encoder's sizes, naming the
    `model.*` settings that would fit it (as for a Hub folder): a ViT-B's 330 MB were downloaded, then refused."""
    refuse_other_encoder(timm_architecture({"architecture": name}, f"finetune.init=timm:{name}"), model, f"timm:{name}")


def timm_state_dict(name: str, init_file: str | None, model: VisionTransformer | None = None) -> dict[str, torch.Tensor]:
    """Pretrained timm weights: from `init_file`, else the model hub, else the local hub cache. `model`, given, is the
    encoder they are for: a timm model of other sizes is refused before its weights are downloaded or read.

    The hub is probed once with a short timeout, so an offline machine gets one clear line
    at once instead of the hub client's retries.
    """
    if init_file:
        return read_init_file(init_file)
    import timm

    pretrained = pretrained_cfg(name)
    if hub_reachable():
        if model is not None:
            check_timm_architecture(name, model)
        try:
            return timm.create_model(name, pretrained=True).state_dict()
        except Exception as e:
            raise CheckpointError(f"finetune.init=timm:{name}: download failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    from huggingface_hub import try_to_load_from_cache

    for filename in ("model.safetensors", "pytorch_model.bin"):
        cached = try_to_load_from_cache(pretrained.hf_hub_id, filename)
        if isinstance(cached, str):
            if model is not None:
                check_timm_architecture(name, model)
            return read_weights_file(cached)
    download = f"hf download {pretrained.hf_hub_id} model.safetensors --local-dir DIR"  # the repository timm reads them from
    raise CheckpointError(f"{unreachable(f'finetune.init=timm:{name}')} and no cached copy exists; download the weights elsewhere "
                          f"(`{download}`) and pass finetune.init_file=DIR/model.safetensors")  # fmt: skip


def load_init(encoder: VisionTransformer, init: str, init_file: str | None, say=None) -> str | None:
    """Load the weights `finetune.init` names into `encoder` (nothing for scratch); returns the pretraining run an MAE
    encoder came from (its `meta.run`), else None. `say` gets a line about anything resampled or left out."""
    if init.startswith("timm:"):
        where = f"finetune.init={init}" + (f" (finetune.init_file={init_file})" if init_file else "")
        state = without_mae_decoder(timm_state_dict(init[5:], init_file, encoder), where, say)
        if bad := non_finite(state):  # as for an encoder.pt or a Hub folder: the fine-tune would stop at its first step
            raise CheckpointError(f"finetune.init={init} ({init_file or 'from the Hub'}) holds weights that are not finite "
                                  f"(NaN or inf): {bad}")  # fmt: skip
        load_timm_weights(encoder, {**state, **fixed_pos_embed(encoder, state, init)})  # a learned table is refused under sincos
        if say is not None and (note := resampling(state, encoder)):  # as an MAE encoder's resampling is said (load_encoder)
            say(f"{where}: {note}")
    elif is_hub_init(init):
        load_hub_weights(encoder, init, say)
    elif (path := encoder_init(init)) is not None:  # an MAE encoder: the architecture comes from the model config, and must match the checkpoint's
        return load_encoder(encoder, path, say).get("meta", {}).get("run")
    return None
