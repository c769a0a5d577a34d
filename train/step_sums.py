"""A step's sums and counts over its micro-batches, kept where they were made until the step ends.

Design choices:
- The task's sums (loss per modality, counts, monitors' sums) are tensors on the run's device:
  reading each one back (``float(tensor)``) would make the host wait for the device once per
  value and micro-batch, so the CPU could never queue work ahead of the GPU. They stay there
  instead, stacked into one vector a micro-batch and added up on the device.
- Numbers the host has anyway (micro-batches, tokens from the loader's batch, a callback's flag,
  CPU tensors of a GPU run) stay on the host.
- ``reduce`` sums both over ranks in ONE collective and reads the result back in ONE transfer:
  the step's only wait for the device in the trainer. The skip-step gate needs the step's loss
  before the optimizer applies (or drops) the update, and the monitors score every step, so this
  wait is once per step; ``docs/training.md`` ("Host syncs") says what it costs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from train.dist import all_reduce_sum


class StepSums:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.keys: list[str] | None = None  # the device vector's keys, in order
        self.vector: torch.Tensor | None = None
        self.host: dict[str, float] = {}

    def add(self, values: Mapping[str, torch.Tensor | float]) -> None:
        """Add one micro-batch's values, key by key (the same keys every micro-batch)."""
        device: dict[str, torch.Tensor] = {
            k: v
            for k, v in values.items()
            if isinstance(v, torch.Tensor) and v.device.type == self.device.type
        }
        for key, value in values.items():
            if key not in device:
                self.host[key] = self.host.get(key, 0.0) + float(value)  # a host number
        if not device:
            return
        keys = sorted(device)
        if self.keys is not None and keys != self.keys:
            raise ValueError(
                f"a micro-batch's sums have other keys than the step's first: {keys} vs {self.keys}"
            )
        # One stack (a single kernel) per micro-batch; float64, so that counts stay exact.
        stacked = torch.stack([device[k].detach().reshape(()) for k in keys]).double()
        self.keys = keys
        self.vector = stacked if self.vector is None else self.vector + stacked

    def reduce(self) -> dict[str, float]:
        """Every sum over all ranks (one collective), read back to the host once."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            # One rank: nothing to sum over, so the host numbers never go to the device
            values = self.vector.tolist() if self.vector is not None else []
            return {**dict(zip(self.keys or [], values)), **self.host}
        host_keys = sorted(self.host)
        host = torch.tensor([self.host[k] for k in host_keys], dtype=torch.float64)
        parts = [host.to(self.device)]
        if self.vector is not None:
            parts.insert(0, self.vector)
        total = all_reduce_sum(torch.cat(parts))
        return dict(zip((self.keys or []) + host_keys, total.tolist()))
