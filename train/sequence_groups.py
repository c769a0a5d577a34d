"""The sequence-parallel (SP) process groups beside data parallelism.

A world of W ranks with SP degree P forms W / P groups of P consecutive ranks: ranks
[0, P), [P, 2P), ... Launchers number the ranks of one node consecutively, so an SP group sits
inside a node whenever P divides the GPUs per node: its two all-to-alls per attention layer stay
on the fast links, and only data parallelism crosses nodes. The ranks of one SP group work on
the same rows (each on its own shard of T/P tokens, model/sequence_parallel.py); the W / P
groups are the data-parallel replicas. A rank's data-parallel rank is its group's index.

A run (``train.sequence_parallel=P``) joins the groups once, in ``train/build.py``
(``join_sequence_groups``): they are DeepSpeed's ``parallel_state_sp`` groups, handed to the
engine as its ``mpu`` (``SequenceParallelMpu``) and to the attention layers, and the rank's place
in them travels in ``DistInfo`` (``sp_rank``, ``data_rank``, ``data_size``).
``new_sequence_groups`` makes a set of groups of its own, for code outside a run (the tests).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from train.config_check import ConfigError
from train.dist import DistInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SequenceGroups:
    degree: int  # P: ranks per SP group
    group: object | None  # this rank's SP process group (None when P = 1)
    rank: int  # this rank's place in its SP group: which shard of the row it holds
    data_rank: int  # which SP group this rank is in (its data-parallel rank)
    data_size: int  # how many SP groups (data-parallel replicas) there are


def sequence_parallel_ranks(world_size: int, degree: int) -> list[list[int]]:
    """The global ranks of every SP group, in order."""
    if degree < 1:
        raise ValueError(f"train.sequence_parallel={degree} must be 1 or more")
    if world_size % degree:
        raise ValueError(
            f"train.sequence_parallel={degree} does not divide the number of processes "
            f"({world_size})"
        )
    return [list(range(start, start + degree)) for start in range(0, world_size, degree)]


def new_sequence_groups(degree: int) -> SequenceGroups:
    """Create the SP groups of the current world (every rank must call this, with the same
    ``degree``: ``new_group`` is collective) and return this rank's."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    members_of_groups = sequence_parallel_ranks(world_size, degree)
    group = None
    if degree > 1:
        for members in members_of_groups:
            made = dist.new_group(members)  # every rank creates every group, in the same order
            if rank in members:
                group = made
    return SequenceGroups(
        degree=degree,
        group=group,
        rank=rank % degree,
        data_rank=rank // degree,
        data_size=world_size // degree,
    )


def check_run(
    degree: int, world_size: int, fits_model: Callable[[int], bool] = lambda n: True
) -> None:
    """At the start of a run: ``train.sequence_parallel`` must divide the number of processes.
    ``fits_model(n)``: whether the model and row split over n ranks (the degrees suggested)."""
    try:
        sequence_parallel_ranks(world_size, degree)
    except ValueError as err:
        # One process: the run was most likely started without a launcher
        fits = [n for n in range(1, world_size + 1) if world_size % n == 0 and fits_model(n)]
        launch = (
            f"; start it with earlyfuse-torchrun --nproc_per_node N, N a multiple of {degree}"
            if world_size == 1
            else f"; run a multiple of {degree} processes, or train.sequence_parallel one of {fits}"
        )
        raise ConfigError.alike(str(err) + launch) from None


class SequenceParallelMpu:
    """What DeepSpeed asks of an ``mpu`` for sequence parallelism, over the groups of DeepSpeed's
    own ``parallel_state_sp`` (P consecutive ranks; one sequence-data-parallel group of all
    ranks). DeepSpeed recognises the SP layout by ``initialize_sequence_parallel``: ZeRO then
    partitions over all DP x SP ranks and gradients are summed over an SP group and averaged
    over the data-parallel replicas, the convention of ``reduce_loss``.

    Unlike ``parallel_state_sp``, it reports no model parallelism (a group of this rank alone):
    SP ranks hold replicas of the weights, not slices. ``parallel_state_sp`` aliases model
    parallelism to SP, which makes DeepSpeed 0.19 record a tensor-parallel degree of P in every
    checkpoint (``ds_to_universal`` then refuses it: one model-state file, not P), would make
    its norm helpers that take an ``mpu`` (the bf16 optimizer of ZeRO 0) count only the first SP
    rank's gradients, and lacks the tensor-parallel size that loading a universal checkpoint
    asks for."""

    def __init__(self, degree: int) -> None:
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        self.state = parallel_state_sp
        if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is None:  # made once per process
            parallel_state_sp.initialize_sequence_parallel(degree)
        elif parallel_state_sp.get_sequence_parallel_world_size() != degree:
            raise ConfigError(
                f"train.sequence_parallel={degree}: this process already made SP groups of "
                f"{parallel_state_sp.get_sequence_parallel_world_size()} ranks"
            )
        self.alone = None  # a group of this rank alone, made when DeepSpeed first asks for it

    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        raise RuntimeError("the SP groups are made once, by SequenceParallelMpu")

    def get_sequence_parallel_group(self):
        return self.state.get_sequence_parallel_group()

    def get_sequence_parallel_world_size(self) -> int:
        return self.state.get_sequence_parallel_world_size()

    def get_sequence_parallel_rank(self) -> int:
        return self.state.get_sequence_parallel_rank()

    def get_sequence_data_parallel_group(self):
        return self.state.get_sequence_data_parallel_group()

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.state.get_sequence_data_parallel_world_size()

    def get_sequence_data_parallel_rank(self) -> int:
        return self.state.get_sequence_data_parallel_rank()

    def get_model_parallel_group(self):
        if self.alone is None:  # only this rank takes part (local synchronisation)
            self.alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        return self.alone

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    # Asked for by name when a universal checkpoint is loaded (``parallel_state_sp`` has none).
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank


_MPU: SequenceParallelMpu | None = None


def deepspeed_mpu(degree: int) -> SequenceParallelMpu | None:
    """The ``mpu`` that tells DeepSpeed the SP layout (``deepspeed.initialize(mpu=...)``), or
    None without sequence parallelism. Made on first use (every rank, collectively), then
    shared: the attention layers and DeepSpeed use one set of groups."""
    global _MPU
    if degree == 1:
        return None
    if _MPU is None:
        _MPU = SequenceParallelMpu(degree)
    elif _MPU.get_sequence_parallel_world_size() != degree:
        raise ConfigError(
            f"train.sequence_parallel={degree}: this process already made SP groups of "
            f"{_MPU.get_sequence_parallel_world_size()} ranks"
        )
    return _MPU


def join_sequence_groups(
    info: DistInfo, degree: int, fits_model: Callable[[int], bool] = lambda n: True
) -> DistInfo:
    """``info`` with this rank's SP group (collective: every rank calls it, before the engine is
    built). ``fits_model``: as ``check_run``'s."""
    check_run(degree, info.world_size, fits_model)
    mpu = deepspeed_mpu(degree)
    if mpu is None:
        return info
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    if info.is_main and per_node % degree:
        # Groups are consecutive ranks: with a node's ranks not a multiple of the degree, some
        # group spans two nodes, a mis-sized --nproc_per_node more often than a choice
        log.warning(
            f"note: train.sequence_parallel={degree} with {per_node} process(es) a node: some "
            "SP groups span nodes, and their all-to-alls (two a layer, forward and backward) "
            "cross the network; a degree that divides the processes of a node keeps them on it"
        )
    return dataclasses.replace(info, sp_degree=degree, sp_group=mpu.get_sequence_parallel_group())
