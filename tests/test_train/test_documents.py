"""The documents new to each modality per batch (train/tasks/documents.py), counted from real
loader batches: what the stagnation rule's ``min_docs`` reads."""

from __future__ import annotations

from data.loader import LoaderConfig, build_loader
from data.loader.config import SourceConfig
from data.vocab import MODALITY_NAMES
from train.tasks.documents import KEY, DocumentCounter


def test_a_document_counts_once_per_modality_however_many_batches_it_spans(tiny_tokens):
    sources = [
        SourceConfig(name=name, shards=[str(tiny_tokens / name)]) for name in ("code", "scenes")
    ]
    loader = build_loader(
        LoaderConfig(sources=sources, seq_len=256, num_workers=0, shuffle_buffer=8),
        rank=0,
        world_size=1,
        micro_batch=2,
    )
    counter, batches = DocumentCounter(), iter(loader)
    counted = dict.fromkeys(MODALITY_NAMES, 0.0)
    held: dict[tuple[int, int], set[str]] = {}  # document -> modalities, from the doc ids
    appearances = dict.fromkeys(MODALITY_NAMES, 0)  # (document, batch) pairs holding it
    for _ in range(30):
        batch = next(batches)
        for name, count in counter.count(batch).items():
            counted[name.removeprefix(KEY)] += count
        in_batch: set[tuple[int, int, str]] = set()
        for row in range(batch["pieces"].shape[0]):
            for piece, (src, sample, _, _) in enumerate(batch["pieces"][row].tolist()):
                if src < 0:
                    continue
                mods = batch["modality"][row][batch["doc_ids"][row] == piece].unique().tolist()
                held.setdefault((src, sample), set()).update(MODALITY_NAMES[m] for m in mods)
                in_batch.update((src, sample, MODALITY_NAMES[m]) for m in mods)
        for *_, name in in_batch:
            appearances[name] += 1
    batches.close()
    for name in ("code", "image", "text"):
        distinct = sum(name in mods for mods in held.values())
        # every document holding the modality counted (again when an epoch brings it back)
        assert 0 < distinct <= counted[name] <= appearances[name], (name, counted, appearances)
    # a code file's chunks fill batch after batch: counted once per stretch, not per batch
    assert counted["code"] <= appearances["code"] / 3, (counted, appearances)
