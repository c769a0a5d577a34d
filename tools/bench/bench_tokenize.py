"""``earlyfuse-prep tokenize`` against a bare ``tokenizers.encode_batch`` script, on the same
documents, in the same run (the goal: >= 0.9x the bare script at 1 worker, >= 1.8x from
1 to 2 workers).

    python tools/bench/bench_tokenize.py [--mb 24] [--repeat 3] [--workers 1,2]

The corpus (stdlib sources ingested into raw shards of 512 KB, a 4096-id BPE, an untrained debug
visual tokenizer: tokenize requires the folder), the two commands and the figures are in
docs/benchmarks.md, "Tokenize". Each run is a whole command in a fresh process with one BPE
thread (``RAYON_NUM_THREADS=1``), so that N workers use N cores and the bare script one; with
more than one worker it also runs the bare script with as many BPE threads as the most workers
(``encode_batch`` parallelises by itself: the baseline a sceptic picks for N workers).
Installs nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.bench import machine, medians, rounds  # noqa: E402

BARE = textwrap.dedent(
    """
    import json, sys, tarfile
    import numpy as np
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(sys.argv[1])
    total = 0
    for tar in sys.argv[2:]:
        with tarfile.open(tar) as tf:
            docs = [json.load(tf.extractfile(m)) for m in tf if m.name.endswith(".json")]
        for i in range(0, len(docs), 64):
            texts = [s["text"] for d in docs[i : i + 64] for s in d["segments"]]
            for e in tok.encode_batch(texts, add_special_tokens=False):
                total += len(np.asarray(e.ids, dtype=np.int32))
    print(total)
    """
)


def make_corpus(root: Path, megabytes: float) -> None:
    """Code files and prose-like text files cut from the stdlib, ``megabytes`` in all."""
    (root / "code").mkdir(parents=True)
    (root / "text").mkdir()
    budget = int(megabytes * 1e6)
    count = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            data = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not data.strip() or len(data) > 200_000:
            continue
        folder = "code" if count % 2 else "text"
        name = f"f{count:05d}.py" if folder == "code" else f"f{count:05d}.txt"
        (root / folder / name).write_text(data)
        budget -= len(data.encode())
        count += 1
        if budget <= 0:
            return


def timed(cmd: list[str], env: dict, out: Path | None = None) -> float:
    """Seconds of ``cmd`` (given ``out``: ``--out out``, deleted after)."""
    started = time.perf_counter()
    more = ["--out", str(out)] if out else []
    subprocess.run(
        cmd + more, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    seconds = time.perf_counter() - started
    if out:
        shutil.rmtree(out)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # Large enough that the spawn and imports of a second worker (~0.5 s) do not decide the
    # 1 -> 2 worker ratio on a quiet machine (~4 MB/s per core here).
    parser.add_argument("--mb", type=float, default=24.0, help="corpus size in MB (default 24)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", default="1,2", help="worker counts to run (default 1,2)")
    args = parser.parse_args()
    from data.ingest import ingest
    from data.train_text_tokenizer import train_text_tokenizer

    with tempfile.TemporaryDirectory(prefix="bench_tokenize_") as scratch:
        tmp = Path(scratch)
        make_corpus(tmp / "corpus", args.mb)
        raw = tmp / "raw"
        ingest(
            raw,
            [f"code:{tmp / 'corpus' / 'code'}", f"text:{tmp / 'corpus' / 'text'}"],
            shard_max_bytes=512_000,
        )
        train_text_tokenizer([raw], tmp / "tok", vocab_size=4096, max_chars=3_000_000)
        import torch

        from model.visual_tokenizer import vtok_debug
        from train.tasks.vtok import save_visual_tokenizer

        torch.manual_seed(0)
        save_visual_tokenizer(vtok_debug().build().state_dict(), vtok_debug(), tmp / "vtok")
        shards = sorted(str(path) for path in raw.rglob("*.tar"))
        megabytes = sum(Path(shard).stat().st_size for shard in shards) / 1e6
        env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "true"}
        bare_cmd = [sys.executable, "-c", BARE, str(tmp / "tok" / "tokenizer.json"), *shards]
        prep = str(Path(sys.executable).with_name("earlyfuse-prep"))
        counts = [int(workers) for workers in args.workers.split(",")]
        tokenize = [prep, "tokenize", "--in", str(raw), "--no-progress"]
        tokenize += ["--tokenizer", str(tmp / "tok"), "--visual-tokenizer", str(tmp / "vtok")]
        measures = {"bare": partial(timed, bare_cmd, env)}
        threads = max(counts)
        if threads > 1:
            env_n = {**env, "RAYON_NUM_THREADS": str(threads)}
            measures["bare_n"] = partial(timed, bare_cmd, env_n)
        for workers in counts:
            run = tokenize + ["--workers", str(workers)]
            measures[f"w{workers}"] = partial(timed, run, env, tmp / f"tokens_{workers}")
        med = medians(rounds(measures, args.repeat))
        load = os.getloadavg()
        print(f"machine: {machine()}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
        print(f"corpus: {len(shards)} raw shards, {megabytes:.1f} MB; median of {args.repeat} runs")
        print(f"{'what':<22} {'seconds':>8} {'MB/s':>7} {'vs bare':>8} {'vs 1 worker':>12}")
        print(f"{'bare encode_batch':<22} {med['bare']:8.2f} {megabytes / med['bare']:7.2f}")
        if "bare_n" in med:
            name = f"bare, {threads} BPE threads"
            print(f"{name:<22} {med['bare_n']:8.2f} {megabytes / med['bare_n']:7.2f}")
        for workers in counts:
            seconds = med[f"w{workers}"]
            base = f"{med['w1'] / seconds:12.2f}" if "w1" in med else ""
            print(
                f"{'tokenize --workers ' + str(workers):<22} {seconds:8.2f} {megabytes / seconds:7.2f} "
                f"{med['bare'] / seconds:8.2f} {base}"
            )
        if "bare_n" in med:
            seconds = med[f"w{threads}"]
            print(
                f"tokenize --workers {threads} / bare with {threads} BPE threads: "
                f"{med['bare_n'] / seconds:.2f}x"
            )


if __name__ == "__main__":
    main()
