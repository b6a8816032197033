"""Hostile tests of loading timm / Hub model folders, timm weights files and encoder checkpoints into our encoder."""

import json
import re

import huggingface_hub
import pytest
import torch
from helpers import TINY_VIT as TINY
from helpers import saved_for_hub as saved
from helpers import tiny_timm_vit as timm_vit
from safetensors.torch import save_file
from timm.layers import resample_abs_pos_embed

import vit.store.hub
from vit.errors import CheckpointError
from vit.models.encoder import VisionTransformer
from vit.models.pos_embed import resample_pos_embed
from vit.store.checkpoint import load_encoder, load_timm_weights, read_weights_file, save_encoder
from vit.store.hub import load_hub_weights


def ours(**kw) -> VisionTransformer:
    return VisionTransformer(**{**TINY, **kw}).eval()


@pytest.mark.parametrize("prefix", [0, 1])
def test_a_table_of_a_non_square_grid_resamples_as_timms_does(prefix):
    table = torch.randn(1, prefix + 4 * 16, 8)
    for new in (8, 5):
        expected = resample_abs_pos_embed(table, [new, new], old_size=[4, 16], num_prefix_tokens=prefix)
        torch.testing.assert_close(resample_pos_embed(table, new, prefix, old_grid=(4, 16)), expected)
    with pytest.raises(ValueError, match=r"has 64 patch positions, not a 4x4 grid"):
        resample_pos_embed(table, 8, prefix, old_grid=(4, 4))


def test_a_folder_trained_on_a_non_square_grid_is_resampled_from_that_grid(tmp_path):
    """A timm ViT at 16x64 px (a 4x16 grid: 64 positions, as many as our 8x8 grid) loaded its table as an 8x8 one,
    every position moved, without a word; at 48 px it was interpolated as if 8x8."""
    theirs = timm_vit(img_size=(16, 64))
    folder = saved(theirs, tmp_path / "oblong")
    table = theirs.pos_embed.detach()
    for img_size, grid in ((32, 8), (48, 12)):
        model = ours(img_size=img_size)
        load_hub_weights(model, f"local-dir:{folder}")
        expected = resample_abs_pos_embed(table, [grid, grid], old_size=[4, 16], num_prefix_tokens=1)
        torch.testing.assert_close(model.pos_embed.detach(), expected)
    for oblong in (folder, saved(timm_vit(img_size=(16, 32)), tmp_path / "4x8")):  # 64 positions: read as 8x8, 32: as none
        with pytest.raises(CheckpointError, match=r"holds a learned positional table: model.pos_embed=sincos would load it frozen"):
            load_hub_weights(ours(pos_embed="sincos"), f"local-dir:{oblong}")


def test_weights_saved_from_a_wrapped_model_load_as_timm_loads_them(tmp_path):
    """Keys with DDP's `module.` or torch.compile's `_orig_mod.` prefix (timm's loader strips both) were hundreds of
    missing and unexpected keys: from a Hub folder, a timm weights file, and an encoder.pt saved from a compiled model."""
    theirs = timm_vit()
    folder = saved(theirs, tmp_path / "hub")
    state = {f"_orig_mod.module.{k}": v.contiguous() for k, v in theirs.state_dict().items()}
    save_file(state, folder / "model.safetensors")
    x = torch.randn(2, 3, 32, 32)
    model = ours()
    load_hub_weights(model, f"local-dir:{folder}")
    torch.testing.assert_close(model.forward_features(x), theirs.forward_features(x))
    torch.save({"state_dict": state}, tmp_path / "weights.pth")
    assert load_timm_weights(ours(), read_weights_file(tmp_path / "weights.pth")) == []
    save_encoder(torch.compile(model), tmp_path / "encoder.pt")
    loaded = ours()
    load_encoder(loaded, tmp_path / "encoder.pt")
    torch.testing.assert_close(loaded.forward_features(x), theirs.forward_features(x))
    torch.save({**state, "pos_embed": theirs.pos_embed.detach()}, tmp_path / "twice.pth")
    twice = r"twice.pth holds the weight 'pos_embed' twice \(also as '(_orig_mod\.module\.)?pos_embed'\)"
    with pytest.raises(CheckpointError, match=twice):
        read_weights_file(tmp_path / "twice.pth")


def test_an_encoder_checkpoint_of_other_keys_is_refused_in_one_short_line(tmp_path):
    """An encoder.pt whose keys are another model's listed every one of them (thousands of characters for a ViT-B)."""
    model = ours(depth=4)
    save_encoder(model, tmp_path / "encoder.pt")
    payload = torch.load(tmp_path / "encoder.pt", weights_only=True)
    payload["state_dict"] = {f"backbone.{k}": v for k, v in payload["state_dict"].items()}
    torch.save(payload, tmp_path / "encoder.pt")
    short = r"does not match the encoder: missing \[.*\] and \d+ more, unexpected \[.*\] and \d+ more"
    with pytest.raises(CheckpointError, match=short) as e:
        load_encoder(ours(depth=4), tmp_path / "encoder.pt")
    assert len(str(e.value)) < 500 and "\n" not in str(e.value)


def shard(folder, state, files=2):
    """`state` written as a sharded safetensors folder: model-0000i-of-0000n.safetensors and their index."""
    keys, names, weight_map = sorted(state), [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)], {}
    for i, name in enumerate(names):
        part = keys[i::files]
        save_file({k: state[k].contiguous() for k in part}, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_a_folder_of_sharded_safetensors_loads_from_its_index_locally_and_from_the_hub(tmp_path, monkeypatch):
    """A folder of shards and their index was "holds no weights"; from the Hub, the shards were never downloaded."""
    theirs = timm_vit()
    folder = saved(theirs, tmp_path / "sharded")
    weight_map = shard(folder, theirs.state_dict())
    x = torch.randn(2, 3, 32, 32)
    model = ours()
    load_hub_weights(model, f"local-dir:{folder}")
    torch.testing.assert_close(model.forward_features(x), theirs.forward_features(x))
    asked = []

    def download(repo_id, filename, revision=None):
        asked.append(filename)
        if not (folder / filename).is_file():
            raise huggingface_hub.errors.EntryNotFoundError(f"{filename} is not in {repo_id}")
        return str(folder / filename)

    monkeypatch.setattr(vit.store.hub, "hub_reachable", lambda timeout=5.0: True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert load_hub_weights(ours(), "hf-hub:someone/sharded") == folder
    shards = sorted(set(weight_map.values()))
    assert asked == ["config.json", "model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", *shards]
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {**weight_map, "norm.weight": "model-00001-of-00002.safetensors",
                                                "norm.bias": "model-00001-of-00002.safetensors"}}))  # fmt: skip
    lost = "norm.bias" if weight_map["norm.bias"] != "model-00001-of-00002.safetensors" else "norm.weight"
    with pytest.raises(CheckpointError, match=rf"lists '{lost}' in model-00001-of-00002.safetensors, which does not hold it"):
        load_hub_weights(ours(), f"local-dir:{folder}")
    index.write_text(json.dumps({"weight_map": {"norm.weight": "../model.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"names the shard '\.\./model\.safetensors': expected a file name in the same folder"):
        load_hub_weights(ours(), f"local-dir:{folder}")


def test_a_config_json_that_disagrees_with_its_weights_is_named_with_its_folder(tmp_path):
    """config.json saying depth 2 over weights of one block was 'timm weights do not fit ...', naming no folder."""
    folder = saved(timm_vit(), tmp_path / "liar")
    config = json.loads((folder / "config.json").read_text())
    config["model_args"]["depth"] = 2
    (folder / "config.json").write_text(json.dumps(config))
    message = (f"finetune.init=local-dir:{folder}: its weights are not the encoder its config.json describes: "
               "timm weights do not fit this encoder: missing ['blocks.1.")  # fmt: skip
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_hub_weights(ours(depth=2), f"local-dir:{folder}")


def test_a_timm_folder_in_bf16_with_average_pooling_gives_timms_features_and_pooling(tmp_path):
    """Checked right: 16-bit weights load into a float32 encoder at another image and patch size, and with timm's
    fc_norm=False its average pooling is ours."""
    theirs = timm_vit(global_pool="avg", fc_norm=False).to(torch.bfloat16)
    folder = saved(theirs, tmp_path / "bf16")
    model = ours(global_pool="avg")
    load_hub_weights(model, f"local-dir:{folder}")
    reference = timm_vit(global_pool="avg", fc_norm=False)
    reference.load_state_dict({k: v.float() for k, v in theirs.state_dict().items()})
    x = torch.randn(2, 3, 32, 32)
    assert model.pos_embed.dtype == torch.float32
    torch.testing.assert_close(model(x), reference(x))
    bigger = ours(img_size=48, patch_size=8, global_pool="avg")
    load_hub_weights(bigger, f"local-dir:{folder}")
    expected = resample_abs_pos_embed(theirs.pos_embed.detach(), [6, 6], num_prefix_tokens=1)  # in bf16, as timm does
    torch.testing.assert_close(bigger.pos_embed.detach(), expected.float())
