"""The early-fusion transformer: config, model, loss, generation, presets. See docs/model.md."""

from model.attention import AttentionConfig, AttentionMask, KVCache, build_attention_mask
from model.flops import ParamCounts, flops_per_token, param_counts
from model.generate import ImageConstraint, SamplingConfig, generate, sample_next
from model.layers import FFNConfig, RMSNorm
from model.loss import LossConfig, LossResult, chunked_linear_cross_entropy
from model.moe import MoEConfig
from model.presets import preset, preset_names
from model.rope import LayoutTracker, RopeConfig
from model.transformer import Transformer, TransformerConfig, positions_from_doc_ids

__all__ = [
    "AttentionConfig",
    "AttentionMask",
    "FFNConfig",
    "ImageConstraint",
    "KVCache",
    "LayoutTracker",
    "LossConfig",
    "LossResult",
    "MoEConfig",
    "ParamCounts",
    "RMSNorm",
    "RopeConfig",
    "SamplingConfig",
    "Transformer",
    "TransformerConfig",
    "build_attention_mask",
    "chunked_linear_cross_entropy",
    "flops_per_token",
    "generate",
    "param_counts",
    "positions_from_doc_ids",
    "preset",
    "preset_names",
    "sample_next",
]
