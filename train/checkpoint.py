"""Checkpoints of a run: ``RUN_DIR/checkpoints/step_NNNNNNNN/`` plus a ``latest`` pointer.

Design choices:
- DeepSpeed writes model, optimizer and scheduler (any ZeRO stage; ``zero_to_fp32.py`` beside
  them consolidates). Beside them each rank writes ``rank_RRRRR.pt`` (its RNG states, its loader
  state, task state), loaded back with ``torch.load(weights_only=True)``; rank 0 writes
  ``meta.json`` (step, world size, ZeRO stage), the resolved config and the vocabulary layout.
- Crash safety: ``latest`` names the newest complete checkpoint and is replaced atomically
  only after a barrier that every rank reaches once its files are on disk. A crash mid-save
  leaves ``latest`` on the previous checkpoint; the half-written folder is removed on resume.
- keep-last-N: older checkpoints are deleted after ``latest`` has moved, except the steps in
  ``protect`` (the monitor's ``protected_steps``: the newest checkpoint from before an open
  alarm, so that a rollback still has somewhere to go).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from train.dist import DistInfo, barrier

TAG = re.compile(r"^step_(\d{8})$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "python_gauss": random.getstate()[2],
        "numpy": {
            "key": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "gauss": float(np_state[4]),
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    n = state["numpy"]
    np.random.set_state(
        ("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    def __init__(self, run_dir: str | Path, dist: DistInfo, keep_last: int) -> None:
        self.dir = Path(run_dir) / "checkpoints"
        self.dist = dist
        self.keep_last = max(1, keep_last)

    # --- reading -----------------------------------------------------------------------------
    def latest(self) -> str | None:
        p = self.dir / "latest"
        if not p.is_file():
            return None
        tag = p.read_text().strip()
        if not TAG.match(tag) or not (self.dir / tag / "meta.json").is_file():
            raise ValueError(
                f"{p} names {tag!r}, which is not a complete checkpoint; delete {p} to start over"
            )
        return tag

    def meta(self, tag: str) -> dict:
        return json.loads((self.dir / tag / "meta.json").read_text())

    def check_compatible(self, tag: str, zero_stage: int) -> dict:
        """The checkpoint's meta; refuses what cannot resume here. Another world size resumes from a
        ZeRO-0 checkpoint as it is, and from a ZeRO 1-3 one through its universal/ conversion."""
        meta = self.meta(tag)
        if meta["zero_stage"] != zero_stage:
            raise ValueError(
                f"{self.dir / tag} was written with ZeRO stage {meta['zero_stage']}; this run uses "
                f"{zero_stage}. Resume with deepspeed.zero_stage={meta['zero_stage']}."
            )
        if (
            meta["world_size"] != self.dist.world_size
            and zero_stage > 0
            and not self.universal(tag)
        ):
            raise ValueError(
                f"{self.dir / tag} was written by {meta['world_size']} rank(s); this run has "
                f"{self.dist.world_size}. Its ZeRO-{zero_stage} shards fit only that world size: make a universal "
                f"checkpoint with `earlyfuse-convert universal {self.dir.parent}` and rerun this command, or run "
                f"with {meta['world_size']} rank(s)."
            )
        return meta

    def universal(self, tag: str) -> bool:
        return (self.dir / tag / "universal" / "mp_rank_00_model_states.pt").is_file()

    def load_resharded(self, engine, tag: str, zero_stage: int) -> tuple[dict, dict | None]:
        """Load a checkpoint written by another world size: (client state, this rank's own state if
        the old world had this rank, else None)."""
        load_dir, t = (self.dir / tag, "universal") if zero_stage > 0 else (self.dir, tag)
        path, client = engine.load_checkpoint(
            str(load_dir), tag=t, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise ValueError(f"{load_dir / t}: DeepSpeed could not load this checkpoint")
        rank_file = self.dir / tag / f"rank_{self.dist.rank:05d}.pt"
        own = torch.load(rank_file, weights_only=True) if rank_file.is_file() else None
        return client or {}, own

    def load_streams(self, tag: str) -> list[dict]:
        """The data stream state of every rank that wrote ``tag``, in rank order: a loader moved onto
        another world size needs all of them (data.loader.redistribute), not only its own rank's."""
        out = []
        for r in range(self.meta(tag)["world_size"]):
            f = self.dir / tag / f"rank_{r:05d}.pt"
            try:
                out.append(torch.load(f, weights_only=True)["stream"])
            except (OSError, RuntimeError, EOFError, KeyError) as e:
                raise ValueError(
                    f"{f}: unreadable rank state ({e!r}); every old rank's is needed to move "
                    "the loader's position onto this world size"
                ) from None
        return out

    def load(self, engine, tag: str) -> tuple[dict, dict]:
        """(client state saved by rank 0, this rank's own state)."""
        path, client = engine.load_checkpoint(
            str(self.dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise ValueError(f"{self.dir / tag}: DeepSpeed could not load this checkpoint")
        rank_file = self.dir / tag / f"rank_{self.dist.rank:05d}.pt"
        try:
            own = torch.load(rank_file, weights_only=True)
        except (OSError, RuntimeError, EOFError) as e:
            raise ValueError(f"{rank_file}: unreadable rank state ({e})") from None
        return client or {}, own

    def complete_steps(self) -> list[int]:
        """Steps of the complete checkpoints up to ``latest``, oldest first."""
        latest = self.latest()
        if latest is None:
            return []
        last = int(TAG.match(latest).group(1))
        steps = [
            int(TAG.match(d.name).group(1)) for d in self._tags() if (d / "meta.json").is_file()
        ]
        return [s for s in steps if s <= last]

    def rewind(self, step: int) -> None:
        """Make ``step`` the latest checkpoint and delete the newer ones (a rollback: they hold the
        trajectory being abandoned)."""
        barrier()
        if self.dist.is_main:
            tmp = self.dir / "latest.tmp"
            tmp.write_text(tag_for(step) + "\n")
            os.replace(tmp, self.dir / "latest")
            for d in self._tags():
                if int(TAG.match(d.name).group(1)) > step:
                    shutil.rmtree(d, ignore_errors=True)
        barrier()

    def clean_partial(self) -> None:
        """Remove checkpoint folders newer than ``latest`` (a save that a crash cut short)."""
        if not self.dist.is_main or not self.dir.is_dir():
            return
        latest = self.latest()
        last = int(TAG.match(latest).group(1)) if latest else -1
        for d in self._tags():
            if int(TAG.match(d.name).group(1)) > last:
                shutil.rmtree(d, ignore_errors=True)

    def _tags(self) -> list[Path]:
        return (
            sorted(d for d in self.dir.iterdir() if d.is_dir() and TAG.match(d.name))
            if self.dir.is_dir()
            else []
        )

    # --- writing -----------------------------------------------------------------------------
    def save(
        self,
        engine,
        step: int,
        *,
        client: dict,
        own: dict,
        meta: dict,
        files: dict[str, str],
        protect: set[int] | frozenset[int] = frozenset(),
    ) -> str:
        tag = tag_for(step)
        engine.save_checkpoint(str(self.dir), tag=tag, client_state=client, save_latest=False)
        folder = self.dir / tag
        torch.save(own, folder / f"rank_{self.dist.rank:05d}.pt")
        if self.dist.is_main:
            for name, text in files.items():
                (folder / name).write_text(text)
            (folder / "meta.json").write_text(
                json.dumps({**meta, "step": step, "tag": tag}, indent=1) + "\n"
            )
        if int(os.environ.get("EARLYFUSE_FAULT_KILL_IN_SAVE", "-1")) == step:
            os._exit(137)  # fault injection for the tests: a crash after the files, before `latest`
        barrier()  # every rank's files are written before `latest` may move
        if self.dist.is_main:
            tmp = self.dir / "latest.tmp"
            tmp.write_text(tag + "\n")
            os.replace(tmp, self.dir / "latest")
            for old in self._tags()[: -self.keep_last]:
                if int(old.name[len("step_") :]) not in protect:
                    shutil.rmtree(old, ignore_errors=True)
        barrier()
        return tag
