"""Typed configuration of the loader (Hydra group ``data/``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from data.config_hint import unknown_key


@dataclass(kw_only=True)
class SourceConfig:
    name: str
    # Token or raw shard tars: paths, globs (``tokens/code/*.tar``), brace ranges
    # (``tokens/code/shard-{000000..000041}.tar``), folders (``tokens/code``), fsspec URLs
    # (``s3://bucket/tokens/code/*.tar``) or ``pipe:`` commands (``pipe:aws s3 cp s3://b/x.tar -``).
    shards: list[str] = field(default_factory=list)
    weight: float = 1.0  # share of the *tokens* delivered, relative to the others


@dataclass(kw_only=True)
class OnlineTokenizeConfig:
    """How raw sources are tokenized in the workers (the options of ``earlyfuse-prep tokenize``)."""

    image_max_pixels: int = 256 * 256
    video_max_pixels: int = 128 * 128  # per frame
    video_fps: float = 4.0
    # A video block's tokens at most; unset: data.doc_budget when set, else 4,096 (as tokenize's
    # --video-max-tokens)
    video_max_tokens: int | None = None


@dataclass(kw_only=True)
class LoaderConfig:
    sources: list[SourceConfig] = field(default_factory=list)
    validation: list[SourceConfig] = field(default_factory=list)  # held-out, measured by modality
    seq_len: int = 2048
    mode: str = "infinite"  # infinite: sources reshuffled and repeated | epoch: one pass
    seed: int = 0  # the order of shards and documents and the mix's draws (train.seed: the model's)
    shuffle_buffer: int = 1024  # samples are shuffled within windows of this many
    shuffle_shards: bool = True
    num_workers: int = 1  # DataLoader worker processes per rank (0: in the main process)
    # How the workers start: fork (from this process, at once) | forkserver (from a clean process
    # that holds torch and the loader; for trainers whose threads write or hold locks a worker may
    # need). data/loader/worker_start.py, docs/loader.md "Worker processes".
    worker_start: str = "fork"
    prefetch_factor: int = 4
    pin_memory: bool = True  # when a GPU is present
    max_pending: int = 4  # documents held aside while a visual block waits for room
    # Documents are handed to the packer in chunks of at most this many tokens (0: seq_len), the
    # sources interleaved chunk by chunk, so a long document cannot fill many rows in a row.
    mix_chunk: int = 0
    oversize: str = "drop_block"  # a visual block longer than a row: drop_block | drop_document
    # Any document that fits a row is never split across rows (one holding a picture or clip
    # never is, whatever this says): it starts a later row, held aside like a visual block (at
    # most max_pending; the row's rest is padding). For long-context stages: files, clips whole.
    # Only documents handed out in one chunk (length <= mix_chunk, default seq_len) are kept whole.
    whole_documents: bool = False
    # Raw sources tokenized online: tokens one document may take (0: no bound beyond each block's,
    # data.seq_len), as ``earlyfuse-prep tokenize --doc-budget``: a document's videos share what
    # its text and images leave of it, keeping as many frames as their share allows; a document
    # whose text and images leave its videos too little is rejected (over-doc-budget). Token
    # sources keep the budget they were tokenized with. Not implied by whole_documents: it
    # changes the tokens (docs/long_context.md).
    doc_budget: int = 0
    # A token source whose visual blocks are longer than seq_len is refused at start (they could
    # only be dropped); true: train anyway, each dropped block counted (data/dropped_blocks).
    allow_block_drops: bool = False
    max_consecutive_errors: int = 16  # unreadable samples in a row before the run stops
    # Check each token sample against the SHA-256 in its shard index (a corrupted one is skipped
    # and counted); ids are always checked against their modality's vocabulary range.
    check_hashes: bool = True
    # A token shard is checked whole when first read (data/loader/shard_check.py) only while at
    # most this many consumers (ranks x workers) share it: each hashes the whole shard but reads
    # 1/consumers of it, so with many the per-document checks cost less. 0: never.
    whole_shard_check_max_consumers: int = 8
    # Raw sources: failed video decodes a worker absorbs before it decodes every later clip in a
    # short-lived child process (decord leaks ~40 KB per failure; data/loader/decode_guard.py)
    video_failure_budget: int = 64
    stall_seconds: float = 120.0  # a read slower than this is reported
    # A tokenizer folder (tokenizer.json, vocab_layout.json, visual_tokenizer/: a token folder's
    # tokenizers/). Raw sources are tokenized with it; token sources must have been made with it.
    # Unset: the token shards' own tokenizers/ copy (local token sources only).
    tokenizers: str | None = None
    tokenize: OnlineTokenizeConfig = field(default_factory=OnlineTokenizeConfig)
    cache_dir: str | None = None  # pipe: shards are fetched here ($TMPDIR/earlyfuse-shards-UID)
    cache_limit_gb: float = 64.0  # least recently used fetched shards are deleted beyond this

    @classmethod
    def from_dict(cls, data: dict, where: str = "the data config", **overrides) -> LoaderConfig:
        """A data config's mapping (configs/data/*.yaml, a run's config.yaml ``data``) with every
        field it sets, then ``overrides`` (a tool's own settings)."""
        try:
            sections = {
                "sources": [SourceConfig(**src) for src in data.get("sources", [])],
                "validation": [SourceConfig(**src) for src in data.get("validation", [])],
                "tokenize": OnlineTokenizeConfig(**data.get("tokenize", {})),
            }
            return cls(**{**data, **sections, **overrides})
        except TypeError as e:  # a key that is no field: named, with the field it may mean
            raise ValueError(f"{where}: not a data config: {unknown_key(e, cls)}") from None


class DataUnreadable(RuntimeError):
    """``data.max_consecutive_errors`` samples in a row could not be read: the run stops (a
    storage down for longer than its patience, a source broken from here on). Its message is
    one line; a DataLoader worker's copy of it carries the worker's traceback before that line
    (``last_line``)."""

    def last_line(self) -> str:
        return str(self).strip().splitlines()[-1].rpartition("DataUnreadable: ")[2]
