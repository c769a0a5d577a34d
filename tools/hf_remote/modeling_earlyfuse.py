"""Qwen3 plus earlyfuse's row and column embeddings of image codes (``model.grid_embedding``).

Written into a Hugging Face export by ``earlyfuse-convert hf`` (the export's README.md says how
to load it) and loaded with ``trust_remote_code=True``. Self-contained: it travels as a file,
so it imports torch and transformers only.

An image code's input embedding is its token embedding plus its row's and its column's, placed
from the whole token history exactly as earlyfuse's ``LayoutTracker`` places it. Because that
depends on everything before a token, ``generate`` works the places out from all ids in
``prepare_inputs_for_generation`` and passes the new tokens' part to ``forward`` as
``image_grid``; a plain ``forward`` over whole sequences computes it itself.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import Qwen3Config, Qwen3ForCausalLM

# config.earlyfuse_grid: the ids that shape an image or video block, the code id range
# [code_start, code_end) and the largest grid side (the tables' length).
GRID_KEYS = ("max_grid", "code_start", "code_end", "boi", "eoi", "bov", "eov", "eol", "frame")


class EarlyfuseConfig(Qwen3Config):
    """Qwen3's config; ``earlyfuse_grid`` (a dict with GRID_KEYS) travels as an extra field."""

    model_type = "earlyfuse_qwen3"


def _last_index(mask: Tensor) -> Tensor:
    """[B, T]: the index of the last True at or before each position (-1 if none)."""
    index = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask, index, torch.full_like(index, -1)).cummax(dim=1).values


def _since(counts: Tensor, start: Tensor) -> Tensor:
    """counts[i] - counts[start[i]]: how many of the counted tokens lie in (start, i]."""
    return counts - counts.gather(1, start.clamp(min=0))


def image_grid_of(input_ids: Tensor, grid: dict) -> Tensor:
    """[B, T, 3] long: (row, column, 1 if an image code else 0) of every token of ``input_ids``
    [B, T], each sequence read from its first token. Rows and columns are 0 where the flag is 0.

    A code inside an image block: row = <eol>s since the block opened (or since its last
    <frame>), column = codes since the row began, each less the block's <frame> count, as
    earlyfuse's (t, h, w) positions give row = h - t, col = w - t."""
    ids = input_ids.long()
    is_code = (ids >= grid["code_start"]) & (ids < grid["code_end"])
    last_open = _last_index((ids == grid["boi"]) | (ids == grid["bov"]))
    last_close = _last_index((ids == grid["eoi"]) | (ids == grid["eov"]))
    in_block = last_open > last_close
    opened_by = ids.gather(1, last_open.clamp(min=0))
    in_image = in_block & (opened_by == grid["boi"])
    in_video = in_block & (opened_by == grid["bov"])
    is_frame = ids == grid["frame"]
    is_eol = ids == grid["eol"]
    # A <frame> restarts the rows, an <eol> (or a <frame>) the columns; the block's opener both.
    row_start = torch.maximum(last_open, _last_index(is_frame))
    col_start = torch.maximum(row_start, _last_index(is_eol))
    frames = _since(is_frame.long().cumsum(1), last_open)
    rows = _since(is_eol.long().cumsum(1), row_start) - frames
    cols = _since(is_code.long().cumsum(1), col_start) - 1 - frames  # - 1: not the code itself
    last = grid["max_grid"] - 1
    inside = is_code & in_image
    rows = torch.where(inside, rows.clamp(0, last), torch.zeros_like(rows))
    cols = torch.where(inside, cols.clamp(0, last), torch.zeros_like(cols))
    image = is_code & ~in_video
    return torch.stack([rows, cols, image.long()], dim=-1)


class EarlyfuseForCausalLM(Qwen3ForCausalLM):
    """``Qwen3ForCausalLM`` whose image codes also get row and column embeddings."""

    config_class = EarlyfuseConfig

    def __init__(self, config: EarlyfuseConfig) -> None:
        super().__init__(config)
        max_grid = int(config.earlyfuse_grid["max_grid"])
        self.grid_rows = nn.Embedding(max_grid, config.hidden_size)
        self.grid_cols = nn.Embedding(max_grid, config.hidden_size)
        self.post_init()

    def grid_embedding(self, grid: Tensor) -> Tensor:
        """[B, T, hidden]: row + column embedding of image codes, zero elsewhere."""
        image = grid[..., 2:3].to(self.grid_rows.weight.dtype)
        return (self.grid_rows(grid[..., 0]) + self.grid_cols(grid[..., 1])) * image

    def _grid_of(self, input_ids: Tensor, kwargs: dict) -> Tensor:
        """image_grid_of ids given without the tokens before them (no ``image_grid``)."""
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        get_seq_length = getattr(cache, "get_seq_length", None)
        seen = get_seq_length() if get_seq_length is not None else 0
        grid = self.config.earlyfuse_grid
        has_code = bool(((input_ids >= grid["code_start"]) & (input_ids < grid["code_end"])).any())
        if seen and has_code:
            raise ValueError(
                "image codes after a KV cache: their rows and columns depend on the earlier "
                "tokens; pass image_grid=image_grid_of(all_ids, config.earlyfuse_grid)[:, -n:] "
                "or use model.generate, which does"
            )
        return image_grid_of(input_ids, grid)

    def forward(self, input_ids=None, attention_mask=None, *args, image_grid=None, **kwargs):
        if input_ids is not None and kwargs.get("inputs_embeds") is None:
            grid = image_grid if image_grid is not None else self._grid_of(input_ids, kwargs)
            kwargs["inputs_embeds"] = self.model.embed_tokens(input_ids) + self.grid_embedding(grid)
            input_ids = None  # attention_mask is named: generate(**tokenizer(text)) looks for it
        return super().forward(input_ids, attention_mask, *args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        new_ids = inputs.get("input_ids")
        if new_ids is not None:
            # input_ids is the whole history here; the model sees its last new_ids.shape[1] tokens.
            full = image_grid_of(input_ids, self.config.earlyfuse_grid)
            inputs["image_grid"] = full[:, full.shape[1] - new_ids.shape[1] :]
        return inputs
