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
from train.names import MODEL_INPUTS


def _bytes_to_unicode() -> dict[int, str]:
    """The byte <-> printable character table of byte-level BPE (GPT-2's): printable Latin-1
    bytes map to themselves, the others to code points from 256 up, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1))
    keep += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte_value in range(256):
        if byte_value in keep:
            table[byte_value] = chr(byte_value)
        else:
            table[byte_value] = chr(256 + extra)
            extra += 1
    return table


def token_byte_lengths(text_tokenizer) -> np.ndarray:
    """UTF-8 bytes each text id stands for (specials: 0), for bits per byte."""
    char_to_byte = {char: byte_value for byte_value, char in _bytes_to_unicode().items()}
    size = text_tokenizer.layout.text_size
    out = np.zeros(size, np.int64)
    specials = {text_tokenizer.pad_id, text_tokenizer.bos_id, text_tokenizer.eos_id}
    for i in range(size):
        tok = text_tokenizer.tok.id_to_token(i)
        if i in specials or tok is None:
            continue
        out[i] = sum(1 for char in tok if char in char_to_byte)
    return out


def _rows(table, packer: Packer, max_docs: int):
    """Packed rows of one source's documents, in index order."""
    docs = iter_documents([table], max_docs_per_source=max_docs)

    def next_doc():
        d = next(docs, None)
        if d is None:
            return None
        count = len(d.ids)
        return Doc(0, 0, 0, count, units_of(count, d.blocks), d.ids.astype(np.int64), d.modality)

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
    total = {key: np.zeros(n_mod) for key in ("ce", "n", "uni", "bytes")}
    sources, docs_read, dropped = {}, {}, {}
    for source_table in tables:
        acc = {key: np.zeros(n_mod) for key in ("ce", "n", "uni", "bytes")}
        rows = []
        packer = Packer(seq_len, pad_id=0)
        gen = _rows(source_table, packer, max_docs)
        while True:
            row = next(gen, None)
            if row is not None:
                rows.append(row)
            if rows and (row is None or len(rows) == batch_rows):
                batch = collate(rows)
                rows = []
                res = model(**{key: batch[key].to(device) for key in MODEL_INPUTS})
                acc["ce"] += res.ce_sum.detach().double().cpu().numpy()
                acc["n"] += res.count.detach().double().cpu().numpy()
                labels, lmod = batch["labels"], batch["label_modality"]
                if lp is not None:
                    acc["uni"] += unigram.nll_sums(labels, lmod, lp)[0].numpy()
                if byte_lengths is not None:
                    keep = (labels >= 0) & (labels < len(byte_lengths))
                    byte_value = byte_lengths[labels[keep].numpy()]
                    acc["bytes"] += np.bincount(
                        lmod[keep].numpy(), weights=byte_value, minlength=n_mod
                    ).astype(np.float64)
            if row is None:
                break
        sources[source_table.name] = _figures(acc, unigram is not None, byte_lengths is not None)
        docs_read[source_table.name] = (
            len(source_table) if not max_docs else min(len(source_table), max_docs)
        )
        dropped[source_table.name] = packer.stats.dropped_blocks
        for key in total:
            total[key] += acc[key]
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
        count = acc["n"][i]
        if not count:
            continue
        figures = {"ce": float(acc["ce"][i] / count), "tokens": int(count)}
        if with_unigram:
            figures["unigram"] = float(acc["uni"][i] / count)
            figures["margin"] = figures["unigram"] - figures["ce"]
        if with_bytes and name in ("text", "code") and acc["bytes"][i]:
            figures["bpb"] = float(acc["ce"][i] / math.log(2) / acc["bytes"][i])
            figures["bytes"] = int(acc["bytes"][i])
        out[name] = figures
    return out
