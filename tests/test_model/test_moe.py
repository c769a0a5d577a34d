"""Mixture of experts and modality-routed FFNs (mixture of transformers)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from data.vocab import Modality
from model.layers import FFNConfig, ModalityFFN, SwiGLU
from model.moe import MoE, MoEConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def test_moe_forward_backward_and_stats(kit, mixed_batch):
    torch.manual_seed(0)
    cfg = kit.tiny_config(moe=MoEConfig(num_experts=4, top_k=2, capacity_factor=1.0))
    model = cfg.build()
    r = model(**mixed_batch)
    r.loss.backward()
    assert r.aux_loss > 0 and r.moe_load_balance >= 1.0 - 1e-5  # E * sum f*P >= 1
    assert r.moe_expert_load.shape == (2, len(Modality), 4)
    # every token is assigned top_k times per layer
    assert int(r.moe_expert_load[0].sum()) == 2 * mixed_batch["input_ids"].numel()
    for layer in model.layers:
        assert (
            layer.feed_forward.router.weight.grad.abs().sum() > 0
        )  # the router learns through the aux loss
        for e in layer.feed_forward.experts:
            assert e.w1.weight.grad is not None
    ce = r.ce
    torch.testing.assert_close(r.loss.detach(), ce + cfg.loss.z_loss_coef * r.z_loss + r.aux_loss)


def test_moe_matches_a_direct_per_token_computation():
    torch.manual_seed(0)
    moe = MoE(8, 16, MoEConfig(num_experts=3, top_k=2, capacity_factor=0)).eval()
    x = torch.randn(2, 5, 8)
    y, stats = moe(x)
    probs = moe.router(x.reshape(-1, 8)).softmax(-1)
    expect = []
    for i, xi in enumerate(x.reshape(-1, 8)):
        p, e = probs[i].topk(2)
        p = p / p.sum()
        expect.append(sum(p[j] * moe.experts[int(e[j])](xi) for j in range(2)))
    torch.testing.assert_close(y.reshape(-1, 8), torch.stack(expect), atol=1e-6, rtol=1e-5)
    assert stats.dropped == 0


def test_moe_capacity_drops_and_counts():
    torch.manual_seed(0)
    moe = MoE(8, 16, MoEConfig(num_experts=4, top_k=1, capacity_factor=0.5))
    with torch.no_grad():  # send every token to expert 0
        moe.router.weight.zero_()
        moe.router.weight[0] = 1.0
    x = torch.rand(1, 16, 8) + 0.5
    y, stats = moe(x)
    capacity = 2  # ceil(0.5 * 16 * 1 / 4)
    assert int(stats.dropped) == 16 - capacity
    assert (y[0, capacity:] == 0).all() and (y[0, :capacity] != 0).any()  # first come, first served
    moe.eval()
    _, stats = moe(x)
    assert int(stats.dropped) == 0  # no capacity limit outside training


def test_moe_expert_load_per_modality():
    torch.manual_seed(0)
    moe = MoE(8, 16, MoEConfig(num_experts=2, top_k=1, capacity_factor=0))
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[1, 0] = 10.0  # feature 0 > 0 -> expert 1
    x = torch.zeros(1, 6, 8)
    x[0, :3, 0], x[0, 3:, 0] = 1.0, -1.0
    mod = torch.tensor([[int(Modality.IMAGE)] * 3 + [int(Modality.TEXT)] * 3])
    _, stats = moe(x, mod)
    assert stats.expert_load[Modality.IMAGE].tolist() == [0, 3]
    assert stats.expert_load[Modality.TEXT].tolist() == [3, 0]


def test_modality_ffn_routes_by_modality():
    torch.manual_seed(0)
    mot = ModalityFFN(8, FFNConfig(hidden_dim=16, modality_groups=[0, 0, 1, 1, 2]))
    x = torch.randn(1, 5, 8)
    mod = torch.arange(5)[None]
    y, _ = mot(x, mod)
    for i, g in enumerate([0, 0, 1, 1, 2]):
        torch.testing.assert_close(y[0, i], mot.experts[g](x[0, i]))
    y.sum().backward()
    assert all(e.w2.weight.grad.abs().sum() > 0 for e in mot.experts)


def test_modality_ffn_unused_group_still_gets_a_gradient(kit, mixed_batch):
    cfg = kit.tiny_config(
        ffn=dataclasses.replace(kit.tiny_config().ffn, modality_groups=[0, 0, 1, 1, 1])
    )
    model = cfg.build()
    b = dict(mixed_batch, modality=torch.zeros_like(mixed_batch["modality"]))  # text only
    model(**b).loss.backward()
    ffn = model.layers[0].feed_forward
    assert (
        ffn.experts[1].w1.weight.grad is not None and ffn.experts[1].w1.weight.grad.abs().sum() == 0
    )


def test_config_rejects_bad_groups_and_both_kinds(kit):
    with pytest.raises(ValueError, match="modality_groups"):
        FFNConfig(modality_groups=[0, 2, 2, 2, 2])
    with pytest.raises(ValueError, match="not both"):
        kit.tiny_config(
            moe=MoEConfig(num_experts=2, top_k=1),
            ffn=FFNConfig(hidden_dim=64, modality_groups=[0, 0, 1, 1, 1]),
        )
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(num_experts=2, top_k=3)
    assert isinstance(SwiGLU(4, 8).w1, torch.nn.Linear)
