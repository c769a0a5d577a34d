"""How well each training step carries the configured mix.

Two figures over the steps of a run:
- the share of steps in which one source holds more than 60 % of the step's tokens while its
  weight is below 30 % (a step given over to one small source's long document);
- the mean KL divergence KL(step mix || target weights), in nats.

From a finished run, reading its ``mix/<source>`` metrics and the weights in its config.yaml:

    .venv/bin/python tools/bench/bench_mix.py --run runs/demo/lm

Or from the loader alone (the batches a run would get: the loader is deterministic and does not
depend on the model), for a data config, the run's micro batch and step count:

    .venv/bin/python tools/bench/bench_mix.py --data configs/data/demo.yaml --steps 300 \
        --micro-batch 8 [--mix-chunk 0,256]

Each ``--mix-chunk`` value is measured in turn (0: ``seq_len``, the default). ``--whole-docs``
measures the old behaviour too (every document handed out whole).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

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
    earlyfuse-report reads the run (after a resume the last record of a step wins)."""
    from tools.report.run import load_run

    data = load_run(run)
    steps = [
        {key[4:]: value for key, value in data.records[step].items() if key.startswith("mix/")}
        for step in data.steps
    ]
    return [mix for mix in steps if mix], data.target_mix


def from_loader(data_yaml: Path, steps: int, micro_batch: int, mix_chunk: int, whole: bool):
    import yaml

    from data.loader import LoaderConfig, SourceConfig, build_loader

    raw = yaml.safe_load(data_yaml.read_text())
    sources = [SourceConfig(**source) for source in raw["sources"]]
    cfg = LoaderConfig(
        sources=sources,
        seq_len=int(raw.get("seq_len", 2048)),
        seed=int(raw.get("seed", 0)),
        shuffle_buffer=int(raw.get("shuffle_buffer", 1024)),
        num_workers=0,
        mix_chunk=10**12 if whole else mix_chunk,  # one chunk = a whole document
    )
    loader = build_loader(cfg, rank=0, world_size=1, micro_batch=micro_batch)
    names = [source.name for source in sources]
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
    return out, {source.name: source.weight for source in sources}, extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--run", type=Path, help="a training run folder (metrics.jsonl, config.yaml)"
    )
    parser.add_argument(
        "--data", type=Path, help="a data config (configs/data/*.yaml) for the loader"
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per step (x grad_accum)")
    parser.add_argument("--mix-chunk", default="0", help="comma-separated data.mix_chunk values")
    parser.add_argument("--whole-docs", action="store_true", help="also measure whole documents")
    args = parser.parse_args(argv)
    if bool(args.run) == bool(args.data):
        parser.error("give --run or --data")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
