"""Image files in folders: labelled trees (`imagefolder`, and CIFAR as images) and unlabelled folders (`folder`).

- `imagefolder`: `<root>/{train,val,test}/<class>/.../<image>` or a `.tar.gz` of that tree (read as a stream, never
  extracted). `train` is required; a `val` folder replaces the carved validation split; `test` is optional.
- `folder`: every image file under `data.root`, at any depth, unlabelled (pretraining only).
"""

from __future__ import annotations

import tarfile
import zlib
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from vit.config import DataConfig
from vit.data.cache import cached
from vit.data.decode import IMAGE_EXTENSIONS, BadImage, decode_image, is_image_name
from vit.data.files import FileSet, SizeCheck, as_text, class_folders, decode_files, folder_files, no_counterpart, tree_files
from vit.data.sources.base import IMAGENET_MEAN, IMAGENET_STD, SPLIT_NAMES, Source, existing_root, is_archive, tree_why_not
from vit.data.splits import ImageSet
from vit.errors import DataError


class ImageTree(Source):
    """`imagefolder`: a labelled tree of image files, or a `.tar.gz` of one."""

    normalizations = {"imagefolder": (IMAGENET_MEAN, IMAGENET_STD)}
    mixed_sizes = True
    lists_files = True

    def why_not_streamed(self) -> str | None:
        return tree_why_not(self.cfg)

    def file_sets(self) -> dict[str, FileSet]:
        return tree_files(existing_root(self.cfg.root), SPLIT_NAMES)

    def read(self, skipped: list) -> dict[str, ImageSet]:
        return read_tree_cached(self.cfg, existing_root(self.cfg.root), skipped)


class PhotoFolder(Source):
    """`folder`: every image file under `data.root`, unlabelled."""

    normalizations = {"folder": (IMAGENET_MEAN, IMAGENET_STD)}
    mixed_sizes = True
    lists_files = True

    def why_not_streamed(self) -> str | None:
        return None

    def file_sets(self) -> dict[str, FileSet]:
        root = existing_root(self.cfg.root)
        held = [name for name in ("val", "test") if (root / "train").is_dir() and (root / name).is_dir()]
        if held:  # an ImageFolder tree: every image under it would be pretrained on, its held-out images too, unsaid
            raise DataError(f"data.root {self.cfg.root} holds train/ and {'/ and '.join(held)}/ folders: data.dataset=folder would train "
                            f"on every image under it, the {' and '.join(held)} images too; point data.root at its train/ folder")  # fmt: skip
        return {"train": folder_files(root)}

    def read(self, skipped: list) -> dict[str, ImageSet]:
        cfg = self.cfg
        return cached(cfg, existing_root(cfg.root), lambda bad: decode_file_sets(cfg, self.file_sets(), bad), skipped,
                      extra=(cfg.image_column, cfg.label_column))  # fmt: skip


def decode_file_sets(cfg: DataConfig, sets: dict[str, FileSet], bad: list) -> dict[str, ImageSet]:
    """Every file set decoded at `data.image_size` (the memory loader), images that do not decode appended to `bad`."""
    return {split: decode_files(files, cfg.image_size, cfg.skip_bad_images, bad, cfg.max_image_pixels) for split, files in sets.items()}


def read_tree_cached(cfg: DataConfig, root: Path, skipped: list, check: Callable[[list[str]], None] | None = None) -> dict[str, ImageSet]:
    """A tree or archive decoded once into the cache (`read_tree`). `check(classes)` refuses it by its training classes:
    a folder's before any image is decoded (hours, for a large tree), an archive's (whose classes its decode finds) before
    its images are cached, and a cache's as it is read (one decoded before the check)."""
    check = check or (lambda classes: None)
    if not is_archive(root) and (root / "train").is_dir():  # else `read_tree` says what the root is instead
        check(train_classes(root))

    def decode(bad: list) -> dict[str, ImageSet]:
        result = read_tree(root, cfg.image_size, cfg.skip_bad_images, bad, cfg.max_image_pixels)
        check(result["train"].classes)
        return result

    result = cached(cfg, root, decode, skipped)
    check(result["train"].classes)
    return result


def train_classes(root: Path) -> list[str]:
    """The class folders of a tree's train/, in label order, as `vit.data.files.tree_files` names them, no image listed."""
    return [as_text(name) for name in class_folders(root / "train")]


def read_tree(source: Path, image_size: int | None, skip_bad: bool = False, bad: list | None = None,
                      max_pixels: int | None = None) -> dict[str, ImageSet]:  # fmt: skip
    """Decode an ImageFolder tree or .tar.gz: {"train": ImageSet, "val"?: ImageSet, "test"?: ImageSet}."""
    bad = [] if bad is None else bad
    if source.is_file() and not is_archive(source):
        raise DataError(f"{source} is a file but not a .tar.gz/.tgz; expected an archive or a folder of train/<class>/<image>")
    if not is_archive(source):
        check = SizeCheck()
        result = {}
        for split, files in tree_files(source, SPLIT_NAMES).items():
            result[split] = decode_files(files, image_size, skip_bad, bad, max_pixels)
            check(files.reader.name(0), result[split].images[0].permute(1, 2, 0).numpy())
        return result
    entries = read_archive(source, image_size, skip_bad, bad, max_pixels)
    classes = sorted({c for split, c in entries if split == "train"})
    index = {c: i for i, c in enumerate(classes)}
    result = {}
    for split in SPLIT_NAMES:
        names = sorted(c for s, c in entries if s == split)
        if not names:
            continue
        for c in names:
            if c not in index:
                raise no_counterpart(source, split, as_text(c), [as_text(name) for name in classes])
        images, labels, identity = [], [], []
        for c in names:
            files = sorted(entries[(split, c)], key=lambda f: f[0])  # file order, so tree and archive agree
            images += [arr for _, _, arr in files]
            identity += [f"{as_text(f'{split}/{c}/{rel}')}\0{size}\n" for rel, size, _ in files]  # as `PathReader.identity` names them
            labels += [index[c]] * len(files)
        stacked = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()  # (N, H, W, 3) -> (N, 3, H, W)
        result[split] = ImageSet(stacked, torch.tensor(labels, dtype=torch.int64), [as_text(c) for c in classes], "".join(identity))
    return result


def read_archive(archive: Path, image_size: int | None, skip_bad: bool, bad: list,
                  max_pixels: int | None = None) -> dict[tuple[str, str], list[tuple[str, int, np.ndarray]]]:  # fmt: skip
    """Stream the members of a .tar.gz (no extraction to disk): `[prefix/]split/class/**/file` images are decoded, at
    any depth below the class folder, as the folder reader (`vit.data.files.tree_files`) reads them. Files are keyed by
    their path below the class folder, so sorting them gives the folder reader's order; each with its size in bytes."""
    check = SizeCheck()
    entries: dict[tuple[str, str], list[tuple[str, int, np.ndarray]]] = {}
    class_dirs: set[tuple[str, str]] = set()
    members: dict[tuple[str, ...], str] = {}  # split/class/**/file -> the member read as it, so a second one is refused
    try:
        with tarfile.open(archive, "r|gz") as tar:
            for member in tar:
                parts = PurePosixPath(member.name).parts  # "./train/x" -> ("train", "x")
                if PurePosixPath(member.name).is_absolute() or ".." in parts:
                    # Unpacked, it would land outside the tree (or, `tar` stripping the '/' or '..', onto another image).
                    raise DataError(f"{archive} holds the member {member.name!r}, a path outside the archive's folder; "
                                    "pack the tree with paths relative to it (tar -C <root> -czf ...)")  # fmt: skip
                wrapped = len(parts) >= 3 and parts[0] not in SPLIT_NAMES and parts[1] in SPLIT_NAMES
                if any(p.startswith(".") for p in parts[:3 if wrapped else 2]):
                    continue  # hidden folders (.ipynb_checkpoints) are no split or class
                if wrapped:
                    parts = parts[1:]  # one wrapping folder, e.g. cifar10/train/cat/0001.png
                if not parts or parts[0] not in SPLIT_NAMES:
                    continue
                if len(parts) >= 3:  # a member below a class folder: the folder is there, listed as a member or not (tar of files)
                    class_dirs.add((parts[0], parts[1]))
                if any(p.startswith(".") for p in parts):
                    continue  # hidden files and folders (macOS ._* twins) are not images
                if member.issym() or member.islnk():  # a stream has no way back to the target: left out, it would be lost unsaid
                    raise DataError(f"{archive}: {member.name} is a link to {member.linkname}; an archive's images and class "
                                    "folders must be plain files and folders (tar -h packs what links point to)")  # fmt: skip
                if member.isdir() and len(parts) == 2:
                    class_dirs.add((parts[0], parts[1]))
                if not member.isfile() or len(parts) < 3 or not is_image_name(parts[-1]):
                    continue
                if parts in members:  # appended twice, or under two wrapping folders: unpacked, one would overwrite the other
                    raise DataError(f"{archive} holds {'/'.join(parts)} twice ({members[parts]} and {member.name}); "
                                    "each image must be one member")  # fmt: skip
                members[parts] = member.name
                name = f"{archive}:{member.name}"
                data = tar.extractfile(member).read()
                try:
                    arr = decode_image(data, name, image_size, max_pixels)
                except BadImage as e:
                    if not skip_bad:
                        raise
                    bad.append((name, str(e)))
                    class_dirs.add((parts[0], parts[1]))
                    continue
                check(name, arr)
                entries.setdefault((parts[0], parts[1]), []).append(("/".join(parts[2:]), member.size, arr))
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise DataError(f"{archive} is truncated or not a readable .tar.gz ({type(e).__name__}: {e})") from None
    empty = sorted(class_dirs - set(entries))
    if empty:
        raise DataError(f"empty class folder {'/'.join(empty[0])} in {archive}: expected images ({', '.join(IMAGE_EXTENSIONS)})")
    if not any(split == "train" for split, _ in entries):
        raise DataError(f"{archive} has no train/<class>/<image> members")
    return entries
