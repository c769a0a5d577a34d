"""The early-fusion decoder: one transformer over text, code, image and video tokens.

Design choices:
- Llama-family block: pre-norm RMSNorm, GQA attention with QK-norm and RoPE/M-RoPE, SwiGLU;
  no biases; untied input and output embeddings.
- ``reorder_norm`` (Chameleon's "swin-norm"): x + norm(attn(x)), h + norm(ffn(h)); the norm
  sits on the branch output, bounding what each block adds to the residual stream.
- The FFN of a block is dense, modality-routed (MoT, ``ffn.modality_groups``) or a learned MoE
  (``moe.num_experts``); setting both is a config error.
- Init: truncated normal(0, init_std) for input-side weights; output projections of every
  residual branch (attention wo, FFN w2) get init_std / sqrt(2 * n_layers) (GPT-2 / Megatron
  depth scaling); the LM head gets dim^-0.5, so initial logits have unit scale and the
  initial loss is about ln V.
- ``forward`` takes the loader's batch tensors by name (``model(**batch)`` works) and returns a
  ``LossResult`` when labels are given, logits otherwise; ``final_hidden`` stops before the
  head, for evaluations that score a few positions of a long row (``output.logits`` of those
  positions: the head's maths stays in one place, model/loss.py). The attention mask and RoPE
  cos/sin are built once per batch and shared by all layers (with local/global attention: two
  masks and two RoPE tables, each shared by the layers of its kind). The model is a plain
  nn.Module: DeepSpeed wraps it as is and calls ``engine.backward(result.loss)``.
- Activation checkpointing is a per-block flag (``activation_checkpoint_every``: 1 = every
  block, 2 = every other, 0 = none), non-reentrant torch.utils.checkpoint.
- ``compile_blocks`` compiles each block and the loss head on their own (``torch.compile``,
  ``fullgraph=True``: a graph break is an error, not a silent slowdown), as torchtitan and
  OLMo-core do: one block's graph is compiled once and reused by every layer, and the mask and
  RoPE tables built once per batch come in as inputs. A block with a modality-routed FFN or a
  MoE compiles its attention only: their routing picks rows by the data (``nonzero``).
  ``Module.compile`` leaves the module tree and the state-dict keys as they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from data.vocab import Modality, VocabLayout
from model.attention import (
    Attention,
    AttentionConfig,
    AttentionMask,
    KVCache,
    build_attention_mask,
    decode_mask,
)
from model.layers import FeedForward, FFNConfig, ModalityFFN, RMSNorm
from model.loss import LossConfig, LossResult, OutputHead
from model.moe import MoE, MoEConfig
from model.rope import RopeConfig, RotaryEmbedding

# Graphs a compiled block may keep (compile_blocks): 16 ways a run calls it, with room to spare
RECOMPILE_LIMIT = 64


@dataclass(kw_only=True)
class TransformerConfig:
    # Vocabulary (fill from the run's VocabLayout with ``with_layout``).
    vocab_size: int = 1550
    text_vocab_size: int = 512  # ids [0, text_vocab_size): text/code, the "text slice"
    visual_offset: int = 550  # ids [visual_offset, vocab_size): visual codes
    max_grid: int = 64  # largest image side in tokens (the layout's; sizes the grid embedding)
    # Sizes.
    dim: int = 64
    n_layers: int = 2
    norm_eps: float = 1e-5
    reorder_norm: bool = False
    init_std: float = 0.02
    # A learned embedding of an image code's row and column, added to its input embedding
    # (DALL-E's row/column embeddings). RoPE only tells attention how far apart two tokens are,
    # so without it a small model must count <eol> tokens to know where in the picture a code
    # sits: "in the top left" has nothing to bind to (docs/benchmarks.md, "The demo, held out").
    grid_embedding: bool = False
    activation_checkpoint_every: int = 0
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    rope: RopeConfig = field(default_factory=RopeConfig)
    ffn: FFNConfig = field(default_factory=FFNConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        # Hydra/OmegaConf may hand nested configs over as dicts.
        for name, cls in (
            ("attention", AttentionConfig),
            ("rope", RopeConfig),
            ("ffn", FFNConfig),
            ("moe", MoEConfig),
            ("loss", LossConfig),
        ):
            if isinstance(getattr(self, name), dict):
                setattr(self, name, cls(**getattr(self, name)))
        if not 0 <= self.text_vocab_size <= self.visual_offset <= self.vocab_size:
            sizes = ("vocab_size", "text_vocab_size", "visual_offset")
            # One size typed by hand against the others' placeholders: the layout sets all three
            kept = [n for n in sizes if getattr(self, n) == getattr(TransformerConfig, n)]
            hint = (
                f" ({', '.join(f'model.{n}' for n in kept)}: the schema's placeholder; a run on "
                "token data takes all three sizes from the tokenizers' vocabulary layout: leave "
                "them out)"
                if kept
                else ""
            )
            raise ValueError(
                f"need 0 <= model.text_vocab_size ({self.text_vocab_size}) <= model.visual_offset ({self.visual_offset}) "
                f"<= model.vocab_size ({self.vocab_size}){hint}"
            )
        if self.dim <= 0 or self.n_layers <= 0:
            raise ValueError(
                f"model.dim ({self.dim}) and model.n_layers ({self.n_layers}) must be positive"
            )
        if not self.init_std > 0:
            raise ValueError(f"model.init_std {self.init_std}: give a standard deviation above 0")
        if self.activation_checkpoint_every < 0:
            raise ValueError(
                f"model.activation_checkpoint_every {self.activation_checkpoint_every}: give 0 (off), "
                "1 (every block) or more"
            )
        if self.moe.enabled and self.ffn.modality_groups:
            raise ValueError(
                "choose one of model.moe.num_experts and model.ffn.modality_groups, not both"
            )
        if self.attention.local_window and self.n_layers < self.attention.global_every:
            raise ValueError(
                f"model.n_layers={self.n_layers} with model.attention.global_every="
                f"{self.attention.global_every} has no global layer (layer global_every - 1 is "
                "the first): lower global_every or drop model.attention.local_window"
            )
        if self.rope.local_theta and not self.attention.local_window:
            raise ValueError(
                f"model.rope.local_theta={self.rope.local_theta} is the local layers' RoPE base, but "
                "model.attention.local_window is 0 (no local layers)"
            )
        head_dim = self.head_dim
        if self.rope.mrope_sections and sum(self.rope.mrope_sections) != head_dim // 2:
            raise ValueError(
                f"model.rope.mrope_sections {self.rope.mrope_sections} must sum to "
                f"head_dim // 2 = {head_dim // 2}"
            )

    @property
    def head_dim(self) -> int:
        return self.attention.resolved_head_dim(self.dim)

    def with_layout(self, layout: VocabLayout, *, strict: bool = True) -> TransformerConfig:
        """This config over ``layout``'s ids. A value given by hand that is neither the schema's
        placeholder nor the layout's is refused (``strict``): it would be dropped without a word.
        A checkpoint's own config is read with ``strict=False``: it trained on the layout's
        sizes, whatever its config.yaml says."""
        sizes = {
            "vocab_size": layout.size,
            "text_vocab_size": layout.text_size,
            "visual_offset": layout.visual_offset,
            "max_grid": layout.max_grid,
        }
        given = {
            name: getattr(self, name)
            for name, value in sizes.items()
            if getattr(self, name) not in (value, getattr(TransformerConfig, name))
        }
        if given and strict:
            raise ValueError(
                ", ".join(f"model.{name}={value}" for name, value in given.items())
                + ": set from the tokenizers' vocabulary layout ("
                + ", ".join(f"{name} {sizes[name]}" for name in given)
                + "), not by hand; leave it out (the vocabulary comes from the tokenizers)"
            )
        return dataclasses.replace(
            self,
            vocab_size=layout.size,
            text_vocab_size=layout.text_size,
            visual_offset=layout.visual_offset,
            max_grid=layout.max_grid,
        )

    def build(self, device: torch.device | str | None = None) -> Transformer:
        with torch.device(device or "cpu"):
            model = Transformer(self)
        if torch.device(device or "cpu").type != "meta":
            model.init_weights()
        return model


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig, layer_id: int) -> None:
        super().__init__()
        self.reorder_norm = cfg.reorder_norm
        every = cfg.activation_checkpoint_every
        self.checkpoint = every > 0 and layer_id % every == 0
        self.local = cfg.attention.is_local(layer_id)  # local/global: windowed, own RoPE base
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg.dim, cfg.attention, cfg.norm_eps)
        hidden = cfg.ffn.resolved_hidden_dim(cfg.dim)
        self.feed_forward: MoE | ModalityFFN | FeedForward
        if cfg.moe.enabled:
            self.feed_forward = MoE(cfg.dim, hidden, cfg.moe)
        elif cfg.ffn.modality_groups:
            self.feed_forward = ModalityFFN(cfg.dim, cfg.ffn)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn)

    def forward(self, x, cos, sin, mask, modality, cache=None, cache_start=0):
        if self.checkpoint and self.training and torch.is_grad_enabled() and cache is None:
            return checkpoint(self._forward, x, cos, sin, mask, modality, use_reentrant=False)
        return self._forward(x, cos, sin, mask, modality, cache, cache_start)

    def _forward(self, x, cos, sin, mask, modality, cache=None, cache_start=0):
        if self.reorder_norm:
            hidden = x + self.attention_norm(self.attention(x, cos, sin, mask, cache, cache_start))
            ffn_out, stats = self.feed_forward(hidden, modality)
            return hidden + self.ffn_norm(ffn_out), stats
        hidden = x + self.attention(self.attention_norm(x), cos, sin, mask, cache, cache_start)
        ffn_out, stats = self.feed_forward(self.ffn_norm(hidden), modality)
        return hidden + ffn_out, stats


def positions_from_doc_ids(doc_ids: Tensor) -> Tensor:
    """1D positions that restart at 0 at every document start: [B, T] long."""
    batch_size, seq_len = doc_ids.shape
    positions = torch.arange(seq_len, device=doc_ids.device).expand(batch_size, seq_len)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return (
        positions - torch.where(start, positions, torch.zeros_like(positions)).cummax(dim=1).values
    )


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.grid_rows = nn.Embedding(cfg.max_grid, cfg.dim) if cfg.grid_embedding else None
        self.grid_cols = nn.Embedding(cfg.max_grid, cfg.dim) if cfg.grid_embedding else None
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope)
        local_theta = cfg.rope.local_theta
        # The local layers' table (local/global attention with their own RoPE base); no weights.
        self.local_rope = (
            RotaryEmbedding(cfg.head_dim, cfg.rope, theta=local_theta)
            if local_theta and local_theta != cfg.rope.theta
            else None
        )
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = OutputHead(
            cfg.dim,
            cfg.vocab_size,
            cfg.loss,
            text_end=cfg.text_vocab_size,
            visual_start=cfg.visual_offset,
        )

    @torch.no_grad()
    def init_weights(self) -> None:
        std = self.cfg.init_std
        out_std = std / (2 * self.cfg.n_layers) ** 0.5
        nn.init.trunc_normal_(self.tok_embeddings.weight, std=std, a=-3 * std, b=3 * std)
        for grid in (self.grid_rows, self.grid_cols):
            if grid is not None:
                nn.init.trunc_normal_(grid.weight, std=std, a=-3 * std, b=3 * std)
        for layer in self.blocks():
            layer.attention.init_weights(std, out_std)
            layer.feed_forward.init_weights(std, out_std)
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        head_std = self.cfg.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, std=head_std, a=-3 * head_std, b=3 * head_std)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        total = sum(param.numel() for param in self.parameters())
        if not exclude_embeddings:
            return total
        tables = [self.tok_embeddings, self.grid_rows, self.grid_cols]
        return total - sum(table.weight.numel() for table in tables if table is not None)

    # --- the trunk --------------------------------------------------------------------------
    def _trunk(
        self,
        input_ids,
        *,
        position_ids,
        position_thw,
        modality,
        mask: AttentionMask,
        caches=None,
        cache_start=0,
    ):
        hidden = self.tok_embeddings(input_ids)
        if self.grid_rows is not None and self.grid_cols is not None and position_thw is not None:
            hidden = hidden + self._grid_embedding(position_thw, modality)
        # Built once per forward, shared by the layers of their kind (local/global attention).
        cos, sin = self.rope(position_ids, position_thw)
        local_cos, local_sin = (
            self.local_rope(position_ids, position_thw) if self.local_rope else (cos, sin)
        )
        local_mask = mask.local() if self.cfg.attention.local_window else mask
        stats = []
        for layer_index, layer in enumerate(self.blocks()):
            cache = caches[layer_index] if caches is not None else None
            if layer.local:
                hidden, layer_stats = layer(
                    hidden, local_cos, local_sin, local_mask, modality, cache, cache_start
                )
            else:
                hidden, layer_stats = layer(hidden, cos, sin, mask, modality, cache, cache_start)
            if layer_stats is not None:
                stats.append(layer_stats)
        return hidden, stats

    def compile_blocks(self, *, backend: str = "inductor") -> None:
        """Compile every block (or, for routed FFNs, its attention) and the loss head, each
        with ``fullgraph=True`` and static shapes (a packed batch's shape never changes).

        A block keeps one graph for each way a run calls it: training or evaluation, rows of
        several documents or of one (no mask), checkpointed or not (``activation_checkpoint_every``
        above 1), local or global (their masks differ): up to 16, past dynamo's default of 8
        graphs a function, which with ``fullgraph=True`` ends the run. The limit is raised to
        ``RECOMPILE_LIMIT`` for the process; the probes and decoding run eager."""
        for name in ("recompile_limit", "cache_size_limit"):  # torch 2.7 renamed it
            if hasattr(torch._dynamo.config, name):
                limit = max(getattr(torch._dynamo.config, name), RECOMPILE_LIMIT)
                setattr(torch._dynamo.config, name, limit)
        for layer in self.blocks():
            target = layer if isinstance(layer.feed_forward, FeedForward) else layer.attention
            target.compile(fullgraph=True, dynamic=False, backend=backend)
        self.output.compile(fullgraph=True, dynamic=False, backend=backend)

    def _grid_embedding(self, position_thw: Tensor, modality: Tensor) -> Tensor:
        """Row and column embeddings of image codes, zero elsewhere. An image's codes sit at
        (t, h, w) = (s, s + row, s + col) (LayoutTracker), so row = h - t and col = w - t.
        Video codes are left out: their t also counts frames, so h - t is not their row."""
        assert self.grid_rows is not None and self.grid_cols is not None
        image = (modality == int(Modality.IMAGE)).unsqueeze(-1)
        last = self.cfg.max_grid - 1
        rows = (position_thw[..., 1] - position_thw[..., 0]).clamp(0, last)
        cols = (position_thw[..., 2] - position_thw[..., 0]).clamp(0, last)
        return (self.grid_rows(rows) + self.grid_cols(cols)) * image

    def _moe_summary(self, stats) -> dict[str, Tensor] | None:
        if not stats:
            return None
        load_balance = torch.stack([layer_stats.load_balance for layer_stats in stats]).mean()
        router_z = torch.stack([layer_stats.router_z for layer_stats in stats]).mean()
        return {
            "aux_loss": self.cfg.moe.load_balance_coef * load_balance
            + self.cfg.moe.router_z_coef * router_z,
            "load_balance": load_balance,
            "router_z": router_z,
            "dropped": torch.stack([layer_stats.dropped for layer_stats in stats]).sum(),
            "expert_load": torch.stack([layer_stats.expert_load for layer_stats in stats]),
        }

    def forward(
        self,
        input_ids: Tensor,
        *,
        labels: Tensor | None = None,
        modality: Tensor | None = None,
        position_ids: Tensor | None = None,
        position_thw: Tensor | None = None,
        doc_ids: Tensor | None = None,
        image_ids: Tensor | None = None,
        label_modality: Tensor | None = None,
        num_real_tokens: Tensor | int | None = None,  # accepted so ``model(**batch)`` works; unused
        mask: AttentionMask | None = None,
        one_doc_rows: bool | None = None,
    ) -> LossResult | Tensor:
        """All tensors [B, T] (position_thw [B, T, 3]). Missing ones default to: one document
        per row, positions from doc_ids (restarting per document), modality TEXT, no images.
        ``mask``: an attention mask built already (a sequence-parallel shard brings its whole
        row's, model/sequence_parallel.py); else it is built here from doc_ids and image_ids.
        ``one_doc_rows``: every row holds at most one document, known on the CPU (the loader's
        batch says so); None: worked out without a read-back from the device
        (``build_attention_mask``).
        Returns a LossResult when ``labels`` (already shifted) are given, else logits [B, T, V]."""
        hidden, stats, modality = self._hidden(
            input_ids,
            modality=modality,
            position_ids=position_ids,
            position_thw=position_thw,
            doc_ids=doc_ids,
            image_ids=image_ids,
            mask=mask,
            one_doc_rows=one_doc_rows,
        )
        final = self.norm(hidden)
        if labels is None:
            return self.output(final)
        if label_modality is None:
            # The target of position i is the token at i + 1; the last position keeps its own.
            label_modality = torch.cat([modality[:, 1:], modality[:, -1:]], dim=1)
        return self.output(final, hidden, labels, label_modality, self._moe_summary(stats))

    def final_hidden(self, input_ids: Tensor, **inputs: Any) -> Tensor:
        """The final-normed hidden states [B, T, D] that the output head reads, from forward's
        inputs (the loss's own, ``labels`` and ``label_modality``, are passed over). Without
        labels, forward returns [B, T, V] float32 logits, 34 GB for one row of 128k tokens and a
        64k vocabulary; an evaluation that scores a few positions of such a row takes these and
        ``output.logits`` of the positions it scores."""
        for key in ("labels", "label_modality", "num_real_tokens"):
            inputs.pop(key, None)
        hidden, _, _ = self._hidden(input_ids, **inputs)
        return self.norm(hidden)

    def _hidden(
        self,
        input_ids: Tensor,
        *,
        modality: Tensor | None = None,
        position_ids: Tensor | None = None,
        position_thw: Tensor | None = None,
        doc_ids: Tensor | None = None,
        image_ids: Tensor | None = None,
        mask: AttentionMask | None = None,
        one_doc_rows: bool | None = None,
    ) -> tuple[Tensor, list, Tensor]:
        """The last block's output (the pre-norm residual), the blocks' MoE statistics and the
        modality ids, with forward's defaults for the inputs left out."""
        batch_size, seq_len = input_ids.shape
        if modality is None:
            modality = torch.full_like(input_ids, int(Modality.TEXT))
        if position_ids is None:
            position_ids = (
                positions_from_doc_ids(doc_ids)
                if doc_ids is not None
                else torch.arange(seq_len, device=input_ids.device).expand(batch_size, seq_len)
            )
        if mask is None:
            mask = build_attention_mask(
                batch_size,
                seq_len,
                input_ids.device,
                doc_ids=doc_ids,
                image_ids=image_ids,
                sliding_window=self.cfg.attention.sliding_window,
                local_window=self.cfg.attention.local_window,
                bidirectional_images=self.cfg.attention.bidirectional_images,
                backend=self.cfg.attention.backend,
                one_doc_rows=one_doc_rows,
            )
        hidden, stats = self._trunk(
            input_ids,
            position_ids=position_ids,
            position_thw=position_thw,
            modality=modality,
            mask=mask,
        )
        return hidden, stats, modality

    def blocks(self) -> list[Block]:
        """The layers, typed (an nn.ModuleList only knows it holds modules)."""
        return cast("list[Block]", list(self.layers))

    # --- decoding with a KV cache -----------------------------------------------------------
    def make_kv_caches(self, batch: int, max_len: int, *, dtype=None, device=None) -> list[KVCache]:
        ref = self.output.weight
        attention = self.blocks()[0].attention
        return [
            KVCache(
                batch,
                attention.n_kv_heads,
                max_len,
                attention.head_dim,
                dtype=dtype or ref.dtype,
                device=device or ref.device,
            )
            for _ in self.layers
        ]

    @torch.no_grad()
    def decode(
        self,
        input_ids: Tensor,
        caches: list[KVCache],
        start: int,
        *,
        position_ids: Tensor | None = None,
        position_thw: Tensor | None = None,
        modality: Tensor | None = None,
        image_ids: Tensor | None = None,
    ) -> Tensor:
        """Run ``input_ids`` [B, s] at positions start.. against the caches; logits of the last
        position, [B, V] float32. The prompt (start == 0) may carry image_ids for bidirectional
        image attention; later steps are causal.

        Always eager, also when ``compile_blocks`` compiled the blocks for training: those graphs
        are for one static shape, and every decode step has a new one (the keys grow by a token),
        so each step would recompile until dynamo's limit stops the run (the monitors' probes
        draw in the middle of training)."""
        with torch.compiler.set_stance("force_eager"):
            return self._decode(
                input_ids,
                caches,
                start,
                position_ids=position_ids,
                position_thw=position_thw,
                modality=modality,
                image_ids=image_ids,
            )

    def _decode(
        self,
        input_ids: Tensor,
        caches: list[KVCache],
        start: int,
        *,
        position_ids: Tensor | None,
        position_thw: Tensor | None,
        modality: Tensor | None,
        image_ids: Tensor | None,
    ) -> Tensor:
        batch_size, num_new = input_ids.shape
        if modality is None:
            modality = torch.full_like(input_ids, int(Modality.TEXT))
        if position_ids is None:
            position_ids = torch.arange(start, start + num_new, device=input_ids.device).expand(
                batch_size, num_new
            )
        window, local_window = self.cfg.attention.sliding_window, self.cfg.attention.local_window
        if start == 0:
            mask = build_attention_mask(
                batch_size,
                num_new,
                input_ids.device,
                image_ids=image_ids,
                sliding_window=window,
                local_window=local_window,
                bidirectional_images=self.cfg.attention.bidirectional_images,
                backend="sdpa",
            )
        else:
            mask = decode_mask(
                start,
                num_new,
                input_ids.device,
                sliding_window=window,
                local_window=local_window,
            )
        hidden, _ = self._trunk(
            input_ids,
            position_ids=position_ids,
            position_thw=position_thw,
            modality=modality,
            mask=mask,
            caches=caches,
            cache_start=start,
        )
        return self.output(self.norm(hidden[:, -1]))
