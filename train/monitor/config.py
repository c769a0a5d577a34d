"""The monitors' typed config (``configs/monitor/*.yaml``). One section per detector; each has
an ``action`` from ``ACTIONS`` and the thresholds it needs. docs/monitors.md explains each.

Actions, weakest first: ``log`` (alarms.jsonl and the metrics only), ``warn`` (also a console
line), ``skip`` (drop this step's update; only for the detectors that run before the update),
``rollback`` (back to the last good checkpoint, skipping a window of data), ``halt`` (stop the
run with an error).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

ACTIONS = ("log", "warn", "skip", "rollback", "halt")
SEVERITY = {a: i for i, a in enumerate(ACTIONS)}


@dataclass(kw_only=True)
class Detector:
    enabled: bool = True
    action: str = "warn"
    min_steps: int = 50  # no alarm before this step: early statistics are noise
    before_update: ClassVar[bool] = False  # does it run before the update (so it may skip it)?

    def validate(self, name: str) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"monitor.{name}.action {self.action!r}: choose one of {ACTIONS}")
        if self.action == "skip" and not self.before_update:
            raise ValueError(
                f"monitor.{name}.action=skip: this detector runs after the update; "
                "choose log, warn, rollback or halt"
            )


@dataclass(kw_only=True)
class SpikeConfig(Detector):
    """Loss or grad norm > mean + sigmas x std of the last ``window`` accepted steps (OLMo-core),
    or not finite. The thresholds are ``optim.skip_step``'s; this section says what else to do."""

    action: str = "skip"
    before_update: ClassVar[bool] = True


@dataclass(kw_only=True)
class DivergenceConfig(Detector):
    """Spikes that persist: at least ``max_skipped`` of the last ``window`` steps skipped, or the
    loss of the ``window`` steps after a skipped spike more than ``max_rise`` (relative) above
    that of the ``window`` steps before it."""

    action: str = "rollback"
    window: int = 20
    max_skipped: int = 4
    max_rise: float = 0.2
    min_steps: int = 0


@dataclass(kw_only=True)
class CollapseConfig(Detector):
    """A modality's normalised CE (CE / ln V_m; 1.0 = chance) over the last ``window`` steps is
    back above ``threshold`` after having been at least ``margin`` below it."""

    window: int = 20
    threshold: float = 0.95
    margin: float = 0.2


@dataclass(kw_only=True)
class StagnationConfig(Detector):
    """A modality's loss over the last ``window`` steps against the ``window`` before: it fell by
    less than ``min_drop`` (relative) or rose, while the other modalities fell by at least
    ``others_drop`` on average, for ``patience`` steps in a row (structure markers excluded)."""

    window: int = 50
    min_drop: float = 0.0
    others_drop: float = 0.02
    patience: int = 25


@dataclass(kw_only=True)
class DriftConfig(Detector):
    """log Z of a modality beyond +-``logz_abs``, or its final hidden norm ``hidden_growth`` x its
    value over the first ``window`` steps from ``min_steps`` (norm growth, Chameleon)."""

    window: int = 20
    logz_abs: float = 30.0
    hidden_growth: float = 8.0


@dataclass(kw_only=True)
class ProbeConfig(Detector):
    every: int = 100  # steps between probes (0: off); also at the last step


@dataclass(kw_only=True)
class AttentionProbeConfig(ProbeConfig):
    """Max attention logit (q.k / sqrt(d), over allowed pairs) and mean attention entropy per
    layer on ``rows`` fixed probe rows, from hooks. Alarm: max logit above ``max_logit`` or mean
    entropy below ``min_entropy`` nats (attention collapse)."""

    rows: int = 2
    max_logit: float = 50.0
    min_entropy: float = 0.05


@dataclass(kw_only=True)
class DependenceConfig(ProbeConfig):
    """Caption loss after the matched image minus after another document's image, on probe
    documents (image then caption). Alarm when the gap, once at least ``arm_gap`` nats, falls
    below ``min_gap``: the text has stopped using the image."""

    probes: int = 8
    arm_gap: float = 0.05
    min_gap: float = 0.01


@dataclass(kw_only=True)
class CodeUseConfig(ProbeConfig):
    """Images drawn from ``probes`` prompts (greedy-free sampling, ``grid`` x ``grid`` codes):
    entropy of the generated codes over ln(min(codes drawn, codebook)). Alarm below
    ``min_entropy`` (the model draws few distinct codes)."""

    probes: int = 4
    grid: int = 4
    min_entropy: float = 0.3


@dataclass(kw_only=True)
class RollbackConfig:
    margin: int = 5  # the checkpoint must be this many steps before the trouble began
    skip_window: int = 0  # steps of data skipped past those already seen (0: as many as seen)
    max_rollbacks: int = 3  # then halt: a run that keeps diverging needs a person


@dataclass(kw_only=True)
class MonitorConfig:
    enabled: bool = True
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    stagnation: StagnationConfig = field(default_factory=StagnationConfig)
    drift: DriftConfig = field(default_factory=DriftConfig)
    attention: AttentionProbeConfig = field(default_factory=AttentionProbeConfig)
    dependence: DependenceConfig = field(default_factory=DependenceConfig)
    code_use: CodeUseConfig = field(default_factory=CodeUseConfig)
    rollback: RollbackConfig = field(default_factory=RollbackConfig)

    def __post_init__(self) -> None:
        for name in (
            "spike",
            "divergence",
            "collapse",
            "stagnation",
            "drift",
            "attention",
            "dependence",
            "code_use",
        ):
            getattr(self, name).validate(name)
