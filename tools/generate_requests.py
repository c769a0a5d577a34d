"""What ``earlyfuse-generate`` does with a release (train/release.py): the ``Generator`` loads it
once and serves requests with the KV-cached ``model.generate`` (docs/checkpoints.md,
"earlyfuse-generate"). Apart from the command line (tools/generate.py) so that other code (the
HF export's check, the scene evaluation: ``sample``, ``draw_image``, ``Generator.caption``)
samples as the command does; ``run_batch`` serves a JSONL file of requests, each line on its
own (a failing one is its ``error`` record).

Prompts are built the way the token shards are (data/tokenize/encoder.py), at the training pixel
budget, so the model sees what it was trained on. Text is sampled under a text-only mask, so
what is printed is the BPE's decode (valid UTF-8); drawings under ``ImageConstraint``, so the
block always parses. Input images are untrusted: refused by their header's size before a pixel
is decoded.
"""

from __future__ import annotations

import json
import math
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data.cli.common import EXIT_REJECTS, USER_ERRORS, rgb_image_formats, with_folder, writable
from data.config_hint import nearest
from data.media import MAX_IMAGE_PIXELS
from data.vocab import Modality, VocabLayout
from train.release import Release, ReleaseError

# a request's sampling keys and their types
SAMPLING = {"max_new_tokens": int, "temperature": float, "top_k": int, "top_p": float, "seed": int}
REQUEST_KEYS = {"id", "prompt", "code", "image", "caption", "draw", "out", "size", "max_size"}
WHOLE = ("max_new_tokens", "top_k", "seed", "max_size")  # the keys that take whole numbers
DRAWING = ("out", "size", "max_size", "guidance")  # the keys only a draw request reads


# --- prompts --------------------------------------------------------------------------------
def draw_prompt(
    caption_ids: list[int], *, bos_id: int, layout: VocabLayout
) -> tuple[list[int], list[int], list[int]]:
    """The drawing prompt for a caption's text ids (``TextTokenizer.encode``; no specials): ids
    ``<bos> caption <boi>``, their modality (text, then structure for ``<boi>``), and ``<bos>
    <boi>``, the request without its caption (the unconditional side of guidance)."""
    boi = layout.structure_id("<boi>")
    ids = [bos_id, *caption_ids, boi]
    modality = [int(Modality.TEXT)] * (len(ids) - 1) + [int(Modality.STRUCTURE)]
    return ids, modality, [bos_id, boi]


def caption_prompt(
    block: np.ndarray,
    block_modality: np.ndarray,
    text_ids: list[int],
    *,
    bos_id: int,
    bidirectional_images: bool,
) -> tuple[list[int], list[int], list[int] | None]:
    """The caption prompt for an image block (``data.layout.image_tokens``) and the text ids
    that follow it (empty for a bare caption): ids ``<bos> [image block] [text]``, their
    modality, and their image ids (0 on the block, -1 elsewhere; None for causal-only models)."""
    ids = [bos_id, *block.tolist(), *text_ids]
    text = int(Modality.TEXT)
    modality = [text, *block_modality.tolist(), *[text] * len(text_ids)]
    image_ids = None
    if bidirectional_images:
        image_ids = [-1] + [0] * len(block) + [-1] * len(text_ids)
    return ids, modality, image_ids


class TextOnly:
    """A ``generate`` constraint (same interface as ImageConstraint): only the text ids of
    ``parts.model``'s vocabulary, but its text tokenizer's pad and bos."""

    def __init__(self, parts) -> None:
        self.mask = torch.zeros(parts.model.cfg.vocab_size, dtype=torch.bool)
        self.mask[: parts.layout.text_size] = True
        self.mask[[parts.text.pad_id, parts.text.bos_id]] = False

    def observe(self, b: int, tok: int, strict: bool = True) -> None:
        pass

    def tokens_to_finish(self, b: int) -> int:
        return 0

    def allowed(self, remaining: int) -> torch.Tensor:
        return self.mask[None]


def sample(
    parts,
    ids: list[int],
    modality: list[int],
    *,
    constraint,
    stop: list[int],
    seed: int = 0,
    image_ids: list[int] | None = None,
    unconditional: list[int] | None = None,
    guidance: float = 1.0,
    **sampling,
) -> list[int]:
    """The ids the KV-cached ``generate`` appends to one prompt (``ids``, its ``modality`` and the
    ``image_ids`` of its bidirectional blocks), from a ``torch.Generator`` seeded with ``seed``;
    ``unconditional``: the prompt that classifier-free ``guidance`` contrasts with; ``sampling``:
    ``SamplingConfig``'s max_new_tokens, temperature (greedy unless given), top_k and top_p.
    ``parts``: the Generator that holds the ``model``, its ``layout``, ``text`` tokenizer and
    (to draw) ``vtok``."""
    from model.generate import SamplingConfig, generate

    device = parts.model.output.weight.device

    def row(values):  # one row [1, n] of a batch, or None
        return None if values is None else torch.tensor([values], dtype=torch.long, device=device)

    # greedy unless a temperature is given (SamplingConfig's own default samples at 1.0)
    options = {"temperature": 0.0, **sampling, "stop_ids": stop, "pad_id": parts.text.pad_id}
    out = generate(
        parts.model,
        row(ids),
        sampling=SamplingConfig(**options),
        constraint=constraint,
        layout=parts.layout,
        modality=row(modality),
        image_ids=row(image_ids),
        generator=torch.Generator(device=device).manual_seed(int(seed)),
        unconditional_ids=row(unconditional),
        guidance=guidance,
    )
    new = out[0, len(ids) :].tolist()
    if 0 < parts.row < len(ids) + len(new):  # RoPE runs on, but the model never trained there
        print(
            f"earlyfuse-generate: note: {len(ids)} prompt + {len(new)} new tokens pass the "
            f"{parts.row}-token rows the model trained on (the release's packing.seq_len): "
            f"positions past {parts.row} were never trained",
            file=sys.stderr,
        )
    return new


def draw_image(
    parts,
    caption: str,
    *,
    size: tuple[int, int] | None,
    side: int,
    **sampling,
) -> tuple[np.ndarray, np.ndarray, int]:
    """The image block sampled after ``<bos> caption <boi>`` under ``ImageConstraint`` (the grid
    ``size``, or the model's choice up to ``side`` a side), decoded: (code grid, pixels [H, W, 3],
    tokens sampled). ``sampling`` may hold a classifier-free ``guidance`` scale (``sample``)."""
    from data.layout import image_block_len, parse_image
    from model.generate import ImageConstraint

    layout = parts.layout
    boi, eoi = layout.structure_id("<boi>"), layout.structure_id("<eoi>")
    need = image_block_len(*(size or (side, side))) - 1  # everything after <boi>
    ids, modality, unconditional = draw_prompt(
        parts.text.encode(caption), bos_id=parts.text.bos_id, layout=layout
    )
    try:
        constraint = ImageConstraint(
            layout, 1, vocab_size=parts.model.cfg.vocab_size, max_h=side, max_w=side, size=size
        )
    except ValueError as e:  # a size outside the layout's grids, a side below 1
        raise ReleaseError(str(e)) from None
    new = sample(
        parts,
        ids,
        modality,
        constraint=constraint,
        stop=[eoi],
        max_new_tokens=need,
        # guidance contrasts the caption with the same request without it: <bos> <boi>
        unconditional=unconditional,
        **sampling,
    )
    block = [boi, *new[: new.index(eoi) + 1]] if eoi in new else [boi, *new]
    codes = parse_image(block, layout)  # the grammar guarantees a well-formed block
    return codes, decode_codes(parts, codes), len(new)


@torch.no_grad()
def decode_codes(parts, codes: np.ndarray) -> np.ndarray:
    """A code grid [h, w] decoded by ``parts.vtok`` into uint8 pixels [H, W, 3]."""
    device = parts.model.output.weight.device
    image = parts.vtok.decode(torch.from_numpy(codes)[None].to(device))[0]  # [3, H, W] in [-1, 1]
    return ((image.float().cpu().permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255).byte().numpy()


@dataclass
class Generator:
    """A release loaded once (model, tokenizers) and the requests it serves."""

    release: Release
    device: torch.device
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        self.model = self.release.build_model(self.device, self.dtype)
        self.layout = self.release.vocab_layout
        self.text = self.release.text_tokenizer()
        self._vtok = None
        row = int((self.release.config.get("packing") or {}).get("seq_len") or 0)
        self._tokenize_options(self.release.config.get("tokenize") or {}, row)

    @classmethod
    def around(cls, model, layout, text, vtok, device, image_max_pixels: int) -> Generator:
        """A Generator around a model built in-process (a test's) with its layout, tokenizers
        (``vtok``: the visual tokenizer, which images need) and training pixel budget: it
        encodes, captions and draws as a release's Generator does."""
        gen = cls.__new__(cls)
        gen.model, gen.layout, gen.text, gen._vtok, gen.device = model, layout, text, vtok, device
        gen._tokenize_options({"image_max_pixels": image_max_pixels})
        return gen

    def _tokenize_options(self, opts: dict, row: int = 0) -> None:
        """How the token data encoded its images (config.json ``tokenize``; ``row``: the
        training row length), so prompts match."""
        self.image_max_pixels = int(opts.get("image_max_pixels", 256 * 256))
        self.row = row  # a prompt and its continuation past it get a note on stderr
        # The longest image block trained on: tokenize's cap (its images were made smaller until
        # they fit) and the row, which no block outlasts (the loader's cap on raw sources)
        caps = [cap for cap in (int(opts.get("max_block_tokens") or 0), row) if cap]
        self.image_max_tokens = min(caps, default=0)
        # "HxW" -> image blocks of the token data at that grid (config.json tokenize.image_grids)
        self.image_grids: dict[str, int] = dict(opts.get("image_grids") or {})
        self.max_source_pixels = MAX_IMAGE_PIXELS  # --max-image-pixels

    @property
    def vtok(self):
        if self._vtok is None:
            self._vtok = self.release.visual_tokenizer(self.device)
        return self._vtok

    def until_eos(self, new: list[int]) -> list[int]:
        return new[: new.index(self.text.eos_id)] if self.text.eos_id in new else new

    def text_result(self, kind: str, text: str, new: list[int]) -> dict:
        """The record of a text or caption request that sampled ``new`` and printed ``text``."""
        return {"kind": kind, "text": text, "tokens": len(new), "stopped": self.text.eos_id in new}

    # --- requests ------------------------------------------------------------------------------
    def continue_text(self, prompt: str, *, code: bool = False, **sampling) -> dict:
        body = self.text.encode(prompt)
        ids = [self.text.bos_id, *body]
        mod = [int(Modality.TEXT)] + [int(Modality.CODE if code else Modality.TEXT)] * len(body)
        new = sample(self, ids, mod, constraint=TextOnly(self), stop=[self.text.eos_id], **sampling)
        kept = self.until_eos(new)
        # Decode prompt and continuation together, so a character split across the boundary is whole.
        full, head = self.text.decode(body + kept), self.text.decode(body)
        cont = full[len(head) :] if full.startswith(head) else self.text.decode(kept)
        return self.text_result("text", cont, new)

    def encode_image(self, image: str | Path | bytes) -> np.ndarray:
        """The code grid of an image file or its bytes, encoded at the tokenizer's size."""
        from data.image_crops import to_tensor
        from data.image_prep import ImagePrep, load_image

        vtok = self.vtok  # a release without one: its own error, not the image's
        try:
            raw = image if isinstance(image, bytes) else Path(image).read_bytes()
            grid, most = self.layout.max_grid, self.image_max_tokens
            prep = ImagePrep(vtok.cfg.factor, self.image_max_pixels, grid, max_tokens=most)
            # writable, as torch.from_numpy wants
            arr = np.array(load_image(raw, prep, max_source_pixels=self.max_source_pixels))
        except Exception as e:  # noqa: BLE001 - whatever a decoder raises on untrusted bytes
            where = "the image bytes" if isinstance(image, bytes) else image
            raise ReleaseError(
                f"{where}: cannot read the image ({type(e).__name__}: {str(e)[:300]})"
            ) from None
        with torch.no_grad():
            return vtok.encode(to_tensor(arr[None]).to(self.device))[0].cpu().numpy()

    def caption(self, image: str | Path | np.ndarray, prompt: str = "", **sampling) -> dict:
        """The text sampled after ``<bos> [the image block] prompt`` (the block's image ids passed
        for bidirectional attention) under the text-only mask, ``<|eos|>`` ending it. ``image``: a
        file, or a code grid already encoded (the scene evaluation's)."""
        from data.layout import image_tokens

        codes = image if isinstance(image, np.ndarray) else self.encode_image(image)
        ids, modality, image_ids = caption_prompt(
            *image_tokens(codes, self.layout),
            self.text.encode(prompt) if prompt else [],
            bos_id=self.text.bos_id,
            bidirectional_images=self.model.cfg.attention.bidirectional_images,
        )
        new = sample(
            self,
            ids,
            modality,
            constraint=TextOnly(self),
            stop=[self.text.eos_id],
            image_ids=image_ids,
            **sampling,
        )
        text = self.text.decode(self.until_eos(new))
        return {**self.text_result("caption", text, new), "image_grid": list(codes.shape)}

    def training_grid(self) -> tuple[int, int] | None:
        """The grid most of the training images had (None when the release does not say): a model
        that saw 6x6 icons draws a 6x6 icon, not a larger grid it never learned to fill."""
        if not self.image_grids:
            return None
        most = max(self.image_grids.items(), key=lambda item: (item[1], item[0]))[0]
        return parse_size(most)

    def default_max_size(self) -> int:
        """The square grid of the training pixel budget (e.g. 256x256 px at factor 8 -> 32)."""
        side = int(math.sqrt(self.image_max_pixels)) // self.vtok.cfg.factor
        return max(1, min(self.layout.max_grid, side))

    def draw(
        self,
        prompt: str,
        out: str | Path,
        *,
        size: tuple[int, int] | None = None,
        max_size: int | None = None,
        **sampling,
    ) -> dict:
        grid_from = "given" if size else ("the model's choice" if max_size is not None else "")
        if size is None and max_size is None:
            size = self.training_grid()
            grid_from = "the training images' most common" if size else "the model's choice"
        if max_size is not None and not 1 <= max_size <= self.layout.max_grid:  # not cut unsaid
            raise ReleaseError(
                f"max_size {max_size}: give 1 to {self.layout.max_grid}, this model's largest grid"
            )
        big = self.layout.max_grid
        if size is not None and not all(1 <= part <= big for part in size):  # named as asked for
            raise ReleaseError(
                f"size {size[0]}x{size[1]}: each side 1 to {big} tokens, this model's largest grid"
            )
        side = max([self.default_max_size() if max_size is None else max_size, *(size or ())])
        out = writable(out, image=True, error=ReleaseError)
        codes, arr, count = draw_image(self, prompt, size=size, side=side, **sampling)
        from PIL import Image

        as_named = rgb_image_formats().get(out.suffix.lower(), "PNG")  # x.jpg: a JPEG
        Image.fromarray(arr, "RGB").save(with_folder(out), as_named)
        return {
            "kind": "draw",
            "out": str(out),
            "grid": list(codes.shape),
            "grid_from": grid_from,
            "pixels": [arr.shape[1], arr.shape[0]],
            "tokens": count,
        }

    def request(self, req: dict, defaults: dict) -> dict:
        """One request (a JSONL line, or the command line's) -> its result record."""
        known = {*REQUEST_KEYS, "guidance", *SAMPLING}
        if unknown := sorted(set(req) - known):
            close = {k: nearest(k, sorted(known)) for k in unknown}
            hint = "; ".join(f"{k!r}: did you mean {c!r}?" for k, c in close.items() if c)
            raise ReleaseError(
                f"unknown request keys {unknown}"
                + (f" ({hint})" if hint else "")
                + f"; known: {sorted(known)}"
            )
        # JSON numbers (not true, "5"), whole where counted
        given = {k: req[k] for k in (*SAMPLING, *WHOLE, "guidance") if req.get(k) is not None}
        bad = [k for k, v in given.items() if type(v) not in (int, float) or k in WHOLE and v % 1]
        if bad:
            whole = "a whole number" if bad[0] in WHOLE else "a number"
            raise ReleaseError(f"{bad[0]} must be {whole}, got {given[bad[0]]!r}")
        texts = [k for k in ("prompt", "image", "draw", "out") if req.get(k) is not None]
        if bad := [k for k in texts if not isinstance(req[k], str)]:  # 5 ran as the text "5"
            raise ReleaseError(f"{bad[0]} must be a JSON string, got {req[bad[0]]!r}")
        if req.get("caption") not in (None, True) or req.get("code", False) not in (True, False):
            raise ReleaseError("'caption' can only be true (an image is captioned); 'code' a bool")
        sampling = {key: kind(req.get(key, defaults[key])) for key, kind in SAMPLING.items()}
        from model.generate import SamplingConfig

        try:  # the line's own values, said as its fault (not a machine's ValueError)
            SamplingConfig(**{k: v for k, v in sampling.items() if k != "seed"})
        except ValueError as e:
            raise ReleaseError(str(e)) from None
        if not -(2**63) <= sampling["seed"] < 2**64:  # what torch.Generator takes
            raise ReleaseError(f"seed {sampling['seed']}: must fit in 64 bits")
        cuts = any(req.get(key) is not None for key in ("top_k", "top_p", "seed"))  # its own
        shaped = sampling["top_k"] or sampling["top_p"] < 1 or req.get("seed") is not None
        if cuts and sampling["temperature"] == 0 and shaped:
            raise ReleaseError(  # greedy would ignore them, as the command line refuses them
                "'top_k', 'top_p' and 'seed' shape a sample, and temperature 0 is greedy: give a "
                "'temperature' too (e.g. 1)"
            )
        if req.get("caption") and req.get("image") is None:
            raise ReleaseError("'caption' needs 'image' (the picture to caption)")
        if req.get("draw") is None and (drawing := [k for k in DRAWING if req.get(k) is not None]):
            raise ReleaseError(f"'{drawing[0]}' is a draw request's key (this line draws nothing)")
        if req.get("code") and (req.get("prompt") is None or req.get("image") is not None):
            raise ReleaseError(
                "'code' is a prompt's (code to continue), not a caption's or a draw's"
            )
        if req.get("code") and not req["prompt"]:
            raise ReleaseError(
                "'code' needs a prompt (the code to continue): an empty one marks nothing as "
                "code, and the model would continue plain text"
            )
        if req.get("draw") is not None:
            if not req.get("out"):
                raise ReleaseError("a draw request needs 'out' (the image to write)")
            if req.get("prompt") is not None or req.get("image") is not None:
                raise ReleaseError("a draw request takes no 'prompt' or 'image' (draw is one)")
            if req.get("max_new_tokens") is not None:
                raise ReleaseError(
                    "a draw request takes no 'max_new_tokens' (its grid is its length)"
                )
            if req.get("size") and req.get("max_size") is not None:
                raise ReleaseError(
                    "'size' fixes the grid and 'max_size' lets the model choose: give one"
                )
            size = parse_size(req["size"]) if req.get("size") else None
            sampling.pop("max_new_tokens")
            res = self.draw(
                str(req["draw"]),
                req["out"],
                size=size,
                max_size=int(given["max_size"]) if "max_size" in given else None,
                guidance=float(req.get("guidance", defaults["guidance"])),
                **sampling,
            )
        elif req.get("image") is not None:
            res = self.caption(req["image"], str(req.get("prompt") or ""), **sampling)
        elif req.get("prompt") is not None:
            res = self.continue_text(
                str(req["prompt"]), code=bool(req.get("code", False)), **sampling
            )
        else:
            raise ReleaseError("a request needs 'prompt', 'image' (to caption) or 'draw' (+ 'out')")
        return {**({"id": req["id"]} if "id" in req else {}), **res}


def parse_size(text) -> tuple[int, int]:
    try:
        height, width = (int(part) for part in str(text).lower().split("x"))
        return height, width
    except ValueError:
        raise ReleaseError(f"size {text!r}: write it as HxW in tokens, e.g. 8x8") from None


def run_batch(gen: Generator, path: str, dest: str | None, defaults: dict) -> int:
    try:
        if path != "-":
            raw = Path(path).read_bytes()
        else:  # a stdin replaced by text (a notebook's) has no bytes beneath
            raw = (
                sys.stdin.buffer.read()
                if hasattr(sys.stdin, "buffer")
                else sys.stdin.read().encode()
            )
    except OSError as e:
        raise ReleaseError(f"{path}: cannot read the requests ({e})") from None
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\0" in raw.split(b"\n", 1)[0]:
        raise ReleaseError(f"{path}: UTF-16 text (PowerShell's default): save it as UTF-8")
    # decoded line by line: a line that is not UTF-8 is its own error, not the whole file's
    lines = raw.removeprefix(b"\xef\xbb\xbf").splitlines()  # the BOM Windows editors write first
    failed, broke, outs = 0, 0, dict[Path | None, int]()  # image file a request writes -> its line
    requests = 0
    with open(with_folder(dest), "w", encoding="utf-8") if dest else nullcontext(sys.stdout) as out:
        for line_no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            requests += 1
            req = None
            try:
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ReleaseError(
                        f"not UTF-8 (byte {line[e.start]:#04x} at {e.start})"
                    ) from None
                req = json.loads(text)
                if not isinstance(req, dict):
                    raise ReleaseError("a request is a JSON object")
                target = Path(req["out"]).resolve() if isinstance(req.get("out"), str) else None
                if first := outs.get(target):  # a later line overwrote an earlier image
                    raise ReleaseError(f"out {req['out']}: line {first} wrote that file")
                rec = {"line": line_no, **gen.request(req, defaults)}
                outs[target] = line_no if target else 0  # 0: no file, no refusal
            except Exception as e:  # noqa: BLE001 - one bad line never ends the batch
                failed += 1
                broke += not isinstance(e, USER_ERRORS)  # not the line's fault: the machine's
                why = str(e) if isinstance(e, ReleaseError) else f"{type(e).__name__}: {e}"
                named = {"id": req["id"]} if isinstance(req, dict) and "id" in req else {}
                rec = {"line": line_no, **named, "error": why}
            out.write(json.dumps(rec, ensure_ascii=False) + "\n")
            out.flush()
    if failed:
        print(
            f"earlyfuse-generate: {failed} of {requests} request(s) failed (see their 'error')",
            file=sys.stderr,
        )
    if not requests:  # nothing written and nothing said looked like a batch lost
        print(
            f"earlyfuse-generate: no request in {path} (empty, or blank lines only)",
            file=sys.stderr,
        )
    return 1 if broke else EXIT_REJECTS if failed else 0  # 3: done, the failed lines listed
