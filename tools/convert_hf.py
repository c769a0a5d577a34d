"""``earlyfuse-convert hf RELEASE OUT``: a release as a Hugging Face ``transformers`` model
(docs/checkpoints.md, "Hugging Face export", says what maps, what is refused and what is tested).
Qwen3 is the target because it has what our transformer has, so the export is a renaming of the
same weights over the whole vocabulary and its logits are ours; a feature Qwen3 lacks is refused
by name rather than exported as another model, except the row and column embeddings of image
codes, which ship as remote code (``tools/hf_remote/modeling_earlyfuse.py``).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from data.cli.common import check_new_folder, local_folder
from data.shards.storage import write_folder
from train.release import LAYOUT, TOKENIZER, Release, ReleaseError

EXAMPLES = """\
examples:
  earlyfuse-convert hf releases/demo hf/demo
  python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('hf/demo', trust_remote_code=True)"
"""
DESCRIPTION = (
    "Write RELEASE as a transformers model (Qwen3ForCausalLM) in OUT, loadable with "
    "AutoModelForCausalLM.from_pretrained and giving the same logits. Row/column embeddings of "
    "image codes (model.grid_embedding, the demo's model) ship as remote code in OUT "
    "(modeling_earlyfuse.py; load with trust_remote_code=True). A model with another feature "
    "Qwen3 lacks (M-RoPE, MoE, modality FFNs, reordered norms, ...) is refused with its name."
)


def blocking_features(cfg) -> list[str]:
    """What in a TransformerConfig Qwen3 cannot express (empty: it maps exactly)."""
    out = []
    if cfg.rope.mrope_sections:
        out.append(
            f"rope.mrope_sections={cfg.rope.mrope_sections} (M-RoPE: Qwen3 has 1D RoPE only)"
        )
    if cfg.reorder_norm:
        out.append(
            "reorder_norm=true (norms after attention and FFN: Qwen3 normalises their inputs)"
        )
    if cfg.ffn.modality_groups:
        out.append(f"ffn.modality_groups={cfg.ffn.modality_groups} (one FFN per modality group)")
    if cfg.moe.num_experts:
        out.append(f"moe.num_experts={cfg.moe.num_experts} (mixture of experts: Qwen3 is dense)")
    if cfg.attention.sliding_window:
        out.append(f"attention.sliding_window={cfg.attention.sliding_window}")
    if cfg.attention.local_window:
        # Qwen3's sliding-window layers are the lowest ones, not every global_every-th, and it
        # has one RoPE base for all layers: a local/global model would export as another model.
        out.append(
            f"attention.local_window={cfg.attention.local_window} with "
            f"attention.global_every={cfg.attention.global_every} (local/global layers: Qwen3 "
            "windows only its lowest layers)"
        )
    if cfg.rope.local_theta:
        out.append(
            f"rope.local_theta={cfg.rope.local_theta} (a RoPE base per layer kind: Qwen3 has one)"
        )
    if cfg.attention.bidirectional_images:
        out.append("attention.bidirectional_images=true (Qwen3 is causal everywhere)")
    if not cfg.attention.qk_norm:
        out.append("attention.qk_norm=false (Qwen3 always normalises q and k per head)")
    return out


def qwen3_config(
    cfg,
    *,
    bos_id,
    eos_id,
    pad_id,
    max_positions=32768,
    dtype="float32",
    config_class=None,
    **extra,
):
    """Qwen3Config (or ``config_class``, a subclass) of a TransformerConfig; ``extra`` fields
    are stored as they are (the remote code's ``earlyfuse_grid``, ``auto_map``). Serving tools
    (vLLM) read ``max_positions`` as the context length: the rows the model was trained on."""
    from transformers import Qwen3Config

    # rope_theta and torch_dtype are the transformers 4.x names; 5.x (typed without them) still
    # takes them through **kwargs, maps them to rope_parameters and dtype, and saves only those:
    # readable_by_4x writes the old names back.
    return (config_class or Qwen3Config)(  # type: ignore[call-arg]
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn.resolved_hidden_dim(cfg.dim),
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.attention.n_heads,
        num_key_value_heads=cfg.attention.kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=max_positions,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope.theta,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype=dtype,
        **extra,
    )


# Grid embeddings export as Hugging Face remote code: this file, written beside the weights.
REMOTE_CODE = Path(__file__).parent / "hf_remote" / "modeling_earlyfuse.py"
GRID_TABLES = ("grid_rows.weight", "grid_cols.weight")  # same names in both models


def grid_ids(layout) -> dict[str, int]:
    """The remote code's ``earlyfuse_grid``: the ids that shape image and video blocks, the code
    range and the largest grid side (its row/column tables' length)."""
    markers = ("boi", "eoi", "bov", "eov", "eol", "frame")
    return {
        "max_grid": layout.max_grid,
        "code_start": layout.visual_offset,
        "code_end": layout.size,
        **{name: layout.structure_id(f"<{name}>") for name in markers},
    }


def qwen3_state(state: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Our tensor names -> Qwen3ForCausalLM's (the tensors themselves are unchanged)."""
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    per_layer = {
        "attention_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attention.wq": "self_attn.q_proj",
        "attention.wk": "self_attn.k_proj",
        "attention.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj",
        "attention.q_norm": "self_attn.q_norm",
        "attention.k_norm": "self_attn.k_norm",
        "feed_forward.mlp.w1": "mlp.gate_proj",
        "feed_forward.mlp.w3": "mlp.up_proj",
        "feed_forward.mlp.w2": "mlp.down_proj",
    }
    for i in range(n_layers):
        for ours, theirs in per_layer.items():
            names[f"layers.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
    # Every name maps: a release's names are its config's (Release.state_dict checks them), and
    # blocking_features passes only configs whose names are these (grid tables are set apart).
    return {names[name]: tensor for name, tensor in state.items()}


def generation_config(layout, tok):
    """Greedy text generation with our specials; every id a text continuation must not produce
    (pad, bos, structure markers, visual codes: ``earlyfuse-generate``'s ``TextOnly`` mask, as a
    list) suppressed (lift with ``suppress_tokens=None`` to sample image blocks)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
        do_sample=False,
        max_new_tokens=64,
        suppress_tokens=[tok.pad_id, tok.bos_id, *range(layout.text_size, layout.size)],
    )


def readable_by_4x(folder: Path, cfg, dtype: str) -> None:
    """The transformers 4.x names beside 5.x's in the saved folder: 4.x reads the RoPE base from
    ``rope_theta`` at the top of config.json (without it, silently its default 10,000: other
    logits for a model trained at 500,000) and resolves the tokenizer by class name (5.x writes
    ``TokenizersBackend``, which 4.x lacks; ``PreTrainedTokenizerFast`` is in both). 5.x reads
    the old names too, to the same model."""
    for name, fields in (
        ("config.json", {"rope_theta": cfg.rope.theta, "torch_dtype": dtype}),
        ("tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"}),
    ):
        path = folder / name
        path.write_text(json.dumps(json.loads(path.read_text()) | fields, indent=2) + "\n")


def hf_tokenizer(tokenizer_json: Path, bos_id: int):
    """Our BPE as a ``PreTrainedTokenizerFast`` that starts every text with ``<|bos|>`` (a
    post-processor in tokenizer.json, which every loader of the file applies) and adds no eos,
    so a prompt is what our documents begin with. A ``<|eos|>`` written in the text stays text,
    as in our documents (``split_special_tokens``, kept in tokenizer_config.json: tokenizer.json
    cannot record it)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_file(str(tokenizer_json))
    backend.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A",
        pair="<|bos|> $A <|bos|> $B",
        special_tokens=[("<|bos|>", bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        split_special_tokens=True,
    )


def readme(rel, tok) -> str:
    lay = rel.vocab_layout
    grid = bool(rel.transformer_config.grid_embedding)
    load = 'from_pretrained("OUT", trust_remote_code=True)' if grid else 'from_pretrained("OUT")'
    # A bf16 model computes in bf16: its greedy tokens part from earlyfuse-generate's (fp32)
    # after a few steps on some prompts. Loaded as fp32 its logits are the release's.
    bf16 = (
        " once the weights are loaded as fp32 (`dtype=torch.float32` in `from_pretrained`, "
        "`torch_dtype=` before transformers 4.56: they are stored in bf16, and bf16 arithmetic "
        "parts from it within a few tokens on some prompts)"
        if rel.config.get("dtype") == "bfloat16"
        else ""
    )
    # AutoTokenizer reads config.json too: without the flag it asks on stdin whether to run
    # modeling_earlyfuse.py (the config class lives there).
    return f"""# earlyfuse model (Qwen3 architecture{" + row/column embeddings, remote code" if grid else ""})

Exported by `earlyfuse-convert hf` from `{rel.path}` (step {rel.step}). Load it with
`transformers.AutoModelForCausalLM.{load}` and `AutoTokenizer.{load}`.
{packing_readme(rel.config.get("packing"))}{tokenize_readme(rel)}{grid_readme(lay) if grid else ""}
## Ids

- `0..{lay.text_size - 1}`: the text tokenizer's (byte-level BPE); `<|pad|>` {tok.pad_id},
  `<|bos|>` {tok.bos_id}, `<|eos|>` {tok.eos_id}. The tokenizer puts `<|bos|>` before every text,
  as our training documents start (`add_special_tokens=False` leaves it out).
- `{lay.structure_offset}..{lay.visual_offset - 1}`: structure markers (`<boi>`, `<eol>`, sizes ...);
  `{lay.visual_offset}..{lay.size - 1}`: the {lay.num_codes} visual codes (`vocab_layout.json`).
  `visual_tokenizer/` turns a grid of codes into pixels (earlyfuse's `model/visual_tokenizer.py`).

## Text generation

`generation_config.json` makes `model.generate` produce text only, like `earlyfuse-generate`: it
lists every non-text id (pad, bos, structure markers, visual codes) in `suppress_tokens`, and
stops at `<|eos|>`. Greedy decoding then gives the same tokens as `earlyfuse-generate`{bf16}:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tok = AutoTokenizer.{load}
model = AutoModelForCausalLM.{load}
ids = tok("The cat sat on", return_tensors="pt").input_ids  # starts with <|bos|>
out = model.generate(ids, max_new_tokens=30)
print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
```

Without that list (`model.generate(ids, suppress_tokens=None)`) the model samples over the
whole vocabulary, visual codes (ids from `{lay.visual_offset}`) included.

Images are blocks `<boi> <h=H> <w=W> (W codes <eol>) x H <eoi>`: drawing one needs the grid
grammar that `earlyfuse-generate --draw` enforces; Hugging Face generation does not know it.
"""


def packing_readme(packing: dict | None) -> str:
    """The rows the run trained and validated on (the release's ``packing``), for held-out figures
    measured on the same rows; nothing for a release that does not record them."""
    from tools.evaluate.table import rows_phrase

    if not packing:
        return ""
    whole = rows_phrase(packing.get("whole_documents"))
    return f"""
Trained on packed rows of {packing.get("seq_len")} tokens, {packing.get("micro_batch")} rows a micro-batch, {whole}. Its
validation packed held-out documents the same way, as `earlyfuse-eval` does on the release this
came from (that release's `config.json`, `packing`): held-out figures compare on the same rows.
"""


def tokenize_readme(rel) -> str:
    """The block budgets the training data's images and videos were tokenized with (the
    release's ``tokenize``), for new data to be sized alike; nothing where none is recorded."""
    from data.tokenize.docs import block_flags

    if not block_flags(rel.config.get("tokenize") or {}):
        return ""
    return f"""
Its training data was tokenized by `{rel.tokenize_command()}` (the release this came from holds
both tokenizers): images and videos tokenized with other block budgets come in sizes it did not
train on.
"""


def grid_readme(lay) -> str:
    return f"""
## Row and column embeddings (remote code)

This model adds a learned row and column embedding to the input embedding of every image code
(Qwen3 has none). `modeling_earlyfuse.py`, in this folder, holds the model class
`EarlyfuseForCausalLM`: a `Qwen3ForCausalLM` with two more tables (`grid_rows`, `grid_cols`,
{lay.max_grid} rows each, in `model.safetensors`). `config.json` maps the Auto classes to it, so
loading needs `trust_remote_code=True` (it runs that file; it imports only torch and
transformers and needs no network). A code's row is the number of `<eol>` since its image's
`<boi>`, its column the number of codes since its row began, both read from the whole sequence;
video codes get none. `forward` on whole sequences and `model.generate` (KV cache) place them
themselves; driving the cache by hand, pass
`image_grid=image_grid_of(all_ids, model.config.earlyfuse_grid)[:, -n:]` for the n new tokens
(`image_grid_of = sys.modules[type(model).__module__].image_grid_of`).
"""


def export_hf(release: str | Path, out: str | Path, *, force: bool = False, log=print) -> Path:
    rel, out = Release(release), Path(out)
    blocked = blocking_features(rel.transformer_config)  # a ReleaseError for a vtok release
    if blocked:
        raise ReleaseError(
            f"{rel.path}: the model does not map onto Qwen3 (the Hugging Face architecture we "
            f"export to): " + "; ".join(blocked)
        )
    check_new_folder(out, force, rel.path, ReleaseError)
    try:
        from transformers import Qwen3ForCausalLM
    except ImportError:
        raise ReleaseError(
            "the Hugging Face export needs `transformers`: pip install 'earlyfuse[hf]'"
        ) from None

    tok = rel.text_tokenizer()
    cfg = rel.transformer_config
    # the release's own precision (earlyfuse-convert release --dtype): bf16 stays bf16
    dtype = str(rel.config.get("dtype", "float32"))
    state = rel.state_dict(getattr(torch, dtype))
    grid_tables = {name: state.pop(name) for name in GRID_TABLES if name in state}
    model_class: type = Qwen3ForCausalLM
    extra: dict = {}
    if cfg.grid_embedding:
        from tools.hf_remote.modeling_earlyfuse import EarlyfuseConfig, EarlyfuseForCausalLM

        module = REMOTE_CODE.stem
        model_class = EarlyfuseForCausalLM
        extra = {
            "config_class": EarlyfuseConfig,
            "earlyfuse_grid": grid_ids(rel.vocab_layout),
            "auto_map": {
                "AutoConfig": f"{module}.EarlyfuseConfig",
                "AutoModelForCausalLM": f"{module}.EarlyfuseForCausalLM",
            },
        }
    ids = {"bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id}
    rows = (rel.config.get("packing") or {}).get("seq_len", 32768)  # unknown: Qwen3's own
    hf_cfg = qwen3_config(cfg, **ids, max_positions=rows, dtype=dtype, **extra)
    with torch.device("meta"):
        model = model_class(hf_cfg)
    model.load_state_dict(qwen3_state(state, cfg.n_layers) | grid_tables, strict=True, assign=True)
    model.generation_config = generation_config(rel.vocab_layout, tok)

    def write(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        hf_tokenizer(rel.path / TOKENIZER, tok.bos_id).save_pretrained(folder)
        readable_by_4x(folder, cfg, dtype)
        shutil.copy(rel.path / LAYOUT, folder / LAYOUT)
        if (rel.path / "visual_tokenizer").is_dir():
            shutil.copytree(rel.path / "visual_tokenizer", folder / "visual_tokenizer")
        if cfg.grid_embedding:
            shutil.copy(REMOTE_CODE, folder / REMOTE_CODE.name)
        (folder / "README.md").write_text(readme(rel, tok))

    write_folder(out, write)  # built whole beside OUT: a failure leaves OUT as it was
    log(
        f"wrote {out}: {type(model).__name__}, {sum(param.numel() for param in model.parameters()):,} parameters, "
        f"vocabulary {rel.transformer_config.vocab_size} (text {rel.vocab_layout.text_size}, codes {rel.vocab_layout.num_codes})"
        + ("; load it with trust_remote_code=True (its own code)" if cfg.grid_embedding else "")
    )
    return out


def run(args: argparse.Namespace) -> None:
    export_hf(args.release, args.out, force=args.force)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "release", metavar="RELEASE", type=local_folder, help="an earlyfuse-convert release folder"
    )
    parser.add_argument(
        "out", metavar="OUT", type=local_folder, help="folder to write (new or empty; see --force)"
    )
    parser.add_argument(
        "--force", action="store_true", help="replace OUT once the new one is complete"
    )
