"""The memory loader's cache: a source's images decoded once into `<cache_dir>/<dataset>-<hash>.pt`.

The hash covers the source's identity (a path with its size and newest change time, mtime or ctime, linked folders
included and hidden ones not, as the listing reads them; or an identity string for shard lists and Hub datasets), the
decode settings (size, `data.max_image_pixels`) and `FORMAT_VERSION`, so a changed source is decoded again. Images
skipped by `data.skip_bad_images` are recorded in the cache too. A broken cache file is rebuilt, a truncated one or one
whose bytes changed (each split's pixels and labels carry a CRC-32); the cache is never written next to the input, and
a folder that cannot take it is refused before decoding.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable, Iterator

import torch

from vit.config import DataConfig
from vit.data.decode import BadImage
from vit.data.files import loops
from vit.data.splits import ImageSet
from vit.errors import DataError
from vit.store.atomic import atomic_save, nearest_existing

FORMAT_VERSION = 6  # bump when the cache layout or the decode changes, so old caches are not reused (2: skipped images, 16-bit PNGs;
#   3: each split's CRC-32 and the names and sizes of its files; 4: torchvision's Resize + CenterCrop, .ppm and .pgm files;
#   5: the images each shard gave, `ImageSet.parts`, which place the shards' val split; 6: reduced-scale JPEGs placed by
#   their DCT scale, not by the ratio of the sizes)


def cache_path(cfg: DataConfig, source: Path | str, extra: tuple = ()) -> Path:
    """`<cache_dir>/<dataset>-<hash>.pt`, the hash over the source's identity and the decode settings.

    `source` is a file or folder (identified by its path, total size and newest mtime) or an identity
    string that already says all that (shard lists, Hub datasets).
    """
    if isinstance(source, Path):
        size, mtime = _fingerprint(source)
        identity = (str(source.resolve()), size, mtime)
    else:
        identity = (source,)
    key = repr((FORMAT_VERSION, cfg.dataset, *identity, cfg.image_size, cfg.max_image_pixels, *extra))
    return cache_dir(cfg) / f"{cfg.dataset}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


def cached(cfg: DataConfig, source: Path | str, decode: Callable[[list], dict[str, ImageSet]], skipped: list,
            where: str | None = None, extra: tuple = ()) -> dict[str, ImageSet]:  # fmt: skip
    """Load `decode(bad)`'s result from the cache, or decode and write it atomically; a broken cache file is rebuilt.

    Images skipped by `data.skip_bad_images` are recorded in the cache too and appended to `skipped` on every load.
    """
    path = cache_path(cfg, source, extra)
    if isinstance(source, Path):
        _refuse_next_to(path.parent, source)
    _refuse_non_folder(path.parent)
    if path.is_file():
        loaded = _read_cache(path)
        if loaded is not None:
            result, bad = loaded
            if bad and not cfg.skip_bad_images:
                raise BadImage(f"{bad[0][1]}; data.skip_bad_images=true skips such files")
            skipped.extend(bad)
            return result
    _refuse_unwritable(path.parent)  # a cache that can be read is read from a read-only folder; one to write is tried first
    start = time.perf_counter()
    bad: list[tuple[str, str]] = []
    result = decode(bad)
    seconds = time.perf_counter() - start
    _write_cache(path, result, bad)
    count = sum(len(s) for s in result.values())
    sizes = ", ".join(f"{k} {len(v)}" for k, v in result.items())
    left_out = f", {len(bad)} that do not decode left out (data.skip_bad_images)" if bad else ""
    print(f"data: decoded {count} images ({sizes}) from {where or source} in {seconds:.1f}s{left_out}; cached at {path}", flush=True)
    for name, reason in bad[:20]:
        print(f"warning: skipped: {reason}", file=sys.stderr, flush=True)
    skipped.extend(bad)
    return result


def _read_cache(path: Path) -> tuple[dict[str, ImageSet], list[tuple[str, str]]] | None:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if payload.get("format") != FORMAT_VERSION:
            raise ValueError(f"format {payload.get('format')}, expected {FORMAT_VERSION}")
        classes = list(payload["classes"])
        splits = {split: ImageSet(v["images"], v["labels"], classes, v["identity"], v["parts"]) for split, v in payload["splits"].items()}
        for split, images in splits.items():
            if _crc(images) != payload["splits"][split]["crc"]:  # torch.load reads changed bytes back without a word
                raise ValueError(f"the {split} images are not the ones written (CRC-32 differs)")
        return splits, [tuple(b) for b in payload.get("skipped", [])]
    except Exception as e:  # truncated, foreign or stale files are all rebuilt the same way
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"warning: data cache {path} is unreadable ({type(e).__name__}: {reason}); decoding again", file=sys.stderr, flush=True)
        return None


def _write_cache(path: Path, result: dict[str, ImageSet], skipped: list[tuple[str, str]] = ()) -> None:
    """Write the decoded splits atomically: readers see the old file or the whole new one, never a torn one."""
    payload = {
        "format": FORMAT_VERSION,
        "classes": list(result["train"].classes),
        "splits": {
            split: {"images": s.images, "labels": s.labels, "identity": s.identity, "parts": s.parts, "crc": _crc(s)}
            for split, s in result.items()
        },
        "skipped": [list(b) for b in skipped],
    }
    try:
        atomic_save(payload, path)
    except OSError as e:
        raise DataError(f"cannot write the data cache {path} ({e.strerror}); set data.cache_dir to a writable folder") from None


def _crc(images: ImageSet) -> int:
    """CRC-32 of a split's pixels and labels: what tells a cache file whose bytes changed on disk."""
    crc = zlib.crc32(images.images.contiguous().view(-1).numpy())  # flat: an empty split has no bytes to cast
    return zlib.crc32(images.labels.numpy().tobytes(), crc)


def _fingerprint(source: Path) -> tuple[int, int]:
    """(total bytes, newest change in ns) of a file, or of every file and folder under a directory (a rename changes a
    folder's times). The change time (ctime) counts besides the mtime: `cp -p`, `rsync -a` and `tar x` give a rewritten
    file an old mtime, and a same-sized image (BMP, PPM) would then leave both numbers as they were."""
    if source.is_file():
        st = source.stat()
        return st.st_size, max(st.st_mtime_ns, st.st_ctime_ns)
    st = source.stat()
    total, newest = 0, max(st.st_mtime_ns, st.st_ctime_ns)
    for entry in _walk(source):
        try:
            st = entry.stat()
        except OSError:  # a dangling link: listed, then skipped or refused as a bad image when it is read
            st = entry.stat(follow_symlinks=False)
        total += st.st_size if entry.is_file() else 0
        newest = max(newest, st.st_mtime_ns, st.st_ctime_ns)
    return total, newest


def _walk(folder: Path, above: frozenset[str] = frozenset()) -> Iterator[os.DirEntry]:
    """Every entry under `folder` that `vit.data.files.list_images` would look at: into linked folders too (it lists the
    images behind a link, so an image changed there changes the source), not hidden ones (it skips them: a `git fetch`
    in a `.git` beside the images decoded them again). A link that loops is not followed and a folder that cannot be
    listed is passed over: the listing names either where it reads them (a root-only `lost+found` beside train/ and
    val/ is never read, yet it stopped the memory loader with a PermissionError traceback)."""
    above = above | {os.path.realpath(folder)}
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith("."):
            continue
        yield entry
        if entry.is_dir() and not loops(os.path.realpath(entry.path), above):
            yield from _walk(Path(entry.path), above)


def _refuse_next_to(cache_dir: Path, source: Path) -> None:
    cache_dir, source = cache_dir.resolve(), source.resolve()
    if cache_dir == source.parent or cache_dir == source or source in cache_dir.parents:
        raise DataError(f"data.cache_dir {cache_dir} would put the cache next to the input {source}; choose another folder")


def _refuse_non_folder(folder: Path) -> None:
    """Before any decoding (hours, for a large tree): a cache_dir that is a file, or lies under one, could not take the
    result."""
    if not (p := nearest_existing(folder)).is_dir():
        raise DataError(f"data.cache_dir {folder} cannot be a folder: {p} is a file; set data.cache_dir to a folder")


def _refuse_unwritable(folder: Path) -> None:
    """Before any decoding: a cache_dir where no file can be written (a read-only folder or file system) was found out only
    when the decoded images were to be written, hours later for a large tree."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".writable.", dir=folder)
    except OSError as e:
        raise DataError(f"cannot write the data cache in {folder} ({e.strerror}); set data.cache_dir to a writable folder") from None
    os.close(fd)
    os.unlink(probe)


def cache_dir(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir).expanduser()
