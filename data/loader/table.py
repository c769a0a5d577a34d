"""The sample tables the loader reads, one per source: where each sample's members lie, its
token count and its visual blocks. A source is *token* shards (``earlyfuse-prep tokenize``, the
fast path: a ``TokenTable``) or *raw* shards (``earlyfuse-prep ingest``, tokenized online in the
workers: a ``SampleTable`` held in memory). table_load.py builds them at start; these classes
answer the loader's per-document questions for the whole run and are pickled to its workers.
A token sample's record (offsets, tokens, blocks, hash) is looked up in its shard's
memory-mapped binary index (data/shards/token_index.py) only when it is read.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data.loader import store
from data.shards import token_index
from data.shards.storage import write_atomic

# One record of a binary index (token_index.RECORD, packed): json, ids, mod (offset, size),
# tokens, block start and count, key start and length, SHA-256. Unpacked straight from the
# memory map: one call per document read, no numpy scalar or array made.
_RECORD = struct.Struct("<6qqqiqi32s")
assert _RECORD.size == token_index.RECORD.itemsize
_NO_BLOCKS: list = []


@dataclass
class SampleTable:
    """Every sample of a source held in memory: raw sources (their index's members), and tables
    built directly (tests). Token sources are ``TokenTable``s, read lazily through the binary
    index; the loader uses only the methods below, which both provide."""

    name: str
    shards: list[str]  # shard URLs
    shard: np.ndarray  # int32 [N] shard of each sample
    keys: list[str]
    tokens: np.ndarray  # int64 [N] (raw shards: 0, known only once tokenized)
    blocks: list[list]  # per sample: [[start, end, t, h, w], ...] (raw: empty)
    fingerprint: str
    tokenizer_fingerprint: str  # tokenizer_key(...) of token shards; "" for raw shards
    kind: str  # tokens | raw: said by whoever builds a table, never assumed
    shard_bytes: list[int] = field(default_factory=list)  # per shard: where its last member ends
    members: list[dict] = field(default_factory=list)  # raw: each sample's index members
    manifest_url: str = ""
    layout_url: str = ""  # the vocabulary layout the token shards were made with
    # [modality, 2]: the id range [lo, hi) of each modality (set by the loader at start)
    id_ranges: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.shard)

    # --- what the loader asks of a table (TokenTable answers the same lazily) ----------------
    def shard_counts(self) -> np.ndarray:
        """int64 [shards]: samples per shard. Samples are numbered shard after shard."""
        return np.bincount(np.asarray(self.shard, np.int64), minlength=len(self.shards))

    def shard_of(self, sample: int) -> int:
        return int(self.shard[sample])

    def shard_end(self, si: int) -> int:
        """Where shard ``si``'s last member ends (a fetched copy must be at least this long)."""
        return self.shard_bytes[si]

    def key_of(self, sample: int) -> str:
        return self.keys[sample]

    def tokens_of(self, sample: int) -> int:
        return int(self.tokens[sample])

    def blocks_of(self, sample: int) -> list:
        return self.blocks[sample]


class TokenTable(SampleTable):
    """A token source built from its manifest alone (per shard: samples, index hash, blocks).
    Each process maps a shard's binary index when it first reads from that shard
    (``resolve_index``). Pickled (to a worker) without its maps."""

    def __init__(
        self,
        name: str,
        shards: list[str],
        counts: list[int],
        index_sha: list[str],
        *,
        fingerprint: str,
        tokenizer_fingerprint: str,
        manifest_url: str,
        layout_url: str,
        cache_dir: str,
        shard_blocks: list[dict],
        shard_sha256: list[str] | None = None,
        tokenize_options: dict | None = None,
    ) -> None:
        self.name, self.shards = name, shards
        self.counts = np.asarray(counts, np.int64)
        self.starts = [0, *np.cumsum(self.counts).tolist()]
        self.index_sha = index_sha
        self.fingerprint, self.tokenizer_fingerprint = fingerprint, tokenizer_fingerprint
        self.kind = "tokens"
        self.manifest_url, self.layout_url = manifest_url, layout_url
        self.id_ranges = None
        self.cache_dir = cache_dir
        self.shard_blocks = shard_blocks
        self.tokenize_options = tokenize_options or {}  # the manifest's (the block budgets)
        # Per shard: the SHA-256 of the whole tar its manifest records ("" where none), checked
        # once when a consumer first reads from it (data/loader/shard_check.py).
        self.shard_sha256 = shard_sha256 or [""] * len(shards)
        self._indexes: dict[int, token_index.TokenIndex] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_indexes": {}}

    def __len__(self) -> int:
        return self.starts[-1]

    def index(self, si: int) -> token_index.TokenIndex:
        """Shard ``si``'s binary index, mapped on first use."""
        idx = self._indexes.get(si)
        if idx is None:
            idx = resolve_index(self.shards[si], self.index_sha[si], self.cache_dir)
            if len(idx) != self.counts[si]:
                raise ValueError(
                    f"{store.index_url(self.shards[si])}: {len(idx)} samples, its manifest "
                    f"says {self.counts[si]}"
                )
            self._indexes[si] = idx
        return idx

    def locate(self, sample: int) -> tuple[int, int]:
        """(shard, position in it) of a sample."""
        if not 0 <= sample < self.starts[-1]:
            raise IndexError(f"sample {sample} of a source of {self.starts[-1]}")
        si = bisect.bisect_right(self.starts, sample) - 1
        return si, sample - self.starts[si]

    def shard_counts(self) -> np.ndarray:
        return self.counts

    def shard_of(self, sample: int) -> int:
        return self.locate(sample)[0]

    def shard_end(self, si: int) -> int:
        return int(self.index(si).header["shard_bytes"])

    def key_of(self, sample: int) -> str:
        si, i = self.locate(sample)
        return self.index(si).key(i)

    def tokens_of(self, sample: int) -> int:
        return self.locate_members(sample)[1]

    def blocks_of(self, sample: int) -> list:
        return list(self.locate_members(sample)[2])

    def locate_members(self, sample: int) -> tuple:
        """What reading a sample needs, flat (it runs once per document): shard, tokens, blocks,
        (offset, size) of its json, ids and mod members, SHA-256 (zeros: none in the index)."""
        si, i = self.locate(sample)
        idx = self.index(si)
        j0, jsz, i0, isz, m0, msz, tokens, b0, nb, _k0, _nk, sha = _RECORD.unpack_from(
            idx.records.data, i * _RECORD.size
        )
        blocks = idx.blocks[b0 : b0 + nb].tolist() if nb else _NO_BLOCKS
        return si, tokens, blocks, j0, jsz, i0, isz, m0, msz, sha


REBUILD = (
    "earlyfuse-prep tokenize writes it with every shard: tokenize the raw shards again (a new "
    "--out; earlyfuse-prep verify tells what else changed)"
)


def resolve_index(tar: str, index_sha: str, cache_dir: str) -> token_index.TokenIndex:
    """Shard ``tar``'s binary index (``SHARD.idx.bin`` beside it), checked to be made from the
    JSONL index of SHA-256 ``index_sha`` (the manifest's). A remote one is fetched once per node
    into the cache (``cache_dir/index/SHA.idx.bin``). ValueError naming the file when it is
    missing or made from another JSONL index."""
    beside = store.beside(tar, token_index.SUFFIX)
    cached = Path(cache_dir) / "index" / f"{index_sha}{token_index.SUFFIX}"
    if store.kind(beside) != "local" and cached.is_file():
        try:
            return token_index.TokenIndex.open(cached)  # fetched before by a consumer of this node
        except ValueError:
            cached.unlink(missing_ok=True)  # cut short by a full disk: fetched again below
    try:
        if store.kind(beside) == "local":
            data = None
            idx = token_index.TokenIndex.open(beside)
        else:
            data = store.read_bytes(beside)
            idx = token_index.TokenIndex.from_buffer(data, where=beside)
    except (OSError, ValueError) as err:
        raise ValueError(f"{beside}: no binary index of shard {tar} ({err}); {REBUILD}") from None
    if idx.header["index_sha256"] != index_sha:
        raise ValueError(
            f"{beside}: made from another JSONL index ({idx.header['index_sha256'][:16]}) than "
            f"the {index_sha[:16]} its manifest records; {REBUILD}"
        )
    if data is not None:
        try:  # best effort: a cache that cannot be written costs a fetch per process
            cached.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(cached, data)
        except OSError:
            pass
    return idx
