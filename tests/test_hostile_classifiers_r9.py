"""Hostile tests of how the classification stage builds its classifiers, round 9: `finetune.init=timm:NAME` with a tag
timm does not know, the hub reachable (a timm model of other sizes is refused before its download; the real download path
stays) or not (the cache, or one line naming the repository to download), and `finetune.init_file` holding what MAE's and
timm's training scripts save (their arguments beside the weights, a whole MAE with its decoder), a whole pickled model, a
folder, a `~` path; a weights file named as finetune.init; the resampling of timm weights said as an MAE encoder's is; the
CIFAR ResNet-18's stem initialised as torchvision initialises its other convs. Weights are built here, no network."""

import argparse
import math

import huggingface_hub.constants
import pytest
import timm
import torch
from safetensors.torch import save_file

import finetune.inits as inits
from finetune.config import FinetuneConfig
from finetune.inits import read_init_encoder
from finetune.models import build_classifier, cifar_resnet18
from finetune.train import main as finetune
from helpers import ROOT, tiny_overrides
from vit.config import load_config
from vit.errors import CheckpointError, ConfigError
from vit.tools.reference import ReferenceMAE

TIMM = "finetune.init=timm:vit_tiny_patch16_224"
HUB_REPO = "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k"  # where timm reads vit_tiny_patch16_224's default weights


def tiny_timm(**sizes) -> torch.nn.Module:
    """timm's ViT of the tiny test encoder's sizes (32 wide, 2 blocks, 2 heads), by default at 32 px, 8 px patches."""
    args = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2, "num_classes": 1000, **sizes}
    return timm.models.vision_transformer.VisionTransformer(**args)


def from_init_file(tmp_path, weights, *extra, say=None):
    """The classifier `finetune.init=timm:... finetune.init_file=weights` builds for the tiny test encoder (10 classes)."""
    cfg = load_config(FinetuneConfig, None, tiny_overrides(tmp_path) + [TIMM, f"finetune.init_file={weights}", *extra])
    return build_classifier(cfg, 10, say=say)


def encoder_weights(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.startswith("head.")}


# --------------------------------------------------------------------------- timm names and the hub


def test_a_pretrained_tag_timm_does_not_know_is_one_line_naming_the_tags_it_knows(tmp_path, capsys):
    """A typo in the tag (`..._ft_in1` for `..._ft_in1k`) was timm's RuntimeError traceback, after the run had started."""
    with pytest.raises(ConfigError) as e:
        inits.timm_state_dict("vit_tiny_patch16_224.augreg_in21k_ft_in1", None)
    assert str(e.value) == ("finetune.init=timm:vit_tiny_patch16_224.augreg_in21k_ft_in1: timm knows no pretrained weights of "
                            "that name; its pretrained weights are vit_tiny_patch16_224.augreg_in21k, "
                            "vit_tiny_patch16_224.augreg_in21k_ft_in1k")  # fmt: skip
    assert finetune(tiny_overrides(tmp_path) + [f"{TIMM}.augreg_in21k_ft_in1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its pretrained weights are vit_tiny_patch16_224.augreg_in21k," in err and "Traceback" not in err
    # A Hub id given to timm: says how a Hub model is named.
    with pytest.raises(ConfigError, match=f"of that name; a Hub model is finetune.init=hf-hub:{HUB_REPO}$"):
        inits.timm_state_dict(f"hf-hub:{HUB_REPO}", None)


@pytest.fixture
def hub(monkeypatch):
    """The hub answers; timm's `create_model(..., pretrained=True)` (its download) builds the model with a seeded random
    init instead, and every call is recorded."""
    calls, create = [], timm.create_model

    def create_model(name, pretrained=False, **kwargs):
        calls.append((name, pretrained))
        torch.manual_seed(7)
        return create(name, pretrained=False, **kwargs)

    monkeypatch.setattr(inits, "hub_reachable", lambda: True)
    monkeypatch.setattr(timm, "create_model", create_model)
    return calls


def test_the_pretrained_baseline_downloads_through_timm_and_says_what_it_resampled(hub):
    """configs/baselines/timm_vit_pretrained.yaml with the hub reachable: timm's own download (create_model, pretrained=True)
    gives the weights, loaded into our 32 px / 4 px-patch encoder. Their 16 px patch kernel and 14x14 table were resampled
    without a word, where an MAE encoder loaded at another size says so."""
    cfg = load_config(FinetuneConfig, ROOT / "configs/baselines/timm_vit_pretrained.yaml", ["run.device=cpu"])
    said = []
    built = build_classifier(cfg, 10, say=said.append)
    assert hub[-1] == ("vit_tiny_patch16_224.augreg_in21k_ft_in1k", True)
    torch.manual_seed(7)
    downloaded = timm.models.vision_transformer.vit_tiny_patch16_224()
    assert torch.equal(built.model.blocks[11].mlp.fc2.weight, downloaded.blocks[11].mlp.fc2.weight)
    assert said == [("finetune.init=timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k: patch embedding resampled from 16x16 to 4x4 "
                     "pixels, positional embeddings interpolated (bicubic) from a 14x14 to a 8x8 patch grid")]  # fmt: skip


def test_a_timm_model_of_other_sizes_is_refused_before_its_download(tmp_path, hub):
    """The tiny test encoder (32 wide, 2 blocks) and timm's ViT-Ti (192 wide, 12 blocks): its weights were downloaded, then
    refused tensor by tensor; now refused first, naming the model.* settings that fit it (as a Hub folder is)."""
    cfg = load_config(FinetuneConfig, None, tiny_overrides(tmp_path) + [TIMM])
    with pytest.raises(CheckpointError) as e:
        build_classifier(cfg, 10)
    assert str(e.value) == ("finetune.init=timm:vit_tiny_patch16_224 is a different encoder; to load it set model.embed_dim=192 "
                            "(this run: 32) model.depth=12 (this run: 2) model.num_heads=3 (this run: 2)")  # fmt: skip
    cfg = load_config(FinetuneConfig, None, tiny_overrides(tmp_path) + ["finetune.init=timm:resnet18"])
    with pytest.raises(CheckpointError, match=r"^finetune.init=timm:resnet18 holds a timm ResNet \(resnet18\), not a ViT$"):
        build_classifier(cfg, 10)
    assert all(not pretrained for _, pretrained in hub)  # nothing downloaded


def test_offline_the_hub_cache_is_read_and_without_it_the_line_names_the_repository_to_download(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    assert finetune(tiny_overrides(tmp_path, name="offline") + [TIMM]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unreachable (HF_HUB_OFFLINE is set) and no cached copy exists" in err
    assert f"(`hf download {HUB_REPO} model.safetensors --local-dir DIR`) and pass finetune.init_file=DIR/model.safetensors" in err
    # The copy timm's download left in the hub cache loads, resampled as from the hub: the pretrained baseline's config.
    repo = tmp_path / "hf" / f"models--{HUB_REPO.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc")
    (repo / "snapshots" / "abc").mkdir(parents=True)
    source = timm.models.vision_transformer.vit_tiny_patch16_224()
    save_file(source.state_dict(), str(repo / "snapshots" / "abc" / "model.safetensors"))
    said = []
    built = build_classifier(load_config(FinetuneConfig, ROOT / "configs/baselines/timm_vit_pretrained.yaml", []), 10, say=said.append)
    assert torch.equal(built.model.blocks[11].attn.qkv.weight, source.blocks[11].attn.qkv.weight)
    assert said[0].startswith("finetune.init=timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k: patch embedding resampled from 16x16")
    # A timm model of other sizes is refused before its cached weights are read, as before a download.
    with pytest.raises(CheckpointError, match=r"is a different encoder; to load it set model.embed_dim=192 \(this run: 32\)"):
        build_classifier(load_config(FinetuneConfig, None, tiny_overrides(tmp_path) + [f"{TIMM}.augreg_in21k_ft_in1k"]), 10)


# --------------------------------------------------------------------------- finetune.init_file


def test_checkpoints_that_maes_and_timms_training_scripts_write_load_as_init_file(tmp_path):
    """MAE's `misc.save_model` saves {"model", "optimizer", "epoch", "scaler", "args"} and timm's `CheckpointSaver`
    {"epoch", "arch", "state_dict", "optimizer", "version", "args", "metric"}, `args` an argparse.Namespace: a weights-only
    load refused both files whole ("not a readable weights file (UnpicklingError)"). A pretraining checkpoint of MAE's
    holds its decoder too, which fine-tuning leaves out (MAE's main_finetune.py does), as it now says."""
    torch.manual_seed(0)
    args = argparse.Namespace(model="mae_vit_tiny", mask_ratio=0.75, output_dir="./output_dir", input_size=32)
    mae = ReferenceMAE(32, 8, 3, 32, 2, 2, decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2)
    optimizer = torch.optim.AdamW(mae.parameters())
    torch.save({"model": mae.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3, "scaler": {}, "args": args},
               tmp_path / "checkpoint-3.pth")  # fmt: skip
    said = []
    built = from_init_file(tmp_path, tmp_path / "checkpoint-3.pth", say=said.append)
    encoder = {k: v for k, v in mae.state_dict().items() if not k.startswith(("decoder_", "mask_token"))}
    assert encoder_weights(built.model).keys() == encoder.keys()
    assert all(torch.equal(v, encoder[k]) for k, v in encoder_weights(built.model).items())
    decoder = len(mae.state_dict()) - len(encoder)
    assert said == [(f"{TIMM} (finetune.init_file={tmp_path / 'checkpoint-3.pth'}): a whole MAE: its decoder ({decoder} tensors: "
                     "decoder_*, mask_token) is left out, the encoder loads")]  # fmt: skip

    source = tiny_timm()
    torch.save({"epoch": 3, "arch": "vit_tiny", "state_dict": source.state_dict(), "optimizer": {}, "version": 2, "args": args,
                "metric": 0.5}, tmp_path / "model_best.pth.tar")  # fmt: skip
    built = from_init_file(tmp_path, tmp_path / "model_best.pth.tar")
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in encoder_weights(built.model).items())


def test_a_whole_pickled_model_as_init_file_is_one_line_saying_what_it_holds(tmp_path, capsys):
    """torch.save(model): the message said "not a readable weights file (UnpicklingError)" of a file torch reads."""
    torch.save(tiny_timm(), tmp_path / "vit.pth")
    with pytest.raises(CheckpointError) as e:
        from_init_file(tmp_path, tmp_path / "vit.pth")
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'vit.pth'} holds pickled Python objects besides tensors (timm.")
    assert "more), which are not loaded from a weights file: save its state_dict alone (torch.save(model.state_dict(), ...))" in message
    assert finetune(tiny_overrides(tmp_path) + [TIMM, f"finetune.init_file={tmp_path / 'vit.pth'}"]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    # Not a torch file at all: as before, one line.
    (tmp_path / "notes.pth").write_text("not weights")
    with pytest.raises(CheckpointError, match=r"notes.pth is not a readable weights file \(UnpicklingError\)$"):
        from_init_file(tmp_path, tmp_path / "notes.pth")


def test_an_init_file_under_home_or_a_folder_is_read_or_named_as_what_it_is(tmp_path, monkeypatch):
    """`finetune.init_file=~/...` (a YAML value, or quoted: no shell expands it) was "does not exist", where run.dir,
    data.root and finetune.init expand it; a folder (a Hub download, an export) was "does not exist" too."""
    monkeypatch.setenv("HOME", str(tmp_path))
    source = tiny_timm()
    save_file(source.state_dict(), str(tmp_path / "vit.safetensors"))
    built = from_init_file(tmp_path, "~/vit.safetensors")
    assert torch.equal(built.model.cls_token, source.cls_token)

    (tmp_path / "download").mkdir()
    with pytest.raises(CheckpointError, match=r"^finetune.init_file=~/download is a folder, not a weights file: name the weights file in"):
        from_init_file(tmp_path, "~/download")
    (tmp_path / "download" / "config.json").write_text("{}")  # a timm / Hub model folder: finetune.init=local-dir: reads it
    local_dir = "load it with finetune.init=local-dir:~/download and no init_file"
    with pytest.raises(CheckpointError, match=rf"^finetune.init_file=~/download is a folder, not a weights file: {local_dir}$"):
        from_init_file(tmp_path, "~/download")


@pytest.mark.parametrize("name", ["vit.safetensors", "vit.pth"])
def test_a_timm_weights_file_named_as_finetune_init_says_how_such_a_file_loads(tmp_path, capsys, name):
    """finetune.init=<timm weights>: "is not an encoder checkpoint (expected format 'vit-encoder/1')", and nothing on how
    a weights file without this project's config loads."""
    path = tmp_path / name
    state = tiny_timm().state_dict()
    if name.endswith(".safetensors"):
        save_file(state, str(path))
    else:
        torch.save({"model": state}, path)  # nested, as DeiT's and MAE's released checkpoints are
    expected = (f"finetune.init={path} is a weights file ({len(state)} tensors, no encoder config), not an MAE encoder.pt: load "
                f"it as timm weights with finetune.init=timm:<model name> finetune.init_file={path}")  # fmt: skip
    with pytest.raises(CheckpointError) as e:
        read_init_encoder(str(path))
    assert str(e.value) == expected
    assert finetune(tiny_overrides(tmp_path) + [f"finetune.init={path}"]) == 2
    assert capsys.readouterr().err == f"error: {expected}\n"


def test_an_encoder_of_another_format_version_or_a_device_file_is_named_for_what_it_is(tmp_path):
    """An encoder.pt of another format version was "a weights file (N tensors, no encoder config)" to load as timm's,
    and finetune.init=/dev/null "did not exist"."""
    from vit.models.encoder import VisionTransformer
    from vit.store.checkpoint import save_encoder

    path = tmp_path / "encoder.pt"
    save_encoder(VisionTransformer(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=0), path)
    payload = torch.load(path, weights_only=True)
    torch.save({**payload, "format": "vit-encoder/2"}, path)
    with pytest.raises(CheckpointError, match=r"records format 'vit-encoder/2', another version of 'vit-encoder/1'"):
        read_init_encoder(str(path))
    with pytest.raises(CheckpointError, match=r"^encoder checkpoint /dev/null is not a regular file$"):
        read_init_encoder("/dev/null")


# --------------------------------------------------------------------------- the ResNet baseline


def test_the_cifar_resnet18_stem_is_initialised_as_torchvision_initialises_its_convs():
    """torchvision draws every conv with kaiming_normal_(fan_out, relu); the 3x3 stem swapped in afterwards kept PyTorch's
    default (kaiming_uniform_, a=sqrt(5): std 1/sqrt(3 * fan_in) = 0.111 for 3x3x3 inputs), about twice the scale."""
    torch.manual_seed(0)
    model = cifar_resnet18(10)
    stem = model.conv1.weight  # (64, 3, 3, 3)
    assert stem.shape == (64, 3, 3, 3) and model.conv1.stride == (1, 1) and isinstance(model.maxpool, torch.nn.Identity)
    fan_out = stem.shape[0] * stem.shape[2] * stem.shape[3]
    assert abs(stem.std().item() / math.sqrt(2 / fan_out) - 1) < 0.1, stem.std().item()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)

