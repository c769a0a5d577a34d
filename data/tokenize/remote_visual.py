"""Tokenize on Ray with GPUs: the visual tokenizer in a pool of GPU actors, fed by CPU actors.

The CPU actors read shards, decode and resize images and video frames, run the BPE and write
token shards, exactly as the local engine does; only the visual tokenizer's forward pass goes
to a GPU actor, through ``RemoteVisualTokenizer``, which stands in for the model inside
``DocEncoder`` (same ``encode`` / ``encode_video`` / ``cfg``). Batches go round-robin over
the pool. Outputs match the local engine run on the same kind of device (codes computed on a
GPU can differ from a CPU's in rare ties of FSQ rounding, on any engine).

Tested on a Ray node that declares a logical GPU on a machine without one (the actor then runs
on the CPU, and says so): the whole path but CUDA itself, byte-identical to the local engine,
also when the GPU actor is killed mid-run (the Ray engine replaces it and sends the jobs that
were calling it again). Never run on a real GPU yet (docs/scaling.md).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np


class VisualActor:
    """A GPU actor: the visual tokenizer on its GPU, loaded once. On a node that declares GPUs
    Ray can schedule but CUDA cannot see (the tests' logical GPU), it runs on the CPU."""

    def __init__(self, vtok_dir: str, tok_dir: str) -> None:
        import torch

        from data.text_tokenizer import TextTokenizer
        from data.tokenize.visual import load_visual_tokenizer

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            # Ray gave this actor a GPU that CUDA cannot see (a logical GPU, or a broken driver):
            # it still works, on the CPU, and says so (here in the worker's log, and through
            # ``describe`` in the driver's output).
            print(f"VisualActor: {self.where()}", file=sys.stderr, flush=True)
        layout = TextTokenizer.load(tok_dir).layout
        self.model = load_visual_tokenizer(vtok_dir, layout, self.device)

    def where(self) -> str:
        if self.device == "cpu":
            return (
                f"no CUDA device visible on {socket.gethostname()} (pid {os.getpid()}); "
                "the visual tokenizer runs on the CPU"
            )
        return f"the visual tokenizer on {self.device} on {socket.gethostname()}"

    def describe(self) -> str:
        """Where it computes (the Ray engine's pool also pings actors with it)."""
        return self.where()

    def encode(self, images: np.ndarray) -> np.ndarray:
        import torch

        with torch.no_grad():
            return self.model.encode(torch.from_numpy(images).to(self.device)).cpu().numpy()

    def encode_video(self, frames: np.ndarray) -> np.ndarray:
        import torch

        with torch.no_grad():
            frames_tensor = torch.from_numpy(frames).to(self.device)
            return self.model.encode_video(frames_tensor).cpu().numpy()


class RemoteVisualTokenizer:
    """What ``DocEncoder`` needs of the visual tokenizer, computed by GPU actors."""

    def __init__(self, actors: list, vtok_dir: str) -> None:
        from model.visual_tokenizer import VisualTokenizerConfig

        self.actors = actors
        self.cfg = VisualTokenizerConfig(**json.loads((Path(vtok_dir) / "config.json").read_text()))
        self._next = 0

    def _call(self, method: str, x):
        import ray
        import torch

        actor = self.actors[self._next % len(self.actors)]
        self._next += 1
        out = ray.get(getattr(actor, method).remote(x.detach().cpu().numpy()))
        return torch.from_numpy(out)

    def encode(self, images):
        return self._call("encode", images)

    def encode_video(self, frames):
        return self._call("encode_video", frames)


def gpu_setup_for(vtok_dir: str, tok_dir: str) -> Callable:
    """For ``data.engine.run_jobs``: a pool of one GPU actor per GPU of the cluster, every
    tokenize job pointed at its actors (data/engine/ray.py replaces one that dies)."""
    from data.engine.ray import GpuPool

    def setup(ray, n_gpus: int) -> GpuPool:
        # No CPU reserved: the CPU actors hold every CPU of the cluster, and a GPU actor that
        # waited for one would never start (the CPU actors would wait on it forever).
        actor_cls = ray.remote(num_gpus=1, num_cpus=0)(VisualActor)
        return GpuPool(
            ray,
            start=lambda: actor_cls.remote(vtok_dir, tok_dir),
            point=lambda job, actors: replace(job, vtok_actors=actors, device="cpu"),
            size=n_gpus,
        )

    return setup
