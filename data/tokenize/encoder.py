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
from data.image_prep import ImagePrep, load_image
from data.layout import image_tokens, video_block_len, video_tokens
from data.schema import Reject
from data.text_tokenizer import TextTokenizer
from data.tokenize.docs import TokenDoc, TokenizeOptions, tokens_by_modality
from data.video_frames import VideoSampling, decode_frames
from data.vocab import Modality

__all__ = ["DocEncoder", "TokenDoc", "TokenizeOptions", "tokens_by_modality"]

MIN_VIDEO_LATENTS = 2  # the first frame and one group: a clip keeps some motion before shrinking


class DocEncoder:
    def __init__(
        self, text: TextTokenizer, vtok, opts: TokenizeOptions, device: torch.device
    ) -> None:
        self.text, self.vtok, self.opts, self.device = text, vtok, opts, device
        self.lay = text.layout
        f = vtok.cfg.factor
        self.image_prep = ImagePrep(
            factor=f,
            max_pixels=opts.image_max_pixels,
            max_grid=self.lay.max_grid,
            max_tokens=opts.max_block_tokens,
        )
        self.video_prep = ImagePrep(
            factor=f, max_pixels=opts.video_max_pixels, max_grid=self.lay.max_grid
        )
        # How clips are decoded; the loader's workers swap in data/loader/decode_guard.py's
        self.decode_frames = decode_frames
        self.video_budget = min(x for x in (opts.video_max_tokens, opts.max_block_tokens) if x)

    # --- visual ----------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, images: list[np.ndarray]) -> list[np.ndarray]:
        """Code grids of images, batched by shape."""
        grids: dict[int, np.ndarray] = {}
        by_shape: dict[tuple, list[int]] = defaultdict(list)
        for i, im in enumerate(images):
            by_shape[im.shape].append(i)
        for idx in by_shape.values():
            for s in range(0, len(idx), self.opts.image_batch):
                part = idx[s : s + self.opts.image_batch]
                x = to_tensor(np.stack([images[i] for i in part])).to(self.device)
                codes = self.vtok.encode(x).cpu().numpy()
                for i, c in zip(part, codes):
                    grids[i] = c
        return [grids[i] for i in range(len(images))]

    def video_plan(self, seg: dict) -> tuple[ImagePrep, int]:
        """(frame preparation, most frames) under which this video's block fits the budget:
        all the frames the clip yields at ``video_fps`` if they fit; else fewer frames, down to
        two latent frames; else smaller frames with two latents; one latent frame only when the
        clip yields one frame, or when even a one-code grid cannot carry two."""
        f, tf = self.vtok.cfg.factor, self.vtok.cfg.temporal_factor
        budget = self.video_budget
        tw, th = self.video_prep.target_size(seg["width"], seg["height"])
        h, w = th // f, tw // f
        wanted = _frames_at(seg, self.opts.video_fps)
        latents = 1 + -(-(wanted - 1) // tf)  # the causal tokenizer: 1 + ceil((T - 1) / tf)
        lat = latents
        while lat > 1 and video_block_len(lat, h, w) > budget:
            lat -= 1
        floor = min(MIN_VIDEO_LATENTS, latents)
        if lat < floor and video_block_len(floor, 1, 1) <= budget:
            lat = floor
        # Each latent frame is 1 + h * (w + 1) tokens; an image block of the same grid is
        # 4 + h * (w + 1): this image-block bound gives the frame grid that fits ``lat`` latents.
        frame_cap = (budget - 4) // lat + 3
        prep = replace(self.video_prep, max_tokens=frame_cap)
        return prep, 1 + (lat - 1) * tf

    @torch.no_grad()
    def encode_video(self, raw: bytes, seg: dict) -> tuple[np.ndarray, list[float]]:
        prep, max_frames = self.video_plan(seg)
        if video_block_len(1, 1, 1) > self.video_budget:
            raise ValueError(f"a video block cannot fit in {self.video_budget} tokens")
        fr = self.decode_frames(raw, VideoSampling(self.opts.video_fps, max_frames), prep)
        x = to_tensor(fr.frames).unsqueeze(0).to(self.device)
        return self.vtok.encode_video(x)[0].cpu().numpy(), [round(float(t), 6) for t in fr.times]

    # --- documents -------------------------------------------------------------------------------
    def encode_chunk(self, raw_docs) -> list[TokenDoc | Reject]:
        """Documents of one chunk (``RawDoc`` from data.shards.reader), in order."""
        images: list[np.ndarray] = []
        where: dict[tuple[int, int], int] = {}  # (document, segment) -> position in images
        failed: dict[int, Reject] = {}
        for di, rd in enumerate(raw_docs):
            for si, seg in enumerate(rd.doc["segments"]):
                if seg["type"] == "image" and di not in failed:
                    try:
                        where[(di, si)] = len(images)
                        images.append(load_image(rd.member(seg["member"]), self.image_prep))
                    except (OSError, ValueError) as e:
                        failed[di] = Reject(
                            f"{rd.shard.name}:{rd.key}.{seg['member']}",
                            "unreadable-image",
                            str(e),
                            key=rd.key,
                            source=rd.doc.get("source"),
                        )
        grids = self.encode_images(images) if images else []
        # All text and code of the chunk in one encode_batch call (the tokenizer's parallel path).
        texts = [
            (di, si, seg["text"])
            for di, rd in enumerate(raw_docs)
            if di not in failed
            for si, seg in enumerate(rd.doc["segments"])
            if seg["type"] in ("text", "code")
        ]
        encoded = self.text.encode_batch([t for _, _, t in texts]) if texts else []
        text_ids = {(di, si): ids for (di, si, _), ids in zip(texts, encoded)}
        out: list[TokenDoc | Reject] = []
        for di, rd in enumerate(raw_docs):
            if di in failed:
                out.append(failed[di])
                continue
            try:
                out.append(
                    self._assemble(
                        rd,
                        {si: grids[j] for (d, si), j in where.items() if d == di},
                        {si: ids for (d, si), ids in text_ids.items() if d == di},
                    )
                )
            except ValueError as e:
                out.append(
                    Reject(
                        f"{rd.shard.name}:{rd.key}",
                        "undecodable-video",
                        str(e),
                        key=rd.key,
                        source=rd.doc.get("source"),
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
        for si, seg in enumerate(rd.doc["segments"]):
            t = seg["type"]
            span: dict = {"type": t}
            if t in ("text", "code"):
                piece = np.asarray(text_ids[si], dtype=np.int64)
                mod = np.full(len(piece), int(Modality.TEXT if t == "text" else Modality.CODE))
                if seg.get("role"):
                    span["role"] = seg["role"]
            elif t == "image":
                piece, mod = image_tokens(grids[si], self.lay)
                span["grid"] = list(grids[si].shape)
            else:
                codes, times = self.encode_video(rd.member(seg["member"]), seg)
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


def _frames_at(seg: dict, fps: float) -> int:
    """Frames a clip yields sampled at ``fps`` (as data.video_frames.pick_frames picks them),
    from its index metadata; a clip without it is taken as long."""
    duration, frames = seg.get("duration"), seg.get("frames")
    if not duration or not frames:
        return 10**6
    return max(1, min(int(frames), math.ceil(float(duration) * fps - 1e-6)))
