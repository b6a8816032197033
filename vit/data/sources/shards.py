"""`webdataset`: tar shards in WebDataset layout (`data.root=shards/train-{000000..000127}.tar`): `<key>.jpg|png|...`
plus an optional `<key>.cls` holding the class index as text, read in order with the `webdataset` package.

Their sample counts (and the classes their `.cls` files name) are read once from the tar headers, which needs no image
data, and cached next to the decoded data. Shards are never indexed: training reads them in order (`ShardSet`), and the
val split is decoded into memory from `data.val_root`'s first samples, or from the last shards' first samples, which
training then leaves out. The memory loader holds out the same samples (`shard_val_index`), so a run pretrained under
one loader and fine-tuned under the other never evaluates on images it trained on.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vit.config import DataConfig
from vit.data.cache import cached
from vit.data.decode import BadImage, decode_image
from vit.data.files import UNLABELLED, ShardSet, SizeCheck
from vit.data.sources.base import IMAGENET_MEAN, IMAGENET_STD, Source
from vit.data.splits import ImageSet, SourceIndex, Splits, seeded_generator
from vit.errors import DataError, UserError


class Shards(Source):
    """`webdataset`: shards read in order (the stream loader), or decoded whole where they fit (the memory loader)."""

    normalizations = {"webdataset": (IMAGENET_MEAN, IMAGENET_STD)}
    mixed_sizes = True

    def why_not_streamed(self) -> str | None:
        return None

    def why_not_memory(self) -> str | None:
        # The memory path decodes data.root alone and carves val from it; the val shards are the stream loader's to read.
        return "data.val_root is read by the stream loader only" if self.cfg.val_root is not None else None

    def read(self, skipped: list) -> dict[str, ImageSet]:
        cfg = self.cfg
        # The scan checks the layout the sample reader cannot see (a damaged tar, a key split in two, two images in one
        # sample, labels on some samples only), as it does for the stream loader, and names the classes both loaders use.
        shards = open_shards(cfg.root, Path(cfg.cache_dir).expanduser())
        identity = repr(shards_identity(shards.urls))
        return cached(cfg, identity, lambda bad: read_shards(shards.urls, cfg, bad, shards.classes), skipped, where=cfg.root)

    def held_out(self, train: ImageSet) -> torch.Tensor:
        # Not the seeded carve of the other sources: the stream loader's val split (`shard_splits`), so that neither
        # loader trains on the other's val images (streamed shards record no positions for the overlap check to read).
        return shard_val_index(train.parts, self.cfg.val_size, self.cfg.root)

    def stream_splits(self, out_size: int, bad: Any, listed=None) -> Splits:
        return shard_splits(self.cfg, out_size, bad, self.normalization)

    def decoded_size(self, out_size: int, listed=None) -> tuple[int, str, int]:
        shards = open_shards(self.cfg.root, Path(self.cfg.cache_dir).expanduser())
        side = self.cfg.image_size or out_size
        return len(shards), f"{side}x{side}", len(shards) * 3 * side * side


def read_shards(urls: list[str], cfg: DataConfig, bad: list, classes: list[str]) -> dict[str, ImageSet]:
    """Every sample of the shards, in order, decoded (`data.loader=memory` for shards small enough); `classes`: those
    the scan of their headers found (`open_shards`)."""
    check = SizeCheck()
    arrays, labels, gave = [], [], dict.fromkeys(urls, 0)
    try:
        samples = list(decoded_samples(urls, cfg, bad, check))
    except (tarfile.TarError, EOFError, OSError) as e:  # webdataset's reader raises tarfile's errors as they come
        first = (str(e).strip().splitlines() or [""])[0]
        raise DataError(f"the shards {cfg.root} are not readable tar files ({type(e).__name__}: {first})") from None
    for url, arr, label in samples:
        gave[url] += 1
        arrays.append(arr)
        labels.append(label)
    if not arrays:
        raise DataError(f"the shards {cfg.root} hold no images")
    labelled = [v != UNLABELLED for v in labels]
    if any(labelled) and not all(labelled):
        raise DataError(f"some samples of {cfg.root} have .cls labels and some do not: label all of them or none")
    stacked = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
    return {"train": ImageSet(stacked, torch.tensor(labels, dtype=torch.int64), list(classes), parts=list(gave.values()))}


def shard_val_index(parts: list[int], val_size: int, root: str) -> torch.Tensor:
    """The val split `shard_splits` streams, as positions among every decoded sample (`parts[i]` of them from shard i,
    in order): the first samples of the last shard, then of the one before, and so on, `val_size` in all, in that order
    -> (val_size,) int64. Samples that do not decode (`data.skip_bad_images`) are neither val nor training images under
    either loader, and the next ones take their place."""
    if val_size >= sum(parts):
        raise DataError(f"the shards {root} hold {sum(parts)} samples that decode; data.val_size={val_size} needs more")
    picked, left, end = [], val_size, sum(parts)
    for size in reversed(parts):
        take = min(left, size)
        if take == 0:
            break
        picked.append(torch.arange(end - size, end - size + take))
        left, end = left - take, end - size
    return torch.cat(picked) if picked else torch.zeros(0, dtype=torch.int64)


def decoded_samples(urls: list[str], cfg: DataConfig, bad: list, check: SizeCheck):
    """(shard url, image (H, W, 3) uint8, label) of every sample of `urls` that decodes, in order; the others appended to
    `bad` (`data.skip_bad_images`) or raised."""
    for sample in shard_samples(urls):
        found = sample_image(sample)
        name = f"{sample.get('__url__')}:{sample['__key__']}"
        try:
            if found is None:
                raise BadImage(f"sample {name} has no image member (.jpg, .png, ...)")
            arr = decode_image(found[0], found[1], cfg.image_size, cfg.max_image_pixels)
        except BadImage as e:
            if not cfg.skip_bad_images:
                raise
            bad.append((name, str(e)))
            continue
        check(name, arr)
        yield sample["__url__"], arr, sample_label(sample)


def shard_head(shards: ShardSet, count: int, out_size: int, skip_bad: bool, bad: Any,
               urls: list[str] | None = None, max_pixels: int | None = None) -> tuple[ImageSet, list[tuple[str, str]]]:  # fmt: skip
    """The first `count` images of `urls` (default the shards', in order, their excluded samples left out), decoded for
    evaluation (shorter side resized to `out_size`, centre crop), and the (url, key) of every sample with an image
    member read (skipped ones too): what `ShardSet.exclude` holds. `bad`: where skipped images are told (a
    `vit.data.stream.BadImageLog`)."""
    arrays, labels, keys = [], [], []
    for sample in shard_samples(urls or shards.urls):
        if len(arrays) >= count:
            break
        if urls is None and (sample["__url__"], sample["__key__"]) in shards.exclude:
            continue
        found = sample_image(sample)
        name = found[1] if found is not None else f"{sample.get('__url__')}:{sample['__key__']}"  # as the stream loader names it
        try:
            if found is None:
                raise BadImage(f"sample {name} has no image member (.jpg, .png, ...)")
            keys.append((sample["__url__"], sample["__key__"]))  # the samples `ShardSet.sizes` counts
            arrays.append(decode_image(found[0], found[1], out_size, max_pixels))
        except BadImage as e:
            if not skip_bad:
                raise BadImage(f"{e}; data.skip_bad_images=true skips such files") from None
            bad.add([(name, str(e))])
            continue
        labels.append(sample_label(sample))
    images = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous() if arrays else torch.zeros(0, 3, out_size, out_size, dtype=torch.uint8)
    return ImageSet(images, torch.tensor(labels, dtype=torch.int64), list(shards.classes)), keys


def local(url: str) -> str:
    """A shard's URL as one spelling: a local file's real path (a relative or linked name of the same file), else as given."""
    return url if "://" in url or url.startswith("pipe:") else os.path.realpath(url)


def shard_splits(cfg: DataConfig, out_size: int, bad: Any, normalization: tuple) -> Splits:
    """Shards: the training ShardSet and a val split decoded into memory (`data.val_root`'s first val_size samples, or
    the first val_size samples of the last shards, which training then leaves out)."""
    if cfg.train_fraction < 1.0:
        raise DataError("data.train_fraction needs an indexable source; shards are read in order (write fewer shards instead)")
    cache_dir = Path(cfg.cache_dir).expanduser()
    train = open_shards(cfg.root, cache_dir)
    val = ImageSet(torch.zeros(0, 3, out_size, out_size, dtype=torch.uint8), torch.zeros(0, dtype=torch.int64), list(train.classes))
    if cfg.val_root is not None:
        held = open_shards(cfg.val_root, cache_dir)
        same = sorted({local(u) for u in held.urls} & {local(u) for u in train.urls})
        if same:  # its val images were training images, unsaid
            raise DataError(f"data.val_root {cfg.val_root!r} names shards of data.root ({same[0]}{f' and {len(same) - 1} more' if len(same) > 1 else ''}): "
                            "its val images would be training images; give val shards of their own, or leave data.val_root unset to "
                            "hold out the first data.val_size samples of the last shards")  # fmt: skip
        # A val label of -1 (none) or past the classifier's head stops the first evaluation with an IndexError.
        if train.labelled and (not held.labelled or len(held.classes) > len(train.classes)):
            found = f"the class index {len(held.classes) - 1}" if held.labelled else "no .cls labels"
            raise DataError(f"data.val_root {cfg.val_root!r} has {found}, but data.root's shards have the {len(train.classes)} classes "
                            f"0..{len(train.classes) - 1}: label the val samples with the training classes")  # fmt: skip
        val, _ = shard_head(held, cfg.val_size or len(held), out_size, cfg.skip_bad_images, bad, urls=held.urls, max_pixels=cfg.max_image_pixels)
        val.classes = list(train.classes)
    elif cfg.val_size:
        if cfg.val_size >= len(train):
            raise DataError(f"the shards hold {len(train)} samples; data.val_size={cfg.val_size} needs more (or set data.val_root)")
        keys, parts, held_out = [], [], set()
        for url, size in zip(reversed(train.urls), reversed(train.sizes)):
            part, read = shard_head(train, cfg.val_size - sum(len(p) for p in parts), out_size, cfg.skip_bad_images, bad, urls=[url],
                                    max_pixels=cfg.max_image_pixels)  # fmt: skip
            if len(read) >= size:
                held_out.add(url)  # every sample is val: training leaves the shard out (a worker given it alone would have none)
            else:
                keys += read  # keyed by shard too: shards written with the same keys in each keep theirs
            parts.append(part)
            if sum(len(p) for p in parts) >= cfg.val_size:
                break
        val = ImageSet(torch.cat([p.images for p in parts]), torch.cat([p.labels for p in parts]), list(train.classes))
        kept = [i for i, url in enumerate(train.urls) if url not in held_out]
        train = ShardSet([train.urls[i] for i in kept], [train.sizes[i] for i in kept], train.classes, frozenset(keys), train.fingerprint)
    mean, std = normalization
    return Splits(cfg.dataset, train, val, None, mean, std, SourceIndex(train.fingerprint, len(train), None, None), "stream", out_size)


SHARD_IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "tif", "tiff", "gif")  # a sample's image member
# The largest class index a .cls may hold: the classes are 0..max, so a stray huge number would make a list (and a
# classifier head) of that many classes, filling the memory before anything says why. ImageNet-21k has 21,841.
MAX_CLASS_INDEX = 999_999
SCAN_VERSION = 2  # bump when `scan_shard` checks more, so indexes cached by an older scan are scanned again


def expand_shards(pattern: str) -> list[str]:
    """`dir/train-{000000..000127}.tar` (brace notation, '::' between patterns; each may also be a glob, `dir/*.tar`,
    whose matches are taken in sorted order) -> the shard paths, each checked to exist and to be named once."""
    from webdataset.shardlists import expand_urls

    urls = []
    for url in expand_urls(os.path.expanduser(pattern)):
        url = os.path.expanduser(url)  # a `~` after '::' too
        if glob.has_magic(url) and not os.path.exists(url):
            found = sorted(u for u in glob.glob(url) if os.path.isfile(u))
            if not found:
                raise DataError(f"data.root {pattern!r}: {url} matches no file")
            urls += found
        else:
            urls.append(url)
    if not urls:
        raise DataError(f"data.root {pattern!r} names no shards")
    folder = next((u for u in urls if os.path.isdir(u)), None)
    if folder is not None:  # training on every tar of a folder would take the val shards written beside them too
        tars = sorted(n for n in os.listdir(folder) if n.endswith((".tar", ".tar.gz", ".tgz")) and not n.startswith("."))
        holds = f"it holds {len(tars)} tar file(s), {tars[0]} .. {tars[-1]}" if tars else "it holds no .tar file"
        raise DataError(f"data.root {pattern!r} is the folder {folder} ({holds}): name its training shards with a brace "
                        f"pattern or a glob, e.g. '{os.path.join(folder, 'train-*.tar')}'")  # fmt: skip
    missing = [u for u in urls if not os.path.isfile(u)]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise DataError(f"shard {missing[0]}{more} of data.root {pattern!r} does not exist (shards must be local or mounted files)")
    first: dict[str, str] = {}
    for url in urls:
        earlier = first.setdefault(local(url), url)
        if earlier is not url:
            same = "" if earlier == url else f" (as {earlier} and {url})"
            raise DataError(f"data.root {pattern!r} names the shard {url} twice{same}: its samples would be read twice an epoch, "
                            "and a val sample carved from one copy trained on through the other; name each shard once")  # fmt: skip
    return urls


def split_key(name: str) -> tuple[str, str]:
    """WebDataset's key rule: `dir/abc.def.jpg` -> ("dir/abc", "def.jpg"): the key ends at the first dot of the base name."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower() if dot else ""


def scan_shard(path: str) -> dict[str, Any]:
    """One pass over a shard's tar headers (no image data is read): {"samples": int, "labels": [distinct .cls values]}."""
    keys, labelled, labels = set(), set(), set()
    images: dict[str, str] = {}  # key -> its image member's extension
    seen, last = set(), None  # every key met, and the key of the member before
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = split_key(member.name)
                # WebDataset makes one sample of each run of members with the same key: a key met again after another
                # would be a second sample of that key, which the count here (and the val split's keys) would merge.
                if key != last and key in seen:
                    raise DataError(f"shard {path}: the members of sample {key} are not together (another sample's come "
                                    f"between them); write each sample's files one after another")  # fmt: skip
                seen.add(key)
                last = key
                if ext in SHARD_IMAGE_EXTENSIONS:
                    if key in images:  # the reader would take one and drop the other without a word
                        raise DataError(f"shard {path}: sample {key} has two images ({key}.{images[key]}, {key}.{ext}); "
                                        "write one image per sample")  # fmt: skip
                    images[key] = ext
                    keys.add(key)
                elif ext == "cls":
                    labels.add(parse_label(tar.extractfile(member).read(), f"{path}:{member.name}"))
                    labelled.add(key)
            # tarfile ends its listing quietly at a header cut short or damaged (past the first): what follows the last
            # member must be the end-of-archive zeros (or nothing), else the samples from there on would be lost unsaid.
            tar.fileobj.seek(tar.offset)
            if tar.fileobj.read(tarfile.BLOCKSIZE).strip(b"\0"):
                raise DataError(f"shard {path} is truncated or damaged: its tar header at byte {tar.offset:,} cannot be read, "
                                f"after {len(keys)} sample(s)")  # fmt: skip
    except (tarfile.TarError, EOFError, OSError) as e:
        first = (str(e).strip().splitlines() or [""])[0].rstrip(":")
        raise DataError(f"shard {path} is not a readable tar file ({type(e).__name__}: {first})") from None
    unlabelled = sorted(keys - labelled) if labelled else []
    if unlabelled:
        raise DataError(f"shard {path}: some samples have .cls labels and some do not (sample {unlabelled[0]} has no .cls label): "
                        "label all samples or none")  # fmt: skip
    return {"samples": len(keys), "labels": sorted(labels)}


def open_shards(pattern: str, cache_dir: Path) -> ShardSet:
    """The shards `pattern` names, with their sample counts and classes (from a cached scan of their headers)."""
    urls = expand_shards(pattern)
    stats = [os.stat(u) for u in urls]
    key = hashlib.sha256(repr((SCAN_VERSION, shards_identity(urls))).encode()).hexdigest()[:16]
    index_file = Path(cache_dir).expanduser() / f"shards-{key}.json"
    scans = None
    if index_file.is_file():
        try:
            scans = json.loads(index_file.read_text())["shards"]
        except (ValueError, KeyError):
            scans = None  # a damaged index is scanned again
    if scans is None or len(scans) != len(urls):
        scans = [scan_shard(u) for u in urls]
        from vit.store.atomic import atomic_write_text

        try:
            atomic_write_text(index_file, json.dumps({"pattern": pattern, "shards": scans}))
        except (OSError, UserError):  # UserError: a full disk (vit.store.atomic's StorageError)
            pass  # the scan is only a cache: a read-only cache_dir costs a rescan next time
    empty = [u for u, s in zip(urls, scans) if s["samples"] == 0]
    if empty:
        raise DataError(f"shard {empty[0]} holds no images (expected <key>.jpg/.png members, WebDataset layout)")
    labels = sorted({v for s in scans for v in s["labels"]})
    labelled = [bool(s["labels"]) for s in scans]
    if any(labelled) and not all(labelled):
        raise DataError(f"shard {urls[labelled.index(False)]} has no .cls labels but {urls[labelled.index(True)]} has: label all shards or none")
    if labels and labels[0] < 0:
        raise DataError(f"the shards' .cls labels must be class indices >= 0, found {labels[0]}")
    classes = [str(i) for i in range(labels[-1] + 1)] if labels else []
    digest = hashlib.blake2b(repr([(os.path.basename(u), s.st_size) for u, s in zip(urls, stats)]).encode(), digest_size=16).hexdigest()
    return ShardSet(urls, [s["samples"] for s in scans], classes, frozenset(), digest)


def shards_identity(urls: list[str]) -> list[tuple[str, int, int]]:
    """(path, size, newest change in ns) of each shard: what keys the cached scan and the decoded cache. The change time
    (ctime) counts besides the mtime: a shard rewritten by `cp -p` or `rsync -a` keeps its old mtime, and tar's 512-byte
    blocks often keep its size (a .cls changed from 1 to 0), so both numbers would say the shard is the one cached."""
    stats = [os.stat(u) for u in urls]
    return [(os.path.abspath(u), st.st_size, max(st.st_mtime_ns, st.st_ctime_ns)) for u, st in zip(urls, stats)]


def shard_samples(urls: list[str]):
    """The samples of `urls`, in order, as WebDataset dicts ({"__key__", "__url__", "<ext>": bytes}), read by `webdataset`."""
    from webdataset.tariterators import tarfile_samples

    return tarfile_samples([{"url": u} for u in urls])


def sample_image(sample: dict[str, Any]) -> tuple[bytes, str] | None:
    """The image bytes of a WebDataset sample and its name (`shard:key.ext`), or None when it holds no image."""
    found = [ext for ext in SHARD_IMAGE_EXTENSIONS if ext in sample]
    if len(found) > 1:  # taking one would drop the other without a word
        key = f"{sample.get('__url__')}:{sample['__key__']}"
        raise DataError(f"sample {key} has two images ({', '.join('.' + e for e in found)}); write one image per sample")
    if not found:
        return None
    return sample[found[0]], f"{sample.get('__url__')}:{sample['__key__']}.{found[0]}"


def sample_label(sample: dict[str, Any]) -> int:
    raw = sample.get("cls")
    return parse_label(raw, f"{sample.get('__url__')}:{sample['__key__']}.cls") if raw is not None else UNLABELLED


def parse_label(raw: bytes, name: str) -> int:
    """The class index a `.cls` member holds as text; a DataError naming it when that is not an integer >= 0."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        label = int(text)
    except ValueError:
        label = UNLABELLED
    if label < 0:
        raise DataError(f"{name} holds {text[:20]!r}, not a class index (an integer >= 0)")
    if label > MAX_CLASS_INDEX:
        raise DataError(f"{name} holds the class index {text[:20]}, over the {MAX_CLASS_INDEX + 1:,} classes this reader takes: "
                        "number the classes from 0")  # fmt: skip
    return label


# --------------------------------------------------------------------------- the stream loader's epochs of shards


def deal(items: list[int], weights: list[int], bins: int) -> list[list[int]]:
    """`items` dealt to `bins` bins of about equal weight: the heaviest first (equal ones in their order), each to the bin
    holding the least weight so far (the lowest bin on a tie); each bin's items in their order in `items`. With positive
    weights and at least `bins` items, no bin is empty."""
    loads, dealt = [0] * bins, [[] for _ in range(bins)]
    for item in sorted(items, key=lambda i: -weights[i]):  # stable: equal weights keep the (seeded) order
        b = min(range(bins), key=lambda k: (loads[k], k))
        dealt[b].append(item)
        loads[b] += weights[item]
    rank = {item: n for n, item in enumerate(items)}
    return [sorted(d, key=rank.__getitem__) for d in dealt]


def apportion(total: int, weights: list[int]) -> list[int]:
    """`total` split in proportion to `weights` (largest remainders, ties to the lower index): sums to `total`; a weight
    of 0 gets 0."""
    whole = sum(weights)
    shares = [total * w // whole for w in weights]
    by_remainder = sorted((i for i, w in enumerate(weights) if w), key=lambda i: (-(total * weights[i] % whole), i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares


def round_robin(quotas: list[int]) -> list[int]:
    """The role that makes each batch when role w makes quotas[w] batches and the roles take turns in order, those done
    left out: what a DataLoader's iterator yields from IterableDataset workers whose iterators end at different lengths."""
    return [w for k in range(max(quotas, default=0)) for w, q in enumerate(quotas) if q > k]


@dataclass
class ShardPlan:
    """One rank's epoch of shards: the shards each worker role reads (`roles`), the batches each makes (`quotas`, in
    proportion to the training samples its shards hold) and which role makes each batch of the epoch (`schedule`)."""

    roles: list[list[int]]
    quotas: list[int]
    schedule: list[int]

    def batches_of(self, role: int) -> list[int]:
        """The rank's batch index of each batch `role` makes, in order."""
        return [b for b, r in enumerate(self.schedule) if r == role]


def shard_plan(samples: list[int], num_batches: int, seed: int, epoch: int, rank: int, world_size: int, workers: int) -> ShardPlan:
    """The shards (training samples per shard: `samples`) permuted by (seed, epoch), dealt to the ranks and then to the
    rank's worker roles by sample count; each role makes its share of the rank's `num_batches` batches. So each role
    reads its shards about once an epoch, whatever their sizes (equal quotas made the role given a small shard repeat it
    and the others leave samples out), and the ranks' shares differ by at most one shard."""
    order = torch.randperm(len(samples), generator=seeded_generator("shards", seed, epoch)).tolist()
    mine = deal(order, samples, world_size)[rank]
    roles = deal(mine, samples, workers)
    quotas = apportion(num_batches, [sum(samples[i] for i in role) for role in roles])
    return ShardPlan(roles, quotas, round_robin(quotas))
