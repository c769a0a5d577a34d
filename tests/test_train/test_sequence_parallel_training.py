"""``earlyfuse-train`` with ``train.sequence_parallel=2`` under torchrun (gloo, fp32, the debug
model) against one process on the same rows:

- 2 processes, SP 2 (one data-parallel replica), ZeRO 1 and ZeRO 2 (and ZeRO 3, marked slow):
  the losses of every step equal the one-process run's to ``LOSS_TOLERANCE``; label tokens per
  modality, the delivered mix and the held-out loss are the rows' figures, counted once (not
  once per rank);
- an SP 2 run killed with -9 and resumed logs the uninterrupted run's losses exactly;
- checkpoints move between SP degrees: one saved at SP 1 (one process) goes on at SP 2 (two)
  with the one-process run's losses, and one saved at SP 2 goes on at SP 1 with the SP 2 run's;
  under ZeRO 0 as it is, under ZeRO 2 through its universal form (another world size; SP 1 to
  SP 2 marked slow);
- 4 processes, SP 2 x data parallel 2, equal 2 processes of plain data parallelism.
"""

from __future__ import annotations

import json
import shutil

import pytest
from trainrun import metrics, train

SOURCES = {"scenes": 0.3, "clips": 0.3, "text": 0.3, "code": 0.1}
STEPS = 4
# fp32: the SP run sums the same products in another order (per shard, then over the group), so
# its losses are the one-process run's up to rounding carried through a few Adam steps (measured:
# at most 2e-6 here).
LOSS_TOLERANCE = 1e-4
MODALITIES = ("text", "code", "image", "video")
PROBES = ("monitor.code_use.min_steps=1", "monitor.code_use.every=2")


def base(tokens, run_dir, *extra):
    srcs = ",".join(
        f"{{name: {s}, shards: [{tokens / s}], weight: {w}}}" for s, w in SOURCES.items()
    )
    heldout = f"[{{name: heldout, shards: [{tokens / 'scenes'}], weight: 1.0}}]"
    return [
        "experiment=debug",
        f"data.sources=[{srcs}]",
        f"data.validation={heldout}",
        "train.eval_batches=0",  # the whole held-out set: the same rows however they are split
        f"run_dir={run_dir}",
        f"train.steps={STEPS}",
        "train.log_every=1",
        "train.micro_batch=2",
        "train.ckpt_every=2",
        "train.tensorboard=false",
        # rows shorter than the longest clips: some blocks are dropped, and counted once per row
        "data.seq_len=128",
        "data.allow_block_drops=true",
        *extra,
    ]


def sp2(tokens, run_dir, *extra, **kwargs):
    return train(base(tokens, run_dir, "train.sequence_parallel=2", *extra), nproc=2, **kwargs)


def losses(run_dir, steps=range(1, STEPS + 1)) -> list[float]:
    logged = metrics(run_dir)
    return [logged[step]["train/loss"] for step in steps]


def final(run_dir) -> dict:
    return json.loads((run_dir / "final.json").read_text())


@pytest.fixture(scope="module")
def runs(tiny_tokens, tmp_path_factory):
    """One process (SP 1), and two processes at SP 2 under ZeRO 0 and ZeRO 2; the code-use probe
    draws its images at steps 2 and 4."""
    root = tmp_path_factory.mktemp("sp_runs")
    train(base(tiny_tokens, root / "one", *PROBES))
    sp2(tiny_tokens, root / "sp2_zero0", *PROBES)
    log = sp2(tiny_tokens, root / "sp2_zero2", "deepspeed.zero_stage=2", *PROBES)
    return {"root": root, "log": log}


def assert_close(got: list[float], want: list[float]) -> None:
    assert got == pytest.approx(want, abs=LOSS_TOLERANCE, rel=0), (got, want)


@pytest.mark.parametrize("name", ["sp2_zero0", "sp2_zero2"])
def test_sp2_trains_like_one_process_and_counts_each_row_once(runs, name):
    one, run = runs["root"] / "one", runs["root"] / name
    assert_close(losses(run), losses(one))
    assert losses(one)[-1] < losses(one)[0]
    want, got = metrics(one), metrics(run)
    for step in range(1, STEPS + 1):
        # DeepSpeed's norm (ZeRO 2) and ours (ZeRO 0) of the gradients averaged over DP only
        norms = got[step]["optim/grad_norm"], want[step]["optim/grad_norm"]
        assert norms[0] == pytest.approx(norms[1], rel=1e-5), (step, norms)
        for modality in MODALITIES:  # label tokens: exact, once per row
            key = f"tokens/{modality}"
            assert got[step].get(key) == want[step].get(key), (step, key)
        for source in SOURCES:
            key = f"mix/{source}"
            assert got[step][key] == pytest.approx(want[step][key], abs=1e-12)
    # The held-out pass (every rank scores its shard) sees every token once.
    for key in ("val/tokens/image", "val/tokens/text"):
        if key in final(one):
            assert final(run)[key] == final(one)[key]
    assert final(run)["val/loss"] == pytest.approx(final(one)["val/loss"], abs=LOSS_TOLERANCE)
    # the run's dropped blocks, from the loader of each SP group's first rank
    drops = {k: v for k, v in final(one).items() if k.startswith("data/dropped_blocks")}
    assert drops["data/dropped_blocks"] > 0
    assert {k: v for k, v in final(run).items() if k.startswith("data/dropped_blocks")} == drops
    # The ranks of an SP group draw the same images, counted once: the figures of one process
    for key in ("monitor/gen_code_distinct", "monitor/gen_image_diversity"):
        assert [got[s][key] for s in (2, 4)] == pytest.approx([want[s][key] for s in (2, 4)])


def test_the_console_and_final_json_name_the_layout(runs):
    assert "sequence parallel 2 x data parallel 1" in runs["log"].stdout
    layout = {"world_size": 2, "sequence_parallel": 2, "data_parallel": 1, "zero_stage": 2}
    assert final(runs["root"] / "sp2_zero2")["run"] == {
        **layout,
        "task": "lm",
        "bf16": False,
        "steps": STEPS,
    }
    assert final(runs["root"] / "one")["run"]["sequence_parallel"] == 1


def test_sp2_zero1_trains_like_one_process(runs, tiny_tokens, tmp_path):
    sp2(tiny_tokens, tmp_path / "run", "deepspeed.zero_stage=1", "train.steps=2")
    assert_close(losses(tmp_path / "run", [1, 2]), losses(runs["root"] / "one", [1, 2]))


@pytest.mark.slow  # a third trainer run; the default suite checks the engine config (test_configs.py)
def test_sp2_zero3_trains_like_one_process(runs, tiny_tokens, tmp_path):
    """ZeRO 3 too: gradients summed over the SP group (its gradient norm is the one-process
    run's, not half of it as DeepSpeed's reduce-scatter made it)."""
    sp2(tiny_tokens, tmp_path / "run", "deepspeed.zero_stage=3", "train.steps=2")
    got, want = metrics(tmp_path / "run"), metrics(runs["root"] / "one")
    assert_close(losses(tmp_path / "run", [1, 2]), losses(runs["root"] / "one", [1, 2]))
    for step in (1, 2):
        norms = got[step]["optim/grad_norm"], want[step]["optim/grad_norm"]
        assert norms[0] == pytest.approx(norms[1], rel=1e-5), (step, norms)


def test_sp2_killed_with_minus_9_resumes_bit_identically(runs, tiny_tokens, tmp_path):
    run = tmp_path / "run"
    killed = sp2(tiny_tokens, run, faults={"kill_at_step": 3}, check=False)
    assert killed.returncode != 0
    sp2(tiny_tokens, run)
    assert losses(run) == losses(runs["root"] / "sp2_zero0")


def rewound_copy(source, target):
    """A copy of finished run ``source`` as it was at step 2's checkpoint."""
    shutil.copytree(source, target)
    shutil.rmtree(target / "checkpoints" / "step_00000004")
    (target / "checkpoints" / "latest").write_text("step_00000002\n")
    (target / "metrics.jsonl").write_text("")
    return target


def test_a_zero0_checkpoint_moves_from_sp1_to_sp2_and_back(runs, tiny_tokens, tmp_path):
    """One process at SP 1 and two at SP 2 are both one data-parallel replica: the same rows, so
    the move needs no train.allow_config_change. A ZeRO-0 checkpoint loads on another world size
    as it is; steps 3 and 4 go on from step 2's checkpoint at the other degree with the losses of
    the run that saved it."""
    root = runs["root"]
    up = rewound_copy(root / "one", tmp_path / "up")
    down = rewound_copy(root / "sp2_zero0", tmp_path / "down")
    p = sp2(tiny_tokens, up, *PROBES)
    said = p.stdout + p.stderr
    assert "resuming step_00000002 of 1 rank(s) on 2" in said and "breaks an exact" not in said
    assert "data-parallel replicas" not in said
    assert_close(losses(up, [3, 4]), losses(root / "one", [3, 4]))
    train(base(tiny_tokens, down, *PROBES))
    assert_close(losses(down, [3, 4]), losses(root / "sp2_zero0", [3, 4]))


def test_a_zero2_sp2_checkpoint_goes_on_at_sp1_through_its_universal_form(
    runs, tiny_tokens, tmp_path
):
    """ZeRO partitions its states over all ranks (DP x SP), so two processes at SP 2 and one at
    SP 1 hold different partitions: the checkpoint goes through ``earlyfuse-convert universal``,
    as for any change of world size, and then goes on with the saving run's losses."""
    from tools.convert import main as convert_main

    down = rewound_copy(runs["root"] / "sp2_zero2", tmp_path / "down")
    assert convert_main(["universal", str(down), "--step", "2"]) == 0
    train(base(tiny_tokens, down, "deepspeed.zero_stage=2", "train.allow_config_change=true"))
    assert_close(losses(down, [3, 4]), losses(runs["root"] / "sp2_zero2", [3, 4]))


@pytest.mark.slow  # the other way: a run of its own first, then loaded under the SP layout
def test_a_zero2_sp1_checkpoint_goes_on_at_sp2_through_its_universal_form(tiny_tokens, tmp_path):
    from tools.convert import main as convert_main

    one = tmp_path / "one"
    train(base(tiny_tokens, one, "deepspeed.zero_stage=2"))
    up = rewound_copy(one, tmp_path / "up")
    assert convert_main(["universal", str(up), "--step", "2"]) == 0
    p = sp2(tiny_tokens, up, "deepspeed.zero_stage=2", "train.allow_config_change=true")
    assert "of 1 rank(s) on 2 from its universal checkpoint" in p.stdout + p.stderr
    assert_close(losses(up, [3, 4]), losses(one, [3, 4]))


def test_sp2_times_data_parallel_2_trains_like_data_parallel_2(
    tiny_tokens, one_document_tokens, tmp_path
):
    """Their held-out set has a source of one document, fewer than the 2 data-parallel ranks:
    validation and the probes (which read it) read all of it on every rank. Before, the probes'
    loader split it over the ranks and stopped the run at the first probe ("fewer samples than
    consumers")."""
    heldout = (
        f"data.validation=[{{name: heldout, shards: [{tiny_tokens / 'scenes'}], weight: 1.0}},"
        f"{{name: one, shards: [{one_document_tokens}], weight: 1.0}}]"
    )
    train(base(tiny_tokens, tmp_path / "dp2", "train.steps=2", heldout), nproc=2)
    train(
        base(
            tiny_tokens, tmp_path / "sp2dp2", "train.steps=2", "train.sequence_parallel=2", heldout
        ),
        nproc=4,
    )
    assert_close(losses(tmp_path / "sp2dp2", [1, 2]), losses(tmp_path / "dp2", [1, 2]))
    for run in ("dp2", "sp2dp2"):
        final = json.loads((tmp_path / run / "final.json").read_text())
        assert final["val/complete"] == 1 and "monitor/attn_max_logit" in metrics(tmp_path / run)[2]
