"""DeepSpeed's process-wide settings, applied once before it builds anything.

Design choices:
- DeepSpeed's CPU accelerator JIT-compiles its ``shm_comm`` op whenever its comm backend is
  created (every start, 2-3 minutes the first time, under a lock a second process waits on).
  The op serves only ``inference_all_reduce`` (DeepSpeed's tensor-parallel inference); training
  never calls it, so we mark it incompatible and DeepSpeed falls back to plain torch.distributed
  (its own code path for a machine that cannot build the op). Nothing is compiled.
- DeepSpeed's probes of its ops (test programs compiled through distutils) run with the root
  logger at WARNING: distutils echoes every gcc command at INFO.
- Where an op is built after all (``EARLYFUSE_DEEPSPEED_SHM=1``, or a future op a run needs),
  it is built once per environment: ``TORCH_EXTENSIONS_DIR`` defaults to ``torch_extensions/``
  inside the virtual environment instead of the home folder that every checkout shares.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

_SHM_OP = "deepspeed_shm_comm"


def extensions_dir() -> Path:
    """Where JIT-built ops go: ``$TORCH_EXTENSIONS_DIR``, set to ``<venv>/torch_extensions``
    when unset (``sys.prefix`` is the virtual environment when it runs us)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    return Path(os.environ["TORCH_EXTENSIONS_DIR"])


def prepare_deepspeed() -> None:
    """Call before the first ``deepspeed.init_distributed`` / ``deepspeed.initialize``."""
    extensions_dir()
    if os.environ.get("EARLYFUSE_DEEPSPEED_SHM", "0") == "1":
        return
    import deepspeed.ops

    # A dict DeepSpeed probes once and keeps (deepspeed/ops/__init__.py): our entry sticks. Its
    # probes compile test programs through distutils, which echoes each gcc command at INFO on the
    # root logger ("gcc ... -laio -o /tmp/.../a.out" at every start): not said.
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.WARNING))
    try:
        deepspeed.ops.__compatible_ops__[_SHM_OP] = False
    finally:
        root.setLevel(level)
