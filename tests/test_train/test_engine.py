"""train/engine.py: what a checkpoint load leaves to the run's config."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from train.engine import config_hyperparameters, param_groups
from train.schedule import CappedLambdaLR, lr_multiplier
from train.skip_step import SkipStepAdamW

MULT = partial(lr_multiplier, total=20, warmup=2, schedule="cosine", min_lr_ratio=0.1)


def built(lr: float, weight_decay: float, betas: tuple[float, float]):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
    opt = SkipStepAdamW(
        param_groups(model, weight_decay), lr=lr, betas=betas, weight_decay=weight_decay
    )
    return model, opt, CappedLambdaLR(opt, MULT)


def test_a_load_keeps_the_configs_hyperparameters_and_the_checkpoints_state():
    """As DeepSpeed loads a checkpoint (the optimizer's state dict, the scheduler's), the saved
    peak lr, betas and weight decay came back over the config's: a resume with another optim.lr
    trained on at the old one."""
    model, opt, sched = built(1e-3, 0.1, (0.9, 0.95))
    for _ in range(5):
        model(torch.tensor([1, 2])).sum().backward()
        opt.step()
        sched.step()
    sched.cap_here(0.5)  # a rollback's cap: state, it travels
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()

    _, opt2, sched2 = built(2e-3, 0.5, (0.8, 0.9))
    with config_hyperparameters(SimpleNamespace(lr_scheduler=sched2)):
        opt2.load_state_dict(saved_opt)
        sched2.load_state_dict(saved_sched)
    decay, no_decay = opt2.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.5, 0.0)
    assert decay["betas"] == (0.8, 0.9) and decay["initial_lr"] == 2e-3
    assert sched2.last_epoch == 5 and sched2.cap == sched.cap  # the schedule's position, its cap
    # The next update already takes the new peak lr, capped as saved
    assert decay["lr"] == pytest.approx(2e-3 * min(MULT(5), sched.cap))
    assert sched2.get_last_lr() == [decay["lr"], no_decay["lr"]]
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], saved_opt["state"][0]["exp_avg"])
