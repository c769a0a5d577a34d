"""Tokenizer input paths against their bare libraries, in one process.

    python tools/bench/bench_tokenize_inputs.py [--corpus runs/demo/corpus] [--decodes 2000]

1. text: our tokenize path (``DocEncoder``: one ``encode_batch`` per chunk of documents) vs bare
   ``tokenizers.Tokenizer.encode_batch`` on the same texts: tokens/s and the ratio.
2. images: ``data.image_prep.load_image`` (EXIF, RGB, grid-multiple resize, JPEG draft) vs a bare
   Pillow ``open -> convert("RGB") -> resize`` to the same sizes: images/s and the ratio.
3. video: ``data.video_frames.decode_frames`` vs bare decord ``VideoReader(BytesIO) -> get_batch``
   of the same frame indices: frames/s and the ratio.
4. RSS after ``--decodes`` video decodes against after 100 (decord has leak reports).
5. visual tokenizer encode throughput (images/s) on CPU, and on CUDA when present.
Every pair runs round-robin in rounds, so both sides see the same machine load; medians.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from data.image_prep import ImagePrep, load_image  # noqa: E402
from data.text_tokenizer import train_bpe  # noqa: E402
from data.video_frames import VideoSampling, decode_frames, pick_frames  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rounds(fns: dict, n: int) -> dict[str, float]:
    """Median seconds of each function over n round-robin rounds (after one warm-up each)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(n):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(samples) for name, samples in times.items()}


def bench_text(corpus: Path, n_rounds: int) -> None:
    texts = [path.read_text(encoding="utf-8") for path in sorted((corpus / "code").rglob("*.py"))][
        :120
    ]
    texts += [
        line
        for path in sorted((corpus / "text").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ][:200]
    tok = train_bpe(texts, 4096)
    tok.encode_special_tokens = True
    from data.text_tokenizer import TextTokenizer
    from data.vocab import VocabLayout

    ours = TextTokenizer(tok, VocabLayout(text_size=tok.get_vocab_size()))
    n_tokens = sum(
        len(encoding.ids) for encoding in tok.encode_batch(texts, add_special_tokens=False)
    )
    # Both sides end with the ids in Python lists: tokens that can be used.
    times = rounds(
        {
            "bare": lambda: [
                encoding.ids for encoding in tok.encode_batch(texts, add_special_tokens=False)
            ],
            "ours": lambda: ours.encode_batch(texts),
        },
        n_rounds,
    )
    print(
        f"text    bare encode_batch {n_tokens / times['bare']:>12,.0f} tok/s   ours {n_tokens / times['ours']:>12,.0f} tok/s"
        f"   ratio {times['bare'] / times['ours']:.3f}"
    )


def bench_images(corpus: Path, n_rounds: int) -> None:
    files = sorted((corpus / "photos").glob("*.jpg")) + sorted((corpus / "photos").glob("*.png"))
    raws = [path.read_bytes() for path in files]
    prep = ImagePrep(factor=8, max_pixels=256 * 256)
    sizes = [prep.target_size(*Image.open(io.BytesIO(raw)).size) for raw in raws]

    def bare():
        for raw, size in zip(raws, sizes):
            Image.open(io.BytesIO(raw)).convert("RGB").resize(size, Image.Resampling.BICUBIC)

    def ours():
        for raw in raws:
            load_image(raw, prep)

    times = rounds({"bare": bare, "ours": ours}, n_rounds)
    print(
        f"images  bare Pillow       {len(raws) / times['bare']:>12,.1f} img/s   ours {len(raws) / times['ours']:>12,.1f} img/s"
        f"   ratio {times['bare'] / times['ours']:.3f}   ({len(raws)} real photos, 256x256 budget)"
    )


def bench_video(corpus: Path, n_rounds: int, decodes: int) -> None:
    import decord

    clips = [path.read_bytes() for path in sorted((corpus / "clips").glob("*.mp4"))]
    sampling, prep = (
        VideoSampling(target_fps=4, max_frames=16),
        ImagePrep(factor=8, max_pixels=96 * 64),
    )
    plans, sizes = [], []
    for raw in clips:
        reader = decord.VideoReader(io.BytesIO(raw), num_threads=1)
        plans.append(
            pick_frames(reader.get_frame_timestamp(list(range(len(reader)))), 4, 16).tolist()
        )
        sizes.append(
            (reader[0].shape[1], reader[0].shape[0])
        )  # in a shard this comes from the index
        del reader
    n_frames = sum(len(plan) for plan in plans)

    def bare():
        for raw, idx in zip(clips, plans):
            reader = decord.VideoReader(io.BytesIO(raw), num_threads=1)
            reader.get_batch(idx).asnumpy()
            del reader

    def ours():
        for raw, size in zip(clips, sizes):
            decode_frames(raw, sampling, prep, size=size)

    times = rounds({"bare": bare, "ours": ours}, n_rounds)
    print(
        f"video   bare decord       {n_frames / times['bare']:>12,.1f} fr/s    ours {n_frames / times['ours']:>12,.1f} fr/s"
        f"    ratio {times['bare'] / times['ours']:.3f}   ({len(clips)} clips)"
    )
    rss = {}
    for i in range(decodes):
        decode_frames(clips[i % len(clips)], sampling, prep, size=sizes[i % len(clips)])
        if i + 1 in (100, decodes):
            rss[i + 1] = rss_mb()
    print(
        f"video   RSS after 100 decodes {rss[100]:.1f} MB, after {decodes}: {rss[decodes]:.1f} MB "
        f"(ratio {rss[decodes] / rss[100]:.3f})"
    )


def bench_vtok(n_rounds: int) -> None:
    from model.visual_tokenizer import vtok_cpu

    for dev in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        model = vtok_cpu().build().to(dev).eval()
        x = torch.rand(64, 3, 64, 64, device=dev) * 2 - 1

        def enc(model=model, x=x, dev=dev):
            with torch.no_grad():
                model.encode(x)
            if dev == "cuda":
                torch.cuda.synchronize()

        times = rounds({"enc": enc}, n_rounds)
        print(
            f"vtok    encode on {dev:<4}     {64 / times['enc']:>12,.1f} img/s   (vtok_cpu, 64x64 images, batch 64)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--corpus", type=Path, default=None, help="a demo corpus (built in a temp folder if absent)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decodes", type=int, default=2000)
    args = parser.parse_args()
    corpus = args.corpus
    if corpus is None or not corpus.is_dir():
        from data.demo_corpus import build

        corpus = Path(tempfile.mkdtemp(prefix="bench_tok_")) / "corpus"
        build(corpus, scale=0.5, progress=False)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    bench_text(corpus, args.rounds)
    bench_images(corpus, args.rounds)
    bench_video(corpus, args.rounds, args.decodes)
    bench_vtok(args.rounds)


if __name__ == "__main__":
    main()
