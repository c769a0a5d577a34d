"""``earlyfuse-train`` with faults injected, for the tests (train/callbacks/faults.py):

    python tests/train_with_faults.py --fault kill_at_step=3 [--fault ...] HYDRA_OVERRIDES...
    python -m torch.distributed.run --nproc_per_node 2 tests/train_with_faults.py --fault ... ...

The same entry point as ``python -m train.app``, with the fault callback registered last.
"""

from __future__ import annotations

import sys

from train.app import main
from train.callbacks.faults import FaultConfig, FaultInjection


def split_faults(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the ``--fault NAME=VALUE`` items, the rest of the command line)."""
    faults, rest = [], []
    args = iter(argv)
    for arg in args:
        if arg == "--fault":
            faults.append(next(args))
        elif arg.startswith("--fault="):
            faults.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    return faults, rest


if __name__ == "__main__":
    items, rest = split_faults(sys.argv[1:])
    faults = FaultConfig.parse(items)
    sys.argv = [sys.argv[0], *rest]
    main(extra_callbacks=lambda cfg: [FaultInjection(faults, seed=cfg.train.seed)])
