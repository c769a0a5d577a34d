"""The documents a stream hands the packing loop (``Doc``: a document, how far it is placed and
handed out; ``Unit``: a stretch of text or one visual block, ``units_of``), and the packing
counters (``PackStats``). The rules they are packed by, and the loop that packs them, are in
pack_kernel.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Doc", "PackStats", "Unit", "units_of"]


@dataclass(slots=True)
class Unit:
    start: int
    end: int
    atomic: bool
    t: int = 0  # latent frames (0: image)
    h: int = 0
    w: int = 0


def units_of(length: int, blocks: list) -> list[Unit]:
    if not blocks:  # text and code only: most documents
        return [Unit(0, length, False)] if length else []
    units, pos = [], 0
    for b in sorted(blocks):
        start, end = int(b[0]), int(b[1])
        if start > pos:
            units.append(Unit(pos, start, False))
        units.append(Unit(start, end, True, int(b[2]), int(b[3]), int(b[4])))
        pos = end
    if pos < length:
        units.append(Unit(pos, length, False))
    return units


@dataclass(slots=True)
class Doc:
    source: int
    sample: int
    epoch: int
    length: int
    units: list[Unit]
    ids: np.ndarray | None = None  # int32 [length] (None in a dry stream: lengths only)
    mod: np.ndarray | None = None
    unit: int = 0  # next unit to place
    offset: int = 0  # tokens of that unit already placed (text only)
    limit: int = -1  # end of the chunk handed out so far (-1: the whole document)
    # Its visual blocks (the atomic units), in order
    blocks: list[Unit] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.limit < 0:
            self.limit = self.length
        # units_of makes one text unit at most when there is no block
        units = self.units
        if len(units) > 1 or (units and units[0].atomic):
            self.blocks = [u for u in units if u.atomic]
        else:
            self.blocks = []

    def position(self) -> int:
        """Doc tokens already placed or dropped: where the next piece starts."""
        return (
            self.units[self.unit].start + self.offset
            if self.unit < len(self.units)
            else self.length
        )

    def cursor(self) -> list[int]:
        return [self.source, self.sample, self.epoch, self.unit, self.offset, self.limit]


@dataclass
class PackStats:
    rows: int = 0
    real_tokens: int = 0
    dropped_blocks: int = 0
    dropped_docs: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)
