"""Image preprocessing for the visual tokenizer: bytes in, an RGB uint8 array out.

Design choices:
- EXIF orientation is applied, so a phone photo is tokenized the way it is seen.
- RGBA / LA / palette-with-transparency are composited on white (transparent pixels have no
  colour of their own); greyscale, CMYK and 16-bit modes become 8-bit RGB.
- An embedded ICC profile other than sRGB (a camera's Adobe RGB, a phone's Display P3, a print
  CMYK or grey profile) is converted to sRGB by LittleCMS (Pillow's ImageCms), in every mode
  that carries one (palette, grey + alpha and 16-bit grey too): the model learns and draws
  colours in one space. A profile counts as sRGB by what it does, not by its description
  (``_to_srgb``).
  Without a profile, or with one that cannot be read, the pixels are taken as sRGB.
- The output keeps the aspect ratio, has sides that are multiples of the tokenizer's spatial
  factor, stays within a pixel budget and at most ``max_grid`` tokens per side: grids vary in
  shape, as the resolution-free layout allows. ``max_tokens`` also bounds the length of the
  image's block in the sequence (codes, row ends and markers), so a block fits a row of the
  training run: a larger image is made smaller, never dropped.
- JPEG is decoded at reduced scale (libjpeg DCT scaling, ``draft``) when the target is smaller,
  which is most of the decode time saved at no visible cost after the resize.
"""

from __future__ import annotations

import functools
import io
import math
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageCms, ImageOps, UnidentifiedImageError

from data.layout import image_block_len

SWAPS_SIDES = {5, 6, 7, 8}  # EXIF orientations that rotate by 90 degrees


def exif_orientation(image: Image.Image) -> int:
    """The EXIF orientation (1-8) a picture is shown with: 1 without one, or with a damaged one
    (the pixels are what is kept)."""
    try:
        orientation = image.getexif().get(0x0112, 1)
    except Exception:  # noqa: BLE001 - whatever a damaged EXIF block raises
        return 1
    return orientation if orientation in range(1, 9) else 1


@dataclass(frozen=True)
class ImagePrep:
    factor: int = 8  # spatial factor of the visual tokenizer
    max_pixels: int = 256 * 256
    max_grid: int = 64  # tokens per side at most
    upscale: bool = False  # enlarge images smaller than the budget
    max_tokens: int = 0  # longest block <boi> <h> <w> rows... <eoi> allowed (0: no bound)

    def target_size(self, w: int, h: int) -> tuple[int, int]:
        """(width, height): multiples of ``factor``, aspect kept, within the budget."""
        factor = self.factor
        scale = math.sqrt(self.max_pixels / (w * h))
        if not self.upscale:
            scale = min(scale, 1.0)
        cap = self.max_grid * factor
        scale = min(scale, cap / w, cap / h)  # the longer side within max_grid, the aspect kept
        target_w = min(cap, max(factor, round(w * scale / factor) * factor))
        target_h = min(cap, max(factor, round(h * scale / factor) * factor))
        while target_w * target_h > self.max_pixels and max(target_w, target_h) > factor:
            if target_w >= target_h:
                target_w -= factor
            else:
                target_h -= factor
        if self.max_tokens:
            # Smaller until the block fits, the side that is relatively larger first (aspect kept).
            while (
                image_block_len(target_h // factor, target_w // factor) > self.max_tokens
                and max(target_w, target_h) > factor
            ):
                if (target_w > factor and target_w * h >= target_h * w) or target_h == factor:
                    target_w -= factor
                else:
                    target_h -= factor
        return target_w, target_h


_ICC_SPACE = {"RGB": "RGB ", "CMYK": "CMYK", "L": "GRAY"}  # mode -> its profiles' colour space


def _probe(mode: str) -> Image.Image:
    """Colours of ``mode`` to compare a transform with: every level of each channel alone and of
    all channels together, and 4096 random colours (the same each time)."""
    bands = Image.getmodebands(mode)
    ramp = np.arange(256, dtype=np.uint8)[:, None]
    alone = [np.where(np.arange(bands) == band, ramp, 0).astype(np.uint8) for band in range(bands)]
    mixed = np.random.default_rng(0).integers(0, 256, (4096, bands), dtype=np.uint8)
    pixels = np.concatenate([*alone, np.repeat(ramp, bands, 1), mixed])
    return Image.frombytes(mode, (len(pixels), 1), pixels.tobytes())


@functools.lru_cache(maxsize=32)
def _to_srgb(icc: bytes, mode: str) -> ImageCms.ImageCmsTransform | None:
    """The transform of ``mode`` pixels under the ICC profile ``icc`` into sRGB; None where there
    is nothing to do (a profile of another colour space than the mode's, or one that is sRGB
    already) or the profile cannot be used (the pixels are then taken as sRGB, as without one).
    A profile is sRGB when its transform moves no colour of ``_probe`` more than one level from
    where it stands without a profile: the test Skia makes (skcms_ApproximatelyEqualProfiles),
    whatever the profile's description says."""
    try:
        profile = ImageCms.ImageCmsProfile(io.BytesIO(icc))
        if profile.profile.xcolor_space != _ICC_SPACE.get(mode):
            return None
        srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB"))
        transform = ImageCms.buildTransform(profile, srgb, mode, "RGB")
        probe = _probe(mode)
        moved = np.asarray(transform.apply(probe), np.int16) - np.asarray(probe.convert("RGB"))
    except (OSError, ImageCms.PyCMSError):
        return None
    return transform if np.abs(moved).max() > 1 else None


def to_rgb(image: Image.Image) -> Image.Image:
    icc = image.info.get("icc_profile")
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):  # 8-bit grey, which its profile converts
        pixels = np.asarray(image, dtype=np.float32)
        if image.mode in ("F", "I"):
            # Levels kept by the range the values say they use (floats in [0, 1], the usual
            # convention for depth maps and scientific TIFFs; 8 or 16 bits in a 32-bit
            # container), not stretched per image: a flat grey would come out black or white.
            pixels = np.nan_to_num(pixels, nan=0.0, posinf=0.0, neginf=0.0)
            low, high = float(pixels.min()), float(pixels.max())
            if low >= 0 and high <= 1:  # floats in [0, 1], or a 0/1 mask
                pixels = pixels * 255.0
            elif low < 0 or high > 65535:  # a range of its own: spread over 8 bits
                pixels = (pixels - low) / max(1e-12, high - low) * 255.0
            elif high > 255:
                pixels = pixels / 257.0
        else:
            pixels = pixels / 257.0
        image = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
    if icc and image.mode in ("P", "PA"):  # a palette's colours are in the profile's space
        alpha = image.mode == "PA" or "transparency" in image.info
        image = image.convert("RGBA" if alpha else "RGB")
    # The alpha is set aside and put back: Pillow's LittleCMS transforms of LA lose the grey.
    colour = {"RGBA": "RGB", "LA": "L"}.get(image.mode, image.mode)
    transform = _to_srgb(icc, colour) if icc else None
    if transform is not None:
        converted = transform.apply(image if colour == image.mode else image.convert(colour))
        if colour != image.mode:
            converted.putalpha(image.getchannel("A"))
        image = converted
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


@contextmanager
def warnings_naming(name: str | None) -> Iterator[None]:
    """Pillow's warnings ("Corrupt EXIF data", "Truncated File Read") name no file: those raised
    inside this block are issued again with ``name`` in front, so the user can find the file."""
    if not name:
        yield
        return
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:  # an image that then fails to decode still has its warnings named
        for got in caught:
            warnings.warn_explicit(f"{name}: {got.message}", got.category, got.filename, got.lineno)


def bomb_detail(err: Exception, limit: int | None) -> str:
    """Pillow's DecompressionBombError states Pillow's own threshold (about 179 M pixels), not the
    limit the caller set (``--max-image-pixels``): the pixels the header claims and ``limit``
    when the image is over it. One under it (a limit set above Pillow's) is still refused by
    Pillow, here and at every later decode: the detail says so, and what to do."""
    claimed = re.search(r"\((\d+) pixels\)", str(err))
    if claimed is None:
        return f"DecompressionBombError: {err}"
    if limit is None or int(claimed.group(1)) <= limit:
        return (
            f"header claims {claimed.group(1)} pixels, over Pillow's own limit of "
            f"{2 * (Image.MAX_IMAGE_PIXELS or 0)} that no setting here raises (not decoded): "
            "downscale the image first"
        )
    return f"header claims {claimed.group(1)} pixels > limit {limit} (not decoded)"


def describe_member(raw_doc, member: str) -> str:
    """``SHARD:KEY.MEMBER (from ORIGINAL_PATH)``: where a raw document's media member is."""
    origin = raw_doc.doc.get("origin", {}).get("path")
    return f"{raw_doc.shard}:{raw_doc.key}.{member}" + (f" (from {origin})" if origin else "")


def load_image(
    raw: bytes,
    prep: ImagePrep,
    *,
    max_source_pixels: int | None = None,
    name: str | None = None,
) -> np.ndarray:
    """Decode, orient, convert and resize; returns uint8 [H, W, 3] with H, W multiples of factor.
    ``max_source_pixels``: an image whose header claims more is a ValueError before any pixel is
    decoded (for untrusted inputs; ingest's ``--max-image-pixels`` did it for shards). ``name``:
    the file or member the bytes are, put in front of any warning the decoder raises."""
    with warnings_naming(name):
        return _load_image(raw, prep, max_source_pixels)


def _load_image(raw: bytes, prep: ImagePrep, max_source_pixels: int | None) -> np.ndarray:
    with warnings.catch_warnings():
        # With our own cap, Pillow's warning between 89 M and 179 M pixels is noise; above 179 M
        # it raises DecompressionBombError (not an OSError): a ValueError here like the others.
        if max_source_pixels is not None:
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image: Image.Image = Image.open(io.BytesIO(raw))
        except Image.DecompressionBombError as e:
            raise ValueError(bomb_detail(e, max_source_pixels)) from None
        except UnidentifiedImageError:  # Pillow's message names an io.BytesIO object, not the file
            raise ValueError(
                f"not an image Pillow reads ({len(raw)} bytes starting {raw[:12]!r}: a video, "
                "another kind of file or a damaged one?)"
            ) from None
    width, height = image.size
    if max_source_pixels is not None and width * height > max_source_pixels:
        raise ValueError(
            f"header claims {width}x{height} = {width * height} pixels > limit "
            f"{max_source_pixels} (not decoded)"
        )
    if image.format != "JPEG":  # a JPEG is drafted at its target size before it is decoded
        # Pillow turns a TIFF by its orientation as it decodes it, and drops the tag: its size
        # and orientation are read after, so a turned picture is not turned again
        image.load()
        width, height = image.size
    orientation = exif_orientation(image)
    if orientation in SWAPS_SIDES:
        width, height = height, width
    target_w, target_h = prep.target_size(width, height)
    if image.format == "JPEG":
        image.draft(
            "RGB", (target_w, target_h) if orientation not in SWAPS_SIDES else (target_h, target_w)
        )
    image = ImageOps.exif_transpose(image)
    image = to_rgb(image)
    if image.size != (target_w, target_h):
        image = image.resize((target_w, target_h), Image.Resampling.BICUBIC, reducing_gap=3.0)
    return np.asarray(image, dtype=np.uint8)
