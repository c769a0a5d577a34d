"""How well each training step carries the configured mix (issue 13).

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
measures the old behaviour too (every document handed out whole, as before issue 13).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHARE_OVER, WEIGHT_UNDER = 0.60, 0.30


def figures(steps: list[dict[str, float]], weights: dict[str, float]) -> dict:
    """``steps``: per step, tokens (or shares) per source. Returns the step count, the steps
    dominated by a small source, their share and the mean KL of the step mix from the target."""
    total_w = sum(weights.values())
    target = {s: w / total_w for s, w in weights.items()}
    dominated, kls = 0, []
    for mix in steps:
        total = sum(mix.get(s, 0.0) for s in target)
        if total <= 0:
            continue
        share = {s: mix.get(s, 0.0) / total for s in target}
        dominated += any(
            share[s] > SHARE_OVER and target[s] < WEIGHT_UNDER for s in target if target[s] > 0
        )
        kls.append(sum(p * math.log(p / target[s]) for s, p in share.items() if p > 0))
    n = len(kls)
    return {
        "steps": n,
        "dominated_steps": dominated,
        "dominated_share": dominated / n if n else 0.0,
        "mean_kl": sum(kls) / n if n else 0.0,
    }


def from_run(run: Path) -> tuple[list[dict[str, float]], dict[str, float]]:
    import yaml

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    weights = {s["name"]: float(s.get("weight", 1.0)) for s in cfg["data"]["sources"]}
    by_step: dict[int, dict[str, float]] = {}
    with open(run / "metrics.jsonl", encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:  # a half-written last line of a running job
                continue
            mix = {k[4:]: v for k, v in rec.items() if k.startswith("mix/")}
            if mix and "step" in rec:
                by_step[int(rec["step"])] = mix  # after a resume the last record of a step wins
    return [by_step[k] for k in sorted(by_step)], weights


def from_loader(data_yaml: Path, steps: int, micro_batch: int, mix_chunk: int, whole: bool):
    import yaml

    from data.loader import LoaderConfig, SourceConfig, build_loader

    raw = yaml.safe_load(data_yaml.read_text())
    sources = [SourceConfig(**s) for s in raw["sources"]]
    cfg = LoaderConfig(
        sources=sources,
        seq_len=int(raw.get("seq_len", 2048)),
        seed=int(raw.get("seed", 0)),
        shuffle_buffer=int(raw.get("shuffle_buffer", 1024)),
        num_workers=0,
        mix_chunk=10**12 if whole else mix_chunk,  # one chunk = a whole document
    )
    loader = build_loader(cfg, rank=0, world_size=1, micro_batch=micro_batch)
    names = [s.name for s in sources]
    out = []
    pieces = rows = 0
    it = iter(loader)
    for _ in range(steps):
        b = next(it)
        out.append(dict(zip(names, (float(x) for x in b["tokens_by_source"].tolist()))))
        pieces += int((b["pieces"][..., 0] >= 0).sum())
        rows += b["pieces"].shape[0]
    it.close()
    extra = {
        "packing_efficiency": loader.delivered()["packing_efficiency"],
        "pieces_per_row": pieces / max(rows, 1),
    }
    return out, {s.name: s.weight for s in sources}, extra


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run", type=Path, help="a training run folder (metrics.jsonl, config.yaml)")
    p.add_argument("--data", type=Path, help="a data config (configs/data/*.yaml) for the loader")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--micro-batch", type=int, default=8, help="rows per step (x grad_accum)")
    p.add_argument("--mix-chunk", default="0", help="comma-separated data.mix_chunk values")
    p.add_argument("--whole-docs", action="store_true", help="also measure whole documents")
    a = p.parse_args(argv)
    if bool(a.run) == bool(a.data):
        p.error("give --run or --data")
    rows = []
    if a.run:
        steps, weights = from_run(a.run)
        rows.append((f"run {a.run}", figures(steps, weights), ""))
    else:
        cases = [(int(c), False) for c in a.mix_chunk.split(",")]
        if a.whole_docs:
            cases.insert(0, (0, True))
        for chunk, whole in cases:
            steps, weights, extra = from_loader(a.data, a.steps, a.micro_batch, chunk, whole)
            what = "whole documents" if whole else f"mix_chunk {chunk or 'seq_len'}"
            more = (
                f"; packing efficiency {extra['packing_efficiency']:.1%}, "
                f"{extra['pieces_per_row']:.2f} document pieces per row"
            )
            rows.append((f"loader, {what}", figures(steps, weights), more))
    for what, f, more in rows:
        print(
            f"{what}: {f['dominated_steps']} of {f['steps']} steps "
            f"({f['dominated_share']:.1%}) have one source above {SHARE_OVER:.0%} of the tokens "
            f"while its weight is below {WEIGHT_UNDER:.0%}; mean KL(step mix || weights) "
            f"{f['mean_kl']:.3f} nats{more}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
