"""The one interface training, evaluation and the probes read batches through.

A task hands the trainer a ``BatchStream``; the trainer never asks what kind it is. Two kinds
exist: ``TokenStream`` (the LM's packed rows, ``data.loader.PackedLoader``) and ``CropStream``
(the visual tokenizer's image crops, ``data.image_crops.CropStream``).

Design choices:
- Resuming is the stream's own policy (``resume``): it is given this rank's saved state (None when
  the old world had no such rank) and a way to read every old rank's state. The token loader loads
  its own state when the split (world size, workers, micro batch) is unchanged and otherwise
  redistributes every old rank's position onto the new split, exactly (docs/loader.md); the crop
  stream has one counter per rank and starts afresh when it cannot take its predecessor's.
- Shard indexes are read once per run (``TableCache``) and shared by the training loader, every
  evaluation and the probes: an index can be megabytes and remote.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from typing import Protocol

from data.image_crops import CropStream as _CropStream
from data.loader.config import SourceConfig
from data.loader.dataset import PackedLoader
from data.loader.table import SampleTable
from data.loader.table_load import load_table
from train.config_check import ConfigError


class BatchStream(Protocol):
    def __iter__(self) -> Generator[dict, None, None]:
        """Batches of this rank; close the iterator (``contextlib.closing``) to stop workers."""
        ...

    def state_dict(self) -> dict:
        """This rank's position, small (kilobytes), saved in every checkpoint."""
        ...

    def load_state_dict(self, state: dict) -> None: ...

    def resume(self, own: dict | None, every_rank: Callable[[], list[dict]]) -> str | None:
        """Continue from a checkpoint: ``own`` is this rank's saved state (None if the old world
        had no such rank), ``every_rank()`` reads all old ranks' states. Returns a note for the
        console when the position had to be moved or dropped, else None."""
        ...

    def skipped(self) -> set[str]:
        """The unreadable samples skipped so far on this rank, each named once."""
        ...

    def delivered(self) -> dict[str, float]:
        """Tokens (or images) delivered so far on this rank, per source."""
        ...

    def batches_left(self) -> int | None:
        """Batches this rank has still to yield in epoch mode (all of them before the first),
        None when the stream never ends."""
        ...

    # ``resume`` moved the position onto another split or mix, and the epoch's batches were
    # counted again from there: the run's length (train.steps=-1) is the steps done plus those left
    recounted: bool


class TableCache:
    """Every source's sample table, read once per run and shared."""

    def __init__(self) -> None:
        self._tables: dict[tuple[str, tuple[str, ...]], SampleTable] = {}

    def get(self, sources: list[SourceConfig]) -> list[SampleTable]:
        out = []
        for src in sources:
            key = (src.name, tuple(src.shards))
            if key not in self._tables:
                try:
                    self._tables[key] = load_table(src)
                except ValueError as e:  # a source that cannot be used: one line, exit code 2
                    raise ConfigError(str(e)) from None
            out.append(self._tables[key])
        return out


def same_place(state: dict, rank: int, split: dict) -> bool:
    """Whether a loader state was saved by loader rank ``rank`` of the same split."""
    return state.get("rank") == rank and all(
        state.get(key) == value for key, value in split.items()
    )


class TokenStream:
    """The LM's packed rows (``data.loader``) behind ``BatchStream``."""

    def __init__(self, loader: PackedLoader) -> None:
        self.loader = loader
        self.recounted = False

    def __iter__(self) -> Generator[dict, None, None]:
        return iter(self.loader)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    def resume(self, own: dict | None, every_rank: Callable[[], list[dict]]) -> str | None:
        try:
            return self._resume(own, every_rank)
        except ValueError as e:
            # The loader refuses a position it cannot carry (another seq_len or mode, other
            # shards): no flag makes that an exact or even a lossless resume, so the run stops
            # with one line saying what cannot change and how to go on from these weights.
            raise ConfigError(
                f"the checkpoint's data position cannot be resumed on this data: {e}. "
                "data.seq_len, data.mode and the shards (a source added or removed, other "
                "shards) cannot change within a run, even with train.allow_config_change=true: "
                "undo the change, or start a new run from these weights (earlyfuse-convert "
                "release RUN_DIR OUT, then train.init_from=OUT with another run_dir)"
            ) from None

    def _resume(self, own: dict | None, every_rank: Callable[[], list[dict]]) -> str | None:
        loader = self.loader
        split = {
            "world_size": loader.world_size,
            "workers": loader.workers,
            "micro_batch": loader.micro_batch,
        }
        from data.loader.redistribute import consumer_states, redistribute

        # The ranks of a sequence-parallel group save the same state (their loader is the data
        # rank's): one per old loader rank. When the SP degree changed but the data-parallel split
        # did not, the old rank that read this rank's rows is among them, and taken as it is.
        # Read once (every rank's file), and only when needed.
        @functools.cache
        def old() -> list[dict]:
            return list({state["rank"]: state for state in every_rank()}.values())

        if own is None or not same_place(own, loader.rank, split):
            own = next((st for st in old() if same_place(st, loader.rank, split)), None)
        if own is not None:
            loader.load_state_dict(own)
            if loader.batch_limit is not None and own["shares"] != loader.state_dict()["shares"]:
                # Epoch mode, new weights: how many batches a consumer can fill changes with the
                # mix, and every rank must stop after as many: counted again from all positions
                fresh = loader.make_stream(0, dry=True).state_dict()
                zero = {"mix": [0] * len(loader.tables)}  # as load_state_dict sets them
                states = [st | zero for st in consumer_states(old(), fresh)]
                loader.batch_limit = loader.count_batches(states)
                self.recounted = True
            return None
        # Another data-parallel size, worker count or micro batch: a split of its own, computed by
        # every rank from all old ranks' states (no communication).
        state = redistribute(old(), loader)
        loader.load_state_dict(state)
        self.recounted = loader.batch_limit is not None
        was, consumers = old()[0], state["redistributed"]["from_consumers"]
        moved = ", ".join(
            f"{key} {was[key]} -> {now}" for key, now in split.items() if was[key] != now
        )
        counts = f" from {consumers} to {loader.consumers} consumers"
        said = counts if consumers != loader.consumers else ""
        return f"the loader's state was redistributed{said} ({moved})"

    def skipped(self) -> set[str]:
        return self.loader.skipped_samples()

    def delivered(self) -> dict[str, float]:
        return {
            source: float(tokens)
            for source, tokens in self.loader.delivered()["tokens_by_source"].items()
        }

    def batches_left(self) -> int | None:
        limit = self.loader.batch_limit
        return None if limit is None else limit * self.loader.workers - self.loader.handed_out


class CropStream:
    """The visual tokenizer's random crops (``data.image_crops``) behind ``BatchStream``."""

    def __init__(self, crops: _CropStream) -> None:
        self.crops = crops
        self.recounted = False  # it never ends

    def __iter__(self) -> Generator[dict, None, None]:
        return iter(self.crops)

    def state_dict(self) -> dict:
        return self.crops.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.crops.load_state_dict(state)

    def resume(self, own: dict | None, every_rank: Callable[[], list[dict]]) -> str | None:
        if own is None:
            return f"rank {self.crops.rank} had no predecessor: a fresh data stream"
        try:
            self.crops.load_state_dict(own)
        except (ValueError, KeyError):
            return "the data stream starts afresh (its state cannot be moved to another world size)"
        return None

    def skipped(self) -> set[str]:
        return set()  # unreadable images are skipped (and counted) when the pool is loaded

    def delivered(self) -> dict[str, float]:
        return {"images": float(self.crops.k * self.crops.batch)}

    def batches_left(self) -> int | None:
        return None
