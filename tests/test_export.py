"""timm / Hub folders: export of encoders and classifiers (`vit.store.export`, `finetune.export`), and their import through
`finetune.init=local-dir:` and `hf-hub:` (no network: the Hub cache stands in for a download)."""

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import huggingface_hub.constants
import pytest
import timm
import torch
import yaml
from safetensors.torch import load_file

from finetune.export import main as export_classifier
from finetune.models import classifier_as_vit, load_classifier
from finetune.train import main as finetune
from helpers import reset_accelerate, tiny_overrides
from pretrain.train import main as pretrain
from vit.errors import ConfigError
from vit.store.checkpoint import CheckpointError, encoder_from_checkpoint, load_encoder, save_encoder
import vit.store.hub
from vit.data.sources import CIFAR10_MEAN, SYNTHETIC_MEAN, SYNTHETIC_STD
from vit.store.export import encoder_export
from pretrain.export import main as export_encoder
from vit.store.hub import load_hub_weights
from vit.models.encoder import create_model

MODEL = {"model.depth": 1}


def small(root, name, **extra):
    return tiny_overrides(root, name=name, **{"schedule.epochs": 1, **MODEL, **extra})


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """An MAE run, a linear probe of it, and the encoder exported (tracker none: this module is about the folders)."""
    root = tmp_path_factory.mktemp("export")
    try:
        assert pretrain(small(root, "mae")) == 0
        reset_accelerate()
        assert finetune(small(root, "probe", **{"finetune.mode": "linear", "finetune.init": root / "runs" / "mae"})) == 0
    finally:
        reset_accelerate()
    assert export_encoder([str(root / "runs" / "mae"), "--out", str(root / "hub" / "mae")]) == 0
    return SimpleNamespace(root=root, runs=root / "runs", folder=root / "hub" / "mae")


def encoder_like_the_run(**overrides):
    return create_model("vit_cifar_tiny", embed_dim=32, depth=1, num_heads=2, patch_size=8, num_classes=0, **overrides)


def test_timm_builds_the_export_and_gives_our_encoders_outputs(exported):
    ours = encoder_from_checkpoint(exported.runs / "mae").eval()
    theirs = timm.create_model(f"local-dir:{exported.folder}", pretrained=True).eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(theirs.forward_features(x), ours.forward_features(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(theirs(x), ours(x), rtol=1e-5, atol=1e-5)


def test_config_json_is_timms_hub_format_with_the_runs_normalisation(exported):
    config = json.loads((exported.folder / "config.json").read_text())
    assert config["num_classes"] == 0 and config["num_features"] == 32 and config["model_args"]["depth"] == 1
    cfg = config["pretrained_cfg"]
    assert cfg["input_size"] == [3, 32, 32] and cfg["mean"] == list(SYNTHETIC_MEAN) and cfg["std"] == list(SYNTHETIC_STD)
    assert {"interpolation", "crop_pct", "first_conv", "classifier"} <= set(cfg)


def test_an_export_is_readable_as_the_umask_allows(exported, tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        assert export_encoder([str(exported.runs / "mae"), "--out", str(tmp_path / "shared")]) == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "shared").iterdir()}
    assert modes == {"model.safetensors": 0o644, "config.json": 0o644, "README.md": 0o644}  # safetensors alone wrote 0600


def test_model_card_has_hub_front_matter_the_recipe_and_the_probes_accuracy(exported):
    text = (exported.folder / "README.md").read_text()
    _, header, body = text.split("---\n", 2)
    meta = yaml.safe_load(header)
    probe = json.loads((exported.runs / "probe" / "summary.json").read_text())
    assert meta["library_name"] == "timm" and meta["pipeline_tag"] == "image-feature-extraction" and meta["metrics"] == ["accuracy"]
    values = {(r["dataset"]["split"], r["metrics"][0]["value"]) for r in meta["model-index"][0]["results"]}
    assert ("test", round(100 * probe["test_top1"], 2)) in values
    commit = yaml.safe_load((exported.runs / "mae" / "config.yaml").read_text())["meta"]["git_commit"]
    assert commit in body and "mask ratio 0.75" in body and "| probe | linprobe |" in body
    assert f'timm.create_model("local-dir:{exported.folder}"' in body


def test_the_card_credits_only_runs_that_used_this_encoder_not_one_of_the_same_name(exported, tmp_path):
    """runs_started_from matched a run's recorded parent by folder name alone: a probe of runs/mae, run into another run
    folder, was reported in the card of that folder's own mae, a different encoder."""
    other = tmp_path / "runs_v2"
    shutil.copytree(exported.runs / "mae", other / "mae")
    shutil.copytree(exported.runs / "probe", other / "probe")  # its parent: exported.runs / "mae", which still exists
    assert encoder_export(other / "mae").used_by == []
    (tmp_path / "link").symlink_to(exported.runs / "mae")  # a link to the run: the runs beside the run itself count
    assert "probe" in [r["run"] for r in encoder_export(tmp_path / "link").used_by]


def test_the_card_leaves_out_eval_runs_and_names_the_images_each_accuracy_is_of(exported, tmp_path):
    """An eval run of the probe was credited as a second run of the encoder, with the probe's own numbers; and a run on
    the whole test split stood beside runs on a subset of it, both as 'test'."""
    probe = json.loads((exported.runs / "probe" / "summary.json").read_text())
    config = yaml.safe_load((exported.runs / "probe" / "config.yaml").read_text())
    evaluated = exported.runs / "probe_evaluated_again"
    evaluated.mkdir()
    try:
        (evaluated / "config.yaml").write_text(yaml.safe_dump(config))
        (evaluated / "summary.json").write_text(json.dumps({**probe, "job_type": "eval"}))
        exp = encoder_export(exported.runs / "mae")
        assert [r["run"] for r in exp.used_by] == ["probe"]
        assert export_encoder([str(exported.runs / "mae"), "--out", str(tmp_path / "card")]) == 0
    finally:
        shutil.rmtree(evaluated)
    _, header, body = (tmp_path / "card" / "README.md").read_text().split("---\n", 2)
    names = [r["metrics"][0]["name"] for r in yaml.safe_load(header)["model-index"][0]["results"]]
    data = probe["data"]
    assert names == [f"top-1, linprobe (probe; {data['val']} val images)", f"top-1, linprobe (probe; {data['test']} test images)"]
    assert f"| {data['val']} / {data['test']} |" in body and "probe_evaluated_again" not in body


def test_finetuning_from_the_export_equals_finetuning_from_the_run(exported):
    """local-dir: loads the very weights of encoder.pt: the same seed gives the same classifier and accuracy."""
    try:
        for name, init in (("from_run", exported.runs / "mae"), ("from_folder", f"local-dir:{exported.folder}")):
            assert finetune(small(exported.root, name, **{"finetune.init": init})) == 0
            reset_accelerate()
    finally:
        reset_accelerate()
    (a, _), (b, _) = load_classifier(exported.runs / "from_run"), load_classifier(exported.runs / "from_folder")
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    summaries = [json.loads((exported.runs / n / "summary.json").read_text()) for n in ("from_run", "from_folder")]
    assert summaries[0]["final_val_top1"] == summaries[1]["final_val_top1"] and summaries[1]["job_type"] == "finetune"


def test_a_hub_folder_is_resampled_to_another_image_size_like_timm_inits(exported):
    model = encoder_like_the_run(img_size=64)
    load_hub_weights(model, f"local-dir:{exported.folder}")
    assert model.pos_embed.shape == (1, 1 + 64, 32)


def broken_copy(folder: Path, tmp: Path, case: str) -> Path:
    """A copy of a good export with one thing wrong."""
    bad = tmp / case
    shutil.copytree(folder, bad)
    config = json.loads((bad / "config.json").read_text())
    if case == "no_config":
        (bad / "config.json").unlink()
    elif case == "config_not_json":
        (bad / "config.json").write_text("{")
    elif case == "no_weights":
        (bad / "model.safetensors").unlink()
    elif case == "corrupt_weights":
        (bad / "model.safetensors").write_bytes((bad / "model.safetensors").read_bytes()[:100])
    elif case in ("resnet", "unknown_architecture", "wider", "layer_scale"):
        config.update({"resnet": {"architecture": "resnet18", "model_args": {}}, "unknown_architecture": {"architecture": "vit_nonsense"}}.get(case, {}))
        config["model_args"].update({"wider": {"embed_dim": 64}, "layer_scale": {"init_values": 1e-5}}.get(case, {}))
        (bad / "config.json").write_text(json.dumps(config))
    elif case == "weights_of_another_size":
        from safetensors.torch import save_file

        save_file(create_model("vit_cifar_tiny", embed_dim=64, depth=1, num_heads=2, patch_size=8, num_classes=0).state_dict(), bad / "model.safetensors")
    elif case in ("pos_embed_without_cls_row", "oblong_patch_kernel", "integer_weights"):  # weights unlike config.json's plain ViT
        from safetensors.torch import save_file

        state = load_file(bad / "model.safetensors")
        if case == "pos_embed_without_cls_row":  # timm's no_embed_class layout
            state["pos_embed"] = state["pos_embed"][:, 1:].contiguous()
        elif case == "oblong_patch_kernel":
            state["patch_embed.proj.weight"] = state["patch_embed.proj.weight"][..., :4].contiguous()
        else:  # load_state_dict cast them to floats without a word: LayerNorm weights near 1 became exact 0s and 1s
            state["blocks.0.norm1.weight"] = state["blocks.0.norm1.weight"].long()
        save_file(state, bad / "model.safetensors")
    return bad


@pytest.mark.parametrize(
    "case, message",
    [
        ("no_config", "is not a timm model folder (no config.json)"),
        ("config_not_json", "config.json is not readable JSON"),
        ("no_weights", "holds no weights (model.safetensors or pytorch_model.bin)"),
        ("corrupt_weights", "is not a readable weights file"),
        ("resnet", "holds a timm ResNet (resnet18), not a ViT"),
        ("unknown_architecture", "timm cannot build architecture 'vit_nonsense'"),
        ("wider", "is a different encoder; to load it set model.embed_dim=64 (this run: 32)"),
        ("layer_scale", "has layer scale, which this encoder does not"),
        ("weights_of_another_size", "timm weights do not fit this encoder (weights != encoder): blocks.0.attn.proj.bias (64,) != (32,)"),
        ("pos_embed_without_cls_row", "timm weights do not fit this encoder: their pos_embed (1, 16, 32) is not a [CLS] row followed by a square"),
        ("oblong_patch_kernel", "timm weights do not fit this encoder (weights != encoder): patch_embed.proj.weight (32, 3, 8, 4) != (32, 3, 8, 8)"),
        ("integer_weights", "timm weights do not fit this encoder (weights != encoder): blocks.0.norm1.weight holds torch.int64 != torch.float32"),
    ],
)  # fmt: skip
def test_a_corrupt_or_foreign_folder_is_refused_naming_what_is_wrong(exported, tmp_path, case, message):
    bad = broken_copy(exported.folder, tmp_path, case)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_hub_weights(encoder_like_the_run(), f"local-dir:{bad}")


@pytest.mark.parametrize(
    "case, message",
    [
        ("no_config", "is damaged: its encoder 'config' is missing or not a mapping"),
        ("no_state_dict", "is damaged: its 'state_dict' is missing or not a mapping of names to tensors"),
        ("unknown_config_field", "its encoder config builds no encoder (VisionTransformer.__init__() got an unexpected keyword argument 'bogus')"),
        ("pos_embed_of_another_grid", "does not match the encoder (checkpoint != encoder): pos_embed (1, 65, 32) != (1, 17, 32)"),
        ("integer_weights", "does not match the encoder (checkpoint != encoder): blocks.0.norm1.weight holds torch.bool != torch.float32"),
    ],
)  # fmt: skip
def test_a_damaged_encoder_pt_is_one_line_for_export_and_finetuning(tmp_path, capsys, case, message):
    """An encoder.pt of the right format with a field lost, or weights that disagree with its own config: a KeyError,
    TypeError or load_state_dict's RuntimeError came out as a traceback (and the export called the file 'an MAE encoder
    checkpoint: expected ... encoder.pt'); weights of booleans loaded as floats without a word."""
    path = tmp_path / "encoder.pt"
    save_encoder(encoder_like_the_run(), path, meta={"data": {"mean": list(CIFAR10_MEAN), "std": [0.25] * 3}})
    payload = torch.load(path, weights_only=True)
    if case in ("no_config", "no_state_dict"):
        payload.pop(case.removeprefix("no_"))
    elif case == "unknown_config_field":
        payload["config"]["bogus"] = 1
    elif case == "integer_weights":  # loaded, cast to floats, without a word
        payload["state_dict"]["blocks.0.norm1.weight"] = payload["state_dict"]["blocks.0.norm1.weight"].bool()
    else:
        payload["state_dict"]["pos_embed"] = torch.zeros(1, 65, 32)
    torch.save(payload, path)
    assert export_encoder([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}") and message in err and not (tmp_path / "out").exists(), err
    if case != "unknown_config_field":  # a fine-tune builds the encoder from its own config, then loads the file into it
        with pytest.raises(CheckpointError, match=re.escape(message)):
            load_encoder(encoder_like_the_run(), path)


def test_local_dir_in_front_of_a_run_folder_says_to_drop_it(exported):
    """finetune.init takes a run folder as it is; with local-dir: in front it is read as a timm folder, and the message
    said only that it is not one."""
    with pytest.raises(CheckpointError, match=re.escape(f"{exported.runs / 'mae'} is a run folder of this project") + ".*without local-dir:"):
        load_hub_weights(encoder_like_the_run(), f"local-dir:{exported.runs / 'mae'}")


def test_timms_own_arguments_in_model_args_never_reach_timm(exported, tmp_path, monkeypatch):
    """A config.json whose model_args name another file for timm to load: only the ViT's fields reach timm, and the
    folder's own weights are what loads."""
    folder = tmp_path / "crafted"
    shutil.copytree(exported.folder, folder)
    other = tmp_path / "other.pth"
    torch.save({"not": "these weights"}, other)
    config = json.loads((folder / "config.json").read_text())
    config["model_args"].update(checkpoint_path=str(other), pretrained_cfg_overlay={"file": str(other)}, cache_dir=str(tmp_path / "elsewhere"))
    (folder / "config.json").write_text(json.dumps(config))
    called = []
    real = timm.create_model
    monkeypatch.setattr(timm, "create_model", lambda *a, **k: called.append(k) or real(*a, **k))
    model = encoder_like_the_run()
    load_hub_weights(model, f"local-dir:{folder}")
    assert called and not {"checkpoint_path", "pretrained_cfg_overlay", "cache_dir"} & set(called[0])
    expected = load_file(folder / "model.safetensors")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    assert not (tmp_path / "elsewhere").exists()


def test_a_bad_folder_stops_a_finetune_with_one_line(exported, tmp_path, capsys):
    code = finetune(small(tmp_path, "bad", **{"finetune.init": f"local-dir:{tmp_path / 'nowhere'}"}))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "model folder" in err and "does not exist" in err


def test_hf_hub_init_loads_from_the_hub_cache_when_offline(exported, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--someone--tiny"
    shutil.copytree(exported.folder, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    model = encoder_like_the_run()
    load_hub_weights(model, "hf-hub:someone/tiny")
    ours = encoder_from_checkpoint(exported.runs / "mae")
    assert torch.equal(model.blocks[0].attn.qkv.weight, ours.blocks[0].attn.qkv.weight)
    with pytest.raises(CheckpointError, match=r"unreachable \(HF_HUB_OFFLINE is set\) and no cached copy exists.*local-dir:DIR"):
        load_hub_weights(encoder_like_the_run(), "hf-hub:someone/other")


def test_hf_hub_init_downloads_config_then_the_weights_file_the_repo_has(exported, tmp_path, monkeypatch):
    """The download path, with the Hub client replaced by a copy from a folder whose weights are a legacy .bin."""
    repo = tmp_path / "repo"
    shutil.copytree(exported.folder, repo)
    torch.save(load_file(repo / "model.safetensors"), repo / "pytorch_model.bin")
    (repo / "model.safetensors").unlink()
    asked = []

    def download(repo_id, filename, revision=None):
        asked.append((repo_id, filename, revision))
        if not (repo / filename).is_file():
            raise huggingface_hub.errors.EntryNotFoundError(f"{filename} is not in {repo_id}")
        return str(repo / filename)

    monkeypatch.setattr(vit.store.hub, "hub_reachable", lambda timeout=5.0: True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    model = encoder_like_the_run()
    assert load_hub_weights(model, "hf-hub:someone/tiny@v1") == repo
    assert [a[1] for a in asked] == ["config.json", "model.safetensors", "pytorch_model.bin"] and asked[0][2] == "v1"


def test_push_without_network_is_one_line_and_the_folder_is_still_written(exported, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "pushed"
    assert export_encoder([str(exported.runs / "mae"), "--out", str(out), "--push", "me/tiny-mae"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unreachable" in err and f"hf upload me/tiny-mae {out}" in err
    assert 'timm.create_model("hf-hub:me/tiny-mae"' in (out / "README.md").read_text() and (out / "model.safetensors").is_file()
    with pytest.raises(SystemExit) as e:
        export_encoder([str(exported.runs / "mae"), "--out", str(out), "--push", "no-user"])
    assert e.value.code == 2


def test_a_linear_probe_exports_as_timms_vit_with_the_probes_logits(exported, tmp_path):
    assert export_classifier([str(exported.runs / "probe"), "--out", str(tmp_path / "probe")]) == 0
    probe, _ = load_classifier(exported.runs / "probe")
    theirs = timm.create_model(f"local-dir:{tmp_path / 'probe'}", pretrained=True).eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), probe.eval()(x), rtol=1e-5, atol=1e-5)
    config = json.loads((tmp_path / "probe" / "config.json").read_text())
    assert config["num_classes"] == 10 and len(config["label_names"]) == 10
    assert "pipeline_tag: image-classification" in (tmp_path / "probe" / "README.md").read_text()


def test_the_card_of_a_classifier_says_how_its_weights_began(exported, tmp_path):
    """Every classifier's card said "trained on an MAE-pretrained encoder" and was tagged masked-autoencoder: a ViT
    trained from scratch (a baseline) was exported with a card claiming a pretraining it never had."""
    try:
        assert finetune(small(tmp_path, "scratch", **{"finetune.init": "scratch"})) == 0
    finally:
        reset_accelerate()
    cards = {}
    for name, run in (("scratch", tmp_path / "runs" / "scratch"), ("probe", exported.runs / "probe")):
        assert export_classifier([str(run), "--out", str(tmp_path / "hub" / name)]) == 0
        cards[name] = (tmp_path / "hub" / name / "README.md").read_text()
    _, header, body = cards["scratch"].split("---\n", 2)
    assert "trained from a random initialisation (no pretraining)" in body and "MAE" not in body
    assert "masked-autoencoder" not in yaml.safe_load(header)["tags"] and "| classifier | training from scratch |" in body
    _, header, body = cards["probe"].split("---\n", 2)
    assert "trained on an MAE-pretrained encoder" in body and "masked-autoencoder" in yaml.safe_load(header)["tags"]
    assert f"| classifier | linear probe from {exported.runs / 'mae'} (pretraining run {exported.runs / 'mae'}) |" in body


def test_what_cannot_export_is_one_line(exported, tmp_path, capsys):
    with pytest.raises(CheckpointError, match="a resnet18 classifier is not a ViT"):
        classifier_as_vit(None, {"arch": "resnet18", "build": {}})
    assert export_encoder([str(exported.runs / "probe"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds a classifier; export it with python -m finetune.export" in err


def test_exporting_an_unfinished_run_warns_and_its_card_says_so(exported, tmp_path, capsys):
    """A run without a summary (still training, or stopped) refreshes its encoder.pt as it goes: a fine-tune from it warns,
    and its export did not, with a card that read like the final encoder's."""
    run = tmp_path / "runs" / "mae"
    shutil.copytree(exported.runs / "mae", run)
    (run / "summary.json").unlink()
    assert export_encoder([str(run), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"warning: the run {run} has not finished") and "encoder of step" in err
    assert "| status | unfinished: the weights of step " in (tmp_path / "out" / "README.md").read_text()
    assert export_encoder([str(exported.runs / "mae"), "--out", str(tmp_path / "done")]) == 0
    assert "warning" not in capsys.readouterr().err and "| status |" not in (tmp_path / "done" / "README.md").read_text()


def test_an_encoder_saved_before_it_recorded_its_normalisation_takes_its_datasets(tmp_path):
    run = tmp_path / "old"
    save_encoder(encoder_like_the_run(), run / "encoder.pt", meta={"run": str(run)})
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"dataset": "cifar10"}}))
    assert encoder_export(run).mean == list(CIFAR10_MEAN)


# --------------------------------------------------------------------------- --out never loses what is there


def export_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_non_empty_out_is_refused_in_one_line_and_its_files_are_kept(exported, tmp_path, capsys):
    out = tmp_path / "full"
    out.mkdir()
    (out / "README.md").write_text("important\n")
    assert export_encoder([str(exported.runs / "mae"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --out {out} is not empty (its README.md differs") and "--overwrite" in err
    assert export_files(out) == {"README.md": b"important\n"}
    assert export_encoder([str(exported.runs / "mae"), "--out", str(out), "--overwrite"]) == 0
    assert set(export_files(out)) == {"README.md", "model.safetensors", "config.json"} and (out / "README.md").read_text() != "important\n"


def test_another_encoder_is_not_exported_over_an_export_without_overwrite(exported, tmp_path, capsys):
    other = tmp_path / "other"
    save_encoder(encoder_like_the_run(), other / "encoder.pt", meta={"run": str(other)})
    (other / "config.yaml").write_text(yaml.safe_dump({"data": {"dataset": "cifar10"}}))
    out = tmp_path / "out"
    assert export_encoder([str(exported.runs / "mae"), "--out", str(out)]) == 0
    first = export_files(out)
    (out / "notes.txt").write_text("mine\n")
    assert export_encoder([str(other), "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert "its model.safetensors holds other weights" in err and "notes.txt is not a file of an export" in err
    assert export_files(out) == {**first, "notes.txt": b"mine\n"}
    assert export_encoder([str(other), "--out", str(out), "--overwrite"]) == 0
    now = export_files(out)
    assert now["model.safetensors"] != first["model.safetensors"] and now["notes.txt"] == b"mine\n"  # --overwrite: only the export's files


def test_exporting_the_same_weights_again_into_their_export_writes_nothing(exported, tmp_path, capsys):
    out = tmp_path / "again"
    assert export_encoder([str(exported.runs / "mae"), "--out", str(out)]) == 0
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert export_encoder([str(exported.runs / "mae"), "--out", str(out)]) == 0
    assert "already holds this encoder" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    (out / "README.md").write_text("my edits\n")  # the same weights, an edited card: kept
    assert export_encoder([str(exported.runs / "mae"), "--out", str(out)]) == 2
    assert "the weights are the same" in capsys.readouterr().err and (out / "README.md").read_text() == "my edits\n"


@pytest.mark.parametrize("inside", ["", "export"])
def test_an_out_at_or_inside_a_run_folder_is_refused_even_with_overwrite(exported, capsys, inside):
    run = exported.runs / "mae"
    before = sorted(p.name for p in run.iterdir())
    out = run / inside if inside else run
    for extra in ([], ["--overwrite"]):
        assert export_encoder([str(run), "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ("is the run folder" if not inside else f"is inside the run folder {run}") in err
    assert sorted(p.name for p in run.iterdir()) == before
    assert export_classifier([str(exported.runs / "probe"), "--out", str(exported.runs / "probe"), "--overwrite"]) == 2


def test_push_of_an_existing_identical_export_still_says_how_to_upload(exported, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "pushed"
    for _ in range(2):
        assert export_encoder([str(exported.runs / "mae"), "--out", str(out), "--push", "me/tiny-mae"]) == 2
        assert f"hf upload me/tiny-mae {out}" in capsys.readouterr().err
    assert export_encoder([str(exported.runs / "mae"), "--out", str(tmp_path / "x"), "--push", "me/..bad"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--push: 'me/..bad' is not a Hub model id" in err and not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- hf-hub: ids


@pytest.mark.parametrize("repo_id", ["a/b/c", "../../etc", "me/..", "a b/c"])
def test_a_malformed_hub_id_is_one_line_naming_finetune_init(tmp_path, monkeypatch, capsys, repo_id):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match=re.escape(f"finetune.init=hf-hub:{repo_id}@main: {repo_id!r} is not a Hub model id")):
        load_hub_weights(encoder_like_the_run(), f"hf-hub:{repo_id}@main")
    assert finetune(small(tmp_path, "bad", **{"finetune.init": f"hf-hub:{repo_id}"})) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: finetune.init=hf-hub:{repo_id}: {repo_id!r} is not a Hub model id")


def test_exporting_something_else_than_an_encoder_says_what_it_is(exported, tmp_path, capsys):
    """mae.pt or a resume state given to `python -m pretrain.export`: the message said only that it is not an encoder."""
    state = next((exported.runs / "mae" / "states").iterdir())
    cases = {exported.runs / "mae" / "mae.pt": "is a whole masked autoencoder (mae.pt)", state: f"is a resume state of the run {exported.runs / 'mae'}"}
    for given, what in cases.items():
        assert export_encoder([str(given), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"error: {given} {what}" in err and "expected a pretraining run folder or its encoder.pt" in err, err
