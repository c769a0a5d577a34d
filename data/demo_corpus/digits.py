"""Digits part: scikit-learn's handwritten digits as 32x32 PNGs with labels as captions.

Read straight from the csv.gz that scikit-learn bundles (what `load_digits` reads), so no
download and no import of sklearn (seconds on a small machine). Each row is 64 pixel
values in 0..16 (16 = ink) followed by the label.
"""

from __future__ import annotations

import csv
import gzip
import io
import pathlib

import numpy as np
from PIL import Image
from tqdm import tqdm

from ._common import in_split, package_dir, rng_for, write_png, write_text

SIZE = 32
TARGET = 300


def load_digits_raw() -> tuple[np.ndarray, np.ndarray]:
    root = package_dir("sklearn")
    if root is None:
        raise RuntimeError("scikit-learn is not installed: pip install 'earlyfuse[demo]'")
    with gzip.open(root / "datasets" / "data" / "digits.csv.gz", "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)


def render(pixels: np.ndarray) -> np.ndarray:
    """8x8 ink levels -> 32x32 greyscale, dark ink on white paper (how the digits were written)."""
    grey = (255 - pixels * (255 / 16)).round().clip(0, 255).astype(np.uint8)
    # Bilinear rather than nearest: smooth strokes look more like handwriting than 4x4 blocks.
    return np.asarray(Image.fromarray(grey).resize((SIZE, SIZE), Image.Resampling.BILINEAR))


def build_digits(
    out: pathlib.Path, *, seed: int, count: int, progress: bool, split: str = "all"
) -> dict:
    images, labels = load_digits_raw()
    rng = rng_for(seed, "digits")
    pool = [i for i in range(len(labels)) if in_split(f"digit:{i}", split)]
    picked = sorted(
        pool[j] for j in rng.choice(len(pool), size=min(count, len(pool)), replace=False).tolist()
    )
    folder = out / "digits"
    total = 0
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["image", "caption", "label"])
    for n, i in enumerate(
        tqdm(picked, desc="digits", unit="img", disable=not progress, leave=False)
    ):
        rel = f"img/digit_{n:04d}.png"
        total += write_png(folder / rel, render(images[i]))
        writer.writerow([rel, f"a handwritten digit {labels[i]}", int(labels[i])])
    total += write_text(folder / "digits.csv", buf.getvalue())
    return {"images": len(picked), "bytes": total}
