"""A packed batch in its compact layout, and the one vectorised pass that turns it into the
per-token fields the trainer takes.

Design choices:
- What the packer decides is small: per token only the id and the modality; per stretch of one
  document in a row (a *segment*) where it lies, which piece it belongs to, how far into the
  piece it starts and what its last token predicts; per visual block where it lies, its grid
  (t, h, w) and where its piece ends. Everything else the model takes (labels, label
  modalities, document ids, 1-D and M-RoPE positions, image ids) follows from those by a few
  vector operations, so the packer writes 5 bytes a token (int32 id, uint8 modality) and a
  table, and a DataLoader worker hands over that instead of ten fields a token (44 bytes:
  int64 labels, the rest int32; batch_buffer.BATCH_DTYPES).
- ``expand`` runs where the batch is handed out: in the trainer's process after the worker
  queue (reading straight from the worker's slot of shared memory, data/loader/transport.py),
  and in-process right after packing. What it writes is, value for value, what the packer
  wrote field by field before (tools/bench/bench_loader_versions.py --check --values compares
  the two; the dtypes have since narrowed).
- numpy (and the same compiled with numba where it is installed, expand_kernel.py: one pass
  instead of ~13), not torch: on this path each torch call costs several microseconds of
  dispatch, and torch splits large copies over its intra-op threads, which on a loaded machine
  waited ms for a copy that takes 0.1 ms (data/loader/transport.py). The outputs are torch tensors all the same:
  ``fields`` are numpy views of the batch's one torch buffer (batch_buffer.BatchBuffer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from data.vocab import Modality

IGNORE = -100
_TEXT, _IMAGE = int(Modality.TEXT), int(Modality.IMAGE)

# Columns of CompactBatch.segments
SEG_START, SEG_END, SEG_PIECE, SEG_OFFSET, SEG_LABEL, SEG_LABEL_MOD = range(6)
# Columns of CompactBatch.blocks
BLK_START, BLK_PIECE_END, BLK_T, BLK_H, BLK_W = range(5)


@dataclass(slots=True)
class CompactBatch:
    """One batch of ``rows`` rows of ``seq_len`` tokens, compact. Positions are flat: row i's
    token j is ``i * seq_len + j``.

    - ``ids``, ``mod``: [rows * seq_len] token ids and modalities, padding included (any integer
      dtype: int32 and uint8 in a worker's slot; None while the batch crosses to the trainer's
      process, which finds them in the slot);
    - ``segments``: int64 [n, 6] (start, end, piece, position offset, last label, last label
      modality): the stretches of one document each, and after a row's real tokens its padding
      as one more (piece: the row's piece count, or -1 in an empty row; label -100). They tile
      the batch in order. A piece's positions run from 0 at its first token; a segment that
      continues a piece (the document's next chunk, right after it) starts ``offset`` in;
    - ``blocks``: int64 [k, 5] (start, end of its piece, t, h, w) of the visual blocks, in row
      order (t = 0: an image);
    - ``real``: int64 [rows] real tokens of each row (the rest is padding).
    """

    rows: int
    seq_len: int
    ids: np.ndarray | None
    mod: np.ndarray | None
    segments: np.ndarray
    blocks: np.ndarray
    real: np.ndarray

    def tables(self) -> CompactBatch:
        """The batch without its per-token arrays: what crosses the worker queue (pickled)."""
        return CompactBatch(
            self.rows, self.seq_len, None, None, self.segments, self.blocks, self.real
        )


# Per-token bytes of the compact layout in a worker's int32 slot: an int32 id and a uint8
# modality (the modalities packed four to an int32 element).
def slot_numel(rows: int, seq_len: int) -> int:
    n = rows * seq_len
    return n + (n + 3) // 4


def slot_views(slot: np.ndarray, rows: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [n], modalities uint8 [n]) of a worker's int32 slot."""
    n = rows * seq_len
    return slot[:n], slot[n:].view(np.uint8)[:n]


_ARANGE = np.arange(1 << 16, dtype=np.int64)


def arange(n: int) -> np.ndarray:
    """0 .. n - 1 (int64), a view of one cached range grown as batches need."""
    global _ARANGE
    if n > len(_ARANGE):
        _ARANGE = np.arange(max(n, 2 * len(_ARANGE)), dtype=np.int64)
    return _ARANGE[:n]


_BLOCK_POSITIONS: dict[tuple[int, int, int], tuple[np.ndarray, int]] = {}


def block_positions(t: int, h: int, w: int) -> tuple[np.ndarray, int]:
    """(int64 [block tokens, 3] M-RoPE offsets from the block's first position, how far the
    position moves past the block) of an image (t = 0) or video block of an h x w code grid:
    ``<boi>``/``<bov>`` and the two size tokens advance all three; per frame (video: after its
    ``<frame>`` marker at (f, 0, 0)) the codes and row ends take (f, row, col); after the block
    the position continues past its largest extent, where ``<eoi>``/``<eov>`` sits (Qwen2-VL).
    Built once per grid shape and reused."""
    key = (t, h, w)
    if key not in _BLOCK_POSITIONS:
        frames = max(t, 1)
        parts = [np.repeat(np.arange(3)[:, None], 3, 1)]
        rows = np.repeat(np.arange(h), w + 1)
        cols = np.tile(np.arange(w + 1), h)
        for f in range(frames):
            if t:
                parts.append(np.asarray([[3 + f, 3, 3]]))
            parts.append(np.stack([np.full(h * (w + 1), 3 + f), 3 + rows, 3 + cols], -1))
        extent = 3 + max(frames, h, w + 1)
        parts.append(np.asarray([[extent] * 3]))
        offsets = np.concatenate(parts).astype(np.int64)
        offsets.setflags(write=False)
        _BLOCK_POSITIONS[key] = (offsets, extent + 1)
    return _BLOCK_POSITIONS[key]


def expand(batch: CompactBatch, fields: dict[str, np.ndarray]) -> None:
    """``expand_numpy``, compiled (data/loader/expand_kernel.py) where numba is installed."""
    if _compiled is not None:
        _compiled(batch, fields)
    else:
        expand_numpy(batch, fields)


def expand_numpy(batch: CompactBatch, fields: dict[str, np.ndarray]) -> None:
    """Write every per-token field of ``batch`` into ``fields`` (batch_buffer.BatchBuffer's: attr ->
    [rows, seq_len] arrays, ``thw`` [rows, seq_len, 3]):

    - ``ids``, ``mod``: copied (widened) from the batch, unless they already are these arrays;
    - ``labels`` / ``label_mod``: the next token's id and modality; at a segment's end the
      document's next token (-100 after its last token, before a dropped block, on padding);
    - ``doc_ids``: the segment's piece; ``pos``: from 0 at each piece's first token, 0 on padding;
    - ``thw`` (M-RoPE): the 1-D position in all three, except that each visual block takes its
      grid's offsets from where it starts and the text after it in its piece moves on by how far
      the block moved the position beyond its length;
    - ``image_ids``: -1, except an image's codes, which carry the image's number in its row.
    """
    B, L = batch.rows, batch.seq_len
    n = B * L
    flat = {k: v.reshape(n, *v.shape[2:]) for k, v in fields.items()}
    ids, mod, labels, label_mod = flat["ids"], flat["mod"], flat["labels"], flat["label_mod"]
    assert batch.ids is not None and batch.mod is not None
    if not np.may_share_memory(ids, batch.ids):
        np.copyto(ids, batch.ids)
    if not np.may_share_memory(mod, batch.mod):
        np.copyto(mod, batch.mod)
    seg = batch.segments
    starts, ends = seg[:, SEG_START], seg[:, SEG_END]
    lengths = ends - starts
    labels[:-1] = ids[1:]
    label_mod[:-1] = mod[1:]
    labels[ends - 1] = seg[:, SEG_LABEL]
    label_mod[ends - 1] = seg[:, SEG_LABEL_MOD]
    flat["doc_ids"][:] = np.repeat(seg[:, SEG_PIECE], lengths)
    pos = flat["pos"]
    np.subtract(arange(n), np.repeat(starts - seg[:, SEG_OFFSET], lengths), out=pos)
    flat["image_ids"][:] = -1
    for i in np.flatnonzero(batch.real < L).tolist():
        padding = slice(i * L + int(batch.real[i]), (i + 1) * L)
        labels[padding] = IGNORE
        label_mod[padding] = _TEXT
        pos[padding] = 0
    thw = flat["thw"]
    if len(batch.blocks):
        _visual(batch, pos, mod, thw, flat["image_ids"])
    else:  # strided copies are far cheaper than a broadcast into the [n, 3] view
        thw_flat = thw.reshape(-1)
        thw_flat[0::3] = pos
        thw_flat[1::3] = pos
        thw_flat[2::3] = pos


_compiled: Callable[[CompactBatch, dict], None] | None
try:
    from data.loader.expand_kernel import expand_compiled as _compiled
except ImportError:  # numba absent: numpy
    _compiled = None


def _visual(
    batch: CompactBatch, pos: np.ndarray, mod: np.ndarray, thw: np.ndarray, image_ids: np.ndarray
) -> None:
    """M-RoPE positions and image numbers of a batch with visual blocks. Each block takes its
    grid's offsets added to where it starts (its 1-D position plus how far the earlier blocks
    of its piece moved the position beyond their lengths); the text after it, up to the next
    block or its piece's end, moves on by as much. A few slice operations a block (a gather over every block token at once measured several times slower:
    blocks are most of a batch's tokens, and contiguous slices copy at memory speed)."""
    L = batch.seq_len
    thw_flat = thw.reshape(-1)
    thw_flat[0::3] = pos
    thw_flat[1::3] = pos
    thw_flat[2::3] = pos
    blocks = batch.blocks.tolist()
    row, n_img = -1, 0
    shift = 0  # how far the blocks so far of the piece moved the position beyond their lengths
    for i, (start, last, t, h, w) in enumerate(blocks):
        if i == 0 or blocks[i - 1][1] != last:  # the first block of its piece (ends differ)
            shift = 0
        offsets, advance = block_positions(t, h, w)
        end = start + len(offsets)
        np.add(offsets, pos.item(start) + shift, out=thw[start:end])
        if t == 0:  # an image: its codes carry its number in the row (bidirectional attention)
            if start // L != row:
                row, n_img = start // L, 0
            np.copyto(image_ids[start:end], n_img, where=mod[start:end] == _IMAGE)
            n_img += 1
        shift += advance - len(offsets)
        # The text after the block, up to the piece's next block or its end
        stop = blocks[i + 1][0] if i + 1 < len(blocks) and blocks[i + 1][1] == last else last
        if shift and end < stop:
            thw[end:stop] += shift
