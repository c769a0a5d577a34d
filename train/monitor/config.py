"""The monitors' typed config (``configs/monitor/*.yaml``). One section per detector; each has
an ``action`` from ``ACTIONS`` and the thresholds it needs. docs/monitors.md explains each.

Actions, weakest first: ``log`` (alarms.jsonl and the metrics only), ``warn`` (also a console
line), ``skip`` (drop this step's update; only for the detectors that run before the update),
``rollback`` (back to the last good checkpoint, skipping a window of data), ``halt`` (stop the
run with an error).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

ACTIONS = ("log", "warn", "skip", "rollback", "halt")
SEVERITY = {a: i for i, a in enumerate(ACTIONS)}


def check_ranges(section: object, where: str) -> None:
    """Every number of a section is 0 or more, except those it names ``SIGNED``; those it names
    ``POSITIVE`` (windows, counts, factors) above 0, ``FRACTIONS`` within [0, 1]: a value out of
    range is a ValueError naming it (a window of 0 crashed mid-run, a negative lr scale ran)."""
    kinds = {
        name: kind
        for kind in ("POSITIVE", "FRACTIONS", "SIGNED")
        for name in getattr(section, kind, ())
    }
    for f in fields(section):  # type: ignore[arg-type]
        value, kind = getattr(section, f.name), kinds.get(f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or kind == "SIGNED":
            continue
        if kind == "POSITIVE" and not value > 0:
            need = "1 or more" if isinstance(value, int) else "a number above 0"
        elif kind == "FRACTIONS" and not 0 <= value <= 1:
            need = "a share between 0 and 1"
        elif value < 0:
            need = "0 or more"
        else:
            continue
        raise ValueError(f"{where}.{f.name} {value}: give {need}")


@dataclass(kw_only=True)
class Detector:
    enabled: bool = True
    action: str = "warn"
    min_steps: int = 50  # no alarm before this step: early statistics are noise
    before_update: ClassVar[bool] = False  # does it run before the update (so it may skip it)?

    def validate(self, name: str) -> None:
        check_ranges(self, f"monitor.{name}")
        if self.action not in ACTIONS:
            fits = [a for a in ACTIONS if a != "skip" or self.before_update]
            raise ValueError(f"monitor.{name}.action {self.action!r}: choose {', '.join(fits)}")
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
    """A run that has left its trajectory, by either of two rules:

    - spikes that persist: at least ``max_skipped`` of the last ``window`` steps skipped;
    - a sustained rise: the loss, with the batch's mix of modalities held fixed, more than
      ``max_rise`` (relative) above its minimum over the last ``horizon`` steps, for
      ``patience`` steps in a row, the modalities above their own minimum by ``max_rise`` (and
      ``z`` robust spreads above their median level of the horizon, so a modality that swings
      with its sources' difficulty must rise beyond its swings) holding at least ``min_share``
      of the tokens. Each modality's level is its token-weighted
      loss over the last ``level_window`` steps, counted when it holds ``min_tokens`` tokens.
      This rule needs no skipped step: it catches a blow-up the spike gate let through."""

    POSITIVE: ClassVar = (
        "window",
        "max_skipped",
        "max_rise",
        "level_window",
        "horizon",
        "patience",
    )
    FRACTIONS: ClassVar = ("min_share",)

    action: str = "rollback"
    window: int = 20
    max_skipped: int = 4
    max_rise: float = 0.2
    level_window: int = 10
    horizon: int = 200
    patience: int = 5
    rise_from: int = 50  # the rise rule starts here (at once after a skipped spike)
    min_share: float = 0.5
    z: float = 3.0  # a modality rose only when its level is z robust spreads above its median
    min_tokens: int = 256
    min_steps: int = 0  # the rise rule also waits for 2 x level_window steps


@dataclass(kw_only=True)
class CollapseConfig(Detector):
    """A modality's normalised CE (CE / ln V_m; 1.0 = chance) over the last ``window`` steps is
    back above ``threshold`` after having been at least ``margin`` below it; or its CE over the
    unigram CE of its own tokens (``unigram/<m>``: what their frequencies alone predict) is, for
    ``unigram_patience`` steps in a row (0: off)."""

    POSITIVE: ClassVar = ("window", "threshold")

    window: int = 20
    threshold: float = 0.95
    margin: float = 0.2
    min_tokens: int = 256  # a window with fewer tokens of the modality is not judged
    # noise over a few ids (base64, compressed bytes, hex dumps) sits far below ln V but at its
    # unigram CE; a stretch of hard files reaches it for a few steps, broken data stays
    unigram_patience: int = 25


@dataclass(kw_only=True)
class StagnationConfig(Detector):
    """A modality's loss over the last ``window`` steps against the ``window`` before, each over
    the unigram CE of the same tokens (the data's difficulty): it fell by
    less than ``min_drop`` (relative) or rose, while the other modalities fell by at least
    ``others_drop`` on average (token-weighted), the two changes at least ``z`` standard errors
    apart (errors over blocks of ``block_steps`` consecutive steps), each window holding at least ``min_tokens`` tokens of the modality in at least
    ``min_presence`` of its steps and from at least ``min_docs`` documents, its data's unigram CE
    within ``max_data_shift`` of the window before, for ``patience`` steps in a row (structure
    markers excluded). A run that evaluates held-out data (``data.validation``,
    ``train.eval_every`` > 0) has it confirmed there: the modality's held-out loss fell by less
    than ``heldout_drop`` (relative) between the evaluation before the trouble and the next one,
    and lagged the others' by more; if not, it is logged, not raised."""

    POSITIVE: ClassVar = ("window", "patience", "block_steps")
    FRACTIONS: ClassVar = ("min_presence", "starve_ratio", "heldout_drop")
    SIGNED: ClassVar = ("min_drop",)

    window: int = 50
    min_drop: float = 0.0
    others_drop: float = 0.02
    z: float = 3.0
    min_tokens: int = 1000
    min_presence: float = 0.5  # share of a window's steps that must hold the modality
    patience: int = 25
    # the standard errors treat runs of this many consecutive steps as one draw (a long
    # document's chunks arrive over neighbouring steps; 1: every step independent)
    block_steps: int = 5
    # a window is judged only when its tokens of the modality came from at least this many
    # documents (those new to it in the window plus the one under way, or fewer by their token
    # mass: data/docs_new/<m>, data/docs_mass/<m>): whole long files otherwise make the
    # modality's loss follow each file's difficulty
    min_docs: int = 8
    # a window is judged only when the modality's data kept its difficulty: the unigram CE of
    # its tokens (unigram/<modality>) over the newest half window within this fraction of the
    # window before's, for the last two windows (0: off). A source whose content shifts (a run
    # of data tables among code files) moves the loss with the data, not with the model
    max_data_shift: float = 0.1
    # starvation: a modality's token share over the last window below this x its highest share
    # over earlier windows (sampled once a window; shares under 5 % are not watched), for half
    # the patience, the modality present in at least min_presence of the window's steps
    starve_ratio: float = 0.5
    # confirmation on the held-out losses (val/loss/<m>), when the run evaluates them: the
    # training losses also move with which files fill a window, and the others' fall can be a
    # small source learnt by heart; a held-out loss on the same documents each time moves with
    # the model only
    heldout_drop: float = 0.01


@dataclass(kw_only=True)
class DriftConfig(Detector):
    """log Z of a modality beyond +-``logz_abs``, or its final hidden norm ``hidden_growth`` x its
    value over the first ``window`` steps from ``min_steps`` (or the lr warmup's end, if later),
    or its token-weighted mean over the last ``window`` steps ``growth_rate`` x its mean
    ``rate_span`` steps before (0: off; each window holding ``min_tokens`` of the modality, the
    unigram CE of their tokens within ``max_data_shift`` of each other): norm growth (Chameleon)."""

    POSITIVE: ClassVar = ("window", "logz_abs", "hidden_growth")

    window: int = 20
    logz_abs: float = 30.0
    hidden_growth: float = 8.0
    growth_rate: float = 2.0
    rate_span: int = 50
    # the rate compares windows with at least this many tokens of the modality: the mean hidden
    # norm of a token or two a step swings by itself
    min_tokens: int = 256
    # and whose tokens' unigram CE (the data's difficulty) is within this fraction of each
    # other's (0: off): the norm follows the data too
    max_data_shift: float = 0.1


@dataclass(kw_only=True)
class ProbeConfig(Detector):
    every: int = 100  # steps between probes (0: off); also at the last step


@dataclass(kw_only=True)
class AttentionProbeConfig(ProbeConfig):
    """Max attention logit (q.k / sqrt(d), over allowed pairs) and mean attention entropy per
    layer on ``rows`` fixed probe rows, from hooks. Alarm: max logit above ``max_logit`` or mean
    entropy below ``min_entropy`` nats (attention collapse)."""

    POSITIVE: ClassVar = ("rows", "max_logit")

    rows: int = 2
    max_logit: float = 50.0
    max_growth: float = (
        0.0  # also alarm when the max logit is this many times the first probe's (0: off)
    )
    min_entropy: float = 0.05


@dataclass(kw_only=True)
class DependenceConfig(ProbeConfig):
    """Caption loss after the matched image minus after another document's image, on probe
    documents (image then caption); with ``reverse``, also the image codes' loss after their own
    caption minus after another caption (caption then image). Alarm, per direction, when the
    gap, once at least ``arm_gap`` nats at two probes in a row, falls below ``min_gap``: one
    modality has stopped using the other."""

    POSITIVE: ClassVar = ("probes",)
    SIGNED: ClassVar = ("min_gap",)

    probes: int = 8
    reverse: bool = True
    arm_gap: float = 0.1
    min_gap: float = 0.02


@dataclass(kw_only=True)
class CodeUseConfig(ProbeConfig):
    """Visual code use, two ways. Every step, the codes the model is *trained on* (image and
    video labels, folded into 64 buckets), their normalised entropy over the last
    ``data_window`` steps (weighted by codes, at least ``data_min_codes`` codes in the window):
    alarm when it is more than ``max_data_drop`` below its median window of the last 200 steps,
    or below ``min_data_entropy`` once that median has stood ``max_data_drop`` above it: the
    visual tokenizer feeding the run has degenerated (data whose images are simple from the
    start is no degeneration). Every ``every`` steps (probe), ``probes`` images drawn (sampling)
    at the shape of the run's own images (``grid`` x ``grid`` codes without images): alarm when
    the entropy of the generated codes over ln(min(codes drawn, codebook)) is below
    ``min_entropy`` and the drawn images' dominant codes vary less than ``min_ratio`` x as much
    as those of as many of the run's own images (the drawings use few codes and look alike;
    never without images in the data), once a probe has drawn like the data (a model that has
    not learned to draw yet has not collapsed)."""

    # 16 drawings, not 4: four flat squares drawn faithfully are four codes, an entropy of 0.17
    POSITIVE: ClassVar = ("probes", "grid", "data_window")
    FRACTIONS: ClassVar = ("min_entropy", "min_data_entropy", "max_data_drop")

    probes: int = 16
    grid: int = 4
    min_entropy: float = 0.3
    min_ratio: float = 0.5
    data_window: int = 20
    min_data_entropy: float = 0.4
    max_data_drop: float = 0.15  # or this far below its median window entropy
    data_min_codes: int = 1000


@dataclass(kw_only=True)
class RollbackConfig:
    POSITIVE: ClassVar = ("lr_scale",)

    margin: int = 5  # the checkpoint must be this many steps before the trouble began
    skip_window: int = 0  # steps of data skipped past those already seen (0: as many as seen)
    max_rollbacks: int = 3  # then halt: a run that keeps diverging needs a person
    # After a rollback the lr never exceeds lr_scale x its value at the checkpoint returned to
    # (an lr the run was stable at): a divergence caused by the lr then does not simply recur.
    cap_lr: bool = True
    lr_scale: float = 0.5  # the cap is this x the lr at that checkpoint (OPT lowered it each time)


# The detectors that have an action (the fields of MonitorConfig that are detector sections).
DETECTORS = (
    "spike",
    "divergence",
    "collapse",
    "stagnation",
    "drift",
    "attention",
    "dependence",
    "code_use",
)


@dataclass(kw_only=True)
class MonitorConfig:
    enabled: bool = True
    # The probes' rows (attention, dependence, code use), in tokens: the run's rows when shorter,
    # else packed at this length; 0: the run's own. A probe holds each layer's [rows, heads, T, T]
    # scores and runs whole rows on every rank (no sequence parallelism): at 32k rows that is
    # tens of GB, at 8k on a CPU four times the training step's memory.
    probe_seq_len: int = 4096
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
        for name in DETECTORS:
            getattr(self, name).validate(name)
        check_ranges(self.rollback, "monitor.rollback")
        if self.probe_seq_len < 0:
            raise ValueError(
                f"monitor.probe_seq_len {self.probe_seq_len}: give the probes' row length in "
                "tokens, or 0 for the run's data.seq_len"
            )
