"""A packed batch in its compact layout, and the one compiled pass that turns it into the
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
  and in-process right after packing.
- Compiled with numba (expand_kernel.py: one pass per field group), not torch: on this path each torch call costs several microseconds of
  dispatch, and torch splits large copies over its intra-op threads, which on a loaded machine
  waited ms for a copy that takes 0.1 ms (data/loader/transport.py). The outputs are torch tensors all the same:
  ``fields`` are numpy views of the batch's one torch buffer (batch_buffer.BatchBuffer).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.loader.expand_kernel import expand_compiled

IGNORE = -100

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


def expand(batch: CompactBatch, fields: dict[str, np.ndarray]) -> None:
    """Write every per-token field of ``batch`` into ``fields`` (batch_buffer.BatchBuffer's: attr ->
    [rows, seq_len] arrays, ``thw`` [rows, seq_len, 3]), compiled (data/loader/expand_kernel.py):

    - ``ids``, ``mod``: copied (widened) from the batch, unless they already are these arrays;
    - ``labels`` / ``label_mod``: the next token's id and modality; at a segment's end the
      document's next token (-100 after its last token, before a dropped block, on padding);
    - ``doc_ids``: the segment's piece; ``pos``: from 0 at each piece's first token, 0 on padding;
    - ``thw`` (M-RoPE): the 1-D position in all three, except that each visual block takes its
      grid's offsets from where it starts and the text after it in its piece moves on by how far
      the block moved the position beyond its length;
    - ``image_ids``: -1, except an image's codes, which carry the image's number in its row.
    """
    expand_compiled(batch, fields)
