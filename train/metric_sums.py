"""Metric sums of a step or a log interval: a dict of floats in which a missing key reads 0.

Why not ``collections.Counter``: its values are ints to a type checker, and these are float sums
(losses, token counts, seconds). Reading a missing key does not insert it (like ``Counter``), so
every rank keeps the same keys, which ``reduce_sums`` relies on to sum them in one collective."""

from __future__ import annotations

from collections.abc import Mapping


class MetricSums(dict[str, float]):
    def __missing__(self, key: str) -> float:
        return 0.0

    def add(self, values: Mapping[str, float]) -> None:
        """Add ``values`` key by key."""
        for key, value in values.items():
            self[key] = self.get(key, 0.0) + value
