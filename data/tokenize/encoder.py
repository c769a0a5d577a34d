"""Turn raw documents into token documents: one id sequence per document.

``<|bos|> segment segment … <|eos|>``: text and code segments are BPE ids (modality text or
code), images and videos are Emu3-style blocks of visual codes (data/layout.py). Images of a
chunk of documents are encoded in batches of equal shape (the visual tokenizer needs equal
sizes in a batch; the resolution-free layout makes many shapes). A document whose media cannot
be decoded becomes a reject with the reason; the others are unaffected.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace

import numpy as np
import torch

from data.image_crops import to_tensor
from data.image_prep import ImagePrep, describe_member, load_image
from data.layout import image_tokens, video_block_len, video_tokens
from data.schema import Reject
from data.text_tokenizer import TextTokenizer
from data.tokenize.docs import TokenDoc, TokenizeOptions, tokens_by_modality
from data.video_frames import VideoSampling, decode_frames
from data.vocab import Modality

__all__ = ["DocEncoder", "TokenDoc", "TokenizeOptions", "tokens_by_modality"]

MIN_VIDEO_LATENTS = 2  # the first frame and one group: a clip keeps some motion before shrinking


class DocBudgetError(ValueError):
    """A document whose text and images leave its videos too little of ``--doc-budget``."""


class DocEncoder:
    def __init__(
        self, text: TextTokenizer, vtok, opts: TokenizeOptions, device: torch.device
    ) -> None:
        self.text, self.vtok, self.opts, self.device = text, vtok, opts, device
        self.lay = text.layout
        factor = vtok.cfg.factor
        self.image_prep = ImagePrep(
            factor=factor,
            max_pixels=opts.image_max_pixels,
            max_grid=self.lay.max_grid,
            max_tokens=opts.max_block_tokens,
        )
        self.video_prep = ImagePrep(
            factor=factor, max_pixels=opts.video_max_pixels, max_grid=self.lay.max_grid
        )
        # How clips are decoded; the loader's workers swap in data/loader/decode_guard.py's
        self.decode_frames = decode_frames
        self.video_budget = min(
            limit for limit in (opts.video_max_tokens, opts.max_block_tokens) if limit
        )

    # --- visual ----------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, images: list[np.ndarray]) -> list[np.ndarray]:
        """Code grids of images, batched by shape."""
        grids: dict[int, np.ndarray] = {}
        by_shape: dict[tuple, list[int]] = defaultdict(list)
        for index, image in enumerate(images):
            by_shape[image.shape].append(index)
        for indices in by_shape.values():
            for start in range(0, len(indices), self.opts.image_batch):
                part = indices[start : start + self.opts.image_batch]
                batch = to_tensor(np.stack([images[index] for index in part])).to(self.device)
                codes = self.vtok.encode(batch).cpu().numpy()
                for index, grid in zip(part, codes):
                    grids[index] = grid
        return [grids[index] for index in range(len(images))]

    def video_plan(self, seg: dict, budget: int | None = None) -> tuple[ImagePrep, int]:
        """(frame preparation, most frames) under which this video's block fits the budget
        (``budget``, default the per-block one): all the frames the clip yields at ``video_fps``
        if they fit; else fewer frames, down to two latent frames; else smaller frames with two
        latents; one latent frame only when the clip yields one frame, or when even a one-code
        grid cannot carry two."""
        factor, group_size = self.vtok.cfg.factor, self.vtok.cfg.temporal_factor
        budget = self.video_budget if budget is None else budget
        target_w, target_h = self.video_prep.target_size(seg["width"], seg["height"])
        grid_h, grid_w = target_h // factor, target_w // factor
        wanted = _frames_at(seg, self.opts.video_fps)
        latents = 1 + -(-(wanted - 1) // group_size)  # causal: 1 + ceil((T - 1) / group_size)
        num_latents = latents
        while num_latents > 1 and video_block_len(num_latents, grid_h, grid_w) > budget:
            num_latents -= 1
        floor = min(MIN_VIDEO_LATENTS, latents)
        if num_latents < floor and video_block_len(floor, 1, 1) <= budget:
            num_latents = floor
        # Each latent frame is 1 + h * (w + 1) tokens; an image block of the same grid is
        # 4 + h * (w + 1): this image-block bound gives the frame grid that fits ``num_latents``
        # latents.
        frame_cap = (budget - 4) // num_latents + 3
        prep = replace(self.video_prep, max_tokens=frame_cap)
        return prep, 1 + (num_latents - 1) * group_size

    @torch.no_grad()
    def encode_video(
        self, raw: bytes, seg: dict, budget: int | None = None
    ) -> tuple[np.ndarray, list[float]]:
        budget = self.video_budget if budget is None else budget
        prep, max_frames = self.video_plan(seg, budget)
        if video_block_len(1, 1, 1) > budget:
            raise ValueError(f"a video block cannot fit in {budget} tokens")
        clip = self.decode_frames(raw, VideoSampling(self.opts.video_fps, max_frames), prep)
        frames_tensor = to_tensor(clip.frames).unsqueeze(0).to(self.device)
        return self.vtok.encode_video(frames_tensor)[0].cpu().numpy(), [
            round(float(time), 6) for time in clip.times
        ]

    # --- documents -------------------------------------------------------------------------------
    def encode_chunk(self, raw_docs) -> list[TokenDoc | Reject]:
        """Documents of one chunk (``RawDoc`` from data.shards.reader), in order."""
        images: list[np.ndarray] = []
        where: dict[tuple[int, int], int] = {}  # (document, segment) -> position in images
        failed: dict[int, Reject] = {}
        for doc_index, raw_doc in enumerate(raw_docs):
            for seg_index, seg in enumerate(raw_doc.doc["segments"]):
                if seg["type"] == "image" and doc_index not in failed:
                    try:
                        where[(doc_index, seg_index)] = len(images)
                        images.append(
                            load_image(
                                raw_doc.member(seg["member"]),
                                self.image_prep,
                                name=describe_member(raw_doc, seg["member"]),
                            )
                        )
                    except (OSError, ValueError) as e:
                        failed[doc_index] = Reject(
                            f"{raw_doc.shard.name}:{raw_doc.key}.{seg['member']}",
                            "unreadable-image",
                            str(e),
                            key=raw_doc.key,
                            source=raw_doc.doc.get("source"),
                        )
        grids = self.encode_images(images) if images else []
        # All text and code of the chunk in one encode_batch call (the tokenizer's parallel path).
        texts = [
            (doc_index, seg_index, seg["text"])
            for doc_index, raw_doc in enumerate(raw_docs)
            if doc_index not in failed
            for seg_index, seg in enumerate(raw_doc.doc["segments"])
            if seg["type"] in ("text", "code")
        ]
        encoded = self.text.encode_batch([text for _, _, text in texts]) if texts else []
        text_ids = {
            (doc_index, seg_index): ids for (doc_index, seg_index, _), ids in zip(texts, encoded)
        }
        out: list[TokenDoc | Reject] = []
        for doc_index, raw_doc in enumerate(raw_docs):
            if doc_index in failed:
                out.append(failed[doc_index])
                continue
            try:
                out.append(
                    self._assemble(
                        raw_doc,
                        {
                            seg_index: grids[image_pos]
                            for (owner, seg_index), image_pos in where.items()
                            if owner == doc_index
                        },
                        {
                            seg_index: ids
                            for (owner, seg_index), ids in text_ids.items()
                            if owner == doc_index
                        },
                    )
                )
            except ValueError as e:  # DocBudgetError is one: over the budget, not undecodable
                reason = "over-doc-budget" if isinstance(e, DocBudgetError) else "undecodable-video"
                out.append(
                    Reject(
                        f"{raw_doc.shard.name}:{raw_doc.key}",
                        reason,
                        str(e),
                        key=raw_doc.key,
                        source=raw_doc.doc.get("source"),
                    )
                )
        return out

    def _assemble(
        self, rd, grids: dict[int, np.ndarray], text_ids: dict[int, list[int]]
    ) -> TokenDoc:
        ids: list[np.ndarray] = [np.array([self.text.bos_id])]
        mods: list[np.ndarray] = [np.array([int(Modality.TEXT)])]
        spans = []
        pos = 1
        video_budget = self._video_share(rd, grids, text_ids)
        for seg_index, seg in enumerate(rd.doc["segments"]):
            kind = seg["type"]
            span: dict = {"type": kind}
            if kind in ("text", "code"):
                piece = np.asarray(text_ids[seg_index], dtype=np.int64)
                mod = np.full(len(piece), int(Modality.TEXT if kind == "text" else Modality.CODE))
                if seg.get("role"):
                    span["role"] = seg["role"]
            elif kind == "image":
                piece, mod = image_tokens(grids[seg_index], self.lay)
                span["grid"] = list(grids[seg_index].shape)
            else:
                codes, times = self.encode_video(rd.member(seg["member"]), seg, video_budget)
                piece, mod = video_tokens(codes, self.lay)
                span["grid"] = list(codes.shape)
                span["times"] = times
            span.update(start=pos, end=pos + len(piece))
            pos += len(piece)
            ids.append(piece)
            mods.append(mod)
            spans.append(span)
        ids.append(np.array([self.text.eos_id]))
        mods.append(np.array([int(Modality.TEXT)]))
        return TokenDoc(
            rd.key,
            np.concatenate(ids).astype(np.int32),
            np.concatenate(mods).astype(np.uint8),
            spans,
            rd.doc.get("source", ""),
        )

    def _video_share(
        self, rd, grids: dict[int, np.ndarray], text_ids: dict[int, list[int]]
    ) -> int | None:
        """Each video's budget under ``doc_budget``: an equal share of what the document's text,
        images, <|bos|> and <|eos|> leave, never above the per-block budget; None without
        ``doc_budget`` (the per-block budget alone)."""
        videos = sum(seg["type"] == "video" for seg in rd.doc["segments"])
        if not self.opts.doc_budget or not videos:
            return None
        fixed = 2 + sum(len(ids) for ids in text_ids.values())
        fixed += sum(len(image_tokens(grid, self.lay)[0]) for grid in grids.values())
        share = (self.opts.doc_budget - fixed) // videos
        if share < video_block_len(1, 1, 1):
            raise DocBudgetError(
                f"its text and images take {fixed} tokens of --doc-budget {self.opts.doc_budget}, "
                f"leaving {max(share, 0)} for each of its {videos} video(s); a video block needs "
                f"at least {video_block_len(1, 1, 1)}"
            )
        return min(share, self.video_budget)


def _frames_at(seg: dict, fps: float) -> int:
    """Frames a clip yields sampled at ``fps`` (as data.video_frames.pick_frames picks them),
    from its index metadata; a clip without it is taken as long."""
    duration, frames = seg.get("duration"), seg.get("frames")
    if not duration or not frames:
        return 10**6
    return max(1, min(int(frames), math.ceil(float(duration) * fps - 1e-6)))
