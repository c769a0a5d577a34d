"""Passkey documents: a random number hidden at a depth of a long filler, then asked for
(Mohtashami & Jaggi 2023, "Landmark Attention"; the needle-in-a-haystack test). The same
sentences serve the evaluation (``earlyfuse-eval --needle``, tools/evaluate/needle.py, which
assembles them token by token at exact lengths) and training data that teaches the task
(``write_passkey_documents``, or ``earlyfuse-prep passkey`` from the command line: ordinary text
documents for ``earlyfuse-prep ingest text:FILE``). A prompt of the evaluation is, token for
token, a document of ``passkey_text`` up to its key, so training and evaluation ask the same
question the same way.

Design choices:
- The filler is the literature's repeated sentences, not real text: the key is then the only
  information in the document, so an answer above the control can only come from reading it,
  and a document of any length is made from nothing (the demo's held-out text documents are
  shorter than the lengths a long-context test needs, and real filler would make the figure
  depend on which documents happen to surround the key).
- The key is a decimal number whose first digit is not zero; the needle states it twice
  ("The pass key is K. Remember it. K is the pass key."), as in the literature.
- Lengths are counted in filler sentences (about 6 tokens each with the demo's BPE), not
  characters: a document is whole sentences, the unit the needle's depth is placed by.
- Depth d in [0, 1]: the needle follows ``round(d * n)`` of the document's ``n`` filler
  sentences; 0 puts it first, 1 right before the question.
- A document ends with the question and its answer (``... The pass key is K.``): a model
  trained on these learns to copy the key to the end.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

FILLER_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"


def random_key(rng: np.random.Generator, digits: int) -> str:
    """``digits`` random decimal digits, the first not zero."""
    if digits < 1:
        raise ValueError(f"a pass key of {digits} digits: give at least 1")
    first = str(int(rng.integers(1, 10)))
    return first + "".join(str(int(d)) for d in rng.integers(0, 10, size=digits - 1))


def filler(sentences: int, *, start: int = 0) -> list[str]:
    """``sentences`` filler sentences, the cycle entered at ``start``."""
    count = len(FILLER_SENTENCES)
    return [FILLER_SENTENCES[(start + i) % count] for i in range(sentences)]


def passkey_text(key: str, *, depth: float, sentences: int) -> str:
    """One passkey document: ``sentences`` filler sentences with the needle after
    ``round(depth * sentences)`` of them, then the question and the answer."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth}: give a fraction in [0, 1]")
    parts = filler(sentences)
    parts.insert(round(depth * sentences), NEEDLE.format(key=key))
    return " ".join([*parts, f"{QUESTION} {key}."])


def passkey_documents(
    count: int,
    *,
    seed: int = 0,
    min_sentences: int = 20,
    max_sentences: int = 200,
    digits: tuple[int, int] = (5, 7),
) -> Iterator[dict]:
    """``count`` documents ``{"id", "text", "key", "depth"}``: a key of ``digits[0]`` to
    ``digits[1]`` digits at a uniform depth in [0, 1] of ``min_sentences`` to ``max_sentences``
    filler sentences (about 6 tokens each with the demo's BPE), all drawn from ``seed``."""
    if not 1 <= min_sentences <= max_sentences:
        raise ValueError(f"sentences {min_sentences}..{max_sentences}: give 1 <= min <= max")
    if not 1 <= digits[0] <= digits[1]:
        raise ValueError(f"digits {digits[0]}..{digits[1]}: give 1 <= min <= max")
    rng = np.random.default_rng([seed, 0x9A55])
    for number in range(count):
        key = random_key(rng, int(rng.integers(digits[0], digits[1] + 1)))
        depth = float(rng.random())
        sentences = int(rng.integers(min_sentences, max_sentences + 1))
        text = passkey_text(key, depth=depth, sentences=sentences)
        yield {"id": f"passkey-{number:06d}", "text": text, "key": key, "depth": round(depth, 4)}


def write_passkey_documents(path: str | Path, count: int, **options) -> int:
    """Write ``count`` passkey documents as a JSONL text table (``{"id", "text", ...}`` a
    line; ``earlyfuse-prep ingest OUT text:PATH`` reads it like any text table); ``options``
    as ``passkey_documents``. Returns the documents written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with path.open("w", encoding="utf-8") as out:
        for row in passkey_documents(count, **options):
            out.write(json.dumps(row) + "\n")
            written += 1
    return written
