"""Learning-rate schedules as multipliers of the peak lr (for ``torch.optim.lr_scheduler.LambdaLR``).

- ``cosine``: linear warmup, then cosine decay to ``min_lr_ratio`` at the last step.
- ``wsd``: warmup, stable at the peak, then a linear decay to ``min_lr_ratio`` over the last
  ``decay_fraction`` of the steps (warmup-stable-decay: a run can be extended from any
  stable-phase checkpoint and decayed later).
- ``constant``: warmup, then the peak.
"""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "wsd", "constant")


def lr_multiplier(
    step: int,
    *,
    total: int,
    warmup: int,
    schedule: str,
    min_lr_ratio: float,
    decay_fraction: float = 0.2,
) -> float:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; choose one of {SCHEDULES}")
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(1, total - warmup)
        progress = min(1.0, (step - warmup) / span)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_steps = max(1, int(round(total * decay_fraction)))
    decay_start = total - decay_steps
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / decay_steps)
    return 1.0 - (1.0 - min_lr_ratio) * progress
