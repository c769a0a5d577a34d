"""``Divergence``: a run pushed off its trajectory (persistent spikes, or a sustained rise)."""

from __future__ import annotations

import math
from collections import deque

from data.vocab import MODALITY_NAMES
from train.monitor.alarms import Alarm
from train.monitor.config import DivergenceConfig
from train.monitor.detectors.common import Levels, _Latch

CONTENT = ("text", "code", "image", "video")  # structure markers are learned in a few steps


class Divergence:
    """A run pushed off its trajectory. Two rules, either fires:

    - spikes that persist: a skipped update leaves the weights as they were, so a run pushed off
      course keeps spiking (``max_skipped`` of the last ``window`` steps skipped);
    - a sustained rise, which needs no skip (the spike gate may have let the blow-up through, or
      it was too gradual to be a spike): each modality's level against its own minimum over the
      last ``horizon`` steps, combined with the current window's token counts as weights, so a
      batch that holds more of a hard modality is not a rise. The modalities that rose must hold
      at least ``min_share`` of the tokens: one small modality going its own way (a source that
      broke, a modality starved) is ``collapse`` or ``stagnation``, a warning, not a reason to
      roll back.

    ``since`` is the step the rise began (or the first skipped step): a rollback goes to a
    checkpoint at least ``monitor.rollback.margin`` steps before it."""

    def __init__(self, cfg: DivergenceConfig) -> None:
        self.cfg = cfg
        self.skipped: deque[tuple[int, bool]] = deque(maxlen=cfg.window)
        self.levels = Levels(cfg.level_window, cfg.horizon, cfg.min_tokens, cfg.rise_from)
        self.seen: set[str] = set()  # content modalities met so far
        self.streak = 0
        self.excursion: int | None = None  # first step of the current rise
        self.last_skip: int | None = None
        self.latch = _Latch()

    def check(self, step: int, metrics: dict) -> list[Alarm]:
        cfg = self.cfg
        skipped = bool(metrics.get("optim/skipped", 0.0))
        self.skipped.append((step, skipped))
        n_skipped = sum(was_skipped for _, was_skipped in self.skipped)
        metrics["monitor/skipped_in_window"] = float(n_skipped)
        # A skipped step's loss stays out of the levels (a lone spike is the gate's business).
        total, rises, tokens = self._rise(step, metrics) if not skipped else (None, {}, {})
        # The rise rule waits for the early fall to settle (``rise_from``), except for a rise
        # right after a skipped spike (that spike's update is the likely cause), and for the
        # level and its minimum to have had a window each.
        after_spike = self.last_skip is not None and step - self.last_skip <= 2 * cfg.level_window
        rising = [
            name
            for name, rise in rises.items()
            if rise > cfg.max_rise and self._clear(name, after_spike)
        ]
        share = sum(tokens[name] for name in rising) / max(sum(tokens.values()), 1e-9)
        cond = (
            step >= 2 * cfg.level_window
            and (step >= cfg.rise_from or after_spike)
            and total is not None
            and total > cfg.max_rise
            and share >= cfg.min_share
        )
        if not skipped:
            self.streak = self.streak + 1 if cond else 0
            if total is not None and total > cfg.max_rise / 4:
                self.excursion = self.excursion or step
            elif total is not None:
                self.excursion = None
        if skipped:
            self.last_skip = step
        bad = [skipped_step for skipped_step, was_skipped in self.skipped if was_skipped]
        by_skips = n_skipped >= cfg.max_skipped
        firing = step >= cfg.min_steps and (by_skips or self.streak >= cfg.patience)
        # The trouble began at the first skipped spike of the window, or where the rise began
        # (at a spike skipped just before it, if any: the update before that spike did it).
        if by_skips:
            since = min(bad)
        else:
            since = self.excursion or step
            if self.last_skip is not None and 0 <= since - self.last_skip <= cfg.level_window:
                since = self.last_skip
        if not self.latch.edge("div", firing, since):
            return []
        if by_skips:
            why = f"{n_skipped} of the last {len(self.skipped)} steps were skipped as spikes"
            threshold = f"{cfg.max_skipped} skipped in {cfg.window} steps"
        else:
            why = (
                f"the loss (mix held fixed) stayed {total:+.0%} over its minimum of the last "
                f"{cfg.horizon} steps for {self.streak} steps; risen: "
                + ", ".join(f"{name} {rises[name]:+.0%}" for name in rising)
            )
            threshold = (
                f"rise > {cfg.max_rise:.0%} for {cfg.patience} steps, in modalities holding >= "
                f"{cfg.min_share:.0%} of the tokens"
            )
        return [
            Alarm(
                step,
                "divergence",
                cfg.action,
                since=since,
                values={
                    "skipped": n_skipped,
                    "rise": total or 0.0,
                    **{f"rise/{name}": rise_value for name, rise_value in rises.items()},
                },
                message=f"{why} (trouble began at step {since})",
                threshold=threshold,
                cause="an update too large for the weights (learning rate too high for this point of "
                "training, a bad batch, or optimizer state blown up): the run has left its trajectory",
                advice="roll back to a checkpoint before the trouble and skip the data seen since; "
                "if it recurs, lower optim.lr or check the batches named in the rise",
            )
        ]

    def _clear(self, name: str, after_spike: bool) -> bool:
        """The modality's level stands ``z`` robust spreads above its median over the horizon:
        beyond what it wanders by itself. With too little history to know its swings, only a
        rise right after a skipped spike counts."""
        levels = self.levels.history[name]
        if len(levels) < self.cfg.level_window:
            return after_spike
        mid, spread = self.levels.spread(name)
        return levels[-1] > mid + self.cfg.z * spread

    @property
    def watch(self) -> dict | None:
        """The rise being watched (where it began, how many steps it has held), or None."""
        if self.excursion is None:
            return None
        return {"since": self.excursion, "streak": self.streak}

    def _rise(
        self, step: int, metrics: dict
    ) -> tuple[float | None, dict[str, float], dict[str, float]]:
        """(the mix-held-fixed rise, each content modality's rise, its tokens in the window)."""
        obs, names, need = metrics, MODALITY_NAMES, -1
        if not any(metrics.get(f"tokens/{modality}") for modality in MODALITY_NAMES):
            # No per-modality losses (the visual tokenizer's task): the total loss, alone, a
            # full window of steps.
            loss = metrics.get("train/loss", math.nan)
            obs = {"tokens/total": 1.0, "loss/total": loss} if math.isfinite(loss) else {}
            names, need = ("total",), self.cfg.level_window
        levels = self.levels.add(step, obs, names, need)
        excess = base = 0.0
        rises, counts = {}, {}
        for name, (level, low, tokens) in levels.items():
            if name in CONTENT or name == "total":
                self.seen.add(name)
                rises[name] = level / low - 1 if low > 0 else 0.0
                counts[name] = tokens
                metrics[f"monitor/rise/{name}"] = rises[name]
            excess += tokens * (level - low)
            base += tokens * low
        if base <= 0:
            return None, rises, counts
        metrics["monitor/rise/total"] = excess / base
        return excess / base, rises, counts

    def troubled(self) -> bool:
        """A step was skipped in the window, or the loss is rising: no checkpoint to return to."""
        return any(bad for _, bad in self.skipped) or self.streak > 0

    def reset_levels(self) -> None:
        """The loss levels start again (another mix: its levels are no rise); the steps skipped
        as spikes stay in the window."""
        cfg = self.cfg
        self.levels = Levels(cfg.level_window, cfg.horizon, cfg.min_tokens, cfg.rise_from)
        self.seen = set()
        self.streak, self.excursion = 0, None
        self.latch = _Latch()

    def reset(self) -> None:
        self.skipped.clear()
        self.streak, self.excursion, self.last_skip = 0, None, None
        self.latch = _Latch()

    def state_dict(self) -> dict:
        return {
            "skipped": list(self.skipped),
            "levels": self.levels.state_dict(),
            "seen": sorted(self.seen),
            "streak": self.streak,
            "excursion": self.excursion,
            "last_skip": self.last_skip,
            "latch": self.latch.state_dict(),
        }

    def load_state_dict(self, st: dict) -> None:
        self.skipped = deque([tuple(pair) for pair in st["skipped"]], maxlen=self.cfg.window)
        self.levels.load_state_dict(st["levels"])
        self.seen = set(st["seen"])
        self.streak = int(st["streak"])
        self.excursion = st["excursion"]
        self.last_skip = st["last_skip"]
        self.latch.load_state_dict(st["latch"])
