"""Per source and modality: CE on held-out token shards, the unigram baseline, the margin, bits
per byte for text and code (docs/evaluation.md, "Per modality"), in the rows training validation
packs (data/loader/heldout.py).

The long-context measures never hold a row's whole logits ([B, T, V] in float32: 34 GB a row at
128k tokens and a 64k vocabulary): ``final_hidden`` stops the model before its head, whose
``logits`` are then taken at the scored positions (the needles) or chunk by chunk (``token_ce``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers.pre_tokenizers import ByteLevel

from data.loader.expand import IGNORE
from data.loader.heldout import HeldoutPass
from data.vocab import MODALITY_NAMES, Modality
from train.names import MODEL_INPUTS

CHUNK = 4096  # positions per logits chunk of token_ce


@torch.no_grad()
def final_hidden(model, batch: dict[str, torch.Tensor], device) -> torch.Tensor:
    """The final-normed hidden states [B, T, D] of ``batch`` (its model inputs on ``device``)."""
    return model.final_hidden(**{key: batch[key].to(device) for key in MODEL_INPUTS})


def token_ce(model, final: torch.Tensor, labels: torch.Tensor) -> np.ndarray:
    """Per-token cross-entropy [B, T] in float64 (0 where the label is ignored), ``CHUNK``
    positions of logits at a time."""
    out = np.zeros(labels.shape)
    for row in range(labels.shape[0]):
        for start in range(0, labels.shape[1], CHUNK):
            logits = model.output.logits(final[row, start : start + CHUNK])
            target = labels[row, start : start + CHUNK].to(logits.device)
            ce = F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="none")
            out[row, start : start + CHUNK] = ce.double().cpu().numpy()
    return out


class Heldout(HeldoutPass):
    """What every held-out measure reads: the held-out pass, in the rows training validation packs
    (the run's ``seq_len``, micro-batch and ``data.whole_documents``), and the model on its
    device."""

    def __init__(self, model, tables: list, device: torch.device, **packing) -> None:
        super().__init__(tables, **packing)
        self.model, self.device = model, device


def token_byte_lengths(text_tokenizer) -> np.ndarray:
    """UTF-8 bytes each text id stands for (specials: 0), for bits per byte: a byte-level BPE
    token is one character of the byte alphabet per byte."""
    alphabet = set(ByteLevel.alphabet())
    size = text_tokenizer.layout.text_size
    out = np.zeros(size, np.int64)
    specials = {text_tokenizer.pad_id, text_tokenizer.bos_id, text_tokenizer.eos_id}
    for i in range(size):
        tok = text_tokenizer.tok.id_to_token(i)
        if i in specials or tok is None:
            continue
        out[i] = sum(1 for char in tok if char in alphabet)
    return out


@torch.no_grad()
def heldout_losses(run: Heldout, byte_lengths: np.ndarray, unigram=None, bigram=None) -> dict:
    """``{"sources": {name: {modality: figures}}, "total": {modality: figures}}``; figures are
    ``ce`` (nats per token), ``tokens``, with a unigram ``unigram`` and ``margin`` (unigram -
    ce, positive = better than token frequencies), with a bigram (tools/evaluate/bigram.py)
    ``bigram``, the CE of the previous token alone, and for text and code ``bpb``."""
    lp = unigram.log_probs() if unigram is not None else None
    n_mod = len(Modality)
    tables = run.tables
    keys = ("ce", "n", "uni", "bi", "bytes")
    acc = [{key: np.zeros(n_mod) for key in keys} for _ in tables]
    for part in run:
        batch = run.tensors(part)
        res = run.model(**{key: batch[key].to(run.device) for key in MODEL_INPUTS})
        into = acc[part.source]
        into["ce"] += res.ce_sum.detach().double().cpu().numpy()
        into["n"] += res.count.detach().double().cpu().numpy()
        labels, lmod = batch["labels"], batch["label_modality"]
        if lp is not None:
            into["uni"] += unigram.nll_sums(labels, lmod, lp)[0].numpy()
        if bigram is not None:
            into["bi"] += bigram.nll_sums(batch["input_ids"], batch["modality"], labels, lmod)
        keep = (labels >= 0) & (labels < len(byte_lengths))
        byte_value = byte_lengths[labels[keep].numpy()]
        into["bytes"] += np.bincount(lmod[keep].numpy(), weights=byte_value, minlength=n_mod)
    total = {key: sum(a[key] for a in acc) for key in keys}
    with_uni, with_bi = unigram is not None, bigram is not None
    return {
        "sources": {t.name: _figures(a, with_uni, with_bi) for t, a in zip(tables, acc)},
        "total": _figures(total, with_uni, with_bi),
        "documents": {t.name: c.documents for t, c in zip(tables, run.counts)},
        "sampled": bool(run.max_docs),
        "dropped": {t.name: c.dropped_blocks for t, c in zip(tables, run.counts)},
        "skipped": {t.name: c.skipped for t, c in zip(tables, run.counts) if c.skipped},
        **({"bigram_tokens": bigram.tokens, "bigram_capped": bigram.capped} if with_bi else {}),
    }


def _figures(acc: dict, with_unigram: bool, with_bigram: bool) -> dict:
    out = {}
    for i, name in enumerate(MODALITY_NAMES):
        count = acc["n"][i]
        if not count:
            continue
        figures = {"ce": float(acc["ce"][i] / count), "tokens": int(count)}
        if with_unigram:
            figures["unigram"] = float(acc["uni"][i] / count)
            figures["margin"] = figures["unigram"] - figures["ce"]
        if with_bigram:
            figures["bigram"] = float(acc["bi"][i] / count)
        if name in ("text", "code") and acc["bytes"][i]:
            figures["bpb"] = float(acc["ce"][i] / math.log(2) / acc["bytes"][i])
            figures["bytes"] = int(acc["bytes"][i])
        out[name] = figures
    return out
