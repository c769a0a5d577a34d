"""A consumer stream's state: one representation, the compiled loop's arrays
(stream_arrays.StreamArrays), snapshot after every batch (``StreamState``: a few of their rows,
a few microseconds; a worker's batch carries it to the trainer's process, pickled small), made
the saved dict only when a checkpoint asks for it (``StreamState.to_dict``), and the dict put
back (``ConsumerStream.load_state_dict``: the stream's cursors and counters set, then
``StreamArrays(stream, st)`` reads the documents held aside or handed out in part again and
makes the arrays). What the dict
holds, and why an older one is refused (``check_state``): docs/loader.md, "Exact resume".
Separate from the stream's work (stream.py: mixing, reading, packing) because the state is a
format with a life of its own: it is saved in every checkpoint, read back on resume and
rewritten for another split by redistribute.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from data.loader import pack_kernel as kernel
from data.loader.order import ORDER_VERSION
from data.loader.pack_kernel import PackStats
from data.vocab import Modality


@dataclass
class SourceCursor:
    epoch: int = 0
    pos: int = 0  # position in this consumer's slice of the epoch order
    tokens: int = 0  # tokens of this source placed in rows
    done: bool = False  # epoch mode: this source is exhausted
    # epoch -> packed mask (order.pack_mask) of the positions of that epoch's order consumed
    # before a redistribute; the slice is then taken from the rest. Dropped once passed: every
    # consumer of one state holds the same masks, so the slowest still has any a later
    # redistribute needs.
    skip: dict[int, str] = field(default_factory=dict)


_DOC_FIELDS = ("source", "sample", "epoch", "unit", "offset", "chunk end")  # pending, open
OLDER_STATE = (
    "it was saved by an older earlyfuse, whose loader states this one does not read; resume "
    "with the earlyfuse that saved it, or start the data from the beginning"
)


def check_fields(st: dict, written: dict, where: str) -> None:
    """ValueError naming ``where`` and the fields ``st`` lacks of ``written`` (a state as this
    earlyfuse writes it)."""
    missing = [name for name in written if name not in st]
    if missing:
        raise ValueError(f"{where}: no {', '.join(map(repr, missing))}; {OLDER_STATE}")


def check_state(st: dict, fresh: dict, where: str) -> None:
    """ValueError naming ``where`` and what is wrong when ``st`` is not a stream state as this
    earlyfuse writes it (``fresh``: a fresh stream's)."""
    check_fields(st, fresh, where)
    if st["order"] != ORDER_VERSION:
        raise ValueError(
            f"{where}: its cursors index epoch order {st['order']!r}, this earlyfuse's is "
            f"{ORDER_VERSION}; {OLDER_STATE}"
        )
    for name in ("pending", "open"):
        for doc in st[name]:
            if len(doc) != len(_DOC_FIELDS):
                raise ValueError(
                    f"{where}: {name} document {doc} is not [{', '.join(_DOC_FIELDS)}]; {OLDER_STATE}"
                )


_IMAGE, _VIDEO = int(Modality.IMAGE), int(Modality.VIDEO)

# docs columns of a held-aside or open document's cursor (stream_state's [source, sample,
# epoch, unit, offset, limit]); src columns of a source (cursor, then image/video drops);
# the packing counters
CURSOR_COLS = [
    kernel.D_SRC,
    kernel.D_SAMPLE,
    kernel.D_EPOCH,
    kernel.D_UNIT,
    kernel.D_OFF,
    kernel.D_LIMIT,
]
SRC_COLS = [
    kernel.S_CEPOCH,
    kernel.S_CPOS,
    kernel.S_TOKENS,
    kernel.S_DONE,
    kernel.S_DROP_IMAGE,
    kernel.S_DROP_VIDEO,
    kernel.S_MIX,
]


@dataclass
class StreamState:
    """A consumer stream's state as a few arrays and counters (StreamArrays.snapshot): what a
    batch carries from a worker (pickled small) and the loader keeps; ``to_dict`` gives the
    saved dict."""

    # int64 arrays first (a worker's batch pickles them as one buffer, packed_batch.py)
    src: np.ndarray  # SRC_COLS of each source
    cursors: np.ndarray  # CURSOR_COLS of the held-aside, then the open documents
    stats: np.ndarray  # kernel.STAT_COLS
    by_modality: np.ndarray
    n_pending: int
    batches: int
    errors: int
    skip: list[dict[int, str]]
    skipped: list[list[int]]

    def to_dict(self) -> dict:
        src = self.src.tolist()
        cursors = self.cursors.tolist()
        return {
            "cursors": [rec[:4] for rec in src],
            "mix": [rec[6] for rec in src],  # tokens the mix counts (stream.py)
            "pending": cursors[: self.n_pending],
            "open": cursors[self.n_pending :],
            "dropped_by": [
                [source, modality, dropped]
                for source, rec in enumerate(src)
                for modality, dropped in ((_IMAGE, rec[4]), (_VIDEO, rec[5]))
                if dropped
            ],
            "batches": self.batches,
            "errors": self.errors,
            "skipped": self.skipped,
            "stats": asdict(PackStats(*self.stats.tolist())),
            "tokens_by_modality": self.by_modality.tolist(),
            "skip": [
                [source, epoch, mask]
                for source in range(len(src))
                for epoch, mask in sorted(self.skip[source].items())
                if epoch >= src[source][0]
            ],
            "order": ORDER_VERSION,
        }
