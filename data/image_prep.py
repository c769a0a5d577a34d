"""Image preprocessing for the visual tokenizer: bytes in, an RGB uint8 array out.

Design choices:
- EXIF orientation is applied, so a phone photo is tokenized the way it is seen.
- RGBA / LA / palette-with-transparency are composited on white (transparent pixels have no
  colour of their own); greyscale, CMYK and 16-bit modes become 8-bit RGB.
- The output keeps the aspect ratio, has sides that are multiples of the tokenizer's spatial
  factor, stays within a pixel budget and at most ``max_grid`` tokens per side: grids vary in
  shape, as the resolution-free layout allows. ``max_tokens`` also bounds the length of the
  image's block in the sequence (codes, row ends and markers), so a block fits a row of the
  training run: a larger image is made smaller, never dropped.
- JPEG is decoded at reduced scale (libjpeg DCT scaling, ``draft``) when the target is smaller,
  which is most of the decode time saved at no visible cost after the resize.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from data.layout import image_block_len

_SWAPS_SIDES = {5, 6, 7, 8}  # EXIF orientations that rotate by 90 degrees


@dataclass(frozen=True)
class ImagePrep:
    factor: int = 8  # spatial factor of the visual tokenizer
    max_pixels: int = 256 * 256
    max_grid: int = 64  # tokens per side at most
    upscale: bool = False  # enlarge images smaller than the budget
    max_tokens: int = 0  # longest block <boi> <h> <w> rows... <eoi> allowed (0: no bound)

    def target_size(self, w: int, h: int) -> tuple[int, int]:
        """(width, height): multiples of ``factor``, aspect kept, within the budget."""
        f = self.factor
        s = math.sqrt(self.max_pixels / (w * h))
        if not self.upscale:
            s = min(s, 1.0)
        cap = self.max_grid * f
        s = min(s, cap / w, cap / h)  # the longer side within max_grid, the aspect kept
        tw = min(cap, max(f, round(w * s / f) * f))
        th = min(cap, max(f, round(h * s / f) * f))
        while tw * th > self.max_pixels and max(tw, th) > f:
            if tw >= th:
                tw -= f
            else:
                th -= f
        if self.max_tokens:
            # Smaller until the block fits, the side that is relatively larger first (aspect kept).
            while image_block_len(th // f, tw // f) > self.max_tokens and max(tw, th) > f:
                if (tw > f and tw * h >= th * w) or th == f:
                    tw -= f
                else:
                    th -= f
        return tw, th


def to_rgb(im: Image.Image) -> Image.Image:
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "LA", "PA"):
        rgba = im.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, rgba).convert("RGB")
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):
        a = np.asarray(im, dtype=np.float32)
        a = a / max(1.0, float(a.max())) * 255.0 if im.mode == "I" else a / 257.0
        return Image.fromarray(a.clip(0, 255).astype(np.uint8)).convert("RGB")
    if im.mode == "F":
        a = np.asarray(im, dtype=np.float32)
        a = (a - a.min()) / max(1e-12, float(a.max() - a.min())) * 255.0
        return Image.fromarray(a.astype(np.uint8)).convert("RGB")
    return im if im.mode == "RGB" else im.convert("RGB")


def load_image(raw: bytes, prep: ImagePrep, *, max_source_pixels: int | None = None) -> np.ndarray:
    """Decode, orient, convert and resize; returns uint8 [H, W, 3] with H, W multiples of factor.
    ``max_source_pixels``: an image whose header claims more is a ValueError before any pixel is
    decoded (for untrusted inputs; ingest's ``--max-image-pixels`` did it for shards)."""
    with warnings.catch_warnings():
        # With our own cap, Pillow's warning between 89 M and 179 M pixels is noise; above 179 M
        # it raises DecompressionBombError (not an OSError): a ValueError here like the others.
        if max_source_pixels is not None:
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            im: Image.Image = Image.open(io.BytesIO(raw))
        except Image.DecompressionBombError as e:
            raise ValueError(f"DecompressionBombError: {e}") from None
    w, h = im.size
    if max_source_pixels is not None and w * h > max_source_pixels:
        raise ValueError(
            f"header claims {w}x{h} = {w * h} pixels > limit {max_source_pixels} (not decoded)"
        )
    orientation = im.getexif().get(0x0112, 1)
    if orientation in _SWAPS_SIDES:
        w, h = h, w
    tw, th = prep.target_size(w, h)
    if im.format == "JPEG":
        im.draft("RGB", (tw, th) if orientation not in _SWAPS_SIDES else (th, tw))
    im = ImageOps.exif_transpose(im)
    im = to_rgb(im)
    if im.size != (tw, th):
        im = im.resize((tw, th), Image.Resampling.BICUBIC, reducing_gap=3.0)
    return np.asarray(im, dtype=np.uint8)
