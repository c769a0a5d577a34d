"""Grouped-query attention with QK-norm, RoPE, document masks, and a KV cache.

Design choices:
- One mask predicate (``_allowed``) defines who may attend to whom: same document, causal,
  optionally within a sliding window, optionally bidirectional inside one image block. The
  FlexAttention ``mask_mod`` and the dense boolean mask for SDPA are both made from it, so the
  two backends cannot drift apart (tested to agree).
- The mask is built ONCE per batch (``build_attention_mask``) and shared by every layer: building
  a FlexAttention block mask can cost more than the attention itself. On CUDA the block mask is
  built by ``torch.compile(create_block_mask)``: the eager builder materialises the [T, T] mask
  first (16 GiB at 128k tokens), the compiled one keeps only the (T/128)^2 block indices. SDPA's
  dense mask (CPU) is [B, 1, T, T] bool, also built once per batch.
- No host sync: whether every row holds one document (then plain causal attention is exact) is
  decided on the CPU, from the loader's batch (``one_doc_rows``, from its table of document
  pieces) or from CPU doc ids; doc ids already on a GPU without the flag get the document mask
  (always exact) rather than a read-back. So a compiled block (``torch.compile(fullgraph=True)``)
  never breaks its graph on the mask.
- A block mask is checked against the queries and keys it is used with (its batch, query and
  key lengths, plain ints): FlexAttention reads outside its tensors when they do not match, which
  surfaces as a CUDA "illegal memory access" far from the cause.
- Backend ``auto`` picks FlexAttention on CUDA (compiled, block-sparse: skips the cross-document
  blocks) and SDPA with an explicit boolean mask elsewhere. On CPU, FlexAttention has no
  backward (torch 2.13 raises), so ``flex`` on CPU is allowed only without gradients.
- QK-norm (Chameleon, OLMo 2, Qwen3): RMSNorm over head_dim of every q and k head, one weight
  shared by the heads, applied before RoPE. It bounds attention logits, the failure Chameleon saw
  when modalities compete through norm growth.
- Sliding window: a query sees the keys at most ``sliding_window - 1`` positions back. It limits
  the causal part only; a bidirectional image block is always seen whole.
- Local/global layers (Gemma 3): ``local_window`` windows every layer except each
  ``global_every``-th. The local mask is the same predicate with that window (the document mask
  AND the window), built in the same call and shared by the local layers; their RoPE base may
  differ (``rope.local_theta``, model/transformer.py). The KV cache keeps every key; the local
  layers' decode mask hides those outside the window.
- Bidirectional image blocks (``image_ids`` >= 0 marks the tokens of one image): meant for
  understanding-only image tokens. It leaks the future into next-token prediction of those
  tokens, so put no labels on image tokens when it is on. Generation decodes causally.
- Sequence parallelism (model/sequence_parallel.py) swaps sequence for heads around the core
  (``Attention.sequence_parallel``), so the core and its mask are the same for a whole row.
- KV cache: preallocated [B, Hkv, max_len, hd] per layer; decoding always uses SDPA with an
  explicit mask (prefill may use the document/image mask of the prompt).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.layers import RMSNorm
from model.rope import apply_rotary

if TYPE_CHECKING:
    from model.sequence_parallel import UlyssesAttention

try:  # FlexAttention: torch >= 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    HAS_FLEX = True
except ImportError:  # pragma: no cover - older torch
    HAS_FLEX = False

BACKENDS = ("auto", "flex", "sdpa")


@dataclass(kw_only=True)
class AttentionConfig:
    n_heads: int = 4
    n_kv_heads: int = 0  # 0: n_heads (multi-head); fewer: grouped-query attention
    head_dim: int = 0  # 0: dim // n_heads
    qk_norm: bool = True
    backend: str = "auto"  # auto | flex | sdpa
    compile_flex: bool = True  # torch.compile flex_attention on CUDA (eager materialises scores)
    sliding_window: int = 0  # every layer: a query sees this many keys back; 0: full context
    # Local/global layers (Gemma 3): ``local_window`` > 0 makes every layer local (a window of
    # that many keys) except each ``global_every``-th, which sees the whole context: 6 = five
    # local layers, then one global. 0: every layer global.
    local_window: int = 0
    global_every: int = 0
    bidirectional_images: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"model.attention.backend must be one of {BACKENDS}, got {self.backend!r}"
            )
        kv_heads = self.n_kv_heads or self.n_heads
        if self.n_heads <= 0 or kv_heads <= 0 or self.n_heads % kv_heads:
            raise ValueError(
                f"model.attention.n_heads ({self.n_heads}) must be a positive multiple of "
                f"model.attention.n_kv_heads ({kv_heads})"
            )
        for key in ("sliding_window", "local_window"):
            if getattr(self, key) < 0:
                raise ValueError(f"model.attention.{key} must be >= 0, got {getattr(self, key)}")
        if self.local_window and self.sliding_window:
            raise ValueError(
                f"model.attention.sliding_window ({self.sliding_window}) windows every layer and "
                f"model.attention.local_window ({self.local_window}) the local ones: set one of them"
            )
        if self.local_window and self.global_every < 2:
            raise ValueError(
                f"model.attention.local_window={self.local_window} needs model.attention.global_every >= 2 "
                f"(every global_every-th layer is global), got {self.global_every}"
            )
        if not self.local_window and self.global_every:
            raise ValueError(
                f"model.attention.global_every={self.global_every} without model.attention.local_window: "
                "set the local layers' window too (or global_every=0)"
            )

    def is_local(self, layer_id: int) -> bool:
        """Layer ``layer_id`` (from 0) attends within ``local_window``: all but every
        ``global_every``-th layer (Gemma 3: layers 0-4 local, 5 global, 6-10 local, ...)."""
        return bool(self.local_window) and (layer_id + 1) % self.global_every != 0

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def resolved_head_dim(self, dim: int) -> int:
        if self.head_dim:
            return self.head_dim
        if dim % self.n_heads:
            raise ValueError(
                f"model.dim {dim} is not divisible by model.attention.n_heads {self.n_heads}; "
                "set model.attention.head_dim"
            )
        return dim // self.n_heads


# --- masks ---------------------------------------------------------------------------------


def _allowed(b, q, kv, *, doc: Tensor | None, img: Tensor | None, window: int, q_offset: int = 0):
    """May query q attend to key kv in row b? Works on broadcast index tensors and inside
    FlexAttention's vmap alike. ``q_offset`` shifts query positions (KV-cache decoding)."""
    query_pos = q + q_offset
    allowed = query_pos >= kv
    if window:
        allowed = allowed & (query_pos - kv < window)
    if img is not None:
        allowed = allowed | ((img[b, query_pos] == img[b, kv]) & (img[b, query_pos] >= 0))
    if doc is not None:
        allowed = allowed & (doc[b, query_pos] == doc[b, kv])
    return allowed


class AttentionMask(NamedTuple):
    """One batch's mask, shared by all layers: a FlexAttention BlockMask, or a dense boolean
    [B, 1, Tq, Tk] mask for SDPA (None with ``causal``: plain causal, SDPA's fast path).
    With local/global layers it also carries the local layers' mask (the same mask AND the
    window), built in the same call: ``local()``.
    A NamedTuple so that DeepSpeed ZeRO-3's hooks can walk a block's inputs."""

    block_mask: object | None = None
    dense: Tensor | None = None
    causal: bool = False
    local_block_mask: object | None = None
    local_dense: Tensor | None = None

    @property
    def backend(self) -> str:
        return "flex" if self.block_mask is not None else "sdpa"

    @property
    def has_local(self) -> bool:
        return self.local_block_mask is not None or self.local_dense is not None

    def local(self) -> AttentionMask:
        """The local layers' mask."""
        if not self.has_local:
            raise ValueError(
                "this attention mask has no local-layer part: build it with the model's "
                "attention.local_window (build_attention_mask(..., local_window=...))"
            )
        return AttentionMask(block_mask=self.local_block_mask, dense=self.local_dense)


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "flex" if (HAS_FLEX and device.type == "cuda") else "sdpa"
    if backend == "flex":
        if not HAS_FLEX:
            raise RuntimeError(
                "model.attention.backend=flex needs torch >= 2.5 (torch.nn.attention.flex_attention)"
            )
        if device.type == "cpu" and torch.is_grad_enabled():
            raise RuntimeError(
                "FlexAttention has no backward on CPU in this torch; use attention.backend=auto or sdpa "
                "for CPU training (flex on CPU works under torch.no_grad())"
            )
    return backend


def build_attention_mask(
    batch: int,
    seq_len: int,
    device: torch.device,
    *,
    doc_ids: Tensor | None = None,
    image_ids: Tensor | None = None,
    sliding_window: int = 0,
    local_window: int = 0,
    bidirectional_images: bool = False,
    backend: str = "auto",
    one_doc_rows: bool | None = None,
    compile_mask: bool | None = None,
) -> AttentionMask:
    """Build the mask for a [batch, seq_len] batch once; pass it to every layer.

    ``local_window`` > 0 builds the local layers' mask too (the same predicate with that window).
    ``compile_mask``: build a BlockMask with the compiled builder; None: on CUDA only.
    ``one_doc_rows``: the caller knows (on the CPU) whether every row holds at most one
    document; None: found from ``doc_ids`` when they are on the CPU, else the document mask is
    used (exact either way; never a read-back from the device)."""
    backend = resolve_backend(backend, device)
    bidir_image_ids = image_ids if (bidirectional_images and image_ids is not None) else None
    doc = doc_ids
    if doc is not None and one_doc_rows is None and doc.device.type == "cpu":
        one_doc_rows = bool((doc == doc[:, :1]).all())  # on the host: no device to wait for
    if one_doc_rows:
        doc = None  # one document per row: the causal fast path is exact
    if backend == "flex":
        compiled = device.type == "cuda" if compile_mask is None else compile_mask
        block_mask = _block_mask(
            batch, seq_len, device, doc, bidir_image_ids, sliding_window, compiled
        )
        local = (
            _block_mask(batch, seq_len, device, doc, bidir_image_ids, local_window, compiled)
            if local_window
            else None
        )
        return AttentionMask(block_mask=block_mask, local_block_mask=local)
    local_dense = (
        _dense_mask(batch, seq_len, device, doc, bidir_image_ids, local_window)
        if local_window
        else None
    )
    if doc is None and bidir_image_ids is None and not sliding_window:
        return AttentionMask(causal=True, local_dense=local_dense)
    return AttentionMask(
        dense=_dense_mask(batch, seq_len, device, doc, bidir_image_ids, sliding_window),
        local_dense=local_dense,
    )


_compiled_block_mask: Callable[..., object] | None = None


def _block_mask(batch, seq_len, device, doc, img, window, compiled: bool):
    """FlexAttention's BlockMask of ``_allowed``.

    ``compiled`` (CUDA's default): ``torch.compile(create_block_mask)``, which fuses the
    mask_mod's evaluation into the per-block reduction, so only the block indices are ever
    stored: four [B, T/128, T/128] int32 tensors, 4 MiB each per row at 128k tokens and 256 MiB
    at 1M. The eager builder materialises the [B, T, T] mask first (16 GiB of bool at 128k,
    1 TiB at 1M). A fresh closure per batch reuses the compiled graph (dynamo guards on the
    code and the captured tensors' shapes; the window is a constant: one graph per window). On
    the CPU, where rows are short and FlexAttention serves no-grad forwards only, the eager
    builder saves a compile of about 15 s."""
    global _compiled_block_mask

    def mask_mod(row_index, h, q, kv):
        return _allowed(row_index, q, kv, doc=doc, img=img, window=window)

    build: Callable[..., object] = create_block_mask
    if compiled:
        if _compiled_block_mask is None:
            _compiled_block_mask = torch.compile(create_block_mask, dynamic=False)
        build = _compiled_block_mask
    return build(
        mask_mod,
        batch if (doc is not None or img is not None) else None,
        None,
        seq_len,
        seq_len,
        device=device,
    )


class RowsTooLong(MemoryError, ValueError):
    """Rows whose dense mask cannot fit in the machine's memory: out of memory (the long-row
    benchmarks report it as such), and a bad value for the tools that take ``--seq-len``."""


CGROUP = Path("/sys/fs/cgroup")  # this process's memory limit, when it has one


def available_memory() -> int:
    """Bytes this process can still take: Linux's MemAvailable (free memory and the page cache
    it can drop), within the room its cgroup's limit leaves (a container, a scheduler's job), at
    most the machine's total. Not the total alone: on a machine shared with other jobs a mask
    that fits the total still takes what the others hold, and the OOM killer picks one."""
    room = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
            room.append(int(line.split()[1]) * 1024)
    # cgroup v2's files, then v1's; the page cache counts as used there and is given back first
    for limit_file, used_file, cache in (
        ("memory.max", "memory.current", "file"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "total_cache"),
    ):
        with contextlib.suppress(OSError, ValueError):
            limit = (CGROUP / limit_file).read_text().strip()
            if limit != "max" and int(limit) < room[0]:  # v1's "no limit" is a huge number
                stats = (CGROUP / limit_file).parent / "memory.stat"
                stat = dict(line.split() for line in stats.read_text().splitlines())
                used = int((CGROUP / used_file).read_text()) - int(stat.get(cache, 0))
                room.append(int(limit) - used)
                break
    return min(room)


# Row shapes whose dense mask was found to fit the memory free once, and not checked again: a run
# whose neighbours grow later is not stopped mid-training for a shape that has trained
_FITTED: set[tuple[int, int]] = set()


def _dense_mask(batch, seq_len, device, doc, img, window) -> Tensor:
    """The boolean [B, 1, T, T] mask of ``_allowed`` for SDPA. On the CPU, rows whose mask and a
    forward's share cannot fit the memory the machine has free are refused by name before
    anything is allocated (else a traceback from the allocator, or the OOM killer, at 100k
    tokens a row). It is a floor, not a training step's need: the backward keeps each layer's
    attention weights too (4 bytes per token pair, head and layer), and each process on the
    machine (a sequence-parallel rank) checks alone."""
    if device.type == "cpu":
        need = batch * seq_len * seq_len * 5  # the mask, and the float copy SDPA makes of it
        shape = (batch, seq_len)
        free = available_memory() if shape not in _FITTED else 2 * need
        if 1.25 * need > free:  # a quarter more for the rest of the forward
            raise RowsTooLong(
                f"attention over {batch} row(s) of {seq_len:,} tokens on the CPU needs a dense "
                f"[{batch}, 1, {seq_len}, {seq_len}] mask and SDPA's float copy of it, "
                f"{need / 2**30:,.1f} GiB and a quarter more for the rest of the forward; this "
                f"machine has {free / 2**30:,.1f} GiB free: use shorter rows (--seq-len, "
                "data.seq_len), fewer rows at once, or a GPU (FlexAttention builds no dense mask)"
            )
        _FITTED.add(shape)
    row_index = torch.arange(batch, device=device)[:, None, None, None]
    q = torch.arange(seq_len, device=device)[None, None, :, None]
    kv = torch.arange(seq_len, device=device)[None, None, None, :]
    return _allowed(row_index, q, kv, doc=doc, img=img, window=window)


def decode_mask(
    start: int,
    length: int,
    device: torch.device,
    *,
    sliding_window: int = 0,
    local_window: int = 0,
) -> AttentionMask:
    """Mask for ``length`` new queries at positions start.. attending to a cache of start+length
    keys; with ``local_window`` also the local layers' (the cache keeps every key, the mask
    hides those outside the window)."""
    q = torch.arange(length, device=device)[None, None, :, None]
    kv = torch.arange(start + length, device=device)[None, None, None, :]
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)

    def dense(window: int) -> Tensor:
        return _allowed(zero, q, kv, doc=None, img=None, window=window, q_offset=start)

    return AttentionMask(
        dense=dense(sliding_window), local_dense=dense(local_window) if local_window else None
    )


_compiled_flex: Callable[..., Tensor] | None = None


def check_block_mask(block_mask, q: Tensor, k: Tensor) -> None:
    """The block mask was built for these queries and keys (plain ints: no sync, and a compiled
    graph keeps them as guards)."""
    mask_batch, _, q_len, kv_len = block_mask.shape
    if (q_len, kv_len) != (q.shape[-2], k.shape[-2]) or mask_batch not in (1, q.shape[0]):
        raise ValueError(
            f"attention mask built for batch {mask_batch}, {q_len} queries and {kv_len} keys, "
            f"used with batch {q.shape[0]}, {q.shape[-2]} queries and {k.shape[-2]} keys: "
            "build it for the batch it is used with (build_attention_mask)"
        )


def _flex(q: Tensor, k: Tensor, v: Tensor, block_mask, gqa: bool, compile_flex: bool) -> Tensor:
    global _compiled_flex
    check_block_mask(block_mask, q, k)
    attend: Callable[..., Tensor] = flex_attention
    if torch.compiler.is_compiling():
        pass  # inside a compiled block: FlexAttention is compiled with it
    elif compile_flex and q.device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        attend = _compiled_flex
    return attend(q, k, v, block_mask=block_mask, enable_gqa=gqa)


# --- the module ----------------------------------------------------------------------------


class KVCache(nn.Module):
    """Preallocated keys and values of one layer: [B, Hkv, max_len, hd]."""

    k: Tensor  # buffers, declared for the type checker
    v: Tensor

    def __init__(
        self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, *, dtype, device
    ) -> None:
        super().__init__()
        self.register_buffer(
            "k", torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        )
        self.register_buffer(
            "v", torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        )

    def update(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = start + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache of {self.k.shape[2]} positions is full (need {end})")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(nn.Module):
    def __init__(self, dim: int, cfg: AttentionConfig, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.kv_heads
        self.head_dim = cfg.resolved_head_dim(dim)
        self.wq = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, norm_eps)
            self.k_norm = RMSNorm(self.head_dim, norm_eps)
        # Set by model.sequence_parallel.apply_sequence_parallel: x holds a shard of the sequence.
        self.sequence_parallel: UlyssesAttention | None = None

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: AttentionMask,
        cache: KVCache | None = None,
        cache_start: int = 0,
    ) -> Tensor:
        B, T, _ = x.shape  # batch, sequence length
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (tensor.transpose(1, 2) for tensor in (q, k, v))  # [B, H, T, hd]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(cache_start, k, v)
        if self.sequence_parallel is not None:  # the whole sequence, a share of the heads
            q, k, v = self.sequence_parallel.scatter_heads(q, k, v)
        gqa = k.shape[1] != q.shape[1]
        if mask.block_mask is not None:
            out = _flex(q, k, v, mask.block_mask, gqa, self.cfg.compile_flex)
        else:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask.dense,
                is_causal=mask.causal and mask.dense is None,
                enable_gqa=gqa,
            )
        if self.sequence_parallel is not None:
            out = self.sequence_parallel.gather_heads(out)
        return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def init_weights(self, std: float, out_std: float) -> None:
        for projection in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(projection.weight, std=std, a=-3 * std, b=3 * std)
        nn.init.trunc_normal_(self.wo.weight, std=out_std, a=-3 * out_std, b=3 * out_std)
        if self.cfg.qk_norm:
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()
