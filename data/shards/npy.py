"""Reading the ``.npy`` members of token shards fast: a 1-D little-endian integer array with a
version 1 header (what ``earlyfuse-prep tokenize`` writes) is read as a view of its bytes, its
header parsed once per (dtype, length), or a whole shard's members located at once
(``npy_layouts``); any other ``.npy`` goes through ``np.load`` (pickle never allowed). Part of
the token shard format, beside its binary index (token_index.py): the loader's stream, its
whole-shard check, shard verification and the tools all read these members, and none of them
should need the stream.
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


_MAGIC = b"\x93NUMPY\x01\x00"  # a version 1 header; its length follows (uint16)
# Where the shape's digits start in a header _NPY_1D matches (its dtype is three characters)
_SHAPE_AT = len("{'descr': '<i4', 'fortran_order': False, 'shape': (")
_ZERO = ord("0")


def npy_layout(data: bytes | memoryview) -> tuple[np.dtype, int, int] | None:
    """(dtype, length, where the values start) of a 1-D little-endian integer .npy with a version
    1 header, the kind tokenize writes; None for any other kind. Each distinct header is parsed
    once."""
    if data[:8] != _MAGIC:
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


def npy_layouts(
    buffer: np.ndarray, at: np.ndarray, size: np.ndarray
) -> tuple[np.dtype, np.ndarray, np.ndarray] | None:
    """``npy_layout`` of many members of one buffer at once (uint8 ``buffer``; int64 ``at``,
    ``size``: where each member lies): (their one dtype, their lengths, where each one's values
    start in ``buffer``); None when any member is of another kind (or lies outside the buffer),
    its values run past its end, or the members differ in dtype.

    No Python call per member: the headers are gathered with numpy, their shape's digits set
    to 0 to make a template (the headers of one dtype and one number of digits are one
    template), each distinct template parsed once, and the lengths read from the digits as a
    vectorised sum."""
    n = len(at)
    if not n:
        return np.dtype("<i4"), np.zeros(0, np.int64), np.zeros(0, np.int64)
    end = at + size
    if int(at.min()) < 0 or int(size.min()) < 10 or int(end.max()) > len(buffer):
        return None
    prefix = buffer[at[:, None] + np.arange(10)]
    if not (prefix[:, :8] == np.frombuffer(_MAGIC, np.uint8)).all():
        return None
    hlen = prefix[:, 8].astype(np.int64) | (prefix[:, 9].astype(np.int64) << 8)
    starts = at + 10 + hlen
    if (starts > end).any():
        return None
    lengths = np.empty(n, np.int64)
    dtypes = set()
    for header_len in np.unique(hlen).tolist():
        sel = np.flatnonzero(hlen == header_len)
        headers = buffer[at[sel, None] + 10 + np.arange(header_len)]
        digit = (headers >= _ZERO) & (headers <= _ZERO + 9)
        digit[:, :_SHAPE_AT] = False  # the dtype's digit stays: it is part of the template
        template = np.where(digit, _ZERO, headers)
        rows = np.ascontiguousarray(template).view(np.dtype((np.void, header_len))).ravel()
        distinct, inverse = np.unique(rows, return_inverse=True)
        inverse = inverse.ravel()
        for k, text in enumerate(distinct):
            m = _NPY_1D.match(text.tobytes())
            if m is None or m.start(2) != _SHAPE_AT:
                return None
            dtypes.add(np.dtype(m.group(1).decode()))
            mine = np.flatnonzero(inverse == k)
            digits = headers[mine, _SHAPE_AT : m.end(2)].astype(np.int64) - _ZERO
            powers = 10 ** np.arange(digits.shape[1] - 1, -1, -1, dtype=np.int64)
            lengths[sel[mine]] = digits @ powers
    if len(dtypes) != 1:
        return None
    dtype = dtypes.pop()
    if (starts + lengths * dtype.itemsize > end).any():
        return None  # a short payload
    return dtype, lengths, starts


def read_npy(data: bytes | memoryview) -> np.ndarray:
    """``np.load`` of a 1-D integer .npy, without its header parser (``ast.literal_eval`` of
    the header costs more than reading a short document); any other .npy goes through
    ``np.load`` (pickle never allowed). A short or bad payload is a ValueError like np.load's."""
    layout = npy_layout(data)
    if layout is not None:
        return np.frombuffer(data, dtype=layout[0], count=layout[1], offset=layout[2])
    return np.load(io.BytesIO(data), allow_pickle=False)
