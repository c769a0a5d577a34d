"""What a batch packed by the compiled loop (data/loader/pack_kernel.py) reports besides its
tokens, compiled: its real tokens per modality and each row's document pieces. Called by
stream_arrays.StreamArrays after each batch; apart from the loop, whose numba cache is keyed on its
own file only (a compiled function that called these would not see them change).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def count_modalities(out_mod, real, mod_count):
    """Real tokens per modality (data/vocab.py's five: text, code, image, video, structure;
    padding is not counted). Padding is text (the packer writes it so), so the other four are
    counted over the whole batch in one flat loop (which LLVM vectorises, unlike a loop per
    row's real tokens) and text is what is left of the real tokens."""
    n_code = n_image = n_video = n_structure = 0
    for i in range(out_mod.shape[0]):
        modality = out_mod[i]
        n_code += modality == 1
        n_image += modality == 2
        n_video += modality == 3
        n_structure += modality == 4
    n_real = 0
    for row in range(real.shape[0]):
        n_real += real[row]
    mod_count[0] = n_real - n_code - n_image - n_video - n_structure
    mod_count[1], mod_count[2], mod_count[3], mod_count[4] = (
        n_code,
        n_image,
        n_video,
        n_structure,
    )


@njit(cache=True)
def pieces_table(pieces, row_pieces):
    """int64 [rows, most pieces, 4] (source, sample, start, end) of each row's pieces, -1
    padded: which documents a batch holds (for checks and debugging; the model never sees it)."""
    B = row_pieces.shape[0]
    most = 0
    for row in range(B):
        most = max(most, row_pieces[row])
    out = np.full((B, most, 4), -1, np.int64)
    idx = 0
    for row in range(B):
        for j in range(row_pieces[row]):
            out[row, j, :] = pieces[idx, :]
            idx += 1
    return out
