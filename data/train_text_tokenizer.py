"""``earlyfuse-prep train-text-tokenizer``: a BPE from the text and code of raw shard folders.

Sampling: every source (a ``--source`` of an ingest) that holds text or code contributes
characters in proportion to its size (estimated from the index: the JSON members' bytes), up
to ``max_chars`` in all. ``weights`` (``--weight NAME=FRACTION``) fix the fraction of the
training characters a source provides instead; the sources not named share the rest by size.
A source smaller than its share gives all it holds, once, and no more: repeating it would train
the merges on copies and overstate what the tokenizer saw. The summary (and
``text_tokenizer_training.json``) says per source the characters used, whether that was all of
it, and its share of what was trained on.
"""

from __future__ import annotations

from pathlib import Path

from data.shards.index import read_index
from data.shards.manifest import load_manifest
from data.shards.reader import iter_shard
from data.text_tokenizer import sample_texts, save_tokenizer, train_bpe
from data.vocab import VocabLayout


def text_sources(in_dirs: list[Path]) -> dict[str, dict]:
    """name -> {"shards": [(tar, index)], "bytes": estimated text bytes} over all folders."""
    out: dict[str, dict] = {}
    for d in in_dirs:
        m = load_manifest(d)
        for sh in m["shards"]:
            segs = sh["segments"]
            if not (segs.get("text") or segs.get("code")) or sh["source"].startswith("val/"):
                continue  # no text, or held out for validation (ingest --val-fraction)
            name = sh["source"] if len(in_dirs) == 1 else f"{Path(d).name}/{sh['source']}"
            s = out.setdefault(name, {"shards": [], "bytes": 0})
            tar, idx = Path(d) / sh["path"], Path(d) / sh["index"]
            s["shards"].append((tar, idx))
            s["bytes"] += sum(
                e["members"]["json"][1]
                for e in read_index(idx)
                if "text" in e["types"] or "code" in e["types"]
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
    if any(w < 0 for w in fixed.values()) or sum(fixed.values()) > 1 + 1e-9:
        raise ValueError(f"--weight fractions must be >= 0 and sum to at most 1 (got {fixed})")
    rest = [n for n in sources if n not in fixed]
    rest_bytes = sum(sources[n]["bytes"] for n in rest)
    left = 1.0 - sum(fixed.values())
    weights = dict(fixed)
    for n in rest:
        weights[n] = left * sources[n]["bytes"] / rest_bytes if rest_bytes else 0.0
    return {n: w for n, w in weights.items() if w > 0}


def _texts_of(shards: list[tuple[Path, Path]]):
    def make():
        for tar, idx in shards:
            for d in iter_shard(tar, idx):
                for seg in d.doc["segments"]:
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
    dirs = [Path(d) for d in in_dirs]
    sources = text_sources(dirs)
    w = resolve_weights(sources, weights or {})
    total_bytes = sum(s["bytes"] for s in sources.values())
    budget = min(max_chars, total_bytes) if not weights else max_chars
    used: dict[str, int] = {}
    ran_out: set[str] = set()
    texts = sample_texts(
        {n: _texts_of(sources[n]["shards"]) for n in w}, w, budget, used, ran_out=ran_out
    )
    tok = train_bpe(texts, vocab_size, progress=progress)
    trained = sum(used.values()) or 1
    total_w = sum(w.values())
    layout = VocabLayout(
        text_size=tok.get_vocab_size(), fsq_levels=tuple(fsq_levels), max_grid=max_grid
    )
    info = {
        "inputs": [str(d) for d in dirs],
        "vocab_size": tok.get_vocab_size(),
        "requested_vocab_size": vocab_size,
        "weights": w,
        "chars_used": used,
        "budget_chars": budget,
        "sources": {
            n: {
                "chars_used": used[n],
                "asked_chars": int(budget * w[n] / total_w),
                "all_of_it": n in ran_out,
                "share": used[n] / trained,
            }
            for n in w
        },
        "layout": layout.to_dict()["ranges"],
    }
    save_tokenizer(tok, layout, out, info)
    return info
