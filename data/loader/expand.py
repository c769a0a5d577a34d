"""A packed batch in its compact layout, and the one compiled pass that turns it into the
per-token fields the trainer takes, where the batch is handed out (docs/loader.md, "One read per
document; a compact batch, expanded where it is handed out"): the packer writes 5 bytes a token
(int32 id, uint8 modality) and two small tables, and a DataLoader worker hands over that instead
of ten fields a token (44 bytes: int64 labels, the rest int32; batch_buffer.BATCH_DTYPES).

Compiled with numba (one pass per field group, each token's values computed where it is
written), not torch: on this path each torch call costs several microseconds of dispatch, and
torch splits large copies over its intra-op threads, which on a loaded machine waited ms for a
copy that takes 0.1 ms (data/loader/transport.py). The outputs are torch tensors all the same:
``fields`` are numpy views of the batch's one torch buffer (batch_buffer.BatchBuffer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from numba import njit

from data.vocab import Modality

IGNORE = -100
TEXT, IMAGE = int(Modality.TEXT), int(Modality.IMAGE)
# The fields ``expand_fields`` writes besides the ids, in the order it takes them
_OUTPUTS = ("mod", "labels", "label_mod", "doc_ids", "pos", "image_ids", "thw")


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
        return replace(self, ids=None, mod=None)


# Per-token bytes of the compact layout in a worker's int32 slot: an int32 id and a uint8
# modality (the modalities packed four to an int32 element).
def slot_numel(rows: int, seq_len: int) -> int:
    n = rows * seq_len
    return n + (n + 3) // 4


def slot_views(slot: np.ndarray, rows: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [n], modalities uint8 [n]) of a worker's int32 slot."""
    n = rows * seq_len
    return slot[:n], slot[n:].view(np.uint8)[:n]


@njit(cache=True, inline="always")
def _put_thw(thw, k, t, h, w):
    """One token's M-RoPE position (t, h, w) at ``thw[k : k + 3]``; the next token's ``k``."""
    thw[k], thw[k + 1], thw[k + 2] = t, h, w
    return k + 3


@njit(cache=True)
def expand_fields(seg, blocks, real, ids, mod_in, outputs, L):
    """The per-token fields ([rows, L] each, ``thw`` [rows, L, 3]; C-contiguous) of a compact
    batch, written flat; ``outputs``: the fields of ``_OUTPUTS``."""
    mod, labels, label_mod, doc_ids, pos, image_ids, thw = outputs
    # reshape, not ravel: numba's reshape refuses a non-contiguous array where ravel would
    # silently write into a copy
    n = ids.size
    ids, mod, labels, label_mod = (
        ids.reshape(n),
        mod.reshape(n),
        labels.reshape(n),
        label_mod.reshape(n),
    )
    doc_ids, pos, image_ids = doc_ids.reshape(n), pos.reshape(n), image_ids.reshape(n)
    thw = thw.reshape(3 * n)
    # ``thw``: flat [n * 3]. Each field is written by a loop of its own over a contiguous range,
    # indexed from 0 (a view per segment): LLVM vectorises such loops, whereas an index that
    # starts at a value read from memory keeps numba's check for negative indices in the loop
    # and the loop scalar, several times slower.
    # labels: the next token's id/modality (a shifted copy), fixed at segment ends and padding
    for tok in range(n - 1):
        labels[tok] = ids[tok + 1]
    for tok in range(n):  # the modalities widened (uint8 -> the field's dtype) on the way
        mod[tok] = mod_in[tok]
    for tok in range(n - 1):
        label_mod[tok] = mod_in[tok + 1]
    for tok in range(n):
        image_ids[tok] = -1
    for seg_i in range(seg.shape[0]):
        seg_a, seg_b, piece, offset = seg[seg_i, 0], seg[seg_i, 1], seg[seg_i, 2], seg[seg_i, 3]
        if seg_b <= seg_a:
            continue
        if seg_a < 0 or seg_b > n:
            raise ValueError("expand: a segment lies outside the batch")
        labels[seg_b - 1] = seg[seg_i, 4]
        label_mod[seg_b - 1] = seg[seg_i, 5]
        seg_doc, seg_pos, seg_thw = (
            doc_ids[seg_a:seg_b],
            pos[seg_a:seg_b],
            thw[3 * seg_a : 3 * seg_b],
        )
        for at in range(seg_doc.shape[0]):
            seg_doc[at] = piece
        for at in range(seg_pos.shape[0]):
            seg_pos[at] = offset + at
        for at in range(seg_pos.shape[0]):  # M-RoPE: the 1-D position in all three
            seg_thw[3 * at] = offset + at
            seg_thw[3 * at + 1] = offset + at
            seg_thw[3 * at + 2] = offset + at
    for row_i in range(real.shape[0]):  # padding: positions 0, nothing to predict
        pad_a, pad_b = row_i * L + real[row_i], (row_i + 1) * L
        pad_labels, pad_mod, pad_pos = labels[pad_a:pad_b], label_mod[pad_a:pad_b], pos[pad_a:pad_b]
        pad_thw = thw[3 * pad_a : 3 * pad_b]
        for at in range(pad_labels.shape[0]):
            pad_labels[at] = IGNORE
        for at in range(pad_mod.shape[0]):
            pad_mod[at] = TEXT
        for at in range(pad_pos.shape[0]):
            pad_pos[at] = 0
        for at in range(pad_thw.shape[0]):
            pad_thw[at] = 0
    row, n_img, shift = -1, 0, 0
    n_blocks = blocks.shape[0]
    for block in range(n_blocks):
        start, last, t, h, w = (
            blocks[block, 0],
            blocks[block, 1],
            blocks[block, 2],
            blocks[block, 3],
            blocks[block, 4],
        )
        if block == 0 or blocks[block - 1, 1] != last:
            shift = 0
        frames = max(t, 1)
        extent = 3 + max(frames, h, w + 1)
        size = 3 + frames * (h * (w + 1) + (1 if t else 0)) + 1
        if start < 0 or start + size > last or last > n:
            raise ValueError("expand: a visual block's grid does not fit where it lies")
        base = pos[start] + shift
        k = 3 * start
        for cell in range(3):
            k = _put_thw(thw, k, base + cell, base + cell, base + cell)
        for frame in range(frames):
            f = base + 3 + frame
            if t:
                k = _put_thw(thw, k, f, base + 3, base + 3)
            for grid_y in range(h):
                for grid_x in range(w + 1):
                    k = _put_thw(thw, k, f, base + 3 + grid_y, base + 3 + grid_x)
        k = _put_thw(thw, k, base + extent, base + extent, base + extent)
        end = k // 3
        if t == 0:
            if start // L != row:
                row, n_img = start // L, 0
            for cell in range(start, end):
                if mod_in[cell] == IMAGE:
                    image_ids[cell] = n_img
            n_img += 1
        shift += extent + 1 - (end - start)
        stop = (
            blocks[block + 1, 0] if block + 1 < n_blocks and blocks[block + 1, 1] == last else last
        )
        if stop < end or stop > last:
            raise ValueError("expand: a piece's next visual block starts inside this one")
        if shift:
            for cell in range(3 * end, 3 * stop):
                thw[cell] += shift


def expand(batch: CompactBatch, fields: dict[str, np.ndarray]) -> None:
    """Write every per-token field of ``batch`` into ``fields`` (batch_buffer.BatchBuffer's: attr ->
    [rows, seq_len] arrays, ``thw`` [rows, seq_len, 3]; C-contiguous: ``expand_fields`` flattens
    them, a view, free inside numba, where each reshape here is a Python call a batch). What each
    holds: docs/loader.md, "What a batch holds". ``ids`` and ``mod`` are copied (widened) from the
    batch unless they already are these arrays; in ``thw`` (M-RoPE) each visual block takes its
    grid's offsets from where it starts, and the text after it in its piece moves on by how far
    the block moved the position beyond its length.
    """
    B, L = batch.rows, batch.seq_len
    ids, ids_in, mod_in = fields["ids"], batch.ids, batch.mod
    size = B * L
    if ids_in is None or mod_in is None or ids_in.shape != (size,) or mod_in.shape != (size,):
        raise ValueError(f"expand: ids and modalities must be [{size}] for {B} x {L}")
    if not np.may_share_memory(ids, ids_in):
        np.copyto(ids.reshape(size), ids_in)
    # uint8 (as the packers write them; modalities are < 5): one compiled signature
    mod_in = mod_in if mod_in.dtype == np.uint8 else mod_in.astype(np.uint8)
    outputs = tuple(fields[attr] for attr in _OUTPUTS)
    expand_fields(batch.segments, batch.blocks, batch.real, ids, mod_in, outputs, L)
