"""``Collapse``: a modality's normalised CE back near chance."""

from __future__ import annotations

import math

from data.vocab import MODALITY_NAMES
from train.monitor.alarms import Alarm
from train.monitor.config import CollapseConfig
from train.monitor.detectors.common import ModalityWindows, _Latch


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
        self.latch.load_state_dict(st["latch"])
