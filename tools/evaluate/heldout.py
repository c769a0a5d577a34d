"""Per source and modality: CE on held-out token shards, the unigram baseline, the margin, bits
per byte for text and code.

Documents are packed in index order into rows of ``seq_len`` exactly as the loader packs them
(data/loader/packer.py: text split across rows, visual blocks never), so the figures are the
trainer's validation figures; every document of every source is read once (``max_docs`` takes
the first N of each source instead: a stated, per-source sample).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from data.loader.packer import Doc, Packer, units_of
from data.token_docs import iter_documents
from data.vocab import MODALITY_NAMES, Modality
from train.monitor.pair_dependence import collate

MODEL_INPUTS = (
    "input_ids",
    "labels",
    "modality",
    "label_modality",
    "doc_ids",
    "position_ids",
    "position_thw",
    "image_ids",
)


def _bytes_to_unicode() -> dict[int, str]:
    """The byte <-> printable character table of byte-level BPE (GPT-2's): printable Latin-1
    bytes map to themselves, the others to code points from 256 up, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1))
    keep += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def token_byte_lengths(text_tokenizer) -> np.ndarray:
    """UTF-8 bytes each text id stands for (specials: 0), for bits per byte."""
    char_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    size = text_tokenizer.layout.text_size
    out = np.zeros(size, np.int64)
    specials = {text_tokenizer.pad_id, text_tokenizer.bos_id, text_tokenizer.eos_id}
    for i in range(size):
        tok = text_tokenizer.tok.id_to_token(i)
        if i in specials or tok is None:
            continue
        out[i] = sum(1 for c in tok if c in char_to_byte)
    return out


def _rows(table, packer: Packer, max_docs: int):
    """Packed rows of one source's documents, in index order."""
    docs = iter_documents([table], max_docs_per_source=max_docs)

    def next_doc():
        d = next(docs, None)
        if d is None:
            return None
        n = len(d.ids)
        return Doc(0, 0, 0, n, units_of(n, d.blocks), d.ids.astype(np.int64), d.modality)

    while (row := packer.pack(next_doc)) is not None:
        yield row


@torch.no_grad()
def heldout_losses(
    model,
    tables,
    *,
    seq_len: int,
    device,
    unigram=None,
    byte_lengths: np.ndarray | None = None,
    batch_rows: int = 8,
    max_docs: int = 0,
) -> dict:
    """``{"sources": {name: {modality: figures}}, "total": {modality: figures}}``; figures are
    ``ce`` (nats per token), ``tokens``, and with a unigram ``unigram`` and ``margin`` (unigram -
    ce, positive = better than token frequencies), and for text and code ``bpb``."""
    lp = unigram.log_probs() if unigram is not None else None
    n_mod = len(Modality)
    total = {k: np.zeros(n_mod) for k in ("ce", "n", "uni", "bytes")}
    sources, docs_read, dropped = {}, {}, {}
    for t in tables:
        acc = {k: np.zeros(n_mod) for k in ("ce", "n", "uni", "bytes")}
        rows = []
        packer = Packer(seq_len, pad_id=0)
        gen = _rows(t, packer, max_docs)
        while True:
            row = next(gen, None)
            if row is not None:
                rows.append(row)
            if rows and (row is None or len(rows) == batch_rows):
                batch = collate(rows)
                rows = []
                res = model(**{k: batch[k].to(device) for k in MODEL_INPUTS})
                acc["ce"] += res.ce_sum.detach().double().cpu().numpy()
                acc["n"] += res.count.detach().double().cpu().numpy()
                labels, lmod = batch["labels"], batch["label_modality"]
                if lp is not None:
                    acc["uni"] += unigram.nll_sums(labels, lmod, lp)[0].numpy()
                if byte_lengths is not None:
                    keep = (labels >= 0) & (labels < len(byte_lengths))
                    b = byte_lengths[labels[keep].numpy()]
                    acc["bytes"] += np.bincount(
                        lmod[keep].numpy(), weights=b, minlength=n_mod
                    ).astype(np.float64)
            if row is None:
                break
        sources[t.name] = _figures(acc, unigram is not None, byte_lengths is not None)
        docs_read[t.name] = len(t) if not max_docs else min(len(t), max_docs)
        dropped[t.name] = packer.stats.dropped_blocks
        for k in total:
            total[k] += acc[k]
    return {
        "sources": sources,
        "total": _figures(total, unigram is not None, byte_lengths is not None),
        "documents": docs_read,
        "sampled": bool(max_docs),
        "dropped": dropped,
    }


def _figures(acc: dict, with_unigram: bool, with_bytes: bool) -> dict:
    out = {}
    for i, name in enumerate(MODALITY_NAMES):
        n = acc["n"][i]
        if not n:
            continue
        f = {"ce": float(acc["ce"][i] / n), "tokens": int(n)}
        if with_unigram:
            f["unigram"] = float(acc["uni"][i] / n)
            f["margin"] = f["unigram"] - f["ce"]
        if with_bytes and name in ("text", "code") and acc["bytes"][i]:
            f["bpb"] = float(acc["ce"][i] / math.log(2) / acc["bytes"][i])
            f["bytes"] = int(acc["bytes"][i])
        out[name] = f
    return out
