"""The memory estimate behind docs/training.md's preset table."""

from __future__ import annotations

import dataclasses

import pytest

from model.presets import preset
from train.memory import estimate, mask_bytes
from train.memory import main as memory_main


@pytest.mark.parametrize("name", ["debug", "125m", "350m", "1b"])
def test_parameter_count_is_the_models(name):
    cfg = preset(name)
    built = sum(p.numel() for p in cfg.build("meta").parameters())
    assert estimate(cfg, micro_batch=1, seq_len=16).params == built


def test_zero_stages_and_checkpointing_only_ever_save_memory():
    cfg = preset("350m")
    kw = dict(micro_batch=4, seq_len=2048, world_size=8)
    states = [estimate(cfg, zero_stage=z, **kw).states_gib for z in range(4)]
    assert states == sorted(states, reverse=True) and states[3] < states[0] / 6
    assert (
        estimate(cfg, act_ckpt=True, **kw).activations_gib < estimate(cfg, **kw).activations_gib / 5
    )
    one = estimate(cfg, micro_batch=4, seq_len=2048, world_size=1, zero_stage=0)
    assert one.states_gib == pytest.approx(20 * one.params / 2**30)  # 20 bytes per parameter
    assert estimate(cfg, grad_accum=4, **kw).tokens_per_step == 4 * 2048 * 4 * 8


def test_sequence_parallel_divides_activations_and_masks_grow_as_blocks_squared():
    cfg = preset("1b")
    kw = dict(micro_batch=1, seq_len=131072, world_size=8, zero_stage=1, act_ckpt=True)
    one, four = estimate(cfg, **kw), estimate(cfg, sequence_parallel=4, **kw)
    assert four.activations_gib == pytest.approx(one.activations_gib / 4)
    assert four.states_gib == one.states_gib  # ZeRO partitions over all 8 ranks either way
    assert four.tokens_per_step == one.tokens_per_step / 4 == 2 * 131072  # 2 replicas of SP 4
    # A BlockMask: four (T/128)^2 int32 index tensors per row; SDPA's: T^2 bytes.
    assert mask_bytes(131072) == 4 * 4 * 2**20 and mask_bytes(2**20) == 4 * 256 * 2**20
    assert mask_bytes(131072, mask="sdpa") == 16 * 2**30
    assert one.mask_gib == pytest.approx(16 / 1024)
    local = dataclasses.replace(
        cfg, attention=dataclasses.replace(cfg.attention, local_window=1024, global_every=6)
    )
    assert estimate(local, **kw).mask_gib == 2 * one.mask_gib  # the local layers' own mask
    with pytest.raises(ValueError, match="over 3 ranks needs the query heads"):
        estimate(cfg, sequence_parallel=3, **kw)
    with pytest.raises(ValueError, match="sequence_parallel=4 must divide the world size"):
        estimate(cfg, **{**kw, "world_size": 2}, sequence_parallel=4)
    # as the trainer, a degree that does not divide the query heads (125m: 12) is refused
    with pytest.raises(ValueError, match=r"n_heads = 12"):
        estimate(preset("125m"), sequence_parallel=8, **kw)
    with pytest.raises(SystemExit):
        memory_main(["125m", "--seq-len", "131072", "--gpus", "8", "--sp", "8"])


@pytest.mark.parametrize(
    "argv, said",
    [
        (["3b"], "unknown model preset '3b'; choose from"),
        (["125m", "--seq-len", "-5"], "argument --seq-len: -5 is not a count (give 1 or more)"),
        (["125m", "--gpus", "0"], "argument --gpus: 0 is not a count (give 1 or more)"),
    ],
)
def test_the_planner_refuses_an_unknown_preset_and_counts_below_1_in_one_line(argv, said, capsys):
    with pytest.raises(SystemExit) as stop:
        memory_main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and said in err and "Traceback" not in err
