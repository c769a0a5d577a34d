"""Image preprocessing: orientation, colour modes, grid-multiple sizes within a budget."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageCms

from data.image_prep import ImagePrep, load_image


def encode(im: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("w,h", [(640, 480), (300, 1000), (17, 9), (4000, 100), (64, 64)])
def test_target_sizes_are_grid_multiples_within_budget_keeping_aspect(w, h):
    p = ImagePrep(factor=16, max_pixels=256 * 256, max_grid=32)
    tw, th = p.target_size(w, h)
    assert tw % 16 == 0 and th % 16 == 0 and tw * th <= 256 * 256
    assert tw <= 32 * 16 and th <= 32 * 16
    if min(w, h) >= 64 and max(w, h) / min(w, h) < 8:
        assert abs(tw / th - w / h) / (w / h) < 0.2


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "TIFF"])
def test_exif_rotation_is_applied(fmt):
    """Once: Pillow turns a TIFF itself as it decodes it (it was turned twice, and squashed)."""
    im = Image.new("RGB", (40, 20), (255, 0, 0))
    im.paste((0, 0, 255), (0, 0, 20, 20))  # left half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW when displayed
    quality = {"quality": 95} if fmt in ("JPEG", "WEBP") else {}
    a = load_image(encode(im, fmt, exif=exif, **quality), ImagePrep(factor=4, max_pixels=10**6))
    assert a.shape == (40, 20, 3)  # portrait after orientation
    assert a[2, 10, 2] > 200 and a[-3, 10, 0] > 200  # blue on top, red at the bottom


def test_modes_become_rgb():
    prep = ImagePrep(factor=4, max_pixels=10**6)
    rgba = Image.new("RGBA", (8, 8), (255, 0, 0, 0))  # fully transparent
    assert load_image(encode(rgba), prep)[0, 0].tolist() == [255, 255, 255]
    grey = Image.new("L", (8, 8), 100)
    assert load_image(encode(grey), prep)[0, 0].tolist() == [100, 100, 100]
    pal = Image.new("P", (8, 8), 3)
    pal.putpalette([0, 0, 0, 10, 20, 30, 40, 50, 60, 70, 80, 90] + [0] * 756)
    assert load_image(encode(pal), prep)[0, 0].tolist() == [70, 80, 90]
    deep = Image.fromarray(np.full((8, 8), 65535, dtype=np.uint16))
    assert load_image(encode(deep), prep)[0, 0].tolist() == [255, 255, 255]
    cmyk = Image.new("CMYK", (8, 8), (0, 0, 0, 0))
    assert load_image(encode(cmyk, "JPEG"), prep)[0, 0].min() > 240


def _photo(name: str) -> bytes:
    """A photo that scikit-image ships (a demo dependency), with its embedded ICC profile."""
    import skimage

    return (Path(skimage.__file__).parent / "data" / name).read_bytes()


def _srgb_curve(linear: np.ndarray) -> np.ndarray:
    """sRGB's transfer curve (IEC 61966-2-1), linear light in [0, 1] to levels 0..255."""
    return np.where(linear <= 0.0031308, 12.92 * linear, 1.055 * linear ** (1 / 2.4) - 0.055) * 255


def _rocket(variant: str) -> bytes:
    """rocket.jpg as shipped, its profile's description made to say "sRGB" (same length, the
    profile sits uncompressed in the JPEG's APP2), or its pixels in a palette PNG (mode P)
    carrying the same profile."""
    raw = _photo("rocket.jpg")
    if variant == "described as sRGB":
        assert raw.count(b"Adobe RGB (1998)") == 1
        return raw.replace(b"Adobe RGB (1998)", b"sRGB-like (1998)")
    if variant == "palette png":
        photo = Image.open(io.BytesIO(raw))
        return encode(photo.quantize(256), icc_profile=photo.info["icc_profile"])
    return raw


@pytest.mark.parametrize("variant", ["jpeg", "described as sRGB", "palette png"])
def test_an_adobe_rgb_photo_is_converted_to_srgb(variant):
    """rocket.jpg carries an Adobe RGB (1998) profile: converted whatever its description says
    and in a palette image too. The expected colours come from the standard's own numbers, not
    from LittleCMS: gamma 563/256, Adobe RGB -> XYZ (D65) -> linear sRGB, clipped, sRGB's
    transfer curve."""
    raw = _rocket(variant)
    prep = ImagePrep(factor=8, max_pixels=10**7, max_grid=256)
    got = load_image(raw, prep).reshape(-1, 3).mean(0)
    pixels = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"), np.float64) / 255
    to_xyz = np.array(
        [[0.57667, 0.18556, 0.18823], [0.29734, 0.62736, 0.07529], [0.02703, 0.07069, 0.99134]]
    )
    to_srgb = np.array(
        [[3.24045, -1.53714, -0.49853], [-0.96927, 1.87601, 0.04156], [0.05564, -0.20403, 1.05723]]
    )
    linear = np.clip(pixels ** (563 / 256) @ (to_srgb @ to_xyz).T, 0, 1)
    want = _srgb_curve(linear).reshape(-1, 3).mean(0)
    assert np.abs(got - want).max() < 1.0, (got, want)
    as_srgb = pixels.reshape(-1, 3).mean(0) * 255  # the profile ignored: red off by ~11 levels
    assert np.abs(as_srgb - want).max() > 5


@pytest.mark.parametrize("variant", ["grey + alpha", "16-bit grey"])
def test_a_grey_photo_is_converted_by_its_grey_profile_in_every_mode(variant):
    """page.png carries a grey "Dot Gain 20%" profile; as grey + alpha (LA) or 16-bit grey
    (I;16) its grey is converted as well. Expected from the profile's own grey curve (kTRC: grey
    level -> luminance Y, read here from the bytes), a neutral grey in sRGB by its transfer
    curve; transparent pixels white."""
    page = Image.open(io.BytesIO(_photo("page.png")))
    icc = page.info["icc_profile"]
    grey = page.crop((0, 0, 384, 184))  # a size the prep keeps: pixel against pixel
    levels = np.asarray(grey)
    alpha = Image.new("L", grey.size, 255)
    if variant == "grey + alpha":
        alpha.paste(0, (0, 0, 64, 184))
        image = Image.merge("LA", (grey, alpha))
    else:  # 257 per 8-bit level, plus a little that the 8-bit level drops
        deep = levels.astype(np.uint32) * 257 + np.where(levels < 255, 100, 0)
        image = Image.fromarray(deep.astype(np.uint16))
        assert image.mode.startswith("I;16")
    raw = encode(image, icc_profile=icc)
    got = load_image(raw, ImagePrep(factor=8, max_pixels=10**7, max_grid=256)).astype(np.float64)
    tags = {
        sig: icc[offset : offset + size]
        for sig, offset, size in (
            struct.unpack(">4sII", icc[132 + 12 * i : 144 + 12 * i])
            for i in range(struct.unpack(">I", icc[128:132])[0])
        )
    }
    curv = tags[b"kTRC"]
    count = struct.unpack(">I", curv[8:12])[0]
    table = np.array(struct.unpack(f">{count}H", curv[12 : 12 + 2 * count])) / 65535
    luminance = np.interp(np.arange(256) / 255, np.linspace(0, 1, count), table)
    want = np.where(np.asarray(alpha) == 255, _srgb_curve(luminance)[levels], 255)
    assert np.abs(got - want[..., None]).max() < 1.5
    assert np.abs(levels - want).max() > 20  # the profile ignored


def test_srgb_and_unreadable_profiles_leave_the_pixels_as_they_are():
    """sRGB is told by what the profile does, not by its description: the IEC profile described
    otherwise and LittleCMS's own sRGB change nothing."""
    prep = ImagePrep(factor=8, max_pixels=10**7, max_grid=256)
    astronaut = Image.open(io.BytesIO(_photo("astronaut.png")))  # sRGB IEC61966-2.1
    plain = load_image(encode(astronaut.convert("RGB"), icc_profile=None), prep)
    np.testing.assert_array_equal(load_image(_photo("astronaut.png"), prep), plain)
    icc = astronaut.info["icc_profile"]
    renamed = icc.replace(b"sRGB IEC61966-2.1", b"IEC61966-2.1 Dflt")
    builtin = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    for profile in (renamed, builtin, b"not an ICC profile"):
        got = load_image(encode(astronaut.convert("RGB"), icc_profile=profile), prep)
        np.testing.assert_array_equal(got, plain)


def test_large_jpeg_is_reduced_to_the_budget():
    rng = np.random.default_rng(0)
    im = Image.fromarray(rng.integers(0, 255, (600, 800, 3), dtype=np.uint8))
    a = load_image(encode(im, "JPEG"), ImagePrep(factor=8, max_pixels=128 * 96))
    assert a.shape == (96, 128, 3) and a.dtype == np.uint8


def test_bytes_that_are_no_image_are_a_value_error_that_says_so(tiny_corpus):
    """A video or any other file given where an image is expected (earlyfuse-generate --image
    clip.mp4): a ValueError saying what the bytes are not, never Pillow's message, which names
    an io.BytesIO object at a memory address instead of anything the user gave."""
    clip = next((tiny_corpus / "clips").glob("*.mp4")).read_bytes()
    for raw in (clip, b"plain text, not a picture"):
        with pytest.raises(ValueError, match="not an image Pillow reads") as refused:
            load_image(raw, ImagePrep(factor=4, max_pixels=1024))
        assert f"{len(raw)} bytes starting {raw[:12]!r}" in str(refused.value)
        assert "BytesIO" not in str(refused.value)


@pytest.mark.parametrize(
    "values, mode, want",
    [
        ([0.5, 0.5], "F", 127),  # a float image in [0, 1]: its level (0.5 x 255), not black
        ([0.5, float("nan")], "F", 127),  # a NaN pixel is black, the others keep their level
        ([100, 100], "I", 100),  # 8-bit values in a 32-bit container
        ([25700, 25700], "I", 100),  # 16-bit values
        ([-5, 200], "I", 255),  # a range of its own: spread over 8 bits
    ],
)
def test_float_and_32_bit_images_keep_their_levels(values, mode, want):
    from PIL import Image

    from data.image_prep import to_rgb

    pixels = np.array([values] * 2, dtype=np.float32 if mode == "F" else np.int32)
    rgb = np.asarray(to_rgb(Image.fromarray(pixels, mode)))
    assert rgb.shape == (2, 2, 3) and int(rgb[0, 0, 0]) in (want, 0) and int(rgb.max()) == want
