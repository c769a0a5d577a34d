"""A packed batch's per-token fields as the trainer takes them (``ROW_FIELDS``, their dtypes
``BATCH_DTYPES``) and the one buffer that holds them all (``BatchBuffer``): ``expand``
(data/loader/expand.py) writes a compact batch into it, and ``split`` hands its tensors out as
views. Apart from the packing loop (pack_kernel.py), which decides what goes into a row.
"""

from __future__ import annotations

import numpy as np

# The per-token fields of a batch: the buffer's name of each -> the trainer's key
ROW_FIELDS = {
    "ids": "input_ids",
    "labels": "labels",
    "mod": "modality",
    "label_mod": "label_modality",
    "doc_ids": "doc_ids",
    "pos": "position_ids",
    "image_ids": "image_ids",
}
# Their dtypes. Labels are int64: cross-entropy and its gathers and scatters take int64 targets.
# Everything else is int32 (ids, positions and document or image numbers fit many times over):
# writing the fields is most of what expanding a batch costs, and a GPU run copies them. Not
# uint8 modalities: torch reads a uint8 index tensor as a boolean mask (model/layers.py).
BATCH_DTYPES: dict[str, np.dtype] = {key: np.dtype(np.int32) for key in ROW_FIELDS.values()}
BATCH_DTYPES |= {"labels": np.dtype(np.int64), "position_thw": np.dtype(np.int32)}
# The int32 fields in the order they lie in a batch's buffer, after the labels
_INT32_ROW = tuple(attr for attr in ROW_FIELDS if attr != "labels")


class BatchBuffer:
    """Every per-token field of a batch of ``rows`` rows in one buffer of bytes: ``labels``
    (int64 [rows, L]), then the other fields above (int32 [rows, L] each), then ``position_thw``
    (int32 [rows, L, 3]), each contiguous. Rows are views of it; ``expand``
    (data/loader/expand.py) writes a compact batch into it, and the trainer gets its views
    without a copy (``split``). ``pin``: in pinned memory (for a copy to the GPU)."""

    def __init__(self, rows: int, seq_len: int, *, pin: bool = False) -> None:
        import torch

        self.rows, self.L = rows, seq_len
        self.tensor = torch.empty(self.nbytes(rows, seq_len), dtype=torch.uint8, pin_memory=pin)
        self.pinned = pin
        n, k = rows * seq_len, len(_INT32_ROW)
        flat = self.tensor.numpy()
        int32 = flat[8 * n :].view(np.int32)
        # Not filled: expand writes every position of the batch.
        self.fields: dict[str, np.ndarray] = {
            "labels": flat[: 8 * n].view(np.int64).reshape(rows, seq_len)
        }
        for i, attr in enumerate(_INT32_ROW):
            self.fields[attr] = int32[i * n : (i + 1) * n].reshape(rows, seq_len)
        self.fields["thw"] = int32[k * n :].reshape(rows, seq_len, 3)

    def split(self) -> dict:
        """The batch's tensors (``input_ids`` ... ``position_thw``), views of the buffer. From the
        numpy views it holds (``torch.from_numpy``, one light call a field: slicing a tensor goes
        through torch's dispatcher for every view), except a pinned buffer's, whose views must be
        views of the pinned tensor: a few torch calls for all of them."""
        import torch

        if not self.pinned:
            return {key: torch.from_numpy(self.fields[attr]) for key, attr in _SPLIT_KEYS}
        n, k = self.rows * self.L, len(_INT32_ROW)
        int32 = self.tensor[8 * n :].view(torch.int32)
        views = dict(zip(_INT32_ROW, int32[: k * n].view(k, self.rows, self.L).unbind(0)))
        views["labels"] = self.tensor[: 8 * n].view(torch.int64).view(self.rows, self.L)
        views["thw"] = int32[k * n :].view(self.rows, self.L, 3)
        return {key: views[attr] for key, attr in _SPLIT_KEYS}

    @staticmethod
    def nbytes(rows: int, seq_len: int) -> int:
        return (8 + 4 * (len(_INT32_ROW) + 3)) * rows * seq_len


# A split batch's keys and the buffer's names of them: ROW_FIELDS', then position_thw
_SPLIT_KEYS = (*((key, attr) for attr, key in ROW_FIELDS.items()), ("position_thw", "thw"))
