"""Helpers shared by the tests."""

import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port nobody listens on now, for a test's own process group (a fixed one can be taken)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def reset_accelerate() -> None:
    """Accelerate keeps process-wide singletons; reset them so the next in-process run starts clean."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def tiny_overrides(tmp_path, name="run", **extra) -> list[str]:
    """Overrides for a run of a 2-block, 32-wide encoder on 256 synthetic images, writing under tmp_path."""
    base = {
        "data.dataset": "synthetic",
        "data.synthetic_size": 256,
        "data.val_size": 40,
        "data.cache_dir": str(tmp_path / "cache"),
        "model.embed_dim": 32,
        "model.depth": 2,
        "model.num_heads": 2,
        "model.patch_size": 8,
        "optim.batch_size": 32,
        "schedule.epochs": 2,
        "schedule.warmup_epochs": 0.5,
        "run.dir": str(tmp_path / "runs"),
        "run.name": name,
        "run.tracker": "none",
        "run.progress": False,
        "run.threads": 1,
        "run.log_every": 1,
        "run.device": "cpu",
        "run.precision": "no",  # the same numbers on every CPU; `auto` would be bf16 on some
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def pretraining_loop(tmp_path, name="run", **overrides):
    """(the TrainLoop `python -m pretrain` runs, its batches epoch after epoch) for a tiny run with `overrides`."""
    from pretrain.config import PretrainConfig
    from pretrain.train import setup
    from vit.config import load_config
    from vit.train.loop import TrainLoop, batches_forever
    from vit.train.run import Run
    from vit.train.states import Progress

    cfg = load_config(PretrainConfig, None, tiny_overrides(tmp_path, name, **overrides))
    t = setup(cfg, Run.start(cfg, stage="pretrain"))
    return TrainLoop(t.run, t.forward, t.optimizer, t.train_loader, t.loss_fn, t.spec, Progress()), batches_forever(t.train_loader)


def finetuning_loop(tmp_path, name="run", **overrides):
    """(the TrainLoop `python -m finetune` runs, its batches epoch after epoch) for a tiny run with `overrides`."""
    import torch

    from finetune.config import FinetuneConfig
    from finetune.models import build_classifier
    from finetune.train import input_size, open_run_data, setup_training
    from vit.config import load_config
    from vit.train.loop import TrainLoop, batches_forever
    from vit.train.run import Run
    from vit.train.states import Progress

    cfg = load_config(FinetuneConfig, None, tiny_overrides(tmp_path, name, **overrides))
    run = Run.start(cfg, stage="finetune")
    data = open_run_data(cfg, run, input_size(cfg))
    t = setup_training(cfg, run, data, build_classifier(cfg, len(data.splits.train.classes), torch.device("cpu"), say=run.print))
    return TrainLoop(run, t.forward, t.optimizer, t.task.train, t.loss_fn, t.spec, Progress()), batches_forever(t.task.train)


class Started:
    """Stands in for `subprocess.Popen` in a sweep (the `started` fixture): records each job's command line and options;
    the job ends at once with exit 0."""

    def __init__(self):
        self.calls: list[tuple[list[str], dict]] = []

    def __call__(self, argv, **kwargs):
        self.calls.append((argv, kwargs))
        return self

    def poll(self):
        return 0

    @property
    def names(self) -> list[str]:
        return [next(a.split("=", 1)[1] for a in argv if a.startswith("run.name=")) for argv, _ in self.calls]


def image_tree(root: Path, bad=lambda split, label, i: False) -> Path:
    """An ImageFolder tree of 3 classes (a, b, c) x (9 train + 2 test) random 16 px PNGs; `bad(split, label, i)` files do
    not decode."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 9), ("test", 2)):
        for label in ("a", "b", "c"):
            (root / split / label).mkdir(parents=True)
            for i in range(n):
                path = root / split / label / f"{i}.png"
                Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(path)
                if bad(split, label, i):
                    path.write_bytes(b"not an image")
    return root


TINY_VIT = {"img_size": 32, "patch_size": 4, "embed_dim": 32, "depth": 1, "num_heads": 2, "num_classes": 0}  # ours and timm's


def tiny_timm_vit(**kw):
    """A tiny timm ViT of TINY_VIT's shape, in eval mode; `kw` overrides it (img_size, patch_size, global_pool, ...)."""
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**TINY_VIT, **kw}).eval()


def saved_for_hub(model, folder: Path) -> Path:
    """`model` saved as timm saves it for the Hub (config.json with its model_args, model.safetensors) into `folder`."""
    from timm.models import save_for_hf

    save_for_hf(model, str(folder), safe_serialization=True)
    return folder
