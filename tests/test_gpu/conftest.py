"""The GPU tests: marked ``gpu``, skipped where torch sees no CUDA device (CPU CI collects and
skips them in milliseconds). ``make test-gpu`` runs them on a CUDA machine; ``tools/gpu_check.sh``
runs them with ``--confcutdir`` set here, so that the fixtures of the other test folders (and the
packages only they need) are not loaded on a GPU machine that lacks them."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make test-gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
