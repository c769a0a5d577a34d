"""Clips whose pixels are not square (a DVD's 32:27, an HDV camera's 4:3) are shown, probed and
tokenized at their display shape: decord gives the stored pixels, the container says their
shape (data/video_colour.py ``pixel_shape``). They were squashed to the stored shape."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np
import pytest
from factories import rotated_mp4

from data.image_prep import ImagePrep
from data.media import probe_video
from data.video_colour import pixel_shape
from data.video_frames import VideoSampling, decode_frames

av = pytest.importorskip("av")  # the [demo] extra makes the clips

W, H = 64, 48


def clip(fmt: str, codec: str, sar: Fraction) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=25)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        stream.codec_context.sample_aspect_ratio = sar
        for i in range(10):
            frame = np.full((H, W, 3), i * 20, np.uint8)
            frame[:, : W // 2] = 255  # the left half white: where the picture's middle is
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize(
    "fmt, codec, sar",
    [
        ("mp4", "libx264", Fraction(2, 1)),  # the pasp box
        ("mov", "mpeg4", Fraction(32, 27)),
        ("mpeg", "mpeg2video", Fraction(4, 3)),  # a DVD's program stream: 16:9 in the header
        ("mp4", "libx264", Fraction(1, 1)),
    ],
)
def test_a_clip_is_probed_and_decoded_at_its_display_shape(fmt, codec, sar):
    raw = clip(fmt, codec, sar)
    assert pixel_shape(raw)[0] == pytest.approx(float(sar))
    info = probe_video(raw, "clip", max_seconds=60)
    assert (info.width, info.height) == (round(W * sar), H)
    prep = ImagePrep(factor=4, max_pixels=1 << 16, max_grid=64)
    frames = decode_frames(raw, VideoSampling(target_fps=25, max_frames=2), prep).frames
    # resized within the budget to the display shape, the white half still half of the width
    assert frames.shape[1:3] == tuple(reversed(prep.target_size(info.width, info.height)))
    white = (frames[0].mean(axis=(0, 2)) > 200).mean()
    assert white == pytest.approx(0.5, abs=0.1)


def test_a_clip_turned_a_quarter_is_stretched_upright():
    """A phone's display matrix turns the frames (decord applies it): stored 64x48 with pixels
    twice as wide as high, shown 48x64 turned, its pixels now twice as high as wide: 48x128."""
    raw = rotated_mp4(clip("mp4", "libx264", Fraction(2, 1)), 90)
    assert pixel_shape(raw) == (2.0, (W, H))
    info = probe_video(raw, "clip", max_seconds=60)
    assert (info.width, info.height) == (H, 2 * W)
    prep = ImagePrep(factor=4, max_pixels=1 << 16, max_grid=64)
    frames = decode_frames(raw, VideoSampling(target_fps=25, max_frames=2), prep).frames
    assert frames.shape[1:3] == tuple(reversed(prep.target_size(H, 2 * W)))
    white = (frames[0].mean(axis=(1, 2)) > 200).mean()  # the white half, turned: the top or bottom
    assert white == pytest.approx(0.5, abs=0.1)


def ebml(element: int, payload: bytes) -> bytes:
    ident = element.to_bytes((element.bit_length() + 7) // 8, "big")
    return ident + bytes([0x80 | len(payload)]) + payload


def test_a_matroska_tracks_display_size_gives_the_pixel_shape():
    """MakeMKV and mkvmerge write a track's display size beside its pixel size."""
    video = b"".join(
        ebml(element, value.to_bytes(2, "big"))
        for element, value in ((0xB0, 720), (0xBA, 480), (0x54B0, 853), (0x54BA, 480))
    )
    track = ebml(0xAE, ebml(0xE0, video))
    raw = b"\x1a\x45\xdf\xa3" + bytes([0x80]) + ebml(0x18538067, ebml(0x1654AE6B, track))
    assert pixel_shape(raw)[0] == pytest.approx(853 / 720)
    assert pixel_shape(raw[:30]) == (1.0, None)  # cut short: square, no error
    assert pixel_shape(b"\x00" * 100) == (1.0, None)
