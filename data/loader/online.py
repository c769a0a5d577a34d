"""Online tokenization: raw shards (``earlyfuse-prep ingest``) become token documents inside the
loader's workers, with the encoder ``earlyfuse-prep tokenize`` uses (data/tokenize/), its
options made by the same function (data/tokenize/docs.py ``budgeted_options``). One document at
a time: its tokens never depend on its neighbours, so a restored stream re-encodes a held-aside
document to the same ids. The rest (the visual tokenizer on the worker's CPU, the budgets, the
decode guard): docs/loader.md, "Raw shards, tokenized in the workers".
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from data.loader.config import LoaderConfig
from data.loader.decode_guard import DecodeGuard
from data.names import VISUAL_TOKENIZER_DIR
from data.schema import Reject
from data.shards.reader import RawDoc
from data.text_tokenizer import TextTokenizer
from data.tokenize.docs import budgeted_options
from data.tokenize.encoder import DocEncoder, TokenDoc, TokenizeOptions
from data.tokenize.visual import load_visual_tokenizer

# What the loader calls tokenize's --seq-len, --max-block-tokens and --doc-budget (the loader has
# no block budget of its own: a row's length is its bound)
LOADER_NAMES = ("data.seq_len", "max_block_tokens", "data.doc_budget")


def online_options(cfg: LoaderConfig) -> TokenizeOptions:
    """The ``TokenizeOptions`` of a LoaderConfig's ``tokenize`` section and ``doc_budget``; the
    row length is applied by ``OnlineTokenizer`` (a state's fingerprint records these)."""
    return budgeted_options(doc_budget=cfg.doc_budget, names=LOADER_NAMES, **asdict(cfg.tokenize))


class OnlineTokenizer:
    """Built lazily in each worker process (tokenizers are not shared across processes), from
    the loader's tokenizer folder, ``tokenize`` options, row length and decode failure budget."""

    def __init__(self, cfg: LoaderConfig) -> None:
        if not cfg.tokenizers:  # build_loader refuses this at start (dataset.check_tokenizers)
            raise ValueError("raw shards are tokenized with data.tokenizers, which is unset")
        folder = Path(cfg.tokenizers)
        text = TextTokenizer.load(folder)
        vtok = load_visual_tokenizer(folder / VISUAL_TOKENIZER_DIR, text.layout, "cpu")
        # Every image and video block fits in a row of ``seq_len``, as with tokenize --seq-len
        base = online_options(cfg)
        opts = budgeted_options(seq_len=cfg.seq_len, names=LOADER_NAMES, **asdict(base))
        self.encoder = DocEncoder(text, vtok, opts, torch.device("cpu"))
        # Failing clips leak inside decord: past a budget, each is decoded in a child process
        self.encoder.decode_frames = DecodeGuard(cfg.video_failure_budget)

    def encode(self, key: str, members: dict, shard_name: str, f) -> tuple[TokenDoc | None, str]:
        """(document, "") or (None, why it was rejected). ``f`` is the open shard."""
        rd = RawDoc(key, {}, {"members": members}, Path(shard_name), f)
        try:
            rd.doc = json.loads(rd.member("json"))
        except ValueError as e:
            return None, f"{key}.json is not valid JSON ({e})"
        try:
            got = self.encoder.encode_chunk([rd])[0]
        except (KeyError, TypeError, IndexError, AttributeError) as e:
            # A JSON member that is not a document of our schema: rejected, never a dead worker.
            return (
                None,
                f"{key}.json is not a document of the raw shard schema ({type(e).__name__}: {e})",
            )
        if isinstance(got, Reject):
            return None, f"{got.reason}: {got.detail}"
        return got, ""
