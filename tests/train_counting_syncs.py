"""``earlyfuse-train`` with every read-back of a tensor's value counted, step by step:

    python tests/train_counting_syncs.py OUT.json HYDRA_OVERRIDES...

On a GPU each of ``Tensor.item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__`` on a device
tensor makes the host wait for the device. A CPU has no such wait to detect (and torch's
``cuda.set_sync_debug_mode`` exists for CUDA only), so the calls themselves are counted: the real
methods are wrapped by a counter, from one step's ``pre_step`` to the next (the step, its
callbacks, and whatever the loop does between them), and written per step to OUT.json as
``{step: {"file:line": calls}}`` (the project's files by their path in it, a library's by its
full path). Calls made where a batch is still being read or packed (the loader's own files,
``data/``) are host work on host arrays, and are left out.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch

from train.app import main
from train.callbacks.base import Callback

METHODS = ("item", "tolist", "__bool__", "__float__", "__int__")
ROOT = Path(__file__).resolve().parents[1]


class SyncCounter(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.steps: dict[int, Counter] = {}
        self.current: Counter | None = None
        self.originals = {name: getattr(torch.Tensor, name) for name in METHODS}
        for name, method in self.originals.items():
            setattr(torch.Tensor, name, self.counting(method))

    def counting(self, method):
        def counted(tensor, *args, **kwargs):
            if self.current is not None:
                frame = sys._getframe(1)
                where = Path(frame.f_code.co_filename)
                if where.parts[-1] == "train_counting_syncs.py":
                    return method(tensor, *args, **kwargs)  # a wrapper calling the next one
                name = str(where.relative_to(ROOT)) if ROOT in where.parents else str(where)
                if not name.startswith("data/"):
                    self.current[f"{name}:{frame.f_lineno}"] += 1
            return method(tensor, *args, **kwargs)

        return counted

    def pre_step(self, trainer, step: int) -> None:
        self.current = self.steps.setdefault(step, Counter())

    def post_train(self, trainer, step: int, final: dict) -> None:
        self.current = None  # the final evaluation and checkpoint are no step's

    def close(self, trainer) -> None:
        self.current = None
        for name, method in self.originals.items():
            setattr(torch.Tensor, name, method)
        self.out.write_text(json.dumps({step: dict(c) for step, c in self.steps.items()}))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    main(extra_callbacks=lambda cfg: [SyncCounter(out)])
