"""KV-cache decoding against full recomputation; sampling; the image grammar."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from data.layout import parse_image
from data.vocab import Modality
from model.attention import AttentionConfig
from model.generate import ImageConstraint, SamplingConfig, generate, sample_next
from model.moe import MoEConfig
from model.rope import LayoutTracker, RopeConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def _variant(kit, name):
    if name == "plain":
        return kit.tiny_config()
    if name == "mrope+window":
        return kit.tiny_config(
            rope=RopeConfig(mrope_sections=[2, 1, 1]),
            attention=AttentionConfig(n_heads=4, n_kv_heads=2, sliding_window=6),
        )
    if name == "local/global+mrope":  # layer 0 local (window 5, its own RoPE base), 1 global
        return kit.tiny_config(
            rope=RopeConfig(mrope_sections=[2, 1, 1], local_theta=100.0),
            attention=AttentionConfig(n_heads=4, n_kv_heads=2, local_window=5, global_every=2),
        )
    if name == "grid":
        return kit.tiny_config(grid_embedding=True)
    if name == "mot":
        return kit.tiny_config(
            ffn=dataclasses.replace(kit.tiny_config().ffn, modality_groups=[0, 1, 2, 2, 2])
        )
    if name == "moe+reorder":
        return kit.tiny_config(moe=MoEConfig(num_experts=4, top_k=2), reorder_norm=True)
    raise KeyError(name)


def _full_logits(model, ids, layout):
    """Last-position logits of a from-scratch forward over the whole prefix (no cache)."""
    thw, mods = zip(*[t for t in map(LayoutTracker(layout).push, ids[0].tolist())])
    thw = torch.tensor([thw])
    mods = torch.tensor([[int(m) for m in mods]])
    return model(ids, position_thw=thw, modality=mods)[:, -1]


@pytest.mark.parametrize(
    "name", ["plain", "mrope+window", "local/global+mrope", "grid", "mot", "moe+reorder"]
)
def test_kv_cache_generation_equals_full_recomputation(kit, name):
    torch.manual_seed(0)
    model = _variant(kit, name).build().eval()
    L = kit.layout
    # A prompt that opens an image, so decoding runs through grid positions, then text again.
    prompt = torch.tensor([[5, 6, 7, L.structure_id("<boi>")]])
    constraint = ImageConstraint(L, 1, size=(2, 3))
    out = generate(
        model,
        prompt,
        sampling=SamplingConfig(max_new_tokens=16, temperature=0.0),
        constraint=constraint,
    )
    assert out.shape == (1, 20)
    check = ImageConstraint(L, 1, size=(2, 3))
    with torch.no_grad():
        for t in range(prompt.shape[1], out.shape[1]):
            for tok in out[0, t - 1 : t].tolist() if t > prompt.shape[1] else out[0, :t].tolist():
                check.observe(0, tok, strict=False)
            logits = _full_logits(model, out[:, :t], L)
            logits = logits.masked_fill(~check.allowed(out.shape[1] - t), float("-inf"))
            assert int(logits.argmax(-1)) == int(out[0, t]), f"step {t}"
        # And the logits themselves match, step by step, through model.decode.
        caches = model.make_kv_caches(1, out.shape[1])
        thw_all = LayoutTracker.positions(out[0].tolist(), L)[None]
        mods = torch.tensor([[int(m) for _, m in map(LayoutTracker(L).push, out[0].tolist())]])
        step = model.decode(
            out[:, :4], caches, 0, position_thw=thw_all[:, :4], modality=mods[:, :4]
        )
        for t in range(4, out.shape[1]):
            torch.testing.assert_close(
                step, _full_logits(model, out[:, :t], L), atol=1e-4, rtol=1e-4
            )
            step = model.decode(
                out[:, t : t + 1],
                caches,
                t,
                position_ids=torch.tensor([[t]]),
                position_thw=thw_all[:, t : t + 1],
                modality=mods[:, t : t + 1],
            )


def _parse_images(tokens, layout):
    """Cut out every <boi> ... <eoi> block and decode it with the real parser (data.layout);
    outside blocks no code or row/size marker may appear."""
    sid = layout.structure_id
    grids, i = [], 0
    while i < len(tokens):
        if tokens[i] != sid("<boi>"):
            assert not (layout.structure_offset <= tokens[i] < layout.size), tokens[i]
            i += 1
            continue
        end = tokens.index(sid("<eoi>"), i)
        grids.append(tuple(parse_image(tokens[i : end + 1], layout).shape))
        i = end + 1
    return grids


def test_constrained_generation_always_yields_decodable_images(kit):
    torch.manual_seed(0)
    model = kit.tiny_config().build().eval()
    L = kit.layout
    with torch.no_grad():  # make image tokens likely so that many images are attempted
        model.output.weight[L.structure_offset :] += (
            0.3 * model.output.weight[L.structure_offset :].sign()
        )
    boi = L.structure_id("<boi>")
    prompts = torch.tensor(
        [[5, 6, boi], [7, 8, 9], [boi, L.size_ids(3, 4)[0], L.size_ids(3, 4)[1]]]
    )
    total = 0
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        n = 25 + 7 * seed  # some budgets are too small for a big image: the grammar must adapt
        c = ImageConstraint(L, 3, max_h=6, max_w=6)
        out = generate(
            model,
            prompts,
            sampling=SamplingConfig(max_new_tokens=n, temperature=1.5, top_k=200),
            constraint=c,
            generator=g,
        )
        for row in out.tolist():
            grids = _parse_images(row, L)
            assert all(h <= 6 and w <= 6 for h, w in grids)
            total += len(grids)
    assert total >= 12  # rows 0 and 2 always hold one image; others appear by chance


def test_forced_size_and_budget(kit):
    model = kit.tiny_config().build().eval()
    L = kit.layout
    boi = L.structure_id("<boi>")
    c = ImageConstraint(L, 1, size=(2, 2))
    out = generate(
        model,
        torch.tensor([[3, boi]]),
        sampling=SamplingConfig(max_new_tokens=9, temperature=1.0),
        constraint=c,
        generator=torch.Generator().manual_seed(0),
    )
    assert _parse_images(out[0].tolist(), L) == [(2, 2)]
    with pytest.raises(ValueError, match="cannot finish the image"):
        generate(
            model,
            torch.tensor([[3, boi]]),
            sampling=SamplingConfig(max_new_tokens=8),
            constraint=ImageConstraint(L, 1, size=(2, 2)),
        )
    with pytest.raises(ValueError, match="breaks the image layout"):
        ImageConstraint(L, 1).observe(0, L.code_id(0))


def test_sampling_modes():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0]]).repeat(400, 1)
    assert (sample_next(logits, SamplingConfig(temperature=0.0)) == 1).all()
    g = torch.Generator().manual_seed(0)
    topk = sample_next(logits, SamplingConfig(top_k=2), g)
    assert set(topk.tolist()) == {1, 2}
    topp = sample_next(logits, SamplingConfig(top_p=0.6), g)  # p(1) = 0.64 covers 0.6 alone
    assert set(topp.tolist()) == {1}
    hot = sample_next(logits, SamplingConfig(temperature=5.0), g)
    assert len(set(hot.tolist())) == 5


def test_stop_ids_and_padding(kit):
    torch.manual_seed(0)
    model = kit.tiny_config().build().eval()
    prompt = torch.tensor([[5, 6], [7, 8]])
    greedy = generate(model, prompt, sampling=SamplingConfig(max_new_tokens=6, temperature=0.0))
    stop = int(greedy[0, 3])
    out = generate(
        model,
        prompt,
        sampling=SamplingConfig(max_new_tokens=6, temperature=0.0, stop_ids=[stop], pad_id=0),
    )
    assert int(out[0, 3]) == stop and (out[0, 4:] == 0).all()
    assert model.training is False


def test_generation_keeps_text_modality_of_prompt(kit):
    """A code prompt continues as CODE for a MoT model (different FFN than TEXT)."""
    torch.manual_seed(0)
    model = _variant(kit, "mot").build().eval()
    prompt = torch.tensor([[11, 12, 13]])
    s = SamplingConfig(max_new_tokens=4, temperature=0.0)
    as_code = generate(
        model,
        prompt,
        sampling=s,
        layout=kit.layout,
        modality=torch.full((1, 3), int(Modality.CODE)),
    )
    with torch.no_grad():
        full = model(as_code[:, :-1], modality=torch.full((1, 6), int(Modality.CODE)))
    assert int(full[0, -1].argmax()) == int(as_code[0, -1])


def test_guided_drawing_follows_the_guided_log_probabilities(kit):
    """Classifier-free guidance: each greedy step takes the argmax of u + s (c - u), with c after
    the caption and u after the same request without it; s = 1 is plain generation."""
    from model.generate import guide

    torch.manual_seed(0)
    model = kit.tiny_config(grid_embedding=True).build().eval()
    L = kit.layout
    boi = L.structure_id("<boi>")
    prompt = torch.tensor([[1, 5, 6, 7, boi]])
    unconditional = torch.tensor([[1, boi]])
    sampling = SamplingConfig(max_new_tokens=9, temperature=0.0)

    def run(scale):
        return generate(
            model,
            prompt,
            sampling=sampling,
            constraint=ImageConstraint(L, 1, size=(2, 2)),
            unconditional_ids=unconditional,
            guidance=scale,
        )

    plain = generate(
        model, prompt, sampling=sampling, constraint=ImageConstraint(L, 1, size=(2, 2))
    )
    assert torch.equal(run(1.0), plain)
    out = run(4.0)
    check = ImageConstraint(L, 1, size=(2, 2))
    for token in prompt[0].tolist():
        check.observe(0, token, strict=False)
    new = out[0, prompt.shape[1] :].tolist()
    for step, token in enumerate(new):
        cond = _full_logits(model, out[:, : prompt.shape[1] + step], L)
        uncond = _full_logits(
            model, torch.cat([unconditional, out[:, prompt.shape[1] :][:, :step]], 1), L
        )
        guided = guide(cond, uncond, 4.0).masked_fill(~check.allowed(9 - step), float("-inf"))
        assert int(guided.argmax(-1)) == token, f"step {step}"
        check.observe(0, token)
    assert new[-1] == L.structure_id("<eoi>")
