"""Trainer overhead and data wait, on CPU, in one process.

Overhead: our training step against a minimal loop driving the same engine on the same batches,
drawn once and replayed to both (the loader is not in the comparison). Data wait: the share of
step time a plain ``earlyfuse-train`` run waits for batches. docs/benchmarks.md, "Trainer
overhead and data wait", has the method, targets and figures; ``experiment=demo`` needs the
demo's token shards (``make demo``).

    .venv/bin/python tools/bench/bench_trainer.py [--experiment demo] [--steps 40] [--rounds 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import machine, report, rounds, train_subprocess  # noqa: E402
from train.names import METRICS_FILE  # noqa: E402


class Replay:
    """The trainer's stream, its batches replaced by fixed ones, replayed: only iteration is
    replaced (the callbacks hold the real stream; checkpoints and resume are off)."""

    def __init__(self, stream, batches: list[dict]) -> None:
        self.stream, self.batches = stream, batches

    def __iter__(self):
        yield from itertools.cycle(self.batches)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def overrides(experiment: str, run_dir: Path, *more: str) -> list[str]:
    """Both measures' run: no progress bar, evaluation or checkpoint (none of them is measured)."""
    return [
        f"experiment={experiment}",
        f"run_dir={run_dir}",
        "train.progress=false",
        "train.eval_every=0",
        "train.ckpt_every=0",
        *more,
    ]


def overhead(experiment: str, steps: int, count: int, run_dir: Path) -> dict:
    from contextlib import closing

    from tools.convert_import import compose_run_config
    from train.build import build_trainer
    from train.dist import init_distributed
    from train.names import MODEL_INPUTS

    cfg, yaml = compose_run_config(overrides(experiment, run_dir, "train.resume=false"))
    trainer = build_trainer(cfg, yaml, init_distributed())
    with closing(iter(trainer.stream)) as stream_iter:
        batches = [next(stream_iter) for _ in range(8 * cfg.train.grad_accum)]
    trainer.stream = Replay(trainer.stream, batches)
    engine, accum = trainer.engine, cfg.train.grad_accum
    trainer.total_steps = 10**9
    trainer.callbacks.pre_train(trainer, 0)
    done = 0

    def ours() -> float:
        """What Trainer.fit does per step: the step, then every callback's post_step."""
        nonlocal done
        started = time.perf_counter()
        with closing(iter(trainer.stream)) as stream:
            for _ in range(steps):
                done += 1
                record = trainer.train_step(done, stream)
                assert record is not None  # replayed batches never end
                trainer.callbacks.post_step(trainer, done, record)
        return (time.perf_counter() - started) / steps

    def minimal() -> float:
        gate, trainer.optimizer.gate = trainer.optimizer.gate, None
        started = time.perf_counter()
        for i in range(steps):
            for micro in range(accum):
                batch = batches[(i * accum + micro) % len(batches)]
                loss = engine(**{key: batch[key] for key in MODEL_INPUTS}).loss
                engine.backward(loss)
                engine.step()
        trainer.optimizer.gate = gate
        return (time.perf_counter() - started) / steps

    ours(), minimal()  # warm-up: allocator, first probes
    times = rounds({"ours": ours, "minimal": minimal}, count)
    trainer.callbacks.close(trainer)
    mean = {name: statistics.mean(values) for name, values in times.items()}
    return {
        "ours_step_s": mean["ours"],
        "minimal_step_s": mean["minimal"],
        "ratio": mean["ours"] / mean["minimal"],
        "rounds": count,
        "steps_per_round": steps,
    }


def data_wait(experiment: str, steps: int, run_dir: Path) -> dict:
    train_subprocess(overrides(experiment, run_dir, f"train.steps={steps}"), "the data-wait run")
    recs = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    wait = sum(rec["throughput/data_wait"] * rec["throughput/step_s"] for rec in recs)
    total = sum(rec["throughput/step_s"] for rec in recs)
    return {
        "data_wait": wait / total,
        "steps": len(recs),
        "max_step_wait": max(rec["throughput/data_wait"] for rec in recs),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiment", default="demo")
    parser.add_argument("--steps", type=int, default=40, help="steps per round of each loop")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--wait-steps", type=int, default=150, help="steps of the data-wait run")
    args = parser.parse_args(argv)
    if args.experiment == "demo" and not Path("runs/demo/tokens/text").is_dir():
        sys.exit("runs/demo/tokens: no token shards; run `make demo` first (or pass --experiment)")
    with tempfile.TemporaryDirectory() as tmp:
        res: dict = {"machine": machine(), "experiment": args.experiment}
        # first: a clean process
        res["wait"] = data_wait(args.experiment, args.wait_steps, Path(tmp) / "wait")
        res["overhead"] = overhead(args.experiment, args.steps, args.rounds, Path(tmp) / "overhead")
    overhead_res, wait_res = res["overhead"], res["wait"]
    print(
        f"trainer overhead: {overhead_res['ratio']:.3f}x a minimal loop on the same engine and batches (target <= 1.10); "
        f"step {overhead_res['ours_step_s'] * 1e3:.1f} ms against {overhead_res['minimal_step_s'] * 1e3:.1f} ms"
    )
    print(
        f"data wait: {wait_res['data_wait']:.2%} of step time over {wait_res['steps']} steps (target < 5%), "
        f"worst step {wait_res['max_step_wait']:.1%}"
    )
    return report(res)


if __name__ == "__main__":
    main()
