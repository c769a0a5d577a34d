"""Run by test_sequence_parallel.py under ``torchrun --nproc_per_node 4`` (gloo, fp32): for each
case in CASES/ (a model config in NAME.json, a batch of whole rows in NAME.safetensors) and each
SP degree (2: groups {0,1} and {2,3}, i.e. 2 data-parallel replicas x SP 2; 4: one group), every
rank computes the single-process reference itself, then the same model sequence-parallel over its
group, and writes the largest differences to OUT/rank_R.json:

- ``logits``: the gathered SP logits against the reference's (no labels);
- ``loss``, ``ce``: the reduced SP loss and CE against the reference's; ``count``: per-modality
  label counts equal (0 or 1);
- ``grad``: the parameter gradients summed over the SP group against the reference's;
- ``flex_logits`` (cases with ``flex``): the same forward with FlexAttention's BlockMask, no grad;
- ``deepspeed/zero1``, ``deepspeed/zero2`` (case ``images``): one DeepSpeed step over DP 2 x SP 2
  against the single-process step (``deepspeed_case``).
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from model.attention import AttentionConfig
from model.sequence_parallel import apply_sequence_parallel, reduce_loss, shard_row
from model.transformer import TransformerConfig
from train.sequence_groups import SequenceGroups, new_sequence_groups

DEEPSPEED_CASE = "images"


def gather_tokens(local: torch.Tensor, group, degree: int) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(degree)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def straddling(batch: dict, degree: int) -> tuple[int, int]:
    """(documents, image blocks) whose tokens lie on both sides of a shard boundary."""
    seq_len = batch["input_ids"].shape[1]
    shard = seq_len // degree
    found = [0, 0]
    for which, key in enumerate(("doc_ids", "image_ids")):
        for row in batch[key]:
            for ident in set(row.tolist()) - {-1}:
                where = (row == ident).nonzero().squeeze(1)
                found[which] += int(where[0]) // shard != int(where[-1]) // shard
    return found[0], found[1]


def run_case(cfg: TransformerConfig, batch: dict, groups: SequenceGroups, flex: bool) -> dict:
    degree = groups.degree
    torch.manual_seed(0)
    model = cfg.build()
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    with torch.no_grad():
        ref_logits = model(**inputs)
    ref = model(**batch)
    ref.loss.backward()
    ref_grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    apply_sequence_parallel(model, groups.group)
    shard = shard_row(batch, cfg, rank=groups.rank, degree=degree)
    with torch.no_grad():
        logits = gather_tokens(
            model(**{key: value for key, value in shard.items() if key != "labels"}),
            groups.group,
            degree,
        )
    result = reduce_loss(model(**shard), groups.group)
    result.loss.backward()
    grad_diff = 0.0
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=groups.group)
        grad_diff = max(grad_diff, float((grad - ref_grads[name]).abs().max()))
    got = {
        "logits": float((logits - ref_logits).abs().max()),
        "loss": abs(float(result.loss) - float(ref.loss)),
        "ce": abs(float(result.ce) - float(ref.ce)),
        "count": int(torch.equal(result.count, ref.count)),
        "num_tokens": int(result.num_tokens) == int(ref.num_tokens),
        "grad": grad_diff,
        "grad_scale": max(float(grad.abs().max()) for grad in ref_grads.values()),
        "straddle": straddling(batch, degree),
    }
    if flex:
        flex_cfg = dataclasses.replace(
            cfg, attention=dataclasses.replace(cfg.attention, backend="flex")
        )
        with torch.no_grad():
            flex_shard = shard_row(inputs, flex_cfg, rank=groups.rank, degree=degree)
            assert flex_shard["mask"].block_mask is not None
            flex_logits = gather_tokens(model(**flex_shard), groups.group, degree)
        got["flex_logits"] = float((flex_logits - ref_logits).abs().max())
    apply_sequence_parallel(model, None)
    return got


def deepspeed_case(cfg: TransformerConfig, batch: dict, stage: int) -> dict:
    """ZeRO ``stage`` over DP 2 x SP 2, DeepSpeed told the SP groups through its own
    ``parallel_state_sp`` as ``mpu``: SP group g trains on row g. One SGD step (its update is
    proportional to the gradient, unlike Adam's first step) must equal the single-process step on
    the mean of the two rows' losses: gradients summed over SP, averaged over DP."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    degree = 2
    sp_group = parallel_state_sp.get_sequence_parallel_group()
    sp_rank, data_rank = dist.get_rank() % degree, dist.get_rank() // degree
    torch.manual_seed(0)
    ref, model = cfg.build(), cfg.build()
    model.load_state_dict(ref.state_dict())
    ref_losses = [
        ref(**{key: value[row : row + 1] for key, value in batch.items() if value.dim()})
        for row in (0, 1)
    ]
    (sum(result.loss for result in ref_losses) / 2).backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        config=config,
        mpu=parallel_state_sp,
    )
    apply_sequence_parallel(engine.module, sp_group)
    row = {key: value[data_rank : data_rank + 1] for key, value in batch.items() if value.dim()}
    result = reduce_loss(engine(**shard_row(row, cfg, rank=sp_rank, degree=degree)), sp_group)
    engine.backward(result.loss)
    engine.step()
    trained = dict(engine.module.named_parameters())
    return {
        "loss": abs(float(result.loss) - float(ref_losses[data_rank].loss)),
        "weights": max(
            float((trained[name].detach() - param.detach()).abs().max())
            for name, param in ref.named_parameters()
        ),
    }


def main() -> None:
    cases, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    groups = {degree: new_sequence_groups(degree) for degree in (2, 4)}
    results = {}
    for spec_path in sorted(cases.glob("*.json")):
        spec = json.loads(spec_path.read_text())
        cfg = TransformerConfig(**spec["config"])
        assert isinstance(cfg.attention, AttentionConfig)
        batch = load_file(spec_path.with_suffix(".safetensors"))
        for degree in spec["degrees"]:
            results[f"{spec_path.stem}/sp{degree}"] = run_case(
                cfg, batch, groups[degree], spec.get("flex", False)
            )
    if dist.get_world_size() == 4:
        import deepspeed
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        from train.ds_env import prepare_deepspeed

        prepare_deepspeed()  # no shm_comm op built (train/ds_env.py)
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        parallel_state_sp.initialize_sequence_parallel(2)
        spec_path = cases / f"{DEEPSPEED_CASE}.json"
        cfg = TransformerConfig(**json.loads(spec_path.read_text())["config"])
        batch = load_file(spec_path.with_suffix(".safetensors"))
        for stage in (1, 2):
            results[f"deepspeed/zero{stage}"] = deepspeed_case(cfg, batch, stage)
    (out / f"rank_{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
