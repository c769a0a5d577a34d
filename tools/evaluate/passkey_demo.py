"""The passkey table of ``make demo-long``: teacher-forced accuracy of a hidden number's digits,
by depth of the needle and length of the document, against a control without the needle.

``python -m tools.evaluate.passkey_demo RELEASE [--lengths 512,1024,2048,4096] [--per-cell 6]``

Design choices:
- Documents are data/demo_corpus/passkey.py's, drawn with a seed of their own (the training
  documents' keys are never asked for), in the text layout training saw (``<|bos|>`` first).
- Teacher forcing: the document is read whole once; at each token of the answer the model's
  most likely next token is compared with the truth. A digit counts as right when the token that
  holds it is predicted exactly (BPE may put several digits in one token).
- The control is the same document without the needle: what the model gets by guessing digits
  (about 10 % for a model that has learnt that a number comes; more where keys share a habit).
- Lengths are in tokens: a document of that many characters would be ~4x longer in tokens
  than wanted, so each length is converted through the filler's characters per token.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from data.demo_corpus._common import rng_for
from data.demo_corpus.passkey import ANSWER_PREFIX, FILLER, passkey_text, random_key

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class Score:
    right: int = 0
    digits: int = 0
    exact: int = 0
    docs: int = 0

    def add(self, other: Score) -> None:
        self.right += other.right
        self.digits += other.digits
        self.exact += other.exact
        self.docs += other.docs

    @property
    def accuracy(self) -> float:
        return self.right / self.digits if self.digits else float("nan")


def answer_tokens(tokenizer, text: str) -> tuple[list[int], int]:
    """(ids with <|bos|> first, index of the answer's first token): the answer is what follows
    the last ``ANSWER_PREFIX``, up to the end of the text."""
    prefix = text[: text.rindex(ANSWER_PREFIX) + len(ANSWER_PREFIX)]
    ids = tokenizer.encode(text)
    head = tokenizer.encode(prefix)
    if ids[: len(head)] != head:
        raise ValueError("the answer does not start on a token boundary")
    return [tokenizer.bos_id, *ids], 1 + len(head)


@torch.no_grad()
def score_document(model, tokenizer, text: str) -> Score:
    ids, start = answer_tokens(tokenizer, text)
    inputs = torch.tensor([ids])
    logits = model(inputs)
    predicted = logits[0, start - 1 : len(ids) - 1].argmax(-1).tolist()
    score = Score(docs=1)
    all_right = True
    for position, guess in zip(range(start, len(ids)), predicted):
        digits = sum(char.isdigit() for char in tokenizer.decode([ids[position]]))
        if not digits:
            continue
        score.digits += digits
        if guess == ids[position]:
            score.right += digits
        else:
            all_right = False
    score.exact = int(all_right and score.digits > 0)
    return score


def chars_per_token(tokenizer) -> float:
    text = FILLER * 40
    return len(text) / len(tokenizer.encode(text))


def passkey_table(
    model,
    tokenizer,
    lengths: list[int],
    depths: tuple[float, ...] = DEPTHS,
    per_cell: int = 6,
    seed: int = 1234,
) -> dict:
    """{"lengths": [...], "depths": [...], "cells": {(length, depth): Score},
    "control": {length: Score}}, lengths in tokens."""
    ratio = chars_per_token(tokenizer)
    cells: dict[tuple[int, float], Score] = {}
    control: dict[int, Score] = {}
    for length in lengths:
        chars = int(length * ratio * 0.95)  # a little under: the needle and question cost more
        control[length] = Score()
        for depth_index, depth in enumerate(depths):
            cell = cells[(length, depth)] = Score()
            for index in range(per_cell):
                rng = rng_for(seed, f"passkey-eval-{length}-{depth_index}", index)
                key = random_key(rng)
                cell.add(score_document(model, tokenizer, passkey_text(chars, depth, key)))
                if depth_index == 0:
                    text = passkey_text(chars, 0.5, key, hidden=False)
                    control[length].add(score_document(model, tokenizer, text))
    return {"lengths": lengths, "depths": list(depths), "cells": cells, "control": control}


def format_table(table: dict, title: str) -> str:
    depths = table["depths"]
    head = f"{'tokens':>7} | " + " ".join(f"d={depth:<4}" for depth in depths) + " | control"
    lines = [title, head, "-" * len(head)]
    for length in table["lengths"]:
        cells = " ".join(f"{table['cells'][(length, depth)].accuracy:6.0%}" for depth in depths)
        lines.append(f"{length:>7} | {cells} | {table['control'][length].accuracy:6.0%}")
    everything = Score()
    for score in table["cells"].values():
        everything.add(score)
    lines.append(
        f"digit accuracy over all cells {everything.accuracy:.1%} (whole key right in "
        f"{everything.exact}/{everything.docs} documents)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from train.release import Release

    parser = argparse.ArgumentParser(
        description="teacher-forced accuracy of a passkey's digits by depth x length (tokens)"
    )
    parser.add_argument("release", nargs="+", help="release folder(s) (earlyfuse-convert release)")
    parser.add_argument("--lengths", default="512,1024,2048,4096", help="tokens, comma-separated")
    parser.add_argument("--per-cell", type=int, default=6, help="documents per depth x length")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    lengths = [int(part) for part in args.lengths.split(",")]
    torch.manual_seed(0)
    for path in args.release:
        release = Release(path)
        model = release.build_model()
        table = passkey_table(
            model, release.text_tokenizer(), lengths, per_cell=args.per_cell, seed=args.seed
        )
        print(format_table(table, f"passkey digits, teacher-forced: {path}"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
