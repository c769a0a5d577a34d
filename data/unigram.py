"""The unigram baseline: how well a model that ignores all context predicts each modality.

A loss means little without it: an image loss at 0.26 of uniform chance (``ln V``) looks strong,
but if the codes' own frequencies already give 0.49, the model has learned less than it seems;
structure tokens (``<eol>``, ``<eoi>``) are fixed by the grid, so a model that follows the layout
predicts them almost exactly while their unigram CE is about 1 nat.

Design choices:
- Counts of *label* tokens (every token of a document but its first, ``<|bos|>``) per label
  modality, over the training token shards as stored (each document once; the training mix is
  not applied: documented in docs/training.md). Add-one smoothing over the modality's own id
  range (text and code: the BPE; image and video: the codes; structure: its markers), so an id
  never seen in training costs ``ln(N_m + V_m)``, never infinity.
- Built once, in seconds for the demo (one read of the ids and modality arrays); ``max_tokens``
  caps the read per source for large corpora (documents in index order up to the cap; the
  cap is reported).
- ``nll_sums`` takes the labels and label modalities of a batch and returns per-modality sums
  and counts, reduced like the model's loss (sums, never means of means).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from data.vocab import Modality, VocabLayout

IGNORE = -100


@dataclass
class Unigram:
    counts: np.ndarray  # int64 [modalities, vocab]: label tokens of each id per label modality
    layout: VocabLayout
    documents: int = 0
    capped_sources: tuple[str, ...] = ()

    @classmethod
    def from_tables(
        cls,
        tables,
        layout: VocabLayout,
        *,
        max_tokens: int = 0,
        skipped: list[tuple[str, str, str]] | None = None,
        progress: bool = False,
    ) -> Unigram:
        """``skipped``: filled with (source, key, why) of every document left out as unreadable."""
        from tqdm import tqdm

        from data.token_docs import iter_documents

        size = layout.size
        flat = np.zeros(len(Modality) * size, np.int64)  # [modality * size + id]
        docs, capped = 0, []
        # a corrupted document is left out, not counted (or raised)
        ranges = np.asarray(layout.modality_ranges(), np.int64)
        total = sum(len(t) for t in tables)
        keys: list[np.ndarray] = []  # modality * size + id of documents not yet counted
        pending = 0

        def count() -> None:
            # one bincount per million tokens or so: np.add.at per document costs far more
            nonlocal flat, pending
            if keys:
                flat += np.bincount(np.concatenate(keys), minlength=len(flat))
                keys.clear()
                pending = 0

        with tqdm(total=total, desc="unigram", unit=" docs", disable=not progress) as bar:
            for t in tables:
                seen = 0
                for doc in iter_documents([t], ranges=ranges, skipped=skipped):
                    ids, mod = doc.ids[1:].astype(np.int64), doc.modality[1:].astype(np.int64)
                    keys.append(mod * size + ids)
                    pending += len(ids)
                    if pending >= 1 << 20:
                        count()
                    docs += 1
                    bar.update(1)
                    seen += len(ids)
                    if max_tokens and seen >= max_tokens:
                        capped.append(t.name)
                        break
            count()
        return cls(flat.reshape(len(Modality), size), layout, docs, tuple(capped))

    def log_probs(self) -> torch.Tensor:
        """[modalities, vocab] float64 log p(id | modality); ids outside the range get the
        smoothed probability of an unseen id of the range."""
        out = torch.empty(self.counts.shape, dtype=torch.float64)
        for modality, (a, b) in enumerate(self.layout.modality_ranges()):
            c = torch.from_numpy(self.counts[modality]).double()
            total = float(c[a:b].sum()) + (b - a)
            out[modality] = math.log(1.0 / total)
            out[modality, a:b] = ((c[a:b] + 1.0) / total).log()
        return out

    def nll_sums(
        self, labels: torch.Tensor, label_modality: torch.Tensor, log_probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of -log p, count) per modality over the non-ignored labels of a batch."""
        keep = labels != IGNORE
        lab, mod = labels[keep].long().cpu(), label_modality[keep].long().cpu()
        nll = -log_probs[mod, lab]
        sums = torch.zeros(len(Modality), dtype=torch.float64).index_add_(0, mod, nll)
        cnt = torch.zeros(len(Modality), dtype=torch.float64).index_add_(
            0, mod, torch.ones_like(nll)
        )
        return sums, cnt

    def entropy(self) -> dict[str, float]:
        """The baseline on the training tokens themselves (its cross-entropy with itself)."""
        log_probs_of = self.log_probs()
        out = {}
        for modality in Modality:
            c = torch.from_numpy(self.counts[modality]).double()
            n = float(c.sum())
            if n:
                out[modality.name.lower()] = float(-(c * log_probs_of[modality]).sum() / n)
        return out
