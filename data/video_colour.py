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
  SDR BT.709, as it was before.
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
from dataclasses import dataclass

import numpy as np

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
    try:
        if raw[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip"):
            return _mp4_colour(raw, 0, len(raw), 0)
        if raw[:4] == b"\x1a\x45\xdf\xa3":
            return _matroska_colour(raw, 0, len(raw), 0)
    except Exception:  # noqa: BLE001 - whatever the bytes do, a clip without a description
        pass
    return None


# The boxes on the way to the sample entries, each at its own depth (moov/trak/mdia/minf/stbl)
_MP4_PATH = (b"moov", b"trak", b"mdia", b"minf", b"stbl")


def _mp4_colour(raw: bytes, start: int, end: int, depth: int) -> Colour | None:
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack_from(">I4s", raw, pos)
        head = 8
        if size == 1:
            size, head = struct.unpack_from(">Q", raw, pos + 8)[0], 16
        elif size == 0:
            size = end - pos
        if size < head:
            return None
        if depth < len(_MP4_PATH) and kind == _MP4_PATH[depth]:
            found = _mp4_colour(raw, pos + head, min(pos + size, end), depth + 1)
            if found:
                return found
        elif kind == b"stsd" and depth == len(
            _MP4_PATH
        ):  # full box, entry count, then the sample entries
            entry = pos + head + 8
            entry_size = struct.unpack_from(">I", raw, entry)[0]
            # a visual sample entry's own fields take 78 bytes, its boxes follow
            found = _colr(raw, entry + 8 + 78, entry + entry_size)
            if found:
                return found
        pos += size
    return None


def _colr(raw: bytes, start: int, end: int) -> Colour | None:
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack_from(">I4s", raw, pos)
        if size < 8:
            return None
        if kind == b"colr" and raw[pos + 8 : pos + 12] in (b"nclx", b"nclc"):
            return Colour(*struct.unpack_from(">HHH", raw, pos + 12))
        pos += size
    return None


# Matroska element ids: the masters on the way to a video track's Colour, and its three fields
_SEGMENT, _TRACKS, _TRACK, _VIDEO, _COLOUR = 0x18538067, 0x1654AE6B, 0xAE, 0xE0, 0x55B0
_CLUSTER = 0x1F43B675  # the first block of frames
_FIELDS = {0x55BB: "primaries", 0x55BA: "transfer", 0x55B1: "matrix"}


_MATROSKA_PATH = (_SEGMENT, _TRACKS, _TRACK, _VIDEO)  # each at its own depth, then Colour


def _matroska_colour(raw: bytes, pos: int, end: int, depth: int) -> Colour | None:
    while pos < end:
        element, pos = _vint(raw, pos, keep_marker=True)
        size, pos = _vint(raw, pos, keep_marker=False)
        stop = end if size is None else min(pos + size, end)
        if element == _CLUSTER:
            return None  # the frames start: every track was described before them
        if element == _COLOUR and depth == len(_MATROSKA_PATH):
            fields = {"primaries": 2, "transfer": 2, "matrix": 2}  # H.273's "unspecified"
            while pos < stop:
                field, pos = _vint(raw, pos, keep_marker=True)
                length, pos = _vint(raw, pos, keep_marker=False)
                if field in _FIELDS and length and length <= 8:
                    fields[_FIELDS[field]] = int.from_bytes(raw[pos : pos + length], "big")
                pos += length or 0
            return Colour(**fields)
        if depth < len(_MATROSKA_PATH) and element == _MATROSKA_PATH[depth]:
            found = _matroska_colour(raw, pos, stop, depth + 1)
            if found or size is None:
                return found
        pos = stop
    return None


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
