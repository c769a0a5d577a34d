"""The run's monitor: the per-step detectors, the probes every N steps, and the alarms they raise.

``Run.step_end`` calls ``check(step, metrics, rule_last)`` once per optimizer step with the
step's metrics (reduced over ranks); it adds the ``monitor/...`` signals to those metrics and
returns the new alarms. The loss/grad-norm spike and the NaN/Inf check run *before* the update,
in the skip-step gate (``train/skip_step.py``); ``check`` turns what the gate decided into
alarms. The run then acts on the strongest alarm (``Run.act``): rollback and halt are the run's
to carry out.

Two questions the run asks between steps:

- ``healthy()``: is now a good moment for a checkpoint (nothing skipped and no loss rising)?
- ``protected_steps(checkpoint_steps)``: which checkpoints keep-last must not delete: while any
  alarm's condition is open, the newest checkpoint from at least ``rollback.margin`` steps
  before the earliest open trouble (``earliest_open_alarm_step()``), so a rollback, or a person,
  can still go back to before it.
"""

from __future__ import annotations

import dataclasses
import math
import time

from data.vocab import MODALITY_NAMES
from train.monitor.alarms import Alarm
from train.monitor.config import SEVERITY, MonitorConfig
from train.monitor.detectors import Collapse, DataCodeUse, Divergence, Drift, Stagnation


def chance_levels(sizes: list[int]) -> dict[str, float]:
    """ln V_m per modality: the CE of a uniform guess over the ids a modality predicts among."""
    return {modality: math.log(size) for modality, size in zip(MODALITY_NAMES, sizes) if size > 1}


# Per probe signal: (likely cause, what to do) for the alarm's text.
PROBE_ADVICE = {
    "attn_logit": (
        "attention logits growing without bound (q and k norms growing; Wortsman et al. 2023): "
        "attention is about to collapse onto single tokens, then the loss diverges",
        "turn on QK-norm (model.attention.qk_norm=true) or lower optim.lr; keep the checkpoint "
        "from before this probe",
    ),
    "attn_entropy": (
        "attention collapsed onto one or two tokens per query (entropy collapse), the step "
        "before a divergence",
        "turn on QK-norm or lower optim.lr; roll back to the checkpoint before this probe",
    ),
    "dependence_gap": (
        "the captions no longer use their images: the model predicts text from text alone "
        "(modality competition, or the image tokens stopped carrying information)",
        "check the image data and visual tokenizer (monitor/gen_code_entropy), the mix "
        "(mix/<source>) and the image loss",
    ),
    "dependence_gap_reverse": (
        "the image codes no longer use the caption before them: the model draws images "
        "regardless of the text",
        "check the caption-then-image data in the mix and the image loss",
    ),
    "gen_code_entropy": (
        "the model draws few distinct visual codes: its visual side collapsed, or the visual "
        "tokenizer feeding it codes has degenerated onto a few codes",
        "check the code use of the training images (earlyfuse-prep stats) and the visual "
        "tokenizer; roll back to before the collapse once the data is fixed",
    ),
}


class Monitor:
    def __init__(
        self,
        cfg: MonitorConfig,
        *,
        total_steps: int,
        chance: dict[str, float] | None = None,
        probes=None,
        warmup_steps: int = 0,
        heldout_every: int = 0,
    ) -> None:
        self.cfg, self.total = cfg, total_steps
        self.heldout_every = heldout_every  # train.eval_every of a run with held-out data, else 0
        self.warmup_steps = warmup_steps
        self.divergence = Divergence(cfg.divergence)
        self.detectors: dict[str, Divergence | Collapse | Stagnation | Drift | DataCodeUse] = {
            "divergence": self.divergence
        }
        if chance:  # the LM task: per-modality losses exist
            self.detectors.update(
                collapse=Collapse(cfg.collapse, chance),
                stagnation=Stagnation(cfg.stagnation, heldout_every),
                drift=Drift(cfg.drift, warmup_steps),
                code_use=DataCodeUse(cfg.code_use),
            )
        self.probes = probes  # train.monitor.lm_probes.LMProbes or None
        self.nonfinite_steps = 0
        self.probe_latch: set[str] = set()
        self.probe_since: dict[str, int] = {}  # open probe alarm -> last probe step before it
        self.probe_last: dict[str, int] = {}  # probe -> step it last ran
        self.probe_ref: dict[str, float] = {}  # attention: max logit at the first probe

    # --- per step ----------------------------------------------------------------------------------
    def check(self, step: int, m: dict, rule_last: dict) -> list[Alarm]:
        alarms = self._spikes(step, m, rule_last)
        if not self.cfg.enabled:  # the skip-step gate is optim.skip_step's: what it drops is said,
            return [dataclasses.replace(a, action="skip") for a in alarms]  # and nothing more done
        for name, det in self.detectors.items():
            if getattr(self.cfg, name).enabled:
                alarms += det.check(step, m)
        if self.probes is not None:
            alarms += self._probe(step, m)
        return alarms

    def finish(self, step: int, final: dict) -> list[Alarm]:
        """The run ended at ``step``: the alarms waiting for a held-out evaluation are judged on
        its last one (``final``: final.json's metrics) or raised without it."""
        stagnation = self._stagnation()
        if stagnation is None:
            return []
        # nothing is left to roll back or halt: what the alarm would have done is said instead
        return [
            dataclasses.replace(alarm, action="warn")
            if SEVERITY[alarm.action] > SEVERITY["warn"]
            else alarm
            for alarm in stagnation.finish(step, final)
        ]

    def flush(self, step: int, why: str) -> list[Alarm]:
        """The alarms waiting for a held-out evaluation, raised now: the run is about to stop
        (a halt) before one judges them."""
        stagnation = self._stagnation()
        return stagnation.flush(step, why) if stagnation is not None else []

    def _stagnation(self) -> Stagnation | None:
        stagnation = self.detectors.get("stagnation")
        if not (self.cfg.enabled and self.cfg.stagnation.enabled):
            return None
        return stagnation if isinstance(stagnation, Stagnation) else None

    def _spikes(self, step: int, metrics: dict, last: dict) -> list[Alarm]:
        metrics["monitor/loss_spike_score"] = _finite(last.get("loss_score", 0.0))
        metrics["monitor/grad_norm_spike_score"] = _finite(last.get("grad_norm_score", 0.0))
        if last.get("nonfinite"):
            self.nonfinite_steps += 1
        metrics["monitor/nonfinite_steps"] = float(self.nonfinite_steps)
        if not last.get("skipped") or not self.cfg.spike.enabled:
            return []
        values = {
            "loss": metrics.get("train/loss", math.nan),
            "grad_norm": metrics.get("optim/grad_norm", math.nan),
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
                    threshold="loss or grad norm not finite",
                    cause="an overflow in the forward or backward pass (lr too high, a bad batch, "
                    "bf16 range exceeded)",
                    advice="nothing while it stays isolated; several in a row trigger divergence",
                )
            ]
        which = "loss_spike" if last["loss_spike"] else "grad_norm_spike"
        return [
            Alarm(
                step,
                which,
                self.cfg.spike.action,
                values=values,
                since=step,
                message=f"loss {values['loss']:.4g} ({last['loss_score']:.1f} sigma"
                + (f"; most from {last['driver']}" if last.get("driver") else "")
                + f"), grad norm "
                f"{values['grad_norm']:.4g} ({last['grad_norm_score']:.1f} sigma): "
                + ("update skipped" if self.cfg.spike.action == "skip" else "update applied"),
                threshold="loss (grad norm) above its de-trended prediction by more than "
                "optim.skip_step.sigmas (grad_norm_sigmas) robust sigmas",
                cause="a batch or an update unlike the recent ones (the step before pushed the "
                "weights too far, or this batch is unusual)",
                advice="the update is dropped (weights and optimizer moments untouched); spikes "
                "that persist trigger divergence",
            )
        ]

    def _probe(self, step: int, metrics: dict) -> list[Alarm]:
        out = []
        for name in ("attention", "dependence", "code_use"):
            probe_cfg = getattr(self.cfg, name)
            if not (probe_cfg.enabled and probe_cfg.every) or not (
                step % probe_cfg.every == 0 or step == self.total
            ):
                continue
            started = time.perf_counter()
            values = self.probes.run(name, step)
            metrics.update(values)
            metrics[f"throughput/probe_s/{name}"] = time.perf_counter() - started
            out += self._probe_alarms(name, step, values)
            self.probe_last[name] = step
        return out

    def _probe_alarms(self, name: str, step: int, values: dict) -> list[Alarm]:
        probe_cfg = getattr(self.cfg, name)
        found: list[
            tuple[str, bool, str, str, str | None]
        ] = []  # signal, firing, msg, rule, modality
        if name == "attention" and values:
            max_logit = values["monitor/attn_max_logit"]
            ref = self.probe_ref.setdefault("attn_max_logit", max_logit)
            m_growth = max_logit / ref if ref > 0 else 1.0
            values = {**values, "monitor/attn_logit_growth": m_growth}
            growth_on = probe_cfg.max_growth > 0  # 0: the growth half of the rule is off
            found.append(
                (
                    "attn_logit",
                    max_logit > probe_cfg.max_logit
                    or (growth_on and m_growth > probe_cfg.max_growth),
                    f"max attention logit {max_logit:.1f}"
                    + (f", {m_growth:.1f}x its value at the first probe" if growth_on else ""),
                    f"max logit > {probe_cfg.max_logit:g}"
                    + (f" or > {probe_cfg.max_growth:g}x the first probe's" if growth_on else ""),
                    None,
                )
            )
            found.append(
                (
                    "attn_entropy",
                    values["monitor/attn_entropy"] < probe_cfg.min_entropy,
                    f"attention entropy {values['monitor/attn_entropy']:.3f} nats: attention collapsed",
                    f"mean attention entropy < {probe_cfg.min_entropy:g} nats",
                    None,
                )
            )
        elif name == "dependence" and values:
            for signal, gap_key, what in (
                ("dependence_gap", "monitor/dependence_gap", "captions after their own image"),
                (
                    "dependence_gap_reverse",
                    "monitor/dependence_gap_reverse",
                    "image codes after their own caption",
                ),
            ):
                if gap_key not in values:
                    continue
                gap = values[gap_key]
                # Armed by two probes in a row at arm_gap: a probe of a few rows swings by
                # several hundredths of a nat, and one high reading is no sign of learning
                if gap < probe_cfg.arm_gap:
                    self.probe_latch.discard(f"{signal}_high")
                elif f"{signal}_high" in self.probe_latch:
                    self.probe_latch.add(f"{signal}_armed")
                else:
                    self.probe_latch.add(f"{signal}_high")
                found.append(
                    (
                        signal,
                        f"{signal}_armed" in self.probe_latch and gap < probe_cfg.min_gap,
                        f"{what} are predicted no better than after another one: gap {gap:.3f} "
                        f"nats (was >= {probe_cfg.arm_gap:g})",
                        f"gap < {probe_cfg.min_gap:g} nats after having reached {probe_cfg.arm_gap:g}",
                        "text" if signal == "dependence_gap" else "image",
                    )
                )
        elif name == "code_use" and values:
            # A collapse is drawings that use few codes *and* look alike, more alike than the
            # run's own images: flat squares of several colours use few codes but differ, and a
            # run without images has nothing to judge its drawings by. Armed once the model has
            # drawn like the data: an untrained model draws near-uniform noise (entropy near 1),
            # then one background code a drawing (small corpora at step 100), a model that has
            # not learned to draw yet, not one that collapsed. A probe arms the rule when its
            # drawings pass both halves and their entropy is nearer the data's than a uniform
            # draw's, after the lr's warmup (on data of high code entropy, photos, an untrained
            # model's noise could pass for the data's).
            drawn = values["monitor/gen_code_entropy"]
            variety = values.get("monitor/gen_image_diversity", 0.0)
            data_variety = values.get("monitor/ref_image_diversity")
            few = drawn < probe_cfg.min_entropy
            alike = data_variety is not None and variety < probe_cfg.min_ratio * data_variety
            if (
                data_variety is not None
                and step >= max(probe_cfg.min_steps, self.warmup_steps)
                and not (few or alike)
                and drawn <= (1.0 + values["monitor/ref_code_entropy"]) / 2
            ):
                self.probe_latch.add("gen_code_entropy_armed")
            found.append(
                (
                    "gen_code_entropy",
                    "gen_code_entropy_armed" in self.probe_latch and few and alike,
                    f"generated images use {values['monitor/gen_code_distinct']:.0f} distinct codes, "
                    f"normalised entropy {drawn:.2f}; their dominant codes vary "
                    f"{max(variety, 0.0) + 0.0:.2f} "  # no "-0.00" from a rounding below 0
                    f"against {data_variety or 0.0:.2f} in the run's own images",
                    f"normalised entropy of generated codes < {probe_cfg.min_entropy:g} and the "
                    f"images' dominant codes < {probe_cfg.min_ratio:g} x as varied as the data's, "
                    "after drawings like the data's",
                    "image",
                )
            )
        out = []
        prev = self.probe_last.get(name, 0)
        for signal, firing, msg, rule, modality in found:
            firing = firing and step >= probe_cfg.min_steps
            if firing and signal not in self.probe_latch:
                cause, advice = PROBE_ADVICE[signal]
                self.probe_since[signal] = prev + 1  # after the last probe that was fine
                out.append(
                    Alarm(
                        step,
                        signal,
                        probe_cfg.action,
                        modality=modality,
                        values={
                            key.split("/", 1)[1]: value
                            for key, value in values.items()
                            if "/L" not in key
                        },
                        since=prev + 1,
                        message=msg,
                        threshold=rule,
                        cause=cause,
                        advice=advice,
                    )
                )
            if firing:
                self.probe_latch.add(signal)
            else:
                self.probe_latch.discard(signal)
                self.probe_since.pop(signal, None)
        return out

    # --- health, retention and state ---------------------------------------------------------------
    def healthy(self) -> bool:
        """No step skipped in the divergence window and no loss rising: a checkpoint now is a
        good one to return to."""
        return not self.divergence.troubled()

    def earliest_open_alarm_step(self) -> int | None:
        """The step the oldest trouble still open began (an alarm whose condition has not
        cleared, a skipped step in the divergence window, or a rise in progress); None when all
        is quiet."""
        found = self.open_troubles()
        return min(found) if found else None

    def protected_steps(self, checkpoint_steps: list[int]) -> set[int]:
        """The checkpoints keep-last must keep: for each open trouble, the newest checkpoint at
        least ``rollback.margin`` steps before it began (so a rollback lands before it), or, when
        none is that old, the oldest there is (the best left)."""
        if not checkpoint_steps:
            return set()
        margin = self.cfg.rollback.margin
        out = set()
        for since in self.open_troubles():
            good = [ckpt_step for ckpt_step in checkpoint_steps if ckpt_step <= since - margin]
            out.add(max(good) if good else min(checkpoint_steps))
        return out

    def open_troubles(self) -> list[int]:
        """The steps at which each open trouble began."""
        found = [
            since_step for det in self.detectors.values() for since_step in det.latch.open_since()
        ]
        stagnation = self.detectors.get("stagnation")
        if isinstance(stagnation, Stagnation):  # an alarm still waiting for the held-out losses
            found += [waiting["since"] for waiting in stagnation.pending.values()]
        found += list(self.probe_since.values())
        skipped = [since_step for since_step, bad in self.divergence.skipped if bad]
        if skipped:
            found.append(min(skipped))
        if self.divergence.excursion is not None:  # the loss has begun to rise
            found.append(self.divergence.excursion)
        return found

    def reached(self) -> dict[str, dict[str, float]]:
        """The best levels each modality has reached, against chance and against its unigram CE
        (what arms the collapse detector's two rules)."""
        collapse = self.detectors.get("collapse")
        if not isinstance(collapse, Collapse):
            return {}
        return {"chance": dict(collapse.best), "unigram": dict(collapse.best_unigram)}

    def keep_reached(self, best: dict[str, dict[str, float]]) -> None:
        """After a rollback: the best levels reached before it count (the restored state's are
        older)."""
        collapse = self.detectors.get("collapse")
        if isinstance(collapse, Collapse):
            for levels, kept in ((collapse.best, "chance"), (collapse.best_unigram, "unigram")):
                for name, level in best.get(kept, {}).items():
                    levels[name] = min(level, levels.get(name, math.inf))

    def restart_data_references(self) -> None:
        """Forget what was learned of the data's losses, shares and codes (a resume with another
        mix): the new mix's levels are no rise, no stagnation and no starvation, and a modality
        is learned against its unigram CE anew (new documents of it start near it). The
        collapse against chance and the drift (hidden norms) detectors go on."""
        self.divergence.reset_levels()
        collapse = self.detectors.get("collapse")
        if isinstance(collapse, Collapse):
            collapse.restart_unigram()
        old = self.detectors.get("stagnation")
        if isinstance(old, Stagnation):
            stagnation = Stagnation(self.cfg.stagnation, self.heldout_every)
            # the held-out data is the same: its evaluations, and the alarms waiting for the
            # next one, stay
            stagnation.heldout, stagnation.pending = old.heldout, old.pending
            self.detectors.update(stagnation=stagnation, code_use=DataCodeUse(self.cfg.code_use))

    def state_dict(self) -> dict:
        return {
            "detectors": {name: detector.state_dict() for name, detector in self.detectors.items()},
            "probe_latch": sorted(self.probe_latch),
            "probe_since": dict(self.probe_since),
            "probe_last": dict(self.probe_last),
            "probe_ref": dict(self.probe_ref),
            "nonfinite_steps": self.nonfinite_steps,
        }

    def load_state_dict(self, st: dict) -> None:
        for key, detector in self.detectors.items():
            if key in st["detectors"]:  # a detector turned on at the resume starts fresh
                detector.load_state_dict(st["detectors"][key])
        self.probe_latch = set(st["probe_latch"])
        self.probe_since = {key: int(value) for key, value in st["probe_since"].items()}
        self.probe_last = {key: int(value) for key, value in st["probe_last"].items()}
        self.probe_ref = {key: float(value) for key, value in st["probe_ref"].items()}
        self.nonfinite_steps = int(st["nonfinite_steps"])


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 1e9


def _at_least(action: str, floor: str) -> str:
    return action if SEVERITY[action] >= SEVERITY[floor] else floor
