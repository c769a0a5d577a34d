"""A compact batch expanded by the trainer, on its own device (torch), into the fields the model
takes: the same values as ``expand.expand`` (tests/test_data/test_expand_torch.py compares them).

Design choices:
- Why: a loader that hands the trainer ten int64 fields a token spends most of its CPU time
  writing them (~1.3 MB a batch of 8 x 2,048) and copying them to the GPU; the compact batch is
  5 bytes a token plus two small tables, and expanding it is a few dozen vector operations,
  microseconds on a GPU. What the peers of the field hand out is ids (and here modalities) too;
  their trainers shift labels and compute positions on the device as well.
- Which runs use it: the training stream of an LM run whose device is a GPU (``data.expand:
  auto``), or any run with ``data.expand: trainer`` (on CPU too: how the tests run this path).
  Evaluation, the probes and tools read fully expanded batches from their own loaders.
- Vectorised without a loop over blocks: M-RoPE's shift after a visual block is a cumulative
  sum of +shift at the block's end and -shift at its piece's end; each block token's (t, h, w)
  offset follows from its index in the block and the block's grid.
"""

from __future__ import annotations

import torch

from data.loader.expand import IGNORE
from data.vocab import Modality

_TEXT, _IMAGE = int(Modality.TEXT), int(Modality.IMAGE)
# Keys of a compact batch (PackedBatch.to_dict(compact=True)) besides the per-batch counts
COMPACT_KEYS = ("input_ids", "modality", "segments", "blocks", "row_real")


def is_compact(batch: dict) -> bool:
    return "segments" in batch


def expand_batch(batch: dict, device, keys=None) -> dict:
    """``batch`` with the model's fields on ``device``: a compact batch expanded there; a full
    one has ``keys`` (default: all its tensors of one value per token) moved there, the rest
    left as they are."""
    if not is_compact(batch):
        keys = keys if keys is not None else [k for k, v in batch.items() if _per_token(v, batch)]
        return {**batch, **{k: batch[k].to(device, non_blocking=True) for k in keys}}
    fields = expand_fields(
        *(batch[k].to(device, non_blocking=True) for k in COMPACT_KEYS), device=device
    )
    rest = {k: v for k, v in batch.items() if k not in COMPACT_KEYS}
    return {**rest, **fields}


def _per_token(v, batch) -> bool:
    return torch.is_tensor(v) and v.shape[:2] == batch["input_ids"].shape


def expand_fields(ids, mod, seg, blocks, real, *, device) -> dict[str, torch.Tensor]:
    """input_ids ... position_thw (int64, [rows, L] / [rows, L, 3]) of a compact batch: ids
    and modalities [rows, L] (any integer dtype), segments [n, 6], blocks [k, 5], real [rows]
    (data/loader/expand.py's CompactBatch)."""
    B, L = ids.shape
    n = B * L
    ids = ids.reshape(n).long()
    mod = mod.reshape(n).long()
    starts, ends = seg[:, 0], seg[:, 1]
    lengths = ends - starts
    labels = torch.empty_like(ids)
    labels[:-1] = ids[1:]
    labels[ends - 1] = seg[:, 4]
    label_mod = torch.empty_like(mod)
    label_mod[:-1] = mod[1:]
    label_mod[ends - 1] = seg[:, 5]
    doc_ids = torch.repeat_interleave(seg[:, 2], lengths, output_size=n)
    flat = torch.arange(n, device=device)
    pos = flat - torch.repeat_interleave(starts - seg[:, 3], lengths, output_size=n)
    padding = (torch.arange(L, device=device)[None, :] >= real[:, None]).reshape(n)
    labels[padding] = IGNORE
    label_mod[padding] = _TEXT
    pos[padding] = 0
    image_ids = torch.full_like(ids, -1)
    thw = pos[:, None].repeat(1, 3)
    if len(blocks):
        _visual(blocks, pos, mod, thw, image_ids, n, L, device)
    shape = (B, L)
    return {
        "input_ids": ids.view(shape),
        "labels": labels.view(shape),
        "modality": mod.view(shape),
        "label_modality": label_mod.view(shape),
        "doc_ids": doc_ids.view(shape),
        "position_ids": pos.view(shape),
        "image_ids": image_ids.view(shape),
        "position_thw": thw.view(B, L, 3),
    }


def _visual(blocks, pos, mod, thw, image_ids, n, L, device) -> None:
    start, last, t, h, w = blocks.unbind(1)
    frames = t.clamp(min=1)
    per_frame = h * (w + 1) + (t > 0).long()  # a video frame starts with its <frame> marker
    size = 3 + frames * per_frame + 1
    extent = 3 + torch.maximum(torch.maximum(frames, h), w + 1)
    moved = extent + 1 - size  # how far the block moves the position beyond its length
    # Shift of every token: +moved from each block's end to its piece's end (blocks of one piece
    # add up; another piece's are cancelled where theirs ends)
    delta = torch.zeros(n + 1, dtype=torch.long, device=device)
    delta.index_add_(0, start + size, moved)
    delta.index_add_(0, last, -moved)
    shift = delta[:n].cumsum(0)
    thw += shift[:, None]
    # Each block token: its offset in the grid in place of its index in the block
    total = int(size.sum())
    which = torch.repeat_interleave(
        torch.arange(len(blocks), device=device), size, output_size=total
    )
    q = torch.arange(total, device=device) - torch.repeat_interleave(
        size.cumsum(0) - size, size, output_size=total
    )
    at = start[which] + q
    bt, bw = t[which], w[which]
    j = (q - 3).clamp(min=0)
    f = j // per_frame[which]
    r = j % per_frame[which] - (bt > 0).long()  # -1: the frame's marker
    y, x = r.clamp(min=0) // (bw + 1), r.clamp(min=0) % (bw + 1)
    off = torch.stack([3 + f, 3 + y, 3 + x], 1)
    off[r < 0] = torch.stack([3 + f, torch.full_like(f, 3), torch.full_like(f, 3)], 1)[r < 0]
    head = q < 3  # <boi>/<bov> and the two size tokens
    off[head] = q[head, None].expand(-1, 3)
    tail = q == size[which] - 1
    off[tail] = extent[which][tail, None].expand(-1, 3)
    thw[at] += off - q[:, None]
    # Images: their codes carry the image's number in its row
    img = torch.nonzero(t == 0).squeeze(1)
    if len(img):
        row = start[img] // L
        first = torch.ones_like(row, dtype=torch.bool)
        first[1:] = row[1:] != row[:-1]
        group = first.long().cumsum(0) - 1
        group_start = torch.nonzero(first).squeeze(1)
        number = torch.arange(len(img), device=device) - group_start[group]
        per_block = torch.full((len(blocks),), -1, dtype=torch.long, device=device)
        per_block[img] = number
        code = (per_block[which] >= 0) & (mod[at] == _IMAGE)
        image_ids[at[code]] = per_block[which][code]
