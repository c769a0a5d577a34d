"""Learning-rate schedules as multipliers of the peak lr (for ``torch.optim.lr_scheduler.LambdaLR``).

- ``cosine``: linear warmup, then cosine decay to ``min_lr_ratio`` at the last step.
- ``wsd``: warmup, stable at the peak, then a linear decay to ``min_lr_ratio`` over the last
  ``decay_fraction`` of the steps (warmup-stable-decay: a run can be extended from any
  stable-phase checkpoint and decayed later).
- ``constant``: warmup, then the peak.

On top of any of them, ``optim.lr_changes`` multiplies the lr over step ranges
(``LrChange``): lower the lr of a running job from some step on when resuming it (what the
OPT-175B team did by hand after each divergence), or hold a lower lr through a stretch of data
known to spike. The instability suite uses one (x100 for 20 steps) to reproduce an lr blow-up
from a config alone.

``CappedLambdaLR`` can cap the multiplier: after a monitor's rollback the run never goes back
above ``monitor.rollback.lr_scale`` x the lr it had at the checkpoint it returned to
(``monitor.rollback.cap_lr``; the OPT-175B team lowered the lr after each restart), so a
divergence caused by the lr does not simply recur. The cap is part of the scheduler's state and
travels with every checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from torch.optim.lr_scheduler import LambdaLR

SCHEDULES = ("cosine", "wsd", "constant")


@dataclass(kw_only=True)
class LrChange:
    """Multiply the schedule's lr by ``scale`` for optimizer steps ``step`` <= s < ``until``
    (``until`` 0: to the end). Steps count from 0, as the scheduler's; ranges may overlap (the
    scales multiply)."""

    step: int
    scale: float
    until: int = 0

    def __post_init__(self) -> None:
        if self.step < 0 or self.scale < 0 or (self.until and self.until <= self.step):
            raise ValueError(
                f"optim.lr_changes entry {self}: needs step >= 0, scale >= 0 and until > step "
                "(or until 0 for the rest of the run)"
            )

    def applies(self, step: int) -> bool:
        return step >= self.step and (not self.until or step < self.until)


def lr_multiplier(
    step: int,
    *,
    total: int,
    warmup: int,
    schedule: str,
    min_lr_ratio: float,
    decay_fraction: float = 0.2,
    changes: list[LrChange] | tuple[LrChange, ...] = (),
) -> float:
    base = _base_multiplier(
        step,
        total=total,
        warmup=warmup,
        schedule=schedule,
        min_lr_ratio=min_lr_ratio,
        decay_fraction=decay_fraction,
    )
    for change in changes:
        if change.applies(step):
            base *= change.scale
    return base


def _base_multiplier(
    step: int, *, total: int, warmup: int, schedule: str, min_lr_ratio: float, decay_fraction: float
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


class CappedLambdaLR(LambdaLR):
    """``LambdaLR`` over one multiplier function, which ``cap_here()`` can cap at its current
    value. ``cap`` (None: no cap) is an attribute, so ``state_dict()`` saves it and
    ``load_state_dict()`` restores it."""

    def __init__(self, optimizer, multiplier: Callable[[int], float]) -> None:
        self.cap: float | None = None
        self.uncapped = multiplier

        def capped(step: int) -> float:
            value = self.uncapped(step)
            return value if self.cap is None else min(value, self.cap)

        super().__init__(optimizer, capped)

    def state_dict(self) -> dict:
        # The multiplier comes from the config (a resumed run may change optim.lr_changes),
        # never from the checkpoint: only the cap and the step travel.
        return {key: value for key, value in super().state_dict().items() if key != "uncapped"}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(
            {key: value for key, value in state_dict.items() if key != "uncapped"}
        )

    def stretch_to(self, total: int) -> None:
        """The schedule's length is now ``total`` steps, from the current step on (a run until
        the data ends, resumed on another split: the epoch was counted again); the multiplier
        must be ``lr_multiplier`` with its settings bound, as ``build_engine`` makes it."""
        assert isinstance(self.uncapped, partial), "stretch_to needs lr_multiplier's partial"
        self.uncapped = partial(self.uncapped.func, **{**self.uncapped.keywords, "total": total})
        self.set_current_lr()

    def cap_here(self, scale: float = 1.0) -> float:
        """From now on the multiplier never exceeds ``scale`` x what it is at the current step
        (the step a rollback returned to), this step's update included; returns the cap."""
        here = scale * self.uncapped(self.last_epoch)
        self.cap = here if self.cap is None else min(self.cap, here)
        self.set_current_lr()
        return self.cap

    def set_current_lr(self) -> None:
        """The optimizer's lr for the current step, as ``step()`` would have set it: after a
        checkpoint load or a new cap, the next update takes it (not the one after)."""
        lrs = [base * rule(self.last_epoch) for rule, base in zip(self.lr_lambdas, self.base_lrs)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs
