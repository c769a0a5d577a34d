"""Preemption: SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) makes the run checkpoint at the next step
boundary and exit 0.

Slurm (and most schedulers) announce a preemption or the end of a time limit with a signal some
time ahead (``sbatch --signal=USR1@120``; docs/training.md). The handler only notes the signal;
every step the ranks agree on it (a flag summed over ranks with the step's own sums, so every rank
stops at the same step even when the signal reached them at different moments, and no collective
or wait for the device of its own), and the loop then saves a checkpoint and returns. A second
signal of the same kind while the first is pending kills the process as the
signal normally would (a way out if the save itself hangs).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import TYPE_CHECKING

import torch

from train.callbacks.base import STOP, Callback, Decision, StepRecord

if TYPE_CHECKING:
    from train.trainer import Trainer

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
FLAG = "signal/preempt"  # ranks that received a signal, in a step's reduced sums


# Signals received since the run started (listen_from_start): those before the trainer's handler
# existed are the trainer's to act on; a pending one keeps _launcher_died from sending another.
# The handlers before listen_from_start.
_early: list[str] = []
_original: dict[int, object] = {}


def _note_early(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    if name in _early:  # the second one: die as the signal would have made us
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    _early.append(name)


def stop_with_launcher() -> None:
    """torchrun starts its workers in sessions of their own, and a launcher killed with SIGKILL
    passes nothing on: its workers went on training, holding the run folder, until they ended.
    A worker of torchrun (``TORCHELASTIC_RUN_ID`` set) asks Linux for a signal when its parent
    dies and answers it with one SIGTERM to itself, so it stops as if preempted: a checkpoint at
    the next step, then exit. Not SIGTERM itself: the signal comes again each time the thread the
    worker is reparented to dies (the launcher's threads die one by one), and a second SIGTERM
    ends a run without its checkpoint (the way out of a hung save): none is sent when a signal
    the launcher passed on before it died is already stopping the run."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    signal.signal(signal.SIGUSR2, _launcher_died)
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGUSR2))  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the launcher died before the request: nothing will send it
        _launcher_died(int(signal.SIGUSR2), None)


_orphaned: list[int] = []


def _launcher_died(signum: int, frame) -> None:
    # Once, however many of the launcher's threads announce it, and not when a stop is pending
    # (torchrun passed a SIGTERM on, then died): that second SIGTERM would end the run unsaved.
    if not (_orphaned or _early):
        _orphaned.append(signum)
        os.kill(os.getpid(), signal.SIGTERM)


def listen_from_start() -> None:
    """Keep a SIGTERM, SIGUSR1 or SIGINT that arrives while the run starts (reading every shard index,
    building the engine, loading a checkpoint: minutes on a large corpus), before the trainer's
    own handler exists: the run then stops after its first step, with a checkpoint, and exits 0
    like one signalled later, instead of dying of it (exit 143; 138 for SIGUSR1)."""
    _early.clear()  # a signal kept for an earlier run of this process is not this run's
    for sig in SIGNALS:
        _original.setdefault(sig, signal.signal(sig, _note_early))


class Preemption(Callback):
    def __init__(self, *, device: torch.device) -> None:
        self.device = device
        self.received: str | None = None
        self.previous: dict[int, object] = {}

    def pre_train(self, trainer: Trainer, step: int) -> None:
        if _early:
            self.received = _early[-1]
        for sig in SIGNALS:
            previous = signal.signal(sig, self.on_signal)
            self.previous[sig] = _original.pop(sig, previous)

    def on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received == name:  # the second one: die as the signal would have made us
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        if signum == signal.SIGINT:  # at a terminal: say what the key press does
            os.write(
                2,
                b"Ctrl-C: stopping after this step with a checkpoint (press it again to "
                b"quit without one)\n",
            )
        self.received = name
        _early.append(name)  # for _launcher_died

    def step_flags(self, trainer: Trainer) -> dict[str, float]:
        return {FLAG: 1.0 if self.received else 0.0}

    def post_step(self, trainer: Trainer, step: int, record: StepRecord) -> Decision | None:
        if not record.sums.get(FLAG):
            return None
        return Decision(action=STOP, reason=self.received or "a signal to another rank")

    def close(self, trainer: Trainer) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self.previous = {}
