"""The monitors on the debug model, with faults injected: each run is real
(DeepSpeed on CPU, real token shards) and each fault is one option of the test-only fault
callback (``train/callbacks/faults.py``, through tests/train_with_faults.py)."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from trainrun import metrics, train

from train.callbacks.run_info import code_commit

SOURCES = {"scenes": 0.3, "clips": 0.2, "text": 0.3, "code": 0.2}
PROBES = ["monitor.attention.every=25", "monitor.dependence.every=25", "monitor.code_use.every=25"]


def base(tokens, run_dir, steps, *extra, sources=None, colours=None):
    srcs = [
        f"{{name: {s}, shards: [{tokens / s}], weight: {w}}}"
        for s, w in (sources or SOURCES).items()
    ]
    if colours is not None:
        srcs.append(f"{{name: colours, shards: [{colours / 'captions'}], weight: 0.5}}")
    return [
        "experiment=debug",
        f"data.sources=[{','.join(srcs)}]",
        f"run_dir={run_dir}",
        f"train.steps={steps}",
        "train.log_every=25",
        "train.micro_batch=2",
        *extra,
    ]


def alarms(run_dir) -> list[dict]:
    p = run_dir / "alarms.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.is_file() else []


def test_healthy_run_raises_no_alarm(tiny_tokens, colour_tokens, tmp_path):
    run = tmp_path / "run"
    train(base(tiny_tokens, run, 150, *PROBES, colours=colour_tokens))
    assert alarms(run) == [], alarms(run)
    m = metrics(run)
    for key in (
        "monitor/attn_max_logit",
        "monitor/attn_entropy",
        "monitor/dependence_gap",
        "monitor/gen_code_entropy",
        "monitor/gen_image_diversity",
        "monitor/ref_image_diversity",  # the run's own images, the drawings' yardstick
    ):
        assert key in m[150] and key in m[25], key
    assert "monitor/loss_spike_score" in m[1] and "monitor/norm_ce_window/text" in m[150]


def test_random_image_codes_fire_the_collapse_detector(tiny_tokens, tmp_path):
    run, k = tmp_path / "run", 80
    train(
        base(tiny_tokens, run, k + 40, "optim.skip_step.enabled=false"),
        faults={"random_image_codes_from": k},
    )
    fired = [a for a in alarms(run) if a["signal"] == "collapse"]
    assert fired and fired[0]["modality"] == "image", alarms(run)
    assert k < fired[0]["step"] <= k + 30
    assert all(a["step"] > k for a in alarms(run))  # nothing before the fault


def test_lr_spike_is_skipped_then_rolled_back_and_recovers(tiny_tokens, tmp_path):
    """An lr blow-up at step 60; the run is preempted (SIGTERM) while its steps are skipped as
    spikes and resumed by the same command: it rolls back to step 50 and recovers. keep-last=2
    would have deleted step 50 at the stop's save (60 and the stop's step kept): every save,
    the stop's too, keeps the way back from a trouble still open."""
    run, k = tmp_path / "run", 60
    args = base(
        tiny_tokens,
        run,
        120,
        "train.ckpt_every=10",
        "train.keep_last=2",
        # The first spiking step is min_steps itself: gated from that very step on.
        f"optim.skip_step.min_steps={k + 1}",
        "optim.schedule=constant",
        # Chunks of 64 tokens: every 2-row step carries the mix, so the loss of a healthy step
        # varies little and the fault's spike stands out by the 6-sigma rule.
        "data.mix_chunk=64",
    )
    p = train(args, faults={"lr_x100_at": k, "sigterm_at_step": k + 2})  # spikes from k + 1
    assert "stopped by SIGTERM at step" in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]
    assert [a for a in alarms(run) if a["action"] == "skip"], alarms(run)  # stopped mid-trouble
    assert (run / "checkpoints" / "step_00000050").is_dir()  # the way back, kept
    # The same command: resumes, the lr still x100, rolls back to 50; killed at step 55, before
    # any checkpoint holds the rollback (its skipped data, the lr cap, the count) ...
    killed = train(args, faults={"lr_x100_at": k, "kill_after_rollback_at": 55}, check=False)
    assert killed.returncode == -9 and "ROLLBACK at step" in killed.stdout, killed.stderr[-3000:]
    assert (run / "checkpoints" / "rollback.json").is_file()
    # ... and again: the rollback is carried out again from step 50 (it replayed the blow-up,
    # rolled back a second time, "rollback 1 of at most 3" once more, each alarm twice)
    p = train(args, faults={"lr_x100_at": k})
    assert "was not yet in a checkpoint when the run stopped: carried out again" in p.stdout, (
        p.stdout[-3000:]
    )
    assert "lr capped at" in p.stdout and "ROLLBACK at step" not in p.stdout
    assert not (run / "checkpoints" / "rollback.json").exists()  # held by step 60's checkpoint
    a = alarms(run)
    assert len([x for x in a if x["action"] == "rollback"]) == 1, a
    spikes = [x for x in a if x["signal"] in ("loss_spike", "grad_norm_spike")]
    rollback = [x for x in a if x["signal"] == "divergence"]
    assert spikes and spikes[0]["action"] == "skip" and spikes[0]["step"] == k + 1, a
    assert rollback and rollback[0]["action"] == "rollback", a
    assert "back to the checkpoint of step 50" in killed.stdout, killed.stdout[-3000:]
    assert "train.ckpt_every=0" not in p.stdout + p.stderr
    # Each start is recorded with the arguments that made it: the same command, three times
    starts = [json.loads(x) for x in (run / "launches.jsonl").read_text().splitlines()]
    assert [s["step"] for s in starts] == [0, k + 3, 50], starts  # SIGTERM: after its next step
    assert starts[0]["arguments"] == starts[1]["arguments"], starts
    assert starts[0]["arguments"].startswith(shlex.join(args)), starts
    assert starts[0]["world_size"] == 1 and starts[0]["torch"] == torch.__version__, starts
    assert starts[0]["commit"] == code_commit()[0], starts  # the checkout's (tests/test_train/...)
    # The steps after 50 were trained again, under the config of the pass (the report's targets)
    kept = sorted(f.name for f in (run / "pass_configs").iterdir())
    assert kept[0] == "from_step_00000000.yaml" and kept[-1] == "from_step_00000050.yaml", kept
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    before = [r["train/loss"] for r in recs if 40 < r["step"] <= k]
    after = [r["train/loss"] for r in recs[-20:]]
    assert sum(after) / len(after) <= sum(before) / len(before) + 0.05
    assert (
        recs[-1]["step"] == 120
        and (run / "checkpoints" / "latest").read_text().strip() == "step_00000120"
    )


def test_shuffled_probe_images_collapse_the_dependence_gap(tiny_tokens, colour_tokens, tmp_path):
    run, k = tmp_path / "run", 150
    train(
        base(
            tiny_tokens,
            run,
            200,
            "monitor.dependence.every=25",
            "monitor.dependence.min_steps=0",
            sources={"text": 0.2},
            colours=colour_tokens,
        ),
        faults={"shuffle_probe_from": k},
    )
    m = metrics(run)
    gaps = {s: m[s]["monitor/dependence_gap"] for s in m if "monitor/dependence_gap" in m[s]}
    assert gaps[125] > 0.05, gaps
    assert abs(gaps[150]) < 0.01 and abs(gaps[200]) < 0.01, gaps
    fired = [a for a in alarms(run) if a["signal"] == "dependence_gap"]
    assert len(fired) == 1 and fired[0]["step"] == 150, alarms(run)


def test_nan_loss_is_skipped_counted_and_never_reaches_the_weights(tiny_tokens, tmp_path):
    run, k = tmp_path / "run", 6
    train(
        base(tiny_tokens, run, k, "train.ckpt_every=1", "train.keep_last=2"),
        faults={"nan_at_step": k},
    )
    a = alarms(run)
    assert [(x["step"], x["signal"], x["action"]) for x in a] == [(k, "nonfinite", "skip")]
    m = metrics(run)
    assert m[k]["optim/skipped_steps"] == 1 and m[k]["monitor/nonfinite_steps"] == 1
    ck = run / "checkpoints"
    prev = torch.load(ck / f"step_{k - 1:08d}" / "mp_rank_00_model_states.pt", weights_only=False)[
        "module"
    ]
    last = torch.load(ck / f"step_{k:08d}" / "mp_rank_00_model_states.pt", weights_only=False)[
        "module"
    ]
    assert prev.keys() == last.keys()
    for name in prev:
        assert torch.equal(prev[name], last[name]), name
        assert torch.isfinite(last[name]).all(), name


def test_the_count_of_alarms_goes_on_after_a_resume(tiny_tokens, tmp_path):
    """``monitor/alarms`` is the run's count so far: a resumed run does not start it at 0."""
    run, k = tmp_path / "run", 4
    train(base(tiny_tokens, run, k, "train.ckpt_every=1"), faults={"nan_at_step": k})
    train(base(tiny_tokens, run, k + 2, "train.ckpt_every=1", "train.allow_config_change=true"))
    m = metrics(run)
    assert [m[s]["monitor/alarms"] for s in range(k - 1, k + 3)] == [0, 1, 1, 1]
    assert [(a["step"], a["signal"]) for a in alarms(run)] == [(k, "nonfinite")]


@pytest.mark.parametrize("ckpt_every", [3, 10])  # a checkpoint before the alarm; none at all
def test_a_resume_after_a_kill_raises_the_replayed_steps_alarms_once(
    tiny_tokens, tmp_path, ckpt_every
):
    """Killed after an alarm and resumed from the checkpoint before it (or from the start): the
    replayed step raises it again, and alarms.jsonl holds it once (the report counted it twice)."""
    run, k = tmp_path / "run", 4
    args = base(tiny_tokens, run, k + 2, f"train.ckpt_every={ckpt_every}")
    killed = train(args, faults={"nan_at_step": k, "kill_at_step": k + 1}, check=False)
    assert killed.returncode != 0 and [a["step"] for a in alarms(run)] == [k]
    train(args, faults={"nan_at_step": k})  # resumes from step 3
    assert [(a["step"], a["signal"]) for a in alarms(run)] == [(k, "nonfinite")]
    assert metrics(run)[k + 2]["monitor/alarms"] == 1


def test_a_resume_keeps_the_alarms_up_to_a_rollback_or_halt(tmp_path):
    """A rollback makes an older checkpoint the latest: a resume from it after a kill keeps the
    rollback's and the abandoned steps' alarms (those steps are not played again as they were)
    and the halt record written after a checkpoint; it cuts only what comes after them."""
    from train.monitor.alarms import Alarm, AlarmLog

    log = AlarmLog(tmp_path, is_main=True, write_line=lambda line: None)
    for step, action in [(12, "skip"), (32, "skip"), (37, "rollback"), (25, "skip")]:
        log.record([Alarm(step, "loss_spike", action, "")], echo=False)
    AlarmLog(tmp_path, is_main=True, write_line=print).resume_at(1)  # the checkpoint of step 20
    assert [a["step"] for a in alarms(tmp_path)] == [12, 32, 37]
    log.record([Alarm(40, "divergence", "halt", "")], echo=False)
    resumed = AlarmLog(tmp_path, is_main=True, write_line=print)
    resumed.resume_at(3)  # a checkpoint saved just before the halt record
    assert [a["step"] for a in alarms(tmp_path)] == [12, 32, 37, 40] and resumed.count == 4


def test_halt_stops_the_run_with_exit_code_3_and_names_the_alarm(tiny_tokens, tmp_path):
    run = tmp_path / "run"
    p = train(
        base(tiny_tokens, run, 6, "monitor.spike.action=halt"),
        faults={"nan_at_step": 3},
        check=False,
    )
    assert p.returncode == 3, p.stderr[-2000:]
    assert "halted by the monitor at step 3: nonfinite" in p.stderr and "Traceback" not in p.stderr
    # divergence rolls back by default, and the debug preset checkpoints only at the end: said at start
    assert "monitor.divergence.action=rollback, but train.ckpt_every=0" in p.stdout + p.stderr
    assert [(a["step"], a["action"]) for a in alarms(run)] == [(3, "halt")]


def test_moe_health_is_logged_per_modality(tiny_tokens, tmp_path):
    run = tmp_path / "run"
    train(
        base(
            tiny_tokens, run, 3, "model.moe.num_experts=4", "model.moe.top_k=2", "train.log_every=1"
        )
    )
    m = metrics(run)
    loads = {
        k: v for rec in m.values() for k, v in rec.items() if k.startswith("monitor/moe_max_load/")
    }
    assert "monitor/moe_max_load/text" in loads and all(1.0 <= v <= 4.0 for v in loads.values()), (
        loads
    )
    assert "train/moe_dropped" in m[3]


def test_a_resume_with_another_mix_starts_the_loss_references_again(tiny_tokens, tmp_path):
    """A mix changed at a resume (train.allow_config_change): the text of the first pass was
    mostly captions, then prose. The divergence rule read the new level as a rise, rolled back
    past the resume point (deleting its checkpoint) and halted; the references now restart."""
    run = tmp_path / "run"
    first = {"scenes": 0.6, "clips": 0.3, "text": 0.05, "code": 0.05}
    then = {"scenes": 0.0, "clips": 0.0, "text": 0.7, "code": 0.3}
    train(base(tiny_tokens, run, 80, "train.ckpt_every=20", sources=first))
    p = train(
        base(
            tiny_tokens,
            run,
            160,
            "train.ckpt_every=20",
            "train.allow_config_change=true",
            sources=then,
        )
    )
    said = p.stdout + p.stderr
    assert "the training mix differs from step 80's (data.sources)" in said, said[-3000:]
    assert [a for a in alarms(run) if a["step"] > 80] == [], alarms(run)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000160"


def test_a_rollback_with_no_checkpoint_to_return_to_halts_and_says_so(tiny_tokens, tmp_path):
    """With no checkpoint before the trouble (train.ckpt_every=0), a rollback halts the run: the
    alarm is recorded again as the halt it became, halted.json says why, and earlyfuse-report
    calls the run halted (it said "rollback" and "running or stopped")."""
    from tools.report.page import status_of
    from tools.report.run import load_run

    run, k = tmp_path / "run", 60
    args = ["optim.skip_step.min_steps=20", "optim.schedule=constant", "data.mix_chunk=64"]
    p = train(base(tiny_tokens, run, 80, *args), faults={"lr_x100_at": k}, check=False)
    assert p.returncode == 3, (p.stdout + p.stderr)[-3000:]
    why = f"no checkpoint from at least 5 steps before the trouble began (step {k + 1})"
    assert why in p.stderr
    last = alarms(run)[-1]
    assert (last["signal"], last["action"]) == ("divergence", "halt") and why in last["message"]
    halted = json.loads((run / "halted.json").read_text())
    assert halted["step"] == last["step"] and why in halted["reason"]
    assert status_of(load_run(run)) == halted["reason"][:300]  # said once, not prefixed again
