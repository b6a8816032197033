"""Hostile input to the exporters (`python -m pretrain.export`, `python -m finetune.export`) and to `finetune.init=local-dir:`
/ `hf-hub:`: run files edited by hand, weights or normalisations that are not numbers, folders where the export writes
files, odd folder names, config.json that names another model, a learned table for a sin-cos model. Each refusal is one
line (exit 2 on the command line) before anything is written; small weights are built in tmp_path, no training."""

import ast
import json
import re
import shlex
import shutil

import huggingface_hub.constants
import pytest
import timm
import torch
import yaml
from safetensors.torch import load_file, save_file

from finetune.export import main as export_classifier
from finetune.models import Built, save_classifier
from pretrain.export import main as export_encoder
from vit.data.sources import SYNTHETIC_MEAN, SYNTHETIC_STD
from vit.errors import CheckpointError
from vit.models.encoder import create_model
from vit.models.pos_embed import sincos_2d
from vit.store.checkpoint import save_encoder
from vit.store.hub import load_hub_weights

DATA = {"dataset": "synthetic", "mean": list(SYNTHETIC_MEAN), "std": list(SYNTHETIC_STD)}


def tiny(num_classes=0, **overrides):
    return create_model("vit_cifar_tiny", embed_dim=32, depth=1, num_heads=2, patch_size=8, num_classes=num_classes, **overrides)


def encoder_run(folder, model=None, data=DATA, config=None, summary=None):
    """A pretraining run folder as far as the exporter reads it: encoder.pt, config.yaml, summary.json."""
    save_encoder(model or tiny(), folder / "encoder.pt", step=5, meta={"run": str(folder), "data": data})
    (folder / "config.yaml").write_text(yaml.safe_dump(config or {"meta": {"stage": "pretrain", "seed": 0}}))
    (folder / "summary.json").write_text(json.dumps(summary if summary is not None else {"epochs": 1}))
    return folder


def classifier_file(path, model=None):
    model = model or tiny(10)
    data = {**DATA, "image_size": 32}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_classifier(path, Built(model, "vit", {"config": model.config}), model, [f"c{i}" for i in range(10)], data, step=3)
    return path


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A good encoder export (learned positional table)."""
    root = tmp_path_factory.mktemp("hostile_export")
    assert export_encoder([str(encoder_run(root / "mae")), "--out", str(root / "hub")]) == 0
    return root / "hub"


def test_run_files_edited_by_hand_make_the_card_say_less_not_a_traceback(tmp_path):
    """A config.yaml section that is a string or a list (`optim: adamw`), a summary.json whose `data` is a list or whose
    accuracy is "high", a run beside it whose `meta` is a list or whose parent is a number or an unknown user's `~`:
    each stopped the export with an AttributeError or TypeError traceback."""
    config = {"meta": ["edited"], "optim": "adamw", "schedule": 5, "mae": "x", "data": "cifar10"}
    run = encoder_run(tmp_path / "runs" / "mae", config=config, summary={"data": [1], "epochs": "one", "wall_time_sec": "long"})
    siblings = {"a": ({"meta": ["x"]}, {"val_top1": 0.5}), "b": ({"meta": {"parent": 5}}, {"val_top1": 0.5}),
                "c": ({"meta": {"parent": "~nosuchuser_xyz/mae"}}, {"val_top1": 0.5}),
                "d": ({"meta": {"parent": str(run)}}, {"val_top1": "high", "test_top1": 0.25, "epochs": {"a": 1}})}  # fmt: skip
    for name, (cfg, summary) in siblings.items():
        (tmp_path / "runs" / name).mkdir()
        (tmp_path / "runs" / name / "config.yaml").write_text(yaml.safe_dump(cfg))
        (tmp_path / "runs" / name / "summary.json").write_text(json.dumps(summary))
    assert export_encoder([str(run), "--out", str(tmp_path / "out")]) == 0
    _, header, body = (tmp_path / "out" / "README.md").read_text().split("---\n", 2)
    results = yaml.safe_load(header)["model-index"][0]["results"]
    # c: its parent's user is not here, so its folder name counts (runs moved from elsewhere); d's "high" is no accuracy
    assert [(r["metrics"][0]["name"], r["metrics"][0]["value"]) for r in results] == [("top-1, ? (c)", 50.0), ("top-1, ? (d)", 25.0)]
    assert "| d | - | {'a': 1} | - | - | 25.0% |" in body  # the edited epochs shown as they are
    clf = classifier_file(tmp_path / "runs" / "clf" / "classifier.pt").parent
    (clf / "config.yaml").write_text(yaml.safe_dump({"meta": {"stage": "finetune"}, "finetune": "full"}))
    assert export_classifier([str(clf), "--out", str(tmp_path / "clf_out")]) == 0


@pytest.mark.parametrize("what", ["encoder", "classifier"])
def test_weights_that_are_not_finite_are_not_exported(tmp_path, capsys, what):
    """A diverged run's NaN weights were exported (and pushed) as a model that gives NaN for every image."""
    model = tiny(10 if what == "classifier" else 0)
    with torch.no_grad():
        model.blocks[0].mlp.fc1.weight[0, 0] = float("nan")
        model.norm.bias[0] = float("inf")
    if what == "encoder":
        source, export = encoder_run(tmp_path / "mae", model), export_encoder
    else:
        source, export = classifier_file(tmp_path / "clf" / "classifier.pt", model), export_classifier
    assert export([str(source), "--out", str(tmp_path / "out")]) == 2
    err = one_error_line(capsys)
    assert f"error: {source} holds weights that are not finite (NaN or inf): blocks.0.mlp.fc1.weight, norm.bias:" in err
    assert "nothing was written" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "mean, std, message",
    [
        ("abc", [0.5] * 3, "mean='abc': expected 3 finite numbers, one per input channel"),
        ([0.5, 0.5], [0.5] * 3, "mean=[0.5, 0.5]: expected 3 finite numbers"),
        ([float("nan")] * 3, [0.5] * 3, "mean=[nan, nan, nan]: expected 3 finite numbers"),
        ([0.5] * 3, [0.5, 0.0, 0.5], "std=[0.5, 0.0, 0.5]: expected 3 finite numbers, one per input channel, each above 0"),
    ],
)  # fmt: skip
def test_a_normalisation_that_is_not_one_number_per_channel_is_refused(tmp_path, capsys, mean, std, message):
    """A string mean was a ValueError traceback; a NaN mean was written into config.json as `NaN` (no JSON: the Hub and
    timm's loader refuse it); two means for three channels or a zero std were exported without a word."""
    run = encoder_run(tmp_path / "mae", data={**DATA, "mean": mean, "std": std})
    assert export_encoder([str(run), "--out", str(tmp_path / "out")]) == 2
    err = one_error_line(capsys)
    assert f"error: {run} records the input normalisation {message}" in err and not (tmp_path / "out").exists(), err


def test_a_folder_where_the_export_writes_a_file_is_refused_before_anything_is_written(folder, tmp_path, capsys):
    """--overwrite into an export whose README.md is a folder wrote model.safetensors and config.json, then failed on
    README.md (naming a temporary file): the old export half replaced, exit 2."""
    out = tmp_path / "out"
    shutil.copytree(folder, out)
    other = encoder_run(tmp_path / "other")  # other weights (another random init)
    (out / "README.md").unlink()
    (out / "README.md").mkdir()
    (out / "README.md" / "notes.txt").write_text("mine\n")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert export_encoder([str(other), "--out", str(out), "--overwrite"]) == 2
    err = one_error_line(capsys)
    assert f"--out {out}: its README.md is a folder, where the export writes a file: nothing was written" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before and (out / "README.md" / "notes.txt").is_file()


def test_an_out_that_is_a_dangling_link_says_so(folder, tmp_path, capsys):
    """mkdir on a link to nothing said only "<out>: File exists"."""
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    assert export_encoder([str(encoder_run(tmp_path / "mae")), "--out", str(tmp_path / "link")]) == 2
    assert f"--out {tmp_path / 'link'} is a link to {tmp_path / 'gone'}, which does not exist" in one_error_line(capsys)
    assert not (tmp_path / "gone").exists()


def test_local_dir_naming_a_file_says_it_is_a_file(tmp_path):
    """`finetune.init=local-dir:runs/mae/encoder.pt` said "model folder .../encoder.pt does not exist" of a file that exists."""
    run = encoder_run(tmp_path / "mae")
    with pytest.raises(CheckpointError, match=re.escape(f"{run / 'encoder.pt'} is a file, not a timm model folder (an MAE encoder ")):
        load_hub_weights(tiny(), f"local-dir:{run / 'encoder.pt'}")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path / 'notes.txt'} is a file, not a timm model folder (a timm model")):
        load_hub_weights(tiny(), f"local-dir:{tmp_path / 'notes.txt'}")


@pytest.mark.parametrize("prefix", ["local-dir:", "hf-hub:"])
def test_a_config_whose_architecture_names_another_model_is_refused(folder, tmp_path, monkeypatch, prefix):
    """config.json `"architecture": "local-dir:OTHER"` made timm read OTHER's config.json (and `hf-hub:` reach the Hub):
    the model_args whitelist that keeps timm from other files did not cover the architecture."""
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    config = json.loads((other / "config.json").read_text())
    config["model_args"]["qkv_bias"] = False  # OTHER's config: a ViT this folder's weights do not fit
    (other / "config.json").write_text(json.dumps(config))
    crafted = tmp_path / "crafted"
    shutil.copytree(folder, crafted)
    config["architecture"] = f"local-dir:{other}" if prefix == "local-dir:" else "hf-hub:someone/other"
    (crafted / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    built = []
    real = timm.create_model
    monkeypatch.setattr(timm, "create_model", lambda name, *a, **k: built.append(name) or real(name, *a, **k))
    message = f"config.json's architecture {config['architecture']!r} names another model ({prefix})"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_hub_weights(tiny(), f"local-dir:{crafted}")
    assert built == []


def test_a_sincos_model_takes_a_sincos_table_exactly_and_refuses_a_learned_one(folder, tmp_path):
    """model.pos_embed=sincos with a folder holding a learned table loaded it into the frozen table without a word (an
    encoder.pt is refused for this); a sin-cos export at another image size was interpolated, not recomputed."""
    with pytest.raises(CheckpointError, match="holds a learned positional table: model.pos_embed=sincos would load it frozen"):
        load_hub_weights(tiny(pos_embed="sincos"), f"local-dir:{folder}")
    assert export_encoder([str(encoder_run(tmp_path / "mae", tiny(pos_embed="sincos"))), "--out", str(tmp_path / "out")]) == 0
    model = tiny(pos_embed="sincos", img_size=64)
    load_hub_weights(model, f"local-dir:{tmp_path / 'out'}")
    assert torch.equal(model.pos_embed[0], sincos_2d(32, 8).float()) and not model.pos_embed.requires_grad
    learned = tiny(img_size=64)  # a learned model takes the sin-cos table as its start, resampled
    load_hub_weights(learned, f"local-dir:{tmp_path / 'out'}")
    assert learned.pos_embed.requires_grad and learned.pos_embed.shape == (1, 65, 32)


def test_the_cards_snippets_hold_an_odd_folder_name_quoted(tmp_path):
    """A folder named `my "best" run` made the card's Python line a syntax error and its finetune command split the path."""
    out = tmp_path / 'my "best" run'
    assert export_encoder([str(encoder_run(tmp_path / "mae")), "--out", str(out)]) == 0
    lines = (out / "README.md").read_text().splitlines()
    snippet = next(line for line in lines if line.startswith("model = timm.create_model("))
    assert ast.literal_eval(ast.parse(snippet).body[0].value.func.value.args[0]) == f"local-dir:{out}"
    command = next(line for line in lines if line.startswith("Fine-tune or probe it")).split("`")[1]
    assert shlex.split(command)[-1] == f"finetune.init=local-dir:{out}"
    assert load_file(out / "model.safetensors").keys() == tiny().state_dict().keys() - {"head.weight", "head.bias"}


def test_an_offline_hub_init_at_a_revision_says_how_to_download_that_revision(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(CheckpointError, match=re.escape("(`hf download someone/tiny --revision v2 --local-dir DIR`)")):
        load_hub_weights(tiny(), "hf-hub:someone/tiny@v2")


def test_a_nan_weight_in_a_hub_folder_is_refused_before_it_loads(folder, tmp_path):
    """A folder with NaN weights loaded without a word: the fine-tune stopped at its first step (an encoder.pt is refused)."""
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    state = load_file(bad / "model.safetensors")
    state["blocks.0.attn.qkv.weight"][0, 0] = float("nan")
    save_file(state, bad / "model.safetensors")
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    message = f"local-dir:{bad} holds weights that are not finite (NaN or inf): blocks.0.attn.qkv.weight"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_hub_weights(model, f"local-dir:{bad}")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def timm_file_init(tmp_path, state, *overrides):
    """The classifier `finetune.init=timm:... finetune.init_file=FILE` builds, FILE holding `state`."""
    from finetune.config import FinetuneConfig
    from finetune.models import build_classifier
    from vit.config import load_config

    weights = tmp_path / "weights.pth"
    torch.save(state, weights)
    cfg = load_config(FinetuneConfig, None, ["model.embed_dim=32", "model.depth=1", "model.num_heads=2", "model.patch_size=8",
                                             "finetune.init=timm:vit_tiny_patch16_224", f"finetune.init_file={weights}", *overrides])  # fmt: skip
    return build_classifier(cfg, num_classes=10)


def test_timm_weights_from_a_file_are_held_to_what_a_hub_folder_is(tmp_path):
    """finetune.init=timm:NAME with finetune.init_file: a NaN weight loaded (the fine-tune stopped at its first step), a
    learned table loaded frozen into a sin-cos model, and a ResNet's weights listed every one of their keys in one line
    of several KB. A hub folder (load_hub_weights) refused the first two."""
    state = {k: v for k, v in tiny().state_dict().items() if not k.startswith("head.")}
    assert timm_file_init(tmp_path, state).model is not None  # sound weights load
    with pytest.raises(CheckpointError, match=r"weights.pth\) holds weights that are not finite \(NaN or inf\): cls_token$"):
        timm_file_init(tmp_path, {**state, "cls_token": torch.full_like(state["cls_token"], float("nan"))})
    with pytest.raises(CheckpointError, match="holds a learned positional table: model.pos_embed=sincos would load it frozen"):
        timm_file_init(tmp_path, state, "model.pos_embed=sincos")
    resnet = {f"layer{i}.{j}.conv{k}.weight": torch.zeros(1) for i in range(4) for j in range(2) for k in range(3)}
    with pytest.raises(CheckpointError) as e:
        timm_file_init(tmp_path, resnet)
    assert "and 21 more" in str(e.value) and len(str(e.value)) < 400, str(e.value)
