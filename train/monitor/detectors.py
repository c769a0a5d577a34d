"""The per-step detectors: they read the step's metrics (already reduced over ranks from sums
and counts) and keep short windows of their own. Window means of a modality's loss are
recomputed from sums and counts (``loss/<m>`` x ``tokens/<m>``), never as means of means, so
a modality that is absent from some steps is weighed by its tokens.

Each detector fires once when its condition starts and again only after it has cleared
(``_Latch``): a collapsed modality is one alarm, not one per step.
"""

from __future__ import annotations

import math
from collections import deque

from data.vocab import MODALITY_NAMES
from train.monitor.alarms import Alarm
from train.monitor.config import CollapseConfig, DivergenceConfig, DriftConfig, StagnationConfig


class _Latch:
    """Which (signal, modality) conditions are on now; fire on the rising edge only."""

    def __init__(self) -> None:
        self.on: set[str] = set()

    def edge(self, key: str, condition: bool) -> bool:
        if condition and key not in self.on:
            self.on.add(key)
            return True
        if not condition:
            self.on.discard(key)
        return False


class ModalityWindows:
    """Per modality, the last ``2 * window`` steps' (CE sum, token count) pairs."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.steps: dict[str, deque] = {m: deque(maxlen=2 * window) for m in MODALITY_NAMES}

    def add(self, m: dict) -> None:
        for name in MODALITY_NAMES:
            n = m.get(f"tokens/{name}", 0.0)
            ce = m.get(f"loss/{name}", 0.0) if n else 0.0
            self.steps[name].append((ce * n, n) if math.isfinite(ce) else (0.0, 0.0))

    def mean(self, name: str, recent: bool = True) -> float | None:
        """Token-weighted CE of the last ``window`` steps (``recent``) or the ``window`` before."""
        q = list(self.steps[name])
        if len(q) < (self.window if recent else 2 * self.window):
            return None
        part = q[-self.window :] if recent else q[-2 * self.window : -self.window]
        n = sum(c for _, c in part)
        return sum(s for s, _ in part) / n if n else None

    def state_dict(self) -> dict:
        return {k: list(v) for k, v in self.steps.items()}

    def load_state_dict(self, st: dict) -> None:
        for k, v in st.items():
            self.steps[k] = deque([tuple(x) for x in v], maxlen=2 * self.window)


class Divergence:
    """Spikes that skip-step alone does not cure: a skipped update leaves the weights as they
    were, so a run pushed off course keeps spiking (``max_skipped`` of the last ``window`` steps
    skipped), or its loss is accepted again but stays high (the mean loss of the ``window`` steps
    after a skipped spike more than ``max_rise`` above the mean of the ``window`` steps before it)."""

    def __init__(self, cfg: DivergenceConfig) -> None:
        self.cfg = cfg
        self.skipped: deque[tuple[int, bool]] = deque(maxlen=cfg.window)
        self.losses: deque[float] = deque(maxlen=cfg.window)  # accepted, finite losses
        self.watch: dict | None = None  # after a spike: {since, ref, losses}
        self.latch = _Latch()

    def check(self, step: int, m: dict) -> list[Alarm]:
        skipped, loss = bool(m.get("optim/skipped", 0.0)), m.get("train/loss", math.nan)
        self.skipped.append((step, skipped))
        if skipped and self.watch is None and len(self.losses) == self.cfg.window:
            self.watch = {"since": step, "ref": sum(self.losses) / len(self.losses), "losses": []}
        elif self.watch is not None and not skipped and math.isfinite(loss):
            self.watch["losses"].append(loss)  # what the run does once updates are accepted again
        if not skipped and math.isfinite(loss):
            self.losses.append(loss)
        n = sum(s for _, s in self.skipped)
        m["monitor/skipped_in_window"] = float(n)
        rise = None
        if self.watch is not None and len(self.watch["losses"]) >= self.cfg.window:
            w = self.watch
            rise = sum(w["losses"]) / len(w["losses"]) / w["ref"] - 1 if w["ref"] > 0 else 0.0
            if rise <= self.cfg.max_rise:
                self.watch, rise = None, None  # the run came back by itself
        on = step >= self.cfg.min_steps and (n >= self.cfg.max_skipped or rise is not None)
        if not self.latch.edge("div", on):
            return []
        bad = [s for s, b in self.skipped if b]
        first = self.watch["since"] if self.watch else min(bad)
        why = (
            f"{n} of the last {len(self.skipped)} steps were skipped as spikes"
            if n >= self.cfg.max_skipped
            else f"the loss stayed {rise:.0%} above its level before the spike for {self.cfg.window} steps"
        )
        return [
            Alarm(
                step,
                "divergence",
                self.cfg.action,
                since=first,
                values={
                    "skipped": n,
                    "window": len(self.skipped),
                    "rise": rise if rise is not None else 0.0,
                },
                message=f"{why} (trouble began at step {first})",
            )
        ]

    def reset(self) -> None:
        self.skipped.clear()
        self.watch = None
        self.latch = _Latch()

    def state_dict(self) -> dict:
        return {
            "skipped": list(self.skipped),
            "losses": list(self.losses),
            "watch": self.watch,
            "on": sorted(self.latch.on),
        }

    def load_state_dict(self, st: dict) -> None:
        self.skipped = deque([tuple(x) for x in st["skipped"]], maxlen=self.cfg.window)
        self.losses = deque(st.get("losses", []), maxlen=self.cfg.window)
        self.watch = st.get("watch")
        self.latch.on = set(st["on"])


class Collapse:
    """A modality's normalised CE back near chance (1.0 = a uniform guess over its own ids)."""

    def __init__(self, cfg: CollapseConfig, chance: dict[str, float]) -> None:
        self.cfg, self.chance = cfg, chance  # chance: modality -> ln V_m
        self.win = ModalityWindows(cfg.window)
        self.best: dict[str, float] = {}
        self.latch = _Latch()

    def check(self, step: int, m: dict) -> list[Alarm]:
        self.win.add(m)
        out = []
        for name in MODALITY_NAMES:
            ce = self.win.mean(name)
            if ce is None or name not in self.chance:
                continue
            norm = ce / self.chance[name]
            m[f"monitor/norm_ce_window/{name}"] = norm
            self.best[name] = min(self.best.get(name, math.inf), norm)
            learned = self.best[name] <= self.cfg.threshold - self.cfg.margin
            on = step >= self.cfg.min_steps and learned and norm >= self.cfg.threshold
            if self.latch.edge(name, on):
                out.append(
                    Alarm(
                        step,
                        "collapse",
                        self.cfg.action,
                        modality=name,
                        since=step - self.cfg.window,
                        values={"norm_ce": norm, "best_norm_ce": self.best[name], "ce": ce},
                        message=f"{name} loss {ce:.3f} is {norm:.2f} x chance (ln V = {self.chance[name]:.2f}) "
                        f"after reaching {self.best[name]:.2f}: it has stopped predicting",
                    )
                )
        return out

    def state_dict(self) -> dict:
        return {"win": self.win.state_dict(), "best": self.best, "on": sorted(self.latch.on)}

    def load_state_dict(self, st: dict) -> None:
        self.win.load_state_dict(st["win"])
        self.best = dict(st["best"])
        self.latch.on = set(st["on"])


class Stagnation:
    """One modality stops improving (or gets worse) against its own trailing window while the
    others still improve: the symptom of modality competition in early fusion. Structure
    markers are left out (they are learned in a few steps and would make every other modality
    look slow), and the condition must hold for ``patience`` consecutive steps: a single noisy
    window of long, hard documents is not a stall."""

    SKIP = ("structure",)

    def __init__(self, cfg: StagnationConfig) -> None:
        self.cfg = cfg
        self.win = ModalityWindows(cfg.window)
        self.streak: dict[str, int] = {}
        self.latch = _Latch()

    def check(self, step: int, m: dict) -> list[Alarm]:
        self.win.add(m)
        drops = {}
        for name in MODALITY_NAMES:
            now, before = self.win.mean(name), self.win.mean(name, recent=False)
            if now is not None and before and name not in self.SKIP:
                drops[name] = (before - now) / before
                m[f"monitor/trend/{name}"] = -drops[name]  # relative change of the windowed loss
        out = []
        for name, drop in drops.items():
            others = [d for k, d in drops.items() if k != name]
            others_mean = sum(others) / len(others) if others else 0.0
            cond = (
                step >= self.cfg.min_steps
                and bool(others)
                and drop <= self.cfg.min_drop
                and others_mean >= self.cfg.others_drop
            )
            self.streak[name] = self.streak.get(name, 0) + 1 if cond else 0
            if self.latch.edge(name, self.streak[name] >= self.cfg.patience):
                word = "rose" if drop < 0 else "stalled"
                out.append(
                    Alarm(
                        step,
                        "stagnation",
                        self.cfg.action,
                        modality=name,
                        since=step - self.cfg.window - self.cfg.patience,
                        values={"change": -drop, "others_change": -others_mean},
                        message=f"{name} loss {word} ({-drop:+.1%} over {self.cfg.window} steps, for "
                        f"{self.cfg.patience} steps running) while the other modalities fell "
                        f"{others_mean:.1%}",
                    )
                )
        return out

    def state_dict(self) -> dict:
        return {"win": self.win.state_dict(), "streak": self.streak, "on": sorted(self.latch.on)}

    def load_state_dict(self, st: dict) -> None:
        self.win.load_state_dict(st["win"])
        self.streak = dict(st.get("streak", {}))
        self.latch.on = set(st["on"])


class Drift:
    """log Z far from 0 (softmax normaliser drift) or the final hidden norm growing against its
    own early value (Chameleon's norm growth, which precedes divergence in mixed-modal runs)."""

    def __init__(self, cfg: DriftConfig) -> None:
        self.cfg = cfg
        self.ref: dict[str, list[float]] = {}  # modality -> [sum, count] of the reference window
        self.latch = _Latch()

    def check(self, step: int, m: dict) -> list[Alarm]:
        out = []
        for name in MODALITY_NAMES:
            logz, hn = m.get(f"monitor/logz/{name}"), m.get(f"monitor/hidden_norm/{name}")
            if logz is None or hn is None:
                continue
            if step >= self.cfg.min_steps:
                r = self.ref.setdefault(name, [0.0, 0.0])
                if r[1] < self.cfg.window:
                    r[0], r[1] = r[0] + hn, r[1] + 1
            ref = self.ref.get(name)
            growth = hn / (ref[0] / ref[1]) if ref and ref[1] >= self.cfg.window else 1.0
            m[f"monitor/hidden_growth/{name}"] = growth
            for key, on, values, msg in (
                (
                    "logz",
                    abs(logz) > self.cfg.logz_abs,
                    {"logz": logz},
                    f"log Z of {name} is {logz:.1f} (limit +-{self.cfg.logz_abs:g}): logits are drifting",
                ),
                (
                    "hidden",
                    growth > self.cfg.hidden_growth,
                    {"hidden_norm": hn, "growth": growth},
                    f"final hidden norm of {name} grew {growth:.1f}x its early value (limit {self.cfg.hidden_growth:g}x)",
                ),
            ):
                if self.latch.edge(f"{key}/{name}", step >= self.cfg.min_steps and on):
                    out.append(
                        Alarm(
                            step,
                            f"{key}_drift",
                            self.cfg.action,
                            modality=name,
                            values=values,
                            message=msg,
                        )
                    )
        return out

    def state_dict(self) -> dict:
        return {"ref": self.ref, "on": sorted(self.latch.on)}

    def load_state_dict(self, st: dict) -> None:
        self.ref = {k: list(v) for k, v in st["ref"].items()}
        self.latch.on = set(st["on"])
