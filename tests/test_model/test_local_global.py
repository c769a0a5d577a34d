"""Local/global attention layers (Gemma 3 style): the local layers see a window of keys AND the
document/image mask, with their own RoPE base; the global layers see the whole document; the
config refuses what it cannot mean."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.attention import AttentionConfig, build_attention_mask
from model.rope import RopeConfig, RotaryEmbedding

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = dict(atol=2e-5, rtol=1e-4)  # fp32


def local_global(kit, **overrides):
    """3 layers, every 3rd global: layers 0 and 1 local (window 6, RoPE base 100), layer 2
    global (base 10,000); M-RoPE and bidirectional image blocks on."""
    return kit.tiny_config(
        n_layers=3,
        attention=AttentionConfig(
            n_heads=4, n_kv_heads=2, local_window=6, global_every=3, bidirectional_images=True
        ),
        rope=RopeConfig(theta=10_000.0, local_theta=100.0, mrope_sections=[2, 1, 1]),
        **overrides,
    )


def by_hand(model, batch):
    """The model's forward, layer by layer, each layer given the mask and RoPE table of its
    kind built here from the single-window masks (``sliding_window``) and plain tables."""
    cfg = model.cfg
    batch_size, seq_len = batch["input_ids"].shape
    hidden = model.tok_embeddings(batch["input_ids"])
    for block in model.blocks():
        window = cfg.attention.local_window if block.local else 0
        theta = cfg.rope.local_theta if block.local else cfg.rope.theta
        mask = build_attention_mask(
            batch_size,
            seq_len,
            hidden.device,
            doc_ids=batch["doc_ids"],
            image_ids=batch["image_ids"],
            sliding_window=window,
            bidirectional_images=True,
            backend="sdpa",
        )
        rope = RotaryEmbedding(cfg.head_dim, dataclasses.replace(cfg.rope, theta=theta))
        cos, sin = rope(batch["position_ids"], batch["position_thw"])
        hidden, _ = block(hidden, cos, sin, mask, batch["modality"])
    return model.output(model.norm(hidden))


def test_layers_alternate_local_and_global(kit):
    cfg = kit.tiny_config(
        n_layers=12,
        attention=AttentionConfig(n_heads=4, n_kv_heads=2, local_window=1024, global_every=6),
    )
    kinds = ["global" if not block.local else "local" for block in cfg.build("meta").blocks()]
    assert kinds == (["local"] * 5 + ["global"]) * 2  # Gemma 3: five local, then one global


def test_local_and_global_layers_get_their_own_mask_and_rope(kit, mixed_batch):
    torch.manual_seed(0)
    model = local_global(kit).build().eval()
    inputs = {key: value for key, value in mixed_batch.items() if key != "labels"}
    with torch.no_grad():
        logits = model(**inputs)
        torch.testing.assert_close(logits, by_hand(model, mixed_batch), **TOL)
        # The window and the local base both change the result: each is really applied.
        wide = dataclasses.replace(
            model.cfg, attention=dataclasses.replace(model.cfg.attention, local_window=64)
        )
        one_base = dataclasses.replace(
            model.cfg, rope=dataclasses.replace(model.cfg.rope, local_theta=10_000.0)
        )
        for other_cfg in (wide, one_base):
            other = other_cfg.build().eval()
            other.load_state_dict(model.state_dict())
            assert (other(**inputs) - logits).abs().max() > 1e-3
        # A window as long as the row with one base is plain document attention.
        plain = dataclasses.replace(
            one_base,
            attention=dataclasses.replace(one_base.attention, local_window=64),
            rope=dataclasses.replace(one_base.rope, local_theta=0.0),
        )
        full = dataclasses.replace(
            plain, attention=dataclasses.replace(plain.attention, local_window=0, global_every=0)
        )
        ref = full.build().eval()
        ref.load_state_dict(model.state_dict())
        wide_plain = plain.build().eval()
        wide_plain.load_state_dict(model.state_dict())
        torch.testing.assert_close(wide_plain(**inputs), ref(**inputs), **TOL)


def test_local_global_trains_with_activation_checkpointing(kit, mixed_batch):
    torch.manual_seed(0)
    model = local_global(kit).build()
    ckpt = local_global(kit, activation_checkpoint_every=1).build()
    ckpt.load_state_dict(model.state_dict())
    for net in (model, ckpt):
        net(**mixed_batch).loss.backward()
    for (name, param), other in zip(model.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(param.grad, other.grad, **TOL, msg=name)


def test_bad_local_global_settings_are_refused_by_name(kit):
    attention = dict(n_heads=4, n_kv_heads=2)
    with pytest.raises(
        ValueError, match="model.attention.local_window=8 needs model.attention.global_every >= 2"
    ):
        AttentionConfig(**attention, local_window=8)
    with pytest.raises(ValueError, match="global_every=3 without model.attention.local_window"):
        AttentionConfig(**attention, global_every=3)
    with pytest.raises(ValueError, match=r"model.attention.local_window must be >= 0, got -5"):
        AttentionConfig(**attention, local_window=-5, global_every=2)
    with pytest.raises(ValueError, match="set one of them"):
        AttentionConfig(**attention, local_window=8, global_every=2, sliding_window=8)
    with pytest.raises(ValueError, match="has no global layer"):
        kit.tiny_config(attention=AttentionConfig(**attention, local_window=8, global_every=6))
    with pytest.raises(ValueError, match=r"model.rope.local_theta=100.0 .* \(no local layers\)"):
        kit.tiny_config(rope=RopeConfig(local_theta=100.0))
    with pytest.raises(ValueError, match="model.rope.local_theta must be >= 0"):
        RopeConfig(local_theta=-1.0)
    with pytest.raises(ValueError, match="no local-layer part"):
        build_attention_mask(1, 8, torch.device("cpu"), backend="sdpa").local()
