"""The robust statistics behind the detectors, on loss curves shaped like real runs: an
early fall, a plateau with batch-to-batch noise, then a blow-up or a mix that swings."""

from __future__ import annotations

import math

import numpy as np
import pytest

from train.callbacks.base import Callback, Callbacks
from train.monitor import Monitor, MonitorConfig
from train.monitor.config import DivergenceConfig, StagnationConfig
from train.monitor.detectors import Divergence, Stagnation
from train.monitor.stats import RobustTrend, median, theil_sen
from train.safe_load import CheckpointError
from train.skip_step import SkipStepConfig, SkipStepRule


def curve(steps: int, *, seed: int = 0, noise: float = 0.08) -> np.ndarray:
    """A debug-run-like loss: 7.8 falling to ~3.2 with most of the fall in the first 50 steps."""
    rng = np.random.default_rng(seed)
    t = np.arange(1, steps + 1)
    return 3.0 + 4.8 * np.exp(-t / 25) + 0.3 * np.exp(-t / 200) + rng.normal(0, noise, steps)


def olmo_score(history: list[float], x: float) -> float:
    """The rule this replaces: sigmas above the mean of the last 128 values."""
    h = history[-128:]
    mean = sum(h) / len(h)
    std = math.sqrt(sum((v - mean) ** 2 for v in h) / (len(h) - 1))
    return (x - mean) / std


def test_theil_sen_and_median():
    assert median([3, 1, 2]) == 2 and median([4, 1, 2, 3]) == 2.5
    b, m = theil_sen([1.0, 3.0, 5.0, 100.0, 9.0])  # one outlier does not tilt the line
    assert m == pytest.approx(2.0) and b == pytest.approx(1.0)


def test_a_blow_up_after_an_early_fall_is_caught_at_default_settings():
    """At step 100 of a run whose loss fell from 7.8, a doubled loss scored 2.7 sigma
    under mean/std of the last 128 steps; the de-trended robust score skips it."""
    loss = curve(150)
    grad = np.random.default_rng(1).lognormal(np.log(1.5), 0.15, 150)
    loss[100:] *= 2.0  # the blow-up: every step from 101 on
    grad[100:] *= 8.0
    rule = SkipStepRule(SkipStepConfig())
    decided = [rule.decide(s + 1, float(loss[s]), float(grad[s])) for s in range(150)]
    assert not any(decided[:100]), [i + 1 for i, d in enumerate(decided) if d]
    assert decided[100] and rule.last["loss_score"] > 10
    assert olmo_score(list(loss[:100]), float(loss[100])) < 6  # what the old rule saw


def test_no_false_skip_on_a_heavy_tailed_healthy_curve():
    """A loss that swings with the batch mix (heavy tails: one batch in 10 of a harder modality)
    is not a spike: the scale is the larger of the MAD and the standard deviation."""
    rng = np.random.default_rng(2)
    loss = curve(400, noise=0.05) + np.where(rng.random(400) < 0.1, 0.8, 0.0)
    grad = rng.lognormal(np.log(1.5), 0.15, 400)
    rule = SkipStepRule(SkipStepConfig())
    assert not any(rule.decide(s + 1, float(loss[s]), float(grad[s])) for s in range(400))


def test_a_loss_spike_names_the_modality_that_drove_it():
    """A step whose total loss is below the usual while one modality's rose far above its own
    trend: the alarm says which (the total alone read as nonsense)."""
    rng = np.random.default_rng(3)
    rule = SkipStepRule(SkipStepConfig(min_steps=10))
    for s in range(80):
        text, image = 4.0 + 0.05 * rng.standard_normal(), 0.5 + 0.05 * rng.standard_normal()
        parts = {"text": (text, 2000.0), "image": (image, 100.0)}
        assert not rule.decide(s + 1, text, 1.0, parts)
    parts = {"text": (4.0, 200.0), "image": (9.0, 100.0)}
    assert rule.decide(81, 2.0, 1.0, parts)
    assert rule.last["driver"].startswith("image's CE 9 on 100 tokens, ")


def test_a_long_clips_layout_tokens_are_not_scored_against_the_images():
    """The layout tokens of images (a hundred a step, CE near 0) and of a rare long clip (five
    hundred in one step, CE anywhere from 0.3 to 10 between passes) are one modality, structure,
    which the gate leaves out: the clip's row is no spike; a step with every content modality
    doubled is."""
    rng = np.random.default_rng(4)
    rule = SkipStepRule(SkipStepConfig(min_steps=20))
    for s in range(1, 121):
        parts = {
            "text": (4.3 + 0.3 * rng.standard_normal(), 1400.0 + 600 * rng.standard_normal()),
            "image": (0.5 + 0.1 * rng.standard_normal(), 500.0),
            "structure": (0.04 + 0.005 * rng.standard_normal(), 60.0 + rng.integers(0, 150)),
        }
        if s % 25 == 5:  # a short clip beside the images: its layout tokens weigh in
            parts["structure"] = (2.0, 217.0)
        assert not rule.decide(s, 4.0, 1.0, parts), (s, rule.last)
    clip_row = {"text": (9.8, 18.0), "video": (0.85, 3520.0), "structure": (10.1, 499.0)}
    assert not rule.decide(121, 2.0, 1.0, clip_row), rule.last
    blow_up = {"text": (8.6, 1400.0), "image": (1.0, 500.0), "structure": (0.04, 100.0)}
    assert rule.decide(122, 7.0, 1.0, blow_up) and rule.last["loss_score"] > 6
    assert "structure" not in rule.state_dict()["by_modality"]


def test_spike_state_round_trips_and_refuses_another_format():
    rule = SkipStepRule(SkipStepConfig())
    for s, x in enumerate(curve(80)):
        rule.decide(s + 1, float(x), 1.0 + 0.01 * s)
    other = SkipStepRule(SkipStepConfig())
    other.load_state_dict(rule.state_dict())
    assert other.state_dict() == rule.state_dict()
    assert other.loss.score(3.5) == rule.loss.score(3.5)
    # A state without the residuals or the per-modality detectors is not one this code wrote:
    # refused by name on resume, never replayed or filled with defaults.
    holder = _StateHolder(other)
    callbacks = Callbacks([holder])
    for drop in ("by_modality", "loss"):
        state = {key: value for key, value in rule.state_dict().items() if key != drop}
        with pytest.raises(CheckpointError, match=rf"ck/step_2: the 'skip_step' state .*{drop}"):
            callbacks.load_state_dict({"skip_step": state}, "ck/step_2")
    no_residuals = {**rule.state_dict(), "loss": {"values": list(curve(80))}}
    with pytest.raises(CheckpointError, match="residuals"):
        callbacks.load_state_dict({"skip_step": no_residuals}, "ck/step_2")


class _StateHolder(Callback):
    """The skip-step rule's state checkpointed the way the trainer's callbacks do it."""

    state_key = "skip_step"

    def __init__(self, rule: SkipStepRule) -> None:
        self.rule = rule

    def state_dict(self) -> dict:
        return self.rule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.rule.load_state_dict(state)


def test_robust_trend_scores_relative_to_the_trend_not_the_level():
    t = RobustTrend(64)
    for i in range(60):
        t.add(10.0 - 0.05 * i + 0.01 * (-1) ** i)  # a steady fall
    assert abs(t.score(10.0 - 0.05 * 60)) < 3  # on the line
    assert t.score(10.0 - 0.05 * 60 + 0.5) > 6  # well above it
    assert t.score(float("nan")) == math.inf


def step_metrics(step: int, losses: dict[str, float], tokens: dict[str, float]) -> dict:
    m = {"train/loss": sum(losses[k] * tokens[k] for k in losses) / sum(tokens.values())}
    for k in losses:
        m[f"loss/{k}"], m[f"tokens/{k}"] = losses[k], tokens[k]
    return m


def run_divergence(stream, cfg=None) -> tuple[Divergence, list]:
    d, out = Divergence(cfg or DivergenceConfig()), []
    for step, m in enumerate(stream, 1):
        out += d.check(step, m)
    return d, out


def healthy_losses(step: int) -> dict[str, float]:
    f = math.exp(-step / 40)
    return {"text": 3.3 + 3 * f, "code": 3.5 + 3 * f, "image": 2.8 + 4 * f}


def test_divergence_fires_on_a_sustained_rise_without_any_skip():
    rng = np.random.default_rng(0)
    stream = []
    for s in range(1, 200):
        losses = {k: v * (1 + rng.normal(0, 0.03)) for k, v in healthy_losses(s).items()}
        if s > 120:  # the run has left its trajectory: every modality 60 % worse
            losses = {k: v * 1.6 for k, v in losses.items()}
        stream.append(step_metrics(s, losses, {"text": 300, "code": 300, "image": 400}))
    d, out = run_divergence(stream)
    assert len(out) == 1 and out[0].signal == "divergence" and out[0].action == "rollback"
    assert 121 <= out[0].step <= 130 and 115 <= out[0].since <= 122, (out[0].step, out[0].since)
    assert "text" in out[0].message and out[0].cause and out[0].advice


def test_divergence_ignores_a_swinging_mix_and_a_single_modality():
    """Batches that alternate between a hard and an easy modality leave the mix-held-fixed loss
    flat; one modality getting worse alone is collapse or stagnation, not a divergence."""
    rng = np.random.default_rng(1)
    stream = []
    for s in range(1, 250):
        losses = {k: v * (1 + rng.normal(0, 0.03)) for k, v in healthy_losses(s).items()}
        if s > 150:
            losses["code"] *= 1.5
        hard = (s // 15) % 2  # 15 steps of mostly image, then 15 of mostly text
        tokens = {"text": 100 + 700 * (1 - hard), "code": 200, "image": 100 + 700 * hard}
        stream.append(step_metrics(s, losses, tokens))
    _, out = run_divergence(stream)
    assert out == []


def test_stagnation_ignores_bursty_token_counts_but_sees_starvation():
    """A modality present in few steps with few tokens is not judged; a modality that stalls
    while the others fall, with steady tokens, is."""
    cfg = StagnationConfig()
    rng = np.random.default_rng(3)
    bursty, starved = Stagnation(cfg), Stagnation(cfg)
    fired_bursty, fired_starved = [], []
    for s in range(1, 301):
        base = healthy_losses(s)
        # bursty: code comes in runs of one long document, whose difficulty differs by file
        code_doc = 3.5 + (s // 20 % 3) * 0.8
        tok_code = 512 if (s // 20) % 4 == 0 else 0
        m = step_metrics(
            s,
            {"text": base["text"], "code": code_doc, "image": base["image"]},
            {"text": 400, "code": tok_code, "image": 300},
        )
        fired_bursty += bursty.check(s, m)
        text = base["text"] * (1 + rng.normal(0, 0.02))
        if s > 150:  # starved: text stops improving and drifts up while the others fall
            text = healthy_losses(150)["text"] * (1 + 0.001 * (s - 150))
        m2 = step_metrics(
            s,
            {"text": text, "code": base["code"], "image": base["image"]},
            {"text": 300, "code": 300, "image": 400},
        )
        fired_starved += starved.check(s, m2)
    assert fired_bursty == []
    assert [(a.signal, a.modality) for a in fired_starved] == [("stagnation", "text")]
    assert fired_starved[0].step > 150 and "starved" in fired_starved[0].cause


def test_protected_steps_keep_the_checkpoint_before_an_open_alarm():
    cfg = MonitorConfig()
    mon = Monitor(cfg, total_steps=300, chance={"text": 6.2, "code": 6.2, "image": 6.9})
    rng = np.random.default_rng(0)
    ckpts = list(range(10, 300, 10))
    protected, alarms = {}, []
    for s in range(1, 200):
        losses = {k: v * (1 + rng.normal(0, 0.02)) for k, v in healthy_losses(s).items()}
        if 140 < s <= 170:
            losses = {k: v * 1.8 for k, v in losses.items()}
        m = step_metrics(s, losses, {"text": 300, "code": 300, "image": 400})
        alarms += mon.check(s, m, {})
        protected[s] = mon.protected_steps([c for c in ckpts if c <= s])
    div = [a for a in alarms if a.signal == "divergence"]
    assert div and div[0].since == 141
    assert protected[130] == set() and protected[div[0].step] == {130}
    assert not mon.healthy() or protected[div[0].step]
    assert protected[199] == set()  # the trouble has cleared: nothing held back
    assert mon.earliest_open_alarm_step() is None


def test_monitor_state_round_trip_keeps_open_alarms():
    mon = Monitor(MonitorConfig(), total_steps=300, chance={"text": 6.2, "code": 6.2})
    for s in range(1, 150):
        losses = healthy_losses(s)
        losses = {"text": losses["text"], "code": losses["code"]}
        if s > 120:
            losses = {k: v * 2 for k, v in losses.items()}
        mon.check(s, step_metrics(s, losses, {"text": 300, "code": 300}), {})
    # divergence opened at 120, collapse (both back at chance) 20 steps before it fired
    since = mon.earliest_open_alarm_step()
    assert since is not None and 100 <= since <= 120
    other = Monitor(MonitorConfig(), total_steps=300, chance={"text": 6.2, "code": 6.2})
    other.load_state_dict(mon.state_dict())
    assert other.state_dict() == mon.state_dict()
    kept = other.protected_steps([90, 100, 110, 120])
    assert max(s for s in (90, 100, 110) if s <= since - 5) in kept


def test_starvation_fires_when_a_modality_loses_its_share_of_the_tokens():
    d = Stagnation(StagnationConfig())
    fired = []
    for s in range(1, 260):
        code_tokens = 350 if s <= 120 else 100  # a source's content changed: code starved
        m = step_metrics(s, healthy_losses(s), {"text": 300, "code": code_tokens, "image": 400})
        fired += [a for a in d.check(s, m) if a.signal == "starvation"]
    assert [(a.signal, a.modality) for a in fired] == [("starvation", "code")]
    assert 120 < fired[0].step <= 200 and "down from" in fired[0].message


def test_lr_changes_and_the_rollback_cap():
    from functools import partial

    import torch

    from train.schedule import CappedLambdaLR, LrChange, lr_multiplier

    mult = partial(
        lr_multiplier,
        total=200,
        warmup=5,
        schedule="cosine",
        min_lr_ratio=0.1,
        changes=(LrChange(step=100, until=120, scale=100.0),),
    )
    assert mult(99) < 1 and mult(100) == pytest.approx(
        100 * mult.func(100, **{**mult.keywords, "changes": ()})
    )
    assert mult(120) < 1
    with pytest.raises(ValueError, match="until > step"):
        LrChange(step=10, scale=2.0, until=5)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = CappedLambdaLR(opt, mult)
    for _ in range(95):
        opt.step()
        sched.step()
    cap = sched.cap_here(0.5)  # a rollback landed at step 95
    assert cap == pytest.approx(0.5 * mult(95))
    lrs = []
    for _ in range(40):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert max(lrs) <= cap + 1e-12  # the x100 stretch never comes back
    state = sched.state_dict()
    assert state["cap"] == cap and "uncapped" not in state
    other = CappedLambdaLR(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0), mult)
    other.load_state_dict(state)
    assert other.cap == cap


def test_spikes_are_scored_per_modality_against_their_own_history():
    """A bursty corpus: 40 steps of one code file, then the first text and images ever
    (loss 7+ against the code's 2.5) is no spike; every modality doubling at once is."""
    rng = np.random.default_rng(0)
    grad = rng.lognormal(np.log(3.0), 0.3, 100)
    rule = SkipStepRule(SkipStepConfig(min_steps=20))
    for s in range(1, 41):
        code = 2.5 + 4 * math.exp(-s / 10) + rng.normal(0, 0.1)
        assert not rule.decide(s, code, grad[s], {"code": (code, 512.0)})
    first = {"text": (7.4, 109.0), "code": (2.6, 85.0), "image": (8.6, 64.0), "video": (8.4, 189.0)}
    assert not rule.decide(41, 7.2, 6.0, first), rule.last
    for s in range(42, 80):
        noise = rng.normal(0, 0.1, 3)
        parts = {
            "text": (3.0 + noise[0], 200.0),
            "code": (2.5 + noise[1], 200.0),
            "image": (3.5 + noise[2], 100.0),
        }
        assert not rule.decide(s, 2.9, grad[s], parts), (s, rule.last)
    doubled = {"text": (6.0, 200.0), "code": (5.0, 200.0), "image": (7.0, 100.0)}
    assert rule.decide(80, 5.8, grad[80], doubled) and rule.last["loss_score"] > 6
    state = rule.state_dict()
    other = SkipStepRule(SkipStepConfig(min_steps=20))
    other.load_state_dict(state)
    assert other.state_dict() == state


def test_hidden_norm_growth_rate_fires_late_in_a_run_and_once():
    """Norm growth long after the early reference: doubling within 50 steps is drift, one alarm
    (hysteresis); a slow healthy growth is not."""
    from train.monitor.config import DriftConfig
    from train.monitor.detectors import Drift

    d, slow = Drift(DriftConfig()), Drift(DriftConfig())
    fired, quiet = [], []
    for s in range(1, 400):
        hn = 5.0 * (1 + 0.002 * s) * (1.03 ** max(0, s - 300))  # x2 in ~25 steps from 300
        text = {"monitor/logz/text": 7.0, "tokens/text": 400.0}
        fired += d.check(s, {**text, "monitor/hidden_norm/text": hn})
        quiet += slow.check(s, {**text, "monitor/hidden_norm/text": 5.0 * (1 + 0.004 * s)})
    assert quiet == []
    assert len(fired) == 1 and fired[0].signal == "hidden_drift" and 300 < fired[0].step < 360
    assert "steps ago" in fired[0].message and fired[0].advice


def test_hidden_norm_rate_counts_optimizer_steps_and_leaves_the_warmup_out():
    """Code in 40 % of the steps, its norm growing while the lr warms up over 150 steps and
    settling by step 200: healthy; so is a faster growth inside the warmup. Counted in the steps that held it, "50 steps ago" reached 125 steps back,
    into the warmup, and fired ("2.3x 50 steps ago"); a warmup longer than ``min_steps`` made
    the early growth count. The same doubling after the warmup, within 50 steps, still fires;
    a burst of a modality of a token a step (its norm swings by itself) does not."""
    from train.monitor.config import DriftConfig
    from train.monitor.detectors import Drift

    def fired(norm_at, warmup: int, tokens: float = 256.0) -> list[int]:
        drift, out = Drift(DriftConfig(), warmup), []
        for s in range(1, 400):
            metrics = {"monitor/logz/text": 7.0, "monitor/hidden_norm/text": 1.0}
            metrics["tokens/text"] = 400.0
            if s % 5 < 2:  # code in 2 of every 5 steps
                metrics.update({"monitor/logz/code": 7.0, "monitor/hidden_norm/code": norm_at(s)})
                metrics["tokens/code"] = tokens
            out += [a.step for a in drift.check(s, metrics) if a.modality == "code"]
        return out

    # 0.35 -> 0.95 as the lr warms up and settles (as measured: 0.39 at step 60, 0.95 at 217)
    warming = lambda s: 0.35 + 0.6 * (min(s, 200) / 200) ** 2  # noqa: E731
    assert fired(warming, warmup=150) == []
    # growing 3x over steps 60-100, inside the warmup: left out of a 150-step warmup's run, a
    # tripling within 50 steps of a run whose lr had warmed up by step 5
    ramp = lambda s: 0.4 * (1 + 2 * min(max(s - 60, 0), 40) / 40)  # noqa: E731
    assert fired(ramp, warmup=150) == [] and fired(ramp, warmup=5)
    assert fired(lambda s: warming(s) * (1.03 ** max(0, s - 250)), warmup=150)  # x2 in ~25 steps
    burst = lambda s: 3.0 if 200 <= s < 220 else 1.0  # noqa: E731
    assert fired(burst, warmup=5, tokens=1.0) == []
    assert fired(burst, warmup=5, tokens=256.0)  # the same norms over many tokens are judged
