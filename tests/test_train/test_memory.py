"""The memory estimate behind docs/training.md's preset table."""

from __future__ import annotations

import pytest

from model.presets import preset
from train.memory import estimate


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
