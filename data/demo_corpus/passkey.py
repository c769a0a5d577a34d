"""Passkey documents: a random number hidden at some depth of a long filler, asked for at the end.

The task of the long-context demo stage (``make demo-long``, docs/long_context.md): a model can
only predict the number at the end from the one hidden earlier, however far back it is, so the
accuracy of those digits says whether the context is used.

- The filler is the passkey literature's (Mohtashami and Jaggi's landmark-attention test, since
  used for LongLoRA and YaRN): a fixed cycle of sentences. It carries nothing the question could
  be answered from, and a small model learns it quickly, so what remains to learn is the copy.
- Each document is plain text, one JSONL line ``{"text": ..., "passkey": ..., "depth": ...}``
  (``text:`` ingest takes the other fields as ``meta``), so the documents go through ingest and
  tokenize like any other text.
- The answer closes the document: ``... What is the pass key? The pass key is 48213.``;
  ``ANSWER_PREFIX`` is the text the digits follow, for scoring by teacher forcing
  (tools/evaluate/passkey_demo.py).

``python -m data.demo_corpus.passkey --out DIR --count N --length-chars C [--min-chars M] --seed S``
writes them from the command line (``make demo-long``).
"""

from __future__ import annotations

import pathlib

from ._common import rng_for, write_jsonl

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there. "
)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
SENTENCES = [sentence + ". " for sentence in FILLER.strip().rstrip(".").split(". ")]
QUESTION = "What is the pass key?"
ANSWER_PREFIX = f"{QUESTION} The pass key is"
DIGITS = 5


def needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def passkey_text(length_chars: int, depth: float, key: str, *, hidden: bool = True) -> str:
    """A document of about ``length_chars`` characters: the intro, filler with the needle after
    ``depth`` (0: first, 1: last) of it, and the question answered with ``key``. ``hidden`` False:
    the control, the same document without the needle (its answer cannot be read anywhere)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth}: must be within [0, 1]")
    ending = f"{ANSWER_PREFIX} {key}."
    planted = needle(key) if hidden else ""
    room = length_chars - len(INTRO) - len(planted) - len(ending)
    # Whole filler sentences, cycled, as many as fit; the needle goes between two of them.
    sentences: list[str] = []
    used = 0
    while room - used >= len(SENTENCES[len(sentences) % len(SENTENCES)]):
        sentences.append(SENTENCES[len(sentences) % len(SENTENCES)])
        used += len(sentences[-1])
    cut = round(depth * len(sentences))
    filler = "".join(sentences)
    cut_at = len("".join(sentences[:cut]))
    return INTRO + filler[:cut_at] + planted + filler[cut_at:] + ending


def random_key(rng) -> str:
    return str(int(rng.integers(10 ** (DIGITS - 1), 10**DIGITS)))


def write_passkey_docs(
    folder: pathlib.Path | str,
    count: int,
    length_chars: int,
    seed: int,
    *,
    min_chars: int | None = None,
) -> pathlib.Path:
    """Write ``count`` passkey documents to ``folder/passkey.jsonl`` and return its path. Each
    has a random 5-digit key at a uniform random depth; its length is ``length_chars``, or drawn
    uniformly from [``min_chars``, ``length_chars``] when ``min_chars`` is given (documents of
    several lengths put the needle at many distances from the question). The same seed writes the
    same bytes."""
    if count < 1 or length_chars < 1:
        raise ValueError(
            f"write_passkey_docs: count {count} and length_chars {length_chars} must be >= 1"
        )
    shortest = length_chars if min_chars is None else min_chars
    if not 1 <= shortest <= length_chars:
        raise ValueError(
            f"write_passkey_docs: min_chars {min_chars} must be within [1, {length_chars}]"
        )
    rows = []
    for index in range(count):
        rng = rng_for(seed, "passkey", index)
        key = random_key(rng)
        depth = round(float(rng.uniform(0.0, 1.0)), 4)
        length = int(rng.integers(shortest, length_chars + 1))
        rows.append({"text": passkey_text(length, depth, key), "passkey": key, "depth": depth})
    path = pathlib.Path(folder) / "passkey.jsonl"
    write_jsonl(path, rows)
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="write passkey documents as a text JSONL file")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="folder of passkey.jsonl")
    parser.add_argument("--count", type=int, default=1000, help="documents (default 1000)")
    parser.add_argument("--length-chars", type=int, default=8000, help="longest, in characters")
    parser.add_argument("--min-chars", type=int, default=None, help="shortest (default: all one)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = write_passkey_docs(
        args.out, args.count, args.length_chars, args.seed, min_chars=args.min_chars
    )
    print(f"{path}: {args.count} passkey documents")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
