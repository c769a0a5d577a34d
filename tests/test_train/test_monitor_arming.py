"""Rules that must not fire on a healthy run that has not learned what they watch yet, or whose
data is simple from the start (docs/monitors.md, "No alarm for what a run has not learned
yet"): the generated-code rule is judged against the run's own images, the data-code floor is
armed by a window above it, and starvation's reference share survives a resume."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from data.vocab import Modality, VocabLayout
from train.monitor import Monitor, MonitorConfig
from train.monitor.config import CodeUseConfig, StagnationConfig
from train.monitor.detectors import DataCodeUse, Stagnation

LAYOUT = VocabLayout(text_size=512, max_grid=32)


def probe(
    monitor: Monitor, step: int, drawn: float, alike: float, ref: float | None, ref_entropy=0.47
) -> list[str]:
    values = {
        "monitor/gen_code_entropy": drawn,
        "monitor/gen_code_distinct": 7.0,
        "monitor/gen_image_diversity": alike,
    }
    if ref is not None:
        values["monitor/ref_image_diversity"] = ref
        values["monitor/ref_code_entropy"] = ref_entropy
    return [alarm.signal for alarm in monitor._probe_alarms("code_use", step, values)]


def test_generated_codes_are_judged_against_the_runs_own_images():
    chance = {"text": math.log(512), "image": math.log(1000)}
    monitor = Monitor(MonitorConfig(), total_steps=300, chance=chance)
    # 16 flat squares drawn faithfully (the debug preset on colour squares, step 200): 7 codes,
    # an entropy of 0.14, but the squares differ from each other as the data's do.
    assert probe(monitor, 100, drawn=0.14, alike=0.65, ref=0.75) == []
    # No images in the data: nothing to judge the drawings by.
    assert probe(monitor, 200, drawn=0.05, alike=0.05, ref=None) == []
    # Varied images in the data, the model that drew like them draws every image alike from a
    # code or two.
    assert probe(monitor, 300, drawn=0.5, alike=0.7, ref=0.75) == []
    assert probe(monitor, 400, drawn=0.1, alike=0.1, ref=0.75) == ["gen_code_entropy"]


def test_generated_codes_are_not_judged_before_the_model_has_drawn_like_the_data():
    """Probes every 100 steps, as the defaults. The drawings of a small corpus's healthy runs:
    one background code (0.04 / 0.00 against the data's 0.33, at steps 100-300), or the data's
    commonest kind of image (0.29 / 0.08 against 0.19, then 0.42 / 0.17): fired at step 100 as
    a collapse. Near-uniform noise does not arm the rule either. A model that drew like the
    data (the suite's visual-code collapse: 0.51 / 0.64 against 0.47) and then draws alike is
    caught at the next probe."""

    def fired(probes: list[tuple[float, float]], ref: float, ref_entropy: float) -> list[int]:
        monitor, out = Monitor(MonitorConfig(), total_steps=1000), []
        for i, (drawn, alike) in enumerate(probes):
            out += [100 * (i + 1)] * len(
                probe(monitor, 100 * (i + 1), drawn, alike, ref, ref_entropy)
            )
        return out

    assert fired([(0.04, 0.0), (0.06, 0.0), (0.06, 0.0)], ref=0.33, ref_entropy=0.37) == []
    assert fired([(0.29, 0.08), (0.42, 0.17), (0.42, 0.0)], ref=0.19, ref_entropy=0.38) == []
    assert fired([(0.93, 0.9), (0.05, 0.0), (0.06, 0.0)], ref=0.47, ref_entropy=0.47) == []
    assert fired([(0.51, 0.64), (0.14, 0.14), (0.09, 0.0)], ref=0.47, ref_entropy=0.47) == [200]
    # Photos (codes of entropy 0.8): an untrained model's noise passes for them during the lr's
    # warmup and does not arm the rule; drawings like them after it do.
    warm = Monitor(MonitorConfig(), total_steps=1000, warmup_steps=300)
    assert probe(warm, 100, 0.88, 0.9, ref=0.8, ref_entropy=0.8) == []
    assert probe(warm, 200, 0.05, 0.0, ref=0.8, ref_entropy=0.8) == []
    assert probe(warm, 300, 0.7, 0.7, ref=0.8, ref_entropy=0.8) == []
    assert probe(warm, 400, 0.05, 0.0, ref=0.8, ref_entropy=0.8) == ["gen_code_entropy"]
    # A collapse found on the model's own earlier drawings; the arming survives a resume.
    first = Monitor(MonitorConfig(), total_steps=1000)
    probe(first, 100, 0.51, 0.64, ref=0.47)
    resumed = Monitor(MonitorConfig(), total_steps=1000)
    resumed.load_state_dict(first.state_dict())
    assert probe(resumed, 200, 0.14, 0.14, ref=0.47) == ["gen_code_entropy"]


def feed(detector: DataCodeUse, steps: range, entropy) -> list[int]:
    fired = []
    for step in steps:
        value = entropy(step) if callable(entropy) else entropy
        metrics = {"monitor/data_codes/image": 100.0, "monitor/data_code_entropy/image": value}
        fired += [alarm.step for alarm in detector.check(step, metrics)]
    return fired


def test_data_code_rules_fire_on_a_fall_not_on_simple_or_swinging_images():
    assert feed(DataCodeUse(CodeUseConfig()), range(1, 301), 0.35) == []  # simple from the start
    # A few images a window: the window entropy swings (by about +-0.08); its highest swing is no
    # level the data had, and 15 % below it is still inside the swings.
    swinging = DataCodeUse(CodeUseConfig())
    assert feed(swinging, range(1, 401), lambda step: 0.6 + 0.1 * math.sin(step / 10)) == []
    # Images of few codes each (stripes, flat colours): the window entropy swings around 0.25 by
    # more than 15 % of it (0.19-0.31); a trough is no fall (before: fired at 0.20, typically 0.25).
    troughs = DataCodeUse(CodeUseConfig())
    assert feed(troughs, range(1, 401), lambda step: 0.25 + 0.06 * math.sin(step / 25)) == []
    fallen = DataCodeUse(CodeUseConfig())
    assert feed(fallen, range(1, 151), 0.7) == []
    fired = feed(fallen, range(151, 201), 0.3)
    assert len(fired) == 1 and 151 < fired[0] <= 170


def test_images_and_videos_codes_are_judged_apart():
    """A long clip of few codes, rare in the mix (a long-context stage's): one of its rows was a
    third of a pooled window's codes and read as the images' tokenizer having degenerated. Each
    modality against its own windows: the clip is no fall, a real fall is named by its modality."""

    def run(image, video) -> list[tuple[int, str]]:
        detector, fired = DataCodeUse(CodeUseConfig()), []
        for step in range(1, 301):
            metrics = {
                "monitor/data_codes/image": 300.0,
                "monitor/data_code_entropy/image": image(step),
            }
            if video(step) is not None:  # a clip row now and then
                metrics |= {
                    "monitor/data_codes/video": 3500.0,
                    "monitor/data_code_entropy/video": video(step),
                }
            fired += [(a.step, a.modality) for a in detector.check(step, metrics)]
        return fired

    varied = lambda step: 0.55  # noqa: E731
    rare_flat_clip = lambda step: 0.16 if step % 53 == 0 else None  # noqa: E731
    assert run(varied, rare_flat_clip) == []
    fired = run(lambda step: 0.55 if step <= 200 else 0.1, rare_flat_clip)
    assert [m for _, m in fired] == ["image"] and 200 < fired[0][0] <= 220
    fired = run(varied, lambda step: 0.6 if step <= 200 else 0.05)
    assert [m for _, m in fired] == ["video"] and 200 < fired[0][0] <= 220


def test_starvation_reference_share_survives_a_resume():
    cfg = StagnationConfig(window=10, min_steps=10, patience=4)
    first = Stagnation(cfg)
    for step in range(1, 41):
        first.check(
            step, {"loss/text": 3.0, "tokens/text": 500, "loss/code": 3.0, "tokens/code": 500}
        )
    resumed = Stagnation(cfg)
    resumed.load_state_dict(first.state_dict())
    assert resumed.share_best == first.share_best and resumed.share_best["code"] >= 0.45
    fired = []
    for step in range(41, 61):  # code's share falls to 20 %
        metrics = {"loss/text": 3.0, "tokens/text": 800, "loss/code": 3.0, "tokens/code": 200}
        fired += [(alarm.signal, alarm.modality) for alarm in resumed.check(step, metrics)]
    assert fired == [("starvation", "code")]


def image_batch(images: list[list[int]]) -> dict:
    """One row holding ``images`` as image blocks (structure around them, text between)."""
    ids, img, mod = [1], [-1], [int(Modality.TEXT)]
    for number, codes in enumerate(images):
        ids += [LAYOUT.structure_id("<boi>"), *LAYOUT.size_ids(8, len(codes) // 8)]
        ids += [LAYOUT.visual_offset + code for code in codes]
        img += [-1, -1, -1] + [number] * len(codes)
        mod += [int(Modality.STRUCTURE)] * 3 + [int(Modality.IMAGE)] * len(codes)
        ids += [LAYOUT.structure_id("<eoi>"), 7]  # and a text token after the image
        img += [-1, -1]
        mod += [int(Modality.STRUCTURE), int(Modality.TEXT)]
    as_row = {"input_ids": ids, "image_ids": img, "modality": mod}
    return {key: torch.tensor([value]) for key, value in as_row.items()}


def test_reference_code_use_reads_the_codes_of_real_image_blocks():
    from train.monitor.probes import code_entropy, image_codes, reference_code_use

    flat = [[colour] * 64 for colour in (3, 9, 27, 81)] * 8
    varied = [list(range(start, start + 64)) for start in range(0, 320, 10)]
    found = image_codes(image_batch(flat), LAYOUT)
    assert len(found) == 32 and found[0][0].tolist() == [3] * 64 and found[0][1] == (8, 8)
    flat_codes = [codes for codes, _ in found]
    ref_flat = reference_code_use(flat_codes, LAYOUT, per_group=4, want=16)
    varied_codes = [codes for codes, _ in image_codes(image_batch(varied), LAYOUT)]
    ref_varied = reference_code_use(varied_codes, LAYOUT, per_group=4, want=16)
    assert math.isclose(ref_flat["monitor/ref_code_entropy"], math.log(4) / math.log(64))
    assert ref_flat["monitor/ref_image_diversity"] == 1.0  # four colours: four leading codes
    assert ref_varied["monitor/ref_code_entropy"] > 0.85
    same = [codes for codes, _ in image_codes(image_batch([[5] * 64] * 8), LAYOUT)]
    alike = reference_code_use(same, LAYOUT, per_group=4, want=16)
    assert alike == {"monitor/ref_code_entropy": 0.0, "monitor/ref_image_diversity": 0.0}
    assert reference_code_use(flat_codes[:3], LAYOUT, per_group=4, want=16) == {}  # no group
    assert code_entropy(torch.tensor([5] * 16), LAYOUT.num_codes) == 0.0


def long_file_metrics(step: int, code_loss: float, code_files: list[int], stall: bool) -> dict:
    """One step shaped like the debug preset over whole long documents: text and image fall,
    each from a few hundred short documents; code (300 tokens a step) comes from the file under
    way, a new file every 40 steps (``code_files``: the steps a file begins), or, ``stall``,
    from two new short files a step."""
    new_code = 2.0 if stall else float(step in code_files)
    return {
        "loss/text": 5.0 - 0.008 * step,
        "tokens/text": 400.0,
        "data/docs_new/text": 3.0,
        "loss/image": 4.0 - 0.006 * step,
        "tokens/image": 200.0,
        "data/docs_new/image": 3.0,
        "loss/code": code_loss,
        "tokens/code": 300.0,
        "data/docs_new/code": new_code,
    }


def code_losses(stall: bool):
    import numpy as np

    rng = np.random.default_rng(2)
    difficulty = rng.uniform(-1.5, 1.5, 8)  # each long file's, no trend (1.5 to 7.5 nats/token)
    noise = rng.normal(0, 0.2, 301)
    if stall:
        return [4.5 + noise[step] for step in range(301)]
    # the code loss falls too, slower than it varies from file to file
    return [4.5 - 0.004 * step + difficulty[(step - 1) // 40] + noise[step] for step in range(301)]


def code_alarms(detector: Stagnation, stall: bool, steps=range(1, 301)) -> list[int]:
    losses = code_losses(stall)
    fired = []
    for step in steps:
        metrics = long_file_metrics(step, losses[step], list(range(1, 301, 40)), stall)
        fired += [alarm.step for alarm in detector.check(step, metrics) if alarm.modality == "code"]
    return fired


def test_stagnation_does_not_judge_code_that_came_from_a_few_long_files():
    """Whole long files (the debug preset on unsplit code): one file fills 40 steps of code, so
    a window of 50 steps holds 2-3 files and its loss follows their difficulty. Judged as if its
    blocks of steps were independent draws, that reads as code stalling while the others learn;
    with ``min_docs`` documents required per window it is not judged at all."""
    cfg = StagnationConfig()
    assert code_alarms(Stagnation(dataclasses.replace(cfg, min_docs=0)), stall=False)  # as before
    assert code_alarms(Stagnation(cfg), stall=False) == []


def test_stagnation_still_fires_on_code_that_stalls_over_many_documents():
    """Code from two new files a step (a hundred a window), flat while text and images learn: a
    stall, reported; a run resumed from the detector's saved state at step 150 decides the same
    (the documents per window are part of that state)."""
    whole = code_alarms(Stagnation(StagnationConfig()), stall=True)
    assert whole and whole[0] >= StagnationConfig().min_steps
    first = Stagnation(StagnationConfig())
    before = code_alarms(first, stall=True, steps=range(1, 151))
    resumed = Stagnation(StagnationConfig())
    resumed.load_state_dict(first.state_dict())
    assert resumed.documents("code") == 101.0
    assert before + code_alarms(resumed, stall=True, steps=range(151, 301)) == whole


def text_alarms(long_file: bool) -> list[int]:
    """Text that stalls while code and images learn; 400 text tokens a step, of which captions
    and markers of 4 new image and code documents bring 40. ``long_file``: the other 360 come
    from one prose file of 36,000 tokens at a time (the window's text loss follows that file);
    else from 12 new prose documents a step."""
    import numpy as np

    rng, detector, fired, total = np.random.default_rng(3), Stagnation(StagnationConfig()), [], 0.0
    for step in range(1, 301):
        metrics = long_file_metrics(step, 4.5 - 0.004 * step, [], stall=True)
        if long_file:
            total = 0.0 if step % 100 == 1 else total  # a new file every 100 steps
            begun, mass = 4.0 + (step % 100 == 1), (total + 360) ** 2 - total**2 + 4 * 10**2
            total += 360
        else:
            begun, mass = 16.0, 12 * 30**2 + 4 * 10**2
        metrics.update({"loss/text": 5.0 + rng.normal(0, 0.05), "data/docs_new/text": begun})
        metrics["data/docs_mass/text"] = mass
        fired += [alarm.step for alarm in detector.check(step, metrics) if alarm.modality == "text"]
    return fired


def test_stagnation_counts_text_documents_by_their_tokens():
    """Every image and code document brings a text token or two, so a document count says a
    window of text came from hundreds of documents while one long prose file held 90 % of its
    tokens. Counted by their token mass the window holds about one: not judged. The same stall
    over many prose documents is reported."""
    assert text_alarms(long_file=False)
    assert text_alarms(long_file=True) == []


def content_shift_alarms(
    data_shifts: bool, ramp: int = 30, detector: Stagnation | None = None, steps=range(1, 301)
) -> list[int]:
    """Code from two new files a step, learning as text and images do, until its loss rises by
    97 % over the ``ramp`` steps from step 150; ``data_shifts``: the code's unigram CE rises
    30 % with it (the source reached a run of data tables), else it stays flat (the model got
    worse on the same kind of code)."""
    detector, fired = detector or Stagnation(StagnationConfig()), []
    for step in steps:
        rise = min(max(step - 150, 0), ramp) / ramp
        metrics = long_file_metrics(step, (4.0 - 0.005 * step) * (1 + 0.97 * rise), [], stall=True)
        metrics["unigram/code"] = 5.0 * (1 + 0.3 * rise) if data_shifts else 5.0
        metrics["unigram/text"], metrics["unigram/image"] = 6.0, 5.0
        fired += [alarm.step for alarm in detector.check(step, metrics) if alarm.modality == "code"]
    return fired


@pytest.mark.parametrize("ramp", [1, 45, 120])
def test_stagnation_does_not_judge_code_whose_data_changed_difficulty(ramp):
    """A loss that rises with its data's own difficulty (the unigram CE of the tokens) follows
    the data, not the model: no alarm, whether the data moves at once or over 120 steps, and a
    run resumed from the detector's state inside the two windows after the move stays silent.
    The same rise on data of unchanged difficulty is one."""
    assert content_shift_alarms(data_shifts=True, ramp=ramp) == []
    first = Stagnation(StagnationConfig())
    assert content_shift_alarms(True, ramp, first, steps=range(1, 241)) == []
    resumed = Stagnation(StagnationConfig())
    resumed.load_state_dict(first.state_dict())
    assert content_shift_alarms(True, ramp, resumed, steps=range(241, 301)) == []
    assert content_shift_alarms(data_shifts=False, ramp=ramp)


def test_the_attention_logit_rule_states_only_the_halves_that_are_on():
    """Before: with the growth half off (max_growth 0, the default) the alarm read "max logit > 50
    or > 0x the first probe's" and "1.0x its value at the first probe" at that first probe."""
    chance = {"text": math.log(512)}
    values = {"monitor/attn_max_logit": 89.0, "monitor/attn_entropy": 0.5}
    monitor = Monitor(MonitorConfig(), total_steps=300, chance=chance)
    (alarm,) = [
        a for a in monitor._probe_alarms("attention", 100, values) if a.signal == "attn_logit"
    ]
    assert alarm.threshold == "max logit > 50" and alarm.message == "max attention logit 89.0"
    grows = dataclasses.replace(monitor.cfg.attention, max_growth=4.0)
    monitor = Monitor(
        dataclasses.replace(monitor.cfg, attention=grows), total_steps=300, chance=chance
    )
    (alarm,) = [
        a for a in monitor._probe_alarms("attention", 100, values) if a.signal == "attn_logit"
    ]
    assert alarm.threshold == "max logit > 50 or > 4x the first probe's"
    assert alarm.message == "max attention logit 89.0, 1.0x its value at the first probe"


def test_the_dependence_gap_is_armed_by_two_probes_in_a_row():
    """A probe of 8 rows swings by several hundredths of a nat: a healthy run read 0.031, 0.010,
    0.139, -0.062, 0.079, ... every 20 steps, and one reading at 0.139 armed the rule, which
    the next fired. Armed by two readings at arm_gap in a row, it waits for the gap to hold; a
    gap that did and then falls is still caught."""

    def fired(gaps: list[float]) -> list[int]:
        monitor, out = Monitor(MonitorConfig(), total_steps=400), []
        for i, gap in enumerate(gaps):
            step = 20 * (i + 1)
            values = {"monitor/dependence_gap_reverse": gap}
            out += [a.step for a in monitor._probe_alarms("dependence", step, values)]
        return out

    assert fired([0.031, 0.010, 0.139, -0.062, 0.079, 0.076, 0.103, 0.133, 0.109, 0.083]) == []
    assert fired([0.05, 0.15, 0.2, 0.25, 0.01]) == [100]
