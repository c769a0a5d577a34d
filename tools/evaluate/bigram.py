"""The bigram baseline: how well the previous token alone predicts each modality.

The unigram margin flatters a model where one token of context already does most of the work:
structure tokens are fixed by the grid (after a row's last code comes ``<eol>``), and image and
video codes of flat scenes repeat their left neighbour. The held-out table shows the bigram CE
beside the unigram's, so that "beats token frequencies" and "beats a lookup of the previous
token" are both read off it.

Design choices:
- Known what the model knows at that position: the previous token and its modality (text and
  code share the BPE's ids; the model is told which it reads). Not the modality of the token to
  come: the model is not told that a structure token comes next, and a baseline told it would
  find ``<eol>`` certain after a row's last code. Its predictions range over the whole
  vocabulary; the per-modality figure is the mean over the labels of that modality, as the
  model's is.
- Counts of (previous modality, previous id, id) over the training shards as stored (each
  document once, both tokens from the same document), interpolated by Witten-Bell with the
  unigram of the whole vocabulary (add-one smoothed):
  ``P(w | p) = (c(p, w) + T(p) P_uni(w)) / (c(p) + T(p))``, T(p) the number of distinct ids seen
  after p. No parameter to tune on the held-out set (an add-k bigram's CE moves with k); a
  previous token never seen falls back to the unigram.
- Pairs are int64 keys ``(modality * V + previous) * V + id``, counted with ``np.unique``: about
  24 bytes a training token at the peak, so at most ``MAX_TOKENS`` tokens are read (documents
  in index order, source after source until the cap; the table says when it was reached).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from data.unigram import IGNORE
from data.vocab import Modality, VocabLayout

MAX_TOKENS = 50_000_000  # about 1.2 GB at the peak of the count


@dataclass
class Bigram:
    keys: np.ndarray  # int64, sorted: (previous modality * V + previous id) * V + id
    counts: np.ndarray  # int64: how often each key was seen
    contexts: np.ndarray  # int64, sorted: previous modality * V + previous id
    context_counts: np.ndarray  # c(p): pairs seen after each context
    context_types: np.ndarray  # T(p): distinct ids seen after each context
    unigram: np.ndarray  # float64 [V]: P(id), add-one smoothed over the whole vocabulary
    size: int
    tokens: int  # pairs counted
    capped: bool  # MAX_TOKENS reached before the training data's end

    @classmethod
    def from_tables(cls, tables, layout: VocabLayout, max_tokens: int = MAX_TOKENS) -> Bigram:
        from data.token_docs import iter_documents

        size = layout.size
        ranges = np.asarray(layout.modality_ranges(), np.int64)
        keys: list[np.ndarray] = []
        seen, capped = 0, False
        for doc in iter_documents(tables, ranges=ranges):
            if seen >= max_tokens:
                capped = True
                break
            ids, mod = doc.ids.astype(np.int64), doc.modality[:-1].astype(np.int64)
            keys.append((mod * size + ids[:-1]) * size + ids[1:])
            seen += len(mod)
        flat = np.concatenate(keys) if keys else np.zeros(0, np.int64)
        pairs, counts = np.unique(flat, return_counts=True)
        del flat, keys
        contexts, first, types = np.unique(pairs // size, return_index=True, return_counts=True)
        unigram = np.bincount(pairs % size, weights=counts, minlength=size) + 1.0
        return cls(
            pairs,
            counts,
            contexts,
            np.add.reduceat(counts, first) if len(first) else np.zeros(0, np.int64),
            types,
            unigram / unigram.sum(),
            size,
            int(counts.sum()),
            capped,
        )

    def nll_sums(
        self,
        inputs: torch.Tensor,
        input_modality: torch.Tensor,
        labels: torch.Tensor,
        label_modality: torch.Tensor,
    ) -> np.ndarray:
        """Sums of -log P(label | the input token before it and its modality) per label
        modality (float64 [modalities]), over the non-ignored labels of a batch: ``inputs[t]``
        precedes ``labels[t]``, as the model reads them."""
        keep = (labels != IGNORE).numpy()
        label = labels.numpy()[keep].astype(np.int64)
        context = input_modality.numpy()[keep].astype(np.int64) * self.size + inputs.numpy()[
            keep
        ].astype(np.int64)
        p_uni = self.unigram[label]
        p = p_uni  # a context never seen in training: the unigram
        if len(self.contexts):
            at = np.searchsorted(self.contexts, context).clip(max=len(self.contexts) - 1)
            known = self.contexts[at] == context
            c, t = self.context_counts[at], self.context_types[at]
            pair = context * self.size + label
            where = np.searchsorted(self.keys, pair).clip(max=len(self.keys) - 1)
            seen = np.where(self.keys[where] == pair, self.counts[where], 0)
            p = np.where(known, (seen + t * p_uni) / np.maximum(c + t, 1), p_uni)
        mod = label_modality.numpy()[keep].astype(np.int64)
        return np.bincount(mod, weights=-np.log(p), minlength=len(Modality))
