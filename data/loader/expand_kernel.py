"""``expand`` (data/loader/expand.py) compiled: the per-token fields of a compact batch in one
pass per field group instead of ~13 numpy passes over the batch, each token's values computed
where it is written. Same results bit for bit (tests/test_data/test_loader_expand.py compares
the two on batches with images, videos, padding and dropped blocks)."""

from __future__ import annotations

import numpy as np
from numba import njit

IGNORE = -100
TEXT, IMAGE = 0, 2  # Modality.TEXT, Modality.IMAGE (a test checks they agree)


@njit(cache=True)
def expand_fields(seg, blocks, real, ids, mod, labels, label_mod, doc_ids, pos, image_ids, thw, L):
    for seg_i in range(seg.shape[0]):
        seg_a, seg_b, piece, offset = seg[seg_i, 0], seg[seg_i, 1], seg[seg_i, 2], seg[seg_i, 3]
        position = offset
        for tok in range(seg_a, seg_b):
            doc_ids[tok] = piece
            pos[tok] = position
            image_ids[tok] = -1
            thw[tok, 0] = position
            thw[tok, 1] = position
            thw[tok, 2] = position
            position += 1
        for tok in range(seg_a, seg_b - 1):  # the next token; the segment's last: its own label
            labels[tok] = ids[tok + 1]
            label_mod[tok] = mod[tok + 1]
        if seg_b > seg_a:
            labels[seg_b - 1] = seg[seg_i, 4]
            label_mod[seg_b - 1] = seg[seg_i, 5]
    for row_i in range(real.shape[0]):  # padding: positions 0, nothing to predict
        for tok in range(row_i * L + real[row_i], (row_i + 1) * L):
            labels[tok] = IGNORE
            label_mod[tok] = TEXT
            pos[tok] = 0
            thw[tok, 0] = 0
            thw[tok, 1] = 0
            thw[tok, 2] = 0
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
        if block == 0 or blocks[block - 1, 1] != last:  # the first block of its piece
            shift = 0
        base = pos[start] + shift
        frames = max(t, 1)
        extent = 3 + max(frames, h, w + 1)
        size = 3 + frames * (h * (w + 1) + (1 if t else 0)) + 1
        if start < 0 or start + size > last or last > thw.shape[0]:
            # numpy's expansion raises on such a block too (a grid that disagrees with its span)
            raise ValueError("expand: a visual block's grid does not fit where it lies")
        tok = start
        for cell in range(3):  # <boi>/<bov> and the two size tokens
            thw[tok, 0] = base + cell
            thw[tok, 1] = base + cell
            thw[tok, 2] = base + cell
            tok += 1
        for frame in range(frames):
            if t:  # a video frame's marker
                thw[tok, 0] = base + 3 + frame
                thw[tok, 1] = base + 3
                thw[tok, 2] = base + 3
                tok += 1
            for grid_y in range(h):
                for grid_x in range(w + 1):
                    thw[tok, 0] = base + 3 + frame
                    thw[tok, 1] = base + 3 + grid_y
                    thw[tok, 2] = base + 3 + grid_x
                    tok += 1
        thw[tok, 0] = base + extent
        thw[tok, 1] = base + extent
        thw[tok, 2] = base + extent
        end = tok + 1
        if t == 0:  # an image: its codes carry its number in the row
            if start // L != row:
                row, n_img = start // L, 0
            for cell in range(start, end):
                if mod[cell] == IMAGE:
                    image_ids[cell] = n_img
            n_img += 1
        shift += extent + 1 - (end - start)
        stop = (
            blocks[block + 1, 0] if block + 1 < n_blocks and blocks[block + 1, 1] == last else last
        )
        if shift:
            for cell in range(end, stop):
                thw[cell, 0] += shift
                thw[cell, 1] += shift
                thw[cell, 2] += shift


def expand_compiled(batch, fields: dict) -> None:
    """``expand.expand``'s contract, compiled."""
    B, L = batch.rows, batch.seq_len
    n = B * L
    frame = {seg_i: v.reshape(n, *v.shape[2:]) for seg_i, v in fields.items()}
    if not np.may_share_memory(frame["ids"], batch.ids):
        np.copyto(frame["ids"], batch.ids)
    if not np.may_share_memory(frame["mod"], batch.mod):
        np.copyto(frame["mod"], batch.mod)
    expand_fields(
        batch.segments,
        batch.blocks,
        batch.real,
        frame["ids"],
        frame["mod"],
        frame["labels"],
        frame["label_mod"],
        frame["doc_ids"],
        frame["pos"],
        frame["image_ids"],
        frame["thw"],
        L,
    )
