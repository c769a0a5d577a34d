"""``earlyfuse-generate RELEASE``: sample from a release (train/release.py) with the KV-cached
``model.generate``: continue text or code, caption an image, draw an image to PNG, or run a
JSONL file of such requests.

Design choices:
- Prompts are built the way the token shards are (data/tokenize/encoder.py): a document starts
  with ``<|bos|>``; an image is an Emu3-style block from the release's visual tokenizer at the
  training pixel budget (config.json ``tokenize.image_max_pixels``); text ends with ``<|eos|>``.
- Text and captions are sampled under a text-only mask (no pad, no bos, no structure tokens,
  no codes), so what is printed is the BPE's decode: valid UTF-8, always (a byte sequence the
  model leaves incomplete decodes to U+FFFD). ``<|eos|>`` ends it.
- Drawing ends the prompt with ``<boi>`` and samples under ``ImageConstraint``: the grid size
  is the model's choice up to ``--max-size`` (default: the square grid of the training pixel
  budget) or fixed by ``--size HxW``, and the token budget always fits the image, so the block
  always parses and decodes. ``<eoi>`` ends it.
- Greedy by default (reproducible); ``--temperature/--top-k/--top-p`` sample from a
  ``torch.Generator`` seeded with ``--seed`` (per JSONL line: its own ``seed`` or ``--seed``), so a
  request gives the same output wherever it sits in a batch file.
- ``--batch`` runs requests one after another (prompts of different lengths cannot share a
  batch without padding, which ``generate`` does not take); a failing line gives an ``error``
  record and the others still run, whatever the failure.
- Input images are untrusted: one whose header claims more than ``--max-image-pixels`` (default
  64 M, as ingest) is refused before a pixel is decoded, so a small PNG of 12000x12000 pixels
  cannot take gigabytes; any decoding error (Pillow's ``DecompressionBombError`` included) is
  an error naming the file.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from train.release import DTYPES, Release, ReleaseError

MAX_SOURCE_PIXELS = 64_000_000  # input images, by their header (ingest's --max-image-pixels)

EXAMPLES = """\
examples:
  # continue text, greedy
  earlyfuse-generate releases/demo --prompt "The cat sat on"
  # continue code, sampled
  earlyfuse-generate releases/demo --code --prompt "def fibonacci(n):" --temperature 0.8 --top-p 0.95 --seed 1
  # caption an image (optionally start the caption with --prompt)
  earlyfuse-generate releases/demo --image photo.jpg --caption
  # draw an image from text; the model picks the grid up to --max-size, or fix it with --size
  earlyfuse-generate releases/demo --draw "a red circle on blue" --out circle.png --size 8x8 --temperature 1
  # the same with classifier-free guidance (the caption's pull on every code, times 3)
  earlyfuse-generate releases/demo --draw "a red circle on blue" --out circle.png --guidance 3 --temperature 1
  # many requests, one JSON object per line, results as JSONL on stdout (or --output FILE)
  earlyfuse-generate releases/demo --batch requests.jsonl --output results.jsonl --device cuda
requests.jsonl (paths relative to the current directory):
  {"id": "a", "prompt": "Once upon a time", "max_new_tokens": 40}
  {"id": "b", "prompt": "import numpy", "code": true, "temperature": 0.7, "seed": 3}
  {"id": "c", "image": "photo.jpg", "caption": true}
  {"id": "d", "draw": "a green square", "out": "square.png", "size": "8x8", "guidance": 3}
"""

SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")


class TextOnly:
    """A ``generate`` constraint (same interface as ImageConstraint): only text ids, no pad/bos."""

    def __init__(self, vocab_size: int, text_size: int, banned: list[int]) -> None:
        self.mask = torch.zeros(vocab_size, dtype=torch.bool)
        self.mask[:text_size] = True
        self.mask[banned] = False

    def observe(self, b: int, tok: int, strict: bool = True) -> None:
        pass

    def tokens_to_finish(self, b: int) -> int:
        return 0

    def allowed(self, remaining: int) -> torch.Tensor:
        return self.mask[None]


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
        opts = self.release.config.get("tokenize") or {}
        self.image_max_pixels = int(opts.get("image_max_pixels", 256 * 256))
        self.max_source_pixels = MAX_SOURCE_PIXELS  # --max-image-pixels

    @property
    def vtok(self):
        if self._vtok is None:
            self._vtok = self.release.visual_tokenizer(self.device)
        return self._vtok

    # --- sampling ------------------------------------------------------------------------------
    def _run(
        self,
        ids: list[int],
        modality: list[int],
        *,
        constraint,
        stop: list[int],
        max_new_tokens: int,
        temperature: float,
        top_k: int,
        top_p: float,
        seed: int,
        image_ids: list[int] | None = None,
        unconditional: list[int] | None = None,
        guidance: float = 1.0,
    ) -> list[int]:
        from model.generate import SamplingConfig, generate

        sampling = SamplingConfig(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop_ids=stop,
            pad_id=self.text.pad_id,
        )
        gen = torch.Generator(device=self.device).manual_seed(int(seed))
        prompt = torch.tensor([ids], dtype=torch.long, device=self.device)
        mod = torch.tensor([modality], dtype=torch.long, device=self.device)
        img = (
            torch.tensor([image_ids], dtype=torch.long, device=self.device)
            if image_ids is not None
            else None
        )
        out = generate(
            self.model,
            prompt,
            sampling=sampling,
            constraint=constraint,
            layout=self.layout,
            modality=mod,
            image_ids=img,
            generator=gen,
            unconditional_ids=(
                torch.tensor([unconditional], dtype=torch.long, device=self.device)
                if unconditional is not None
                else None
            ),
            guidance=guidance,
        )
        return out[0, len(ids) :].tolist()

    def _text_constraint(self) -> TextOnly:
        return TextOnly(
            self.model.cfg.vocab_size, self.layout.text_size, [self.text.pad_id, self.text.bos_id]
        )

    def _until_eos(self, new: list[int]) -> list[int]:
        return new[: new.index(self.text.eos_id)] if self.text.eos_id in new else new

    # --- requests ------------------------------------------------------------------------------
    def continue_text(self, prompt: str, *, code: bool = False, **sampling) -> dict:
        from data.vocab import Modality

        body = self.text.encode(prompt)
        ids = [self.text.bos_id, *body]
        mod = [int(Modality.TEXT)] + [int(Modality.CODE if code else Modality.TEXT)] * len(body)
        new = self._run(
            ids, mod, constraint=self._text_constraint(), stop=[self.text.eos_id], **sampling
        )
        kept = self._until_eos(new)
        # Decode prompt and continuation together, so a character split across the boundary is whole.
        full, head = self.text.decode(body + kept), self.text.decode(body)
        cont = full[len(head) :] if full.startswith(head) else self.text.decode(kept)
        return {
            "kind": "text",
            "text": cont,
            "tokens": len(new),
            "stopped": self.text.eos_id in new,
        }

    def encode_image(self, path: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, modality, code grid [H, W]) of an image file's block."""
        from data.image_crops import to_tensor
        from data.image_prep import ImagePrep, load_image
        from data.layout import image_tokens

        try:
            raw = Path(path).read_bytes()
            prep = ImagePrep(
                factor=self.vtok.cfg.factor,
                max_pixels=self.image_max_pixels,
                max_grid=self.layout.max_grid,
            )
            # writable, as torch.from_numpy wants
            arr = np.array(load_image(raw, prep, max_source_pixels=self.max_source_pixels))
        except Exception as e:  # noqa: BLE001 - whatever a decoder raises on untrusted bytes
            raise ReleaseError(
                f"{path}: cannot read the image ({type(e).__name__}: {str(e)[:300]})"
            ) from None
        with torch.no_grad():
            codes = self.vtok.encode(to_tensor(arr[None]).to(self.device))[0].cpu().numpy()
        return (*image_tokens(codes, self.layout), codes)

    def caption(self, image: str | Path, prompt: str = "", **sampling) -> dict:
        from data.vocab import Modality

        block, bmod, codes = self.encode_image(image)
        body = self.text.encode(prompt) if prompt else []
        ids = [self.text.bos_id, *block.tolist(), *body]
        mod = [int(Modality.TEXT), *bmod.tolist(), *[int(Modality.TEXT)] * len(body)]
        image_ids = None
        if (
            self.model.cfg.attention.bidirectional_images
        ):  # the block sees itself both ways, as in training
            image_ids = [-1] + [0] * len(block) + [-1] * len(body)
        new = self._run(
            ids,
            mod,
            constraint=self._text_constraint(),
            stop=[self.text.eos_id],
            image_ids=image_ids,
            **sampling,
        )
        return {
            "kind": "caption",
            "text": self.text.decode(self._until_eos(new)),
            "tokens": len(new),
            "stopped": self.text.eos_id in new,
            "image_grid": list(codes.shape),
        }

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
        max_new_tokens: int | None = None,
        guidance: float = 1.0,
        **sampling,
    ) -> dict:
        from data.layout import image_block_len, parse_image
        from data.vocab import Modality
        from model.generate import ImageConstraint

        lay = self.layout
        boi, eoi = lay.structure_id("<boi>"), lay.structure_id("<eoi>")
        side = max_size or self.default_max_size()
        need = (
            image_block_len(*size) - 1 if size else image_block_len(side, side) - 1
        )  # everything after <boi>
        body = self.text.encode(prompt)
        ids = [self.text.bos_id, *body, boi]
        mod = [int(Modality.TEXT)] * (len(ids) - 1) + [int(Modality.STRUCTURE)]
        try:
            constraint = ImageConstraint(
                lay, 1, vocab_size=self.model.cfg.vocab_size, max_h=side, max_w=side, size=size
            )
        except ValueError as e:
            raise ReleaseError(f"--size: {e}") from None
        new = self._run(
            ids,
            mod,
            constraint=constraint,
            stop=[eoi],
            max_new_tokens=max(need, max_new_tokens or 0),
            # guidance contrasts the caption with the same request without it: <bos> <boi>
            unconditional=[self.text.bos_id, boi],
            guidance=guidance,
            **sampling,
        )
        block = [boi, *new[: new.index(eoi) + 1]] if eoi in new else [boi, *new]
        codes = parse_image(block, lay)  # the grammar guarantees a well-formed block
        with torch.no_grad():
            img = self.vtok.decode(torch.from_numpy(codes)[None].to(self.device))[0]
        arr = (
            ((img.float().cpu().permute(1, 2, 0) + 1) * 127.5)
            .round()
            .clamp(0, 255)
            .to(torch.uint8)
            .numpy()
        )
        from PIL import Image

        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(arr, "RGB").save(out, format="PNG")
        return {
            "kind": "draw",
            "out": str(out),
            "grid": list(codes.shape),
            "pixels": [arr.shape[1], arr.shape[0]],
            "tokens": len(new),
        }

    def request(self, req: dict, defaults: dict) -> dict:
        """One request (a JSONL line, or the command line's) -> its result record."""
        known = {
            "id",
            "prompt",
            "code",
            "image",
            "caption",
            "draw",
            "out",
            "size",
            "max_size",
            "guidance",
            *SAMPLING_KEYS,
        }
        unknown = sorted(set(req) - known)
        if unknown:
            raise ReleaseError(f"unknown request keys {unknown}; known: {sorted(known)}")
        sampling = {key: req.get(key, defaults[key]) for key in SAMPLING_KEYS}
        sampling = {
            "max_new_tokens": int(sampling["max_new_tokens"]),
            "temperature": float(sampling["temperature"]),
            "top_k": int(sampling["top_k"]),
            "top_p": float(sampling["top_p"]),
            "seed": int(sampling["seed"]),
        }
        if req.get("draw") is not None:
            if not req.get("out"):
                raise ReleaseError("a draw request needs 'out' (the PNG to write)")
            size = parse_size(req["size"]) if req.get("size") else None
            sampling.pop("max_new_tokens")
            res = self.draw(
                str(req["draw"]),
                req["out"],
                size=size,
                max_size=req.get("max_size"),
                guidance=float(req.get("guidance", defaults.get("guidance", 1.0))),
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


def write_utf8(text: str, stream=None) -> None:
    """UTF-8 whatever the locale says (the console may claim ASCII)."""
    stream = stream or sys.stdout
    data = text.encode("utf-8", errors="replace")
    buf = getattr(stream, "buffer", None)
    if buf is not None:
        stream.flush()
        buf.write(data)
        buf.flush()
    else:
        stream.write(data.decode("utf-8"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="earlyfuse-generate",
        description="Sample from an earlyfuse release (earlyfuse-convert release): continue text or code, caption "
        "an image, draw an image to PNG, or run a JSONL file of requests. KV-cached; CPU by default.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("release", metavar="RELEASE", help="a release folder")
    parser.add_argument(
        "--prompt", help="text to continue (with --image: the start of the caption)"
    )
    parser.add_argument("--image", metavar="PATH", help="an image file to caption (with --caption)")
    parser.add_argument("--draw", metavar="TEXT", help="draw an image from TEXT (needs --out)")
    parser.add_argument(
        "--batch", metavar="JSONL", help="one request per line (see below); '-' reads stdin"
    )
    parser.add_argument(
        "--caption",
        action="store_true",
        help="caption --image (what an image prompt does; may be left out)",
    )
    parser.add_argument(
        "--code", action="store_true", help="the prompt is code (modality code instead of text)"
    )
    parser.add_argument("--out", metavar="PNG", help="where --draw writes its image")
    parser.add_argument(
        "--size",
        metavar="HxW",
        help="--draw: a fixed grid in tokens (pixels = tokens x the visual tokenizer's factor)",
    )
    parser.add_argument(
        "--max-size",
        type=int,
        default=None,
        help="--draw: largest grid side the model may choose "
        "(default: the square grid of the training pixel budget)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=64, help="text and captions (default 64)"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--guidance",
        type=float,
        default=1.0,
        help="--draw: classifier-free guidance scale; every code is sampled from the "
        "log-probabilities after no caption plus SCALE x (after the caption - after none); "
        "1 = off (default), 3-5 draw closer to the caption",
    )
    parser.add_argument(
        "--output", metavar="JSONL", help="--batch: write results here instead of stdout"
    )
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=MAX_SOURCE_PIXELS,
        metavar="N",
        help="refuse input images whose header claims more pixels, before decoding (default 64M)",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    parser.add_argument(
        "--dtype", choices=["fp32", "bf16"], default="fp32", help="compute dtype (default fp32)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    modes = [
        mode
        for mode, chosen in (
            ("--prompt", args.prompt is not None and not args.image),
            ("--image", args.image),
            ("--draw", args.draw is not None),
            ("--batch", args.batch),
        )
        if chosen
    ]
    if len(modes) != 1:
        parser.error(
            "give one of --prompt TEXT, --image PATH --caption, --draw TEXT --out PNG, --batch JSONL"
            + (f" (got {' '.join(modes)})" if modes else "")
        )
    if args.caption and not args.image:
        parser.error("--caption needs --image PATH")
    if args.draw is not None and not args.out:
        parser.error("--draw needs --out PNG")
    defaults = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "guidance": args.guidance,
    }
    try:
        gen = Generator(Release(args.release), torch.device(args.device), DTYPES[args.dtype])
        gen.max_source_pixels = args.max_image_pixels
        if args.batch:
            return run_batch(gen, args.batch, args.output, defaults)
        if args.draw is not None:
            req = {"draw": args.draw, "out": args.out, "size": args.size, "max_size": args.max_size}
        elif args.image:
            req = {"image": args.image, "caption": True, "prompt": args.prompt or ""}
        else:
            req = {"prompt": args.prompt, "code": args.code}
        res = gen.request(req, defaults)
    except ReleaseError as e:
        print(f"earlyfuse-generate: error: {e}", file=sys.stderr)
        return 1
    if res["kind"] == "draw":
        print(
            f"wrote {res['out']}: {res['grid'][0]}x{res['grid'][1]} tokens, "
            f"{res['pixels'][0]}x{res['pixels'][1]} pixels"
        )
    else:
        write_utf8(res["text"] + "\n")
    return 0


def run_batch(gen: Generator, path: str, output: str | None, defaults: dict) -> int:
    try:
        lines = (
            sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        ).splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ReleaseError(f"{path}: cannot read the requests ({e})") from None
    out = open(output, "w", encoding="utf-8") if output else None
    failed = 0
    try:
        for line_no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            req = None
            try:
                req = json.loads(line)
                if not isinstance(req, dict):
                    raise ReleaseError("a request is a JSON object")
                rec = {"line": line_no, **gen.request(req, defaults)}
            except Exception as e:  # noqa: BLE001 - one bad line never ends the batch
                failed += 1
                why = str(e) if isinstance(e, ReleaseError) else f"{type(e).__name__}: {e}"
                rec = {
                    "line": line_no,
                    **({"id": req["id"]} if isinstance(req, dict) and "id" in req else {}),
                    "error": why,
                }
            text = json.dumps(rec, ensure_ascii=False) + "\n"
            if out:
                out.write(text)
                out.flush()
            else:
                write_utf8(text)
    finally:
        if out:
            out.close()
    if failed:
        print(
            f"earlyfuse-generate: {failed} of {len(lines)} request(s) failed (see their 'error')",
            file=sys.stderr,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
