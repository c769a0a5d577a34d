"""Image crops for training the visual tokenizer, from raw shard folders.

Design choices:
- A pool of preprocessed images (``ImagePrep``: EXIF, RGB, resized into a pixel budget) and,
  optionally, frames sampled from videos, decoded once and kept in memory: the visual
  tokenizer's corpus at the scales we train it on CPU fits, and crops are then free.
- Held out by *document*: a document whose key hashes below ``heldout_fraction`` never gives
  a training crop, so held-out PSNR measures images the tokenizer has not seen.
- Batch k of rank r is a pure function of (seed, rank, k): the stream's state is one counter,
  and a resumed run sees exactly the crops an uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from data.image_prep import ImagePrep, describe_member, load_image
from data.shards.reader import iter_shard, shard_entries
from data.video_frames import VideoSampling, decode_frames


def heldout(key: str, fraction: float) -> bool:
    hash_fraction = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    return hash_fraction < fraction


MIN_HELDOUT_DOCS = 5  # fewer held-out documents than this: the eval/ figures are warned about


@dataclass
class ImagePool:
    train: list[np.ndarray]
    heldout: list[np.ndarray]
    skipped: int  # images smaller than a crop, or undecodable
    # source -> {"small": count, "unreadable": count, "examples": ["key (WxH)", ...]}
    skipped_by_source: dict[str, dict] = field(default_factory=dict)
    heldout_docs: int = 0  # documents whose images or frames are in ``heldout``
    # source -> images (and videos, when their frames are used) never read because the pool was
    # full (``limit``): counted from the manifest's per-shard segment counts, not read
    not_read: dict[str, int] = field(default_factory=dict)

    def describe_not_read(self, limit: int) -> str:
        """A warning naming what a full pool left unread ("" when every document was read)."""
        if not self.not_read:
            return ""
        counts = ", ".join(f"{source} {count:,}" for source, count in sorted(self.not_read.items()))
        return (
            f"vtok_data.cache_images {limit:,} reached: {sum(self.not_read.values()):,} "
            f"image(s) or video(s) were not read ({counts}); the pool holds the first "
            "images in shard order. Raise vtok_data.cache_images (each image is kept decoded, up "
            "to 3 x vtok_data.max_pixels bytes), or choose sources with vtok_data.sources"
        )

    def describe_heldout(self, fraction: float) -> str:
        """A warning when the held-out figures rest on no document or on a few ("" otherwise):
        with none, the evaluation falls back to training crops, which the tokenizer has seen."""
        if self.heldout_docs >= MIN_HELDOUT_DOCS:
            return ""
        what = (
            "the eval/ figures and the comparison with the baselines are measured on training "
            "crops, which the tokenizer has seen"
            if not self.heldout
            else f"the eval/ figures rest on their {len(self.heldout)} image(s) or frame(s) alone"
        )
        return (
            f"{self.heldout_docs} document(s) held out (vtok_data.heldout_fraction {fraction:g}, "
            f"fewer than {MIN_HELDOUT_DOCS}): {what}. Raise vtok_data.heldout_fraction or train "
            "on more images"
        )

    def describe_skipped(self, crop: int) -> str:
        """What was skipped, where, and what to do about it ("" when nothing was)."""
        if not self.skipped:
            return ""
        parts = []
        for source, got in sorted(self.skipped_by_source.items()):
            counts = ", ".join(
                f"{got[reason]} {reason}" for reason in ("small", "unreadable") if got[reason]
            )
            parts.append(f"{source}: {counts} (e.g. {', '.join(got['examples'])})")
        return (
            f"{self.skipped} image(s) or frame(s) skipped, smaller than the {crop}x{crop} crop after "
            f"resizing into vtok_data.max_pixels, or unreadable: {'; '.join(parts)}. To train on "
            "small ones, lower vtok_data.crop (a multiple of vtok.factor); to leave a source out, "
            "name the others in vtok_data.sources"
        )


def load_pool(
    raw_dirs: list[str],
    *,
    sources: list[str] | None,
    prep: ImagePrep,
    crop: int,
    heldout_fraction: float,
    video_frames: bool,
    limit: int,
) -> ImagePool:
    train: list[np.ndarray] = []
    held: list[np.ndarray] = []
    skipped = held_docs = 0
    by_source: dict[str, dict] = {}
    not_read: dict[str, int] = {}

    def skip(raw_doc, reason: str, what: str) -> None:
        nonlocal skipped
        skipped += 1
        source = Path(raw_doc.shard).parent.name  # shards/NAME/shard-N.tar
        got = by_source.setdefault(source, {"small": 0, "unreadable": 0, "examples": []})
        got[reason] += 1
        if len(got["examples"]) < 3:
            got["examples"].append(f"{raw_doc.key} ({what})")

    sampling = VideoSampling(target_fps=2.0, max_frames=4)
    kinds = ("image", "video") if video_frames else ("image",)

    def full() -> bool:
        return len(train) + len(held) >= limit

    def count_unread(source: str, segments: dict) -> None:
        unread = sum(segments.get(kind, 0) for kind in kinds)
        if unread:
            not_read[source] = not_read.get(source, 0) + unread

    def load_doc(raw_doc) -> None:
        """Its images (and video frames) into the training or held-out pool."""
        nonlocal held_docs
        target = held if heldout(raw_doc.key, heldout_fraction) else train
        held_before = len(held)
        for seg in raw_doc.doc["segments"]:
            try:
                if seg["type"] == "image":
                    member = seg["member"]
                    name = describe_member(raw_doc, member)
                    arrays = [load_image(raw_doc.member(member), prep, name=name)]
                elif seg["type"] == "video" and video_frames:
                    arrays = list(
                        decode_frames(
                            raw_doc.member(seg["member"]),
                            sampling,
                            prep,
                            size=(seg["width"], seg["height"]),
                        ).frames
                    )
                else:
                    continue
            except (OSError, ValueError) as e:
                skip(raw_doc, "unreadable", str(e)[:80])
                continue
            for array in arrays:
                if array.shape[0] >= crop and array.shape[1] >= crop:
                    target.append(array)
                else:
                    skip(raw_doc, "small", f"{array.shape[1]}x{array.shape[0]}")
        held_docs += len(held) > held_before

    for raw_dir in raw_dirs:
        for tar, index, entry in shard_entries(raw_dir, sources or None):
            if not sources and entry["source"].startswith("val/"):
                continue  # ingest's held-out split (--val-fraction): the LM is measured on it
            if full():  # the rest is counted from the manifest, never read
                count_unread(entry["source"], entry.get("segments", {}))
                continue
            for raw_doc in iter_shard(tar, index):
                if full():  # the rest of this shard
                    segments = Counter(seg["type"] for seg in raw_doc.doc["segments"])
                    count_unread(entry["source"], segments)
                else:
                    load_doc(raw_doc)
    if not train:
        raise ValueError(
            f"no training image of at least {crop}x{crop} in {raw_dirs} (sources {sources or 'all'})"
            + (f"; {skipped} skipped: {by_source}" if skipped else "")
        )
    return ImagePool(train, held, skipped, by_source, held_docs, not_read)


def to_tensor(batch: np.ndarray) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float [B, 3, H, W] in [-1, 1]."""
    return torch.from_numpy(batch).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


class CropStream:
    """Random crops (with horizontal flips) of the training pool, ``batch`` at a time."""

    def __init__(
        self, images: list[np.ndarray], *, crop: int, batch: int, seed: int, rank: int
    ) -> None:
        self.images, self.crop, self.batch, self.seed, self.rank = images, crop, batch, seed, rank
        self.k = 0

    def __iter__(self):
        while True:
            batch = self.batch_at(self.k)
            self.k += 1  # before yielding: the state is always "the next batch to make"
            yield batch

    def batch_at(self, k: int) -> dict:
        rng = np.random.default_rng([self.seed, self.rank, k])
        size = self.crop
        out = np.empty((self.batch, size, size, 3), dtype=np.uint8)
        for slot, image_index in enumerate(rng.integers(0, len(self.images), self.batch)):
            image = self.images[image_index]
            top = rng.integers(0, image.shape[0] - size + 1)
            left = rng.integers(0, image.shape[1] - size + 1)
            patch = image[top : top + size, left : left + size]
            out[slot] = patch[:, ::-1] if rng.random() < 0.5 else patch
        return {"images": to_tensor(out)}

    def state_dict(self) -> dict:
        return {"k": self.k}

    def load_state_dict(self, state: dict) -> None:
        self.k = int(state["k"])


def fixed_crops(images: list[np.ndarray], crop: int, count: int, seed: int = 1234) -> torch.Tensor:
    """``count`` crops of the held-out images, spread over them, the same every time."""
    if not images:
        return torch.empty(0, 3, crop, crop)
    rng = np.random.default_rng(seed)
    out = []
    for index in range(count):
        image = images[index % len(images)]
        top = rng.integers(0, image.shape[0] - crop + 1)
        left = rng.integers(0, image.shape[1] - crop + 1)
        out.append(image[top : top + crop, left : left + crop])
    return to_tensor(np.stack(out))
