"""``earlyfuse-prep train-text-tokenizer``: a BPE from the text and code of raw shard folders.

Sampling: every source (a ``--source`` of an ingest) that holds text or code contributes
characters in proportion to its size (estimated from the index: the JSON members' bytes), up
to ``max_chars`` in all. ``weights`` (``--weight NAME=FRACTION``) fix the fraction of the
training characters a source provides instead; the sources not named share the rest by size.
The budget is then the most characters at which every share can hold (a source's characters
over its share, counted first), up to ``max_chars``: on a corpus smaller than that, the larger
sources give less than all they hold, so that the shares asked are the shares trained on.
A source smaller than its share gives all it holds, once, and no more: repeating it would train
the merges on copies and overstate what the tokenizer saw. The summary (and
``text_tokenizer_training.json``) says per source the characters used, whether that was all of
it, and its share of what was trained on.
"""

from __future__ import annotations

import math
from pathlib import Path

from data.shards.index import read_index
from data.shards.manifest import load_manifest
from data.shards.reader import iter_shard
from data.text_tokenizer import sample_texts, save_tokenizer, train_bpe
from data.vocab import VocabLayout


def text_sources(in_dirs: list[Path]) -> dict[str, dict]:
    """name -> {"shards": [(tar, index)], "bytes": estimated text bytes} over all folders."""
    out: dict[str, dict] = {}
    for folder in in_dirs:
        manifest = load_manifest(folder)
        for shard in manifest["shards"]:
            segs = shard["segments"]
            if not (segs.get("text") or segs.get("code")) or shard["source"].startswith("val/"):
                continue  # no text, or held out for validation (ingest --val-fraction)
            name = (
                shard["source"] if len(in_dirs) == 1 else f"{Path(folder).name}/{shard['source']}"
            )
            entry = out.setdefault(name, {"shards": [], "bytes": 0})
            tar, idx = Path(folder) / shard["path"], Path(folder) / shard["index"]
            entry["shards"].append((tar, idx))
            entry["bytes"] += sum(
                record["members"]["json"][1]
                for record in read_index(idx)
                if "text" in record["types"] or "code" in record["types"]
            )
    if not out:
        raise ValueError(f"no text or code in {', '.join(map(str, in_dirs))}")
    return out


def resolve_weights(sources: dict[str, dict], fixed: dict[str, float]) -> dict[str, float]:
    unknown = set(fixed) - set(sources)
    if unknown:
        raise ValueError(
            f"--weight names unknown source(s) {sorted(unknown)}; sources with text: {sorted(sources)}"
        )
    if any(weight < 0 for weight in fixed.values()) or sum(fixed.values()) > 1 + 1e-9:
        raise ValueError(f"--weight fractions must be >= 0 and sum to at most 1 (got {fixed})")
    rest = [name for name in sources if name not in fixed]
    rest_bytes = sum(sources[name]["bytes"] for name in rest)
    left = 1.0 - sum(fixed.values())
    weights = dict(fixed)
    for name in rest:
        weights[name] = left * sources[name]["bytes"] / rest_bytes if rest_bytes else 0.0
    return {name: weight for name, weight in weights.items() if weight > 0}


def text_chars(source: dict, cap: int) -> int:
    """The characters of a source's text and code, counted up to ``cap``; past it, estimated
    from its documents' JSON bytes (``source["bytes"]``) at the characters per byte counted."""
    held = read = 0
    for tar, idx in source["shards"]:
        for raw_doc in iter_shard(tar, idx):
            texts = [
                seg["text"] for seg in raw_doc.doc["segments"] if seg["type"] in ("text", "code")
            ]
            if not texts:
                continue
            held += sum(map(len, texts))
            read += raw_doc.entry["members"]["json"][1]
            if held >= cap:
                return max(held, round(source["bytes"] * held / read))
    return held


def _texts_of(shards: list[tuple[Path, Path]]):
    def make():
        for tar, idx in shards:
            for raw_doc in iter_shard(tar, idx):
                for seg in raw_doc.doc["segments"]:
                    if seg["type"] in ("text", "code"):
                        yield seg["text"]

    return make


def train_text_tokenizer(
    in_dirs: list[str | Path],
    out: str | Path,
    *,
    vocab_size: int,
    weights: dict[str, float] | None = None,
    max_chars: int = 100_000_000,
    fsq_levels: tuple[int, ...] = (8, 5, 5, 5),
    max_grid: int = 64,
    progress: bool = False,
) -> dict:
    dirs = [Path(folder) for folder in in_dirs]
    sources = text_sources(dirs)
    total_bytes = sum(source["bytes"] for source in sources.values())
    # Index sizes are JSON bytes, escapes and metadata and all: too rough to hold a share (a
    # caption table's row is mostly metadata). With --weight, the sources not named share the
    # rest by their text's characters: counted up to the rest's part of --max-chars, past it
    # estimated from the index at the characters per byte counted.
    rest = int(max_chars * (1 - sum((weights or {}).values()))) + 1
    held = {
        name: text_chars(source, rest)
        for name, source in sources.items()
        if weights and name not in weights
    }
    sized = {
        name: {**source, "bytes": held.get(name, source["bytes"])}
        for name, source in sources.items()
    }
    mix = resolve_weights(sized, weights or {})
    # With fixed shares, no more characters than the scarcest source (for its share) allows: on a
    # corpus smaller than --max-chars the shares would otherwise be the corpus's, whatever was
    # asked. The named sources' characters are counted up to their share of --max-chars.
    total_w = sum(mix.values())
    budget, scarcest = min(max_chars, total_bytes), None
    if weights:
        caps = {name: int(max_chars * w / total_w) + 1 for name, w in mix.items()}
        fill = {
            name: min(
                held[name] if name in held else text_chars(sources[name], caps[name]), caps[name]
            )
            * total_w
            / w
            for name, w in mix.items()
        }
        scarcest = min(fill, key=lambda name: fill[name])
        budget = min(max_chars, math.ceil(fill[scarcest]))
    used: dict[str, int] = {}
    ran_out: set[str] = set()
    texts = sample_texts(
        {name: _texts_of(sources[name]["shards"]) for name in mix},
        mix,
        budget,
        used,
        ran_out=ran_out,
    )
    tok = train_bpe(texts, vocab_size, progress=progress)
    trained = sum(used.values()) or 1
    layout = VocabLayout(
        text_size=tok.get_vocab_size(), fsq_levels=tuple(fsq_levels), max_grid=max_grid
    )
    info = {
        "inputs": [str(folder) for folder in dirs],
        "vocab_size": tok.get_vocab_size(),
        "requested_vocab_size": vocab_size,
        "weights": mix,
        "chars_used": used,
        "budget_chars": budget,
        # the source whose size set the budget below --max-chars (fixed shares only)
        "budget_set_by": scarcest if budget < max_chars else None,
        "sources": {
            name: {
                "chars_used": used[name],
                "asked_chars": int(budget * mix[name] / total_w),
                "all_of_it": name in ran_out,
                "share": used[name] / trained,
            }
            for name in mix
        },
        "layout": layout.to_dict()["ranges"],
    }
    save_tokenizer(tok, layout, out, info)
    return info
