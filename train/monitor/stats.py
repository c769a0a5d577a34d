"""Robust statistics for the detectors: scores that an early loss fall, a noisy batch mix or one
outlier do not blind.

- ``RobustTrend``: the one-step-ahead prediction of a signal from a local linear trend (Theil-Sen:
  the median of pairwise slopes over the last ``trend`` accepted values, so one outlier in the
  trend window does not tilt it), and the score of a new value: its prediction error, minus the
  median error, over the larger of 1.4826 x the median absolute deviation (MAD) of the last
  ``window`` errors (= one standard deviation for Gaussian noise) and their standard deviation. Removing the local trend is what keeps a
  falling loss from inflating the scale: the mean/std of raw values over 128 steps that still
  hold the first, steep part of the curve scored a 2x loss jump at step 100 of 150 as 2.7 sigma.
  The median centre ignores up to half the window being outliers; the scale errs high, never
  low, so heavy-tailed noise (a batch mix that swings) is not taken for spikes.
- ``median``: the plain median (no numpy: these run on a few hundred floats per step).

Every state is a few lists of floats (``state_dict``), saved in checkpoints so a resumed run
scores the same as the run that was not interrupted.
"""

from __future__ import annotations

import math
from collections import deque

MAD_TO_SIGMA = 1.4826  # MAD x this = standard deviation, for normally distributed residuals


def median(values) -> float:
    ordered = sorted(values)
    count = len(ordered)
    if count == 0:
        return math.nan
    mid = count // 2
    return ordered[mid] if count % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def theil_sen(values: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the robust line through ``values`` at x = 0, 1, ..., n - 1."""
    count = len(values)
    slopes = [(values[j] - values[i]) / (j - i) for i in range(count) for j in range(i + 1, count)]
    slope = median(slopes) if slopes else 0.0
    intercept = median(value - slope * i for i, value in enumerate(values))
    return intercept, slope


class RobustTrend:
    """Scores values of one signal against its own recent, de-trended history.

    ``log``: score ``log(value)`` (signals whose noise is multiplicative, like the gradient norm).
    ``rel_floor``: the scale is at least this fraction of the signal's level (``abs_floor`` for
    log signals), so a signal that has gone flat does not turn tiny wiggles into huge scores."""

    def __init__(
        self,
        window: int,
        *,
        trend: int = 16,
        log: bool = False,
        min_residuals: int = 8,
        rel_floor: float = 0.01,
        abs_floor: float = 0.01,
    ) -> None:
        self.window, self.trend, self.log = window, max(3, trend), log
        self.min_residuals = min_residuals
        self.rel_floor, self.abs_floor = rel_floor, abs_floor
        self.values: deque[float] = deque(maxlen=self.trend)
        self.residuals: deque[float] = deque(maxlen=window)

    def _t(self, x: float) -> float:
        return math.log(max(x, 1e-30)) if self.log else x

    def predict(self) -> float | None:
        """The next value the trend expects (in the log domain for ``log`` signals)."""
        if len(self.values) < 3:
            return None
        intercept, slope = theil_sen(list(self.values))
        return intercept + slope * len(self.values)

    def scale(self) -> float:
        """The larger of 1.4826 x MAD and the standard deviation of the errors (about the
        median): the MAD alone under-states heavy-tailed noise, such as a loss that swings with
        the batch's mix of modalities and sources, and would turn every swing into a spike."""
        center = median(self.residuals)
        mad = median(abs(residual - center) for residual in self.residuals)
        count = len(self.residuals)
        std = math.sqrt(
            sum((residual - center) ** 2 for residual in self.residuals) / max(count - 1, 1)
        )
        level = abs(self.values[-1]) if self.values else 0.0
        floor = self.abs_floor if self.log else max(self.rel_floor * level, 1e-12)
        return max(MAD_TO_SIGMA * mad, std, floor)

    def ready(self) -> bool:
        return len(self.values) >= 3 and len(self.residuals) >= self.min_residuals

    def score(self, x: float) -> float:
        """Sigmas by which ``x`` exceeds the trend's prediction (inf when ``x`` is not finite; 0
        while the history is too short to say)."""
        if not math.isfinite(x):
            return math.inf
        pred = self.predict()
        if pred is None or not self.ready():
            return 0.0
        return (self._t(x) - pred - median(self.residuals)) / self.scale()

    def add(self, x: float) -> None:
        """Take ``x`` into the history (accepted values only: a skipped spike never enters)."""
        if not math.isfinite(x):
            return
        pred = self.predict()
        if pred is not None:
            self.residuals.append(self._t(x) - pred)
        self.values.append(self._t(x))

    def state_dict(self) -> dict:
        return {"values": list(self.values), "residuals": list(self.residuals)}

    def load_state_dict(self, st: dict) -> None:
        self.values = deque(st["values"], maxlen=self.trend)
        self.residuals = deque(st["residuals"], maxlen=self.window)
