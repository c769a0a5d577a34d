"""Skip an optimizer update when the loss or the gradient norm spikes (OLMo-core's rule).

A value is a spike when it exceeds mean + ``sigmas`` x std of the last ``window`` accepted
values, checked from step ``min_steps`` on (before that the statistics are too young). NaN
and Inf always count as spikes. A skipped update leaves the weights *and* the optimizer
moments untouched: ``SkipStepAdamW.step`` returns before doing anything.

Under DeepSpeed the optimizer we pass in is wrapped (ZeRO 1-3, bf16): the wrapper computes
the global gradient norm, clips, then calls our ``step`` once per parameter group. The gate
is asked once per optimizer step (the first call) and its answer reused for the other groups.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class SkipStepConfig:
    enabled: bool = True
    window: int = 128
    sigmas: float = 6.0
    min_steps: int = 64


class SpikeDetector:
    """Trailing mean/std of one signal; ``score`` is how many sigmas above the mean a value is."""

    def __init__(self, window: int) -> None:
        self.values: deque[float] = deque(maxlen=window)

    def score(self, value: float) -> float:
        if not math.isfinite(value):
            return math.inf
        if len(self.values) < 2:
            return 0.0
        n = len(self.values)
        mean = sum(self.values) / n
        std = math.sqrt(max(sum((v - mean) ** 2 for v in self.values) / (n - 1), 0.0))
        return (value - mean) / max(std, 1e-12 * max(1.0, abs(mean)))

    def add(self, value: float) -> None:
        if math.isfinite(value):
            self.values.append(value)

    def state_dict(self) -> dict:
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict) -> None:
        self.values.clear()
        self.values.extend(state["values"])


class SkipStepRule:
    """Decides, once per optimizer step, whether to drop the update."""

    def __init__(self, cfg: SkipStepConfig) -> None:
        self.cfg = cfg
        self.loss = SpikeDetector(cfg.window)
        self.grad_norm = SpikeDetector(cfg.window)
        self.skipped = 0
        self.last: dict = {}

    def decide(self, step: int, loss: float, grad_norm: float) -> bool:
        ls, gs = self.loss.score(loss), self.grad_norm.score(grad_norm)
        nonfinite = not (math.isfinite(loss) and math.isfinite(grad_norm))
        spike = self.cfg.enabled and step >= self.cfg.min_steps and max(ls, gs) > self.cfg.sigmas
        skip = nonfinite or spike
        self.last = {
            "loss_score": ls,
            "grad_norm_score": gs,
            "skipped": skip,
            "nonfinite": nonfinite,
        }
        if skip:
            self.skipped += 1
        else:
            self.loss.add(loss)
            self.grad_norm.add(grad_norm)
        return skip

    def state_dict(self) -> dict:
        return {
            "loss": self.loss.state_dict(),
            "grad_norm": self.grad_norm.state_dict(),
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict) -> None:
        self.loss.load_state_dict(state["loss"])
        self.grad_norm.load_state_dict(state["grad_norm"])
        self.skipped = int(state["skipped"])


class SkipStepAdamW(torch.optim.AdamW):
    """AdamW whose ``step`` asks ``gate()`` first and does nothing when it answers True.

    ``clip_grad`` > 0 clips here, *after* the gate has seen the unclipped norm; it is used
    where DeepSpeed would otherwise clip before calling us (plain fp32 stage 0)."""

    def __init__(self, params, **kw) -> None:
        super().__init__(params, **kw)
        self.gate: Callable[[], bool] | None = None
        self.clip_grad = 0.0

    @torch.no_grad()
    def step(self, closure=None):
        if self.gate is not None and self.gate():
            return None
        if self.clip_grad > 0:
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.clip_grad)
        return super().step(closure)


class UpdateGate:
    """The gate of one run: asked (through the optimizer) once per optimizer step, with the
    step's loss, already averaged over micro-batches and ranks, and the engine's grad norm."""

    def __init__(self, rule: SkipStepRule, grad_norm: Callable[[], float]) -> None:
        self.rule = rule
        self.grad_norm_fn = grad_norm
        self.step = 0
        self.loss = 0.0
        self.grad_norm = float("nan")
        self.decision: bool | None = None

    def begin(self, step: int, loss: float) -> None:
        self.step, self.loss, self.decision, self.grad_norm = step, loss, None, float("nan")

    def __call__(self) -> bool:
        if self.decision is None:
            self.grad_norm = self.grad_norm_fn()
            self.decision = self.rule.decide(self.step, self.loss, self.grad_norm)
        return self.decision
