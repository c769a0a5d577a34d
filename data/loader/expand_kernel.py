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
    for k in range(seg.shape[0]):
        a, b, piece, offset = seg[k, 0], seg[k, 1], seg[k, 2], seg[k, 3]
        p = offset
        for i in range(a, b - 1):
            labels[i] = ids[i + 1]
            label_mod[i] = mod[i + 1]
            doc_ids[i] = piece
            pos[i] = p
            image_ids[i] = -1
            thw[i, 0] = p
            thw[i, 1] = p
            thw[i, 2] = p
            p += 1
        if b > a:
            i = b - 1
            labels[i] = seg[k, 4]
            label_mod[i] = seg[k, 5]
            doc_ids[i] = piece
            pos[i] = p
            image_ids[i] = -1
            thw[i, 0] = p
            thw[i, 1] = p
            thw[i, 2] = p
    for r in range(real.shape[0]):  # padding: positions 0, nothing to predict
        for i in range(r * L + real[r], (r + 1) * L):
            labels[i] = IGNORE
            label_mod[i] = TEXT
            pos[i] = 0
            thw[i, 0] = 0
            thw[i, 1] = 0
            thw[i, 2] = 0
    row, n_img, shift = -1, 0, 0
    nb = blocks.shape[0]
    for j in range(nb):
        start, last, t, h, w = blocks[j, 0], blocks[j, 1], blocks[j, 2], blocks[j, 3], blocks[j, 4]
        if j == 0 or blocks[j - 1, 1] != last:  # the first block of its piece
            shift = 0
        base = pos[start] + shift
        frames = max(t, 1)
        extent = 3 + max(frames, h, w + 1)
        i = start
        for q in range(3):  # <boi>/<bov> and the two size tokens
            thw[i, 0] = base + q
            thw[i, 1] = base + q
            thw[i, 2] = base + q
            i += 1
        for f in range(frames):
            if t:  # a video frame's marker
                thw[i, 0] = base + 3 + f
                thw[i, 1] = base + 3
                thw[i, 2] = base + 3
                i += 1
            for y in range(h):
                for x in range(w + 1):
                    thw[i, 0] = base + 3 + f
                    thw[i, 1] = base + 3 + y
                    thw[i, 2] = base + 3 + x
                    i += 1
        thw[i, 0] = base + extent
        thw[i, 1] = base + extent
        thw[i, 2] = base + extent
        end = i + 1
        if t == 0:  # an image: its codes carry its number in the row
            if start // L != row:
                row, n_img = start // L, 0
            for q in range(start, end):
                if mod[q] == IMAGE:
                    image_ids[q] = n_img
            n_img += 1
        shift += extent + 1 - (end - start)
        stop = blocks[j + 1, 0] if j + 1 < nb and blocks[j + 1, 1] == last else last
        if shift:
            for q in range(end, stop):
                thw[q, 0] += shift
                thw[q, 1] += shift
                thw[q, 2] += shift


def expand_compiled(batch, fields: dict) -> None:
    """``expand.expand``'s contract, compiled."""
    B, L = batch.rows, batch.seq_len
    n = B * L
    f = {k: v.reshape(n, *v.shape[2:]) for k, v in fields.items()}
    if not np.may_share_memory(f["ids"], batch.ids):
        np.copyto(f["ids"], batch.ids)
    if not np.may_share_memory(f["mod"], batch.mod):
        np.copyto(f["mod"], batch.mod)
    expand_fields(
        batch.segments,
        batch.blocks,
        batch.real,
        f["ids"],
        f["mod"],
        f["labels"],
        f["label_mod"],
        f["doc_ids"],
        f["pos"],
        f["image_ids"],
        f["thw"],
        L,
    )
