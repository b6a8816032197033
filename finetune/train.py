"""Classification: `accelerate launch -m finetune --config configs/finetune/....yaml [key=value ...]`.

One entry point for full fine-tuning, linear probing (cached or not), weighted kNN on frozen
features (`finetune/knn.py`), evaluation of a finished classifier, and the baselines (scratch
ViT, timm ViT, ResNet-18).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from finetune.config import FinetuneConfig, FinetuneSection
from finetune.evaluate import evaluate, save_confusion_matrix, scorer, sync_from_main
from finetune.features import FeatureLoader, extract_features
from finetune.knn import check_knn_data, run_knn
from finetune.loss import make_loss
from finetune.inits import check_finite_weights, encoder_init, read_init_encoder, unfinished_encoder
from finetune.models import Built, build_classifier, load_classifier, save_classifier
from vit.cli import parse
from vit.config import ModelConfig
from vit.data.files import ShardSet
from vit.data.loaders import Data
from vit.data.provenance import SPLIT_KEYS, check_overlap, split_record, unrecorded
from vit.data.randaug import make_ops
from vit.data.splits import Splits
from vit.errors import ConfigError, DataError, exit_on_user_error
from vit.models.encoder import preset_image_size
from vit.store.checkpoint import unwrap
from vit.store.hub import hub_provenance, is_hub_init
from vit.store.runs import CLASSIFIER_FILE, confusion_path
from vit.train import tracking
from vit.train.accelerator import compile_for_run
from vit.train.budget import Evaluation, evaluation_timer
from vit.train.ema import WeightAverage, weight_average
from vit.train.loop import fit
from vit.train.optim import make_optimizer, param_groups
from vit.train.run import Run, param_checksum
from vit.train.schedule import LoopSpec, loop_spec
from vit.train.signals import Preempted, ctrl_c_in_one_line
from vit.train.states import Progress, load_state, open_stage_data


def job_type(cfg: FinetuneConfig) -> str:
    ft = cfg.finetune
    if ft.mode == "linear":
        return "linprobe"
    if ft.mode in ("eval", "knn"):
        return ft.mode
    # An exported encoder (local-dir:) is ours; timm's weights and Hub models are reference points.
    mae_init = ft.arch == "vit" and ft.init != "scratch" and not ft.init.startswith(("timm:", "hf-hub:"))
    return "finetune" if mae_init else "baseline"


def parent_encoder(cfg: FinetuneConfig) -> dict:
    """The payload of the MAE encoder `finetune.init` names ({} for other inits): its `meta` (run, group, data) and step.

    Read before anything is written, so a bad path fails first.
    """
    return read_init_encoder(cfg.finetune.init) or {}


def input_size(cfg: FinetuneConfig) -> int | None:
    """The image size the classifier takes: the ViT's (preset and overrides); for ResNet-18 `data.image_size` (None: as stored)."""
    if cfg.finetune.arch == "resnet18":
        return cfg.data.image_size
    return preset_image_size(cfg.model.name, cfg.model.img_size)


def open_run_data(cfg: FinetuneConfig, run: Run, out_size: int | None) -> Data:
    """The run's labelled data (the main process decodes or scans first, the others then read its cache)."""
    return open_stage_data(run, cfg.data, out_size, need_labels=True)


def loaders(cfg: FinetuneConfig, data: Data, augment: bool):
    # A linear probe sees only crop and flip (MAE's probe recipe); fine-tuning adds the `aug` ops.
    train = data.loader(data.splits.train, cfg.optim.batch_size, train=True, seed=cfg.run.seed, ops=make_ops(cfg.aug) if augment else ())
    return train, eval_loaders(cfg, data)


def eval_loaders(cfg: FinetuneConfig, data: Data) -> dict[str, Any]:
    """The evaluation loaders: val when the split is not empty, test when the dataset has one."""
    splits = data.splits
    batch = data.eval_batch(cfg.optim.batch_size)
    evals = {"val": data.loader(splits.val, batch, train=False)} if len(splits.val) else {}
    if splits.test is not None:
        evals["test"] = data.loader(splits.test, batch, train=False)
    return evals


def report_eval(run: Run, results: dict[str, dict], classes: list[str], tag: str, figures: bool) -> dict:
    """Flatten results for summary.json and write the per-class table and confusion-matrix PNGs."""
    out = {}
    for split, r in results.items():
        out[f"{split}_top1"] = r["top1"]
        out[f"{split}_top5"] = r["top5"]
        out[f"{split}_loss"] = r["loss"]
        out[f"{split}_per_class"] = dict(zip(classes, r["per_class"]))
        run.log_table(f"per_class_{split}", ["class", "accuracy"], [[c, a] for c, a in zip(classes, r["per_class"])])
        if figures and run.is_main:
            path = save_confusion_matrix(r["confusion"], classes, confusion_path(run.dir, split), f"{tag} - {split} top-1 {r['top1']:.2%}",
                                         r.get("images"))
            run.log_images({f"confusion_{split}": path})
    return out


@dataclass
class Task:
    """What the optimiser trains and on what: the whole classifier on images, or a cached probe's head on features."""

    module: nn.Module  # the classifier, or the cached probe's head
    groups: list[dict]  # its optimiser groups
    train: Any  # a batch loader of images, or a FeatureLoader
    evals: dict[str, Any]
    layer_decay: float | None = None  # what `param_groups` was given (None: one learning rate for every layer)
    feature_time: float = 0.0  # seconds spent computing the cached features


@dataclass
class Trained:
    """What `train` returns."""

    model: nn.Module  # the whole classifier, trained
    results: dict[str, dict]  # the final evaluation per split
    progress: Progress  # its feature_time: a cached probe's seconds computing its features, summed over restarts
    trained_val_top1: float | None = None  # with a weight average (which `results` are of): the trained weights' own val top-1


def classifier_task(cfg: FinetuneConfig, run: Run, data: Data, built: Built) -> Task:
    """Full fine-tuning, the baselines, or an uncached linear probe: the classifier trained end to end on images."""
    ft = cfg.finetune
    num_layers = built.encoder_config["depth"] if built.encoder_config and built.arch in ("vit", "timm_vit") else None
    layer_decay = ft.layer_decay if num_layers is not None and ft.mode == "full" else None
    groups = param_groups(built.model, cfg.optim.weight_decay, layer_decay, num_layers)
    train, evals = loaders(cfg, data, augment=ft.mode == "full")
    return Task(built.model, groups, train, evals, layer_decay)


def cached_probe_task(cfg: FinetuneConfig, run: Run, data: Data, built: Built) -> Task:
    """A linear probe on features computed once: the head trains on the cache for many epochs in seconds."""
    acc, splits = run.accelerator, data.splits
    if isinstance(splits.train, ShardSet):
        raise ConfigError("finetune.probe_cache=true computes every training image's features once, unaugmented, and streamed WebDataset "
                          "shards are read for training only: set finetune.probe_cache=false (the head then trains on streamed images), "
                          "or data.loader=memory where the shards fit in memory")  # fmt: skip
    probe = built.model.to(acc.device)
    feats, batch = {}, data.eval_batch(cfg.optim.batch_size)  # the features' batches, and the head's evaluation's
    started = time.perf_counter()
    for split, images in (("train", splits.train), ("val", splits.val), ("test", splits.test)):
        if images is None or not len(images):
            continue
        loader = data.loader(images, batch, train=False)
        feats[split] = extract_features(probe, loader, acc)
    feature_time = time.perf_counter() - started
    feature_rate = sum(f.shape[0] for f, _ in feats.values()) / max(feature_time, 1e-9)
    shapes = ", ".join(f"{s} {tuple(f.shape)}" for s, (f, _) in feats.items())
    run.print(f"features: {shapes} in {feature_time:.1f}s ({feature_rate:.0f} img/s)")
    shard = dict(rank=acc.process_index, world_size=acc.num_processes)
    train = FeatureLoader(*feats["train"], cfg.optim.batch_size, seed=cfg.run.seed, **shard)
    evals = {s: FeatureLoader(*feats[s], batch, train=False, **shard) for s in ("val", "test") if s in feats}
    return Task(probe.head, param_groups(probe.head, cfg.optim.weight_decay), train, evals, feature_time=feature_time)


@dataclass
class Training:
    """What `train` fits, built by `setup_training` (the benchmark's pipeline section times the same)."""

    task: Task
    module: nn.Module  # the task's module under Accelerate
    optimizer: torch.optim.Optimizer
    forward: nn.Module  # `module`, compiled where `run.compile` says: the training steps call it
    spec: LoopSpec
    loss_fn: Any
    cached: bool  # a linear probe on cached features
    average: WeightAverage | None = None  # finetune.ema_decay's average of the weights, which is evaluated and saved

    def evaluated(self) -> nn.Module:
        """The weights the run evaluates and saves: the average where there is one, else the trained ones."""
        return self.average.module if self.average is not None else unwrap(self.module)


def setup_training(cfg: FinetuneConfig, run: Run, data: Data, built: Built) -> Training:
    """The task, its optimiser, loaders, loss and schedule (the time budget told what is evaluated, and how often)."""
    acc, splits = run.accelerator, data.splits
    cached = cfg.finetune.mode == "linear" and cfg.finetune.probe_cache
    task = (cached_probe_task if cached else classifier_task)(cfg, run, data, built)
    optimizer = make_optimizer(task.groups, cfg.optim, acc.device)
    module, optimizer = acc.prepare(task.module, optimizer)
    # A cached probe's head is one BatchNorm and one Linear: nothing for torch.compile to speed up.
    forward = compile_for_run(run, module, optimizer, compile=not cached)
    average = weight_average(unwrap(module), optimizer, run, cfg.finetune.ema_decay if cfg.finetune.mode == "full" else None)
    # For a time budget: the val split every `finetune.eval_every` epochs, then val and test once at the end.
    # An evaluation's images are timed on the val split's (or test's) first batches, each scored as `evaluate` scores it.
    timed = next(iter(task.evals.values()), None)
    model, num_classes = unwrap(module), len(splits.train.classes)
    timer = evaluation_timer(model, timed, acc, scorer(model, num_classes, acc)) if timed is not None else None
    # the end evaluates val and test, and with a weight average the trained weights on val too (`train`)
    final = sum(len(s) for s in (splits.val, splits.test, splits.val if average is not None else None) if s is not None)
    evaluation = Evaluation(images=len(splits.val) if "val" in task.evals else 0, every=cfg.finetune.eval_every,
                            final_images=final, timer=timer)  # fmt: skip
    spec = loop_spec(cfg, len(task.train), acc.num_processes, (evaluation,))
    averaged = f", weights averaged (EMA decay {average.decay:g})" if average is not None else ""
    run.print(f"schedule: {spec.described()}, peak lr {spec.peak_lr:.3g}, layer decay {task.layer_decay}{averaged}")
    return Training(task, module, optimizer, forward, spec, make_loss(cfg, num_classes), cached, average)


def train(cfg: FinetuneConfig, run: Run, data: Data, built: Built) -> Trained:
    """Train what `cfg.finetune` asks for (resuming where `run.resume` says) and evaluate it on every split."""
    acc, splits = run.accelerator, data.splits
    t = setup_training(cfg, run, data, built)
    task, module, spec = t.task, t.module, t.spec
    num_classes = len(splits.train.classes)

    evaluated: dict[str, Any] = {"step": None, "val": None}  # where an epoch's end last evaluated val, and what it found

    def on_epoch_end(epoch: int, progress: Progress) -> dict:
        if "val" not in task.evals or (epoch % cfg.finetune.eval_every and epoch != spec.epoch_limit):
            return {}
        r = evaluate(t.evaluated(), task.evals["val"], acc, num_classes, "val")
        evaluated.update(step=progress.step, val=r)
        best = max(progress.best.get("val_top1", 0.0), r["top1"])
        progress.best["val_top1"] = best
        if not t.cached:  # the cached probe runs many short epochs
            run.print(f"epoch {epoch}: val top-1 {r['top1']:.2%} (best {best:.2%}), top-5 {r['top5']:.2%}, loss {r['loss']:.4f}")
        return {"val_top1": r["top1"], "val_top5": r["top5"], "val_loss": r["loss"]}

    progress = load_state(run) or Progress()
    progress.feature_time += task.feature_time  # the features of each session's process, resumed or not: the stage's cost
    progress = fit(run, t.forward, t.optimizer, task.train, t.loss_fn, spec, progress, on_epoch_end)
    at_end = evaluated["step"] == progress.step  # the last epoch's end evaluated these very weights on val: not again
    results = {split: evaluated["val"] if split == "val" and at_end else evaluate(t.evaluated(), loader, acc, num_classes, split)
               for split, loader in task.evals.items()}  # fmt: skip
    if "val" in results and not at_end:
        # A time budget (or schedule.max_steps) ends mid-epoch, where no epoch end evaluated: the final weights' val
        # figures join the curve at the last step, and count for the best.
        r = results["val"]
        progress.best["val_top1"] = max(progress.best.get("val_top1", 0.0), r["top1"])
        epoch = progress.epochs_done(len(task.train))
        run.log({"step": progress.step, "epoch": epoch, "val_top1": r["top1"], "val_top5": r["top5"], "val_loss": r["loss"]})
    trained_val = None
    if t.average is not None and "val" in task.evals:  # whether the average helps, told on val by the same run
        trained_val = evaluate(unwrap(module), task.evals["val"], acc, num_classes, "val")["top1"]
        run.print(f"weight average: val top-1 {results['val']['top1']:.2%}; the trained weights' own {trained_val:.2%}")
    if t.cached:
        built.model.head = unwrap(module)
    return Trained(built.model if t.cached else t.evaluated(), results, progress, trained_val)


def unused_in_eval(cfg: FinetuneConfig) -> list[str]:
    """The settings given that `finetune.mode=eval` does not use: the classifier says its model and its pooling."""
    model = [(f"model.{k}", v, getattr(ModelConfig(), k)) for k, v in vars(cfg.model).items() if k != "attn_impl"]
    fixed = [(f"finetune.{k}", getattr(cfg.finetune, k), getattr(FinetuneSection(), k)) for k in ("arch", "probe_pool")]
    return [f"{key}={value}" for key, value, default in [*model, *fixed] if value != default]


def run_eval(cfg: FinetuneConfig) -> int:
    """`finetune.mode=eval`: evaluate a finished classifier on the val (and test) split, no training."""
    model, payload = load_classifier(cfg.finetune.init, "finetune.init")
    record = payload["data"].get("split")
    # The val split must be the one the classifier was validated on: its settings, not the command line's (data.root may differ).
    replaced = [f"data.{k}={record[k]} (not {getattr(cfg.data, k)})" for k in SPLIT_KEYS if record and getattr(cfg.data, k) != record[k]]
    for key in SPLIT_KEYS if record else ():
        setattr(cfg.data, key, record[key])
    if record and record["dataset"] == "synthetic" and record.get("source_size"):
        cfg.data.synthetic_size = record["source_size"]  # generated images: how many is part of which ones
    if cfg.data.image_size is None and payload["data"].get("stored_size"):  # kept at another size, evaluated resized from it
        cfg.data.image_size = payload["data"]["stored_size"]
    run = Run.start(cfg, stage="finetune", job_type="eval", parent=payload.get("parent"), parent_run_id=payload.get("parent_run_id"))
    if replaced:
        run.print(f"eval: the classifier's data split: {', '.join(replaced)}")
    if given := unused_in_eval(cfg):
        run.print(f"eval: the classifier is rebuilt as it was saved ({payload['arch']}); {', '.join(given)} not used")
    acc = run.accelerator
    size = payload["data"]["image_size"]
    data = open_run_data(cfg, run, size)
    splits = data.splits
    if list(splits.train.classes) != list(payload["classes"]):
        raise DataError(f"the classifier was trained on classes {payload['classes']}, this data has {splits.train.classes}")
    note = check_overlap(record, splits, f"the classifier {cfg.finetune.init}", "finetune.allow_overlap", cfg.finetune.allow_overlap)
    if note:
        run.warn(note)
    evals = eval_loaders(cfg, data)
    if not evals:  # it printed "eval: " and wrote a summary without a number, exit 0
        raise DataError(f"nothing to evaluate: the classifier {cfg.finetune.init} was trained with no val split (data.val_size=0, "
                        f"which eval keeps), and {cfg.data.root or cfg.data.dataset} has no test split")  # fmt: skip
    run.ready()
    model = model.to(acc.device)
    results = {s: evaluate(model, loader, acc, len(splits.train.classes), s) for s, loader in evals.items()}
    flat = report_eval(run, results, splits.train.classes, f"eval {payload['arch']}", cfg.finetune.confusion_matrix)
    summary = run.finish({"mode": "eval", "init": cfg.finetune.init, "model": payload["arch"], "data": splits.describe(),
                          "bad_images": data.bad_total(acc), **flat})  # fmt: skip
    run.print("eval: " + ", ".join(f"{s} top-1 {r['top1']:.2%}" for s, r in results.items()))
    return 0 if summary else 1


@ctrl_c_in_one_line
@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg = parse(FinetuneConfig, argv, "finetune", "Fine-tune, linear-probe or evaluate a classifier")
    if cfg.finetune.mode == "eval":
        return run_eval(cfg)
    parent_payload = parent_encoder(cfg)
    check_finite_weights(cfg.finetune.init, parent_payload)
    parent = parent_payload.get("meta", {})
    tracking.inherit_group(cfg.run, parent)
    run = Run.start(cfg, stage="finetune", job_type=job_type(cfg), parent=parent.get("run"), parent_run_id=parent.get("run_id"))
    encoder = encoder_init(cfg.finetune.init)
    if encoder is not None:
        run.use_encoder(encoder)
        note = unfinished_encoder(encoder, parent_payload)  # an intermediate encoder.pt is no error, but should not pass unsaid
        if note:
            run.warn(note)
    data = open_run_data(cfg, run, input_size(cfg))
    splits = data.splits
    if len(splits.train.classes) < 2:  # every image of its one class: 100% top-1 whatever the model, reported as a result
        raise DataError(f"the training split of {cfg.data.root or cfg.data.dataset} has {len(splits.train.classes)} class "
                        f"({', '.join(map(str, splits.train.classes)) or 'none'}): a classifier needs at least 2")  # fmt: skip
    built = build_classifier(cfg, len(splits.train.classes), run.accelerator.device, say=run.print)
    check_pretraining_overlap(cfg, run, splits, parent_payload)  # after the weights load: an init that cannot load is one line
    # Each rank drew its own random init (per-rank seed); a cached probe's encoder is never wrapped in DDP, so make them one.
    sync_from_main(built.model, run.accelerator)
    if cfg.finetune.mode == "knn":
        check_knn_data(cfg, data)
        run.ready()
        return run_knn(cfg, run, data, built, parent.get("run"))
    # A training mode clears a run it replaces in `fit` (TrainLoop calls Run.ready), once `train` has built its loaders and
    # schedule: a batch larger than the training split, or a cached probe of streamed shards, left that run whole.
    if built.arch == "linear_probe" and cfg.data.val_size == 0 and splits.test is None:
        run.warn("no validation or test split: the probe's accuracy cannot be measured")
    n_params = sum(p.numel() for p in built.model.parameters() if p.requires_grad)
    run.print(f"data: {splits.describe()} | {built.arch} ({cfg.finetune.mode}, init {cfg.finetune.init}): {n_params / 1e6:.2f}M trainable parameters")
    try:
        trained = train(cfg, run, data, built)
    except Preempted as e:
        run.print(str(e))
        return 143
    if run.is_main:
        size = built.encoder_config["img_size"] if built.encoder_config is not None else data.out_size
        # stored_size: the size the memory loader kept the images at, which evaluation resized to `size` (predict does too)
        data_info = {"dataset": splits.name, "image_size": size, "stored_size": data.cfg.image_size if data.kind == "memory" else None,
                     "mean": list(splits.mean), "std": list(splits.std),
                     "split": split_record(cfg.data, splits)}  # fmt: skip
        save_classifier(run.dir / CLASSIFIER_FILE, built, trained.model, splits.train.classes, data_info, trained.progress.step,
                        lineage={k: run.meta[k] for k in ("run_id", "parent_run_id")})  # fmt: skip
    flat = report_eval(run, trained.results, splits.train.classes, f"{built.arch} {cfg.finetune.mode} ({cfg.finetune.init})",
                       cfg.finetune.confusion_matrix)  # fmt: skip
    summary = run.finish(summarize(cfg, run, data, built, trained, parent, flat))
    lines = [f"{s} top-1 {r['top1']:.2%} top-5 {r['top5']:.2%}" for s, r in trained.results.items()]
    if not lines:
        lines.append("nothing evaluated (no val split: data.val_size=0, and no test split in this dataset)")
    elif splits.test is None:
        lines.append("(no test split in this dataset: val only)")
    run.print(f"done in {summary['wall_time_sec']:.0f}s: " + ", ".join(lines) + f" -> {run.dir}")
    return 0


def summarize(cfg: FinetuneConfig, run: Run, data: Data, built: Built, trained: Trained, parent: dict, flat: dict) -> dict[str, Any]:
    """What summary.json says of a classification run (Run.finish adds the run's facts)."""
    progress, splits = trained.progress, data.splits
    cached = cfg.finetune.mode == "linear" and cfg.finetune.probe_cache
    rate = round(progress.images / max(progress.train_time, 1e-9), 1)
    rates, bad = {"images_per_sec": rate}, data.bad_total(run.accelerator)
    if cached:
        # A cached probe has two rates: the frozen encoder's over every image (the stage's cost, which `images_per_sec`
        # keeps meaning across stages), and the head's over the cache. Its images are read once, for the features: those the
        # stream loaders skipped (data.skip_bad_images; the memory loader's never joined the splits) were not featurised.
        skipped = bad - len(splits.bad_images)
        featurised = len(splits.train) + len(splits.val) + (len(splits.test) if splits.test is not None else 0) - skipped
        feature_rate = round(featurised / max(progress.feature_time, 1e-9), 1)
        rates = {"images_per_sec": feature_rate, "feature_images_per_sec": feature_rate, "head_images_per_sec": rate}
    return {
        "mode": cfg.finetune.mode,
        "job_type": run.job_type,
        "init": cfg.finetune.init,
        "parent": parent.get("run"),
        "model": cfg.model.name if built.arch != "resnet18" else "resnet18",
        "arch": built.arch,
        "cached_features": cached,
        "epochs": progress.epoch,
        "steps": progress.step,
        "skipped_steps": progress.nan_skips,
        "scaler_skipped_steps": progress.scaler_skips,  # fp16's GradScaler's own (inf/NaN gradients at its scale)
        "wall_time_sec": round(progress.train_time + progress.feature_time, 2),  # a cached probe's stage time includes its features
        "feature_time_sec": round(progress.feature_time, 2),
        "images": progress.images,
        **rates,
        "final_loss": run.last_logged("loss"),
        "final_val_loss": flat.get("val_loss"),
        "best_val_top1": progress.best.get("val_top1"),
        "final_val_top1": flat.get("val_top1"),
        **({"trained_weights_val_top1": trained.trained_val_top1} if trained.trained_val_top1 is not None else {}),
        "final_test_top1": flat.get("test_top1"),
        "data": splits.describe(),
        "test_split": splits.test is not None,
        "bad_images": bad,
        "ranks": rank_checksums(trained.model, run.accelerator),
        **flat,
    }


def check_pretraining_overlap(cfg: FinetuneConfig, run: Run, splits: Splits, encoder_payload: dict) -> None:
    """Refuse val images the encoder was pretrained on (`finetune.allow_overlap=true` goes on regardless); warn where
    its training images are not recorded (timm weights, Hub folders other than our encoder exports). `encoder_payload`:
    the MAE encoder.pt that `finetune.init` names, as `parent_encoder` read it ({} for other inits)."""
    init, path = cfg.finetune.init, encoder_init(cfg.finetune.init)
    if path is not None:
        record, what = encoder_payload.get("meta", {}).get("data"), f"the encoder {path}"
    elif is_hub_init(init):
        record, what = hub_provenance(init), f"the encoder {init}"  # our encoder exports carry it in config.json
        if record is None:
            run.warn(unrecorded(what, "its config.json has no pretrained_on: not an export of this project, or an older one",
                                "export it again (python -m pretrain.export or finetune.export), or start from its run folder"))  # fmt: skip
            return
    else:
        if init != "scratch":
            run.warn(unrecorded(f"the encoder {init}", "timm's pretrained weights do not record their training images",
                                "make sure this run's val images are not among them"))  # fmt: skip
        return
    note = check_overlap(record, splits, what, "finetune.allow_overlap", cfg.finetune.allow_overlap)
    if note:
        run.warn(note)


def rank_checksums(model: nn.Module, acc) -> list[dict]:
    """Per-rank sum of the model's parameters for summary.json: every rank must have trained and evaluated the same model."""
    checksum = param_checksum(model).reshape(1, 1).to(acc.device)
    return [{"rank": r, "param_checksum": c[0]} for r, c in enumerate(acc.gather(checksum).cpu().tolist())]
