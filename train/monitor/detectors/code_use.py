"""``DataCodeUse``: the entropy of the visual codes the run trains on, every step."""

from __future__ import annotations

from collections import deque

from train.monitor.alarms import Alarm
from train.monitor.config import CodeUseConfig
from train.monitor.detectors.common import _Latch
from train.monitor.stats import MAD_TO_SIGMA, median

HISTORY = 10  # data windows whose median is the typical level
VISUAL = ("image", "video")  # the modalities whose codes the entropy counts
SWING_SIGMAS = 5.0  # a drop must also exceed this many standard deviations of the windows' swings


class DataCodeUse:
    """The visual codes a run trains on, every step (``monitor/data_code_entropy`` from the
    task: the entropy of the step's image and video label codes folded into 64 buckets): a
    visual tokenizer that emits a handful of codes shows the moment its output reaches the
    batches, long before the model's own drawings (the ``code_use`` probe) degrade, and while
    the image loss, if anything, *falls* (constant codes are easy to predict)."""

    def __init__(self, cfg: CodeUseConfig) -> None:
        self.cfg = cfg
        self.steps: deque[tuple[float, float]] = deque(maxlen=cfg.data_window)
        # The window entropies of the last HISTORY windows' worth of steps (from min_steps): their
        # median is the run's typical level. Not their maximum: a window holds the codes of a
        # few dozen images, so its entropy swings with which images it holds, and the highest
        # swing of a long run is no level the data ever had (images at 10 % of a healthy mix
        # swung 0.41-0.48, 15 % below the highest).
        self.history: deque[float] = deque(maxlen=HISTORY * cfg.data_window)
        self.best = 0.0  # the highest typical level so far
        self.latch = _Latch()
        self.seen: set[str] = set()  # the visual modalities delivered so far: the alarm names them

    def check(self, step: int, metrics: dict) -> list[Alarm]:
        cfg = self.cfg
        codes, entropy = (
            metrics.get("monitor/data_codes", 0.0),
            metrics.get("monitor/data_code_entropy"),
        )
        self.steps.append((entropy * codes, codes) if entropy is not None and codes else (0.0, 0.0))
        self.seen |= {name for name in VISUAL if metrics.get(f"tokens/{name}")}
        total = sum(step_codes for _, step_codes in self.steps)
        if total < cfg.data_min_codes:
            return []
        ent = sum(weighted for weighted, _ in self.steps) / total
        metrics["monitor/data_code_entropy_window"] = ent
        known = len(self.history) >= cfg.data_window
        typical = median(self.history) if known else 0.0
        # The drop must also leave the windows' own swings: on images of few codes each (flat
        # colours, stripes), which few dozen images a window holds swings its entropy by more
        # than the margin (0.19-0.32 around 0.25 on a healthy mix of 80 % striped pictures,
        # which fired at 0.20), while before a degenerate visual tokenizer the windows of a
        # varied corpus stand within +-0.01 (0.72-0.73 in the suite's visual-code-collapse).
        swing = MAD_TO_SIGMA * median([abs(h - typical) for h in self.history]) if known else 0.0
        self.best = max(self.best, typical)
        if step >= cfg.min_steps and len(self.steps) == cfg.data_window:
            self.history.append(ent)
        margin = max(cfg.max_data_drop * typical, SWING_SIGMAS * swing)
        dropped = typical > 0 and ent < typical - margin
        # The floor counts only as a fall: once the typical level has stood the drop's margin
        # above it. A run whose images are simple from the start (flat colours, a few codes
        # each) has nothing that degenerated.
        armed = self.best * (1 - cfg.max_data_drop) >= cfg.min_data_entropy
        firing = step >= cfg.min_steps and (dropped or (armed and ent < cfg.min_data_entropy))
        if not self.latch.edge("data", firing, step - cfg.data_window):
            return []
        # image and video labels are counted together (train/tasks/lm.py, code_buckets)
        seen = [name for name in VISUAL if name in self.seen] or list(VISUAL)
        return [
            Alarm(
                step,
                "data_code_entropy",
                cfg.action,
                modality=seen[0],
                since=step - cfg.data_window,
                values={
                    "entropy": ent,
                    "typical": typical,
                    "swing": swing,
                    "best": self.best,
                    "codes": total,
                },
                message=f"the {' and '.join(seen)} codes in the last {cfg.data_window} steps' "
                f"batches have a normalised entropy of {ent:.2f} (typically {typical:.2f}; "
                f"{total:.0f} codes): a few codes dominate",
                threshold=f"entropy of the trained-on codes (64 buckets) {cfg.max_data_drop:.0%} "
                f"and {SWING_SIGMAS:g} sigma of its swings below its median window, or < "
                f"{cfg.min_data_entropy:g} after a median that stood {cfg.max_data_drop:.0%} above it",
                cause="the visual tokenizer (or the image data) degenerated: most images map to "
                "a few codes; the image loss falls because the codes became trivial",
                advice="stop feeding these shards: check the visual tokenizer's reconstructions "
                "and `earlyfuse-prep stats` code use of the sources named in mix/<source>",
            )
        ]

    def state_dict(self) -> dict:
        return {
            "steps": list(self.steps),
            "history": list(self.history),
            "best": self.best,
            "latch": self.latch.state_dict(),
            "seen": sorted(self.seen),
        }

    def load_state_dict(self, st: dict) -> None:
        self.steps = deque([tuple(pair) for pair in st["steps"]], maxlen=self.cfg.data_window)
        self.history = deque(st["history"], maxlen=HISTORY * self.cfg.data_window)
        self.best = float(st["best"])
        self.latch.load_state_dict(st["latch"])
        self.seen = set(st.get("seen", ()))  # an older checkpoint: learnt again from the next steps
