"""How many documents of each modality a batch brings that the batches before it did not: the
stagnation rule judges a window only when enough documents of the modality went into it (one
long file filling a stretch of batches moves the modality's loss with its own difficulty, not
with the model: docs/monitors.md).

Counted on the host from what the loader hands over anyway, the pieces table (source, sample,
start, end per row) and the batch's modalities: a row is its pieces' tokens in order, so piece j
of a row is the stretch after pieces 0..j-1. A document counts for a modality in the first batch
in which it holds tokens of that modality, whatever piece of it that is: a long file's chunks
arrive over consecutive batches (counted once), and a short document whose image did not fit
the rest of a row continues in a later row (its image counted there).

A count says nothing of how the tokens are spread: every image and code document brings a text
token or two (its markers, a caption) and counts for text, while one long prose file may hold
most of a window's text. So the counter also gives the documents' token mass, the sum over
documents of their tokens squared, per batch as its increase: a document under way adds
(C + t)^2 - C^2, C its tokens of the modality in the batches before, t in this one. Over a
window, (tokens)^2 / mass is the number of equally long documents that would hold those tokens
(the inverse Simpson index); a long file's tokens from before the window count against it, so
the figure errs towards too few documents, the side on which the rule holds its judgement.
"""

from __future__ import annotations

import numpy as np

from data.vocab import MODALITY_NAMES

KEY = "docs_new/"  # summed over micro-batches and ranks; data/docs_new/<modality> per step
MASS = "docs_mass/"  # likewise; data/docs_mass/<modality>


class DocumentCounter:
    """Per batch, the documents new to each modality (holding it here and not in the previous
    batch of this rank; the memory is one batch: a file whose chunks skip a batch counts twice)
    and the increase of their token mass. The memory, each document's tokens of the modality
    since it began, goes into the rank's checkpoint, so that a resumed run counts as the run it
    continues."""

    def __init__(self) -> None:
        self.previous: dict[tuple[int, int, int], float] = {}

    def state_dict(self) -> dict:
        return {"previous": sorted((*key, tokens) for key, tokens in self.previous.items())}

    def load_state_dict(self, state: dict) -> None:
        self.previous = {
            (int(s), int(d), int(m)): float(tokens) for s, d, m, tokens in state["previous"]
        }

    def count(self, batch: dict) -> dict[str, float]:
        """``docs_new/<modality>`` and ``docs_mass/<modality>`` for one host batch; empty for a
        batch without the table."""
        pieces, modality = batch.get("pieces"), batch.get("modality")
        if pieces is None or modality is None or pieces.numel() == 0:
            return {}
        table = pieces.numpy()
        mods = modality.numpy().reshape(table.shape[0], -1)
        used = table[..., 0] >= 0
        lengths = np.where(used, table[..., 3] - table[..., 2], 0)
        ends = np.cumsum(lengths, axis=1)
        starts = ends - lengths
        held: dict[tuple[int, int, int], float] = {}
        for row, col in zip(*np.nonzero(used)):
            src, sample = int(table[row, col, 0]), int(table[row, col, 1])
            present, in_piece = np.unique(
                mods[row, starts[row, col] : ends[row, col]], return_counts=True
            )
            for index, n in zip(present.tolist(), in_piece.tolist()):
                held[src, sample, index] = held.get((src, sample, index), 0.0) + n
        counts, mass = [0.0] * len(MODALITY_NAMES), [0.0] * len(MODALITY_NAMES)
        for key, tokens in held.items():
            before = self.previous.get(key)
            if before is None:
                counts[key[2]] += 1
                before = 0.0
            held[key] = before + tokens
            mass[key[2]] += held[key] ** 2 - before**2
        self.previous = held
        out = {f"{KEY}{name}": counts[i] for i, name in enumerate(MODALITY_NAMES)}
        return out | {f"{MASS}{name}": mass[i] for i, name in enumerate(MODALITY_NAMES)}
