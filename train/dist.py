"""Process-group set-up for one process, ``torchrun`` and the ``deepspeed`` launcher.

The ``deepspeed`` launcher appends ``--local_rank=N`` to the command line, which Hydra would
reject as an unknown override; ``strip_launcher_args`` moves it into ``LOCAL_RANK`` first.
CPU runs use the gloo backend (DeepSpeed's CPU accelerator), GPU runs NCCL.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    # Sequence parallelism (train/sequence_groups.py): ranks [0, P), [P, 2P), ... share rows.
    sp_degree: int = 1  # P: ranks per sequence-parallel group (1: off)
    sp_group: object | None = None  # this rank's sequence-parallel process group (P > 1)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sp_rank(self) -> int:
        """Which shard of a row this rank holds (0 without sequence parallelism)."""
        return self.rank % self.sp_degree

    @property
    def data_rank(self) -> int:
        """This rank's data-parallel replica: the rows it reads are the loader's for this rank."""
        return self.rank // self.sp_degree

    @property
    def data_size(self) -> int:
        """Data-parallel replicas (the world without sequence parallelism)."""
        return self.world_size // self.sp_degree


def strip_launcher_args(argv: list[str]) -> list[str]:
    out = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            os.environ["LOCAL_RANK"] = arg.split("=", 1)[1]
        elif arg in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ["LOCAL_RANK"] = argv[i + 1]
            skip = True
        else:
            out.append(arg)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> DistInfo:
    """Join (or create) the process group; a plain ``python`` run becomes a world of one."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())),
        )
    os.environ.setdefault("LOCAL_RANK", "0")
    rank, world, local = (
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        int(os.environ["LOCAL_RANK"]),
    )
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        import deepspeed

        from train.ds_env import prepare_deepspeed

        prepare_deepspeed()
        deepspeed.init_distributed(
            dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False, verbose=False
        )
    return DistInfo(rank, world, local, device)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a no-op in a world of one). Reduce sums and counts, never means."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Elementwise max over ranks (for extremes such as the largest attention logit)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    """At the end of a run that every rank finished: wait for all, then close the process groups,
    so that no rank tears its connections down while another still uses them (gloo aborts a
    process whose peer vanished mid-exchange)."""
    if dist.is_initialized():
        barrier()
        dist.destroy_process_group()


# gloo's words for a connection whose other end is gone; NCCL's for a peer that exited
PEER_GONE = re.compile(r"(closed|reset) by peer|remote process exited|Broken pipe")


def peer_gone(error: BaseException) -> re.Match | None:
    """Where a collective's error says that another rank is gone (None: it does not; a reader's
    connection to object storage reset is no lost rank)."""
    collective = isinstance(error, dist.DistError) or re.search(
        r"gloo|nccl", str(error), re.IGNORECASE
    )
    return PEER_GONE.search(str(error)) if collective else None


def broadcast_from_main(value):
    """Rank 0's ``value`` on every rank (a small picklable object); itself on one process."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
