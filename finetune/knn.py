"""`finetune.mode=knn`: weighted kNN classification on frozen features (Wu et al. 2018, as DINO evaluates), no training.

The encoder's pooled features of the training split are the memory bank; val and test are
classified by the vote of their `finetune.knn_k` nearest bank features. Nothing is trained, so
the stage takes the time of one pass of the encoder over the images.
"""

from __future__ import annotations

import time

import torch

from finetune.config import FinetuneConfig
from finetune.models import Built
from vit.data.files import ShardSet
from vit.data.loaders import Data
from vit.errors import CheckpointError, ConfigError, DataError
from vit.eval.knn import encode, knn_accuracy
from vit.train.run import Run


def check_knn_data(cfg: FinetuneConfig, data: Data) -> None:
    """Refuse, in one line, data `run_knn` cannot classify; before the run is set up (`Run.ready`), so that a run it
    would replace (run.overwrite) is left as it is."""
    splits = data.splits
    if isinstance(splits.train, ShardSet):
        raise ConfigError("finetune.mode=knn encodes every training image once, unaugmented, as its memory bank, and streamed WebDataset "
                          "shards are read for training only: set data.loader=memory where the shards fit in memory")  # fmt: skip
    if not any(images is not None and len(images) for images in (splits.val, splits.test)):  # as finetune.mode=eval refuses it
        raise DataError(f"finetune.mode=knn has nothing to classify: no val split (data.val_size=0), and "
                        f"{cfg.data.root or cfg.data.dataset} has no test split; set data.val_size")  # fmt: skip


def run_knn(cfg: FinetuneConfig, run: Run, data: Data, built: Built, parent: str | None) -> int:
    """Classify val and test against the training features (`check_knn_data` passed); writes summary.json like a probe's
    (val/test top-1, top-5)."""
    acc, ft, splits = run.accelerator, cfg.finetune, data.splits
    encoder = built.model.to(acc.device).encoder  # the LinearProbe's frozen encoder; its head is not used
    started, batch = time.perf_counter(), data.eval_batch(cfg.optim.batch_size)
    bank, bank_labels = encode(encoder, data.loader(splits.train, batch, train=False), acc, ft.probe_pool, gather=True)
    queries = {}
    for split, images in (("val", splits.val), ("test", splits.test)):
        if images is not None and len(images):
            queries[split] = encode(encoder, data.loader(images, batch, train=False), acc, ft.probe_pool)
    feature_time = time.perf_counter() - started
    check_finite(ft.init, {"train": bank, **{split: f for split, (f, _) in queries.items()}}, acc)
    if not bank.shape[0]:  # gathered: every rank refuses alike
        raise DataError(f"finetune.mode=knn: none of the {len(splits.train)} training images decoded (data.skip_bad_images skipped "
                        "each): the memory bank is empty and nothing was classified")  # fmt: skip
    num_classes = len(splits.train.classes)
    k = min(ft.knn_k, bank.shape[0])
    if k < ft.knn_k:
        run.warn(f"finetune.knn_k={ft.knn_k} is more than the {bank.shape[0]} training images of the bank: all {k} vote")
    results = {split: knn_accuracy(bank, bank_labels, f, y, num_classes, k, ft.knn_temperature, acc)
               for split, (f, y) in queries.items()}  # fmt: skip
    for split, r in results.items():  # counts summed over the ranks: every rank refuses alike
        if not r["count"]:  # its top-1 would read 0 of max(0, 1): 0.00%, recorded as the result
            listed = splits.val if split == "val" else splits.test
            raise DataError(f"finetune.mode=knn: none of the {len(listed)} {split} images decoded (data.skip_bad_images skipped "
                            "each): there is nothing to classify there, and nothing was recorded")  # fmt: skip
    wall_time = time.perf_counter() - started
    images = bank.shape[0] + sum(r["count"] for r in results.values())  # those featurised: skipped images are in no split's count
    flat = {f"{split}_{key}": r[key] for split, r in results.items() for key in ("top1", "top5")}
    run.finish({
        "mode": "knn",
        "job_type": run.job_type,
        "init": ft.init,
        "parent": parent,
        "model": cfg.model.name,
        "arch": built.arch,
        "knn": {"k": k, "temperature": ft.knn_temperature, "pool": ft.probe_pool, "bank": bank.shape[0]},
        "wall_time_sec": round(wall_time, 2),
        "feature_time_sec": round(feature_time, 2),
        "images_per_sec": round(images / max(feature_time, 1e-9), 1),
        "feature_images_per_sec": round(images / max(feature_time, 1e-9), 1),
        "final_val_top1": flat.get("val_top1"),
        "final_test_top1": flat.get("test_top1"),
        "data": splits.describe(),
        "test_split": splits.test is not None,
        "bad_images": data.bad_total(acc),
        **flat,
    })  # fmt: skip
    lines = [f"{s} top-1 {r['top1']:.2%} top-5 {r['top5']:.2%}" for s, r in results.items()]
    run.print(f"knn (k {k}, T {ft.knn_temperature}, bank {bank.shape[0]}): " + ", ".join(lines)
              + f" in {wall_time:.1f}s ({feature_time:.1f}s of features) -> {run.dir}")  # fmt: skip
    return 0


def check_finite(init: str, features: dict[str, torch.Tensor], accelerator=None) -> None:
    """Refuse features that are not finite (an encoder with NaN or inf weights): each vote of a NaN similarity counted
    for no class, and the run reported 0% top-1 as its result. features: {split: (N, D)}, the bank ("train") gathered on
    every rank and the query splits this rank's shard: their counts are summed over the ranks (`accelerator`), so that
    every rank refuses alike (one that went on alone waited for the others in the vote) and the message counts the split."""
    counts = {
        split: torch.stack([(~f.isfinite()).any(1).sum(), torch.tensor(f.shape[0], device=f.device)]) for split, f in features.items()
    }
    if accelerator is not None and accelerator.num_processes > 1:
        counts.update({split: accelerator.reduce(c, reduction="sum") for split, c in counts.items() if split != "train"})
    total = {split: c.tolist() for split, c in counts.items()}  # {split: [non-finite, images]}
    if any(n for n, _ in total.values()):
        said = ", ".join(f"{n} of {size} {split}" for split, (n, size) in total.items() if n)
        raise CheckpointError(f"finetune.init={init}: the encoder's features are not finite (NaN or inf) for {said} images: its "
                              "weights are damaged or diverged; nothing was classified")  # fmt: skip
