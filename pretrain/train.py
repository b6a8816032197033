"""MAE pretraining: `accelerate launch -m pretrain --config configs/pretrain/cpu.yaml [key=value ...]`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from pretrain.config import PretrainConfig
from pretrain.figures import save_reconstruction_figure
from pretrain.model import MaskedAutoencoder, build_mae
from vit.cli import parse
from vit.data.files import ShardSet
from vit.data.loaders import Data
from vit.data.provenance import split_record
from vit.errors import exit_on_user_error
from vit.eval.knn import knn_evaluate, pooled, seeded_subset
from vit.store.checkpoint import save_encoder, save_mae, unwrap
from vit.store.runs import ENCODER_FILE, MAE_FILE, RECONSTRUCTION_FILE, epoch_figure_path, read_metrics
from vit.train.accelerator import compile_for_run
from vit.train.budget import FORWARD_SHARE, Evaluation, evaluation_timer
from vit.train.loop import fit
from vit.train.optim import make_optimizer, param_groups
from vit.train.run import Run, param_checksum
from vit.train.schedule import LoopSpec, loop_spec
from vit.train.signals import Preempted, ctrl_c_in_one_line
from vit.train.states import load_state, open_stage_data


@torch.no_grad()
def validation_loss(mae: MaskedAutoencoder, loader, run: Run, seed: int) -> float:
    """Masked-patch loss on the validation split with fixed masks, averaged over every image of every rank. An image's
    mask follows from its place in the split, so the loss does not depend on how many processes share the split."""
    mae.eval()
    start, stop = loader.shard  # this rank's contiguous slice of the split
    noise = torch.rand(stop, mae.num_patches, generator=torch.Generator().manual_seed(seed))[start:]  # (images, L)
    total = torch.zeros(2, device=run.accelerator.device)
    at = 0
    for images, _ in loader.epoch(0):
        with run.accelerator.autocast():
            loss, _, _ = mae(images, noise=noise[at : at + images.shape[0]])
        at += images.shape[0]
        total[0] += loss.float() * images.shape[0]  # no host read per batch: the device runs ahead of the host
        total[1] += images.shape[0]
    total = run.accelerator.reduce(total, reduction="sum")
    return (total[0] / total[1].clamp(min=1)).item()


def knn_monitor(cfg: PretrainConfig, run: Run, data: Data):
    """`evaluate(encoder, epoch, epoch_seconds) -> metrics`: kNN top-1 / top-5 of a seeded subset of the val split
    against a seeded subset of the training images; None when `mae.knn_every` is 0, or there is no val split or no labels."""
    mae_cfg, splits = cfg.mae, data.splits
    if not mae_cfg.knn_every:
        return None
    if not splits.labelled:
        run.print("kNN monitor: off, the data has no labels (mae.knn_every needs labelled images)")
        return None
    if not len(splits.val):  # it queried nothing and said nothing
        run.print("kNN monitor: off, there is no val split to query (data.val_size=0; mae.knn_every needs one)")
        return None
    bank = data.subset(splits.train, seeded_subset(len(splits.train), mae_cfg.knn_bank_size, cfg.run.seed, "knn_bank"))
    queries = data.subset(splits.val, seeded_subset(len(splits.val), mae_cfg.knn_val_size or len(splits.val), cfg.run.seed, "knn_val"))
    batch = data.eval_batch(cfg.optim.batch_size)
    bank_loader, query_loader = data.loader(bank, batch, train=False), data.loader(queries, batch, train=False)
    num_classes = len(splits.train.classes)
    k = min(mae_cfg.knn_k, len(bank))  # the vote takes the whole bank where k is larger: say so, and print the k that votes
    if k < mae_cfg.knn_k:
        run.warn(f"mae.knn_k={mae_cfg.knn_k} is more than the {len(bank)} training images of the kNN monitor's bank: all {k} vote")
    held = bank.labels.unique().numel()  # streamed shards give their first samples, not a seeded draw: of a few classes, if sorted
    if held < num_classes:
        shards = isinstance(splits.train, ShardSet)
        how = "the shards' first samples, in their order" if shards else "a seeded draw"
        fix = "write shards that mix the classes, or raise mae.knn_bank_size" if shards else "raise mae.knn_bank_size"
        run.warn(f"the kNN monitor's bank ({len(bank)} training images, {how}) holds {held} of the {num_classes} classes: "
                 f"its kNN accuracy cannot reach the images of the others; {fix}")  # fmt: skip

    def evaluate(encoder, epoch: int, epoch_seconds: float) -> dict[str, float]:
        r = knn_evaluate(encoder, bank_loader, query_loader, run.accelerator, num_classes, k=k,
                         temperature=mae_cfg.knn_temperature, pool=mae_cfg.knn_pool)  # fmt: skip
        run.print(f"epoch {epoch}: kNN top-1 {r['top1']:.2%}, top-5 {r['top5']:.2%} (k {k}, bank {r['bank']}, "
                  f"{r['count']} val images) in {r['seconds']:.1f}s, {r['seconds'] / max(epoch_seconds, 1e-9):.1%} "
                  f"of the epoch's {epoch_seconds:.0f}s of training")  # fmt: skip
        return {"knn_top1": r["top1"], "knn_top5": r["top5"], "knn_sec": round(r["seconds"], 2)}

    return evaluate


def rank_report(run: Run, model, first_batch_sum: float, rank_images: list[int]) -> list[dict]:
    """Per-rank facts for summary.json: proof that every rank trained, on its own data, with the same weights.
    `rank_images`: each rank's training images (rank order), the same list on every rank."""
    acc = run.accelerator
    checksum = param_checksum(unwrap(model))
    local = torch.tensor([float(acc.process_index), first_batch_sum, checksum.item()], device=acc.device)
    gathered = acc.gather(local.unsqueeze(0)).cpu().tolist()
    return [{"rank": int(r), "first_batch_sum": b, "images": rank_images[int(r)], "param_checksum": c} for r, b, c in gathered]


def images_of_ranks(progress, processes: int) -> list[int]:
    """Each rank's training images (rank order), as the loop counted them. A run resumed from a state saved before states
    held them knows their sum alone: each rank is given the mean, which is its count only where no rank skipped an image."""
    if progress.rank_images is not None:
        return progress.rank_images
    return [progress.images // processes] * processes


# encoder.pt and mae.pt are refreshed at an epoch's end at most this often (and always at the end): a CPU epoch takes
# minutes, a GPU one a second, where writing both files at every epoch cost several percent of the run.
WEIGHTS_EVERY_SECONDS = 60.0


@dataclass
class Pretraining:
    """Everything a pretraining run trains with, built from its config (`setup`): what `main` runs and what the
    benchmark's pipeline section times."""

    cfg: PretrainConfig
    run: Run
    data: Data
    mae: MaskedAutoencoder  # the plain module (evaluation, figures, weights)
    model: torch.nn.Module  # under Accelerate (DDP on several processes)
    optimizer: torch.optim.Optimizer
    forward: torch.nn.Module  # `model`, compiled where `run.compile` says: the training steps call it
    train_loader: Any
    val_loader: Any
    spec: LoopSpec

    @staticmethod
    def loss_fn(m, images, labels):
        loss, _, _ = m(images)
        return loss, {}


def setup(cfg: PretrainConfig, run: Run) -> Pretraining:
    """The run's data, MAE, optimiser, loaders and schedule (the time budget told what each epoch evaluates)."""
    acc = run.accelerator
    mae = build_mae(cfg, acc.device)
    img_size = mae.encoder.patch_embed.img_size
    data = open_stage_data(run, cfg.data, img_size)
    splits = data.splits
    run.print(f"data: {splits.describe()} | model: {cfg.model.name} {mae.encoder.config['embed_dim']}d x {mae.encoder.config['depth']}, "
              f"{sum(p.numel() for p in mae.encoder.parameters()) / 1e6:.2f}M encoder parameters, decoder {mae.decoder_config}")
    optimizer = make_optimizer(param_groups(mae, cfg.optim.weight_decay), cfg.optim, acc.device)
    model, optimizer = acc.prepare(mae, optimizer)
    train_loader = data.loader(splits.train, cfg.optim.batch_size, train=True, seed=cfg.run.seed)
    val_loader = data.loader(splits.val, data.eval_batch(cfg.optim.batch_size), train=False) if len(splits.val) else None
    spec = loop_spec(cfg, len(train_loader), acc.num_processes, evaluations(cfg, splits, mae, val_loader, acc))
    run.print(f"schedule: {spec.described()}, peak lr {spec.peak_lr:.3g} "
              f"(effective batch {cfg.optim.batch_size * cfg.optim.grad_accum_steps * acc.num_processes}), warmup {spec.warmup_steps} steps")
    return Pretraining(cfg, run, data, mae, model, optimizer, compile_for_run(run, model, optimizer), train_loader, val_loader, spec)


def masked_forward(mae: MaskedAutoencoder) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """`(images, labels) -> mae(images)` with fixed masks, as the val loss runs it: no draw from the run's random streams."""
    return lambda images, _labels: mae(images, noise=torch.rand(images.shape[0], mae.num_patches, generator=torch.Generator().manual_seed(0)))


def evaluations(cfg: PretrainConfig, splits, mae: MaskedAutoencoder, val_loader, accelerator) -> tuple[Evaluation, ...]:
    """What pretraining evaluates, for a time budget: the val loss every `mae.val_every` epochs (a masked-MAE forward of
    each val image) and the kNN monitor every `mae.knn_every` (its bank and queries through the encoder with every patch
    visible, about 3 masked-MAE forwards an image), each once more after the last step. Each is timed on val images."""
    if val_loader is None:
        return ()
    timer = evaluation_timer(mae, val_loader, accelerator, forward=masked_forward(mae))
    val = Evaluation(images=len(splits.val) if cfg.mae.val_every else 0, every=cfg.mae.val_every or 1, final_images=len(splits.val), timer=timer)
    if not (cfg.mae.knn_every and splits.labelled):
        return (val,)
    knn_images = min(cfg.mae.knn_bank_size, len(splits.train)) + min(cfg.mae.knn_val_size or len(splits.val), len(splits.val))
    timer = evaluation_timer(mae.encoder, val_loader, accelerator, forward=lambda images, _: pooled(mae.encoder, images, cfg.mae.knn_pool))
    return val, Evaluation(images=knn_images, every=cfg.mae.knn_every, final_images=knn_images, cost=3 * FORWARD_SHARE, timer=timer)


@ctrl_c_in_one_line
@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg = parse(PretrainConfig, argv, "pretrain", "MAE pretraining of a ViT encoder")
    run = Run.start(cfg, stage="pretrain")
    t = setup(cfg, run)
    run.ready()
    model, splits = t.model, t.data.splits
    knn = knn_monitor(cfg, run, t.data)
    pretrained_on = split_record(cfg.data, splits)  # encoder.pt records it, so fine-tuning can refuse val images seen here
    figure = reconstruction_figures(cfg, run, t)
    first_batch_sum = next(t.train_loader.epoch(0))[0].float().sum().item()  # float32: MPS has no float64
    clock = {"epoch": time.perf_counter(), "weights": time.perf_counter()}  # when the epoch's steps began; the weights' last save
    evaluated = {"step": None, "val_loss": None}  # where an epoch's end last evaluated (val loss, kNN), and its val loss

    def on_epoch_end(epoch: int, progress) -> dict[str, float]:
        epoch_seconds = time.perf_counter() - clock["epoch"]
        metrics = {}
        # The epoch where training stops (its schedule's last, or where schedule.max_steps falls on an epoch's end) evaluates
        # both: final_evaluation then takes its numbers, which are of the encoder that encoder.pt holds.
        last = epoch == t.spec.epoch_limit or progress.step >= t.spec.stop_step
        if t.val_loader is not None and ((cfg.mae.val_every and epoch % cfg.mae.val_every == 0) or last):
            metrics["val_loss"] = validation_loss(t.mae, t.val_loader, run, cfg.run.seed)
            run.print(f"epoch {epoch}: val loss {metrics['val_loss']:.4f}")
        if knn is not None and (epoch % cfg.mae.knn_every == 0 or last):
            metrics.update(knn(t.mae.encoder, epoch, epoch_seconds))
        if cfg.run.figure_every and epoch % cfg.run.figure_every == 0:
            figure(progress.step, epoch_figure_path(run.dir, "reconstruction", epoch))
        if time.perf_counter() - clock["weights"] >= WEIGHTS_EVERY_SECONDS:
            save_weights(run, model, progress.step, splits, pretrained_on)
            clock["weights"] = time.perf_counter()
        clock["epoch"] = time.perf_counter()
        if metrics:
            evaluated.update(step=progress.step, val_loss=metrics.get("val_loss"))
        return metrics

    try:
        progress = fit(run, t.forward, t.optimizer, t.train_loader, t.loss_fn, t.spec, load_state(run), on_epoch_end)
    except Preempted as e:
        run.print(str(e))
        return 143
    save_weights(run, model, progress.step, splits, pretrained_on)
    run.log_encoder(run.dir / ENCODER_FILE)
    figure(progress.step, run.dir / RECONSTRUCTION_FILE)
    final_val = final_evaluation(run, t, knn, progress, evaluated, clock["epoch"])
    summary = run.finish(summarize(cfg, run, t, progress, final_val, first_batch_sum))
    run.print(f"done: {summary['steps']} steps in {summary['wall_time_sec']:.0f}s ({summary['images_per_sec']:.0f} img/s), "
              f"loss {summary['final_loss']}, val loss {'- (no val split)' if final_val is None else final_val} -> {run.dir / ENCODER_FILE}")
    return 0


def summarize(cfg: PretrainConfig, run: Run, t: Pretraining, progress, final_val: float | None, first_batch_sum: float) -> dict[str, Any]:
    """What summary.json says of a pretraining run (Run.finish adds the run's facts)."""
    acc, model, splits = run.accelerator, t.model, t.data.splits
    return {
        "final_loss": run.last_logged("loss"),
        "final_val_loss": final_val,
        "final_knn_top1": run.last_logged("knn_top1"),
        "knn_time_sec": round(sum(r.get("knn_sec", 0) for r in read_metrics(run.dir)[0]), 2) if run.is_main else None,  # part of wall_time_sec
        "steps": progress.step,
        "skipped_steps": progress.nan_skips,
        "scaler_skipped_steps": progress.scaler_skips,  # fp16's GradScaler's own (inf/NaN gradients at its scale)
        "epochs": progress.epoch,
        "images": progress.images,
        "wall_time_sec": round(progress.train_time, 2),
        "images_per_sec": round(progress.images / max(progress.train_time, 1e-9), 1),
        "model": cfg.model.name,
        "encoder": t.mae.encoder.config,
        "decoder": t.mae.decoder_config,
        "mask_ratio": cfg.mae.mask_ratio,
        "data": splits.describe(),
        "bad_images": t.data.bad_total(acc),
        "ranks": rank_report(run, model, first_batch_sum, images_of_ranks(progress, acc.num_processes)),
    }


def final_evaluation(run: Run, t: Pretraining, knn, progress, evaluated: dict[str, Any], epoch_start: float) -> float | None:
    """The final encoder's val loss (None without a val split): the last epoch end's where it evaluated these very weights
    (`evaluated`: its step and val loss), else computed here. A run that ended mid-epoch (a time budget's plan,
    schedule.max_steps) ended where no epoch end evaluated: its val loss and kNN join the curves at the last step, so
    that final_knn_top1 is of the encoder that encoder.pt holds."""
    if t.val_loader is None:
        return None
    at_end = evaluated["step"] == progress.step
    if at_end and evaluated["val_loss"] is not None:
        return evaluated["val_loss"]
    final_val = validation_loss(t.mae, t.val_loader, run, run.cfg.run.seed)
    if not at_end:
        epoch = progress.epochs_done(len(t.train_loader))
        final = knn(t.mae.encoder, epoch, time.perf_counter() - epoch_start) if knn is not None else {}
        run.log({"step": progress.step, "epoch": epoch, "val_loss": final_val, **final})
    return final_val


def reconstruction_figures(cfg: PretrainConfig, run: Run, t: Pretraining) -> Callable[[int, Any], None]:
    """`figure(step, path)`: the reconstruction figure of `mae.figure_images` fixed images (main process; none when 0)."""
    figure_batch = None
    if cfg.mae.figure_images:
        # Images spread evenly over the split (so over its classes), the same ones at every figure.
        splits = t.data.splits
        source = splits.val if len(splits.val) else splits.train
        picks = t.data.subset(source, torch.linspace(0, len(source) - 1, cfg.mae.figure_images).long().unique())
        figure_batch = next(t.data.loader(picks, cfg.mae.figure_images, train=False, sharded=False).epoch(0))[0]

    def figure(step: int, path) -> None:
        if figure_batch is None or not run.is_main:
            return
        with run.accelerator.autocast():
            path = save_reconstruction_figure(t.mae, figure_batch, t.data.splits.mean, t.data.splits.std, path, seed=cfg.run.seed)
        run.log_images({"reconstruction": path}, step)

    return figure


def encoder_meta(run: Run, splits, pretrained_on: dict) -> dict:
    """Where the encoder came from (its run folder, and its run id: which training of that folder, `vit.store.lineage`), its
    wandb group (runs started from it join it), the input normalisation it expects, and the split it was pretrained on
    (fine-tuning refuses val images seen here)."""
    data = {"dataset": splits.name, "mean": list(splits.mean), "std": list(splits.std), **pretrained_on}
    return {"run": str(run.dir), "run_id": run.meta["run_id"], "stage": "pretrain", "git_commit": run.meta["git_commit"],
            "seed": run.cfg.run.seed, "group": run.cfg.run.group, "data": data}  # fmt: skip


def save_weights(run: Run, model, step: int, splits, pretrained_on: dict) -> None:
    """encoder.pt, what the classification stage starts from, and mae.pt, the whole MAE that figures rebuild (main process)."""
    if run.is_main:
        mae = unwrap(model)
        meta = encoder_meta(run, splits, pretrained_on)
        save_encoder(mae.encoder, run.dir / ENCODER_FILE, step=step, meta=meta)
        save_mae(mae, run.dir / MAE_FILE, step=step, meta=meta)
