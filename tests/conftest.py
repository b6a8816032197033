"""Shared fixtures: tiny configs that train in seconds on generated data."""

import os
import pickle
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torchvision.io  # noqa: F401  decode.py imports it lazily; data workers forked from here then need not (2 s each)

from helpers import Started, reset_accelerate
from vit.device import usable_cores
from vit.train.accelerator import SHARED_BY_ENV

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

# The suite runs on pytest-xdist workers (`-n auto`, pyproject.toml). In a worker, its in-process runs and the stages it
# launches take their share of the cores, as a sweep's jobs do: two workers of two threads each on two cores ran slower.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ.setdefault(SHARED_BY_ENV, str(WORKERS))
    torch.set_num_threads(max(1, usable_cores() // WORKERS))


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: a worker per usable core, at most four (each imports torch and trains runs of its own; the tests that
    launch two-process runs already use two cores each)."""
    return max(1, min(4, usable_cores()))


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test's in-process runs start with a clean Accelerate state."""
    yield
    reset_accelerate()


@pytest.fixture
def started(monkeypatch) -> Started:
    """A sweep's jobs start as `Started` (nothing runs) and its waits take no time."""
    from vit.tools import sweep

    fake = Started()
    monkeypatch.setattr(sweep.subprocess, "Popen", fake)
    waits = []

    def sleep(seconds):  # a sweep that waits for nothing fails the test instead of hanging it
        waits.append(seconds)
        assert len(waits) < 1000, "the sweep waits for a job that never starts"

    monkeypatch.setattr(sweep.time, "sleep", sleep)
    return fake


# --------------------------------------------------------------------------- on-disk data fixtures (tests/test_data.py)
# Tiny copies of each format the data sources read, written into tmp_path, with the arrays they hold.

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@pytest.fixture
def cifar10_folder(tmp_path):
    """torchvision's `cifar-10-batches-py` layout: 5 training batches of 10 images (5 per class overall) and a test batch of 10.

    Returns SimpleNamespace(root, folder, classes, train_images (50, 3, 32, 32) uint8, train_labels (50,), test_images, test_labels).
    """
    rng = np.random.default_rng(0)
    folder = tmp_path / "cifar" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    train_images = rng.integers(0, 256, (50, 3, 32, 32), dtype=np.uint8)
    train_labels = rng.permutation(np.arange(50) % 10)
    test_images = rng.integers(0, 256, (10, 3, 32, 32), dtype=np.uint8)
    test_labels = np.arange(10)

    def dump(name, obj):
        with open(folder / name, "wb") as f:
            pickle.dump(obj, f)

    for i in range(5):
        rows = slice(10 * i, 10 * (i + 1))
        batch = {"labels": train_labels[rows].tolist(), "data": train_images[rows].reshape(10, 3072)}
        dump(f"data_batch_{i + 1}", batch)
    dump("test_batch", {"batch_label": "testing batch 1 of 1", "labels": test_labels.tolist(), "data": test_images.reshape(10, 3072)})
    dump("batches.meta", {"label_names": CIFAR10_CLASSES, "num_cases_per_batch": 10, "num_vis": 3072})
    return SimpleNamespace(root=tmp_path / "cifar", folder=folder, classes=CIFAR10_CLASSES, train_images=train_images,
                           train_labels=train_labels, test_images=test_images, test_labels=test_labels)  # fmt: skip


def _write_image(path, array, quality=None):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(array)
    if quality is None:
        image.save(path)
    else:
        image.save(path, quality=quality)


@pytest.fixture
def imagefolder_tree(tmp_path):
    """`<root>/{train,test}/<class>/<image>`: classes cat, dog, emu; 4 training images each (one cat image a JPEG,
    one dog image grayscale PNG), 1 test PNG each; all 16x16.

    Returns SimpleNamespace(root, classes, train_images (12, 3, 16, 16) uint8, train_labels (12,), test_images (3, 3, 16, 16),
    test_labels (3,), jpeg_rows: training rows stored lossy, exact: the other rows match the files bit for bit).
    """
    rng = np.random.default_rng(1)
    root = tmp_path / "tree"
    classes = ["cat", "dog", "emu"]
    expected = {"train": ([], []), "test": ([], [])}
    jpeg_rows = []
    for label, name in enumerate(classes):
        for i in range(4):
            if name == "cat" and i == 3:
                # A smooth image, so the lossy JPEG stays within a few levels of it.
                ramp = np.linspace(0, 255, 16, dtype=np.float32)
                hwc = np.stack([ramp[None, :].repeat(16, 0), ramp[:, None].repeat(16, 1), np.full((16, 16), 128.0)], -1).astype(np.uint8)
                _write_image(root / "train" / name / "b0.jpg", hwc, quality=95)
                jpeg_rows.append(len(expected["train"][0]))
            elif name == "dog" and i == 0:
                grey = rng.integers(0, 256, (16, 16), dtype=np.uint8)
                _write_image(root / "train" / name / f"a{i}.png", grey)
                hwc = np.repeat(grey[..., None], 3, -1)
            else:
                hwc = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
                _write_image(root / "train" / name / f"a{i}.png", hwc)
            expected["train"][0].append(hwc.transpose(2, 0, 1))
            expected["train"][1].append(label)
        hwc = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
        _write_image(root / "test" / name / "t0.png", hwc)
        expected["test"][0].append(hwc.transpose(2, 0, 1))
        expected["test"][1].append(label)
    (root / "train" / "notes.txt").write_text("not an image: ignored")
    (root / "train" / "cat" / "._a0.png").write_bytes(b"macOS resource fork: hidden, ignored")
    (root / "train" / ".ipynb_checkpoints").mkdir()  # hidden, not a class
    return SimpleNamespace(
        root=root, classes=classes, jpeg_rows=jpeg_rows,
        train_images=np.stack(expected["train"][0]), train_labels=np.array(expected["train"][1]),
        test_images=np.stack(expected["test"][0]), test_labels=np.array(expected["test"][1]),
    )  # fmt: skip


@pytest.fixture
def imagefolder_tar(imagefolder_tree, tmp_path):
    """The `imagefolder_tree` as a .tar.gz with members `train/<class>/<image>` (directory members included).

    Returns SimpleNamespace(path, tree): `tree` is the imagefolder_tree namespace with the expected arrays.
    """
    path = tmp_path / "archives" / "tree.tar.gz"
    path.parent.mkdir()
    with tarfile.open(path, "w:gz") as tar:
        for split in ("train", "test"):
            tar.add(imagefolder_tree.root / split, arcname=split)
    return SimpleNamespace(path=path, tree=imagefolder_tree)


@pytest.fixture
def mnist_root(tmp_path):
    """torchvision's idx layout for MNIST and FashionMNIST alike, 20 training and 10 test 28x28 images:
    `<root>/<MNIST|FashionMNIST>/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`.

    Returns SimpleNamespace(root, train_images (20, 28, 28) uint8, train_labels (20,), test_images (10, 28, 28), test_labels (10,)).
    """
    rng = np.random.default_rng(2)
    root = tmp_path / "mnist"
    arrays = {
        "train": (rng.integers(0, 256, (20, 28, 28), dtype=np.uint8), np.arange(20, dtype=np.uint8) % 10),
        "t10k": (rng.integers(0, 256, (10, 28, 28), dtype=np.uint8), np.arange(10, dtype=np.uint8)),
    }
    for folder in ("MNIST", "FashionMNIST"):
        raw = root / folder / "raw"
        raw.mkdir(parents=True)
        for prefix, (images, labels) in arrays.items():
            # idx format: magic (0, 0, dtype 0x08 = uint8, number of dims), big-endian int32 dims, then the raw bytes.
            header = bytes([0, 0, 8, 3]) + np.array(images.shape, dtype=">i4").tobytes()
            (raw / f"{prefix}-images-idx3-ubyte").write_bytes(header + images.tobytes())
            header = bytes([0, 0, 8, 1]) + np.array(labels.shape, dtype=">i4").tobytes()
            (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(header + labels.tobytes())
    return SimpleNamespace(root=root, train_images=arrays["train"][0], train_labels=arrays["train"][1].astype(np.int64),
                           test_images=arrays["t10k"][0], test_labels=arrays["t10k"][1].astype(np.int64))  # fmt: skip


@pytest.fixture(scope="session")
def mae_run(tmp_path_factory) -> Path:
    """A short MAE pretraining run shared by the tests that start from one (fine-tuning, kNN, provenance): two epochs of
    the tiny encoder, with the kNN monitor on the whole training split as its bank and every val image."""
    from helpers import reset_accelerate, tiny_overrides
    from pretrain.train import main as pretrain

    tmp = tmp_path_factory.mktemp("mae")
    assert pretrain(tiny_overrides(tmp, name="mae", **{"mae.knn_bank_size": 1000, "mae.knn_val_size": 0})) == 0
    reset_accelerate()
    return tmp / "runs" / "mae"
