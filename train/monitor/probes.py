"""Probes: measurements on fixed inputs every N steps, for what the training loss cannot show.

- ``attention_stats``: the largest attention logit (q.k / sqrt(d) over the pairs the mask allows)
  and the mean attention entropy, per layer. Hooks on each attention module's q/k projections
  (and QK-norms) capture q and k as the model computes them, and the module's cos/sin; the
  scores are recomputed densely from those. Nothing in ``model/`` changes and no parameter is
  read directly, so it works under ZeRO-3 too. Costs one forward of the probe batch plus the
  dense [B, H, T, T] scores: run it every few hundred steps, on a small batch.
- ``dependence_gap``: on probe rows holding an image followed by its caption, the caption's CE
  with the image it came with against with another image of the same shape (the codes are
  swapped between same-shape blocks, so positions and masks stay identical). Early fusion is
  only working if the gap is clearly above zero.
- ``reverse_dependence_gap``: the other direction, on rows holding a caption followed by its
  image: the image codes' CE after their own caption against after another caption of the same
  length (captions swapped between images of the same shape). Above zero when the visual
  tokens use the text before them (what drawing an image from text needs).
- ``generated_code_use``: images drawn from the model under the grid constraint (at the shape of
  the run's own images: a shape it never saw is no test of what it learned); the entropy of
  the codes drawn, normalised by ln(min(draws, codebook)). A model that draws few distinct codes
  has collapsed its visual side even when its teacher-forced image loss looks fine.
  With it, how alike the drawn images are: the entropy of each image's dominant code across
  the images (flat squares of several colours differ; a collapsed model draws them all alike).
- ``reference_code_use``: the same statistics on the images the run trains on (as many images,
  as many codes from each), the yardstick the drawings are judged against.

Every rank probes its own rows and the results are reduced as sums and counts (the max logit
with a max), so the decision is the same on every rank.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from data.layout import image_block_len
from data.vocab import Modality, VocabLayout
from model.attention import build_attention_mask
from model.generate import ImageConstraint, SamplingConfig, generate
from model.rope import apply_rotary
from train import names
from train.dist import all_reduce_max, all_reduce_sum

MODEL_INPUTS = tuple(key for key in names.MODEL_INPUTS if key != "labels")  # labels: per probe


# --- attention -------------------------------------------------------------------------------------


class _AttentionTap:
    """Captures one attention module's q, k (after QK-norm when the model has it) and cos/sin
    during a forward."""

    # module -> what its output is. The norms run after the projections, so with QK-norm their
    # output replaces the projection's; without it (the configuration whose attention logits
    # grow, and that this probe exists for) the projections' outputs are q and k.
    SOURCES = (("wq", "q"), ("wk", "k"), ("q_norm", "q"), ("k_norm", "k"))

    def __init__(self, attn) -> None:
        self.attn = attn
        self.store: dict[str, Tensor] = {}
        self.handles: list[RemovableHandle] = []
        self.handles.append(attn.register_forward_pre_hook(self._pre))
        for name, key in self.SOURCES:
            mod = getattr(attn, name, None)
            if mod is not None:
                self.handles.append(mod.register_forward_hook(self._grab(key)))

    def _pre(self, module, args):
        self.store["cos"], self.store["sin"] = args[1], args[2]

    def _grab(self, key: str):
        def hook(module, args, out):
            self.store[key] = out  # the norm's output replaces the projection's

        return hook

    def qk(self) -> tuple[Tensor, Tensor]:
        a, s = self.attn, self.store
        B, T = s["q"].shape[:2]
        q = s["q"].reshape(B, T, a.n_heads, a.head_dim).transpose(1, 2)
        k = s["k"].reshape(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, s["cos"], s["sin"]), apply_rotary(k, s["cos"], s["sin"])
        return q.float(), k.float().repeat_interleave(a.n_heads // a.n_kv_heads, dim=1)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def attention_stats(model, batch: dict, device) -> dict[str, float]:
    """``monitor/attn_max_logit`` and ``monitor/attn_entropy`` (min over layers) and per layer."""
    inputs = {k: batch[k].to(device) for k in MODEL_INPUTS}
    B, T = inputs["input_ids"].shape
    taps = [_AttentionTap(layer.attention) for layer in model.layers]
    try:
        model(**inputs)
    finally:
        for t in taps:
            t.remove()
    mask = build_attention_mask(
        B,
        T,
        device,
        doc_ids=inputs["doc_ids"],
        image_ids=inputs["image_ids"],
        sliding_window=model.cfg.attention.sliding_window,
        local_window=model.cfg.attention.local_window,
        bidirectional_images=model.cfg.attention.bidirectional_images,
        backend="sdpa",
    )
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
    allowed = mask.dense if mask.dense is not None else causal
    # Local layers (local/global attention) see their windowed mask.
    local_allowed = mask.local_dense if mask.local_dense is not None else allowed
    layer_allowed = [local_allowed if block.local else allowed for block in model.blocks()]
    real = (batch["labels"].to(device) != -100)[
        :, None, :
    ]  # [B, 1, T] queries that are real tokens
    maxes, ent = [], []
    for t, allowed_here in zip(taps, layer_allowed, strict=True):
        q, k = t.qk()
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~allowed_here, float("-inf"))
        maxes.append(scores.amax())
        p = scores.softmax(-1)
        h = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [B, H, T]
        h = h.masked_fill(~real, 0.0)
        ent.append(torch.stack([h.sum(), real.sum() * q.shape[1]]).double())
    mx = all_reduce_max(torch.stack(maxes).double().cpu())
    es = all_reduce_sum(torch.stack(ent).cpu())
    per_layer = (es[:, 0] / es[:, 1].clamp(min=1)).tolist()
    out = {"monitor/attn_max_logit": float(mx.max()), "monitor/attn_entropy": min(per_layer)}
    for i, (m, e) in enumerate(zip(mx.tolist(), per_layer)):
        out[f"monitor/attn_max_logit/L{i}"] = m
        out[f"monitor/attn_entropy/L{i}"] = e
    return out


# --- cross-modal dependence -----------------------------------------------------------------------


def caption_rows(batch: dict, layout: VocabLayout) -> tuple[Tensor, list[tuple[int, int, int]]]:
    """Caption labels (everything else ignored) and the image blocks ``(row, start, end)`` of rows
    where text follows an image in the same document."""
    ids, labels, lmod = batch["input_ids"], batch["labels"], batch["label_modality"]
    img, doc = batch["image_ids"], batch["doc_ids"]
    keep = torch.full_like(labels, -100)
    blocks = []
    for r in range(ids.shape[0]):
        for i in sorted(set(img[r].tolist()) - {-1}):
            pos = (img[r] == i).nonzero().squeeze(1)
            s, e = int(pos[0]), int(pos[-1]) + 1
            if int(batch["modality"][r, s]) != int(Modality.IMAGE):
                continue
            j = e
            while j < ids.shape[1] and doc[r, j] == doc[r, s] and img[r, j] < 0:
                j += 1
            cap = (lmod[r, e:j] == int(Modality.TEXT)) & (labels[r, e:j] != -100)
            if cap.any():
                keep[r, e:j] = torch.where(cap, labels[r, e:j], keep[r, e:j])
                blocks.append((r, s, e))
    return keep, blocks


def shuffle_images(
    ids: Tensor, blocks: list[tuple[int, int, int]], layout: VocabLayout
) -> tuple[Tensor, int]:
    """Swap the codes of same-shape image blocks in a cycle; returns (ids, images swapped). Two
    blocks have the same shape when their size tokens and their ``<eol>`` pattern agree."""
    groups: dict[tuple, list[tuple[int, int, int]]] = {}
    for r, s, e in blocks:
        block = ids[r, max(0, s - 3) : e]
        shape = torch.where(block >= layout.visual_offset, torch.full_like(block, -1), block)
        groups.setdefault(tuple(shape.tolist()), []).append((r, s, e))
    out, swapped = ids.clone(), 0
    for g in groups.values():
        if len(g) < 2:
            continue
        for (r, s, e), (r2, s2, e2) in zip(g, g[1:] + g[:1]):
            out[r, s:e] = ids[r2, s2:e2]
        swapped += len(g)
    return out, swapped


@torch.no_grad()
def dependence_gap(
    model, batch: dict, layout: VocabLayout, device, *, fault_shuffled: bool = False
) -> dict[str, float]:
    """Caption CE with matched and with shuffled images, and their gap (nats per caption token)."""
    labels, blocks = caption_rows(batch, layout)
    shuffled, swapped = shuffle_images(batch["input_ids"], blocks, layout)
    matched = shuffled if fault_shuffled else batch["input_ids"]  # fault injection: both shuffled
    sums = torch.zeros(3, dtype=torch.float64)
    # Every rank runs the same forwards or none (ZeRO-3 gathers weights collectively).
    if all_reduce_sum(torch.tensor([0.0 if swapped else 1.0], dtype=torch.float64))[0] == 0:
        inputs = {k: batch[k].to(device) for k in MODEL_INPUTS if k != "input_ids"}
        for i, ids in enumerate((matched, shuffled)):
            res = model(input_ids=ids.to(device), labels=labels.to(device), **inputs)
            sums[i] = float(res.ce_sum[int(Modality.TEXT)])
        sums[2] = float(res.count[int(Modality.TEXT)])
    sums = all_reduce_sum(sums)
    if sums[2] == 0:
        return {}
    m, s = float(sums[0] / sums[2]), float(sums[1] / sums[2])
    return {
        "monitor/caption_loss_matched": m,
        "monitor/caption_loss_shuffled": s,
        "monitor/dependence_gap": s - m,
    }


def image_after_caption_rows(
    batch: dict, layout: VocabLayout, *, bos_id: int = 1
) -> tuple[Tensor, list[tuple[int, int, int, int, int]]]:
    """The reverse direction: image-code labels (everything else ignored) and
    ``(row, caption start, caption end, codes start, codes end)`` of image blocks that follow a
    run of text in the same document (a caption before its image). The document's ``<bos>`` is
    not part of the caption: an image that opens its document (a caption after it) has none,
    and counting ``<bos>`` alone as one made every such pair a no-op swap (the demo logged a
    reverse gap of exactly 0.0)."""
    ids, labels, lmod, mod = (
        batch["input_ids"],
        batch["labels"],
        batch["label_modality"],
        batch["modality"],
    )
    img, doc = batch["image_ids"], batch["doc_ids"]
    keep = torch.full_like(labels, -100)
    pairs = []
    for r in range(ids.shape[0]):
        for i in sorted(set(img[r].tolist()) - {-1}):
            pos = (img[r] == i).nonzero().squeeze(1)
            s, e = int(pos[0]), int(pos[-1]) + 1
            b = s - 3  # <boi> and the two size tokens come before the codes
            if int(mod[r, s]) != int(Modality.IMAGE) or b < 1:
                continue
            a = b
            while a > 0 and doc[r, a - 1] == doc[r, s] and int(mod[r, a - 1]) == int(Modality.TEXT):
                a -= 1
            while a < b and int(ids[r, a]) == bos_id:
                a += 1
            if a == b:
                continue
            codes = (lmod[r, b:e] == int(Modality.IMAGE)) & (labels[r, b:e] != -100)
            if codes.any():
                keep[r, b:e] = torch.where(codes, labels[r, b:e], keep[r, b:e])
                pairs.append((r, a, b, s, e))
    return keep, pairs


def swap_images_after_captions(
    ids: Tensor, labels: Tensor, pairs: list[tuple[int, int, int, int, int]]
) -> tuple[Tensor, Tensor, int]:
    """Give each caption another pair's image: cycle the image blocks (``<boi>``, sizes, codes)
    among pairs whose images have the same shape, their code labels moving with them. Every
    caption keeps its length and every block its position, mask and M-RoPE indices, so captions
    of any length mix (swapping the captions instead needs equal lengths, which real captions
    rarely have). Returns (ids, labels, swapped)."""
    groups: dict[tuple, list[tuple[int, int, int]]] = {}
    for row, _, block_start, codes_start, codes_end in pairs:
        # the size tokens and the block's length fix the shape
        shape = tuple(ids[row, block_start:codes_start].tolist()) + (codes_end - codes_start,)
        groups.setdefault(shape, []).append((row, block_start, codes_end))
    out_ids, out_labels, swapped = ids.clone(), labels.clone(), 0
    for group in groups.values():
        if len(group) < 2:
            continue
        for (row, start, end), (row2, start2, end2) in zip(group, group[1:] + group[:1]):
            out_ids[row, start:end] = ids[row2, start2:end2]
            out_labels[row, start:end] = labels[row2, start2:end2]
        swapped += len(group)
    return out_ids, out_labels, swapped


@torch.no_grad()
def reverse_dependence_gap(model, batch: dict, layout: VocabLayout, device) -> dict[str, float]:
    """Image-code CE after the image's own caption and after another image's caption, and their
    gap (nats per code): do the visual tokens attend to the text before them?"""
    labels, pairs = image_after_caption_rows(batch, layout)
    shuffled, shuffled_labels, swapped = swap_images_after_captions(
        batch["input_ids"], labels, pairs
    )
    sums = torch.zeros(3, dtype=torch.float64)
    if all_reduce_sum(torch.tensor([0.0 if swapped else 1.0], dtype=torch.float64))[0] == 0:
        inputs = {k: batch[k].to(device) for k in MODEL_INPUTS if k != "input_ids"}
        for index, (ids, scored) in enumerate(
            ((batch["input_ids"], labels), (shuffled, shuffled_labels))
        ):
            result = model(input_ids=ids.to(device), labels=scored.to(device), **inputs)
            sums[index] = float(result.ce_sum[int(Modality.IMAGE)])
        sums[2] = float(result.count[int(Modality.IMAGE)])
    sums = all_reduce_sum(sums)
    if sums[2] == 0:
        return {}
    matched, mismatched = float(sums[0] / sums[2]), float(sums[1] / sums[2])
    return {
        "monitor/image_loss_matched": matched,
        "monitor/image_loss_shuffled": mismatched,
        "monitor/dependence_gap_reverse": mismatched - matched,
    }


# --- generated visual codes ------------------------------------------------------------------------


@torch.no_grad()
def generated_code_use(
    model,
    layout: VocabLayout,
    device,
    *,
    images: int,
    size: tuple[int, int],
    seed: int,
    bos_id: int = 1,
    counted: bool = True,
) -> dict[str, float]:
    """Entropy (normalised) and coverage of the codes in ``images`` drawn images of ``size``
    (rows, columns of codes), summed over the ranks that are ``counted`` (one of each sequence
    parallel group: its ranks draw the same images, and every rank must run the forwards)."""
    boi = layout.structure_id("<boi>")
    prompt = torch.tensor([[bos_id, boi]] * images, dtype=torch.long, device=device)
    constraint = ImageConstraint(layout, images, vocab_size=model.cfg.vocab_size, size=size)
    n_new = image_block_len(*size) - 1
    gen = torch.Generator(device=device).manual_seed(seed)
    out = generate(
        model,
        prompt,
        sampling=SamplingConfig(max_new_tokens=n_new, temperature=1.0),
        constraint=constraint,
        layout=layout,
        generator=gen,
    )
    new = out[:, 2:]
    valid = (new >= layout.visual_offset) & (new < layout.size)
    codes = new[valid] - layout.visual_offset
    hist = all_reduce_sum(
        torch.bincount(codes.cpu(), minlength=layout.num_codes).double() * counted
    )
    n = float(hist.sum())
    if n == 0:
        return {}
    dominant = [
        int(torch.bincount(row[keep] - layout.visual_offset).argmax())
        for row, keep in zip(new.cpu(), valid.cpu())
        if keep.any()
    ]
    by_image = all_reduce_sum(
        torch.bincount(
            torch.tensor(dominant, dtype=torch.long), minlength=layout.num_codes
        ).double()
        * counted
    )
    return {
        "monitor/gen_code_entropy": _entropy(hist) / math.log(max(2.0, min(n, layout.num_codes))),
        "monitor/gen_code_distinct": float((hist > 0).sum()),
        "monitor/gen_image_diversity": _diversity(by_image, layout.num_codes),
    }


def _entropy(hist: Tensor) -> float:
    share = hist[hist > 0] / hist.sum()
    return float(-(share * share.log()).sum())


def _diversity(dominant_hist: Tensor, num_codes: int) -> float:
    """Entropy of the images' dominant codes over ln(min(images, codebook)): 1 = every image
    led by another code, 0 = all led by one. Flat squares of several colours score high; a
    model that draws every image alike scores near 0."""
    images = float(dominant_hist.sum())
    return _entropy(dominant_hist) / math.log(max(2.0, min(images, num_codes)))


def image_codes(batch: dict, layout: VocabLayout) -> list[tuple[Tensor, tuple[int, int]]]:
    """The visual codes of every image block of a batch (videos left out: the probe draws
    images), one tensor per image in raster order, with the image's shape (rows, columns of
    codes) read from the size tokens before its codes."""
    ids, img, mod = batch["input_ids"], batch["image_ids"], batch["modality"]
    out = []
    for row in range(ids.shape[0]):
        for image in sorted(set(img[row].tolist()) - {-1}):
            pos = (img[row] == image).nonzero().squeeze(1)
            start = int(pos[0])
            if int(mod[row, start]) != int(Modality.IMAGE) or start < 2:
                continue
            names = [
                layout.structure[int(ids[row, start - back]) - layout.structure_offset]
                if layout.structure_offset <= int(ids[row, start - back]) < layout.visual_offset
                else ""
                for back in (2, 1)
            ]
            if not (names[0].startswith("<h=") and names[1].startswith("<w=")):
                continue
            codes = ids[row, pos]
            codes = codes[codes >= layout.visual_offset] - layout.visual_offset
            if len(codes):
                out.append((codes.cpu(), (int(names[0][3:-1]), int(names[1][3:-1]))))
    return out


def code_entropy(codes: Tensor, num_codes: int) -> float:
    """Entropy of ``codes`` over ln(min(len(codes), num_codes)): 1 = every code different (or
    spread as evenly as the codebook allows), 0 = one code."""
    hist = torch.bincount(codes, minlength=num_codes).double()
    return _entropy(hist) / math.log(max(2.0, min(float(hist.sum()), num_codes)))


def reference_code_use(
    images: list[Tensor], layout: VocabLayout, *, per_group: int, want: int, groups: int = 8
) -> dict[str, float]:
    """``generated_code_use``'s statistics on real images: groups of ``per_group`` images,
    ``want`` codes evenly spaced through each (all of a smaller image), the means over up to
    ``groups`` groups; summed over ranks. Absent when no rank has a whole group."""
    sums = torch.zeros(3, dtype=torch.float64)
    for start in range(0, min(len(images), per_group * groups) - per_group + 1, per_group):
        picked = []
        for codes in images[start : start + per_group]:
            step = max(1, len(codes) // want)
            picked.append(codes[::step][:want])
        dominant = torch.tensor([int(torch.bincount(codes).argmax()) for codes in picked])
        sums[0] += code_entropy(torch.cat(picked), layout.num_codes)
        sums[1] += _diversity(
            torch.bincount(dominant, minlength=layout.num_codes).double(), layout.num_codes
        )
        sums[2] += 1
    sums = all_reduce_sum(sums)
    if sums[2] == 0:
        return {}
    return {
        "monitor/ref_code_entropy": float(sums[0] / sums[2]),
        "monitor/ref_image_diversity": float(sums[1] / sums[2]),
    }
