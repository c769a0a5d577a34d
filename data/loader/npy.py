"""Reading the ``.npy`` members of token shards fast: a 1-D little-endian integer array with a
version 1 header (what ``earlyfuse-prep tokenize`` writes) is read as a view of its bytes, its
header parsed once per (dtype, length); any other ``.npy`` goes through ``np.load`` (pickle
never allowed). Its own module because the loader's stream, the whole-shard check, shard
verification and the tools all read these members, and none of them should need the stream.
"""

from __future__ import annotations

import io
import re

import numpy as np

# The header numpy writes for a 1-D little-endian array (what earlyfuse-prep tokenize stores).
_NPY_1D = re.compile(
    rb"\{'descr': '([<|][iu][1248])', 'fortran_order': False, 'shape': \((\d+),\), \}"
)

_HEADERS: dict[bytes, tuple[np.dtype, int]] = {}  # header text -> (dtype, length), parsed once


def npy_layout(data: bytes | memoryview) -> tuple[np.dtype, int, int] | None:
    """(dtype, length, where the values start) of a 1-D little-endian integer .npy with a version
    1 header, the kind tokenize writes; None for any other kind."""
    if data[:8] != b"\x93NUMPY\x01\x00":
        return None
    hlen = int.from_bytes(data[8:10], "little")
    header = bytes(data[10 : 10 + hlen])
    known = _HEADERS.get(header)
    if known is None:
        m = _NPY_1D.match(header)
        if not m:
            return None
        known = (np.dtype(m.group(1).decode()), int(m.group(2)))
        if len(_HEADERS) < 65536:  # one per (dtype, length): documents repeat lengths
            _HEADERS[header] = known
    return known[0], known[1], 10 + hlen


def read_npy(data: bytes | memoryview) -> np.ndarray:
    """``np.load`` of a 1-D integer .npy, without its header parser (``ast.literal_eval`` of
    the header costs more than reading a short document); any other .npy goes through
    ``np.load`` (pickle never allowed). A short or bad payload is a ValueError like np.load's."""
    layout = npy_layout(data)
    if layout is not None:
        return np.frombuffer(data, dtype=layout[0], count=layout[1], offset=layout[2])
    return np.load(io.BytesIO(data), allow_pickle=False)
