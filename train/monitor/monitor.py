"""The run's monitor: the per-step detectors, the probes every N steps, and the alarms they raise.

``Run.step_end`` calls ``check(step, metrics)`` once per optimizer step with the step's metrics
(reduced over ranks); it adds the ``monitor/...`` signals to those metrics and returns the new
alarms. The loss/grad-norm spike and the NaN/Inf check run *before* the update, in the skip-step
gate (``train/skip_step.py``); ``check`` turns what the gate decided into alarms. The run then
acts on the strongest alarm (``Run.act``): rollback and halt are the run's to carry out.
"""

from __future__ import annotations

import math
import time

from data.vocab import MODALITY_NAMES
from train.monitor.alarms import Alarm
from train.monitor.config import SEVERITY, MonitorConfig
from train.monitor.detectors import Collapse, Divergence, Drift, Stagnation


def chance_levels(sizes: list[int]) -> dict[str, float]:
    """ln V_m per modality: the CE of a uniform guess over the ids a modality predicts among."""
    return {n: math.log(v) for n, v in zip(MODALITY_NAMES, sizes) if v > 1}


class Monitor:
    def __init__(
        self,
        cfg: MonitorConfig,
        *,
        total_steps: int,
        chance: dict[str, float] | None = None,
        probes=None,
    ) -> None:
        self.cfg, self.total = cfg, total_steps
        self.divergence = Divergence(cfg.divergence)
        self.detectors: dict[str, Divergence | Collapse | Stagnation | Drift] = {
            "divergence": self.divergence
        }
        if chance:  # the LM task: per-modality losses exist
            self.detectors.update(
                collapse=Collapse(cfg.collapse, chance),
                stagnation=Stagnation(cfg.stagnation),
                drift=Drift(cfg.drift),
            )
        self.probes = probes  # train.monitor.lm_probes.LMProbes or None
        self.nonfinite_steps = 0
        self.probe_latch: set[str] = set()

    # --- per step ----------------------------------------------------------------------------------
    def check(self, step: int, m: dict, rule_last: dict) -> list[Alarm]:
        if not self.cfg.enabled:
            return []
        alarms = self._spikes(step, m, rule_last)
        for name, det in self.detectors.items():
            if getattr(self.cfg, name).enabled:
                alarms += det.check(step, m)
        if self.probes is not None:
            alarms += self._probe(step, m)
        return alarms

    def _spikes(self, step: int, m: dict, last: dict) -> list[Alarm]:
        m["monitor/loss_spike_score"] = _finite(last.get("loss_score", 0.0))
        m["monitor/grad_norm_spike_score"] = _finite(last.get("grad_norm_score", 0.0))
        if last.get("nonfinite"):
            self.nonfinite_steps += 1
        m["monitor/nonfinite_steps"] = float(self.nonfinite_steps)
        if not last.get("skipped") or not self.cfg.spike.enabled:
            return []
        values = {
            "loss": m.get("train/loss", math.nan),
            "grad_norm": m.get("optim/grad_norm", math.nan),
            "loss_score": last["loss_score"],
            "grad_norm_score": last["grad_norm_score"],
        }
        if last.get("nonfinite"):
            return [
                Alarm(
                    step,
                    "nonfinite",
                    _at_least(self.cfg.spike.action, "skip"),
                    values=values,
                    since=step,
                    message=f"loss {values['loss']:.4g}, grad norm {values['grad_norm']:.4g}: "
                    "the update was skipped, the weights are untouched",
                )
            ]
        which = "loss_spike" if last["loss_score"] >= last["grad_norm_score"] else "grad_norm_spike"
        return [
            Alarm(
                step,
                which,
                self.cfg.spike.action,
                values=values,
                since=step,
                message=f"loss {values['loss']:.4g} ({last['loss_score']:.1f} sigma), grad norm "
                f"{values['grad_norm']:.4g} ({last['grad_norm_score']:.1f} sigma): update skipped",
            )
        ]

    def _probe(self, step: int, m: dict) -> list[Alarm]:
        out = []
        for name in ("attention", "dependence", "code_use"):
            c = getattr(self.cfg, name)
            if not (c.enabled and c.every) or not (step % c.every == 0 or step == self.total):
                continue
            t0 = time.perf_counter()
            values = self.probes.run(name, step)
            m.update(values)
            m[f"throughput/probe_s/{name}"] = time.perf_counter() - t0
            out += self._probe_alarms(name, step, values)
        return out

    def _probe_alarms(self, name: str, step: int, v: dict) -> list[Alarm]:
        c = getattr(self.cfg, name)
        found: list[tuple[str, bool, str]] = []
        if name == "attention" and v:
            found.append(
                (
                    "attn_logit",
                    v["monitor/attn_max_logit"] > c.max_logit,
                    f"max attention logit {v['monitor/attn_max_logit']:.1f} > {c.max_logit:g}",
                )
            )
            found.append(
                (
                    "attn_entropy",
                    v["monitor/attn_entropy"] < c.min_entropy,
                    f"attention entropy {v['monitor/attn_entropy']:.3f} nats < {c.min_entropy:g}: attention collapsed",
                )
            )
        elif name == "dependence" and v:
            gap = v["monitor/dependence_gap"]
            if gap >= c.arm_gap:
                self.probe_latch.add("dep_armed")
            found.append(
                (
                    "dependence_gap",
                    "dep_armed" in self.probe_latch and gap < c.min_gap,
                    f"captions no longer depend on their images: loss {v['monitor/caption_loss_matched']:.3f} "
                    f"with the matched image, {v['monitor/caption_loss_shuffled']:.3f} with another "
                    f"(gap {gap:.3f} < {c.min_gap:g} nats, was >= {c.arm_gap:g})",
                )
            )
        elif name == "code_use" and v:
            found.append(
                (
                    "gen_code_entropy",
                    v["monitor/gen_code_entropy"] < c.min_entropy,
                    f"generated images use {v['monitor/gen_code_distinct']:.0f} distinct codes, normalised "
                    f"entropy {v['monitor/gen_code_entropy']:.2f} < {c.min_entropy:g}",
                )
            )
        out = []
        for signal, on, msg in found:
            on = on and step >= c.min_steps
            if on and signal not in self.probe_latch:
                out.append(
                    Alarm(
                        step,
                        signal,
                        c.action,
                        modality=None if name == "attention" else "image",
                        values={k.split("/", 1)[1]: x for k, x in v.items() if "/L" not in k},
                        message=msg,
                    )
                )
            (self.probe_latch.add if on else self.probe_latch.discard)(signal)
        return out

    # --- health and state --------------------------------------------------------------------------
    def healthy(self) -> bool:
        """No step skipped in the divergence window: a checkpoint now is a good one to return to."""
        return not any(bad for _, bad in self.divergence.skipped)

    def state_dict(self) -> dict:
        return {
            "detectors": {k: d.state_dict() for k, d in self.detectors.items()},
            "probe_latch": sorted(self.probe_latch),
            "nonfinite_steps": self.nonfinite_steps,
        }

    def load_state_dict(self, st: dict) -> None:
        for k, d in self.detectors.items():
            if k in st.get("detectors", {}):
                d.load_state_dict(st["detectors"][k])
        self.probe_latch = set(st.get("probe_latch", []))
        self.nonfinite_steps = int(st.get("nonfinite_steps", 0))


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 1e9


def _at_least(action: str, floor: str) -> str:
    return action if SEVERITY[action] >= SEVERITY[floor] else floor
