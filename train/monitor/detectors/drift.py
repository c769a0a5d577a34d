"""``Drift``: log Z far from 0, or the final hidden norm growing (Chameleon's norm growth)."""

from __future__ import annotations

from collections import defaultdict, deque

from data.vocab import MODALITY_NAMES
from train.monitor.alarms import Alarm
from train.monitor.config import DriftConfig
from train.monitor.detectors.common import _Latch


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
                    f"{self.cfg.min_steps}-{self.cfg.min_steps + self.cfg.window}"
                    + (  # no rate before rate_span + window steps of norms (rate() says 1.0 then)
                        f" and {rate:.1f}x {self.cfg.rate_span} steps ago"
                        if len(self.recent[name]) >= self.cfg.rate_span + self.cfg.window
                        else ""
                    ),
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
        for name, norms in st["recent"].items():
            self.recent[name] = deque(norms, maxlen=self.cfg.rate_span + self.cfg.window)
        self.latch.load_state_dict(st["latch"])
