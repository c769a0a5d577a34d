"""Small helpers shared by the demo-corpus parts: seeding, deterministic writers, package paths.

Every file of the corpus must be byte-identical for the same seed, so all writing goes
through these few functions (fixed JSON key order, "\n" line ends, PNG without metadata).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import zlib
from collections.abc import Iterable

import numpy as np
from PIL import Image


def rng_for(seed: int, part: str, index: int = 0) -> np.random.Generator:
    """A generator per (seed, part, item): item i is the same whatever the scale, so a
    small corpus is a prefix of a large one and parts never disturb each other's draws."""
    # crc32 rather than hash(): str hashes are salted per process.
    return np.random.default_rng([seed, zlib.crc32(part.encode()), index])


SPLITS = ("all", "train", "heldout")
HELDOUT_ONE_IN = 5  # about one item of real material in five goes to the held-out split


def in_split(group: str, split: str) -> bool:
    """Whether real material of this group (a file name, a top-level package, a digit's index)
    belongs to ``split``. ``train`` and ``heldout`` are disjoint and together make ``all``; the
    choice is a fixed hash of the group, so it is the same on every machine and at every scale,
    and the generated parts never decide it."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if split == "all":
        return True
    held = zlib.crc32(f"heldout:{group}".encode()) % HELDOUT_ONE_IN == 0
    return held if split == "heldout" else not held


def package_dir(name: str) -> pathlib.Path | None:
    """Folder of an installed package *without importing it* (skimage/sklearn imports cost
    seconds on a 2-core machine; we only need the data files they ship)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def write_jsonl(path: pathlib.Path, rows: Iterable[dict]) -> int:
    """One JSON object per line, UTF-8, key order as built; returns bytes written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    path.write_bytes(data)
    return len(data)


def write_text(path: pathlib.Path, text: str) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode("utf-8")
    path.write_bytes(data)
    return len(data)


def write_png(path: pathlib.Path, image: np.ndarray) -> int:
    """PIL's PNG writer is deterministic as long as no metadata (time, text chunks) is added."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path, format="PNG", optimize=False)
    return path.stat().st_size


def scaled(n: int, scale: float, minimum: int = 1) -> int:
    """Item count of a part at a given scale (never below `minimum`, so every part exists)."""
    return max(minimum, int(round(n * scale)))
