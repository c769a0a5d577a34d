"""The detectors and probes on their own: synthetic metric streams and a tiny model."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from train.monitor import Monitor, MonitorConfig
from train.monitor.config import (
    CodeUseConfig,
    CollapseConfig,
    DivergenceConfig,
    DriftConfig,
    RollbackConfig,
    SpikeConfig,
    StagnationConfig,
)
from train.monitor.detectors import Collapse, Divergence, Drift, Stagnation

LN = {"text": math.log(1000), "image": math.log(1000)}


def step_metrics(text: float, image: float | None, n: int = 100) -> dict:
    m = {"loss/text": text, "tokens/text": n}
    if image is not None:
        m.update({"loss/image": image, "tokens/image": n})
    return m


def test_collapse_fires_once_when_a_learned_modality_returns_to_chance():
    d = Collapse(CollapseConfig(window=5, min_steps=0), LN)
    fired = []
    for s in range(1, 60):
        img = 0.5 * LN["image"] if s < 30 else 1.05 * LN["image"]
        fired += d.check(s, step_metrics(0.5 * LN["text"], img))
    assert [(a.signal, a.modality) for a in fired] == [("collapse", "image")]
    assert 30 <= fired[0].step <= 35


def test_collapse_fires_again_after_a_rollback_to_before_it_had_learned():
    """A rollback restores the detector's state of a step when the modality was not learned yet:
    on data still broken it never armed again, and the run trained at chance without an alarm.
    What the model reached before the rollback stays reached (``keep_reached``)."""
    cfg = dataclasses.replace(MonitorConfig(), collapse=CollapseConfig(window=5, min_steps=0))
    mon = Monitor(cfg, total_steps=200, chance=LN)
    early = None
    fired = []
    for s in range(1, 60):
        img = (0.9 if s < 10 else 0.5 if s < 30 else 1.05) * LN["image"]
        fired += mon.check(s, step_metrics(0.5 * LN["text"], img), {})
        early = (
            copy.deepcopy(mon.state_dict()) if s == 8 else early
        )  # the checkpoint rolled back to
    assert [a.signal for a in fired if a.signal == "collapse"] == ["collapse"]
    reached = mon.reached()
    mon.load_state_dict(early)  # the rollback
    mon.keep_reached(reached)
    again = [
        a.signal
        for s in range(9, 40)
        for a in mon.check(s, step_metrics(0.5 * LN["text"], 1.05 * LN["image"]), {})
    ]
    assert again == ["collapse"]


@pytest.mark.parametrize("noise_steps", [15, 60])
def test_collapse_sees_noise_over_a_few_ids_at_its_unigram_ce(noise_steps):
    """Base64 blobs in a code source (a user's corpus): the code loss sits at the unigram CE of
    its tokens (4.7 nats), far below ln V (8.3): the chance rule cannot fire. At its unigram
    for ``unigram_patience`` steps it is a collapse; a stretch of hard files that gets there for
    a few steps is not."""
    detector = Collapse(CollapseConfig(), {"code": math.log(4096)})
    fired = []
    for step in range(1, 201):
        noise = 100 <= step < 100 + noise_steps
        unigram = 4.75 if noise else 8.1
        loss = 0.98 * unigram if noise else (8.0 if step < 40 else 5.0)
        fired += detector.check(
            step, {"loss/code": loss, "tokens/code": 1500, "unigram/code": unigram}
        )
    assert [(alarm.signal, alarm.modality) for alarm in fired] == (
        [("collapse", "code")] if noise_steps == 60 else []
    )
    if fired:
        assert "no better than by its tokens' frequencies" in fired[0].message
        assert 125 < fired[0].step < 160 and fired[0].values["unigram_ratio"] > 0.95


def test_collapse_at_the_unigram_fires_again_after_a_rollback_to_before_it_had_learned():
    """What was reached against the unigram CE before a rollback stays reached, as the chance
    rule's level does: the same noise after it is said again."""
    cfg = dataclasses.replace(MonitorConfig(), collapse=CollapseConfig(min_steps=0))
    monitor = Monitor(cfg, total_steps=300, chance={"code": math.log(4096)})

    def code(step: int, noise: bool) -> dict:
        unigram = 4.75 if noise else 8.1
        loss = 0.98 * unigram if noise else (8.0 if step < 40 else 5.0)
        return {"loss/code": loss, "tokens/code": 1500, "unigram/code": unigram}

    fired, early = [], None
    for step in range(1, 161):
        fired += monitor.check(step, code(step, step >= 100), {})
        early = copy.deepcopy(monitor.state_dict()) if step == 30 else early
    assert [alarm.signal for alarm in fired] == ["collapse"]
    reached = monitor.reached()
    monitor.load_state_dict(early)  # the rollback, to before the code was learned
    monitor.keep_reached(reached)
    again = [alarm.signal for s in range(31, 100) for alarm in monitor.check(s, code(s, True), {})]
    assert again == ["collapse"]


def test_collapse_ignores_a_modality_that_never_learned():
    d = Collapse(CollapseConfig(window=5, min_steps=0), LN)
    assert not any(
        d.check(s, step_metrics(0.5 * LN["text"], 0.99 * LN["image"])) for s in range(1, 60)
    )


def test_collapse_weighs_steps_by_tokens_not_by_step():
    d = Collapse(CollapseConfig(window=2, min_steps=0), LN)
    d.check(1, {"loss/image": 0.0, "tokens/image": 1})
    d.check(2, {"loss/image": LN["image"], "tokens/image": 99})
    m = {}
    d.check(3, m)  # image absent: the window still holds steps 2 and 3
    assert d.win.mean("image") == pytest.approx(LN["image"])


def test_stagnation_needs_the_others_to_improve():
    cfg = StagnationConfig(window=10, min_steps=0, patience=5)
    d, quiet = Stagnation(cfg), Stagnation(cfg)
    fired, calm = [], []
    for s in range(1, 41):
        fired += d.check(s, step_metrics(5.0 - 0.05 * s, 3.0 + 0.01 * s))  # image rises, text falls
        calm += quiet.check(s, step_metrics(3.0, 3.0))  # everything flat
    assert fired and fired[0].modality == "image" and "rose" in fired[0].message
    assert calm == []


def test_divergence_counts_skipped_steps_and_names_the_first():
    d = Divergence(DivergenceConfig(window=10, max_skipped=4))
    out = []
    for s in range(1, 30):
        out += d.check(s, {"optim/skipped": float(s in (12, 14, 15, 16, 17))})
    assert (
        len(out) == 1 and out[0].step == 16 and out[0].since == 12 and out[0].action == "rollback"
    )


def test_drift_fires_on_logz_and_hidden_norm_growth():
    d = Drift(DriftConfig(window=3, min_steps=5, logz_abs=20, hidden_growth=4))
    out = []
    for s in range(1, 40):
        out += d.check(
            s,
            {
                "monitor/logz/text": 5.0 if s < 30 else 25.0,
                "monitor/hidden_norm/text": 1.0 if s < 20 else 5.0,
            },
        )
    assert sorted((a.signal, a.step) for a in out) == [("hidden_drift", 20), ("logz_drift", 30)]


@pytest.mark.parametrize("easier", [0.0, 0.3])
def test_drift_rate_is_not_judged_across_data_of_another_difficulty(easier):
    """A stretch of repetitive files (unigram CE 30 % lower: a user's small code corpus) raised
    the code's final hidden norm from ~2 to ~6 and fired the rate rule on a healthy run; the
    same growth on data of the same difficulty is norm growth and fires."""
    detector = Drift(DriftConfig())
    fired = []
    for step in range(1, 181):
        stretch = 140 <= step < 160  # the rate is judged from step 119 (min_steps 50)
        fired += detector.check(
            step,
            {
                "monitor/logz/code": 0.0,
                "monitor/hidden_norm/code": 6.0 if stretch else 2.0,
                "tokens/code": 1500,
                "unigram/code": 6.5 * (1 - easier) if stretch else 6.5,
            },
        )
    assert [(alarm.signal, alarm.step) for alarm in fired] == (
        [] if easier else [("hidden_drift", 150)]
    )


def test_monitor_turns_gate_decisions_into_alarms_and_keeps_state():
    mon = Monitor(MonitorConfig(), total_steps=100, chance=LN)
    m = {"train/loss": float("nan"), "optim/grad_norm": float("nan"), "optim/skipped": 1.0}
    a = mon.check(
        3,
        m,
        {"loss_score": math.inf, "grad_norm_score": math.inf, "skipped": True, "nonfinite": True},
    )
    assert [(x.signal, x.action) for x in a] == [("nonfinite", "skip")] and m[
        "monitor/nonfinite_steps"
    ] == 1
    assert not mon.healthy()
    st = mon.state_dict()
    other = Monitor(MonitorConfig(), total_steps=100, chance=LN)
    other.load_state_dict(st)
    assert other.state_dict() == st and other.nonfinite_steps == 1


def test_with_the_monitors_off_an_update_the_gate_drops_is_still_said():
    """monitor.enabled=false turned the alarms off but not the skip-step gate (optim.skip_step):
    updates were dropped without a word."""
    mon = Monitor(MonitorConfig(enabled=False), total_steps=100, chance=LN)
    last = {"loss_score": 9.0, "grad_norm_score": 1.0, "skipped": True, "loss_spike": True}
    assert [a.signal for a in mon.check(70, {"train/loss": 5.0}, last)] == ["loss_spike"]
    quiet = {**step_metrics(LN["text"], LN["image"]), "train/loss": 5.0}
    assert mon.check(71, quiet, {"skipped": False}) == []
    # said, and nothing more done: a spike action of halt does not halt a run without monitors
    off = Monitor(
        MonitorConfig(enabled=False, spike=SpikeConfig(action="halt")), total_steps=100, chance=LN
    )
    assert [a.action for a in off.check(70, {"train/loss": 5.0}, last)] == ["skip"]


def test_a_spike_is_named_by_the_bar_it_crossed_not_by_the_larger_score():
    """The loss's bar is 6 sigma, the grad norm's 12: a step at loss 7 and grad norm 9 sigma was
    skipped for its loss, and is a ``loss_spike`` (it was named ``grad_norm_spike``)."""
    import numpy as np

    from train.skip_step import SkipStepConfig, SkipStepRule

    rule, rng = SkipStepRule(SkipStepConfig(min_steps=10)), np.random.default_rng(0)
    for step in range(1, 81):
        rule.decide(step, 3.0 + rng.normal(0, 0.05), math.exp(rng.normal(0, 0.05)))

    def at_score(score, target: float, low: float, high: float) -> float:
        for _ in range(60):  # bisection: the score rises with the value
            low, high = (
                (low, (low + high) / 2)
                if score((low + high) / 2) > target
                else ((low + high) / 2, high)
            )
        return (low + high) / 2

    loss = at_score(lambda x: rule.loss_score(x, {}), 7.0, 3.0, 30.0)
    grad = at_score(rule.grad_norm.score, 9.0, 1.0, 100.0)
    assert rule.decide(81, loss, grad)
    assert rule.last["loss_score"] < rule.last["grad_norm_score"] < rule.cfg.grad_norm_sigmas
    mon = Monitor(MonitorConfig(), total_steps=100, chance=LN)
    alarms = mon.check(81, {"train/loss": loss, "optim/grad_norm": grad}, rule.last)
    assert [(a.signal, a.action) for a in alarms] == [("loss_spike", "skip")]


@pytest.mark.parametrize(
    "section",
    ["collapse", "stagnation", "drift", "attention", "dependence", "code_use", "divergence"],
)
def test_skip_is_refused_for_detectors_that_run_after_the_update(section):
    cfg = MonitorConfig()
    getattr(cfg, section).action = "skip"
    with pytest.raises(ValueError, match=f"monitor.{section}.action=skip"):
        cfg.__post_init__()
    SpikeConfig(action="skip").validate("spike")


@pytest.mark.parametrize(
    "section, key, value, need",
    [
        ("divergence", "window", -5, "1 or more"),  # was a traceback when the deque was made
        ("stagnation", "block_steps", 0, "1 or more"),  # was a crash at step 50
        ("collapse", "threshold", -1.0, "a number above 0"),
        ("code_use", "min_entropy", 1.5, "a share between 0 and 1"),
        ("attention", "every", -10, "0 or more"),
        ("rollback", "lr_scale", -1.0, "a number above 0"),  # ran with a negative lr cap
        ("rollback", "max_rollbacks", -1, "0 or more"),
    ],
)
def test_monitor_values_out_of_range_are_named(section, key, value, need):
    sections = {"rollback": RollbackConfig, "code_use": CodeUseConfig}
    kind = sections.get(section) or type(getattr(MonitorConfig(), section))
    with pytest.raises(ValueError, match=rf"^monitor\.{section}\.{key} {value}: give {need}$"):
        MonitorConfig(**{section: kind(**{key: value})})
    MonitorConfig(stagnation=StagnationConfig(min_drop=-0.1))  # a signed one may be below 0


def test_unknown_action_is_named():
    with pytest.raises(ValueError, match="monitor.collapse.action 'explode'"):
        MonitorConfig(collapse=CollapseConfig(action="explode"))


def _batch(ids):
    z = torch.zeros_like(ids)
    T = ids.shape[1]
    return {
        "input_ids": ids,
        "labels": ids,
        "modality": z,
        "label_modality": z,
        "doc_ids": z,
        "position_ids": torch.arange(T).expand_as(ids),
        "position_thw": torch.arange(T)[None, :, None].expand(ids.shape[0], T, 3).contiguous(),
        "image_ids": torch.full_like(ids, -1),
    }


def test_attention_probe_scores_are_the_ones_the_model_used():
    """softmax(recomputed scores) @ v must equal the attention output the model computed."""
    from model.presets import preset
    from train.monitor.probes import _AttentionTap, attention_stats

    torch.manual_seed(0)
    model = preset("debug").build().eval()
    ids = torch.randint(0, 200, (2, 12))
    attn = model.layers[1].attention
    tap, seen = _AttentionTap(attn), {}
    h1 = attn.wv.register_forward_hook(lambda m, a, o: seen.__setitem__("v", o))
    h2 = attn.wo.register_forward_pre_hook(lambda m, a: seen.__setitem__("out", a[0]))
    with torch.no_grad():
        model(ids)
    for h in (h1, h2):
        h.remove()
    tap.remove()
    q, k = tap.qk()
    B, T = ids.shape
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    v = seen["v"].view(B, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    v = v.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1)
    torch.testing.assert_close(out, seen["out"], atol=1e-5, rtol=1e-4)

    stats = attention_stats(model, _batch(ids), torch.device("cpu"))
    assert stats["monitor/attn_max_logit/L1"] == pytest.approx(float(scores.amax()), rel=1e-5)
    p = scores.softmax(-1)
    ent = float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean())
    assert stats["monitor/attn_entropy/L1"] == pytest.approx(ent, rel=1e-5)
    assert stats["monitor/attn_max_logit"] == max(
        stats["monitor/attn_max_logit/L0"], stats["monitor/attn_max_logit/L1"]
    )


def test_attention_probe_masks_local_layers_with_their_window():
    """Local/global attention: the probe scores a local layer under its window (4 keys)."""
    from model.presets import preset
    from train.monitor.probes import _AttentionTap, attention_stats

    torch.manual_seed(0)
    cfg = preset("debug")
    cfg = dataclasses.replace(
        cfg,
        attention=dataclasses.replace(cfg.attention, local_window=4, global_every=2),
        rope=dataclasses.replace(cfg.rope, local_theta=100.0),
    )
    model = cfg.build().eval()
    assert model.blocks()[0].local and not model.blocks()[1].local
    ids = torch.randint(0, 200, (2, 12))
    tap = _AttentionTap(model.layers[0].attention)
    with torch.no_grad():
        model(ids)
    tap.remove()
    q, k = tap.qk()
    T = ids.shape[1]
    offsets = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    window = (offsets >= 0) & (offsets < 4)
    scores = ((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])).masked_fill(~window, -math.inf)
    p = scores.softmax(-1)
    ent = float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean())
    stats = attention_stats(model, _batch(ids), torch.device("cpu"))
    assert stats["monitor/attn_entropy/L0"] == pytest.approx(ent, rel=1e-5)
    assert ent < math.log(4) + 1e-6  # at most 4 keys: no more than ln 4 nats


def test_divergence_fires_when_the_loss_stays_high_after_a_spike():
    d = Divergence(DivergenceConfig(window=10, max_skipped=4, max_rise=0.2))
    out = []
    for s in range(1, 60):
        loss = (
            5.0 if s < 30 else (20.0 if s == 30 else 7.0)
        )  # one skipped spike, then stuck 40% higher
        out += d.check(s, {"optim/skipped": float(s == 30), "train/loss": loss})
    assert len(out) == 1 and out[0].since == 30 and out[0].step == 40 and "stayed" in out[0].message


def test_divergence_stays_quiet_when_the_run_recovers_by_itself():
    d = Divergence(DivergenceConfig(window=10, max_skipped=4, max_rise=0.2))
    out = []
    for s in range(1, 60):
        out += d.check(
            s, {"optim/skipped": float(s in (30, 31)), "train/loss": 30.0 if s in (30, 31) else 5.0}
        )
    assert out == [] and d.watch is None


def test_shuffle_swaps_codes_only_between_blocks_of_the_same_shape():
    import numpy as np

    from data.layout import image_tokens
    from data.vocab import VocabLayout
    from train.monitor.probes import shuffle_images

    lay = VocabLayout(text_size=100, max_grid=8)
    rows, blocks = [], []
    for r, (h, w, c) in enumerate([(2, 2, 1), (2, 2, 2), (2, 3, 3), (2, 2, 4)]):
        ids, _ = image_tokens(np.full((h, w), c), lay)
        row = np.concatenate([[1], ids, [5, 6, 2]])
        rows.append(np.pad(row, (0, 24 - len(row))))
        codes = np.flatnonzero(row >= lay.visual_offset)
        blocks.append((r, int(codes[0]), int(codes[-1]) + 1))
    ids = torch.tensor(np.stack(rows))
    out, swapped = shuffle_images(ids, blocks, lay)
    assert swapped == 3
    assert torch.equal(out[2], ids[2])  # 2x3: no partner, untouched
    assert torch.equal(out != ids, (ids >= lay.visual_offset) & (torch.arange(4) != 2)[:, None])
    assert sorted(int(out[r][out[r] >= lay.visual_offset][0]) for r in (0, 1, 3)) == sorted(
        int(ids[r][ids[r] >= lay.visual_offset][0]) for r in (0, 1, 3)
    )


def test_stagnation_waits_for_patience_and_ignores_structure():
    """One outlier step keeps a 10-step window high for 10 steps; patience 12 outlasts it. A flat
    structure loss is never a stall."""
    d = Stagnation(StagnationConfig(window=10, min_steps=0, patience=12))
    fired = []
    for s in range(1, 61):
        m = step_metrics(5.0 - 0.05 * s, 3.0 - 0.01 * s + (2.0 if s == 30 else 0.0))
        m.update({"loss/structure": 3.0, "tokens/structure": 100})
        fired += d.check(s, m)
    assert fired == []


def test_attention_probe_works_without_qk_norm():
    """A model without QK-norm crashed at its first probe (KeyError 'q'). Without the
    norms the projections' outputs are q and k; the recomputed attention must still be the
    layer's own."""
    import dataclasses

    from model.presets import preset
    from train.monitor.probes import _AttentionTap, attention_stats

    torch.manual_seed(0)
    cfg = preset("debug")
    cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, qk_norm=False))
    model = cfg.build().eval()
    assert not hasattr(model.layers[0].attention, "q_norm")
    ids = torch.randint(0, 200, (2, 12))
    attn = model.layers[0].attention
    tap, seen = _AttentionTap(attn), {}
    h1 = attn.wv.register_forward_hook(lambda m, a, o: seen.__setitem__("v", o))
    h2 = attn.wo.register_forward_pre_hook(lambda m, a: seen.__setitem__("out", a[0]))
    with torch.no_grad():
        model(ids)
    for h in (h1, h2):
        h.remove()
    tap.remove()
    q, k = tap.qk()
    B, T = ids.shape
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    v = seen["v"].view(B, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    v = v.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1)
    torch.testing.assert_close(out, seen["out"], atol=1e-5, rtol=1e-4)
    stats = attention_stats(model, _batch(ids), torch.device("cpu"))
    assert stats["monitor/attn_max_logit/L0"] == pytest.approx(float(scores.amax()), rel=1e-5)


def _caption_first_rows(lay, captions, grids):
    """Rows ``<bos> caption <boi> size codes... <eoi> <eos>`` with real modalities, labels and ids
    as the packer makes them (one document per row)."""
    import numpy as np

    from data.layout import image_tokens
    from data.vocab import Modality

    rows, mods = [], []
    for cap, grid in zip(captions, grids):
        img, img_mod = image_tokens(grid, lay)
        ids = np.concatenate([[1], cap, img, [2]])
        mod = np.concatenate([[0], np.full(len(cap), int(Modality.TEXT)), img_mod, [0]])
        rows.append(ids)
        mods.append(mod)
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mod = torch.zeros(len(rows), T, dtype=torch.long)
    image_ids = torch.full((len(rows), T), -1, dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, mods)):
        ids[i, : len(r)] = torch.tensor(r)
        mod[i, : len(m)] = torch.tensor(m)
        image_ids[i, : len(m)] = torch.where(torch.tensor(m) == int(Modality.IMAGE), 0, -1)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    label_mod = torch.zeros_like(mod)
    label_mod[:, :-1] = mod[:, 1:]
    return {
        "input_ids": ids,
        "labels": labels,
        "modality": mod,
        "label_modality": label_mod,
        "doc_ids": torch.zeros_like(ids),
        "position_ids": torch.arange(T).expand_as(ids),
        "position_thw": torch.arange(T)[None, :, None].expand(len(rows), T, 3).contiguous(),
        "image_ids": image_ids,
    }


def test_reverse_probe_finds_captions_before_images_and_swaps_same_length_ones():
    import numpy as np

    from data.vocab import Modality, VocabLayout
    from train.monitor.probes import image_after_caption_rows, swap_images_after_captions

    lay = VocabLayout(text_size=100, max_grid=8)
    caps = [[10, 11, 12], [20, 21, 22], [30, 31], [40, 41, 42]]
    grids = [np.full((2, 2), 1), np.full((2, 2), 2), np.full((2, 2), 3), np.full((2, 3), 4)]
    batch = _caption_first_rows(lay, caps, grids)
    keep, pairs = image_after_caption_rows(batch, lay)
    # the caption run starts after <bos> (a text token, the same in every row)
    assert [(r, a, b) for r, a, b, _, _ in pairs] == [(0, 1, 4), (1, 1, 4), (2, 1, 3), (3, 1, 4)]
    # an image that opens its document (only <bos> before it) has no caption before it
    lone = _caption_first_rows(lay, [[]], [np.full((2, 2), 1)])
    assert image_after_caption_rows(lone, lay)[1] == []
    kept = keep != -100  # only image codes are scored
    assert kept.any() and bool((batch["label_modality"][kept] == int(Modality.IMAGE)).all())
    ids = batch["input_ids"]
    out, out_labels, swapped = swap_images_after_captions(ids, keep, pairs)
    assert swapped == 3  # rows 0-2: 2x2 images, captions of any length; row 3 is 2x3
    (_, _, b0, _, e0), (_, _, b1, _, e1), (_, _, b2, _, e2) = pairs[:3]
    assert torch.equal(out[0, b0:e0], ids[1, b1:e1]) and torch.equal(out[2, b2:e2], ids[0, b0:e0])
    assert torch.equal(out_labels[0, b0:e0], keep[1, b1:e1])  # the code labels move with them
    for row, (_, _, block_start, _, _) in enumerate(pairs):
        assert torch.equal(out[row, :block_start], ids[row, :block_start])  # captions stay
    assert torch.equal(out[3], ids[3]) and torch.equal(out_labels[3], keep[3])
    assert int((out_labels != -100).sum()) == int((keep != -100).sum())


def test_reverse_gap_is_positive_for_a_model_that_reads_the_caption():
    """A model trained for a few steps on caption -> image pairs where the caption names the
    image's only code scores the codes better after their own caption."""
    import numpy as np

    from data.vocab import VocabLayout
    from model.presets import preset
    from train.monitor.probes import reverse_dependence_gap

    lay = VocabLayout(text_size=64, max_grid=8)
    torch.manual_seed(0)
    model = preset("debug", lay).build()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)

    def batch(n):
        colour = rng.integers(0, 8, n)
        caps = [[10 + int(c), 30] for c in colour]
        grids = [np.full((2, 2), int(c) * 7) for c in colour]
        return _caption_first_rows(lay, caps, grids)

    for _ in range(150):
        b = batch(16)
        loss = model(**{k: b[k] for k in b}).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    out = reverse_dependence_gap(model, batch(16), lay, torch.device("cpu"))
    assert out["monitor/dependence_gap_reverse"] > 0.5, out
    assert out["monitor/image_loss_shuffled"] > out["monitor/image_loss_matched"]


def test_stagnation_errors_count_a_documents_chunks_as_one_draw():
    """A long document's row-sized chunks reach the model over neighbouring steps, so a hard or
    easy file moves several steps' loss together (the demo's code: 512 tokens a step, one chunk
    of one file). With no trend in the modality that must not read as a rise: the standard
    errors treat ``block_steps`` consecutive steps as one draw. A real rise still fires."""
    import numpy as np

    rng = np.random.default_rng(3)
    difficulty = rng.uniform(-1.0, 1.0, 40)  # each file's, no trend

    def alarms(block: int, spread: float, rise: float) -> list:
        per_step = 4.5 + spread * np.repeat(difficulty, 6)[:200] + rng.normal(0, 0.2, 200)
        detector = Stagnation(StagnationConfig(min_steps=0, block_steps=block))
        fired = []
        for step in range(1, 201):
            code = per_step[step - 1] * (1 + rise * max(0, step - 100) / 100)
            fired += detector.check(step, step_metrics(5.0 - 0.01 * step, code))
        return [alarm for alarm in fired if alarm.modality == "image"]

    assert alarms(1, 3.0, 0.0)  # files of 1.5-7.5 nats, as if every step were a fresh draw
    assert alarms(StagnationConfig().block_steps, 3.0, 0.0) == []
    assert alarms(StagnationConfig().block_steps, 0.5, 1.0)  # the loss doubles in 100 steps


def _stalled_image_run(detector, *, image_heldout, steps: int = 60, every: int = 20) -> list:
    """The image training loss rises from step 1 while text falls (the rule fires at step 24 on
    the training losses); every ``every`` steps an evaluation logs ``val/loss/text`` (falling
    1 % a step) and ``val/loss/image`` (``image_heldout(step)``)."""
    fired = []
    for step in range(1, steps + 1):
        metrics = step_metrics(5.0 - 0.05 * step, 3.0 + 0.01 * step)
        if step % every == 0:
            metrics.update(
                {"val/loss/text": 5.0 * 0.99**step, "val/loss/image": image_heldout(step)}
            )
        fired += detector.check(step, metrics)
    return fired


def test_stagnation_waits_for_the_held_out_losses_and_raises_only_a_stall_they_confirm():
    """In a run that evaluates held-out data the training losses' alarm waits for the next
    evaluation: raised when the modality's held-out loss stalls behind the others' too, logged
    (not raised) when it falls: the training loss followed its files, or the others' fall was a
    source learnt by heart. With no evaluation before the trouble, the first after it is the
    reference."""
    cfg = StagnationConfig(window=10, min_steps=0, patience=5)
    now = _stalled_image_run(Stagnation(cfg), image_heldout=lambda s: 3.0)
    assert [(a.step, a.action) for a in now] == [(24, "warn")]  # no held-out data: as it was
    assert "train.eval_every > 0" in now[0].advice

    stalled = _stalled_image_run(Stagnation(cfg, heldout_every=20), image_heldout=lambda s: 3.0)
    # the trouble began at 9 (24 - window - patience), before any evaluation: the first after
    # it (20) is the reference and 40 judges: image flat, text down 18 %
    assert [(a.step, a.action, a.since) for a in stalled] == [(40, "warn", 9)]
    assert "val/loss/image +0.0% from step 20 to 40" in stalled[0].message
    assert stalled[0].values["heldout_others_change"] == pytest.approx(0.99**20 - 1)
    assert "confirm" in stalled[0].cause and "raise its weight" in stalled[0].advice

    learning = _stalled_image_run(
        Stagnation(cfg, heldout_every=20), image_heldout=lambda s: 3.0 * 0.995**s
    )
    assert [(a.step, a.action) for a in learning] == [(40, "log")]
    assert learning[0].message.startswith("not raised: image loss rose")
    assert "-9.5% from step 20 to 40" in learning[0].message


def test_stagnation_judges_a_waiting_alarm_at_the_end_and_keeps_it_across_a_resume():
    """An evaluation before the trouble is the reference; the run's last evaluation (final.json,
    ``finish``) judges what still waits, and a resume in between carries the waiting alarm. An
    alarm raised at an evaluation's step is judged on it at once."""
    cfg = StagnationConfig(window=10, min_steps=0, patience=5)
    first = Stagnation(cfg, heldout_every=7)
    fired = _stalled_image_run(first, image_heldout=lambda s: 3.0, steps=27, every=7)
    assert fired == [] and first.pending["image"]["base"][0] == 7  # the trouble began at 9
    resumed = Stagnation(cfg, heldout_every=7)
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    final = {"val/loss/text": 4.0, "val/loss/image": 3.0}
    (alarm,) = resumed.finish(27, final)
    assert (alarm.step, alarm.action, alarm.values["heldout_from"]) == (27, "warn", 7)

    now = _stalled_image_run(
        Stagnation(cfg, heldout_every=8), image_heldout=lambda s: 3.0, steps=24, every=8
    )
    assert [(a.step, a.action, a.values["heldout_from"]) for a in now] == [(24, "warn", 8)]

    # No evaluation between the reference and the end (the last one is the reference, or the
    # data ended on an evaluation's step and final.json repeats it): raised as found
    for every, final in ((100, {"val/loss/text": 4.0, "val/loss/image": 3.0}), (26, {})):
        late = Stagnation(cfg, heldout_every=every)
        fired = _stalled_image_run(late, image_heldout=lambda s: 3.0, steps=26, every=every)
        assert fired == []
        again = {"val/loss/text": 5.0 * 0.99**26, "val/loss/image": 3.0} if every == 26 else final
        (alarm,) = late.finish(26, again)
        assert alarm.action == "warn" and "no held-out evaluation came" in alarm.advice


def test_stagnation_not_confirmed_is_judged_again_while_it_lasts():
    """Held-out image loss falling at first (logged, not raised), then flat while the training
    losses still say it stalls: raised at the first evaluation that shows it, once."""
    cfg = StagnationConfig(window=10, min_steps=0, patience=5)
    fired = _stalled_image_run(
        Stagnation(cfg, heldout_every=20),
        image_heldout=lambda s: 3.0 * 0.99 ** min(s, 40),
        steps=120,
    )
    assert [(a.step, a.action) for a in fired] == [(40, "log"), (60, "warn")]
    assert fired[1].values["heldout_from"] == 40


def test_monitor_keeps_waiting_alarms_over_a_mix_change_and_says_them_before_going_back():
    """A waiting alarm stays through a change of the mix (the held-out data is the same), is said when the run rolls back or halts over the
    steps it waited in, and a halt judged at the run's end is said as a warning."""
    cfg = MonitorConfig(stagnation=StagnationConfig(window=10, min_steps=0, patience=5))
    monitor = Monitor(cfg, total_steps=100, chance=LN, heldout_every=20)
    stagnation = monitor.detectors["stagnation"]
    fired = _stalled_image_run(stagnation, image_heldout=lambda s: 3.0, steps=30)
    assert fired == []
    monitor.restart_data_references()
    assert list(monitor.detectors["stagnation"].pending) == ["image"]
    (alarm,) = monitor.flush(30, "the run goes back")
    assert alarm.action == "warn" and "the run goes back" in alarm.advice
    assert monitor.detectors["stagnation"].pending == {}

    halting = MonitorConfig(
        stagnation=StagnationConfig(window=10, min_steps=0, patience=5, action="halt")
    )
    monitor = Monitor(halting, total_steps=30, chance=LN, heldout_every=20)
    _stalled_image_run(monitor.detectors["stagnation"], image_heldout=lambda s: 3.0, steps=30)
    (alarm,) = monitor.finish(30, {"val/loss/text": 1.0, "val/loss/image": 3.0})
    assert alarm.action == "warn" and alarm.values["heldout_from"] == 20


def test_stagnation_waits_from_its_newest_reference():
    """Evaluations of other documents move the reference on; the alarm waits for one that can
    judge it, counting from that reference, instead of being raised at step 2 x eval_every after
    it was found as if no evaluation had come."""
    cfg = StagnationConfig(window=10, min_steps=0, patience=5)
    detector = Stagnation(cfg, heldout_every=20)
    fired = []
    for step in range(1, 101):
        metrics = step_metrics(5.0 - 0.05 * step, 3.0 + 0.01 * step)
        if step % 20 == 0:
            batches = {20: 8.0, 40: 16.0}.get(step, 32.0)  # two resumes that changed the cap
            capped = {"val/complete": 0.0, "val/batches": batches}
            metrics.update({"val/loss/text": 5.0 * 0.99**step, "val/loss/image": 3.0, **capped})
        fired += detector.check(step, metrics)
    assert [(a.step, a.action, a.values["heldout_from"]) for a in fired] == [(80, "warn", 60)]


def test_drift_keeps_an_open_alarm_open_while_the_data_differs():
    """Norm growth that goes on through a stretch of easier data is one alarm, not two."""
    detector = Drift(DriftConfig())
    fired = []
    for step in range(1, 226):  # the norm x2 in 45 steps: the rate fires, not the x8 rule
        fired += detector.check(
            step,
            {
                "monitor/logz/code": 0.0,
                "monitor/hidden_norm/code": 2.0 * 1.016 ** max(0, step - 100),
                "tokens/code": 1500,
                "unigram/code": 4.5 if 180 <= step < 200 else 6.5,
            },
        )
    assert [alarm.signal for alarm in fired] == ["hidden_drift"]


def test_stagnation_compares_only_evaluations_of_the_same_documents():
    """A resume that changes train.eval_batches (or the world size) under a capped held-out
    pass reads other documents: that evaluation becomes the reference, the next one judges."""
    cfg = StagnationConfig(window=10, min_steps=0, patience=5)
    detector = Stagnation(cfg, heldout_every=20)
    fired = []
    for step in range(1, 61):
        metrics = step_metrics(5.0 - 0.05 * step, 3.0 + 0.01 * step)
        if step % 20 == 0:
            capped = {"val/complete": 0.0, "val/batches": 8.0 if step < 40 else 16.0}
            image = 3.0 if step < 40 else 2.0  # another share of the documents: another level
            metrics.update({"val/loss/text": 5.0 * 0.99**step, "val/loss/image": image, **capped})
        fired += detector.check(step, metrics)
    assert [(a.step, a.action, a.values["heldout_from"]) for a in fired] == [(60, "warn", 40)]
