"""``earlyfuse-generate RELEASE``: sample from a release: continue text or code, caption an
image, draw an image to PNG, or run a JSONL file of such requests (docs/checkpoints.md,
"earlyfuse-generate"). This file is the command line (flags and the request they make); what
each request does, and the JSONL batch runner, is tools/generate_requests.py. Every request is seeded
on its own and a failing line of a batch gives an ``error`` record while the others still run,
so a result never depends on its neighbours.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data.cli.common import checked_device, reader_left, writable
from data.media import MAX_IMAGE_PIXELS

EXAMPLES = """\
examples:
  # continue text, greedy
  earlyfuse-generate releases/demo --prompt "The cat sat on"
  # continue code, sampled
  earlyfuse-generate releases/demo --code --prompt "def fibonacci(n):" --temperature 0.8 --top-p 0.95 --seed 1
  # caption an image (optionally start the caption with --prompt)
  earlyfuse-generate releases/demo --image photo.jpg --caption
  # draw an image from text at the training images' most common grid; --size fixes another,
  # --max-size lets the model choose; --out's ending picks the format (none: PNG)
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
        "--prompt",
        help="text to continue: prints the continuation alone (with --image: the caption's start)",
    )
    parser.add_argument("--image", metavar="PATH", help="an image file to caption (with --caption)")
    parser.add_argument("--draw", metavar="TEXT", help="draw an image from TEXT (needs --out)")
    parser.add_argument("--batch", metavar="JSONL", help="one request per line (below); '-': stdin")
    parser.add_argument("--caption", action="store_const", const=True, help="caption --image")
    parser.add_argument("--code", action="store_true", help="the prompt is code, not text")
    parser.add_argument("--out", metavar="IMAGE", help="--draw writes here (.png, .jpg, ...)")
    parser.add_argument(
        "--size",
        metavar="HxW",
        help="--draw: a fixed grid in tokens (pixels = tokens x the visual tokenizer's factor); "
        "default: the grid most of the training images had (recorded by tokenize, carried by the "
        "release)",
    )
    parser.add_argument(
        "--max-size",
        type=int,
        help="--draw: let the model choose the grid, up to this side (without --size or "
        "--max-size: the training images' most common grid; for a release without those counts, "
        "the model's choice up to the square grid of the training pixel budget)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, help="text and captions (default 64; a drawing's is its grid)"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument(
        "--seed", type=int, help="the sampler's seed (default 0); needs --temperature above 0"
    )
    parser.add_argument(
        "--guidance",
        type=float,
        default=1.0,
        help="--draw: classifier-free guidance scale; every code is sampled from the "
        "log-probabilities after no caption plus SCALE x (after the caption - after none); "
        "1 = off (default), 0 = the caption ignored, 3-5 draw closer to it",
    )
    parser.add_argument("--output", metavar="JSONL", help="--batch: results here ('-': stdout)")
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=MAX_IMAGE_PIXELS,
        metavar="N",
        help="refuse input images whose header claims more pixels, before decoding (default 64M)",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="fp32 (default)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if reconfigure := getattr(sys.stdout, "reconfigure", None):  # UTF-8 whatever the locale says
        reconfigure(encoding="utf-8", errors="replace")
    chosen = {"--prompt": args.prompt is not None and not args.image, "--image": args.image}
    chosen |= {"--draw": args.draw is not None, "--batch": args.batch}
    modes = [mode for mode, given in chosen.items() if given]
    if len(modes) != 1:
        parser.error(
            "give one of --prompt TEXT, --image PATH --caption, --draw TEXT --out IMAGE, --batch JSONL"
            + (f" (got {' '.join(modes)})" if modes else "")
        )
    if args.caption and not args.image:
        parser.error("--caption needs --image PATH")
    if (args.draw is None) != (not args.out) or args.output and not args.batch:  # not ignored
        parser.error("--draw TEXT and --out IMAGE go together; --output JSONL needs --batch")
    drawing = args.size or args.max_size is not None or args.guidance != 1 and not args.batch
    if drawing and not args.draw:  # a batch's lines carry their own sizes
        parser.error("--size, --max-size and --guidance are --draw's (--guidance: or --batch's)")
    # what a single request would ignore (a batch's lines say their own)
    if args.code and (args.image or args.draw is not None or args.batch):
        parser.error("--code is --prompt's (code to continue; a --batch line says its own 'code')")
    if args.code and not args.prompt and not args.batch:
        parser.error(
            "--code needs a --prompt (the code to continue): an empty one marks nothing as code"
        )
    if args.draw is not None and args.max_new_tokens is not None:
        parser.error("--max-new-tokens is text's and captions': a drawing's length is its grid")
    if args.max_size is not None and args.max_size < 1:
        parser.error(f"--max-size {args.max_size}: a grid's side is at least 1 token")
    if args.size and args.max_size is not None:
        parser.error("--size fixes the grid and --max-size lets the model choose it: give one")
    if args.max_new_tokens is None:
        args.max_new_tokens = 64
    shaped = args.top_k or args.top_p < 1 or args.seed is not None  # any seed, 0 too, as a line's
    if not args.temperature and shaped and not args.batch:
        parser.error(  # greedy would ignore them
            "--top-k, --top-p and --seed shape a sample, and --temperature 0 (the default) is "
            "greedy: give --temperature too (e.g. 1)"
        )
    args.output = None if args.output == "-" else args.output  # stdout, as --batch -'s stdin
    if args.batch and args.output and Path(args.output).resolve() == Path(args.batch).resolve():
        parser.error(f"--output {args.output} is the --batch file: the results would replace it")
    import torch  # torch and the model load after the flags are read: --help answers at once

    from tools.generate_requests import REQUEST_KEYS, SAMPLING, Generator, run_batch
    from train.release import DTYPES, Release, ReleaseError

    defaults = {key: getattr(args, key) for key in (*SAMPLING, "guidance")}
    defaults["seed"] = args.seed or 0
    try:
        device = torch.device(checked_device(args.device))
        args.out and writable(args.out, image=True)  # refused before the release is loaded
        args.output and writable(args.output)
        gen = Generator(Release(args.release), device, DTYPES[args.dtype])
        gen.max_source_pixels = args.max_image_pixels
        if args.batch:
            return run_batch(gen, args.batch, args.output, defaults)
        # the flags as one request: Generator.request picks draw, caption or text as a line would
        res = gen.request({key: getattr(args, key) for key in REQUEST_KEYS - {"id"}}, defaults)
    except (ReleaseError, ValueError) as e:  # ValueError: a sampling option out of range
        print(f"earlyfuse-generate: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # --batch's results read by `head`
        return reader_left()
    if res["kind"] == "draw":
        print(
            f"wrote {res['out']}: {res['grid'][0]}x{res['grid'][1]} tokens, "
            f"{res['pixels'][1]}x{res['pixels'][0]} pixels (grid: {res['grid_from']})"
        )
    else:
        print(res["text"], flush=True)
        if not res["text"].strip() and res["stopped"]:  # an empty line alone reads as a failure
            what = "caption" if res["kind"] == "caption" else "continuation"
            print(f"(the model ended its {what} at once: it is empty)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
