"""Cross-modal dependence on whole documents (docs/evaluation.md, "Dependence, both directions"):
does a caption depend on its image, and an image on its caption? Contexts are swapped along a
fixed derangement within a source, so the figure is deterministic. The training monitor's probes
(train/monitor/probes.py) measure the same gaps cheaply inside packed batches; here each
document runs alone, packed as the loader packs it, for the final figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from data.loader import pack_documents
from data.vocab import Modality
from tools.evaluate.heldout import final_hidden, token_ce

CAPTION = "caption"  # image first, the caption is the target
DRAWING = "drawing"  # caption first, the image is the target


@dataclass
class Pair:
    """One pair document cut into (bos, first part, second part, eos)."""

    source: str
    key: str
    direction: str  # CAPTION or DRAWING
    bos: np.ndarray  # ids [1]
    first: tuple[np.ndarray, np.ndarray]  # (ids, modality) of the context
    second: tuple[np.ndarray, np.ndarray]  # of the target
    eos: np.ndarray  # ids, possibly empty
    grid: tuple[int, int]  # (h, w) of its image block


def find_pair(source: str, key: str, ids, modality, blocks) -> Pair | None:
    """The pair structure of a token document, or None when it is not one image block with
    text on exactly one side (interleaved pages, videos and bare images are not pairs)."""
    ids, modality = np.asarray(ids), np.asarray(modality)
    if len(blocks) != 1 or int(blocks[0][2]) != 0:  # one image (t = 0), no video
        return None
    start, end = int(blocks[0][0]), int(blocks[0][1])
    last = len(ids) - 1 if modality[-1] == Modality.TEXT else len(ids)  # the closing <eos>
    before, after = (1, start), (end, last)
    text_before = before[1] > before[0]
    text_after = after[1] > after[0]
    if text_before == text_after:
        return None
    image = (ids[start:end], modality[start:end])
    text_span = before if text_before else after
    text = (ids[text_span[0] : text_span[1]], modality[text_span[0] : text_span[1]])
    if not (modality[text_span[0] : text_span[1]] == Modality.TEXT).all():
        return None
    direction = DRAWING if text_before else CAPTION
    first, second = (text, image) if text_before else (image, text)
    grid = (int(blocks[0][3]), int(blocks[0][4]))
    return Pair(source, key, direction, ids[:1], first, second, ids[last:], grid)


def _document(pair: Pair, donor: Pair) -> tuple[np.ndarray, np.ndarray, list, np.ndarray]:
    """``pair``'s document with ``donor``'s context: ids, modality, visual blocks, and which
    labels are the target's scored tokens (caption text, or the image block's codes: the block's
    structure tokens are fixed by its size and left out)."""
    context = donor.first
    ids = np.concatenate([pair.bos, context[0], pair.second[0], pair.eos]).astype(np.int64)
    mod = np.concatenate(
        [[int(Modality.TEXT)], context[1], pair.second[1], [int(Modality.TEXT)] * len(pair.eos)]
    ).astype(np.int64)
    if pair.direction == CAPTION:
        start, length, (h, w) = 1, len(context[0]), donor.grid
    else:
        start, length, (h, w) = 1 + len(context[0]), len(pair.second[0]), pair.grid
    blocks = [[start, start + length, 0, h, w]]
    # Labels are shifted by one: the label at position j is token j + 1.
    target_start = 1 + len(context[0])
    want = Modality.TEXT if pair.direction == CAPTION else Modality.IMAGE
    mask = np.zeros(len(ids), bool)
    mask[target_start - 1 : target_start - 1 + len(pair.second[0])] = pair.second[1] == want
    return ids, mod, blocks, mask


@torch.no_grad()
def target_nll(model, pair: Pair, donor: Pair, device) -> tuple[float, int]:
    """(sum of -log p, count) of the pair's target tokens after ``donor``'s context, the document
    packed alone in a row of its own length."""
    ids, mod, blocks, mask = _document(pair, donor)
    doc = SimpleNamespace(ids=ids, modality=mod, blocks=blocks)
    batch = next(pack_documents([doc], len(ids)))
    nll = token_ce(model, final_hidden(model, batch, device), batch["labels"])[0]
    keep = mask & (batch["labels"][0].numpy() >= 0)
    return float(nll[keep].sum()), int(keep.sum())


def dependence_gaps(model, pairs: list[Pair], device, *, progress: bool = False) -> dict:
    """Per (source, direction): the target's CE after its own context and after another's, the
    gap (other - own, nats per target token) and the pair and token counts. A source with one
    pair is listed unmeasured (no other document's context to give it: figures None)."""
    from tqdm import tqdm

    bar = tqdm(total=len(pairs), desc="dependence", unit=" pairs", disable=not progress)
    groups: dict[tuple[str, str], list[Pair]] = {}
    for pair in pairs:
        groups.setdefault((pair.source, pair.direction), []).append(pair)
    out = {}
    for (source, direction), group in sorted(groups.items()):
        row: dict[str, Any] = {"source": source, "direction": direction, "pairs": len(group)}
        row.update(tokens=0, ce_own=None, ce_other=None, gap=None)  # unmeasured, unless below
        out[f"{source}/{direction}"] = row
        if len(group) < 2:
            bar.update(1)
            continue
        own = other = 0.0
        count = 0
        for i, pair in enumerate(group):
            own_nll, tokens = target_nll(model, pair, pair, device)
            # the same target tokens after the next document's context
            other_nll, _ = target_nll(model, pair, group[(i + 1) % len(group)], device)
            own, other, count = own + own_nll, other + other_nll, count + tokens
            bar.update(1)
        row.update(
            tokens=count, ce_own=own / count, ce_other=other / count, gap=(other - own) / count
        )
    bar.close()
    return out
