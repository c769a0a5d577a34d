"""A compact batch expanded by the trainer, on its own device (torch), into the fields the model
takes: the same values as ``expand.expand`` (tests/test_data/test_expand_torch.py compares them).

Design choices:
- Why it exists: a loader that hands the trainer ten fields a token spends much of its
  CPU time writing them (~0.7 MB a batch of 8 x 2,048; 1.3 MB when all were int64); the compact batch is 5 bytes a token
  plus two small tables. What the peers of the field hand out is ids (and here modalities);
  their trainers shift labels and compute positions themselves.
- Why it is not the default (``data.expand: loader``): measured on an H200
  (tools/bench/bench_expand_device.py), these ~40 small operations cost the trainer's process
  1.4-1.7 ms a batch of 8 x 2,048 (kernel launches and the small tables' copies), 7.6-8.7x
  what expanding the batch on the CPU and queueing its 1.3 MB copy from pinned memory cost (then
  all int64; now 0.7 MB). Kept as
  ``data.expand: trainer`` for batches whose CPU expansion would cost more than that, and tested
  on the CPU (a debug run trains bit-identically either way). Evaluation, the probes and tools
  read fully expanded batches.
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
    ids, mod, seg, blocks, real = (batch[k] for k in COMPACT_KEYS)
    fields = expand_fields(ids, mod, seg, blocks, real, device=device)
    rest = {k: v for k, v in batch.items() if k not in COMPACT_KEYS}
    return {**rest, **fields}


def _per_token(v, batch) -> bool:
    return torch.is_tensor(v) and v.shape[:2] == batch["input_ids"].shape


def expand_fields(ids, mod, seg, blocks, real, *, device) -> dict[str, torch.Tensor]:
    """input_ids ... position_thw ([rows, L] / [rows, L, 3], the dtypes of the loader's expansion:
    int64 labels, the rest int32, batch_buffer.BATCH_DTYPES) on ``device`` of a compact
    batch given on the CPU: ids and modalities [rows, L] (any integer dtype), segments [n, 6],
    blocks [k, 5], real [rows] (data/loader/expand.py's CompactBatch). What depends on a block
    only is worked out on the CPU from its small table; on the device every operation is per
    token and none waits for the device (no boolean indexing, no size read back)."""
    B, L = ids.shape
    n = B * L
    plan = _block_plan(blocks, L) if len(blocks) else None
    ids, mod, seg, real = (x.to(device, non_blocking=True) for x in (ids, mod, seg, real))
    # int64 to compute with (index_put and repeat_interleave want one dtype); the fields handed
    # on are the narrow ones, so the ids and modalities as they came (int32 ids: no cast)
    ids_in, mod_in = ids.reshape(n), mod.reshape(n)
    ids, mod = ids_in.long(), mod_in.long()
    starts, ends = seg[:, 0], seg[:, 1]
    lengths = ends - starts
    labels = torch.empty_like(ids)
    labels[:-1] = ids[1:]
    labels[ends - 1] = seg[:, 4]
    label_mod = torch.empty_like(mod)
    label_mod[:-1] = mod[1:]
    label_mod[ends - 1] = seg[:, 5]
    doc_ids = torch.repeat_interleave(seg[:, 2], lengths, output_size=n)
    pos = torch.arange(n, device=device) - torch.repeat_interleave(
        starts - seg[:, 3], lengths, output_size=n
    )
    padding = (torch.arange(L, device=device)[None, :] >= real[:, None]).reshape(n)
    labels = torch.where(padding, IGNORE, labels)
    label_mod = torch.where(padding, _TEXT, label_mod)
    pos = torch.where(padding, 0, pos)
    image_ids = torch.full_like(ids, -1)
    thw = pos[:, None].repeat(1, 3)
    if plan is not None:
        _visual(plan, pos, mod, thw, image_ids, n, device)
    shape = (B, L)
    narrow = torch.int32  # computed in int64 (what repeat_interleave and indexing give)
    return {
        "input_ids": ids_in.view(shape).to(narrow),
        "labels": labels.view(shape),
        "modality": mod_in.view(shape).to(narrow),
        "label_modality": label_mod.view(shape).to(narrow),
        "doc_ids": doc_ids.view(shape).to(narrow),
        "position_ids": pos.view(shape).to(narrow),
        "image_ids": image_ids.view(shape).to(narrow),
        "position_thw": thw.view(B, L, 3).to(narrow),
    }


def _block_plan(blocks: torch.Tensor, L: int) -> dict:
    """Per block, on the CPU (a few dozen rows): its start, where its piece ends, its grid,
    its length in tokens, how far it moves the position past its length, and its image number
    in its row (-1: a video); and the blocks' tokens in all."""
    blocks = blocks.cpu()
    start, last, t, h, w = blocks.unbind(1)
    frames = t.clamp(min=1)
    per_frame = h * (w + 1) + (t > 0).long()  # a video frame starts with its <frame> marker
    size = 3 + frames * per_frame + 1
    extent = 3 + torch.maximum(torch.maximum(frames, h), w + 1)
    number = torch.full_like(t, -1)  # images numbered within their row, in order
    row, count = -1, 0
    for k, (begin, grid_t) in enumerate(zip(start.tolist(), t.tolist())):
        if grid_t == 0:
            if begin // L != row:
                row, count = begin // L, 0
            number[k] = count
            count += 1
    return {
        "start": start,
        "last": last,
        "t": t,
        "w": w,
        "per_frame": per_frame,
        "size": size,
        "extent": extent,
        "moved": extent + 1 - size,
        "number": number,
        "total": int(size.sum()),
    }


def _visual(plan: dict, pos, mod, thw, image_ids, n, device) -> None:
    on = {k: v.to(device, non_blocking=True) for k, v in plan.items() if k != "total"}
    total, size = plan["total"], on["size"]
    # Shift of every token: +moved from each block's end to its piece's end (blocks of one piece
    # add up; another piece's are cancelled where theirs ends)
    delta = torch.zeros(n + 1, dtype=torch.long, device=device)
    delta.index_add_(0, on["start"] + size, on["moved"])
    delta.index_add_(0, on["last"], -on["moved"])
    thw += delta[:n].cumsum(0)[:, None]
    # Each block token: its offset in the grid in place of its index in the block
    which = torch.repeat_interleave(torch.arange(len(size), device=device), size, output_size=total)
    q = torch.arange(total, device=device) - torch.repeat_interleave(
        size.cumsum(0) - size, size, output_size=total
    )
    at = on["start"][which] + q
    video, width = on["t"][which] > 0, on["w"][which] + 1
    j = (q - 3).clamp(min=0)
    frame = j // on["per_frame"][which]
    cell = j % on["per_frame"][which] - video.long()  # -1: the frame's marker
    marker = cell < 0
    grid_y = torch.where(marker, 0, cell.clamp(min=0) // width)
    grid_x = torch.where(marker, 0, cell.clamp(min=0) % width)
    off = torch.stack([3 + frame, 3 + grid_y, 3 + grid_x], 1)
    head = (q < 3)[:, None]  # <boi>/<bov> and the two size tokens: (q, q, q)
    tail = (q == size[which] - 1)[:, None]  # <eoi>/<eov>: past the largest extent
    off = torch.where(head, q[:, None], off)
    off = torch.where(tail, on["extent"][which][:, None], off)
    thw[at] += off - q[:, None]
    # Images: their codes carry the image's number in its row
    number = on["number"][which]
    image_ids[at] = torch.where((number >= 0) & (mod[at] == _IMAGE), number, image_ids[at])
