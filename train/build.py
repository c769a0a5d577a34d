"""Assembling a run: seeds, task, model, DeepSpeed engine, batch stream, monitor, and the
callbacks, registered here once, in the order their hooks run (``train/callbacks/base.py``).

A test or a suite adds callbacks of its own with ``extra_callbacks`` (they run last, e.g. the
fault injection of ``train/callbacks/faults.py``); a normal run registers exactly the list below.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import yaml

from model.sequence_parallel import sequence_parallel_refusal
from train.callbacks.base import Callback, Callbacks
from train.callbacks.checkpointing import Checkpointing
from train.callbacks.data_health import DataHealth
from train.callbacks.evaluation import Evaluation
from train.callbacks.metrics_log import (
    JsonlSink,
    MetricSink,
    MetricsLog,
    TensorBoardSink,
    WandbSink,
)
from train.callbacks.monitoring import Monitoring, Rollback
from train.callbacks.preemption import Preemption
from train.callbacks.progress import ProgressBar
from train.callbacks.run_info import RunInfo
from train.callbacks.step_metrics import SkipStep, StepMetrics
from train.callbacks.throughput import Throughput
from train.checkpoint import Checkpointer
from train.config import RunConfig, TrainConfig
from train.config_check import ConfigError, override_items
from train.dist import DistInfo
from train.engine import build_engine, global_grad_norm
from train.monitor import AlarmLog, Monitor
from train.names import CONFIG_FILE, METRICS_FILE
from train.sequence_groups import join_sequence_groups
from train.skip_step import SkipStepRule, UpdateGate
from train.streams import BatchStream
from train.tasks import build_task
from train.trainer import Trainer

log = logging.getLogger(__name__)


def seed_everything(seed: int, rank: int, deterministic: bool) -> None:
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def total_steps(train: TrainConfig, stream: BatchStream) -> int:
    """``train.steps``, or with ``train.steps=-1`` the optimizer steps the data holds: one pass in
    epoch mode, counted by the loader at start (every rank yields the same number of batches), so
    the lr schedule has a length."""
    if train.steps > 0:
        return train.steps
    batches = stream.batches_left()
    if batches is None:
        raise ConfigError(
            "train.steps=-1 (until the data ends) needs data.mode=epoch: an infinite stream never "
            "ends; give train.steps a number"
        )
    steps = batches // train.grad_accum
    if steps < 1:
        raise ConfigError(
            f"train.steps=-1: the data holds {batches} batch(es) per rank, fewer than one step of "
            f"train.grad_accum={train.grad_accum}"
        )
    return steps


def compile_model(model: torch.nn.Module, *, asked: bool) -> bool:
    """``train.compile``: the LM's blocks and loss head (model/transformer.py). A model without a
    compiled form (the visual tokenizer) is left as it is, or refused when compiling was
    ``asked`` for explicitly. Whether the model is compiled now."""
    compile_blocks = getattr(model, "compile_blocks", None)
    if compile_blocks is None:
        if asked:
            raise ConfigError(
                f"train.compile=true: {type(model).__name__} has no compiled form; "
                "set train.compile to auto or false"
            )
        return False
    compile_blocks()
    return True


def build_trainer(
    cfg: RunConfig,
    resolved_yaml: str,
    dist: DistInfo,
    *,
    extra_callbacks: Sequence[Callback] = (),
    command: Sequence[str] = (),
) -> Trainer:
    heads, rows = cfg.model.attention.n_heads, cfg.data.seq_len
    net = "model" if cfg.task == "lm" else "vtok"
    dist = join_sequence_groups(
        dist,
        cfg.train.sequence_parallel,
        lambda n: not sequence_parallel_refusal(n_heads=heads, seq_len=rows, degree=n),
    )
    seed_everything(cfg.train.seed, dist.rank, cfg.train.deterministic)
    task = build_task(cfg, dist)
    model = task.build_model()
    if (
        cfg.train.init_from
    ):  # a release's weights (earlyfuse-convert import); a resuming run ignores it
        from train.init_from import init_from_release

        init_from_release(model, cfg, task, dist.is_main)
    compiled = cfg.train.compiles(dist.device.type, cfg.deepspeed.zero_stage)
    if compiled:
        compiled = compile_model(model, asked=cfg.train.compile == "true")
    run_dir = Path(cfg.run_dir)
    checkpointer = Checkpointer(run_dir, dist, cfg.train.keep_last)
    stream = task.batches()
    steps = total_steps(cfg.train, stream)
    flops_per_unit = task.flops_per_unit()  # here: it may build a model (global RNG) before resume
    engine, optimizer, scheduler = build_engine(model, cfg, dist.world_size, total_steps=steps)
    rule = SkipStepRule(cfg.optim.skip_step)
    gate = UpdateGate(rule, lambda: global_grad_norm(engine))
    optimizer.gate = gate
    monitor = Monitor(
        cfg.monitor,
        total_steps=steps,
        chance=task.chance_levels(),
        probes=task.probes(cfg.monitor, engine),
        warmup_steps=cfg.optim.warmup_steps,
        heldout_every=cfg.train.eval_every if cfg.data.validation else 0,
    )
    main, train_cfg = dist.is_main, cfg.train
    monitoring = Monitoring(monitor, AlarmLog(run_dir, is_main=main, write_line=log_alarm), rule)
    sinks: list[MetricSink] = []
    if main:
        sinks.append(JsonlSink(run_dir / METRICS_FILE))
        if train_cfg.tensorboard:
            sinks.append(TensorBoardSink(run_dir / "tb"))
        if train_cfg.wandb:
            config = yaml.safe_load(resolved_yaml)
            sinks.append(
                WandbSink(run_dir, project=train_cfg.wandb_project, name=cfg.name, config=config)
            )
    precision = "bf16" if train_cfg.bf16 else "fp32"
    describe = (
        f"run {cfg.name} ({cfg.task}) in {run_dir}: {dist.world_size} rank(s) on "
        f"{dist.device.type}, ZeRO {cfg.deepspeed.zero_stage}, {precision}"
        + (", compiled" if compiled else "")
    )
    if dist.sp_degree > 1:
        describe += f", sequence parallel {dist.sp_degree} x data parallel {dist.data_size}"
    if cfg.optim.warmup_steps >= steps and main:  # a preset cut short for a try, a fine-tune
        log.warning(
            f"optim.warmup_steps={cfg.optim.warmup_steps} is not below the run's {steps} steps: "
            "the lr rises for the whole run and never reaches its peak nor decays; lower "
            "optim.warmup_steps (a few percent of the steps is usual)"
        )
    if train_cfg.bf16 and dist.device.type == "cpu" and main:
        # A GPU preset on a laptop: it starts, then swaps for minutes before its first step
        log.warning(
            "train.bf16=true on a CPU: the GPU presets (experiment=gpu_*) are sized for GPUs; on "
            "a CPU their first step takes minutes and tens of GB. For a CPU run: experiment=demo"
        )
    callbacks = [
        RunInfo(
            run_dir=run_dir,
            resolved_yaml=resolved_yaml,
            describe=describe,
            is_main=main,
            command=command,
            world_size=dist.world_size,
        ),
        StepMetrics(task_metrics=task.metrics, lr=lambda: scheduler.get_last_lr()[0]),
        SkipStep(rule, gate),
        Throughput(
            flops_per_unit=flops_per_unit,
            world_size=dist.world_size,
            device=dist.device,
            configured_peak=train_cfg.peak_tflops,
            is_main=main,
        ),
        Evaluation(task.evaluate, every=train_cfg.eval_every, is_main=main),
        DataHealth(stream, log_every=train_cfg.log_every, device=dist.device, is_main=main),
        monitoring,
        MetricsLog(
            sinks,
            log_every=train_cfg.log_every,
            unit=task.unit,
            task_metrics=task.metrics,
            is_main=main,
        ),
        ProgressBar(enabled=train_cfg.progress and main),
        Checkpointing(
            every=train_cfg.ckpt_every,
            healthy=monitoring.healthy,
            unhealthy_why="the monitors see trouble (a step skipped as a spike in the last "
            f"{cfg.monitor.divergence.window}, or the loss rising)",
            is_main=main,
        ),
        Rollback(monitoring, cfg.monitor.rollback, grad_accum=train_cfg.grad_accum, is_main=main),
        Preemption(device=dist.device),
        *extra_callbacks,
    ]
    return Trainer(
        train=train_cfg,
        dist=dist,
        task=task,
        engine=engine,
        optimizer=optimizer,
        gate=gate,
        stream=stream,
        checkpointer=checkpointer,
        callbacks=Callbacks(callbacks),
        total_steps=steps,
        run_dir=run_dir,
        zero_stage=cfg.deepspeed.zero_stage,
        resolved_yaml=resolved_yaml,
        save_meta={
            "world_size": dist.world_size,
            "sequence_parallel": dist.sp_degree,
            "zero_stage": cfg.deepspeed.zero_stage,
            "task": cfg.task,
            "bf16": train_cfg.bf16,
            # The network as it trained: config.yaml beside it may be edited (paths after a
            # move), and a release must build what trained, not what the copy now says
            "network": {net: yaml.safe_load(resolved_yaml)[net]},
        },
        save_files={CONFIG_FILE: resolved_yaml, **task.extra_files()},
        given_keys=frozenset(key for key, _ in override_items(command)),
        protect=monitor.protected_steps,
    )


def log_alarm(line: str) -> None:
    import logging

    logging.getLogger("train.monitor").warning(line)
