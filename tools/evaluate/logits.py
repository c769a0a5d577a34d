"""Logits where they are needed, from the model's final hidden states: what the long-context
evaluations read at rows of any length.

A forward pass without labels returns the logits of every position, [B, T, V] in float32: at
128k tokens and a 64k vocabulary that is 34 GB a row. Here the model runs as it is, the output
head's input (the final-normed hidden states, [B, T, D]) is taken on its way in and the head is
handed an empty slice of it; the logits are then computed only at the positions scored
(``logits_at``), or chunk by chunk for a per-token CE (``token_ce``), with the head's own weight
(``OutputHead`` without labels is ``F.linear(final, weight).float()``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from data.loader.expand import IGNORE
from train.names import MODEL_INPUTS

CHUNK = 4096  # positions per logits chunk of token_ce


@torch.no_grad()
def final_hidden(model, batch: dict[str, torch.Tensor], device) -> torch.Tensor:
    """The final-normed hidden states [B, T, D] of ``batch`` (its model inputs but the labels)."""
    taken: list[torch.Tensor] = []

    def take(_module, args):
        taken.append(args[0])
        return (args[0][:, :0], *args[1:])

    handle = model.output.register_forward_pre_hook(take)
    try:
        model(**{key: batch[key].to(device) for key in MODEL_INPUTS if key != "labels"})
    finally:
        handle.remove()
    return taken[0]


def logits_at(model, final: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Float32 logits [K, V] at positions (``rows[k]``, ``cols[k]``) of ``final``."""
    return F.linear(final[rows, cols], model.output.weight).float()


def token_ce(model, final: torch.Tensor, labels: torch.Tensor) -> np.ndarray:
    """Per-token cross-entropy [B, T] in float64 (0 where the label is ignored), ``CHUNK``
    positions of logits at a time."""
    out = np.zeros(labels.shape)
    for row in range(labels.shape[0]):
        for start in range(0, labels.shape[1], CHUNK):
            logits = F.linear(final[row, start : start + CHUNK], model.output.weight).float()
            target = labels[row, start : start + CHUNK].to(logits.device)
            ce = F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="none")
            out[row, start : start + CHUNK] = ce.double().cpu().numpy()
    return out
