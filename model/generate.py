"""Sampling with a KV cache, and a grammar that keeps generated images decodable.

Design choices:
- The prompt runs once (prefill, which may use bidirectional image attention if the model has
  it); each new token then runs alone against the per-layer KV caches. Greedy when temperature
  is 0; otherwise temperature, then top-k, then top-p (nucleus), then a multinomial draw from an
  optional torch.Generator, so sampling is reproducible.
- ``ImageConstraint`` is a per-row state machine over the Emu3-style layout. Inside an image
  block only the one legal kind of token can be sampled: ``<boi>`` -> ``<h=H>`` -> ``<w=W>`` ->
  H rows of exactly W codes each closed by ``<eol>`` -> ``<eoi>``. Outside a block, codes, row
  and size markers, ``<eoi>`` and the video markers cannot be sampled (video generation is not
  constrained, so it is not offered). The token budget is part of the grammar: ``<boi>`` and
  each size are allowed only if the whole image still fits in ``max_new_tokens``, so an image is
  never cut off; ``size`` forces one grid, ``max_h``/``max_w`` cap it.
- (t, h, w) positions and modality ids of generated tokens come from ``LayoutTracker``, the
  same code that defines them for training data; text ids keep the prompt's last text-like
  modality (TEXT or CODE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from data.vocab import Modality, VocabLayout
from model.rope import LayoutTracker

OUT, NEED_H, NEED_W, GRID, NEED_EOI = range(5)


@dataclass(kw_only=True)
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    stop_ids: list[int] = field(default_factory=list)
    pad_id: int = 0  # emitted by rows that already stopped

    def __post_init__(self) -> None:
        # Refused here, not clamped: a negative temperature or a top_p of 0 would otherwise
        # sample silently from something other than what was asked for (an infinite
        # temperature, from no distribution at all: softmax of inf - inf is nan).
        for name, value, allowed, ok in (
            ("max_new_tokens", self.max_new_tokens, "at least 1", self.max_new_tokens >= 1),
            (
                "temperature",
                self.temperature,
                "0 (greedy) or more, finite",
                0 <= self.temperature < math.inf,
            ),
            ("top_k", self.top_k, "0 (off) or more", self.top_k >= 0),
            ("top_p", self.top_p, "in (0, 1] (1: off)", 0 < self.top_p <= 1),
        ):
            if not ok:
                raise ValueError(f"{name} {value}: must be {allowed}")


def check_guidance(guidance: float) -> None:
    """Refuses a guidance scale that is not a finite number: every guided log-probability would
    be nan or inf."""
    if not math.isfinite(guidance):
        raise ValueError(f"guidance {guidance}: must be a finite number (1: off)")


class ImageConstraint:
    def __init__(
        self,
        layout: VocabLayout,
        batch_size: int,
        *,
        vocab_size: int | None = None,
        max_h: int | None = None,
        max_w: int | None = None,
        size: tuple[int, int] | None = None,
    ) -> None:
        self.layout, self.B = layout, batch_size
        self.V = vocab_size or layout.size
        sid = layout.structure_id
        self.boi, self.eoi, self.eol = sid("<boi>"), sid("<eoi>"), sid("<eol>")
        self.h0, self.w0 = sid("<h=1>"), sid("<w=1>")
        self.max_h = min(max_h or layout.max_grid, layout.max_grid)
        self.max_w = min(max_w or layout.max_grid, layout.max_grid)
        self.size = size
        if size is not None and not (
            1 <= size[0] <= layout.max_grid and 1 <= size[1] <= layout.max_grid
        ):
            raise ValueError(f"image size {size} outside 1..{layout.max_grid}")
        if any(side is not None and side < 1 for side in (max_h, max_w)):  # 0 is not "no cap"
            raise ValueError(f"largest side {max_h}x{max_w}: must be at least 1")
        self.state = [OUT] * batch_size
        self.H, self.W = [0] * batch_size, [0] * batch_size
        self.row, self.col = [0] * batch_size, [0] * batch_size
        self._out = torch.ones(self.V, dtype=torch.bool)
        self._out[layout.structure_offset : layout.visual_offset] = (
            False  # every structure token ...
        )
        self._out[self.boi] = True  # ... except <boi> (budget permitting)
        self._out[layout.visual_offset : layout.size] = False
        self._codes = torch.zeros(self.V, dtype=torch.bool)
        self._codes[layout.visual_offset : layout.size] = True

    # --- sizes and budget -------------------------------------------------------------------
    def _min_wh(self) -> tuple[int, int]:
        return self.size if self.size is not None else (1, 1)

    def tokens_to_finish(self, b: int) -> int:
        """Fewest tokens that close row b's open image (0 outside one)."""
        hmin, wmin = self._min_wh()
        state = self.state[b]
        if state == NEED_H:
            return 1 + 1 + hmin * (wmin + 1) + 1
        if state == NEED_W:
            return 1 + self.H[b] * (wmin + 1) + 1
        if state == GRID:
            return (
                (self.W[b] - self.col[b]) + 1 + (self.H[b] - self.row[b] - 1) * (self.W[b] + 1) + 1
            )
        return 1 if state == NEED_EOI else 0

    def allowed(self, remaining: int) -> Tensor:
        """[B, V] bool: what each row may sample when ``remaining`` tokens (this one included) are left."""
        rows = []
        hmin, wmin = self._min_wh()
        for row_index in range(self.B):
            state, mask = self.state[row_index], torch.zeros(self.V, dtype=torch.bool)
            if state == OUT:
                mask = self._out.clone()
                mask[self.boi] = remaining >= 4 + hmin * (wmin + 1)
            elif state == NEED_H:
                high = min(self.max_h, (remaining - 3) // (wmin + 1))
                low, high = (self.size[0], self.size[0]) if self.size else (1, high)
                mask[self.h0 + low - 1 : self.h0 + high] = True
            elif state == NEED_W:
                high = min(self.max_w, (remaining - 2) // self.H[row_index] - 1)
                low, high = (self.size[1], self.size[1]) if self.size else (1, high)
                mask[self.w0 + low - 1 : self.w0 + high] = True
            elif state == GRID:
                mask = self._codes.clone() if self.col[row_index] < self.W[row_index] else mask
                mask[self.eol] = self.col[row_index] == self.W[row_index]
            else:
                mask[self.eoi] = True
            rows.append(mask)
        return torch.stack(rows)

    # --- state ------------------------------------------------------------------------------
    def observe(self, b: int, tok: int, *, strict: bool = True) -> None:
        """Advance row b past ``tok``; a token the grammar forbids raises ValueError. With
        ``strict=False`` (prompts) anything goes outside an image block, e.g. a video to caption."""
        tok, state = int(tok), self.state[b]
        legal = True
        if state == OUT:
            legal = not strict or tok == self.boi or (tok < self.V and bool(self._out[tok]))
            if tok == self.boi:
                self.state[b] = NEED_H
        elif state == NEED_H:
            legal = self.h0 <= tok < self.h0 + self.layout.max_grid
            self.H[b], self.state[b] = tok - self.h0 + 1, NEED_W
        elif state == NEED_W:
            legal = self.w0 <= tok < self.w0 + self.layout.max_grid
            self.W[b], self.state[b], self.row[b], self.col[b] = tok - self.w0 + 1, GRID, 0, 0
        elif state == GRID:
            if self.col[b] < self.W[b]:
                legal = self.layout.is_code(tok)
                self.col[b] += 1
            else:
                legal = tok == self.eol
                self.row[b], self.col[b] = self.row[b] + 1, 0
                if self.row[b] == self.H[b]:
                    self.state[b] = NEED_EOI
        else:
            legal = tok == self.eoi
            self.state[b] = OUT
        if not legal:
            raise ValueError(f"token {tok} breaks the image layout in row {b} (state {state})")


def sample_next(
    logits: Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None
) -> Tensor:
    """logits [B, V] (disallowed ids already -inf) -> next ids [B]."""
    if cfg.temperature <= 0:
        return logits.argmax(-1)
    logits = logits / cfg.temperature
    if cfg.top_k > 0:
        kth = logits.topk(min(cfg.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > cfg.top_p  # mass before this token already exceeds p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


class _Decoder:
    """One batch of prompts run against its own KV caches: the prefill, then one token a step.
    Knows each generated token's (t, h, w) position and modality from ``LayoutTracker``."""

    def __init__(self, model, prompt_ids, *, layout, modality, image_ids, max_new) -> None:
        self.model = model
        batch_size, self.prompt_len = prompt_ids.shape
        device = self.device = prompt_ids.device
        mod = (
            modality.clone()
            if modality is not None
            else torch.full_like(prompt_ids, int(Modality.TEXT))
        )
        thw = None
        self.trackers = (
            [LayoutTracker(layout) for _ in range(batch_size)] if layout is not None else None
        )
        if self.trackers is not None:
            rows = [
                [self.trackers[row].push(int(token)) for token in prompt_ids[row].tolist()]
                for row in range(batch_size)
            ]
            thw = torch.tensor(
                [[position for position, _ in row_positions] for row_positions in rows],
                dtype=torch.long,
                device=device,
            ).reshape(batch_size, self.prompt_len, 3)
            if modality is None:
                mod = torch.tensor(
                    [[modality_id for _, modality_id in row_positions] for row_positions in rows],
                    dtype=torch.long,
                    device=device,
                )
            # generated text continues the prompt's last text-like modality
            for row in range(batch_size):
                textlike = [
                    int(modality_id)
                    for modality_id in mod[row].tolist()
                    if modality_id in (Modality.TEXT, Modality.CODE)
                ]
                self.trackers[row].text_modality = textlike[-1] if textlike else int(Modality.TEXT)
        self.caches = model.make_kv_caches(batch_size, self.prompt_len + max_new, device=device)
        self.logits = model.decode(
            prompt_ids, self.caches, 0, position_thw=thw, modality=mod, image_ids=image_ids
        )
        self.last_mod = mod[:, -1].clone()
        self.steps = 0

    def advance(self, nxt: Tensor, finished: Tensor) -> None:
        """Feed the sampled tokens [B] (rows already finished are left where they were)."""
        batch_size = nxt.shape[0]
        step_thw = torch.zeros(batch_size, 1, 3, dtype=torch.long, device=self.device)
        if self.trackers is not None:
            for row, tok in enumerate(nxt.tolist()):
                if not finished[row]:
                    pos, modality_id = self.trackers[row].push(tok)
                    step_thw[row, 0] = torch.tensor(pos)
                    self.last_mod[row] = int(modality_id)
        start = self.prompt_len + self.steps
        self.steps += 1
        self.logits = self.model.decode(
            nxt[:, None],
            self.caches,
            start,
            position_ids=torch.full((batch_size, 1), start, dtype=torch.long, device=self.device),
            position_thw=step_thw if self.trackers is not None else None,
            modality=self.last_mod[:, None].clone(),
        )


def guide(conditional: Tensor, unconditional: Tensor, scale: float) -> Tensor:
    """Classifier-free guidance on log-probabilities: u + scale * (c - u) (scale 1: c)."""
    cond, uncond = conditional.float().log_softmax(-1), unconditional.float().log_softmax(-1)
    return uncond + scale * (cond - uncond)


@torch.no_grad()
def generate(
    model,
    prompt_ids: Tensor,
    *,
    sampling: SamplingConfig | None = None,
    constraint: ImageConstraint | None = None,
    layout: VocabLayout | None = None,
    modality: Tensor | None = None,
    image_ids: Tensor | None = None,
    generator: torch.Generator | None = None,
    unconditional_ids: Tensor | None = None,
    guidance: float = 1.0,
) -> Tensor:
    """Continue ``prompt_ids`` [B, T0] (equal-length prompts) by up to max_new_tokens: [B, T0 + n].

    With ``unconditional_ids`` [B, T1] (the same request without its condition, e.g. only
    ``<bos> <boi>`` where the prompt is ``<bos> caption <boi>``) and ``guidance`` > 1, every step
    samples from classifier-free guided log-probabilities (``guide``), as Make-A-Scene, Parti
    and Chameleon draw images; both prompts see the same sampled tokens."""
    cfg = sampling or SamplingConfig()
    batch_size = prompt_ids.shape[0]
    max_new, device = cfg.max_new_tokens, prompt_ids.device
    layout = layout or (constraint.layout if constraint is not None else None)
    if (model.cfg.rope.mrope_sections or model.cfg.grid_embedding) and layout is None:
        raise ValueError(
            "an M-RoPE or grid-embedding model needs the vocabulary layout to place generated tokens"
        )
    check_guidance(guidance)
    guided = unconditional_ids is not None and guidance != 1.0
    if unconditional_ids is not None and unconditional_ids.shape[0] != batch_size:
        raise ValueError("unconditional_ids needs as many rows as prompt_ids")
    was_training = model.training
    model.eval()
    try:
        if constraint is not None:
            for row in range(batch_size):
                for token in prompt_ids[row].tolist():
                    constraint.observe(row, token, strict=False)
                if constraint.tokens_to_finish(row) > max_new:
                    raise ValueError(
                        f"max_new_tokens={max_new} cannot finish the image that prompt row "
                        f"{row} opened"
                    )
        decoders = [
            _Decoder(
                model,
                prompt_ids,
                layout=layout,
                modality=modality,
                image_ids=image_ids,
                max_new=max_new,
            )
        ]
        if guided and unconditional_ids is not None:
            decoders.append(
                _Decoder(
                    model,
                    unconditional_ids,
                    layout=layout,
                    modality=None,
                    image_ids=None,
                    max_new=max_new,
                )
            )
        out = [prompt_ids]
        finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
        stop = torch.tensor(cfg.stop_ids, dtype=torch.long, device=device)
        for step in range(max_new):
            logits = decoders[0].logits
            if guided:
                logits = guide(logits, decoders[1].logits, guidance)
            if constraint is not None:
                logits = logits.masked_fill(
                    ~constraint.allowed(max_new - step).to(device), float("-inf")
                )
            nxt = sample_next(logits, cfg, generator)
            nxt = torch.where(finished, torch.full_like(nxt, cfg.pad_id), nxt)
            out.append(nxt[:, None])
            if constraint is not None:
                for row, tok in enumerate(nxt.tolist()):
                    if not finished[row]:
                        constraint.observe(row, tok)
            was_finished = finished.clone()
            finished |= torch.isin(nxt, stop)
            if bool(finished.all()) or step == max_new - 1:
                break
            for decoder in decoders:
                decoder.advance(nxt, was_finished)
        return torch.cat(out, dim=1)
    finally:
        model.train(was_training)
