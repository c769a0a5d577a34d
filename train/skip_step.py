"""Skip an optimizer update when the loss or the gradient norm spikes (OLMo-core's rule, made
robust).

A value is a spike when its prediction error exceeds ``sigmas`` robust standard deviations: the
prediction is a local linear trend (Theil-Sen over the last ``trend`` accepted values), the
scale 1.4826 x the median absolute deviation of the last ``window`` prediction errors
(``train/monitor/stats.py``). OLMo-core's mean + 6 sigma of the raw values is blinded by the
early loss fall: with 128 steps that still hold it, a 2x loss jump at step 100 scored 2.7 sigma.
The gradient norm is scored in log space (its noise is multiplicative), against its own,
higher threshold ``grad_norm_sigmas`` (heavier tails). Checked from step
``min_steps`` on (before that the statistics are too young). NaN and Inf always count as
spikes. A skipped update leaves the weights *and* the optimizer moments untouched:
``SkipStepAdamW.step`` returns before doing anything.

Under DeepSpeed the optimizer we pass in is wrapped (ZeRO 1-3, bf16): the wrapper computes
the global gradient norm, clips, then calls our ``step`` once per parameter group. The gate
is asked once per optimizer step (the first call) and its answer reused for the other groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from train.monitor.detectors import CONTENT
from train.monitor.stats import RobustTrend


@dataclass(kw_only=True)
class SkipStepConfig:
    enabled: bool = True
    window: int = 128  # prediction errors the robust scale is taken over
    sigmas: float = 6.0  # for the loss
    # For the gradient norm, scored in log space: its tails are heavier (a batch unlike the
    # others moves it 2-3x while the loss stays put; healthy debug runs reach 6 sigma).
    grad_norm_sigmas: float = 12.0
    min_steps: int = 64
    trend: int = 16  # accepted values the local trend is fitted to


class SpikeDetector(RobustTrend):
    """One signal's spike score: robust sigmas above its de-trended prediction."""


MIN_TOKENS = 32  # a modality with fewer label tokens in a step is neither scored nor learned from


def modality_parts(sums: dict | None) -> dict[str, tuple[float, float]]:
    """``{modality: (mean CE, tokens)}`` from a step's reduced sums (``ce_sum/<m>``,
    ``count/<m>``, as the LM task makes them); empty for a task without them."""
    out: dict[str, tuple[float, float]] = {}
    sums = sums or {}
    for key, count in sums.items():
        if key.startswith("count/") and count:
            name = key[len("count/") :]
            ce_sum = sums.get(f"ce_sum/{name}")
            if ce_sum is not None:
                out[name] = (ce_sum / count, float(count))
    return out


class SkipStepRule:
    """Decides, once per optimizer step, whether to drop the update.

    With per-modality losses (the LM task), the loss is scored *per modality*, each against its
    own de-trended history, and the scores combined weighted by the step's tokens (Stouffer's
    weighted z: ``sum(n_m z_m) / sqrt(sum(n_m^2))``). A batch that holds more of a hard modality
    is then no spike, and neither is the first batch of a modality never seen before (it has no
    history to be scored against): only a modality that got worse than its own trend counts.
    Structure markers are not scored: they are of several kinds (an image's few size tokens, CE
    near 0; a long clip's hundreds of frame and time markers, CE anywhere from 0.3 to 10 between
    passes), so their mean CE moves with the blocks a step holds, not with the update; a
    blow-up shows in the content modalities. Without per-modality losses (the visual
    tokenizer), the total loss is scored."""

    def __init__(self, cfg: SkipStepConfig) -> None:
        self.cfg = cfg
        self.loss = SpikeDetector(cfg.window, trend=cfg.trend)
        self.grad_norm = SpikeDetector(cfg.window, trend=cfg.trend, log=True)
        self.by_modality: dict[str, SpikeDetector] = {}
        self.skipped = 0
        self.last: dict = {}
        self.scored: dict[str, tuple[float, float, float]] = {}  # modality -> (z, CE, tokens)

    def loss_score(self, loss: float, parts: dict[str, tuple[float, float]]) -> float:
        if not parts:
            return self.loss.score(loss)
        num = den = 0.0
        self.scored = {}
        for name, (mean_ce, tokens) in parts.items():
            det = self.by_modality.get(name)
            if name not in CONTENT or det is None or tokens < MIN_TOKENS or not det.ready():
                continue
            score = det.score(mean_ce)
            self.scored[name] = (score, mean_ce, tokens)
            num, den = num + tokens * score, den + tokens * tokens
        return num / math.sqrt(den) if den else 0.0

    def driver(self) -> str:
        """The modality that weighed most in the last loss score, as the alarm names it (a
        step's total loss can be below the usual while one modality's rose far above its own)."""
        if not self.scored:
            return ""
        name, (score, mean_ce, tokens) = max(
            self.scored.items(), key=lambda item: item[1][0] * item[1][2]
        )
        return (
            f"{name}'s CE {mean_ce:.4g} on {int(tokens)} tokens, {score:.1f} sigma over its trend"
        )

    def decide(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        parts: dict[str, tuple[float, float]] | None = None,
    ) -> bool:
        parts = parts or {}
        loss_score, grad_score = self.loss_score(loss, parts), self.grad_norm.score(grad_norm)
        nonfinite = not (math.isfinite(loss) and math.isfinite(grad_norm))
        spike = (
            self.cfg.enabled
            and step >= self.cfg.min_steps
            and (loss_score > self.cfg.sigmas or grad_score > self.cfg.grad_norm_sigmas)
        )
        skip = nonfinite or spike
        self.last = {
            "loss_score": loss_score,
            "grad_norm_score": grad_score,
            # which bar was crossed: the two scores have their own (loss 6, grad norm 12), so
            # the larger score is not the one that crossed (loss 7.6 over 6, grad norm 8.0 under 12)
            "loss_spike": loss_score > self.cfg.sigmas,
            "driver": self.driver() if loss_score > self.cfg.sigmas else "",
            "skipped": skip,
            "nonfinite": nonfinite,
        }
        if skip:
            self.skipped += 1
        else:
            self.loss.add(loss)
            self.grad_norm.add(grad_norm)
            for name, (mean_ce, tokens) in parts.items():
                if name in CONTENT and tokens >= MIN_TOKENS:
                    self.by_modality.setdefault(
                        name, SpikeDetector(self.cfg.window, trend=self.cfg.trend)
                    ).add(mean_ce)
        return skip

    def restart_losses(self) -> None:
        """Another mix: the losses' histories start again (its levels are no spike, as a new
        modality's first batches are none); the grad norm's history stays."""
        self.loss = SpikeDetector(self.cfg.window, trend=self.cfg.trend)
        self.by_modality = {}

    def state_dict(self) -> dict:
        return {
            "loss": self.loss.state_dict(),
            "grad_norm": self.grad_norm.state_dict(),
            "by_modality": {
                name: detector.state_dict() for name, detector in self.by_modality.items()
            },
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict) -> None:
        self.loss.load_state_dict(state["loss"])
        self.grad_norm.load_state_dict(state["grad_norm"])
        self.by_modality = {}
        for name, detector_state in state["by_modality"].items():
            self.by_modality[name] = SpikeDetector(self.cfg.window, trend=self.cfg.trend)
            self.by_modality[name].load_state_dict(detector_state)
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
            params = [
                param
                for group in self.param_groups
                for param in group["params"]
                if param.grad is not None
            ]
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
        self.parts: dict[str, tuple[float, float]] = {}
        self.decision: bool | None = None

    def begin(self, step: int, loss: float, sums: dict | None = None) -> None:
        """A new optimizer step: its loss, and (optional) its reduced sums, whose per-modality
        CE sums and counts let the rule score each modality against its own history."""
        self.step, self.loss, self.decision, self.grad_norm = step, loss, None, float("nan")
        self.parts = modality_parts(sums)

    def __call__(self) -> bool:
        if self.decision is None:
            self.grad_norm = self.grad_norm_fn()
            self.decision = self.rule.decide(self.step, self.loss, self.grad_norm, self.parts)
        return self.decision
