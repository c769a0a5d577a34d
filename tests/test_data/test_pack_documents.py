"""``pack_documents``: documents of real token shards packed as the loader packs them, in
batches whose last one is filled with blank rows, dropped blocks counted."""

from __future__ import annotations

import numpy as np
import torch

from data.loader import SourceConfig, pack_documents
from data.loader.expand import IGNORE
from data.loader.pack_kernel import PackStats
from data.loader.table_load import load_table
from data.token_docs import iter_documents


def test_documents_are_packed_whole_in_order_and_the_last_batch_is_filled(tiny_tokens):
    docs = []
    for name in ("docs", "clips", "text"):
        table = load_table(SourceConfig(name=name, shards=[str(tiny_tokens / name)]))
        docs += list(iter_documents([table], samples=iter(range(3))))
    stats = PackStats()
    batches = list(pack_documents(docs, 96, batch_rows=4, stats=stats))
    assert stats.dropped_blocks > 0  # clips' videos are longer than 96 tokens
    rows = sum(len(batch["input_ids"]) for batch in batches)
    assert rows == 4 * len(batches) and stats.rows > 4 * (len(batches) - 1)
    blank = batches[-1]["labels"][stats.rows - 4 * (len(batches) - 1) :]
    assert bool((blank == IGNORE).all())
    real = sum(int(batch["num_real_tokens"]) for batch in batches)
    assert real == stats.real_tokens
    # Text is split across rows: every row is full but the last, the documents in order.
    text = docs[-3:]
    (batch,) = pack_documents(text, 64, batch_rows=64)
    ids = batch["input_ids"].reshape(-1)[: int(batch["num_real_tokens"])]
    assert torch.equal(ids, torch.from_numpy(np.concatenate([doc.ids for doc in text])))
