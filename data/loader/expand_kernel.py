"""``expand`` (data/loader/expand.py): the per-token fields of a compact batch in one compiled
pass per field group, each token's values computed where it is written (not a pass over the
batch per vector operation)."""

from __future__ import annotations

import numpy as np
from numba import njit

IGNORE = -100
TEXT, IMAGE = 0, 2  # Modality.TEXT, Modality.IMAGE (a test checks they agree)


@njit(cache=True)
def expand_fields(
    seg, blocks, real, ids, mod_in, mod, labels, label_mod, doc_ids, pos, image_ids, thw, L
):
    """The per-token fields ([rows, L] each, ``thw`` [rows, L, 3]; C-contiguous) of a compact
    batch, written flat."""
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
            v = base + cell
            thw[k] = v
            thw[k + 1] = v
            thw[k + 2] = v
            k += 3
        for frame in range(frames):
            f = base + 3 + frame
            if t:
                thw[k] = f
                thw[k + 1] = base + 3
                thw[k + 2] = base + 3
                k += 3
            for grid_y in range(h):
                y = base + 3 + grid_y
                x0 = base + 3
                for grid_x in range(w + 1):
                    thw[k] = f
                    thw[k + 1] = y
                    thw[k + 2] = x0 + grid_x
                    k += 3
        v = base + extent
        thw[k] = v
        thw[k + 1] = v
        thw[k + 2] = v
        end = k // 3 + 1
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


def expand_compiled(batch, fields: dict) -> None:
    """``expand.expand``'s contract, compiled. The fields go in as they are ([rows, L], ``thw``
    [rows, L, 3], C-contiguous): the kernel flattens them (a view, free inside numba, where
    each reshape here is a Python call a batch)."""
    B, L = batch.rows, batch.seq_len
    ids = fields["ids"]
    if batch.ids.shape != (B * L,) or batch.mod.shape != (B * L,):
        raise ValueError(f"expand: ids and modalities must be [{B * L}] for {B} x {L}")
    if not np.may_share_memory(ids, batch.ids):
        np.copyto(ids.reshape(B * L), batch.ids)
    # uint8 (as the packers write them; modalities are < 5): one compiled signature
    mod_in = batch.mod if batch.mod.dtype == np.uint8 else batch.mod.astype(np.uint8)
    expand_fields(
        batch.segments,
        batch.blocks,
        batch.real,
        ids,
        mod_in,
        fields["mod"],
        fields["labels"],
        fields["label_mod"],
        fields["doc_ids"],
        fields["pos"],
        fields["image_ids"],
        fields["thw"],
        L,
    )
