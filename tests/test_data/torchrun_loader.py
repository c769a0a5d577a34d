"""Run by test_loader.py under ``torchrun --nproc_per_node 2``: each rank iterates its loader
(epoch mode, 2 workers) to the end, all-reducing a tensor after every batch as DDP would (an
uneven batch count would hang here), then writes what it saw to OUT/rank_R.json."""

import json
import os
import sys

import torch
import torch.distributed as dist

from data.loader import LoaderConfig, SourceConfig, build_loader


def main() -> None:
    out, tokens = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    srcs = [
        SourceConfig(name=s, shards=[os.path.join(tokens, s)], weight=1.0)
        for s in ("scenes", "digits", "text")
    ]
    cfg = LoaderConfig(sources=srcs, seq_len=256, num_workers=2, mode="epoch", shuffle_buffer=8)
    loader = build_loader(cfg, rank=rank, world_size=world, micro_batch=2)
    batches, pieces = 0, []
    for b in loader:
        dist.all_reduce(torch.ones(1))
        batches += 1
        pieces += [p for p in b["pieces"].reshape(-1, 4).tolist() if p[0] >= 0]
    with open(os.path.join(out, f"rank_{rank}.json"), "w") as f:
        json.dump({"batches": batches, "pieces": pieces, "delivered": loader.delivered()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
