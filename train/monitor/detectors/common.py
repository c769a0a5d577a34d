"""What the detectors share: the rising-edge latch, per-modality loss windows and levels."""

from __future__ import annotations

import math
from collections import defaultdict, deque

from data.vocab import MODALITY_NAMES
from train.monitor.stats import MAD_TO_SIGMA, median


class _Latch:
    """Which (signal, modality) conditions are on now; fire on the rising edge only. Each open
    condition remembers ``since``, the step its trouble began: while it is open, the
    newest checkpoint before that step is kept (``Monitor.protected_steps``)."""

    def __init__(self) -> None:
        self.on: set[str] = set()
        self.since: dict[str, int] = {}

    def edge(self, key: str, condition: bool, since: int | None = None) -> bool:
        if condition and key not in self.on:
            self.on.add(key)
            if since is not None:
                self.since[key] = since
            return True
        if not condition:
            self.on.discard(key)
            self.since.pop(key, None)
        return False

    def open_since(self) -> list[int]:
        return [since for key, since in self.since.items() if key in self.on]

    def state_dict(self) -> dict:
        return {"on": sorted(self.on), "since": dict(self.since)}

    def load_state_dict(self, st: dict) -> None:
        self.on = set(st["on"])
        self.since = {key: int(value) for key, value in st["since"].items() if key in self.on}


class ModalityWindows:
    """Per modality, the last ``2 * window`` steps' (CE sum, token count) pairs: of the model's
    loss (``loss/<m>``), or of another per-token CE in the metrics (``key``)."""

    def __init__(self, window: int, key: str = "loss/") -> None:
        self.window, self.key = window, key
        self.steps: dict[str, deque] = {
            modality: deque(maxlen=2 * window) for modality in MODALITY_NAMES
        }

    def add(self, metrics: dict) -> None:
        for name in MODALITY_NAMES:
            tokens = metrics.get(f"tokens/{name}", 0.0)
            loss = metrics.get(f"{self.key}{name}", 0.0) if tokens else 0.0
            self.steps[name].append((loss * tokens, tokens) if math.isfinite(loss) else (0.0, 0.0))

    def part(self, name: str, recent: bool = True) -> list | None:
        pairs = list(self.steps[name])
        if len(pairs) < (self.window if recent else 2 * self.window):
            return None
        return pairs[-self.window :] if recent else pairs[-2 * self.window : -self.window]

    def mean(self, name: str, recent: bool = True, newest: int = 0) -> float | None:
        """Token-weighted CE of the last ``window`` steps (``recent``) or the ``window`` before;
        ``newest``: of the last ``newest`` steps only (once ``window`` steps are in)."""
        part = self.part(name, recent) or []
        part = part[-newest:] if newest and recent else part
        tokens = sum(count for _, count in part)
        return sum(ce_sum for ce_sum, _ in part) / tokens if tokens else None

    def stats(
        self, name: str, recent: bool = True, block: int = 1
    ) -> tuple[float, float, float, float] | None:
        """(token-weighted mean CE, its standard error, tokens, share of the window's steps that
        hold the modality) of one window. The error is the sandwich estimate over blocks of
        ``block`` consecutive steps (weights = tokens): a window whose steps disagree, or whose
        tokens sit in a few steps, is known to be uncertain. Blocks, because neighbouring steps
        are not independent: a long document's row-sized chunks reach the model over
        consecutive steps, so a hard or easy file moves several steps' loss together, and an
        error computed as if every step were a fresh draw is too small (batch means)."""
        part = self.part(name, recent)
        tokens = sum(count for _, count in part) if part else 0
        if not part or not tokens:
            return None
        presence = sum(1 for _, count in part if count) / len(part)
        mean = sum(ce_sum for ce_sum, _ in part) / tokens
        blocks = [
            (sum(ce for ce, _ in part[i : i + block]), sum(n for _, n in part[i : i + block]))
            for i in range(0, len(part), block)
        ]
        var = sum(
            count * count * (ce_sum / count - mean) ** 2 for ce_sum, count in blocks if count
        ) / (tokens * tokens)
        return mean, math.sqrt(var), tokens, presence

    def state_dict(self) -> dict:
        return {name: list(pairs) for name, pairs in self.steps.items()}

    def load_state_dict(self, st: dict) -> None:
        for name, pairs in st.items():
            self.steps[name] = deque([tuple(pair) for pair in pairs], maxlen=2 * self.window)


class Levels:
    """Per modality, the token-weighted loss of the last ``window`` steps (its *level*, counted
    when the window holds at least ``min_tokens`` tokens), the minimum level over the last
    ``horizon`` steps (a monotone queue) and how far the level has wandered over them (the
    median and 1.4826 x MAD of its values: a modality whose sources differ wildly in difficulty,
    easy captions and hard prose, swings by itself and needs a bigger rise to count)."""

    def __init__(self, window: int, horizon: int, min_tokens: int, history_from: int = 0) -> None:
        self.window, self.horizon, self.min_tokens = window, horizon, min_tokens
        self.history_from = history_from  # the early fall is no measure of how levels wander
        self.steps: dict[str, deque] = defaultdict(lambda: deque(maxlen=window))
        self.minq: dict[str, deque] = defaultdict(deque)
        self.history: dict[str, deque] = defaultdict(lambda: deque(maxlen=horizon))

    def spread(self, name: str) -> tuple[float, float]:
        """(median, robust spread) of the modality's levels over the horizon."""
        levels = self.history[name]
        mid = median(levels)
        return mid, MAD_TO_SIGMA * median(abs(level - mid) for level in levels)

    def add(
        self,
        step: int,
        metrics: dict,
        names: tuple[str, ...] = MODALITY_NAMES,
        min_tokens: int = -1,
    ) -> dict[str, tuple[float, float, float]]:
        """Take one step; returns ``{modality: (level, minimum, tokens in the window)}``."""
        out = {}
        need = self.min_tokens if min_tokens < 0 else min_tokens
        for name in names:
            count = metrics.get(f"tokens/{name}", 0.0)
            loss = metrics.get(f"loss/{name}", 0.0) if count else 0.0
            self.steps[name].append((loss * count, count) if math.isfinite(loss) else (0.0, 0.0))
            tokens = sum(tokens_in_step for _, tokens_in_step in self.steps[name])
            if tokens < need or tokens <= 0:
                continue
            level = sum(ce_sum for ce_sum, _ in self.steps[name]) / tokens
            minima = self.minq[name]
            while minima and minima[-1][1] >= level:
                minima.pop()
            minima.append((step, level))
            while minima[0][0] <= step - self.horizon:
                minima.popleft()
            if step >= self.history_from:
                self.history[name].append(level)
            out[name] = (level, minima[0][1], tokens)
        return out

    def state_dict(self) -> dict:
        return {
            "steps": {name: list(queue) for name, queue in self.steps.items()},
            "minq": {name: list(queue) for name, queue in self.minq.items()},
            "history": {name: list(queue) for name, queue in self.history.items()},
        }

    def load_state_dict(self, st: dict) -> None:
        for name, queue in st["steps"].items():
            self.steps[name] = deque([tuple(pair) for pair in queue], maxlen=self.window)
        for name, queue in st["minq"].items():
            self.minq[name] = deque(tuple(pair) for pair in queue)
        for name, queue in st["history"].items():
            self.history[name] = deque(queue, maxlen=self.horizon)
