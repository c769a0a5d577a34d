"""The DeepSpeed engine of a run, built from the typed config.

Design choices:
- We hand DeepSpeed our own optimizer (``SkipStepAdamW``) and lr scheduler, so the decay
  groups, the skip-step rule and the schedules are ours and identical across ZeRO stages;
  DeepSpeed owns partitioning, bf16 master weights, gradient accumulation and clipping.
- No weight decay on norms, biases and embeddings (1-D tensors and ``nn.Embedding`` weights).
- bf16 keeps fp32 master weights and accumulates gradients in fp32.
- AdamW is torch's fused kernel on a GPU (one launch for the update).
- Sequence parallelism (``train.sequence_parallel`` > 1) hands DeepSpeed the SP layout as its
  ``mpu`` (``train/sequence_groups.py``): ZeRO partitions over all ranks, gradients are averaged
  over the data-parallel replicas only, and a step is ``micro_batch x grad_accum x data_size``
  rows. Under ZeRO 3 it also turns DeepSpeed's reduce-scatter off (``ds_config``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from train.config import RunConfig
from train.config_check import ConfigError
from train.schedule import CappedLambdaLR, lr_multiplier
from train.sequence_groups import deepspeed_mpu
from train.skip_step import SkipStepAdamW


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    no_decay_ids = {
        id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)
    }
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or id(param) in no_decay_ids else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def ds_config(cfg: RunConfig, world_size: int, largest_param: int = 0, params: int = 0) -> dict:
    """DeepSpeed's config for this run. ``largest_param``: the model's largest parameter
    (elements), which ZeRO 3 with sequence parallelism checks against the reduce bucket;
    ``params``: the model's parameter count, which bounds the buckets."""
    train_cfg, ds_cfg = cfg.train, cfg.deepspeed
    # Rows per optimizer step: the ranks of a sequence-parallel group share theirs.
    data_size = world_size // train_cfg.sequence_parallel
    conf: dict = {
        "train_micro_batch_size_per_gpu": train_cfg.micro_batch,
        "gradient_accumulation_steps": train_cfg.grad_accum,
        "train_batch_size": train_cfg.micro_batch * train_cfg.grad_accum * data_size,
        "gradient_clipping": cfg.optim.clip_grad,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": ds_cfg.zero_stage},
        "zero_allow_untested_optimizer": True,
    }
    if ds_cfg.zero_stage == 0 and not train_cfg.bf16:
        # DeepSpeed would clip before our optimizer sees the gradients; SkipStepAdamW clips
        # after the skip-step gate has read the unclipped norm instead.
        conf["gradient_clipping"] = 0.0
    if train_cfg.bf16:
        conf["bf16"] = {"enabled": True}
        conf["data_types"] = {"grad_accum_dtype": "fp32"}
    if ds_cfg.zero_stage >= 1 and params:
        # DeepSpeed's buckets default to 5e8 elements, and ZeRO 1-2 allocate one afresh every
        # micro-step: 2 GB a step whatever the model, most of a small model's step on a CPU.
        # No bucket needs to hold more than the whole model; ZeRO 1-2 want a multiple of their
        # alignment (2 elements), 8 keeps it for any dtype.
        bucket = min(-(-params // 8) * 8, 500_000_000)
        conf["zero_optimization"] |= {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if ds_cfg.offload_optimizer and ds_cfg.zero_stage >= 1:
        conf["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    sp_zero3 = ds_cfg.zero_stage == 3 and train_cfg.sequence_parallel > 1
    if sp_zero3:
        # ZeRO 3's reduce-scatter path (DeepSpeed 0.19, its default) averages gradients over all
        # ranks and ignores the SP layout: gradients and their norm would be 1/P of the whole
        # row's. Its all-reduce path sums over an SP group and averages over the replicas.
        conf["zero_optimization"]["reduce_scatter"] = False
    for key, value in ds_cfg.config.items():
        conf[key] = (
            {**conf[key], **value}
            if isinstance(value, dict) and isinstance(conf.get(key), dict)
            else value
        )
    if sp_zero3:
        _check_sp_zero3(conf["zero_optimization"], train_cfg.sequence_parallel, largest_param)
    return conf


def _check_sp_zero3(zero: dict, degree: int, largest_param: int) -> None:
    """Refuses a ZeRO-3 config under which DeepSpeed 0.19 takes its reduce-scatter path for some
    gradients (it ignores the SP groups: those gradients would be 1/P of the row's). Its
    all-reduce path needs all three: reduce_scatter off, contiguous_gradients on, and every
    parameter within reduce_bucket_size."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    default = DeepSpeedZeroConfig()
    why = ""
    if zero.get("reduce_scatter", default.reduce_scatter):
        why = "zero_optimization.reduce_scatter=true; leave reduce_scatter out"
    elif not zero.get("contiguous_gradients", default.contiguous_gradients):
        why = "zero_optimization.contiguous_gradients=false; leave it on"
    elif largest_param > (
        bucket := int(zero.get("reduce_bucket_size", default.reduce_bucket_size))
    ):
        why = (
            f"zero_optimization.reduce_bucket_size={bucket:,} is below the largest parameter "
            f"({largest_param:,} elements); raise it to at least that"
        )
    if why:  # a config the user changes: one line and exit code 2, as at composition
        raise ConfigError.alike(
            f"deepspeed.config {why} (ZeRO 3 with train.sequence_parallel={degree}: DeepSpeed "
            "would then reduce-scatter gradients over all ranks, ignoring the SP groups, and "
            "they would be 1/P of the row's)"
        )


def build_engine(model: nn.Module, cfg: RunConfig, world_size: int, *, total_steps: int = 0):
    """(engine, optimizer, scheduler); ``optimizer`` is our SkipStepAdamW (set its ``gate``).
    ``total_steps``: the schedule's length when it is not ``train.steps`` (``train.steps=-1``)."""
    import deepspeed

    from train.ds_env import prepare_deepspeed

    prepare_deepspeed()
    optim_cfg = cfg.optim
    opt = SkipStepAdamW(
        param_groups(model, optim_cfg.weight_decay),
        lr=optim_cfg.lr,
        betas=tuple(optim_cfg.betas),
        eps=optim_cfg.eps,
        weight_decay=optim_cfg.weight_decay,
        # One fused kernel for the whole update on a GPU (the default for-each path launches
        # several per parameter group); an offloaded optimizer steps on the CPU
        fused=torch.cuda.is_available() and not cfg.deepspeed.offload_optimizer,
    )
    mult = partial(
        lr_multiplier,
        total=total_steps or cfg.train.steps,
        warmup=optim_cfg.warmup_steps,
        schedule=optim_cfg.schedule,
        min_lr_ratio=optim_cfg.min_lr_ratio,
        decay_fraction=optim_cfg.decay_fraction,
        changes=tuple(optim_cfg.lr_changes),
    )
    sched = CappedLambdaLR(opt, mult)
    if cfg.deepspeed.zero_stage == 0 and not cfg.train.bf16:
        opt.clip_grad = optim_cfg.clip_grad
    sizes = [param.numel() for param in model.parameters()]
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=opt,
        lr_scheduler=sched,
        config=ds_config(cfg, world_size, max(sizes), sum(sizes)),
        mpu=deepspeed_mpu(
            cfg.train.sequence_parallel
        ),  # ZeRO over DP x SP, train/sequence_groups.py
    )
    return engine, opt, sched


@contextmanager
def config_hyperparameters(engine) -> Iterator[dict[str, float]]:
    """Around a checkpoint load: the optimizer's hyperparameters (lr, betas, eps, weight decay)
    and the schedule's peak lr are the run's config's, not the checkpoint's: DeepSpeed restores
    the param groups and the scheduler's ``base_lrs`` as saved, which would train a resume that
    changed ``optim.lr`` or ``optim.weight_decay`` on under the old values while its config.yaml
    says the new ones. The checkpoint keeps what is state: moments, step counts, the schedule's
    position and its lr cap. Yields a dict that holds, after the load, the next step's lr as
    the checkpoint had it (``saved``)."""
    sched = engine.lr_scheduler
    optimizer = sched.optimizer  # our AdamW, whose groups every DeepSpeed wrapper steps
    lrs: dict[str, float] = {}
    config = [
        {key: value for key, value in g.items() if key != "params"} for g in optimizer.param_groups
    ]
    peak = list(sched.base_lrs)
    yield lrs
    lrs["saved"] = sched.get_last_lr()[0]
    for group, values in zip(optimizer.param_groups, config):  # the load made new group dicts
        group.update(values)
    sched.base_lrs = peak
    sched.set_current_lr()


def global_grad_norm(engine) -> float:
    """The gradient norm the engine computed for the step in progress (before clipping).

    Under ZeRO and bf16 DeepSpeed's optimizer wrapper has it already when it calls our optimizer;
    a plain fp32 stage-0 engine has full gradients on every rank, so we compute it here.

    The wrapper's ``_global_grad_norm`` is private, but DeepSpeed's public accessor cannot serve:
    ``engine.get_global_grad_norm()`` is refreshed only after ``optimizer.step()`` returns
    (``DeepSpeedEngine._take_model_step``, DeepSpeed 0.19), so inside the step, where the gate
    must decide, it still holds the previous step's norm."""
    wrapped = engine.optimizer
    norm = getattr(wrapped, "_global_grad_norm", None)
    if norm is not None and not isinstance(wrapped, SkipStepAdamW):
        return float(norm)
    grads = [param.grad.detach() for param in engine.module.parameters() if param.grad is not None]
    if not grads:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(grad) for grad in grads])
    # One read-back for the whole model (not one per parameter: each waits for the device)
    return float(torch.linalg.vector_norm(norms))
