"""The contract between the training loop and its side concerns.

A callback is a small object with hooks the ``Trainer`` calls at fixed points of a run, in the
order the callbacks were registered (``train/build.py`` registers them, once):

    pre_train(trainer, step)            after the resume, before the first step (``step``: where
                                        the run starts)
    pre_step(trainer, step)             before step ``step`` (1-based) draws its first batch
    step_flags(trainer)                 before the step's sums are reduced over ranks: numbers
                                        to sum with them (``record.sums`` has their totals), so
                                        that every rank learns them without a collective of
                                        their own
    post_step(trainer, step, record)    after the optimizer step: read ``record.sums`` (reduced over
                                        ranks), add to ``record.metrics``, return a ``Decision``
                                        or None
    on_rollback(trainer, step)          the run's state was just restored to checkpoint ``step``
    post_train(trainer, step, final)    the run ended at ``step`` (its last step, or where the data
                                        ended): add to ``final`` (final.json)
    close(trainer)                      always, last, also after an error or a preemption

Design choices:
- Registration order is the data flow of a step: the callbacks that compute metrics come before
  the monitors that read them, the monitors before the sinks that write them, the sinks before the
  checkpoint that may be skipped when the monitors are unhappy.
- A callback never throws to change the run's course: it returns a ``Decision`` (roll back, halt,
  stop); the loop takes the strongest one of the step and acts on it.
- A callback with a ``state_key`` has its ``state_dict`` saved in every checkpoint under that key
  (the checkpoint's client state is the union of them) and loaded back on resume and rollback.
- Every hook has a do-nothing default, so a callback implements only what it needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from train.trainer import Trainer

# What the loop can be asked to do after a step, weakest first.
ROLLBACK, STOP, HALT = "rollback", "stop", "halt"
STRENGTH = {STOP: 0, ROLLBACK: 1, HALT: 2}


@dataclass(frozen=True, kw_only=True)
class Decision:
    """A callback's request to change the course of the run after a step.

    - ``rollback``: restore checkpoint ``to_step`` and discard ``skip_batches`` batches
      (``record``: what the rollback was, kept until a checkpoint holds it);
    - ``stop``: checkpoint this step and leave with exit code 0 (a preemption signal);
    - ``halt``: stop with an error now (``RunHalted``, exit code 3).

    A rollback outranks a stop (the state being abandoned is not worth saving; the stop request
    stays pending and is honoured at the next step), a halt outranks both."""

    action: str
    reason: str
    to_step: int = 0
    skip_batches: int = 0
    record: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.action not in STRENGTH:
            raise ValueError(f"decision {self.action!r}: choose one of {tuple(STRENGTH)}")


def strongest(decisions: Sequence[Decision | None]) -> Decision | None:
    found = [d for d in decisions if d is not None]
    return max(found, key=lambda d: STRENGTH[d.action], default=None)


@dataclass
class StepRecord:
    """One optimizer step as the callbacks see it."""

    sums: dict[str, float]  # the step's sums and counts, reduced over micro-batches and ranks
    seconds: float  # wall time of the step (forward, backward, optimizer; not the callbacks)
    data_wait: float  # of which spent waiting for batches
    metrics: dict[str, float | str] = field(default_factory=dict)  # filled by the callbacks


class Callback:
    """Base class: every hook does nothing. ``state_key`` None: nothing to checkpoint."""

    state_key: ClassVar[str | None] = None

    def pre_train(self, trainer: Trainer, step: int) -> None:
        pass

    def pre_step(self, trainer: Trainer, step: int) -> None:
        pass

    def step_flags(self, trainer: Trainer) -> dict[str, float]:
        return {}

    def post_step(self, trainer: Trainer, step: int, record: StepRecord) -> Decision | None:
        return None

    def on_rollback(self, trainer: Trainer, step: int) -> None:
        pass

    def on_mix_change(self, trainer: Trainer, step: int) -> None:
        """A resume at ``step`` trains another mix than the checkpoint's (data.sources' weights,
        allowed by train.allow_config_change): references learned on the old mix are stale."""

    def post_train(self, trainer: Trainer, step: int, final: dict) -> None:
        pass

    def close(self, trainer: Trainer) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Callbacks:
    """The registered callbacks, called in order."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.items = list(callbacks)
        keys = [c.state_key for c in self.items if c.state_key]
        if len(keys) != len(set(keys)):
            raise ValueError(f"two callbacks save their state under one key: {keys}")

    def __iter__(self):
        return iter(self.items)

    def find(self, kind: type) -> list:
        return [c for c in self.items if isinstance(c, kind)]

    def pre_train(self, trainer: Trainer, step: int) -> None:
        for c in self.items:
            c.pre_train(trainer, step)

    def pre_step(self, trainer: Trainer, step: int) -> None:
        for c in self.items:
            c.pre_step(trainer, step)

    def step_flags(self, trainer: Trainer) -> dict[str, float]:
        flags: dict[str, float] = {}
        for c in self.items:
            flags.update(c.step_flags(trainer))
        return flags

    def post_step(self, trainer: Trainer, step: int, record: StepRecord) -> Decision | None:
        # Every callback sees every step, even after an earlier one decided something.
        return strongest([c.post_step(trainer, step, record) for c in self.items])

    def on_rollback(self, trainer: Trainer, step: int) -> None:
        for c in self.items:
            c.on_rollback(trainer, step)

    def on_mix_change(self, trainer: Trainer, step: int) -> None:
        for c in self.items:
            c.on_mix_change(trainer, step)

    def post_train(self, trainer: Trainer, step: int, final: dict) -> None:
        for c in self.items:
            c.post_train(trainer, step, final)

    def close(self, trainer: Trainer) -> None:
        """Every callback's ``close``, even when one of them fails (the first error is raised)."""
        error: BaseException | None = None
        for c in self.items:
            try:
                c.close(trainer)
            except BaseException as e:  # noqa: BLE001 - the others must still close
                error = error or e
        if error is not None:
            raise error

    def state_dict(self) -> dict:
        return {c.state_key: c.state_dict() for c in self.items if c.state_key}

    def load_state_dict(self, state: dict, where: str = "the checkpoint") -> None:
        """Each callback's entry, where the checkpoint has one (a callback the resumed run turned
        on, such as the monitors, keeps its fresh state). An entry that is not in the format the
        callback writes is a CheckpointError naming ``where`` and the callback, not a KeyError
        from deep inside it."""
        from train.safe_load import CheckpointError

        for c in self.items:
            if c.state_key and c.state_key in state:
                try:
                    c.load_state_dict(state[c.state_key])
                except (KeyError, TypeError, ValueError) as e:
                    raise CheckpointError(
                        f"{where}: the {c.state_key!r} state is not in the format this code "
                        f"writes ({type(e).__name__}: {e}); resume from a checkpoint this "
                        "version saved, or start the run over"
                    ) from None
