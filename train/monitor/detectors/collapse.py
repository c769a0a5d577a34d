"""``Collapse``: a modality's normalised CE back near chance, or at its tokens' unigram CE."""

from __future__ import annotations

import math

from data.vocab import MODALITY_NAMES
from train.monitor.alarms import Alarm
from train.monitor.config import CollapseConfig
from train.monitor.detectors.common import ModalityWindows, _Latch


class Collapse:
    """A modality's normalised CE back near chance (1.0 = a uniform guess over its own ids), or
    at the unigram CE of its own tokens for ``unigram_patience`` steps: noise over a few ids
    (base64 or compressed payloads, hex dumps) is far from a uniform guess over the
    modality's ids, and a model that has learned predicts real data well below its tokens'
    frequencies alone. Both only after the modality had been learned (``margin`` below)."""

    def __init__(self, cfg: CollapseConfig, chance: dict[str, float]) -> None:
        self.cfg, self.chance = cfg, chance  # chance: modality -> ln V_m
        self.win = ModalityWindows(cfg.window)
        self.data = ModalityWindows(cfg.window, key="unigram/")
        self.best: dict[str, float] = {}
        self.best_unigram: dict[str, float] = {}
        self.at_unigram: dict[str, int] = {}  # modality -> steps in a row at its unigram CE
        self.latch = _Latch()

    def check(self, step: int, metrics: dict) -> list[Alarm]:
        self.win.add(metrics)
        self.data.add(metrics)
        out = []
        for name in MODALITY_NAMES:
            stats = self.win.stats(name)
            if stats is None or stats[2] < self.cfg.min_tokens or name not in self.chance:
                self.at_unigram[name] = 0
                continue
            out += self._at_unigram(step, name, stats[0])
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

    def _at_unigram(self, step: int, name: str, loss: float) -> list[Alarm]:
        """The loss over the window at the unigram CE of the same tokens, for
        ``unigram_patience`` steps after it had been ``margin`` below (a run on raw shards counts
        no unigram: off there)."""
        cfg, unigram = self.cfg, self.data.mean(name)
        if not cfg.unigram_patience or not unigram:
            return []
        ratio = loss / unigram
        best = self.best_unigram[name] = min(self.best_unigram.get(name, math.inf), ratio)
        firing = (
            step >= cfg.min_steps and best <= cfg.threshold - cfg.margin and ratio >= cfg.threshold
        )
        self.at_unigram[name] = self.at_unigram.get(name, 0) + 1 if firing else 0
        since = step - cfg.window - cfg.unigram_patience
        if not self.latch.edge(
            f"unigram/{name}", self.at_unigram[name] >= cfg.unigram_patience, since
        ):
            return []
        return [
            Alarm(
                step,
                "collapse",
                cfg.action,
                modality=name,
                since=since,
                values={"unigram_ratio": ratio, "best_unigram_ratio": best, "ce": loss},
                message=f"{name} loss {loss:.3f} is {ratio:.2f} x the unigram CE of its own tokens "
                f"({unigram:.2f}) for {cfg.unigram_patience} steps, after reaching "
                f"{best:.2f}: it is predicted no better than by its tokens' frequencies",
                threshold=f"CE / unigram CE over {cfg.window} steps >= {cfg.threshold:g} for "
                f"{cfg.unigram_patience} steps after having been <= {cfg.threshold - cfg.margin:g}",
                cause=f"the {name} data turned to noise over a few ids (base64 or compressed "
                "payloads, hex dumps, hashes, encrypted bytes: far from a uniform guess over the "
                f"ids, which the chance rule measures), broken or files of that kind read in a "
                f"long stretch, or the model lost {name}",
                advice=f"inspect recent {name} batches (mix/<source> names the sources; "
                "earlyfuse-prep stats shows a source's tokens) and take such files out of it",
            )
        ]

    def restart_unigram(self) -> None:
        """Another mix: what was learned against the unigram CE is the old data's; judged again
        once a whole window holds the new mix's steps."""
        self.data = ModalityWindows(self.cfg.window, key="unigram/")
        self.best_unigram.clear()
        self.at_unigram.clear()
        self.latch.on = {key for key in self.latch.on if not key.startswith("unigram/")}

    def state_dict(self) -> dict:
        return {
            "win": self.win.state_dict(),
            "data": self.data.state_dict(),
            "best": self.best,
            "best_unigram": self.best_unigram,
            "at_unigram": self.at_unigram,
            "latch": self.latch.state_dict(),
        }

    def load_state_dict(self, st: dict) -> None:
        self.win.load_state_dict(st["win"])
        self.data.load_state_dict(st["data"])
        self.best = dict(st["best"])
        self.best_unigram = dict(st["best_unigram"])
        self.at_unigram = dict(st["at_unigram"])
        self.latch.load_state_dict(st["latch"])
