"""Export an encoder as a timm / Hugging Face Hub folder, with a model card written from its run folder.

    python -m pretrain.export runs/mae --out exports/mae                    # a pretraining run folder or an encoder.pt
    python -m pretrain.export runs/mae --out exports/mae --push USER/NAME   # and upload it to the Hub
    python -m finetune.export runs/finetune --out exports/finetune          # a classifier, head included (same options)

`--out` must be a new or empty folder, outside every run folder; a folder holding an identical earlier export is
completed (nothing in it changes), and `--overwrite` replaces the three files of another one.

The folder (`vit.store.hub`: model.safetensors, config.json, README.md) loads as it is:
`timm.create_model("local-dir:exports/mae", pretrained=True)`, and starts a fine-tune or probe with
`finetune.init=local-dir:exports/mae` (`hf-hub:USER/NAME` once pushed).

The model card holds the architecture, the data and recipe of the run that made the weights (epochs,
wall time, device, git commit, command), and the val/test accuracy of the runs that used them
(run folders beside it whose encoder came from it), with Hub front matter (library, tags, datasets, metrics).
An encoder's config.json carries the data split it was pretrained on (`vit.store.hub.PROVENANCE_KEY`), so a
fine-tune from the folder refuses val images the encoder trained on, as one from its run folder does.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from vit.data.provenance import record_to_json
from vit.data.sources import NORMALIZATION
from vit.store.checkpoint import encoder_from_checkpoint, non_finite, read_encoder, wrong_kind
from vit.errors import CheckpointError, UserError
from vit.store.hub import check_repo_id, hub_config, is_model_folder, push_folder, write_hub_folder
from vit.store.lineage import parent_changed, run_id_of
from vit.models.encoder import VisionTransformer, count_parameters
from vit.store.runs import CLASSIFIER_FILE, ENCODER_FILE, is_finished, read_config, read_summary, run_folder_of
from vit.store.values import is_finite, per_channel, pop_out_of_range

# Hub dataset ids, for the card's front matter (the Hub links a model to these).
HUB_DATASETS = {"cifar10": "uoft-cs/cifar10", "cifar100": "uoft-cs/cifar100", "mnist": "ylecun/mnist", "fashionmnist": "zalando-datasets/fashion_mnist"}


@dataclass
class Export:
    """What goes into a Hub folder: the model in timm's layout and what the card says about it."""

    model: VisionTransformer  # headless (an encoder) or with its head (a classifier)
    kind: str  # "encoder" or "classifier"
    mean: list[float]
    std: list[float]
    dataset: str | None
    run_dir: Path | None  # the run folder that made the weights (its config.yaml and summary.json feed the card)
    label_names: list[str] | None = None
    step: int | None = None
    parent: str | None = None  # a classifier's pretraining run
    used_by: list[dict[str, Any]] = field(default_factory=list)  # summaries of the runs that started from an encoder
    pretrained_on: dict[str, Any] | None = None  # the images the weights trained on, as JSON (`vit.data.provenance.record_to_json`)
    unfinished: bool = False  # the weights of a run that has not finished (no summary): an intermediate encoder
    init: str | None = None  # a classifier's `finetune.init` (scratch, timm:..., a run, ...), None where no run folder records it
    source: str | None = None  # the path the user named (a run folder or checkpoint file), for messages


def read_run_file(run_dir: Path | None, reader: Callable[[Path], dict[str, Any] | None]) -> dict[str, Any]:
    """`read_config` or `read_summary` of a run folder, {} when absent or damaged: the card then says less."""
    if run_dir is None:
        return {}
    try:
        return reader(run_dir) or {}
    except (UserError, OSError, UnicodeDecodeError):
        return {}


def card_summary(run_dir: Path | None) -> dict[str, Any]:
    """`read_summary` of a run folder for the card, without the values no run writes (`in_bounds`: a top-1 of 170%, a
    wall time of -50 s; image counts that are no count): a hand-edited summary makes the card say less, not the wrong thing."""
    summary = read_run_file(run_dir, read_summary)
    pop_out_of_range(summary)
    return summary


def part(mapping: Any, key: str) -> dict[str, Any]:
    """`mapping[key]` where both are mappings, else {}: a config.yaml or summary.json edited by hand (a section that is a
    string or a list) makes the card say less instead of stopping the export with a traceback."""
    value = mapping.get(key) if isinstance(mapping, dict) else None
    return value if isinstance(value, dict) else {}


def runs_started_from(run_dir: Path) -> list[dict[str, Any]]:
    """Summaries of the finished run folders beside `run_dir` whose encoder came from it (their `meta.parent`), and from
    this training of it (`meta.parent_run_id`, where both record one: a run of the folder's earlier training is not).
    Eval runs are not among them: each evaluates again a classifier that is (its numbers were counted twice)."""
    run_dir = run_dir.resolve()  # a link to the run: its runs lie beside the run itself
    found, run_id = [], run_id_of(run_dir)
    for other in sorted(p for p in run_dir.parent.iterdir() if p.is_dir() and p != run_dir):
        meta = part(read_run_file(other, read_config), "meta")
        parent, summary = meta.get("parent"), card_summary(other)
        this_training = not parent_changed(meta.get("parent_run_id"), run_id)
        ours = isinstance(parent, str) and parent and names_run(parent, run_dir) and this_training
        if ours and summary and summary.get("job_type") != "eval":
            found.append({"run": other.name, **summary})
    return found


def names_run(recorded: str, run_dir: Path) -> bool:
    """Whether the parent a run recorded is `run_dir`: the same folder while the recorded path exists (another run of the
    same name elsewhere is not this one), else, the runs moved or copied since, the same folder name."""
    try:
        path = Path(recorded).expanduser()
    except RuntimeError:  # `~someone/...` of a user this machine does not have: the runs moved here from another
        path = Path(recorded)
    return path.resolve() == run_dir if path.exists() else path.name == run_dir.name


def encoder_export(path: str | Path) -> Export:
    """An `encoder.pt` (or the pretraining run folder holding one) ready to export."""
    path = Path(path).expanduser()
    if is_model_folder(path):
        raise CheckpointError(f"{path} is a timm / Hub model folder, already an export: expected a pretraining run folder or its {ENCODER_FILE}")
    if path.is_dir() and not (path / ENCODER_FILE).exists() and (path / CLASSIFIER_FILE).exists():
        raise CheckpointError(f"{path} holds a classifier; export it with python -m finetune.export {path} --out DIR")
    try:
        payload = read_encoder(path)
    except CheckpointError as e:  # mae.pt, a resume state, an unfinished run: say what it is
        raise (wrong_kind(str(path), ENCODER_FILE, f"a pretraining run folder or its {ENCODER_FILE}") or e) from None
    model = encoder_from_checkpoint(path).eval()
    run_dir = run_folder_of(path)
    data = part(part(payload, "meta"), "data")
    dataset = data.get("dataset") or part(read_run_file(run_dir, read_config), "data").get("dataset")
    dataset = dataset if isinstance(dataset, str) else None
    if "mean" in data:
        mean, std = data["mean"], data["std"]
    elif dataset in NORMALIZATION:  # an encoder.pt that records no normalisation: its dataset's
        mean, std = NORMALIZATION[dataset]
    else:
        raise CheckpointError(f"{path} does not record the input normalisation it was trained with, and no run folder beside it names the dataset")
    # A pretraining run refreshes its encoder.pt while it trains: without a summary, this one is not its final encoder.
    unfinished = run_dir is not None and "meta" in read_run_file(run_dir, read_config) and not is_finished(run_dir)
    mean, std = (list(v) if isinstance(v, (list, tuple)) else v for v in (mean, std))  # anything else: `check_export` names it
    return Export(model, "encoder", mean, std, dataset, run_dir, step=payload.get("step"),
                  used_by=runs_started_from(run_dir) if run_dir is not None else [],
                  pretrained_on=record_to_json(data) if data.get("fingerprint") else None, unfinished=unfinished,
                  source=str(path))  # fmt: skip


# --------------------------------------------------------------------------- the model card


def front_matter(exp: Export, name: str) -> dict[str, Any]:
    """The card's YAML header, in the Hub's model-card metadata format."""
    meta: dict[str, Any] = {
        "library_name": "timm",
        "pipeline_tag": "image-classification" if exp.kind == "classifier" else "image-feature-extraction",
        "tags": ["timm", "vision-transformer", *(["masked-autoencoder"] if from_mae(exp) else []), "vit-mae"],
    }
    hub_dataset = HUB_DATASETS.get(exp.dataset or "")
    if hub_dataset:
        meta["datasets"] = [hub_dataset]
    results = [(r, split, r.get(f"{split}_top1")) for r in accuracy_runs(exp) for split in ("val", "test")]
    results = [r for r in results if is_finite(r[2])]  # a hand-edited summary's "high" is no accuracy
    if results:
        meta["metrics"] = ["accuracy"]
        meta["model-index"] = [{"name": name, "results": [
            {"task": {"type": "image-classification"},
             "dataset": {"name": exp.dataset, "type": hub_dataset or exp.dataset, "split": "validation (held out of train)" if split == "val" else "test"},
             "metrics": [{"type": "accuracy", "value": round(100 * top1, 2), "name": f"top-1, {r.get('job_type', '?')} ({r['run']}{images(r, split)})"}]}
            for r, split, top1 in results]}]  # fmt: skip
    return meta


def images(summary: dict[str, Any], split: str) -> str:
    """'; 10000 test images': how many images of `split` a run's accuracy is of (its summary's data), where recorded.
    The runs of one card may read other copies of the data (a subset, the whole test split)."""
    count = part(summary, "data").get(split)
    return f"; {count} {split} images" if isinstance(count, int) and not isinstance(count, bool) else ""


def from_mae(exp: Export) -> bool:
    """Whether the weights come from MAE pretraining: an encoder, or a classifier whose init was an MAE encoder (a run
    folder, encoder.pt or one of our exports) or that records its pretraining run."""
    init = exp.init or ""
    return exp.kind == "encoder" or exp.parent is not None or (init != "" and init != "scratch" and not init.startswith(("timm:", "hf-hub:")))


def origin(exp: Export) -> str:
    """How the weights were made, in the card's words: a scratch baseline's card claimed MAE pretraining."""
    init = exp.init or ""
    if exp.kind == "encoder":
        return "pretrained as a masked autoencoder (MAE)"
    if init == "scratch":
        return "trained from a random initialisation (no pretraining)"
    if init.startswith(("timm:", "hf-hub:")):
        return f"trained from the pretrained weights {init}"
    return "trained on an MAE-pretrained encoder" if from_mae(exp) else "trained (its initialisation is not recorded)"


def accuracy_runs(exp: Export) -> list[dict[str, Any]]:
    """The summaries whose accuracies the card reports: the classifier's own, or those of the runs that used the encoder."""
    if exp.kind == "classifier":
        summary = card_summary(exp.run_dir)
        return [{"run": exp.run_dir.name, **summary}] if summary and exp.run_dir is not None else []
    return exp.used_by


def fmt(value: Any, percent: bool = False) -> str:
    if value is None:
        return "-"
    if percent:
        return f"{100 * value:.1f}%" if is_finite(value) else "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "-"
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


def training_rows(exp: Export) -> list[tuple[str, str]]:
    """What made the weights, from the run folder's config.yaml and summary.json."""
    config, summary = read_run_file(exp.run_dir, read_config), card_summary(exp.run_dir)
    optim, schedule, meta, data = part(config, "optim"), part(config, "schedule"), part(config, "meta"), part(summary, "data")
    lr = optim.get("lr") or (f"base_lr {optim['base_lr']} x batch / 256" if "base_lr" in optim else None)
    rows = [
        ("run folder", exp.run_dir.name if exp.run_dir else None),
        ("data", f"{exp.dataset}: {fmt(data.get('train'))} train, {fmt(data.get('val'))} val, {fmt(data.get('test'))} test images"),
        ("recipe", f"{optim.get('name')}, lr {fmt(lr)}, batch {fmt(optim.get('batch_size'))} per process, weight decay {fmt(optim.get('weight_decay'))}, "
                   f"warmup {fmt(schedule.get('warmup_epochs'))} epochs"),
        ("epochs / steps", f"{fmt(summary.get('epochs'))} / {fmt(summary.get('steps', exp.step))}"),
        ("wall time", f"{duration(summary['wall_time_sec'])} ({fmt(summary.get('images_per_sec'))} img/s)" if "wall_time_sec" in summary else None),
        ("ran on", f"{fmt(summary.get('device'))} x {fmt(summary.get('processes'))} process(es), precision {fmt(summary.get('precision'))}"),
        ("final loss (train / val)", f"{fmt(summary.get('final_loss'))} / {fmt(summary.get('final_val_loss'))}"),
        ("seed, git commit", f"{fmt(meta.get('seed'))}, {fmt(meta.get('git_commit'))}"),
        ("command", f"`{meta['command']}`" if meta.get("command") else None),
    ]  # fmt: skip
    if exp.kind == "encoder":
        mae = part(config, "mae")
        rows.insert(3, ("MAE", f"mask ratio {fmt(mae.get('mask_ratio'))}, normalised-pixel loss {fmt(mae.get('norm_pix_loss'))}"))
    else:
        ft = part(config, "finetune")
        how = "linear probe" if ft.get("mode") == "linear" else "training" if ft.get("init") == "scratch" else "full fine-tuning"
        parent = f" (pretraining run {exp.parent})" if exp.parent else ""
        rows.insert(3, ("classifier", f"{how} from {fmt(ft.get('init'))}{parent}"))
    if exp.unfinished:
        rows.insert(1, ("status", f"unfinished: the weights of step {exp.step}, saved before the run ended (still training, or stopped)"))
    return [(k, v) for k, v in rows if v is not None]


def model_card(exp: Export, name: str, load_as: str) -> str:
    """README.md: Hub front matter, what the model is, how to load it, how it was trained, what the runs using it reached."""
    c = exp.model.config
    what = "classifier" if exp.kind == "classifier" else "encoder (no head)"
    pretrained = origin(exp)
    tokens = (c["img_size"] // c["patch_size"]) ** 2
    labels = [str(n) for n in exp.label_names or []]
    init_arg = shlex.quote(f"finetune.init={load_as}")  # a folder name with spaces or quotes stays one argument
    output = (f"logits = model(images)  # (B, {c['num_classes']}): {', '.join(labels[:4])}{', ...' if len(labels) > 4 else ''}"
              if exp.kind == "classifier" else f"tokens = model.forward_features(images)  # (B, 1 + {tokens}, {c['embed_dim']})")  # fmt: skip
    lines = ["---", yaml.safe_dump(front_matter(exp, name), sort_keys=False).rstrip(), "---", "", f"# {name}", "",
             f"A Vision Transformer {what}, {pretrained} on {exp.dataset} with vit-mae: {c['embed_dim']} wide, {c['depth']} block(s), "
             f"{c['num_heads']} heads, {c['patch_size']}x{c['patch_size']} patches on {c['img_size']}x{c['img_size']} images, "
             f"{count_parameters(exp.model) / 1e6:.2f}M parameters, {c['global_pool']} pooling. The weights use timm's names "
             "and load in timm as they are.", "",
             "## Use it", "", "```python", "import timm", "",
             f"model = timm.create_model({python_str(load_as)}, pretrained=True).eval()",
             f"# images: (B, {c['in_chans']}, {c['img_size']}, {c['img_size']}), normalised with the mean and std of config.json",
             output,
             "```", "", f"Fine-tune or probe it with vit-mae: `python -m finetune --config configs/finetune/cpu.yaml {init_arg}`.",
             "", "## Training", "", "| | |", "|---|---|"]  # fmt: skip
    lines += [f"| {k} | {v} |" for k, v in training_rows(exp)]
    runs = accuracy_runs(exp)
    if runs:
        title = "## Accuracy" if exp.kind == "classifier" else "## Runs that used it"
        lines += ["", title, "", "| run | job type | epochs | wall time | val top-1 | test top-1 | val / test images |",
                  "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in runs:
            counts = " / ".join(str(part(r, "data").get(split, "-")) for split in ("val", "test"))
            lines.append(f"| {r['run']} | {r.get('job_type', '-')} | {fmt(r.get('epochs'))} | {duration(r.get('wall_time_sec'))} | "
                         f"{fmt(r.get('val_top1'), True)} | {fmt(r.get('test_top1'), True)} | {counts} |")
        lines += ["", "val: images held out of the training split; test: the dataset's test split."]
    return "\n".join(lines) + "\n"


def python_str(text: str) -> str:
    """`text` as a Python string literal in double quotes: a folder named `my "best" run` broke the card's snippet."""
    return json.dumps(text, ensure_ascii=False)


# --------------------------------------------------------------------------- the command line


def check_export(exp: Export) -> None:
    """Refuse, before anything is written, weights that are not finite (a diverged run: a Hub folder that gives NaN) and
    an input normalisation that is not one finite number per input channel, std above 0 (config.json would hold NaN,
    which is no JSON, or a mean timm cannot apply)."""
    where = exp.source or f"the {exp.kind}"
    if bad := non_finite(exp.model.state_dict()):
        raise CheckpointError(f"{where} holds weights that are not finite (NaN or inf): {bad}: the training diverged or the file is "
                              "damaged; nothing was written")  # fmt: skip
    channels = exp.model.config["in_chans"]
    for key, values in (("mean", exp.mean), ("std", exp.std)):
        if not per_channel(values, channels, positive=key == "std"):
            raise CheckpointError(f"{where} records the input normalisation {key}={values!r}: expected {channels} finite numbers, one "
                                  f"per input channel{', each above 0' if key == 'std' else ''}; nothing was written")  # fmt: skip


def export(exp: Export, out: str | Path, push: str | None = None, overwrite: bool = False) -> Path:
    """Write the Hub folder for `exp` into `out` and, with `push=USER/NAME`, upload it.

    `out` must be new, empty or hold this very export, unless `overwrite` (`vit.store.hub.write_hub_folder`)."""
    check_export(exp)
    folder = Path(out).expanduser()
    name = push.split("/")[-1] if push else folder.resolve().name
    load_as = f"hf-hub:{push}" if push else f"local-dir:{folder}"
    config = hub_config(exp.model, list(exp.mean), list(exp.std), exp.label_names, exp.pretrained_on)
    if exp.unfinished:
        print(f"warning: the run {exp.run_dir} has not finished (no summary: still training, or stopped): its {ENCODER_FILE} is the "
              f"encoder of step {exp.step}, not its final one; the model card says so", file=sys.stderr, flush=True)  # fmt: skip
    written = write_hub_folder(folder, exp.model, config, model_card(exp, name, load_as), overwrite)
    what = f"{exp.kind} ({exp.model.config['embed_dim']}d x {exp.model.config['depth']})"
    if written:
        print(f"export: {what} -> {folder} (load with timm.create_model({python_str(f'local-dir:{folder}')}, pretrained=True))")
    else:
        print(f"export: {folder} already holds this {what} export, file for file; nothing written")
    if push:
        print(f"export: pushed to {push_folder(folder, push)}")
    return folder


def cli(argv: list[str] | None, load: Callable[[str], Export], prog: str, what: str) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=f"Export {what} as a timm / Hugging Face Hub folder with a model card")
    parser.add_argument("source", help=f"{what}: its run folder or checkpoint file")
    parser.add_argument("--out", required=True, help="folder to write model.safetensors, config.json and README.md into")
    parser.add_argument("--push", metavar="USER/NAME", help="also upload the folder to this Hub model repository (needs network and a login)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace model.safetensors, config.json and README.md in an --out that holds other files or another "
                             "export (other files there are left alone); without it such an --out is refused. An --out at or "
                             "inside a run folder is always refused")  # fmt: skip
    args = parser.parse_args(argv)
    if not args.out.strip():  # Path("") is the current folder: a project's own README.md would be what --overwrite replaces
        parser.error("--out is empty: name the folder to write the export into")
    if args.push is not None and args.push.count("/") != 1:
        parser.error(f"--push {args.push!r} must look like USER/NAME")
    if args.push is not None:
        check_repo_id(args.push, "--push")
    export(load(args.source), args.out, args.push, args.overwrite)
    return 0
