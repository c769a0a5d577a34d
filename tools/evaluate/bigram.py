"""The bigram baseline: how well the previous token alone predicts each modality.

The unigram margin flatters a model where one token of context already does most of the work:
structure tokens are fixed by the grid (after a row's last code comes ``<eol>``), and image and
video codes of flat scenes repeat their left neighbour. The held-out table shows the bigram CE
beside the unigram's, so that "beats token frequencies" and "beats a lookup of the previous
token" are both read off it.

Design choices:
- Counts of (label modality, previous id, id) over the label tokens of the training shards as
  stored (each document once, the previous token from the same document), like the unigram's.
- Witten-Bell interpolation with the unigram (itself add-one smoothed over the modality's id
  range): ``P(w | p) = (c(p, w) + T(p) P_uni(w)) / (c(p) + T(p))``, T(p) the number of distinct
  ids seen after p. It has no parameter to tune on the held-out set (an add-k bigram's CE moves
  with k), and a previous token never seen falls back to the unigram.
- Pairs are int64 keys ``(modality * V + previous) * V + id``, counted with ``np.unique`` and
  looked up with ``np.searchsorted``: memory is 8 bytes a training token, read once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from data.unigram import IGNORE, Unigram
from data.vocab import Modality


@dataclass
class Bigram:
    keys: np.ndarray  # int64, sorted: (label modality * V + previous id) * V + id
    counts: np.ndarray  # int64: how often each key was seen
    contexts: np.ndarray  # int64, sorted: label modality * V + previous id
    context_counts: np.ndarray  # c(p): pairs seen after each context
    context_types: np.ndarray  # T(p): distinct ids seen after each context
    unigram: Unigram

    @classmethod
    def from_tables(cls, tables, unigram: Unigram) -> Bigram:
        from data.token_docs import iter_documents

        size = unigram.layout.size
        ranges = np.asarray(unigram.layout.modality_ranges(), np.int64)
        keys: list[np.ndarray] = []
        for doc in iter_documents(tables, ranges=ranges):
            ids, mod = doc.ids.astype(np.int64), doc.modality[1:].astype(np.int64)
            keys.append((mod * size + ids[:-1]) * size + ids[1:])
        flat = np.concatenate(keys) if keys else np.zeros(0, np.int64)
        pairs, counts = np.unique(flat, return_counts=True)
        contexts, first, types = np.unique(pairs // size, return_index=True, return_counts=True)
        return cls(pairs, counts, contexts, np.add.reduceat(counts, first), types, unigram)

    def nll_sums(
        self, inputs: torch.Tensor, labels: torch.Tensor, label_modality: torch.Tensor
    ) -> np.ndarray:
        """Sums of -log P(label | the input token before it) per label modality (float64
        [modalities]), over the non-ignored labels of a batch: ``inputs[t]`` precedes
        ``labels[t]``, as the model reads them."""
        size = self.unigram.layout.size
        keep = (labels != IGNORE).numpy()
        prev = inputs.numpy()[keep].astype(np.int64)
        label = labels.numpy()[keep].astype(np.int64)
        mod = label_modality.numpy()[keep].astype(np.int64)
        p_uni = np.exp(self.unigram.log_probs().numpy()[mod, label])
        context = mod * size + prev
        p = p_uni  # a context never seen in training: the unigram
        if len(self.contexts):
            at = np.searchsorted(self.contexts, context).clip(max=len(self.contexts) - 1)
            known = self.contexts[at] == context
            c, t = self.context_counts[at], self.context_types[at]
            where = np.searchsorted(self.keys, context * size + label).clip(max=len(self.keys) - 1)
            pair = np.where(self.keys[where] == context * size + label, self.counts[where], 0)
            p = np.where(known, (pair + t * p_uni) / np.maximum(c + t, 1), p_uni)
        return np.bincount(mod, weights=-np.log(p), minlength=len(Modality))
