"""The per-step detectors: they read the step's metrics (already reduced over ranks from sums
and counts) and keep short windows of their own. Window means of a modality's loss are
recomputed from sums and counts (``loss/<m>`` x ``tokens/<m>``), never as means of means, so
a modality that is absent from some steps is weighed by its tokens.

Each detector fires once when its condition starts and again only after it has cleared
(``_Latch``): a collapsed modality is one alarm, not one per step.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque

from data.vocab import MODALITY_NAMES
from train.monitor.alarms import Alarm
from train.monitor.config import (
    CodeUseConfig,
    CollapseConfig,
    DivergenceConfig,
    DriftConfig,
    StagnationConfig,
)
from train.monitor.stats import MAD_TO_SIGMA, median


class _Latch:
    """Which (signal, modality) conditions are on now; fire on the rising edge only. Each open
    condition remembers ``since``, the step its trouble began: while it is open, the
    newest checkpoint before that step is kept (``Monitor.protected_steps``)."""

    def __init__(self) -> None:
        self.on: set[str] = set()
        self.since: dict[str, int] = {}

    def edge(self, key: str, condition: bool, since: int | None = None) -> bool:
        if condition and key not in self.on:
            self.on.add(key)
            if since is not None:
                self.since[key] = since
            return True
        if not condition:
            self.on.discard(key)
            self.since.pop(key, None)
        return False

    def open_since(self) -> list[int]:
        return [since for key, since in self.since.items() if key in self.on]

    def state_dict(self) -> dict:
        return {"on": sorted(self.on), "since": dict(self.since)}

    def load_state_dict(self, st: dict) -> None:
        self.on = set(st["on"])
        self.since = {
            key: int(value) for key, value in st.get("since", {}).items() if key in self.on
        }


class ModalityWindows:
    """Per modality, the last ``2 * window`` steps' (CE sum, token count) pairs."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.steps: dict[str, deque] = {
            modality: deque(maxlen=2 * window) for modality in MODALITY_NAMES
        }

    def add(self, metrics: dict) -> None:
        for name in MODALITY_NAMES:
            tokens = metrics.get(f"tokens/{name}", 0.0)
            loss = metrics.get(f"loss/{name}", 0.0) if tokens else 0.0
            self.steps[name].append((loss * tokens, tokens) if math.isfinite(loss) else (0.0, 0.0))

    def part(self, name: str, recent: bool = True) -> list | None:
        pairs = list(self.steps[name])
        if len(pairs) < (self.window if recent else 2 * self.window):
            return None
        return pairs[-self.window :] if recent else pairs[-2 * self.window : -self.window]

    def mean(self, name: str, recent: bool = True) -> float | None:
        """Token-weighted CE of the last ``window`` steps (``recent``) or the ``window`` before."""
        part = self.part(name, recent) or []
        tokens = sum(count for _, count in part)
        return sum(ce_sum for ce_sum, _ in part) / tokens if tokens else None

    def stats(
        self, name: str, recent: bool = True, block: int = 1
    ) -> tuple[float, float, float, float] | None:
        """(token-weighted mean CE, its standard error, tokens, share of the window's steps that
        hold the modality) of one window. The error is the sandwich estimate over blocks of
        ``block`` consecutive steps (weights = tokens): a window whose steps disagree, or whose
        tokens sit in a few steps, is known to be uncertain. Blocks, because neighbouring steps
        are not independent: a long document's row-sized chunks reach the model over
        consecutive steps, so a hard or easy file moves several steps' loss together, and an
        error computed as if every step were a fresh draw is too small (batch means)."""
        part = self.part(name, recent)
        tokens = sum(count for _, count in part) if part else 0
        if not part or not tokens:
            return None
        presence = sum(1 for _, count in part if count) / len(part)
        mean = sum(ce_sum for ce_sum, _ in part) / tokens
        blocks = [
            (sum(ce for ce, _ in part[i : i + block]), sum(n for _, n in part[i : i + block]))
            for i in range(0, len(part), block)
        ]
        var = sum(
            count * count * (ce_sum / count - mean) ** 2 for ce_sum, count in blocks if count
        ) / (tokens * tokens)
        return mean, math.sqrt(var), tokens, presence

    def state_dict(self) -> dict:
        return {name: list(pairs) for name, pairs in self.steps.items()}

    def load_state_dict(self, st: dict) -> None:
        for name, pairs in st.items():
            self.steps[name] = deque([tuple(pair) for pair in pairs], maxlen=2 * self.window)


CONTENT = ("text", "code", "image", "video")  # structure markers are learned in a few steps


class Levels:
    """Per modality, the token-weighted loss of the last ``window`` steps (its *level*, counted
    when the window holds at least ``min_tokens`` tokens), the minimum level over the last
    ``horizon`` steps (a monotone queue) and how far the level has wandered over them (the
    median and 1.4826 x MAD of its values: a modality whose sources differ wildly in difficulty,
    easy captions and hard prose, swings by itself and needs a bigger rise to count)."""

    def __init__(self, window: int, horizon: int, min_tokens: int, history_from: int = 0) -> None:
        self.window, self.horizon, self.min_tokens = window, horizon, min_tokens
        self.history_from = history_from  # the early fall is no measure of how levels wander
        self.steps: dict[str, deque] = defaultdict(lambda: deque(maxlen=window))
        self.minq: dict[str, deque] = defaultdict(deque)
        self.history: dict[str, deque] = defaultdict(lambda: deque(maxlen=horizon))

    def spread(self, name: str) -> tuple[float, float]:
        """(median, robust spread) of the modality's levels over the horizon."""
        levels = self.history[name]
        mid = median(levels)
        return mid, MAD_TO_SIGMA * median(abs(level - mid) for level in levels)

    def add(
        self,
        step: int,
        metrics: dict,
        names: tuple[str, ...] = MODALITY_NAMES,
        min_tokens: int = -1,
    ) -> dict[str, tuple[float, float, float]]:
        """Take one step; returns ``{modality: (level, minimum, tokens in the window)}``."""
        out = {}
        need = self.min_tokens if min_tokens < 0 else min_tokens
        for name in names:
            count = metrics.get(f"tokens/{name}", 0.0)
            loss = metrics.get(f"loss/{name}", 0.0) if count else 0.0
            self.steps[name].append((loss * count, count) if math.isfinite(loss) else (0.0, 0.0))
            tokens = sum(tokens_in_step for _, tokens_in_step in self.steps[name])
            if tokens < need or tokens <= 0:
                continue
            level = sum(ce_sum for ce_sum, _ in self.steps[name]) / tokens
            minima = self.minq[name]
            while minima and minima[-1][1] >= level:
                minima.pop()
            minima.append((step, level))
            while minima[0][0] <= step - self.horizon:
                minima.popleft()
            if step >= self.history_from:
                self.history[name].append(level)
            out[name] = (level, minima[0][1], tokens)
        return out

    def state_dict(self) -> dict:
        return {
            "steps": {name: list(queue) for name, queue in self.steps.items()},
            "minq": {name: list(queue) for name, queue in self.minq.items()},
            "history": {name: list(queue) for name, queue in self.history.items()},
        }

    def load_state_dict(self, st: dict) -> None:
        for name, queue in st["steps"].items():
            self.steps[name] = deque([tuple(pair) for pair in queue], maxlen=self.window)
        for name, queue in st["minq"].items():
            self.minq[name] = deque(tuple(pair) for pair in queue)
        for name, queue in st.get("history", {}).items():
            self.history[name] = deque(queue, maxlen=self.horizon)


class Divergence:
    """A run pushed off its trajectory. Two rules, either fires:

    - spikes that persist: a skipped update leaves the weights as they were, so a run pushed off
      course keeps spiking (``max_skipped`` of the last ``window`` steps skipped);
    - a sustained rise, which needs no skip (the spike gate may have let the blow-up through, or
      it was too gradual to be a spike): each modality's level against its own minimum over the
      last ``horizon`` steps, combined with the current window's token counts as weights, so a
      batch that holds more of a hard modality is not a rise. The modalities that rose must hold
      at least ``min_share`` of the tokens: one small modality going its own way (a source that
      broke, a modality starved) is ``collapse`` or ``stagnation``, a warning, not a reason to
      roll back.

    ``since`` is the step the rise began (or the first skipped step): a rollback goes to a
    checkpoint at least ``monitor.rollback.margin`` steps before it."""

    def __init__(self, cfg: DivergenceConfig) -> None:
        self.cfg = cfg
        self.skipped: deque[tuple[int, bool]] = deque(maxlen=cfg.window)
        self.levels = Levels(cfg.level_window, cfg.horizon, cfg.min_tokens, cfg.rise_from)
        self.seen: set[str] = set()  # content modalities met so far
        self.streak = 0
        self.excursion: int | None = None  # first step of the current rise
        self.last_skip: int | None = None
        self.latch = _Latch()

    def check(self, step: int, metrics: dict) -> list[Alarm]:
        cfg = self.cfg
        skipped = bool(metrics.get("optim/skipped", 0.0))
        self.skipped.append((step, skipped))
        n_skipped = sum(was_skipped for _, was_skipped in self.skipped)
        metrics["monitor/skipped_in_window"] = float(n_skipped)
        # A skipped step's loss stays out of the levels (a lone spike is the gate's business).
        total, rises, tokens = self._rise(step, metrics) if not skipped else (None, {}, {})
        # The rise rule waits for the early fall to settle (``rise_from``), except for a rise
        # right after a skipped spike (that spike's update is the likely cause), and for the
        # level and its minimum to have had a window each.
        after_spike = self.last_skip is not None and step - self.last_skip <= 2 * cfg.level_window
        rising = [
            name
            for name, rise in rises.items()
            if rise > cfg.max_rise and self._clear(name, after_spike)
        ]
        share = sum(tokens[name] for name in rising) / max(sum(tokens.values()), 1e-9)
        cond = (
            step >= 2 * cfg.level_window
            and (step >= cfg.rise_from or after_spike)
            and total is not None
            and total > cfg.max_rise
            and share >= cfg.min_share
        )
        if not skipped:
            self.streak = self.streak + 1 if cond else 0
            if total is not None and total > cfg.max_rise / 4:
                self.excursion = self.excursion or step
            elif total is not None:
                self.excursion = None
        if skipped:
            self.last_skip = step
        bad = [skipped_step for skipped_step, was_skipped in self.skipped if was_skipped]
        by_skips = n_skipped >= cfg.max_skipped
        firing = step >= cfg.min_steps and (by_skips or self.streak >= cfg.patience)
        # The trouble began at the first skipped spike of the window, or where the rise began
        # (at a spike skipped just before it, if any: the update before that spike did it).
        if by_skips:
            since = min(bad)
        else:
            since = self.excursion or step
            if self.last_skip is not None and 0 <= since - self.last_skip <= cfg.level_window:
                since = self.last_skip
        if not self.latch.edge("div", firing, since):
            return []
        if by_skips:
            why = f"{n_skipped} of the last {len(self.skipped)} steps were skipped as spikes"
            threshold = f"{cfg.max_skipped} skipped in {cfg.window} steps"
        else:
            why = (
                f"the loss (mix held fixed) stayed {total:+.0%} over its minimum of the last "
                f"{cfg.horizon} steps for {self.streak} steps; risen: "
                + ", ".join(f"{name} {rises[name]:+.0%}" for name in rising)
            )
            threshold = (
                f"rise > {cfg.max_rise:.0%} for {cfg.patience} steps, in modalities holding >= "
                f"{cfg.min_share:.0%} of the tokens"
            )
        return [
            Alarm(
                step,
                "divergence",
                cfg.action,
                since=since,
                values={
                    "skipped": n_skipped,
                    "rise": total or 0.0,
                    **{f"rise/{name}": rise_value for name, rise_value in rises.items()},
                },
                message=f"{why} (trouble began at step {since})",
                threshold=threshold,
                cause="an update too large for the weights (learning rate too high for this point of "
                "training, a bad batch, or optimizer state blown up): the run has left its trajectory",
                advice="roll back to a checkpoint before the trouble and skip the data seen since; "
                "if it recurs, lower optim.lr or check the batches named in the rise",
            )
        ]

    def _clear(self, name: str, after_spike: bool) -> bool:
        """The modality's level stands ``z`` robust spreads above its median over the horizon:
        beyond what it wanders by itself. With too little history to know its swings, only a
        rise right after a skipped spike counts."""
        levels = self.levels.history[name]
        if len(levels) < self.cfg.level_window:
            return after_spike
        mid, spread = self.levels.spread(name)
        return levels[-1] > mid + self.cfg.z * spread

    @property
    def watch(self) -> dict | None:
        """The rise being watched (where it began, how many steps it has held), or None."""
        if self.excursion is None:
            return None
        return {"since": self.excursion, "streak": self.streak}

    def _rise(
        self, step: int, metrics: dict
    ) -> tuple[float | None, dict[str, float], dict[str, float]]:
        """(the mix-held-fixed rise, each content modality's rise, its tokens in the window)."""
        obs, names, need = metrics, MODALITY_NAMES, -1
        if not any(metrics.get(f"tokens/{modality}") for modality in MODALITY_NAMES):
            # No per-modality losses (the visual tokenizer's task): the total loss, alone, a
            # full window of steps.
            loss = metrics.get("train/loss", math.nan)
            obs = {"tokens/total": 1.0, "loss/total": loss} if math.isfinite(loss) else {}
            names, need = ("total",), self.cfg.level_window
        levels = self.levels.add(step, obs, names, need)
        excess = base = 0.0
        rises, counts = {}, {}
        for name, (level, low, tokens) in levels.items():
            if name in CONTENT or name == "total":
                self.seen.add(name)
                rises[name] = level / low - 1 if low > 0 else 0.0
                counts[name] = tokens
                metrics[f"monitor/rise/{name}"] = rises[name]
            excess += tokens * (level - low)
            base += tokens * low
        if base <= 0:
            return None, rises, counts
        metrics["monitor/rise/total"] = excess / base
        return excess / base, rises, counts

    def troubled(self) -> bool:
        """A step was skipped in the window, or the loss is rising: no checkpoint to return to."""
        return any(bad for _, bad in self.skipped) or self.streak > 0

    def reset(self) -> None:
        self.skipped.clear()
        self.streak, self.excursion, self.last_skip = 0, None, None
        self.latch = _Latch()

    def state_dict(self) -> dict:
        return {
            "skipped": list(self.skipped),
            "levels": self.levels.state_dict(),
            "seen": sorted(self.seen),
            "streak": self.streak,
            "excursion": self.excursion,
            "last_skip": self.last_skip,
            "latch": self.latch.state_dict(),
        }

    def load_state_dict(self, st: dict) -> None:
        self.skipped = deque([tuple(pair) for pair in st["skipped"]], maxlen=self.cfg.window)
        if "levels" in st:  # states saved before the rise rule have none
            self.levels.load_state_dict(st["levels"])
        self.seen = set(st.get("seen", []))
        self.streak = int(st.get("streak", 0))
        self.excursion = st.get("excursion")
        self.last_skip = st.get("last_skip")
        self.latch.load_state_dict(st.get("latch") or {"on": st["on"]})


class Collapse:
    """A modality's normalised CE back near chance (1.0 = a uniform guess over its own ids)."""

    def __init__(self, cfg: CollapseConfig, chance: dict[str, float]) -> None:
        self.cfg, self.chance = cfg, chance  # chance: modality -> ln V_m
        self.win = ModalityWindows(cfg.window)
        self.best: dict[str, float] = {}
        self.latch = _Latch()

    def check(self, step: int, metrics: dict) -> list[Alarm]:
        self.win.add(metrics)
        out = []
        for name in MODALITY_NAMES:
            stats = self.win.stats(name)
            if stats is None or stats[2] < self.cfg.min_tokens or name not in self.chance:
                continue
            loss = stats[0]
            norm = loss / self.chance[name]
            metrics[f"monitor/norm_ce_window/{name}"] = norm
            self.best[name] = min(self.best.get(name, math.inf), norm)
            learned = self.best[name] <= self.cfg.threshold - self.cfg.margin
            firing = step >= self.cfg.min_steps and learned and norm >= self.cfg.threshold
            if self.latch.edge(name, firing, step - self.cfg.window):
                out.append(
                    Alarm(
                        step,
                        "collapse",
                        self.cfg.action,
                        modality=name,
                        since=step - self.cfg.window,
                        values={"norm_ce": norm, "best_norm_ce": self.best[name], "ce": loss},
                        message=f"{name} loss {loss:.3f} is {norm:.2f} x chance (ln V = {self.chance[name]:.2f}) "
                        f"after reaching {self.best[name]:.2f}: it has stopped predicting",
                        threshold=f"CE / ln V over {self.cfg.window} steps >= {self.cfg.threshold:g} "
                        f"after having been <= {self.cfg.threshold - self.cfg.margin:g}",
                        cause=f"the {name} data turned to noise (broken source, tokenizer mismatch, "
                        f"a degenerate visual tokenizer) or the model lost {name} entirely",
                        advice=f"inspect recent {name} batches (mix/<source> names the sources) "
                        "and roll back to before the collapse once the data is fixed",
                    )
                )
        return out

    def state_dict(self) -> dict:
        return {"win": self.win.state_dict(), "best": self.best, "latch": self.latch.state_dict()}

    def load_state_dict(self, st: dict) -> None:
        self.win.load_state_dict(st["win"])
        self.best = dict(st["best"])
        self.latch.load_state_dict(st.get("latch") or {"on": st["on"]})


class Stagnation:
    """One modality stops improving (or gets worse) against its own trailing window while the
    others still improve: the symptom of modality competition or starvation in early fusion.

    Robust to a batch mix that swings: window means weigh steps by their tokens of the modality,
    a window needs ``min_tokens`` of them spread over at least ``min_presence`` of its steps (a
    modality that arrives in bursts, one long document filling a few batches, changes with the
    document, not with the model), and the difference between this modality's change and the
    others' must exceed ``z`` standard errors (estimated from the steps' own spread). Structure markers are left out
    (learned in a few steps, they would make every other modality look slow), and the condition
    must hold for ``patience`` consecutive steps."""

    SKIP = ("structure",)

    def __init__(self, cfg: StagnationConfig) -> None:
        self.cfg = cfg
        self.win = ModalityWindows(cfg.window)
        self.streak: dict[str, int] = {}
        self.share_best: dict[str, float] = {}
        self.latch = _Latch()

    def _changes(self, metrics: dict) -> dict[str, tuple[float, float, float]]:
        """modality -> (relative change of its windowed loss, its standard error, tokens)."""
        out = {}
        for name in MODALITY_NAMES:
            if name in self.SKIP:
                continue
            block = self.cfg.block_steps
            now = self.win.stats(name, block=block)
            before = self.win.stats(name, recent=False, block=block)
            if now is None or before is None or before[0] <= 0:
                continue
            if min(now[2], before[2]) < self.cfg.min_tokens:
                continue
            if min(now[3], before[3]) < self.cfg.min_presence:
                continue  # a modality that comes in bursts (one long document at a time)
            change = now[0] / before[0] - 1
            std_err = (now[0] / before[0]) * math.hypot(
                now[1] / max(now[0], 1e-9), before[1] / before[0]
            )
            out[name] = (change, std_err, now[2])
            metrics[f"monitor/trend/{name}"] = change  # relative change of the windowed loss
        return out

    def _starved(self, step: int, metrics: dict) -> list[Alarm]:
        """A modality whose share of the tokens fell to ``starve_ratio`` of its highest share
        over earlier windows: the mix shifted (a source changed content, a weight was changed)
        and it is being starved, whatever its loss does yet."""
        cfg = self.cfg
        parts = {
            modality: self.win.part(modality)
            for modality in MODALITY_NAMES
            if modality not in self.SKIP
        }
        if any(part is None for part in parts.values()):
            return []
        tokens = {
            modality: sum(count for _, count in part or []) for modality, part in parts.items()
        }
        presence = {
            modality: sum(1 for _, count in part or [] if count) / cfg.window
            for modality, part in parts.items()
        }
        total = sum(tokens.values())
        out = []
        for name, count in tokens.items():
            if not total:
                break
            share = count / total
            metrics[f"monitor/share/{name}"] = share
            best = self.share_best.get(name, 0.0)
            steady = presence[name] >= cfg.min_presence  # a bursty modality has no steady share
            low = (
                steady
                and step >= cfg.min_steps
                and best >= 0.05
                and share < cfg.starve_ratio * best
            )
            key = f"share/{name}"
            self.streak[key] = self.streak.get(key, 0) + 1 if low else 0
            if steady and step >= cfg.min_steps and (step - cfg.min_steps) % cfg.window == 0:
                self.share_best[name] = max(best, share)  # one sample per window
            # Half the patience: a share is a count, far less noisy than a loss.
            firing = self.streak[key] >= max(1, cfg.patience // 2)
            if self.latch.edge(key, firing, step - cfg.window - cfg.patience // 2):
                out.append(
                    Alarm(
                        step,
                        "starvation",
                        cfg.action,
                        modality=name,
                        since=step - cfg.window - cfg.patience // 2,
                        values={"share": share, "best_share": best},
                        message=f"{name} gets {share:.0%} of the tokens over the last {cfg.window} "
                        f"steps, down from {best:.0%}",
                        threshold=f"token share < {cfg.starve_ratio:g} x its highest window share "
                        f"for {cfg.patience // 2} steps, present in >= {cfg.min_presence:.0%} of them",
                        cause=f"the delivered mix shifted away from {name}: a source's content "
                        "changed, or the weights did; its learning stalls or reverses",
                        advice="compare mix/<source> and tokens/<modality> with data.sources' "
                        f"weights; restore {name}'s share if the shift was not meant",
                    )
                )
        return out

    def check(self, step: int, metrics: dict) -> list[Alarm]:
        cfg = self.cfg
        self.win.add(metrics)
        changes = self._changes(metrics)
        out = self._starved(step, metrics)
        for name, (change, std_err, _) in changes.items():
            others = {other: other_stats for other, other_stats in changes.items() if other != name}
            tokens = sum(other_stats[2] for other_stats in others.values())
            if not others or not tokens:
                self.streak[name] = 0
                continue
            others_change = (
                sum(other_stats[0] * other_stats[2] for other_stats in others.values()) / tokens
            )
            others_se = (
                math.sqrt(
                    sum((other_stats[1] * other_stats[2]) ** 2 for other_stats in others.values())
                )
                / tokens
            )
            gap = change - others_change
            cond = (
                step >= cfg.min_steps
                and change >= -cfg.min_drop
                and others_change <= -cfg.others_drop
                and gap > cfg.z * math.hypot(std_err, others_se)
            )
            self.streak[name] = self.streak.get(name, 0) + 1 if cond else 0
            since = step - cfg.window - cfg.patience
            if self.latch.edge(name, self.streak[name] >= cfg.patience, since):
                word = "rose" if change > 0 else "stalled"
                out.append(
                    Alarm(
                        step,
                        "stagnation",
                        cfg.action,
                        modality=name,
                        since=since,
                        values={
                            "change": change,
                            "others_change": others_change,
                            "z": gap / max(math.hypot(std_err, others_se), 1e-12),
                        },
                        message=f"{name} loss {word} ({change:+.1%} over {cfg.window} steps, for "
                        f"{cfg.patience} steps running) while the other modalities fell "
                        f"{-others_change:.1%}",
                        threshold=f"change >= {-cfg.min_drop:+.0%} while the others fall >= "
                        f"{cfg.others_drop:.0%}, {cfg.z:g} standard errors apart, for {cfg.patience} steps",
                        cause=f"{name} is losing the competition for the model's capacity or is "
                        f"starved of tokens (tokens/{name}, mix/<source>), or its data changed",
                        advice=f"check the delivered mix (mix/<source>, tokens/{name}) against the "
                        f"weights and the {name} sources; raise its weight or the model's capacity",
                    )
                )
        return out

    def state_dict(self) -> dict:
        return {
            "win": self.win.state_dict(),
            "streak": self.streak,
            "latch": self.latch.state_dict(),
        }

    def load_state_dict(self, st: dict) -> None:
        self.win.load_state_dict(st["win"])
        self.streak = dict(st.get("streak", {}))
        self.latch.load_state_dict(st.get("latch") or {"on": st["on"]})


class Drift:
    """log Z far from 0 (softmax normaliser drift), or the final hidden norm growing: against its
    own early value, or fast (its mean over the last ``window`` steps ``growth_rate`` x its mean
    ``rate_span`` steps before). Chameleon's norm growth precedes divergence in mixed-modal
    runs; the rate catches it at any point of a long run, where the early value is long gone."""

    def __init__(self, cfg: DriftConfig) -> None:
        self.cfg = cfg
        self.ref: dict[str, list[float]] = {}  # modality -> [sum, count] of the reference window
        self.recent: dict[str, deque] = defaultdict(
            lambda: deque(maxlen=cfg.rate_span + cfg.window)
        )
        self.latch = _Latch()

    def rate(self, name: str) -> float:
        """Mean hidden norm of the last ``window`` steps over that of the ``window`` steps
        ``rate_span`` earlier (1.0 until both exist)."""
        norms = list(self.recent[name])
        window = self.cfg.window
        if len(norms) < self.cfg.rate_span + window:
            return 1.0
        old, new = sum(norms[:window]) / window, sum(norms[-window:]) / window
        return new / old if old > 0 else 1.0

    def check(self, step: int, metrics: dict) -> list[Alarm]:
        out = []
        for name in MODALITY_NAMES:
            logz, hidden_norm = (
                metrics.get(f"monitor/logz/{name}"),
                metrics.get(f"monitor/hidden_norm/{name}"),
            )
            if logz is None or hidden_norm is None:
                continue
            if step >= self.cfg.min_steps:
                ref_sum = self.ref.setdefault(name, [0.0, 0.0])
                if ref_sum[1] < self.cfg.window:
                    ref_sum[0], ref_sum[1] = ref_sum[0] + hidden_norm, ref_sum[1] + 1
            ref = self.ref.get(name)
            growth = hidden_norm / (ref[0] / ref[1]) if ref and ref[1] >= self.cfg.window else 1.0
            metrics[f"monitor/hidden_growth/{name}"] = growth
            if step >= self.cfg.min_steps:  # the early steps' fast growth is training, not drift
                self.recent[name].append(hidden_norm)
            rate = self.rate(name)
            metrics[f"monitor/hidden_rate/{name}"] = rate
            # Hysteresis: an open condition clears only below 80 % of its threshold, so a signal
            # hovering at the threshold is one alarm, not one every few steps.
            keep = {signal: f"{signal}/{name}" in self.latch.on for signal in ("logz", "hidden")}
            lz_limit = self.cfg.logz_abs * (0.8 if keep["logz"] else 1.0)
            hn_limit = self.cfg.hidden_growth * (0.8 if keep["hidden"] else 1.0)
            rate_limit = self.cfg.growth_rate * (0.8 if keep["hidden"] else 1.0)
            for key, firing, values, msg, rule in (
                (
                    "logz",
                    abs(logz) > lz_limit,
                    {"logz": logz},
                    f"log Z of {name} is {logz:.1f}: the output logits are drifting",
                    f"|log Z| > {self.cfg.logz_abs:g}",
                ),
                (
                    "hidden",
                    growth > hn_limit or (self.cfg.growth_rate > 0 and rate > rate_limit),
                    {"hidden_norm": hidden_norm, "growth": growth, "rate": rate},
                    f"final hidden norm of {name} is {hidden_norm:.4g}, {growth:.1f}x its value at steps "
                    f"{self.cfg.min_steps}-{self.cfg.min_steps + self.cfg.window} and {rate:.1f}x "
                    f"{self.cfg.rate_span} steps ago",
                    f"hidden norm > {self.cfg.hidden_growth:g}x its early value, or > "
                    f"{self.cfg.growth_rate:g}x its value {self.cfg.rate_span} steps before",
                ),
            ):
                firing = step >= self.cfg.min_steps and firing
                if self.latch.edge(f"{key}/{name}", firing, step - self.cfg.window):
                    out.append(
                        Alarm(
                            step,
                            f"{key}_drift",
                            self.cfg.action,
                            modality=name,
                            values=values,
                            since=step - self.cfg.window,
                            message=msg,
                            threshold=rule,
                            cause="norm growth: the lr is too high for this model without its "
                            "stabilisers (z-loss, QK-norm), or modalities compete through the "
                            "softmax (Chameleon); it precedes a divergence",
                            advice="keep the checkpoint from before it; lower optim.lr, check "
                            "model.loss.z_loss_coef and model.attention.qk_norm",
                        )
                    )
        return out

    def state_dict(self) -> dict:
        return {
            "ref": self.ref,
            "recent": {name: list(norms) for name, norms in self.recent.items()},
            "latch": self.latch.state_dict(),
        }

    def load_state_dict(self, st: dict) -> None:
        self.ref = {name: list(norms) for name, norms in st["ref"].items()}
        for name, norms in st.get("recent", {}).items():
            self.recent[name] = deque(norms, maxlen=self.cfg.rate_span + self.cfg.window)
        self.latch.load_state_dict(st.get("latch") or {"on": st["on"]})


class DataCodeUse:
    """The visual codes a run trains on, every step (``monitor/data_code_entropy`` from the
    task: the entropy of the step's image and video label codes folded into 64 buckets): a
    visual tokenizer that emits a handful of codes shows the moment its output reaches the
    batches, long before the model's own drawings (the ``code_use`` probe) degrade, and while
    the image loss, if anything, *falls* (constant codes are easy to predict)."""

    def __init__(self, cfg: CodeUseConfig) -> None:
        self.cfg = cfg
        self.steps: deque[tuple[float, float]] = deque(maxlen=cfg.data_window)
        self.best = 0.0  # the highest window entropy seen (from min_steps)
        self.latch = _Latch()

    def check(self, step: int, metrics: dict) -> list[Alarm]:
        cfg = self.cfg
        codes, entropy = (
            metrics.get("monitor/data_codes", 0.0),
            metrics.get("monitor/data_code_entropy"),
        )
        self.steps.append((entropy * codes, codes) if entropy is not None and codes else (0.0, 0.0))
        total = sum(step_codes for _, step_codes in self.steps)
        if total < cfg.data_min_codes:
            return []
        ent = sum(weighted for weighted, _ in self.steps) / total
        metrics["monitor/data_code_entropy_window"] = ent
        if step >= cfg.min_steps and len(self.steps) == cfg.data_window:
            self.best = max(self.best, ent)
        dropped = self.best > 0 and ent < (1 - cfg.max_data_drop) * self.best
        firing = step >= cfg.min_steps and (ent < cfg.min_data_entropy or dropped)
        if not self.latch.edge("data", firing, step - cfg.data_window):
            return []
        return [
            Alarm(
                step,
                "data_code_entropy",
                cfg.action,
                modality="image",
                since=step - cfg.data_window,
                values={"entropy": ent, "best": self.best, "codes": total},
                message=f"the visual codes in the last {cfg.data_window} steps' batches have a "
                f"normalised entropy of {ent:.2f} (it was {self.best:.2f}; {total:.0f} codes): "
                "a few codes dominate",
                threshold=f"entropy of the trained-on codes (64 buckets) < {cfg.min_data_entropy:g}, "
                f"or {cfg.max_data_drop:.0%} below its highest window",
                cause="the visual tokenizer (or the image data) degenerated: most images map to "
                "a few codes; the image loss falls because the codes became trivial",
                advice="stop feeding these shards: check the visual tokenizer's reconstructions "
                "and `earlyfuse-prep stats` code use of the sources named in mix/<source>",
            )
        ]

    def state_dict(self) -> dict:
        return {"steps": list(self.steps), "best": self.best, "latch": self.latch.state_dict()}

    def load_state_dict(self, st: dict) -> None:
        self.steps = deque([tuple(pair) for pair in st["steps"]], maxlen=self.cfg.data_window)
        self.best = float(st.get("best", 0.0))
        self.latch.load_state_dict(st["latch"])
