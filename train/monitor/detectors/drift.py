"""``Drift``: log Z far from 0, or the final hidden norm growing (Chameleon's norm growth)."""

from __future__ import annotations

from collections import defaultdict, deque

from data.vocab import MODALITY_NAMES
from train.monitor.alarms import Alarm
from train.monitor.config import DriftConfig
from train.monitor.detectors.common import _Latch


class Drift:
    """log Z far from 0 (softmax normaliser drift), or the final hidden norm growing: against its
    own early value, or fast (its token-weighted mean over the last ``window`` steps
    ``growth_rate`` x its mean ``rate_span`` steps before). Chameleon's norm growth precedes
    divergence in mixed-modal runs; the rate catches it at any point of a long run, where the
    early value is long gone. The hidden norm also moves with the data (a stretch of
    repetitive files raises a modality's norm two- or threefold), so the rate is not judged
    when the two windows' tokens differ in difficulty (their unigram CE, ``unigram/<m>``) by
    more than ``max_data_shift``."""

    def __init__(self, cfg: DriftConfig, warmup_steps: int = 0) -> None:
        self.cfg = cfg
        # The norms grow as the lr warms up: that is training, not drift. The hidden-norm rules
        # take their early value, and count their steps, from the warmup's end or min_steps.
        self.start = max(cfg.min_steps, warmup_steps)
        self.ref: dict[str, list[float]] = {}  # modality -> [sum, count] of the reference window
        # modality -> (step, hidden norm, tokens, unigram CE of the tokens; 0: not counted) of
        # the steps that held it, the last rate_span + window
        self.recent: dict[str, deque] = defaultdict(deque)
        self.latch = _Latch()
        self.shifted: set[str] = set()  # the modalities whose rate the data's shift leaves unjudged

    def rate(self, name: str, step: int) -> float | None:
        """Mean hidden norm over the last ``window`` optimizer steps over that of the ``window``
        steps ``rate_span`` earlier; None until the run has both. Counted in optimizer steps, not
        in the steps that held the modality: a modality in 40 % of the steps would otherwise be
        compared with its norm 125 steps back, deep in the lr's warmup."""
        norms = self.recent[name]
        span, window = self.cfg.rate_span, self.cfg.window
        # Judged afresh from the saved windows at every step, so a resumed run decides the same.
        self.shifted.discard(name)
        if step - span - window + 1 < self.start:
            return None
        means, data = [], []
        for part in (
            [entry for entry in norms if entry[0] <= step - span],
            [entry for entry in norms if entry[0] > step - window],
        ):
            tokens = sum(count for _, _, count, _ in part)
            if tokens < max(1, self.cfg.min_tokens):
                return None
            means.append(sum(norm * count for _, norm, count, _ in part) / tokens)
            data.append(sum(unigram * count for _, _, count, unigram in part) / tokens)
        shift = self.cfg.max_data_shift
        if shift and all(data) and abs(data[1] / data[0] - 1) > shift:
            self.shifted.add(name)
            return None  # other data, not the same data's norm growing
        return means[1] / means[0] if means[0] > 0 else None

    def check(self, step: int, metrics: dict) -> list[Alarm]:
        out = []
        for name in MODALITY_NAMES:
            logz, hidden_norm = (
                metrics.get(f"monitor/logz/{name}"),
                metrics.get(f"monitor/hidden_norm/{name}"),
            )
            if logz is None or hidden_norm is None:
                continue
            if step >= self.start:
                ref_sum = self.ref.setdefault(name, [0.0, 0.0])
                if ref_sum[1] < self.cfg.window:
                    ref_sum[0], ref_sum[1] = ref_sum[0] + hidden_norm, ref_sum[1] + 1
            ref = self.ref.get(name)
            growth = hidden_norm / (ref[0] / ref[1]) if ref and ref[1] >= self.cfg.window else 1.0
            metrics[f"monitor/hidden_growth/{name}"] = growth
            if step >= self.start:  # the early steps' fast growth is training, not drift
                norms = self.recent[name]
                tokens = float(metrics.get(f"tokens/{name}", 1.0))
                norms.append(
                    (step, hidden_norm, tokens, float(metrics.get(f"unigram/{name}", 0.0)))
                )
                while norms[0][0] <= step - self.cfg.rate_span - self.cfg.window:
                    norms.popleft()
            found = self.rate(name, step)
            rate = 1.0 if found is None else found
            if found is not None:
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
                    growth > hn_limit
                    or (self.cfg.growth_rate > 0 and rate > rate_limit)
                    # unjudged while the data differs: an open alarm stays open, not raised again
                    or (keep["hidden"] and name in self.shifted),
                    {"hidden_norm": hidden_norm, "growth": growth, "rate": rate},
                    f"final hidden norm of {name} is {hidden_norm:.4g}, {growth:.1f}x its value over its "
                    f"first {self.cfg.window} steps from step {self.start}"
                    + (
                        f" and {rate:.1f}x {self.cfg.rate_span} steps ago"
                        if found is not None
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
            self.recent[name] = deque(
                (int(at), float(norm), float(n), float(unigram)) for at, norm, n, unigram in norms
            )
        self.latch.load_state_dict(st["latch"])
