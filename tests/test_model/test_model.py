"""The whole model: overfitting, presets, counts and FLOPs, checkpointing, config handling."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from data.vocab import Modality
from model.flops import attention_context, flops_per_token, param_counts
from model.moe import MoEConfig
from model.presets import mrope_sections, preset, preset_names
from model.transformer import TransformerConfig, positions_from_doc_ids

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tiny_model_overfits_a_mixed_batch_in_every_modality(kit, mixed_batch):
    torch.manual_seed(0)
    cfg = kit.tiny_config(dim=64, attention=dataclasses.replace(kit.tiny_config().attention))
    model = cfg.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    first = None
    for _ in range(150):
        r = model(**mixed_batch)
        first = first if first is not None else r.modality_means()
        opt.zero_grad()
        r.loss.backward()
        opt.step()
    r = model(**mixed_batch)
    last = r.modality_means()
    assert set(last) == {"loss/text", "loss/code", "loss/image", "loss/structure"}
    for name, value in last.items():
        assert value < 0.05, (name, value, first[name])
    assert first["loss/image"] > 5.0


def test_every_preset_builds_and_its_counts_match(kit):
    assert {"debug", "demo", "125m", "350m", "1b"} <= set(preset_names())
    for name in preset_names():
        cfg = preset(name)
        model = cfg.build("meta")  # no memory: a 1.4B model on a CPU test machine
        pc = param_counts(cfg)
        assert model.num_params() == pc.total, name
        assert model.num_params(exclude_embeddings=True) == pc.total - pc.embedding
        assert pc.active == pc.total
        assert cfg.attention.qk_norm and cfg.loss.z_loss_coef == 1e-5
    assert 1.0e9 < param_counts(preset("1b")).total < 1.5e9
    assert preset("debug", n_layers=3).n_layers == 3
    with pytest.raises(KeyError, match="unknown model preset"):
        preset("huge")


def test_moe_and_mot_param_counts_match_built_models(kit):
    cases = [
        kit.tiny_config(moe=MoEConfig(num_experts=4, top_k=2, hidden_dim=48)),
        kit.tiny_config(
            ffn=dataclasses.replace(kit.tiny_config().ffn, modality_groups=[0, 0, 1, 1, 2])
        ),
    ]
    for cfg in cases:
        pc = param_counts(cfg)
        assert cfg.build("meta").num_params() == pc.total
        assert pc.active < pc.total
    moe = param_counts(cases[0])
    assert moe.total - moe.active == 2 * 2 * 3 * 32 * 48  # 2 layers x 2 unused experts


def test_flops_per_token(kit):
    cfg = kit.tiny_config()
    pc = param_counts(cfg)
    T = 128
    expect = 6 * (pc.active_non_embedding + pc.output) + 12 * 2 * 4 * 8 * T
    assert flops_per_token(cfg, T) == expect
    assert attention_context(cfg, T, causal=True) == (T + 1) / 2
    win = kit.tiny_config(attention=dataclasses.replace(cfg.attention, sliding_window=16))
    assert attention_context(win, T) == 16
    assert 15 < attention_context(win, T, causal=True) < 16
    # Local/global: 3 layers, every 3rd global: two local layers see 16 keys, one sees T.
    local = kit.tiny_config(
        n_layers=3,
        attention=dataclasses.replace(cfg.attention, local_window=16, global_every=3),
    )
    assert attention_context(local, T) == (2 * 16 + T) / 3


def test_activation_checkpointing_gives_identical_loss_and_grads(kit, mixed_batch):
    torch.manual_seed(0)
    a = kit.tiny_config(moe=MoEConfig(num_experts=2, top_k=1)).build()
    b = kit.tiny_config(
        moe=MoEConfig(num_experts=2, top_k=1), activation_checkpoint_every=1
    ).build()
    b.load_state_dict(a.state_dict())
    ra, rb = a(**mixed_batch), b(**mixed_batch)
    ra.loss.backward()
    rb.loss.backward()
    assert all(layer.checkpoint for layer in b.layers)
    torch.testing.assert_close(ra.loss, rb.loss, atol=0, rtol=0)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, msg=n)


def test_reorder_norm_trains(kit, mixed_batch):
    torch.manual_seed(0)
    model = kit.tiny_config(reorder_norm=True).build()
    r = model(**mixed_batch)
    r.loss.backward()
    assert torch.isfinite(r.loss) and model.layers[0].ffn_norm.weight.grad.abs().sum() > 0


def test_depth_scaled_init(kit):
    torch.manual_seed(0)
    model = kit.tiny_config(dim=256, n_layers=8).build()
    std = model.cfg.init_std
    wq, wo = model.layers[0].attention.wq.weight, model.layers[0].attention.wo.weight
    assert abs(wq.std().item() - std * 0.986) < 0.1 * std  # truncated at 3 sigma
    assert abs(wo.std().item() - std / 4 * 0.986) < 0.1 * std / 4  # / sqrt(2 * 8)
    assert abs(model.output.weight.std().item() - 256**-0.5 * 0.986) < 0.1 * 256**-0.5
    assert all(p.abs().sum() > 0 for p in model.parameters())


def test_positions_from_doc_ids():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [5, 5, 5, 5, 5, 5, 5, 5]])
    assert positions_from_doc_ids(doc).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]


def test_config_validation_and_hydra_round_trip(kit):
    from omegaconf import OmegaConf

    cfg = preset("demo")
    cfg = dataclasses.replace(
        cfg, rope=dataclasses.replace(cfg.rope, mrope_sections=mrope_sections(cfg.head_dim))
    )
    structured = OmegaConf.structured(cfg)
    back = OmegaConf.to_object(OmegaConf.merge(structured, {"attention": {"sliding_window": 256}}))
    assert isinstance(back, TransformerConfig) and back.attention.sliding_window == 256
    assert (
        back.rope.mrope_sections == cfg.rope.mrope_sections
        and sum(back.rope.mrope_sections) == cfg.head_dim // 2
    )
    with pytest.raises(Exception):  # noqa: B017 - omegaconf's error class varies by version
        OmegaConf.merge(structured, {"attention": {"n_hedas": 3}})  # a typo is an error
    assert TransformerConfig(**{**dataclasses.asdict(kit.tiny_config())}).attention.n_heads == 4
    with pytest.raises(ValueError, match="backend"):
        kit.tiny_config(
            attention=dataclasses.replace(kit.tiny_config().attention, backend="xformers")
        )
    with pytest.raises(ValueError, match="visual_offset"):
        TransformerConfig(vocab_size=10, text_vocab_size=5, visual_offset=20)
    # A layout's own sizes typed by hand meet the placeholder of the one left out
    with pytest.raises(ValueError, match=r"\(model.visual_offset: the schema's placeholder; a"):
        TransformerConfig(vocab_size=4406, text_vocab_size=4096)
    with pytest.raises(ValueError, match="init_std 0: give a standard deviation above 0"):
        TransformerConfig(init_std=0)  # was a ZeroDivisionError at build
    with pytest.raises(ValueError, match="activation_checkpoint_every -1: give 0"):
        TransformerConfig(activation_checkpoint_every=-1)  # was accepted: no checkpointing


def test_forward_takes_a_loader_batch_and_returns_logits_without_labels(kit, mixed_batch):
    model = kit.tiny_config().build()
    r = model(**mixed_batch)
    assert r.loss.ndim == 0 and r.ce_sum.shape == (len(Modality),)
    b = {k: v for k, v in mixed_batch.items() if k != "labels"}
    assert model(**b).shape == (2, 64, kit.layout.size)
    assert model(mixed_batch["input_ids"]).shape == (2, 64, kit.layout.size)


def test_final_hidden_and_the_heads_logits_of_some_positions_are_the_forward_ones(kit, mixed_batch):
    """What an evaluation of long rows reads (tools/evaluate/heldout.py): the hidden states the
    head reads, then the head's logits of a few positions only, from the whole batch (labels
    included: they are passed over)."""
    torch.manual_seed(0)
    model = kit.tiny_config().build()
    with torch.no_grad():
        full = model(**{k: v for k, v in mixed_batch.items() if k != "labels"})
        final = model.final_hidden(**mixed_batch)
        rows, cols = torch.tensor([0, 1, 1]), torch.tensor([3, 0, 63])
        picked = model.output.logits(final[rows, cols])
    assert final.shape == (2, 64, model.cfg.dim)
    assert picked.dtype == torch.float32
    torch.testing.assert_close(picked, full[rows, cols])


def test_bf16_model_trains_and_matches_fp32_loss(kit, mixed_batch):
    torch.manual_seed(0)
    cfg = kit.tiny_config(moe=MoEConfig(num_experts=2, top_k=1))
    fp32 = cfg.build()
    bf16 = cfg.build().to(torch.bfloat16)
    bf16.load_state_dict(fp32.state_dict())
    a, b = fp32(**mixed_batch), bf16(**mixed_batch)
    b.loss.backward()
    assert b.loss.dtype == torch.float32 and abs(a.loss.item() - b.loss.item()) < 0.05
    assert all(
        p.grad is not None and p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all()
        for p in bf16.parameters()
    )


def test_grid_embedding_marks_where_an_image_code_sits(kit):
    """Row/column embeddings reach image codes only: moving text positions changes nothing, and
    the same code at another grid cell gets another input (it is what lets "in the top left"
    bind to a place in the picture)."""
    torch.manual_seed(0)
    model = kit.tiny_config(grid_embedding=True).build().eval()
    assert model.grid_rows is not None and model.grid_cols is not None
    image, text = int(Modality.IMAGE), int(Modality.TEXT)
    modality = torch.tensor([[text, image, image, image]])
    # (t, h, w): a text token, then codes at (row 0, col 0), (0, 1) and (1, 0) of a block at s=1.
    thw = torch.tensor([[[0, 0, 0], [1, 1, 1], [1, 1, 2], [1, 2, 1]]])
    extra = model._grid_embedding(thw, modality)
    assert extra[0, 0].abs().sum() == 0  # text: nothing added
    torch.testing.assert_close(extra[0, 1], model.grid_rows.weight[0] + model.grid_cols.weight[0])
    torch.testing.assert_close(extra[0, 2], model.grid_rows.weight[0] + model.grid_cols.weight[1])
    torch.testing.assert_close(extra[0, 3], model.grid_rows.weight[1] + model.grid_cols.weight[0])
    # Without the option the parameters do not exist (old checkpoints load unchanged).
    assert kit.tiny_config().build().grid_rows is None


@pytest.mark.parametrize("ffn", ["modality_groups", "moe"])
def test_the_loaders_narrow_dtypes_give_what_int64_gives(kit, mixed_batch, ffn):
    """The loader hands out int32 fields and int64 labels (data/loader/batch_buffer.BATCH_DTYPES):
    loss, logits and gradients equal those of the same batch in int64, through everything that
    reads them (M-RoPE, the grid embedding, per-modality FFN groups and MoE, document masks and
    bidirectional images; FlexAttention's mask too, which on CPU runs without gradients)."""
    from data.loader.batch_buffer import BATCH_DTYPES
    from model.attention import AttentionConfig
    from model.rope import RopeConfig

    narrow = {
        k: v.to(getattr(torch, BATCH_DTYPES[k].name)) if k in BATCH_DTYPES else v
        for k, v in mixed_batch.items()
    }
    assert narrow["input_ids"].dtype == torch.int32 and narrow["labels"].dtype == torch.int64
    assert narrow["modality"].dtype == torch.int32  # not uint8: a uint8 index is a mask
    attention = AttentionConfig(n_heads=4, n_kv_heads=2, bidirectional_images=True)
    by_modality = (
        {"ffn": dataclasses.replace(kit.tiny_config().ffn, modality_groups=[0, 0, 1, 1, 0])}
        if ffn == "modality_groups"
        else {"moe": MoEConfig(num_experts=2, top_k=1)}
    )
    cfg = kit.tiny_config(
        rope=RopeConfig(mrope_sections=mrope_sections(8)),
        grid_embedding=True,
        attention=attention,
        **by_modality,
    )
    torch.manual_seed(0)
    model = cfg.build()
    results = []
    for batch in (mixed_batch, narrow):
        model.zero_grad()
        r = model(**batch)
        r.loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((r.loss.detach(), r.ce_sum.detach(), grads))
    (loss_a, ce_a, grads_a), (loss_b, ce_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(ce_a, ce_b)
    assert len(grads_a) == len(grads_b) and all(map(torch.equal, grads_a, grads_b))
    flex_cfg = dataclasses.replace(cfg, attention=dataclasses.replace(attention, backend="flex"))
    flex = flex_cfg.build().eval()
    flex.load_state_dict(model.state_dict())
    without = ("labels",)
    with torch.no_grad():
        a = flex(**{k: v for k, v in mixed_batch.items() if k not in without})
        b = flex(**{k: v for k, v in narrow.items() if k not in without})
    torch.testing.assert_close(a, b, atol=0, rtol=0)
