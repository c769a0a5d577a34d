"""The training loop. One iteration is one optimizer step over ``grad_accum`` micro-batches;
everything else (logging, evaluation, checkpoints, monitors) is a callback of ``Run``."""
from __future__ import annotations

import time
from collections import Counter
from contextlib import closing

from train.dist import all_reduce_sum


def reduce_sums(sums: Counter, device) -> dict[str, float]:
    """Sum every metric over ranks in one collective (sums and counts, never means)."""
    import torch

    keys = sorted(sums)
    vec = all_reduce_sum(torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=device))
    return dict(zip(keys, vec.tolist()))


def train_loop(run) -> None:
    engine, task, gate, accum = run.engine, run.task, run.gate, run.cfg.train.grad_accum
    with closing(iter(run.stream)) as batches:   # closing stops the loader's workers cleanly
        for step in range(run.start_step, run.cfg.train.steps):
            t0 = time.perf_counter()
            wait, sums = 0.0, Counter()
            for micro in range(accum):
                tw = time.perf_counter()
                batch = next(batches)
                wait += time.perf_counter() - tw
                out = task.forward(engine, batch)
                engine.backward(out.loss)
                sums.update({k: float(v) for k, v in out.sums.items()})
                sums.update(loss_sum=float(out.loss.detach()), micro=1, units=out.units)
                if micro == accum - 1:
                    # The skip-step gate needs this step's loss, identical on every rank, before
                    # engine.step() applies (or drops) the update.
                    reduced = reduce_sums(sums, run.dist.device)
                    gate.begin(step, reduced["loss_sum"] / reduced["micro"])
                engine.step()
            run.step_end(step + 1, reduced, time.perf_counter() - t0, wait)
