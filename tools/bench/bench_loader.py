"""Loader benchmarks, on the demo's token shards (``make demo``), in one process
(docs/benchmarks.md, "Loader: the token path", has the method and the figures): tokens/s of the
token path on one core against plain ``webdataset`` ``np.load``-ing the same shards; the RSS
while it packs ``--samples`` samples' worth of tokens (flat); a restore at the start of the
stream against one after those samples (equal: restoring seeks, never replays).

    .venv/bin/python tools/bench/bench_loader.py [--tokens runs/demo/tokens] [--samples 100000]

With ``--data`` or ``--run``, instead: how well each training step carries the configured mix
(docs/benchmarks.md, "Mix per step"), over the batches the loader alone gives a run of a data
config, each ``--mix-chunk`` value in turn (0: ``seq_len``; ``--whole-docs`` also whole
documents), or over a finished run's ``mix/<source>`` metrics.

    .venv/bin/python tools/bench/bench_loader.py --data configs/data/demo.yaml --steps 300 \
        --micro-batch 8 [--mix-chunk 0,256] [--whole-docs]
    .venv/bin/python tools/bench/bench_loader.py --run runs/demo/lm
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.loader import LoaderConfig, build_loader  # noqa: E402
from tools.bench import loader_start, machine, report, status_mib, token_loader_config  # noqa: E402


def ours(cfg: LoaderConfig, min_tokens: int) -> float:
    """Tokens/s of the loader over at least ``min_tokens`` packed tokens."""
    batches, tokens = iter(build_loader(cfg, rank=0, world_size=1, micro_batch=8)), 0
    started = time.perf_counter()
    while tokens < min_tokens:
        tokens += int(next(batches)["num_real_tokens"])
    seconds = time.perf_counter() - started
    batches.close()
    return tokens / seconds


def plain_wds(shards: list[str], min_tokens: int) -> float:
    """Tokens/s of plain webdataset ``np.load``-ing every sample's arrays."""
    import webdataset as wds

    tokens, started = 0, time.perf_counter()
    while tokens < min_tokens:
        for sample in wds.WebDataset(shards, shardshuffle=False, empty_check=False):
            ids = np.load(io.BytesIO(sample["ids.npy"]), allow_pickle=False)
            np.load(io.BytesIO(sample["mod.npy"]), allow_pickle=False)
            json.loads(sample["json"])
            tokens += len(ids)
    return tokens / (time.perf_counter() - started)


SHARE_OVER, WEIGHT_UNDER = 0.60, 0.30


def figures(steps: list[dict[str, float]], weights: dict[str, float]) -> dict:
    """``steps``: per step, tokens (or shares) per source. Returns the step count, the steps
    dominated by a small source, their share and the mean KL of the step mix from the target."""
    total_w = sum(weights.values())
    target = {source: weight / total_w for source, weight in weights.items()}
    dominated, kls = 0, []
    for mix in steps:
        total = sum(mix.get(source, 0.0) for source in target)
        if total <= 0:
            continue
        share = {source: mix.get(source, 0.0) / total for source in target}
        dominated += any(
            share[source] > SHARE_OVER and target[source] < WEIGHT_UNDER
            for source in target
            if target[source] > 0
        )
        kls.append(
            sum(
                prob * math.log(prob / target[source]) for source, prob in share.items() if prob > 0
            )
        )
    count = len(kls)
    return {
        "steps": count,
        "dominated_steps": dominated,
        "dominated_share": dominated / count if count else 0.0,
        "mean_kl": sum(kls) / count if count else 0.0,
    }


def from_run(run: Path) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Each logged step's ``mix/<source>`` shares and the config's weights, read as
    earlyfuse-report reads the run (after a resume the pass the run goes on with wins)."""
    from tools.report.run import load_run

    data = load_run(run)
    steps = [
        {key[4:]: value for key, value in data.records[step].items() if key.startswith("mix/")}
        for step in data.steps
    ]
    return [mix for mix in steps if mix], data.target_mix


def from_loader(data_yaml: Path, steps: int, micro_batch: int, mix_chunk: int, whole: bool):
    from data.loader.preview import config_of

    one_chunk = 10**12 if whole else mix_chunk  # one chunk = a whole document
    cfg = LoaderConfig.from_dict(config_of(data_yaml), num_workers=0, mix_chunk=one_chunk)
    loader = build_loader(cfg, rank=0, world_size=1, micro_batch=micro_batch)
    names = [source.name for source in cfg.sources]
    out = []
    pieces = rows = 0
    batches = iter(loader)
    for _ in range(steps):
        batch = next(batches)
        out.append(
            dict(zip(names, (float(tokens) for tokens in batch["tokens_by_source"].tolist())))
        )
        pieces += int((batch["pieces"][..., 0] >= 0).sum())
        rows += batch["pieces"].shape[0]
    batches.close()
    extra = {
        "packing_efficiency": loader.delivered()["packing_efficiency"],
        "pieces_per_row": pieces / max(rows, 1),
    }
    return out, {source.name: source.weight for source in cfg.sources}, extra


def mix(args) -> list[tuple[str, dict, str]]:
    """The mix figures of ``--run`` or of the loader over ``--data``, printed."""
    rows = []
    if args.run:
        steps, weights = from_run(args.run)
        rows.append((f"run {args.run}", figures(steps, weights), ""))
    else:
        cases = [(int(chunk_text), False) for chunk_text in args.mix_chunk.split(",")]
        if args.whole_docs:
            cases.insert(0, (0, True))
        for chunk, whole in cases:
            steps, weights, extra = from_loader(
                args.data, args.steps, args.micro_batch, chunk, whole
            )
            what = "whole documents" if whole else f"mix_chunk {chunk or 'seq_len'}"
            more = (
                f"; packing efficiency {extra['packing_efficiency']:.1%}, "
                f"{extra['pieces_per_row']:.2f} document pieces per row"
            )
            rows.append((f"loader, {what}", figures(steps, weights), more))
    for what, result, more in rows:
        print(
            f"{what}: {result['dominated_steps']} of {result['steps']} steps "
            f"({result['dominated_share']:.1%}) have one source above {SHARE_OVER:.0%} of the tokens "
            f"while its weight is below {WEIGHT_UNDER:.0%}; mean KL(step mix || weights) "
            f"{result['mean_kl']:.3f} nats{more}"
        )
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=Path, default=Path("runs/demo/tokens"))
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--round-tokens", type=int, default=2_000_000, help="tokens per timed round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--samples", type=int, default=100_000, help="stream length for the RSS and restore figures"
    )
    mix_flags = ap.add_argument_group("mix per step")
    mix_flags.add_argument("--run", type=Path, help="a training run folder (metrics, config.yaml)")
    mix_flags.add_argument("--data", type=Path, help="a data config (configs/data/*.yaml)")
    mix_flags.add_argument("--steps", type=int, default=300)
    mix_flags.add_argument(
        "--micro-batch", type=int, default=8, help="rows per step (x grad_accum)"
    )
    mix_flags.add_argument("--mix-chunk", default="0", help="comma-separated data.mix_chunk values")
    mix_flags.add_argument("--whole-docs", action="store_true", help="also whole documents")
    a = ap.parse_args(argv)
    if a.run and a.data:
        ap.error("give --run or --data, not both")
    if a.run or a.data:
        return {"mix": mix(a)}
    if not (a.tokens / "manifest.json").is_file():
        sys.exit(f"{a.tokens}: no token shards; run `make demo` first (or pass --tokens)")
    manifest = json.loads((a.tokens / "manifest.json").read_text())
    cfg = token_loader_config(a.tokens, a.seq_len, num_workers=0, mode="infinite")
    shards = sorted(glob.glob(str(a.tokens / "*" / "*.tar")))
    res: dict = {
        "machine": machine(),
        "sources": [source.name for source in cfg.sources],
        "shards": len(shards),
        "seq_len": a.seq_len,
    }

    ours(cfg, 200_000), plain_wds(shards, 200_000)  # warm the page cache and imports
    ours_rates, plain_rates = [], []
    for _ in range(a.rounds):
        ours_rates.append(ours(cfg, a.round_tokens))
        plain_rates.append(plain_wds(shards, a.round_tokens))
    res["throughput"] = {
        "ours_tokens_per_s": statistics.mean(ours_rates),
        "plain_wds_tokens_per_s": statistics.mean(plain_rates),
        "ratio": statistics.mean(ours_rates) / statistics.mean(plain_rates),
    }

    per_sample = manifest["totals"]["tokens"] / manifest["totals"]["samples"]
    target = int(a.samples * per_sample)
    loader = build_loader(cfg, rank=0, world_size=1, micro_batch=8)
    batches = iter(loader)
    next(batches)
    start_state = json.loads(json.dumps(loader.state_dict()))
    marks: list[float] = []
    tokens, started = 0, time.perf_counter()
    while tokens < target:
        tokens += int(next(batches)["num_real_tokens"])
        if len(marks) < 100 and tokens >= target * len(marks) / 100:
            marks.append(status_mib("VmRSS"))
    late_state = json.loads(json.dumps(loader.state_dict()))
    batches.close()
    res["rss"] = {
        "tokens": tokens,
        "samples_approx": round(tokens / per_sample),
        "seconds": time.perf_counter() - started,
        "rss_mib_at_10pct": marks[10],
        "rss_mib_at_end": status_mib("VmRSS"),
        "rss_mib_max": max(marks),
    }

    at_start, late = [], []
    for _ in range(3):
        at_start.append(loader_start(cfg, start_state)[1])
        late.append(loader_start(cfg, late_state)[1])
    res["restore"] = {
        "start_s": statistics.median(at_start),
        "late_s": statistics.median(late),
        "ratio": statistics.median(late) / statistics.median(at_start),
        "state_bytes": len(json.dumps(late_state)),
    }

    t, r, rs = res["throughput"], res["rss"], res["restore"]
    print(
        f"token path: {t['ours_tokens_per_s']:,.0f} tokens/s per core packed at seq_len {a.seq_len}, "
        f"{t['ratio']:.2f}x plain webdataset + np.load ({t['plain_wds_tokens_per_s']:,.0f} tokens/s) (target >= 0.8)"
    )
    print(
        f"RSS: {r['rss_mib_at_10pct']:.0f} MiB at 10 % of {r['samples_approx']:,} samples, {r['rss_mib_at_end']:.0f} MiB "
        f"at the end (max {r['rss_mib_max']:.0f})"
    )
    print(
        f"restore + first batch: {rs['start_s'] * 1e3:.0f} ms at the start, {rs['late_s'] * 1e3:.0f} ms after "
        f"{r['samples_approx']:,} samples ({rs['ratio']:.2f}x); state {rs['state_bytes']:,} bytes"
    )
    return report(res)


if __name__ == "__main__":
    main()
