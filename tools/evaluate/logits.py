"""Logits where they are needed, from the model's final hidden states: what the long-context
evaluations read at rows of any length.

A forward pass without labels returns the logits of every position, [B, T, V] in float32: at
128k tokens and a 64k vocabulary that is 34 GB a row. Here the model stops before its head
(``Transformer.final_hidden``) and the head's ``logits`` are taken only at the positions scored
(the needles), or chunk by chunk for a per-token CE (``token_ce``).
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
    """The final-normed hidden states [B, T, D] of ``batch`` (its model inputs on ``device``)."""
    return model.final_hidden(**{key: batch[key].to(device) for key in MODEL_INPUTS})


def token_ce(model, final: torch.Tensor, labels: torch.Tensor) -> np.ndarray:
    """Per-token cross-entropy [B, T] in float64 (0 where the label is ignored), ``CHUNK``
    positions of logits at a time."""
    out = np.zeros(labels.shape)
    for row in range(labels.shape[0]):
        for start in range(0, labels.shape[1], CHUNK):
            logits = model.output.logits(final[row, start : start + CHUNK])
            target = labels[row, start : start + CHUNK].to(logits.device)
            ce = F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="none")
            out[row, start : start + CHUNK] = ce.double().cpu().numpy()
    return out
