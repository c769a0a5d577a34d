"""Text part: English prose that ships with Python (`OUT/text/*.jsonl`).

- `pydoc_topics.jsonl`: the language-reference topics that `help("topic")` shows (pydoc_data).
- `docstrings.jsonl`: module docstrings of the stdlib modules longer than 200 characters.

Docstrings are read with `tokenize` from the first tokens of each file, never by importing
the module: importing stdlib modules has side effects (`antigravity` opens a browser,
`this` prints) and costs time.
"""

from __future__ import annotations

import ast
import io
import pathlib
import tokenize

from ._common import in_split, rng_for, write_jsonl
from .stdlib_code import candidates, split_group, stdlib_dir

MIN_DOCSTRING = 200


def module_docstring(path: pathlib.Path) -> str | None:
    """The module docstring, if the first statement of the file is a string literal."""
    try:
        tokens = tokenize.tokenize(io.BytesIO(path.read_bytes()).readline)
        for tok in tokens:
            if tok.type in (tokenize.ENCODING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE):
                continue
            if tok.type != tokenize.STRING:
                return None
            value = ast.literal_eval(tok.string)
            return value if isinstance(value, str) else None
    except (tokenize.TokenError, SyntaxError, ValueError):
        return None
    return None


def module_name(rel: pathlib.Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def build_text(out: pathlib.Path, *, seed: int, scale: float, split: str = "all") -> dict:
    from pydoc_data.topics import topics  # stdlib; the text of help("keyword") topics

    names = sorted(n for n in topics if in_split(f"topic:{n}", split))
    # Below scale 1 keep a seeded subset; at scale >= 1 everything (there is no more to add).
    keep = _subset(len(names), scale, rng_for(seed, "pydoc"))
    topic_rows = [{"id": names[i], "text": topics[names[i]].strip()} for i in keep]
    b1 = write_jsonl(out / "text" / "pydoc_topics.jsonl", topic_rows)

    root = stdlib_dir()
    docs = []
    for rel in candidates():
        if not in_split(split_group(rel), split):
            continue
        doc = module_docstring(root / rel)
        if doc and len(doc.strip()) > MIN_DOCSTRING:
            docs.append({"id": module_name(rel), "text": doc.strip()})
    keep = _subset(len(docs), scale, rng_for(seed, "docstrings"))
    doc_rows = [docs[i] for i in keep]
    b2 = write_jsonl(out / "text" / "docstrings.jsonl", doc_rows)
    return {"files": 2, "documents": len(topic_rows) + len(doc_rows), "bytes": b1 + b2}


def _subset(n: int, scale: float, rng) -> list[int]:
    if scale >= 1.0:
        return list(range(n))
    k = max(1, int(round(n * scale)))
    return sorted(rng.choice(n, size=k, replace=False).tolist())
