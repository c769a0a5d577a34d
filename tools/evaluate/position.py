"""Loss by token position on held-out documents (docs/evaluation.md, "Loss by token position",
says why the buckets are log-spaced and why each averages only the document stretches that
cover it whole): does a token cost less the more of its document the model has read?
"""

from __future__ import annotations

import numpy as np
import torch

from data.loader.expand import IGNORE
from data.vocab import MODALITY_NAMES, Modality
from tools.evaluate.heldout import Heldout, final_hidden, token_ce


def bucket_edges(row: int, first: int = 64) -> list[int]:
    """``[0, first, 2 first, 4 first, ..., row]``: log-spaced bucket edges up to the row length
    (the last bucket is shorter when ``row`` is not ``first`` times a power of 2)."""
    if not 1 <= first < row:  # one bucket the whole row long would be its own ``first``
        raise ValueError(f"--position-first-bucket {first}: give 1 to {row - 1} (row length {row})")
    edges, edge = [0], first
    while edge < row:
        edges.append(edge)
        edge *= 2
    edges.append(row)
    return edges


def stretches(doc_ids: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per token of one row: its offset in its document's stretch of the row and that
    stretch's length (padding, whose labels are all ignored, counts as no stretch: length 0)."""
    length = len(doc_ids)
    starts = np.flatnonzero(np.r_[True, doc_ids[1:] != doc_ids[:-1]])
    ends = np.r_[starts[1:], length]
    offset = np.arange(length) - np.repeat(starts, ends - starts)
    predicts = np.add.reduceat(labels != IGNORE, starts) > 0  # a padding stretch predicts nothing
    return offset, np.repeat(np.where(predicts, ends - starts, 0), ends - starts)


def _mean(total, count) -> float | None:
    return float(total / count) if count else None


class PositionAccumulator:
    """Sums and counts per (modality, bucket), fed one row at a time."""

    def __init__(self, edges: list[int]) -> None:
        self.edges = np.asarray(edges)
        shape = (len(Modality), len(edges) - 1)
        self.ce = np.zeros(shape)  # over stretches covering the bucket
        self.tokens = np.zeros(shape, np.int64)
        self.first = np.zeros(shape)  # those stretches' first-bucket CE
        self.first_tokens = np.zeros(shape, np.int64)
        self.stretches = np.zeros(len(edges) - 1, np.int64)
        self.ce_all = np.zeros(shape)
        self.tokens_all = np.zeros(shape, np.int64)

    def add_row(self, ce: np.ndarray, labels, label_modality, doc_ids) -> None:
        """``ce``: per-token cross-entropy of one row (any value where the label is ignored)."""
        labels, mod = np.asarray(labels), np.asarray(label_modality).astype(np.int64)
        offset, span = stretches(np.asarray(doc_ids), labels)
        scored = labels != IGNORE
        bucket = np.searchsorted(self.edges, offset, side="right") - 1
        np.add.at(self.ce_all, (mod[scored], bucket[scored]), ce[scored])
        np.add.at(self.tokens_all, (mod[scored], bucket[scored]), 1)
        first_end = self.edges[1]
        for k in range(len(self.edges) - 1):
            covers = span >= self.edges[k + 1]  # the stretch reaches the bucket's end
            inside = covers & scored & (bucket == k)
            np.add.at(self.ce[:, k], mod[inside], ce[inside])
            np.add.at(self.tokens[:, k], mod[inside], 1)
            early = covers & scored & (offset < first_end)
            np.add.at(self.first[:, k], mod[early], ce[early])
            np.add.at(self.first_tokens[:, k], mod[early], 1)
            self.stretches[k] += int((covers & (offset == 0)).sum())

    def result(self) -> dict:
        buckets = [[int(a), int(b)] for a, b in zip(self.edges[:-1], self.edges[1:])]
        by_modality: dict[str, dict] = {}
        for i, name in enumerate(MODALITY_NAMES):
            if not self.tokens_all[i].any():
                continue
            rows = [
                {
                    "ce": _mean(self.ce[i, k], self.tokens[i, k]),
                    "tokens": int(self.tokens[i, k]),
                    "ce_first": _mean(self.first[i, k], self.first_tokens[i, k]),
                    "ce_all": _mean(self.ce_all[i, k], self.tokens_all[i, k]),
                    "tokens_all": int(self.tokens_all[i, k]),
                }
                for k in range(len(buckets))
            ]
            by_modality[name] = {"buckets": rows}
        return {
            "buckets": buckets,
            "stretches": [int(count) for count in self.stretches],
            "modalities": by_modality,
        }


@torch.no_grad()
def position_losses(run: Heldout, edges: list[int]) -> dict:
    """Mean CE per position bucket (``bucket_edges``) and modality over the held-out pass:
    ``{"seq_len", "buckets": [[start, end], ...], "stretches": [per bucket], "modalities":
    {name: {"buckets": [{"ce", "tokens", "ce_first", "ce_all", "tokens_all"}, ...]}}}``."""
    acc = PositionAccumulator(edges)
    for part in run:
        batch = run.tensors(part)
        ce = token_ce(run.model, final_hidden(run.model, batch, run.device), batch["labels"])
        # a blank row filling the pass's last batch scores nothing: every stretch is padding
        for row in range(batch["labels"].shape[0]):
            acc.add_row(
                ce[row], batch["labels"][row], batch["label_modality"][row], batch["doc_ids"][row]
            )
    out = {"seq_len": run.seq_len, "whole_documents": run.whole_documents, **acc.result()}
    out["documents"] = sum(counts.documents for counts in run.counts)
    out["sampled"] = bool(run.max_docs)
    return out
