"""The trainer's side concerns, one small callback each (``base.py`` has the contract; the
registration order is in ``train/build.py``; docs/training.md, "How the trainer is organised")."""

from train.callbacks.base import HALT, ROLLBACK, STOP, Callback, Callbacks, Decision, StepRecord

__all__ = ["HALT", "ROLLBACK", "STOP", "Callback", "Callbacks", "Decision", "StepRecord"]
