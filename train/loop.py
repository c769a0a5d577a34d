"""The training loop. One iteration is one optimizer step over ``grad_accum`` micro-batches;
everything else (logging, evaluation, checkpoints, monitors) is a callback of ``Run``. A monitor
that orders a rollback raises ``Rollback``: the run reloads a checkpoint, and the loop starts a
fresh batch iterator there, first discarding the window of data it was told to skip."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import closing

from train.dist import all_reduce_sum


class Rollback(Exception):
    def __init__(self, alarm) -> None:
        super().__init__(alarm.message)
        self.alarm = alarm


def reduce_sums(sums: Counter, device) -> dict[str, float]:
    """Sum every metric over ranks in one collective (sums and counts, never means)."""
    import torch

    keys = sorted(sums)
    vec = all_reduce_sum(
        torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=device)
    )
    return dict(zip(keys, vec.tolist()))


def train_loop(run) -> None:
    engine, task, gate, accum, faults = (
        run.engine,
        run.task,
        run.gate,
        run.cfg.train.grad_accum,
        run.faults,
    )
    step = run.start_step
    while step < run.cfg.train.steps:
        with closing(iter(run.stream)) as batches:  # closing stops the loader's workers cleanly
            for _ in range(run.pending_skip):  # the data window a rollback skips
                next(batches)
            run.pending_skip = 0
            try:
                for step in range(step, run.cfg.train.steps):  # noqa: B020 - resumes from step
                    t0 = time.perf_counter()
                    wait, sums = 0.0, Counter()
                    for micro in range(accum):
                        tw = time.perf_counter()
                        batch = faults.batch(step + 1, next(batches), getattr(task, "layout", None))
                        wait += time.perf_counter() - tw
                        out = task.forward(engine, batch)
                        engine.backward(faults.loss(step + 1, out.loss))
                        sums.update({k: float(v) for k, v in out.sums.items()})
                        sums.update(
                            loss_sum=float(faults.loss(step + 1, out.loss.detach())),
                            micro=1,
                            units=out.units,
                        )
                        if micro == accum - 1:
                            # The skip-step gate needs this step's loss, identical on every rank,
                            # before engine.step() applies (or drops) the update.
                            reduced = reduce_sums(sums, run.dist.device)
                            gate.begin(step, reduced["loss_sum"] / reduced["micro"], reduced)
                            run.scale_lr(faults.lr_scale(step + 1))
                        engine.step()
                    run.step_end(step + 1, reduced, time.perf_counter() - t0, wait)
                step = run.cfg.train.steps
            except Rollback as rb:
                step = run.rollback(rb.alarm, step + 1)
