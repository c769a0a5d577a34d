"""Packed batches for the GPU tests: rows of several documents, one with image blocks, on the GPU.
Plain tensors built here (the GPU tests load none of the CPU tests' fixtures)."""

from __future__ import annotations

import torch

from data.vocab import Modality


def packed_batch(rows: int, seq_len: int, vocab: int, device, *, docs: int = 4, seed: int = 0):
    """``rows`` rows of ``seq_len`` tokens, ``docs`` documents each (the last padded), one image
    block of 3 x 8 codes in the middle of every row's second document."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=gen)
    doc = (torch.arange(seq_len) * docs // seq_len).expand(rows, seq_len).clone()
    pad = seq_len - seq_len // (4 * docs)
    doc[:, pad:] = -1
    labels = torch.cat([ids[:, 1:], torch.full((rows, 1), -100)], dim=1)
    last = torch.cat([doc[:, 1:] != doc[:, :-1], torch.ones(rows, 1, dtype=torch.bool)], dim=1)
    labels[last | (doc < 0)] = -100
    modality = torch.full((rows, seq_len), int(Modality.TEXT))
    image = torch.full((rows, seq_len), -1)
    start = seq_len // docs + seq_len // (4 * docs)
    image[:, start : start + 24] = 0  # image 0 of each row
    modality[:, start : start + 24] = int(Modality.IMAGE)
    label_modality = torch.cat([modality[:, 1:], modality[:, -1:]], dim=1)
    starts = torch.cat([torch.ones(rows, 1, dtype=torch.bool), doc[:, 1:] != doc[:, :-1]], dim=1)
    positions = torch.arange(seq_len).expand(rows, seq_len)
    position_ids = positions - torch.where(starts, positions, 0).cummax(dim=1).values
    batch = {
        "input_ids": ids,
        "labels": labels,
        "modality": modality,
        "label_modality": label_modality,
        "doc_ids": doc,
        "position_ids": position_ids,
        "position_thw": position_ids[..., None].repeat(1, 1, 3),
        "image_ids": image,
    }
    return {key: value.to(device) for key, value in batch.items()}
