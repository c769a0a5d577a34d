"""The one id space every stage shares: ``[text BPE incl. its specials] [structure] [visual codes]``.

Design choices:
- The layout is a small frozen dataclass saved as ``vocab_layout.json`` beside the tokenizers; it
  travels with every checkpoint and release, and its fingerprint guards loader state.
- Structure tokens are named, so a layout read back from disk is self-describing; size tokens
  ``<h=K>`` / ``<w=K>`` (K = 1..max_grid) give the grid of an image or video frame, Emu3-style.
- Every token carries a modality id (``Modality``); structure tokens have their own, so the
  monitors never mix row markers into the image loss.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from pathlib import Path


class Modality(IntEnum):
    TEXT = 0
    CODE = 1
    IMAGE = 2
    VIDEO = 3
    STRUCTURE = 4


MODALITY_NAMES = tuple(modality.name.lower() for modality in Modality)

# Text-side specials live inside the BPE vocabulary (the tokenizer knows them).
TEXT_SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>")

# Fixed structure markers; the size tokens follow them (see ``structure_names``).
STRUCTURE_MARKERS = ("<boi>", "<eoi>", "<eol>", "<bov>", "<eov>", "<frame>")


def structure_names(max_grid: int) -> list[str]:
    return (
        list(STRUCTURE_MARKERS)
        + [f"<h={size}>" for size in range(1, max_grid + 1)]
        + [f"<w={size}>" for size in range(1, max_grid + 1)]
    )


@dataclass(frozen=True)
class VocabLayout:
    text_size: int  # BPE vocabulary size, its specials included
    fsq_levels: tuple[int, ...] = (8, 5, 5, 5)
    max_grid: int = 64  # largest image/frame side, in tokens
    structure: tuple[str, ...] = field(default=())
    version: int = 1

    def __post_init__(self) -> None:
        if not self.structure:
            object.__setattr__(self, "structure", tuple(structure_names(self.max_grid)))
        object.__setattr__(self, "fsq_levels", tuple(int(level) for level in self.fsq_levels))

    # --- ranges -------------------------------------------------------------------------
    @property
    def structure_offset(self) -> int:
        return self.text_size

    @property
    def visual_offset(self) -> int:
        return self.text_size + len(self.structure)

    @property
    def num_codes(self) -> int:
        product = 1
        for level in self.fsq_levels:
            product *= level
        return product

    @property
    def size(self) -> int:
        return self.visual_offset + self.num_codes

    def structure_id(self, name: str) -> int:
        try:
            return self.structure_offset + self.structure.index(name)
        except ValueError:
            raise KeyError(f"unknown structure token {name!r}") from None

    def size_ids(self, h: int, w: int) -> tuple[int, int]:
        if not (1 <= h <= self.max_grid and 1 <= w <= self.max_grid):
            raise ValueError(f"grid {h}x{w} outside 1..{self.max_grid}")
        return self.structure_id(f"<h={h}>"), self.structure_id(f"<w={w}>")

    def code_id(self, code: int) -> int:
        return self.visual_offset + int(code)

    def is_code(self, token_id: int) -> bool:
        return self.visual_offset <= token_id < self.size

    def modality_ranges(self) -> list[tuple[int, int]]:
        """[lo, hi) of the ids each modality holds, in ``Modality`` order: text and code share the
        BPE, images and videos the visual codes."""
        text, codes = (0, self.text_size), (self.visual_offset, self.size)
        return [text, text, codes, codes, (self.structure_offset, self.visual_offset)]

    # --- persistence ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        record = asdict(self)
        record["fsq_levels"] = list(self.fsq_levels)
        record["structure"] = list(self.structure)
        record["ranges"] = {
            "text": [0, self.text_size],
            "structure": [self.structure_offset, self.visual_offset],
            "visual": [self.visual_offset, self.size],
        }
        return record

    @classmethod
    def from_dict(cls, d: dict) -> VocabLayout:
        return cls(
            text_size=int(d["text_size"]),
            fsq_levels=tuple(d["fsq_levels"]),
            max_grid=int(d["max_grid"]),
            structure=tuple(d["structure"]),
            version=int(d["version"]),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> VocabLayout:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{path}: not a readable vocabulary layout ({e})") from e

    def fingerprint(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
