"""HDR and wide-gamut video frames brought to the SDR BT.709 colours every other frame is in.

decord converts a clip's YUV to RGB with the clip's own matrix (BT.2020's for a BT.2020 clip),
but leaves the values in the clip's transfer function and primaries: as they are, an HDR clip
(PQ or HLG, as phones record by default) looks flat and dim (a PQ clip's reference white sits at
58 % of full scale), and a BT.2020 one desaturated. Images are converted to sRGB by their ICC profile
(data.image_prep); frames are brought the same way to what an SDR BT.709 clip of the scene holds.

Design choices:
- The colour description is read from the container, where phones and encoders write it: the
  ``colr`` box (``nclx``/``nclc``) of an MP4/MOV video sample entry, the ``Colour`` element of a
  Matroska/WebM video track. A clip that signals it only inside its bitstream (VUI) is taken as
  SDR BT.709, as it was before. The pixel aspect ratio (``pixel_shape``: a DVD's or an HDV
  camera's pixels are not square) is read from the same places (``pasp``; the track's display
  size), and from an MPEG-2 stream's sequence header; decord gives the stored pixels.
- Linear light, scaled so that HDR reference white (203 cd/m², ITU-R BT.2408) is 1.0: PQ by
  its EOTF (SMPTE ST 2084), HLG by its inverse OETF and the OOTF of a 1,000 cd/m² display
  (system gamma 1.2, BT.2100), SDR BT.2020 by BT.1886's gamma 2.4. Then BT.2020 or Display P3
  primaries to BT.709 (3x3 in linear light).
- Tone mapping on max(R, G, B), scaling the three channels alike so hue is kept (as FFmpeg's
  ``tonemap`` filter and libplacebo do): identity up to ``KNEE`` (three quarters of reference
  white: skin, grey cards and most of a picture stay as graded), then a Reinhard-style shoulder
  with slope 1 at the knee that reaches 1.0 at the 1,000 cd/m² peak. Reference white lands at
  0.88 linear (95 % of the 8-bit signal), above SDR mid tones and below its highlights; a
  curve that compresses everything (FFmpeg's ``tonemap=hable``) darkens the mid tones instead
  (docs/formats.md, "HDR and wide-gamut video", compares them on a scene with an SDR master).
- Colours outside BT.709 are clipped per channel, then encoded with BT.1886's inverse (gamma
  1/2.4), the signal an SDR clip of that display light holds.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

T = TypeVar("T")

# H.273 code points (ISO/IEC 23091-2), as MP4's colr box and Matroska's Colour element write them
BT709, BT2020, P3_D65 = 1, 9, 12  # colour primaries
PQ, HLG = 16, 18  # transfer characteristics
SDR_TRANSFERS = (1, 6, 14, 15)  # BT.709, BT.601, BT.2020 10- and 12-bit: one curve

REFERENCE_WHITE = 203.0  # cd/m², HDR reference white (BT.2408): 1.0 in the linear light here
PEAK = 1000.0 / REFERENCE_WHITE  # the nominal display peak HLG is defined for, and PQ's usual
KNEE = 0.75  # the tone curve is the identity below this (fraction of reference white)

# Chromaticities (x, y) of the red, green and blue primaries; all three share D65 white
PRIMARIES_XY = {
    BT709: ((0.640, 0.330), (0.300, 0.600), (0.150, 0.060)),
    BT2020: ((0.708, 0.292), (0.170, 0.797), (0.131, 0.046)),
    P3_D65: ((0.680, 0.320), (0.265, 0.690), (0.150, 0.060)),
}
D65 = (0.3127, 0.3290)


def _rgb_to_xyz(primaries) -> np.ndarray:
    """The linear RGB -> CIE XYZ matrix of ``primaries`` with D65 white (SMPTE RP 177)."""
    xyz = np.array([[x / y, 1.0, (1 - x - y) / y] for x, y in primaries]).T
    white = np.array([D65[0] / D65[1], 1.0, (1 - D65[0] - D65[1]) / D65[1]])
    return xyz * np.linalg.solve(xyz, white)


# Linear-light RGB of another set of primaries to BT.709's (BT.2087 gives the BT.2020 one to
# four decimals); white stays white, so each row sums to 1
TO_BT709 = {
    code: np.linalg.solve(_rgb_to_xyz(PRIMARIES_XY[BT709]), _rgb_to_xyz(PRIMARIES_XY[code]))
    for code in (BT2020, P3_D65)
}


@dataclass(frozen=True)
class Colour:
    primaries: int
    transfer: int
    matrix: int

    @property
    def needs_mapping(self) -> bool:
        return self.transfer in (PQ, HLG) or (
            self.primaries in TO_BT709 and self.transfer in SDR_TRANSFERS
        )


def colour_of(raw: bytes) -> Colour | None:
    """The colour description an MP4/MOV or Matroska/WebM clip gives its video track, or None
    (no description, another container, or bytes that do not parse)."""
    found = (_colr(raw, start, end) for start, end in _sample_entries(raw))
    matroska = (_matroska_colour(raw, start, end) for start, end in _matroska_videos(raw))
    return _first(found) or _first(matroska)


def pixel_shape(raw: bytes) -> tuple[float, tuple[int, int] | None]:
    """Width over height of one stored pixel as the clip is to be shown (DVDs' 8:9 or 32:27,
    HDV's 4:3), and the stored (width, height) of an MP4/MOV's frames it is read with (None for
    other containers). The aspect is read from an MP4/MOV's ``pasp`` box, a Matroska/WebM track's
    display size, an MPEG-2 program stream's sequence header; 1.0 when the clip says nothing
    (square pixels). A track whose display matrix turns its frames a quarter, as decord applies,
    has them stored height x width: their stretch is then vertical."""
    mp4 = _first(  # one walk of the sample entries: the pasp and the entry it is in
        (aspect, _stored_size(raw, start))
        for start, end in _sample_entries(raw)
        if (aspect := _pasp(raw, start, end))
    )
    matroska = (_matroska_aspect(raw, start, end) for start, end in _matroska_videos(raw))
    aspect, stored = mp4 or (_first(matroska) or _mpeg_aspect(raw), None)
    if not aspect or not 0.1 <= aspect <= 10:  # past that, a damaged field
        return 1.0, None
    return aspect, stored


def _stored_size(raw: bytes, boxes_start: int) -> tuple[int, int]:
    """(width, height) fields of the visual sample entry whose boxes start at ``boxes_start``:
    they sit 32 bytes into the entry, whose own fields take 86 bytes before its boxes."""
    return struct.unpack_from(">HH", raw, boxes_start - 86 + 32)


def _first(found: Iterator[T | None]) -> T | None:
    """The first value of ``found`` that is not None; None also when the bytes do not parse."""
    try:
        return next((value for value in found if value is not None), None)
    except Exception:  # noqa: BLE001 - whatever the bytes do, a clip without a description
        return None


# The boxes on the way to the sample entries, each at its own depth (moov/trak/mdia/minf/stbl)
_MP4_PATH = (b"moov", b"trak", b"mdia", b"minf", b"stbl")


def _sample_entries(
    raw: bytes, start: int = 0, end: int = -1, depth: int = 0
) -> Iterator[tuple[int, int]]:
    """(start, end) of the boxes inside each track's first sample entry of an MP4/MOV, in
    track order (an audio track's entry holds no video box: the callers look on)."""
    if depth == 0:
        if raw[4:8] not in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip"):
            return
        end = len(raw)
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack_from(">I4s", raw, pos)
        head = 8
        if size == 1:
            size, head = struct.unpack_from(">Q", raw, pos + 8)[0], 16
        elif size == 0:
            size = end - pos
        if size < head:
            return
        if depth < len(_MP4_PATH) and kind == _MP4_PATH[depth]:
            yield from _sample_entries(raw, pos + head, min(pos + size, end), depth + 1)
        elif kind == b"stsd" and depth == len(_MP4_PATH):
            entry = pos + head + 8  # full box, entry count, then the sample entries
            entry_size = struct.unpack_from(">I", raw, entry)[0]
            # a visual sample entry's own fields take 78 bytes, its boxes follow
            yield entry + 8 + 78, entry + entry_size
        pos += size


def _boxes(raw: bytes, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """(kind, payload start, box end) of the boxes between ``start`` and ``end``."""
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack_from(">I4s", raw, pos)
        if size < 8:
            return
        yield kind, pos + 8, pos + size
        pos += size


def _colr(raw: bytes, start: int, end: int) -> Colour | None:
    for kind, payload, _ in _boxes(raw, start, end):
        if kind == b"colr" and raw[payload : payload + 4] in (b"nclx", b"nclc"):
            return Colour(*struct.unpack_from(">HHH", raw, payload + 4))
    return None


def _pasp(raw: bytes, start: int, end: int) -> float | None:
    for kind, payload, _ in _boxes(raw, start, end):
        if kind == b"pasp":
            h_spacing, v_spacing = struct.unpack_from(">II", raw, payload)
            return h_spacing / v_spacing if h_spacing and v_spacing else None
    return None


# Matroska element ids: the masters on the way to a video track's Video element, and in it the
# Colour master (its three fields) and the pixel and display sizes
_SEGMENT, _TRACKS, _TRACK, _VIDEO, _COLOUR = 0x18538067, 0x1654AE6B, 0xAE, 0xE0, 0x55B0
_CLUSTER = 0x1F43B675  # the first block of frames
_FIELDS = {0x55BB: "primaries", 0x55BA: "transfer", 0x55B1: "matrix"}
_PIXEL_W, _PIXEL_H, _DISPLAY_W, _DISPLAY_H, _DISPLAY_UNIT = 0xB0, 0xBA, 0x54B0, 0x54BA, 0x54B2


_MATROSKA_PATH = (_SEGMENT, _TRACKS, _TRACK, _VIDEO)  # each at its own depth


def _matroska_videos(
    raw: bytes, pos: int = 0, end: int = -1, depth: int = 0
) -> Iterator[tuple[int, int]]:
    """(start, end) of each video track's Video element of a Matroska/WebM clip."""
    if depth == 0:
        if raw[:4] != b"\x1a\x45\xdf\xa3":
            return
        end = len(raw)
    while pos < end:
        element, pos = _vint(raw, pos, keep_marker=True)
        size, pos = _vint(raw, pos, keep_marker=False)
        stop = end if size is None else min(pos + size, end)
        if element == _CLUSTER:
            return  # the frames start: every track was described before them
        if depth < len(_MATROSKA_PATH) and element == _MATROSKA_PATH[depth]:
            if depth + 1 == len(_MATROSKA_PATH):
                yield pos, stop
            else:
                yield from _matroska_videos(raw, pos, stop, depth + 1)
            if size is None:
                return
        pos = stop


def _ebml_fields(raw: bytes, pos: int, end: int) -> Iterator[tuple[int | None, int, int]]:
    """(element id, payload start, payload length) of the elements between ``pos`` and ``end``."""
    while pos < end:
        element, pos = _vint(raw, pos, keep_marker=True)
        length, pos = _vint(raw, pos, keep_marker=False)
        yield element, pos, length or 0
        pos += length or 0


def _matroska_colour(raw: bytes, start: int, end: int) -> Colour | None:
    for element, pos, length in _ebml_fields(raw, start, end):
        if element == _COLOUR:
            fields = {"primaries": 2, "transfer": 2, "matrix": 2}  # H.273's "unspecified"
            for field, at, size in _ebml_fields(raw, pos, pos + length):
                if field in _FIELDS and 0 < size <= 8:
                    fields[_FIELDS[field]] = int.from_bytes(raw[at : at + size], "big")
            return Colour(**fields)
    return None


def _matroska_aspect(raw: bytes, start: int, end: int) -> float | None:
    sizes = {
        element: int.from_bytes(raw[pos : pos + length], "big")
        for element, pos, length in _ebml_fields(raw, start, end)
        if element in (_PIXEL_W, _PIXEL_H, _DISPLAY_W, _DISPLAY_H, _DISPLAY_UNIT)
        and 0 < length <= 8
    }
    if sizes.get(_DISPLAY_UNIT, 0) not in (0, 3):  # centimetres, inches: no aspect of pixels
        return None
    pixel_w, pixel_h = sizes.get(_PIXEL_W), sizes.get(_PIXEL_H)
    display_w, display_h = sizes.get(_DISPLAY_W, pixel_w), sizes.get(_DISPLAY_H, pixel_h)
    if not (pixel_w and pixel_h and display_w and display_h):
        return None
    return (display_w / pixel_w) / (display_h / pixel_h)


# MPEG-2 sequence header's aspect_ratio_information: the shape of the picture (1: square pixels)
_MPEG2_PICTURE = {2: 4 / 3, 3: 16 / 9, 4: 2.21}
_MPEG_SEQUENCE, _MPEG_EXTENSION = b"\x00\x00\x01\xb3", b"\x00\x00\x01\xb5"


def _mpeg_aspect(raw: bytes) -> float | None:
    """An MPEG-2 program or elementary stream's first sequence header (a DVD's VOB or an .mpg
    program stream; a transport stream is not read): pixel aspect from its picture aspect and size. MPEG-1 (no sequence extension after
    the header) codes the pixel's shape in another table, rare enough to be taken as square."""
    if raw[:4] not in (b"\x00\x00\x01\xba", _MPEG_SEQUENCE):
        return None
    at = raw.find(_MPEG_SEQUENCE, 0, 1 << 20)
    if at < 0 or at + 8 > len(raw) or raw.find(_MPEG_EXTENSION, at, at + 256) < 0:
        return None
    width = (raw[at + 4] << 4) | (raw[at + 5] >> 4)
    height = ((raw[at + 5] & 0x0F) << 8) | raw[at + 6]
    code = raw[at + 7] >> 4
    if code not in _MPEG2_PICTURE or not width or not height:
        return None
    return _MPEG2_PICTURE[code] * height / width


def _vint(raw: bytes, pos: int, keep_marker: bool) -> tuple[int | None, int]:
    """An EBML variable-length integer at ``pos``: (value, position after it); a size of all
    ones (unknown, as a live stream writes its Segment) is None."""
    first = raw[pos]
    length = 9 - first.bit_length()
    if not 1 <= length <= 8:
        raise ValueError("not an EBML integer")
    value = int.from_bytes(raw[pos : pos + length], "big")
    if keep_marker:
        return value, pos + length
    value &= (1 << (7 * length)) - 1
    return (None if value == (1 << (7 * length)) - 1 else value), pos + length


def to_sdr(frames: np.ndarray, colour: Colour) -> np.ndarray:
    """uint8 [..., 3] frames as decoded from a clip of ``colour``, in SDR BT.709 (above)."""
    if not colour.needs_mapping:
        return frames
    light = _linear(frames.astype(np.float32) / 255.0, colour)
    hdr = colour.transfer in (PQ, HLG)
    # PQ and HLG are BT.2100's, whose primaries are BT.2020's: a clip that leaves them
    # unspecified has those
    primaries = BT2020 if hdr and colour.primaries not in PRIMARIES_XY else colour.primaries
    matrix = TO_BT709.get(primaries)
    if matrix is not None:
        light = light @ matrix.T.astype(np.float32)
    if hdr:
        light = _tone_map(light)
    signal = np.clip(light, 0.0, 1.0) ** (1 / 2.4)
    return np.round(signal * 255.0).astype(np.uint8)


def _linear(signal: np.ndarray, colour: Colour) -> np.ndarray:
    """The display light of ``signal`` (0..1), 1.0 at reference white (SDR: at full scale)."""
    if colour.transfer == PQ:
        m1, m2, c1, c2, c3 = 0.1593017578125, 78.84375, 0.8359375, 18.8515625, 18.6875
        p = signal ** (1 / m2)
        nits = 10000.0 * (np.maximum(p - c1, 0.0) / (c2 - c3 * p)) ** (1 / m1)
        return nits / REFERENCE_WHITE
    if colour.transfer == HLG:
        a, b, c = 0.17883277, 0.28466892, 0.55991073
        scene = np.where(signal <= 0.5, signal**2 / 3, (np.exp((signal - c) / a) + b) / 12).astype(
            np.float32
        )
        luma = scene @ np.array([0.2627, 0.6780, 0.0593], np.float32)
        ootf = np.maximum(luma, 1e-6)[..., None] ** 0.2  # system gamma 1.2 at 1,000 cd/m²
        return 1000.0 * ootf * scene / REFERENCE_WHITE
    return signal**2.4


def _tone_map(light: np.ndarray) -> np.ndarray:
    """Identity below ``KNEE``, then a shoulder of slope 1 at the knee reaching 1.0 at ``PEAK``,
    applied to max(R, G, B) with the channels scaled alike."""
    top = light.max(axis=-1, keepdims=True)
    over = np.maximum(top - KNEE, 0.0)
    room, span = 1.0 - KNEE, PEAK - KNEE
    soft = room * span / (span - room)  # slope 1 at the knee, 1.0 at the peak
    mapped = np.where(top > KNEE, KNEE + room * over / (over + soft) * (span + soft) / span, top)
    return light * (mapped / np.maximum(top, 1e-6))
