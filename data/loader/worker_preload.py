"""What the process the loader's workers fork from does once, so that every worker finds it done
(worker_start.py): import torch's DataLoader worker loop and the loader, and warm the loader's
compiled kernels. Imported for that alone: by the trainer's process when its workers fork from
it, or named in the fork server's preload list.

Warming calls each kernel a worker runs once, on tiny arrays of a stream's argument types
(docs/loader.md, "Worker processes"). It is best effort: a kernel whose types drifted from these
is loaded by the worker at its first call instead, and a failure never stops the trainer or the
server (an exception other than ImportError in a preloaded module would stop the server).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import torch.utils.data._utils.worker  # noqa: F401  (the worker loop a DataLoader worker runs)

import data.loader.dataset  # noqa: F401  (what a worker unpickles its dataset from)
from data.loader.pack_documents import pack_documents
from data.loader.pack_kernel import count_modalities, pieces_table
from data.loader.sample_check import first_bad_token
from data.loader.shard_check import first_bad_document
from data.loader.stage_kernel import fill_units, gather_tokens


def warm_kernels() -> None:
    """Load every compiled kernel of a worker's stream (and the expansion) in this process."""
    # The packing loop and the expansion, through a real (tiny) packing
    doc = SimpleNamespace(ids=np.arange(8, dtype=np.int32), modality=np.zeros(8, np.uint8))
    doc.blocks = []
    for _ in pack_documents([doc], 8):
        pass
    empty = np.zeros(0, np.int64)
    # A run of documents of a checked shard brought in (StreamArrays): its blocks table
    # and its map are read-only views of the shard
    blocks = np.zeros((0, 5), np.int64)
    blocks.flags.writeable = False
    fill_units(np.zeros((0, 6), np.int64), 0, empty, empty, empty, empty, blocks, empty, empty)
    mapped = np.zeros(0, np.uint8)
    mapped.flags.writeable = False
    gather_tokens(
        mapped, empty, empty, empty, empty, empty, np.zeros(0, np.int32), np.zeros(0, np.uint8)
    )
    # A batch's tokens per modality (StreamArrays.pack)
    count_modalities(np.zeros(0, np.uint8), np.zeros(0, np.int64), np.zeros(5, np.int64))
    pieces_table(np.zeros((0, 4), np.int64), np.zeros(0, np.int64))
    # The whole-shard check of the ids (shard_check.check_shard): the shard's read-only map
    ranges = np.zeros((0, 2), np.int64)
    first_bad_document(mapped, empty, empty, empty.copy(), ranges, -1)
    # A document checked on its own (sample_check.check_ids): views of a token shard's map, or
    # the int64 arrays of a raw document tokenized here
    first_bad_token(mapped.view(np.int32), mapped, ranges, -1)
    first_bad_token(empty, empty, ranges, -1)


try:
    warm_kernels()
except Exception as error:  # noqa: BLE001  (warming is an optimisation: never stop anything)
    print(f"[loader] could not warm the loader's kernels for its workers: {error}", file=sys.stderr)
