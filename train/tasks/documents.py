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
"""

from __future__ import annotations

import numpy as np

from data.vocab import MODALITY_NAMES

KEY = "docs_new/"  # summed over micro-batches and ranks; data/docs_new/<modality> per step


class DocumentCounter:
    """Per batch, the documents new to each modality: holding it here and not in the previous
    batch of this rank (the memory is one batch: a file whose chunks skip a batch counts twice).
    The memory goes into the rank's checkpoint, so that a resumed run counts as the run it
    continues."""

    def __init__(self) -> None:
        self.previous: set[tuple[int, int, int]] = set()

    def state_dict(self) -> dict:
        return {"previous": sorted(self.previous)}

    def load_state_dict(self, state: dict) -> None:
        self.previous = {(int(s), int(d), int(m)) for s, d, m in state.get("previous", ())}

    def count(self, batch: dict) -> dict[str, float]:
        """``docs_new/<modality>`` for one host batch; empty for a batch without the table."""
        pieces, modality = batch.get("pieces"), batch.get("modality")
        if pieces is None or modality is None or pieces.numel() == 0:
            return {}
        table = pieces.numpy()
        mods = modality.numpy().reshape(table.shape[0], -1)
        used = table[..., 0] >= 0
        lengths = np.where(used, table[..., 3] - table[..., 2], 0)
        ends = np.cumsum(lengths, axis=1)
        starts = ends - lengths
        held: set[tuple[int, int, int]] = set()
        for row, col in zip(*np.nonzero(used)):
            src, sample = int(table[row, col, 0]), int(table[row, col, 1])
            present = np.unique(mods[row, starts[row, col] : ends[row, col]])
            held.update((src, sample, int(index)) for index in present)
        counts = [0.0] * len(MODALITY_NAMES)
        for _, _, index in held - self.previous:
            counts[index] += 1
        self.previous = held
        return {f"{KEY}{name}": counts[i] for i, name in enumerate(MODALITY_NAMES)}
