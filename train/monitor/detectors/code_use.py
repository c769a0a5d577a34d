"""``DataCodeUse``: the entropy of the visual codes the run trains on, every step, for images
and videos apart."""

from __future__ import annotations

from collections import deque

from train.monitor.alarms import Alarm
from train.monitor.config import CodeUseConfig
from train.monitor.detectors.common import _Latch
from train.monitor.stats import MAD_TO_SIGMA, median

HISTORY = 10  # data windows whose median is the typical level
VISUAL = ("image", "video")  # the modalities whose codes are judged, each apart
SWING_SIGMAS = 5.0  # a drop must also exceed this many standard deviations of the windows' swings


class _Level:
    """One visual modality's windows: the last ``data_window`` steps' codes and the median of
    the windows before (its typical level)."""

    def __init__(self, cfg: CodeUseConfig) -> None:
        self.steps: deque[tuple[float, float]] = deque(maxlen=cfg.data_window)
        # The window entropies of the last HISTORY windows' worth of steps (from min_steps): their
        # median is the typical level. Not their maximum: a window holds the codes of a few dozen
        # images, so its entropy swings with which images it holds, and the highest swing of a
        # long run is no level the data ever had (images at 10 % of a healthy mix swung
        # 0.41-0.48, 15 % below the highest).
        self.history: deque[float] = deque(maxlen=HISTORY * cfg.data_window)
        self.best = 0.0  # the highest typical level so far

    def state_dict(self) -> dict:
        return {"steps": list(self.steps), "history": list(self.history), "best": self.best}

    def load_state_dict(self, st: dict) -> None:
        self.steps.clear()
        self.steps.extend(tuple(pair) for pair in st["steps"])
        self.history.clear()
        self.history.extend(st["history"])
        self.best = float(st["best"])


class DataCodeUse:
    """The visual codes a run trains on, every step (``monitor/data_code_entropy/<m>`` from the
    task: the entropy of the step's image, and of its video, label codes folded into 64
    buckets): a visual tokenizer that emits a handful of codes shows the moment its output
    reaches the batches, long before the model's own drawings (the ``code_use`` probe) degrade,
    and while the image loss, if anything, *falls* (constant codes are easy to predict).

    Images and videos are judged apart, each against its own windows: pooled, one row of a long
    clip of few codes (a long-context stage's, a third of a window's codes when the clip is rare
    in the mix) read as the images' tokenizer having degenerated."""

    def __init__(self, cfg: CodeUseConfig) -> None:
        self.cfg = cfg
        self.levels = {name: _Level(cfg) for name in VISUAL}
        self.latch = _Latch()

    def check(self, step: int, metrics: dict) -> list[Alarm]:
        return [a for name in VISUAL if (a := self._check(name, step, metrics)) is not None]

    def _check(self, name: str, step: int, metrics: dict) -> Alarm | None:
        cfg, level = self.cfg, self.levels[name]
        codes = metrics.get(f"monitor/data_codes/{name}", 0.0)
        entropy = metrics.get(f"monitor/data_code_entropy/{name}")
        level.steps.append(
            (entropy * codes, codes) if entropy is not None and codes else (0.0, 0.0)
        )
        total = sum(step_codes for _, step_codes in level.steps)
        if total < cfg.data_min_codes:
            return None
        ent = sum(weighted for weighted, _ in level.steps) / total
        metrics[f"monitor/data_code_entropy_window/{name}"] = ent
        known = len(level.history) >= cfg.data_window
        typical = median(level.history) if known else 0.0
        # The drop must also leave the windows' own swings: on images of few codes each (flat
        # colours, stripes), which few dozen images a window holds swings its entropy by more
        # than the margin (0.19-0.32 around 0.25 on a healthy mix of 80 % striped pictures,
        # which fired at 0.20), while before a degenerate visual tokenizer the windows of a
        # varied corpus stand within +-0.01 (0.72-0.73 in the suite's visual-code-collapse).
        swing = MAD_TO_SIGMA * median([abs(h - typical) for h in level.history]) if known else 0.0
        level.best = max(level.best, typical)
        if step >= cfg.min_steps and len(level.steps) == cfg.data_window:
            level.history.append(ent)
        margin = max(cfg.max_data_drop * typical, SWING_SIGMAS * swing)
        dropped = typical > 0 and ent < typical - margin
        # The floor counts only as a fall: once the typical level has stood the drop's margin
        # above it. A run whose images are simple from the start (flat colours, a few codes
        # each) has nothing that degenerated.
        armed = level.best * (1 - cfg.max_data_drop) >= cfg.min_data_entropy
        firing = step >= cfg.min_steps and (dropped or (armed and ent < cfg.min_data_entropy))
        if not self.latch.edge(f"data/{name}", firing, step - cfg.data_window):
            return None
        return Alarm(
            step,
            "data_code_entropy",
            cfg.action,
            modality=name,
            since=step - cfg.data_window,
            values={
                "entropy": ent,
                "typical": typical,
                "swing": swing,
                "best": level.best,
                "codes": total,
            },
            message=f"the {name} codes in the last {cfg.data_window} steps' batches have a "
            f"normalised entropy of {ent:.2f} (typically {typical:.2f}; {total:.0f} codes): a "
            "few codes dominate",
            threshold=f"entropy of the trained-on {name} codes (64 buckets) "
            f"{cfg.max_data_drop:.0%} and {SWING_SIGMAS:g} sigma of its swings below its median "
            f"window, or < {cfg.min_data_entropy:g} after a median that stood "
            f"{cfg.max_data_drop:.0%} above it",
            cause=f"the visual tokenizer (or the {name} data) degenerated: most {name}s map to "
            f"a few codes; the {name} loss falls because the codes became trivial",
            advice="stop feeding these shards: check the visual tokenizer's reconstructions "
            "and `earlyfuse-prep stats` code use of the sources named in mix/<source>",
        )

    def state_dict(self) -> dict:
        return {
            "levels": {name: level.state_dict() for name, level in self.levels.items()},
            "latch": self.latch.state_dict(),
        }

    def load_state_dict(self, st: dict) -> None:
        for name, level in self.levels.items():
            level.load_state_dict(st["levels"][name])
        self.latch.load_state_dict(st["latch"])
