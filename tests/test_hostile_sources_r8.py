"""Hostile inputs to the dataset sources (vit/data/sources/): CIFAR batches and MNIST idx files holding a label past
their classes, a CIFAR image tree of another class count read by the stream loader, a .tar.gz packed without folder
members whose class folder holds no image, and a Hugging Face split whose ClassLabel lists other classes than the
train split's. Each is read as torchvision (or the dataset's own class names) reads it, or refused in one line."""

import io
import pickle
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image
from test_stream import assert_one_line_naming, data_cfg, open_quiet

from vit.data.sources import load_splits
from vit.data.sources.hf import hf_files
from vit.errors import DataError


def png(seed: int, size: int = 8) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


# --------------------------------------------------------------------------- labels past the classes


def cifar10_with_label(tmp_path, bad: int):
    """torchvision's cifar-10-batches-py with 2 images a batch; row 1 of data_batch_3 labelled `bad`."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(1, 6):
        labels = [2 * i % 10, (2 * i + 1) % 10] if i != 3 else [0, bad]
        with open(folder / f"data_batch_{i}", "wb") as f:
            pickle.dump({"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8), "labels": labels}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)
    return folder / "data_batch_3"


def mnist_with_label(tmp_path, bad: int):
    """torchvision's MNIST/raw idx files, 4 training images; the third labelled `bad`."""
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    images = np.zeros((4, 28, 28), dtype=np.uint8)
    labels = np.array([0, 1, bad, 3], dtype=np.uint8)
    (raw / "train-images-idx3-ubyte").write_bytes(bytes([0, 0, 8, 3]) + np.array(images.shape, ">i4").tobytes() + images.tobytes())
    (raw / "train-labels-idx1-ubyte").write_bytes(bytes([0, 0, 8, 1]) + np.array(labels.shape, ">i4").tobytes() + labels.tobytes())
    return raw / "train-labels-idx1-ubyte"


@pytest.mark.parametrize("dataset, write, bad", [("cifar10", cifar10_with_label, 10), ("cifar10", cifar10_with_label, -1),
                                                 ("mnist", mnist_with_label, 10), ("mnist", mnist_with_label, 255)])  # fmt: skip
def test_a_label_past_the_classes_is_one_line_naming_its_file(tmp_path, dataset, write, bad):
    """Read as it was, label 10 of CIFAR-10 (or MNIST) went into the splits and stopped the first batch holding it with
    an IndexError in the loss (a device-side assert on a GPU), far from the file."""
    path = write(tmp_path, bad)
    with pytest.raises(DataError) as e:
        load_splits(data_cfg(tmp_path, dataset=dataset, root=str(tmp_path)))
    assert_one_line_naming(e, path, f"the label {bad}", "the 10 classes")


# --------------------------------------------------------------------------- a CIFAR tree of another class count


@pytest.mark.parametrize("loader", ["memory", "stream", "auto"])
def test_a_cifar_tree_of_three_classes_is_refused_by_every_loader(tmp_path, loader):
    """The memory loader refused it; the stream loader trained a 'cifar10' run on 3 classes."""
    for c in "abc":
        for i in range(2):
            (tmp_path / "tree" / "train" / c).mkdir(parents=True, exist_ok=True)
            (tmp_path / "tree" / "train" / c / f"{i}.png").write_bytes(png(i, 32))
    with pytest.raises(DataError) as e:
        open_quiet(data_cfg(tmp_path, dataset="cifar10", root=str(tmp_path / "tree"), loader=loader, workers=0), out_size=32)
    assert_one_line_naming(e, tmp_path / "tree", "holds 3 class folders, expected the 10 CIFAR-10 classes")


# --------------------------------------------------------------------------- archives packed without folder members


def archive_of_files(path, files: dict[str, bytes]):
    """A .tar.gz of `files` alone, no folder members (as `tar czf x.tgz train/*/*` or a script adding files packs it)."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("inside", ["notes.txt", "photo.heic", ".DS_Store"])
def test_a_class_folder_without_images_in_an_archive_without_folder_members_is_refused_as_in_the_tree(tmp_path, inside):
    """The class folder b held no image: the tree refuses it (torchvision's ImageFolder too); the archive dropped class
    b unsaid, so class c became label 1, against every other reading of the same images."""
    files = {"train/a/0.png": png(0), "train/a/1.png": png(1), f"train/b/{inside}": b"not an image", "train/c/0.png": png(2)}
    for name, data in files.items():
        (tmp_path / "tree" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tree" / name).write_bytes(data)
    archive = archive_of_files(tmp_path / "tree.tar.gz", files)
    for root, says in ((tmp_path / "tree", tmp_path / "tree" / "train" / "b"), (archive, "train/b")):
        with pytest.raises(DataError) as e:
            load_splits(data_cfg(tmp_path, dataset="imagefolder", root=str(root)))
        assert_one_line_naming(e, "empty class folder", says)


def test_an_archive_without_folder_members_reads_as_torchvisions_imagefolder(tmp_path):
    import torchvision

    files = {f"train/{c}/{i}.png": png(10 * j + i) for j, c in enumerate(["10", "2", "B", "a"]) for i in range(2)}
    for name, data in files.items():
        (tmp_path / "tree" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tree" / name).write_bytes(data)
    # Hidden files and folders are no images or classes here (torchvision would read them); a file beside the classes is none.
    files.update({"train/a/.hidden.png": png(99), "train/.ipynb_checkpoints/x.png": png(98), "train/notes.txt": b"x"})
    split = load_splits(data_cfg(tmp_path, dataset="imagefolder", root=str(archive_of_files(tmp_path / "t.tgz", files)))).train
    ref = torchvision.datasets.ImageFolder(str(tmp_path / "tree" / "train"))
    ref_images = torch.stack([torch.from_numpy(np.array(ref.loader(p))).permute(2, 0, 1) for p, _ in ref.samples])
    assert split.classes == ref.classes == ["10", "2", "B", "a"]
    assert split.labels.tolist() == ref.targets and torch.equal(split.images, ref_images)


# --------------------------------------------------------------------------- Hugging Face ClassLabels


def hf_train_test(tmp_path, train_names: list[str], test_names: list[str], test_labels: list[int]) -> str:
    import datasets

    def part(names, labels, seed):
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
        images = [Image.open(io.BytesIO(png(seed + i))) for i in range(len(labels))]
        return datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)

    parts = {"train": part(train_names, list(range(len(train_names))) * 2, 0), "test": part(test_names, test_labels, 50)}
    datasets.DatasetDict(parts).save_to_disk(str(tmp_path / "hf"))
    return str(tmp_path / "hf")


@pytest.mark.parametrize("test_names", [["a", "c"], ["c", "b", "a"]])
def test_a_hugging_face_split_with_a_classlabel_of_its_own_is_labelled_by_class_name(tmp_path, test_names):
    """Splits loaded one by one (`load_dataset("imagefolder")` of a test folder lacking class b) have ClassLabels of
    their own: test label 1 is 'c' there, and was read as the train split's 'b'."""
    test_labels = [0, 1, 1, 0]
    root = hf_train_test(tmp_path, ["a", "b", "c"], test_names, test_labels)
    expected = [["a", "b", "c"].index(test_names[v]) for v in test_labels]
    assert hf_files(root, "image", "label")["test"].labels.tolist() == expected  # what the stream loader serves
    splits = load_splits(data_cfg(tmp_path, dataset="hf", root=root))
    assert splits.train.classes == ["a", "b", "c"] and splits.test.labels.tolist() == expected


def test_a_hugging_face_split_naming_a_class_train_lacks_is_one_line(tmp_path):
    root = hf_train_test(tmp_path, ["a", "b"], ["a", "zebra"], [0, 1])
    with pytest.raises(DataError) as e:
        hf_files(root, "image", "label")
    assert_one_line_naming(e, "test split has the label 'zebra'", "not one of the train split's 2 classes")
