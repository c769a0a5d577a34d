"""The documents new to each modality per batch and their token mass (train/tasks/documents.py),
counted from real loader batches: what the stagnation rule's ``min_docs`` reads."""

from __future__ import annotations

from data.loader import LoaderConfig, build_loader
from data.loader.config import SourceConfig
from data.vocab import MODALITY_NAMES
from train.tasks.documents import KEY, MASS, DocumentCounter


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
    mass = dict.fromkeys(MODALITY_NAMES, 0.0)
    held: dict[tuple[int, int], set[str]] = {}  # document -> modalities, from the doc ids
    appearances = dict.fromkeys(MODALITY_NAMES, 0)  # (document, batch) pairs holding it
    # (document, modality) -> its tokens in each stretch of consecutive batches holding it
    stretches: dict[tuple[int, int, str], list[float]] = {}
    previous: set[tuple[int, int, str]] = set()
    for _ in range(30):
        batch = next(batches)
        for key, value in counter.count(batch).items():
            (counted if key.startswith(KEY) else mass)[key.split("/")[-1]] += value
        in_batch: dict[tuple[int, int, str], int] = {}
        for row in range(batch["pieces"].shape[0]):
            for piece, (src, sample, _, _) in enumerate(batch["pieces"][row].tolist()):
                if src < 0:
                    continue
                mods = batch["modality"][row][batch["doc_ids"][row] == piece].tolist()
                held.setdefault((src, sample), set()).update(MODALITY_NAMES[m] for m in mods)
                for m in mods:
                    key = (src, sample, MODALITY_NAMES[m])
                    in_batch[key] = in_batch.get(key, 0) + 1
        for key, tokens in in_batch.items():
            appearances[key[2]] += 1
            if key not in previous:
                stretches.setdefault(key, []).append(0.0)
            stretches[key][-1] += tokens
        previous = set(in_batch)
    batches.close()
    for name in MODALITY_NAMES:  # the sum of each stretch's tokens squared
        want = sum(t * t for key, runs in stretches.items() if key[2] == name for t in runs)
        assert mass[name] == want, (name, mass, want)
    assert MASS != KEY and mass["code"] > 0
    for name in ("code", "image", "text"):
        distinct = sum(name in mods for mods in held.values())
        # every document holding the modality counted (again when an epoch brings it back)
        assert 0 < distinct <= counted[name] <= appearances[name], (name, counted, appearances)
    # a code file's chunks fill batch after batch: counted once per stretch, not per batch
    assert counted["code"] <= appearances["code"] / 3, (counted, appearances)
