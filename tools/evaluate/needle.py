"""Needle tests (docs/evaluation.md, "Needle tests", says how each prompt is made and scored):
does the model retrieve what it read far back? Depth x length tables of teacher-forced accuracy,
a key in text (passkey) and a repeated video frame (frame copy), each against a control that has
nothing to retrieve. Every prompt is one document packed alone into a row by the training
packer, so positions and M-RoPE rows and columns are as in training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from data.layout import parse_video, video_block_len, video_tokens
from data.loader import pack_documents
from data.passkey import FILLER_SENTENCES, NEEDLE, QUESTION, random_key
from data.token_docs import iter_documents
from data.vocab import Modality
from tools.evaluate.heldout import Heldout, final_hidden

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
_TEXT = int(Modality.TEXT)


@dataclass
class Prompt:
    ids: np.ndarray  # int64 [n <= length]
    modality: np.ndarray  # uint8 [n]
    blocks: list  # [[start, end, t, h, w], ...]
    target: tuple[int, int]  # [start, end) of the tokens scored


def pack_prompts(prompts: list[Prompt], length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Each prompt alone in a row of ``length`` tokens, as the training loader packs a document
    (``pack_documents``), the rows stacked into one batch."""
    rows = [next(pack_documents([prompt], length, pad_id=pad_id)) for prompt in prompts]
    return {key: torch.cat([row[key] for row in rows]) for key in rows[0] if rows[0][key].ndim}


@torch.no_grad()
def predictions(model, prompts: list[Prompt], length: int, pad_id: int, device, batch_rows: int):
    """The model's argmax next token [P, length] at the positions that predict each prompt's
    target (-1 elsewhere): logits only where they are scored (tools/evaluate/heldout.py)."""
    out = np.full((len(prompts), length), -1, np.int64)
    for start in range(0, len(prompts), batch_rows):
        chunk = prompts[start : start + batch_rows]
        final = final_hidden(model, pack_prompts(chunk, length, pad_id), device)
        rows = [row for row, p in enumerate(chunk) for _ in range(*p.target)]
        cols = [place - 1 for p in chunk for place in range(*p.target)]
        guess = model.output.logits(final[rows, cols]).argmax(-1)
        out[[start + row for row in rows], cols] = guess.cpu().numpy()
    return out


# --- scoring -------------------------------------------------------------------------------------
def digit_hits(predicted: str, target: str) -> tuple[int, int]:
    """(digits of ``target`` that ``predicted`` has at the same place, digits of ``target``)."""
    right = sum(
        1
        for place, char in enumerate(target)
        if char.isdigit() and place < len(predicted) and predicted[place] == char
    )
    return right, sum(char.isdigit() for char in target)


def score_answers(
    predicted: np.ndarray,
    prompts: list[Prompt],
    token_text: Callable[[int], str],
) -> dict:
    """Digits of each prompt's target tokens spelled right by ``predicted`` ([P, T] argmax ids:
    ``predicted[p, j]`` is the guess for token j + 1). ``{"digit": share of digits right,
    "whole": share of prompts with every digit token right, "prompts", "digits"}``."""
    right = total = whole = 0
    for row, prompt in enumerate(prompts):
        all_right = True
        for place in range(*prompt.target):
            target = token_text(int(prompt.ids[place]))
            if not any(char.isdigit() for char in target):
                continue
            guess = token_text(int(predicted[row, place - 1]))
            hits, digits = digit_hits(guess, target)
            right, total = right + hits, total + digits
            all_right = all_right and guess == target
        whole += all_right
    return {
        "digit": right / total if total else None,
        "whole": whole / len(prompts) if prompts else None,
        "prompts": len(prompts),
        "digits": total,
    }


def score_codes(predicted: np.ndarray, prompts: list[Prompt], is_code: Callable[[int], bool]):
    """Share of the code tokens of each prompt's target that ``predicted`` gets right."""
    right = total = 0
    for row, prompt in enumerate(prompts):
        for place in range(*prompt.target):
            if is_code(int(prompt.ids[place])):
                right += int(predicted[row, place - 1] == prompt.ids[place])
                total += 1
    return {"accuracy": right / total if total else None, "prompts": len(prompts), "codes": total}


# --- text: passkey -------------------------------------------------------------------------------
class PasskeyPrompts:
    """Passkey prompts of exact token lengths from a release's text tokenizer."""

    def __init__(self, text_tokenizer) -> None:
        self.tok = text_tokenizer
        self.sentences = [np.array(text_tokenizer.encode(" " + s)) for s in FILLER_SENTENCES]
        self.question = text_tokenizer.encode(" " + QUESTION)
        # A training document (data/passkey.py's passkey_text, tokenized after <bos>) starts
        # with its first word bare, every later one after a space: the prompt's first word is
        # written the same way, so that the prompt is token for token such a document. Its
        # first piece is the first filler sentence or (depth 0) the needle, which start alike
        # (the long-context tests compare prompts of both kinds with such documents).
        word = NEEDLE.split()[0]
        self.spaced_head = text_tokenizer.encode(" " + word)
        self.bare_head = text_tokenizer.encode(word)

    def filler(self, count: int, *, start: int = 0) -> tuple[list[int], list[int]]:
        """``count`` filler tokens (the sentences cycled from ``start``, the last cut short) and
        the sentence boundaries among them, its end included (depth 1 is right before the
        question even when the last sentence is cut)."""
        ids: list[int] = []
        bounds = [0]
        sentence = start
        while len(ids) < count:
            ids += self.sentences[sentence % len(self.sentences)].tolist()
            bounds.append(len(ids))
            sentence += 1
        return ids[:count], [b for b in bounds if b < count] + [count]

    def prompt(self, key: str, *, length: int, depth: float, needle: bool = True) -> Prompt:
        """``<bos>`` filler, the needle at ``depth`` of the filler (at the nearest sentence
        boundary), filler, the question and the key: ``length`` tokens, the tokens of a
        ``passkey_text`` document of that filler (its last sentence cut short) after ``<bos>``,
        up to the key. ``needle=False``: the control, filler in the needle's place."""
        needle_ids = self.tok.encode(" " + NEEDLE.format(key=key))
        answer = self.tok.encode(" " + key)
        bare = len(self.bare_head) - len(self.spaced_head)  # tokens the bare first word adds
        fill = length - 1 - len(needle_ids) - len(self.question) - len(answer) - bare
        if fill < 0:
            raise ValueError(
                f"--needle-lengths {length}: a passkey prompt needs {length - fill} tokens"
            )
        if needle:
            stream, bounds = self.filler(fill)
            cut = min(bounds, key=lambda b: abs(b - depth * fill))
            sentence = bounds.index(cut)
            rest, _ = self.filler(fill - cut, start=sentence)
            body = stream[:cut] + needle_ids + rest
        else:
            body, _ = self.filler(fill + len(needle_ids))
        head = len(self.spaced_head)
        if body[:head] != self.spaced_head:  # a filler too short to hold its first word
            raise ValueError(
                f"a passkey prompt of length {length} has no room for a whole first filler word"
            )
        body = self.bare_head + body[head:]
        ids = np.array([self.tok.bos_id, *body, *self.question, *answer], np.int64)
        return Prompt(ids, np.full(len(ids), _TEXT, np.uint8), [], (length - len(answer), length))

    def token_text(self, token: int) -> str:
        return self.tok.decode([token]) if token < self.tok.layout.text_size else ""


def passkey_table(
    run: Heldout,
    text_tokenizer,
    *,
    lengths: list[int],
    depths: tuple[float, ...] = DEPTHS,
    trials: int = 8,
    digits: int = 5,
) -> dict:
    """``{"lengths", "depths", "trials", "digits", "cells": {length: {depth: score}},
    "control": {length: score}}`` (scores as ``score_answers``); the same ``trials`` keys in
    every cell."""
    maker = PasskeyPrompts(text_tokenizer)
    rng = np.random.default_rng([0, 0x9A55])
    keys = [random_key(rng, digits) for _ in range(trials)]
    pad = text_tokenizer.pad_id
    out: dict = {"lengths": lengths, "depths": list(depths), "trials": trials, "digits": digits}
    out["cells"], out["control"] = {}, {}
    work = [(length, depth) for length in lengths for depth in (*depths, None)]
    for length, depth in tqdm(work, desc="passkey", disable=not run.progress):
        prompts = [
            maker.prompt(key, length=length, depth=depth or 0.0, needle=depth is not None)
            for key in keys
        ]
        guessed = predictions(run.model, prompts, length, pad, run.device, run.batch_rows)
        score = score_answers(guessed, prompts, maker.token_text)
        if depth is None:
            out["control"][str(length)] = score
        else:
            out["cells"].setdefault(str(length), {})[f"{depth:g}"] = score
    return out


# --- video: a frame copied ----------------------------------------------------------------------
def held_out_videos(tables, layout, *, limit: int = 64) -> list[np.ndarray]:
    """Latent code grids [T, H, W] of the first ``limit`` video blocks of the held-out
    documents, those of the most common grid size (H, W) only. Only documents whose index
    lists a video block are read."""
    videos: list[np.ndarray] = []
    for table in tables:
        if len(videos) >= limit:
            break
        with_video = (i for i in range(len(table)) if any(b[2] for b in table.blocks_of(i)))
        for doc in iter_documents([table], samples=with_video):
            for start, end, frames, _, _ in doc.blocks:
                if frames:
                    videos.append(parse_video(doc.ids[start:end], layout))
            if len(videos) >= limit:
                break
    shapes = [video.shape[1:] for video in videos]
    common = max(set(shapes), key=shapes.count, default=None)
    return [video for video in videos if video.shape[1:] == common]


def frame_prompts(
    videos: list[np.ndarray],
    layout,
    bos: int,
    *,
    length: int,
    depth: float,
    trial: int,
    copy: bool,
) -> Prompt:
    """Trial ``trial``'s sequence: video ``trial``'s middle frame at ``depth`` (``copy=False``:
    video ``trial + 1``'s instead) among frames of the other videos, then video ``trial``'s
    frame again, last; ``<bos>`` and one video block of as many frames as fit ``length``."""
    count = len(videos)
    _, height, width = videos[0].shape
    # the most frames whose block fits in the row after <bos>
    frames = (length - 1 - video_block_len(0, height, width)) // (1 + height * (width + 1))
    if frames < 3:
        raise ValueError(
            f"--needle-lengths {length}: a frame-copy sequence needs 3 frames of "
            f"{height}x{width} codes, {1 + video_block_len(3, height, width)} tokens"
        )
    needle_video = videos[trial % count]
    needle = needle_video[len(needle_video) // 2]
    other_video = videos[(trial + 1) % count]
    placed = needle if copy else other_video[len(other_video) // 2]
    pool = [
        frame for v in range(2, count) for frame in videos[(trial + v) % count]
    ]  # the other videos' frames, in order
    slot = round(depth * (frames - 2))
    filler = [pool[i % len(pool)] for i in range(frames - 2)]
    codes = np.stack([*filler[:slot], placed, *filler[slot:], needle])
    block, modality = video_tokens(codes, layout)
    ids = np.concatenate([[bos], block]).astype(np.int64)
    mod = np.concatenate([[_TEXT], modality]).astype(np.uint8)
    last = len(ids) - 1 - (1 + height * (width + 1))  # the last frame's <frame> marker
    return Prompt(ids, mod, [[1, len(ids), frames, height, width]], (last + 1, len(ids) - 1))


def frame_copy_table(
    run: Heldout,
    text_tokenizer,
    *,
    lengths: list[int],
    depths: tuple[float, ...] = DEPTHS,
    trials: int = 8,
) -> dict:
    """``{"lengths", "depths", "trials", "frames": {length: frames in the block}, "grid",
    "cells": {length: {depth: copy score}}, "control": {length: {depth: score}}}`` (scores as
    ``score_codes``) over the held-out videos. It needs 3 of one grid size (the needle's, the
    control's and the filler's): with fewer, ``{"missing": why}``."""
    layout, bos, pad_id = text_tokenizer.layout, text_tokenizer.bos_id, text_tokenizer.pad_id
    videos = held_out_videos(run.tables, layout)
    if len(videos) < 3:
        return {"missing": f"{len(videos)} held-out videos of one grid size; the test needs 3"}
    # Rows too short for 3 of these frames are left out, said in the table: the passkey, whose
    # prompts are much shorter, still runs at them.
    _, height, width = videos[0].shape
    need = 1 + video_block_len(3, height, width)
    short = [length for length in lengths if length < need]
    if not (lengths := [length for length in lengths if length >= need]):
        return {"missing": f"rows of {need}+ tokens hold 3 frames of {height}x{width} codes"}
    out: dict = {"lengths": lengths, "depths": list(depths), "trials": trials}
    if short:
        out["left_out"] = {"lengths": short, "need": need}
    out["grid"] = list(videos[0].shape[1:])
    out["cells"], out["control"], out["frames"] = {}, {}, {}
    work = [(length, depth) for length in lengths for depth in depths]
    for length, depth in tqdm(work, desc="frame copy", disable=not run.progress):
        for copy, into in ((True, out["cells"]), (False, out["control"])):
            prompts = [
                frame_prompts(
                    videos, layout, bos, length=length, depth=depth, trial=trial, copy=copy
                )
                for trial in range(trials)
            ]
            out["frames"][str(length)] = prompts[0].blocks[0][2]
            guessed = predictions(run.model, prompts, length, pad_id, run.device, run.batch_rows)
            into.setdefault(str(length), {})[f"{depth:g}"] = score_codes(
                guessed, prompts, layout.is_code
            )
    return out


def parse_list(text: str, kind: Callable, what: str) -> list:
    """``"256,512"`` -> ``[256, 512]``; a clear error naming the flag otherwise."""
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{what} {text!r}: give comma-separated numbers") from None
    if not values:
        raise ValueError(f"{what} {text!r}: give at least one value")
    return values
