"""The documents a stream hands the packing loop (``Doc``: a document, how far it is placed and
handed out; its units, stretches of text and visual blocks: ``units_of``), and the packing
counters (``PackStats``). The rules they are packed by, and the loop that packs them, are in
pack_kernel.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.loader.stage_kernel import fill_units

__all__ = ["Doc", "PackStats", "units_of"]

_NO_UNITS = np.zeros((0, 6), np.int64)


def units_of(length: int, blocks) -> np.ndarray:
    """A document's packing units, int64 [n, 6] (start, end, atomic, t, h, w: pack_kernel's
    ``units`` rows): the text between its visual blocks (``[start, end, t, h, w]`` each) and the
    blocks, in order; made as a checked shard's runs make theirs (stage_kernel.fill_units)."""
    if not len(blocks):  # text and code only: most documents
        return np.array([[0, length, 0, 0, 0, 0]], np.int64) if length else _NO_UNITS
    table = np.array(blocks, np.int64).reshape(-1, 5)
    table.flags.writeable = False  # as a shard's index holds them: one compiled signature
    units = np.empty((2 * len(table) + 1, 6), np.int64)
    first, count = np.zeros(1, np.int64), np.array([len(table)], np.int64)
    where = [np.zeros(1, np.int64) for _ in range(3)]  # unit0, n_units, nblk (unused here)
    end = fill_units(units, 0, first, np.array([length]), first, count, table, *where)
    return units[:end]


@dataclass(slots=True)
class Doc:
    source: int
    sample: int
    epoch: int
    length: int
    units: np.ndarray  # units_of
    ids: np.ndarray | None = None  # int32 [length] (None in a dry stream: lengths only)
    mod: np.ndarray | None = None
    unit: int = 0  # next unit to place
    offset: int = 0  # tokens of that unit already placed (text only)
    limit: int = -1  # end of the chunk handed out so far (-1: the whole document)

    def __post_init__(self) -> None:
        if self.limit < 0:
            self.limit = self.length


@dataclass
class PackStats:
    rows: int = 0
    real_tokens: int = 0
    dropped_blocks: int = 0
    dropped_docs: int = 0
