"""HDR and wide-gamut clips come out of the decoder in SDR BT.709 (data/video_colour.py).

The clips are real 10-bit HEVC encoded with PyAV from a scene of known display light, by the
standards' forward formulas (BT.2100's PQ inverse EOTF, HLG's inverse OOTF and OETF, BT.2020's
matrix), written here independently of the module's inverse ones. The scene's SDR BT.709
signal is what the decoded frames must be."""

from __future__ import annotations

import io

import numpy as np
import pytest

import data.video_frames
from data.image_prep import ImagePrep
from data.video_colour import BT709, BT2020, HLG, P3_D65, PQ, Colour, colour_of, to_sdr
from data.video_frames import VideoSampling, decode_frames

W, H = 64, 32
PREP = ImagePrep(factor=8, max_pixels=W * H)  # frames at their own size
# Display light, 1.0 = HDR reference white (203 cd/m²): greys and colours of an SDR grade, below
# the tone curve's knee, each a 16 x 16 patch (whole 4:2:0 chroma blocks)
PATCHES = [
    (0.02, 0.02, 0.02),
    (0.1, 0.1, 0.1),
    (0.3, 0.3, 0.3),
    (0.6, 0.6, 0.6),
    (0.5, 0.2, 0.1),
    (0.1, 0.4, 0.2),
    (0.15, 0.2, 0.6),
    (0.6, 0.5, 0.1),
]
BT709_TO_BT2020 = np.array(  # BT.2087
    [[0.6274, 0.3293, 0.0433], [0.0691, 0.9195, 0.0114], [0.0164, 0.0880, 0.8956]]
)


def scene() -> np.ndarray:
    light = np.zeros((H, W, 3))
    for i, patch in enumerate(PATCHES):
        light[(i // 4) * 16 : (i // 4 + 1) * 16, (i % 4) * 16 : (i % 4 + 1) * 16] = patch
    return light


def pq_signal(light: np.ndarray) -> np.ndarray:
    m1, m2, c1, c2, c3 = 0.1593017578125, 78.84375, 0.8359375, 18.8515625, 18.6875
    y = (203.0 * light / 10000.0) ** m1
    return ((c1 + c2 * y) / (1 + c3 * y)) ** m2


def hlg_signal(light: np.ndarray) -> np.ndarray:
    nits = 203.0 * light  # display light of a 1,000 cd/m² HLG display (system gamma 1.2)
    display_luma = nits @ np.array([0.2627, 0.6780, 0.0593])
    scene_luma = (display_luma / 1000.0) ** (1 / 1.2)
    e = nits / (1000.0 * np.maximum(scene_luma, 1e-9)[..., None] ** 0.2)
    a, b, c = 0.17883277, 0.28466892, 0.55991073
    return np.where(e <= 1 / 12, np.sqrt(3 * e), a * np.log(np.maximum(12 * e - b, 1e-9)) + c)


def mux(out, stream, frames) -> None:
    """Encode ``frames`` (pts 0, 1, ...) into ``stream`` of container ``out``, then flush."""
    for i, frame in enumerate(frames):
        frame.pts = i
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)


def hevc_10bit(signal: np.ndarray, transfer: int) -> bytes:
    """A lossless 10-bit HEVC mp4 of BT.2020 ``signal`` (R'G'B' 0..1), tagged BT.2020 and
    ``transfer`` as phones tag theirs (the ``colr`` box)."""
    import av

    y = signal @ np.array([0.2627, 0.6780, 0.0593])
    cb, cr = (signal[..., 2] - y) / 1.8814, (signal[..., 0] - y) / 1.4746
    planes = [
        np.round(64 + 876 * y),
        np.round(512 + 896 * cb.reshape(H // 2, 2, W // 2, 2).mean((1, 3))),
        np.round(512 + 896 * cr.reshape(H // 2, 2, W // 2, 2).mean((1, 3))),
    ]
    name = {PQ: "smpte2084", HLG: "arib-std-b67"}[transfer]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx265", rate=8)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p10le"
        stream.codec_context.color_primaries = BT2020
        stream.codec_context.color_trc = transfer
        stream.codec_context.colorspace = BT2020
        stream.options = {
            "x265-params": f"lossless=1:colorprim=bt2020:transfer={name}:colormatrix=bt2020nc:"
            "log-level=error"
        }
        frame = av.VideoFrame(W, H, "yuv420p10le")
        for plane, values in zip(frame.planes, planes):
            rows = np.frombuffer(plane, np.uint16).reshape(-1, plane.line_size // 2)
            rows[: values.shape[0], : values.shape[1]] = values
        mux(out, stream, [frame] * 3)
    return buf.getvalue()


@pytest.mark.parametrize("transfer", [PQ, HLG])
def test_an_hdr_clip_decodes_to_the_sdr_signal_of_its_scene(transfer, monkeypatch):
    av = pytest.importorskip("av")
    if "libx265" not in av.codecs_available:
        pytest.skip("this PyAV has no libx265 encoder")
    light = scene()
    hdr = (pq_signal if transfer == PQ else hlg_signal)(light @ BT709_TO_BT2020.T)
    raw = hevc_10bit(hdr, transfer)
    assert colour_of(raw) == Colour(BT2020, transfer, BT2020)
    want = np.round(255 * light ** (1 / 2.4))
    got = decode_frames(raw, VideoSampling(8, 4), PREP).frames.astype(float)
    error = np.abs(got - want).mean()
    # decord's 8-bit RGB sits 1-2 levels below the 10-bit signal, 3-5 % of the light on PQ's
    # steep curve: measured 4.1 levels (PQ) and 2.7 (HLG) off on average
    assert error < 6, error
    # The frames as decord gives them (the clip's PQ or HLG signal in BT.2020 primaries): 33.8
    # and 20.4 levels off
    monkeypatch.setattr(data.video_frames, "colour_of", lambda raw: None)
    untouched = decode_frames(raw, VideoSampling(8, 4), PREP).frames.astype(float)
    assert np.abs(untouched - want).mean() > 5 * error


def test_the_colour_description_is_read_from_mp4_mov_and_matroska(tmp_path):
    av = pytest.importorskip("av")
    if "libx264" not in av.codecs_available:
        pytest.skip("this PyAV has no libx264 encoder")

    def clip(container: str, codec: str, pix_fmt: str) -> bytes:
        buf = io.BytesIO()
        with av.open(buf, mode="w", format=container) as out:
            stream = out.add_stream(codec, rate=8)
            stream.width, stream.height, stream.pix_fmt = 32, 32, pix_fmt
            stream.options = {"threads": "1"}
            cc = stream.codec_context
            cc.color_primaries, cc.color_trc, cc.colorspace = BT2020, PQ, BT2020
            mux(out, stream, [av.VideoFrame(32, 32, pix_fmt) for _ in range(2)])
        return buf.getvalue()

    hdr = Colour(BT2020, PQ, BT2020)
    assert colour_of(clip("mp4", "libx264", "yuv420p")) == hdr
    assert colour_of(clip("mov", "libx264", "yuv420p")) == hdr
    # Matroska (WebM's container) with H.264: PyAV's libvpx fails to open once decord's FFmpeg
    # is loaded in the process, as it is in a test run
    mkv = clip("matroska", "libx264", "yuv420p")
    assert colour_of(mkv) == hdr
    assert colour_of(mkv[:60]) is None  # cut short: nothing, no error
    assert colour_of(b"\x00" * 100) is None
    untagged = io.BytesIO()
    with av.open(untagged, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=8)
        stream.width, stream.height = 32, 32
        mux(out, stream, [av.VideoFrame(32, 32, "yuv420p")])
    assert colour_of(untagged.getvalue()) is None


def test_wide_gamut_sdr_keeps_white_and_saturates_less_than_it_would_unconverted():
    """An SDR clip in Display P3 or BT.2020 primaries: white stays white, greys stay grey, and
    a primary's colour is brought inside BT.709 (its pure red is a redder red than BT.709's)."""
    frames = np.array([[[255, 255, 255], [128, 128, 128], [200, 40, 40]]], np.uint8)
    for primaries in (P3_D65, BT2020):
        out = to_sdr(frames, Colour(primaries, BT709, BT709)).astype(int)
        assert (np.abs(out[0, :2] - frames[0, :2]) <= 1).all()
        assert out[0, 2, 0] > frames[0, 2, 0]  # the same light is more saturated in BT.709
    assert to_sdr(frames, Colour(BT709, BT709, BT709)) is frames  # nothing to do


@pytest.mark.parametrize(
    "raw",
    [
        b"\x00\x00\x00\x10ftypisom\x00\x00\x00\x00" + b"\x00\x00\x00\x08moov" * 2000,
        b"\x1a\x45\xdf\xa3\x80" + b"\xae\xff" * 2000,  # unknown-size elements, nested
        b"\x00\x00\x00\x10ftypisom\x00\x00\x00\x00\x00\x00\x00\x20moov\x00\x00\x00\x18stsd",
        b"\x1a\x45\xdf\xa3\x80\x18\x53\x80\x67\xff\x55\xb0\xff\x55\xba\x88" + b"\xff" * 64,
    ],
)
def test_bytes_that_do_not_parse_give_no_description_and_no_error(raw):
    """Nested boxes or elements raised RecursionError out of colour_of, which stopped the
    tokenize command (it rejects a document on ValueError only)."""
    assert colour_of(raw) is None
