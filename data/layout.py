"""Visual blocks in the token sequence (Emu3-style, resolution-free and decodable), and back.

Image:  ``<boi> <h=H> <w=W>  c c … c <eol>  (H rows)  <eoi>``
Video:  ``<bov> <h=H> <w=W>  <frame> (H rows of W codes, each ended by <eol>)  <frame> …  <eov>``

Design choices:
- The grid size comes first, so a decoder (or constrained generation) knows the block's exact
  length and shape before the first code; every row ends in ``<eol>``, so a reader can resync
  and the model learns the 2-D raster explicitly.
- Video frames here are the *latent* frames of the causal video tokenizer (the first frame
  alone, then one latent per group of frames), all sharing the image code space.
- Parsing is strict: any deviation raises ``ValueError`` naming the position and the token,
  so a malformed generation is an error, never a silently wrong picture.
- Modality per token: codes get IMAGE or VIDEO, markers and size tokens STRUCTURE.
"""

from __future__ import annotations

import numpy as np

from data.vocab import Modality, VocabLayout


def _rows(codes: np.ndarray, lay: VocabLayout, eol: int) -> np.ndarray:
    height, width = codes.shape
    grid = np.empty((height, width + 1), dtype=np.int64)
    grid[:, :width] = codes.astype(np.int64) + lay.visual_offset
    grid[:, width] = eol
    return grid.reshape(-1)


def _check_codes(codes: np.ndarray, lay: VocabLayout) -> None:
    if codes.size and (codes.min() < 0 or codes.max() >= lay.num_codes):
        raise ValueError(f"codes outside 0..{lay.num_codes - 1}")


def image_tokens(codes: np.ndarray, lay: VocabLayout) -> tuple[np.ndarray, np.ndarray]:
    """Ids and per-token modality of one image block from its code grid [H, W]."""
    codes = np.asarray(codes)
    if codes.ndim != 2:
        raise ValueError(f"image codes must be [H, W], got shape {codes.shape}")
    _check_codes(codes, lay)
    height, width = codes.shape
    sid = lay.structure_id
    ids = np.concatenate(
        [
            [sid("<boi>"), *lay.size_ids(height, width)],
            _rows(codes, lay, sid("<eol>")),
            [sid("<eoi>")],
        ]
    ).astype(np.int64)
    return ids, modality_of(ids, lay, Modality.IMAGE)


def video_tokens(codes: np.ndarray, lay: VocabLayout) -> tuple[np.ndarray, np.ndarray]:
    """Ids and per-token modality of one video block from its latent code grids [T, H, W]."""
    codes = np.asarray(codes)
    if codes.ndim != 3 or codes.shape[0] < 1:
        raise ValueError(f"video codes must be [T>=1, H, W], got shape {codes.shape}")
    _check_codes(codes, lay)
    _, height, width = codes.shape
    sid = lay.structure_id
    parts = [np.array([sid("<bov>"), *lay.size_ids(height, width)])]
    for frame in codes:
        parts += [np.array([sid("<frame>")]), _rows(frame, lay, sid("<eol>"))]
    parts.append(np.array([sid("<eov>")]))
    ids = np.concatenate(parts).astype(np.int64)
    return ids, modality_of(ids, lay, Modality.VIDEO)


def modality_of(ids: np.ndarray, lay: VocabLayout, code_modality: Modality) -> np.ndarray:
    mod = np.full(ids.shape, int(Modality.STRUCTURE), dtype=np.uint8)
    mod[ids >= lay.visual_offset] = int(code_modality)
    return mod


def image_block_len(h: int, w: int) -> int:
    return 3 + h * (w + 1) + 1


def video_block_len(t: int, h: int, w: int) -> int:
    return 3 + t * (1 + h * (w + 1)) + 1


class _Reader:
    def __init__(self, ids, lay: VocabLayout):
        self.ids = [int(token) for token in ids]
        self.lay = lay
        self.pos = 0

    def name(self, i: int) -> str:
        lay = self.lay
        if lay.structure_offset <= i < lay.visual_offset:
            return lay.structure[i - lay.structure_offset]
        return f"code {i - lay.visual_offset}" if lay.is_code(i) else f"text id {i}"

    def take(self, expected: str) -> None:
        got = self.next()
        if got != self.lay.structure_id(expected):
            raise ValueError(f"position {self.pos - 1}: expected {expected}, got {self.name(got)}")

    def next(self) -> int:
        if self.pos >= len(self.ids):
            raise ValueError(f"block ends early at position {self.pos}")
        self.pos += 1
        return self.ids[self.pos - 1]

    def size(self) -> tuple[int, int]:
        out = []
        for axis in "hw":
            token = self.next()
            name = self.name(token)
            if not name.startswith(f"<{axis}="):
                raise ValueError(
                    f"position {self.pos - 1}: expected a <{axis}=K> size token, got {name}"
                )
            out.append(int(name[3:-1]))
        return out[0], out[1]

    def rows(self, h: int, w: int) -> np.ndarray:
        codes = np.empty((h, w), dtype=np.int64)
        for row in range(h):
            for col in range(w):
                token = self.next()
                if not self.lay.is_code(token):
                    raise ValueError(
                        f"position {self.pos - 1}: expected a code (row {row}, col {col}), "
                        f"got {self.name(token)}"
                    )
                codes[row, col] = token - self.lay.visual_offset
            self.take("<eol>")
        return codes

    def done(self) -> None:
        if self.pos != len(self.ids):
            raise ValueError(f"{len(self.ids) - self.pos} token(s) after the end of the block")


def parse_image(ids, lay: VocabLayout) -> np.ndarray:
    """The code grid [H, W] of an image block; ValueError if the block is malformed."""
    reader = _Reader(ids, lay)
    reader.take("<boi>")
    height, width = reader.size()
    codes = reader.rows(height, width)
    reader.take("<eoi>")
    reader.done()
    return codes


def parse_video(ids, lay: VocabLayout) -> np.ndarray:
    """The latent code grids [T, H, W] of a video block; ValueError if malformed."""
    reader = _Reader(ids, lay)
    reader.take("<bov>")
    height, width = reader.size()
    frames = []
    while True:
        token = reader.next()
        if token == lay.structure_id("<eov>"):
            break
        if token != lay.structure_id("<frame>"):
            raise ValueError(
                f"position {reader.pos - 1}: expected <frame> or <eov>, got {reader.name(token)}"
            )
        frames.append(reader.rows(height, width))
    reader.done()
    if not frames:
        raise ValueError("video block without frames")
    return np.stack(frames)
