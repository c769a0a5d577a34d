"""Typed schemas of a training run. Hydra composes YAML presets onto these (``configs/``), so an
unknown or mistyped key is an error naming it; the entry point turns the result into these
dataclasses once and passes them down (nothing below ``train/app.py`` sees Hydra).

Sections: ``model`` (the transformer, ``model/``), ``vtok`` (the visual tokenizer network,
``vtok/``), ``data`` (the token stream for the LM), ``vtok_data`` (image crops for the visual
tokenizer), ``optim``, ``train``, ``deepspeed``, ``monitor``. A run uses the sections of its
``task`` (``lm`` or ``vtok``) and ignores the others.
"""

from __future__ import annotations

import glob
from contextvars import ContextVar
from dataclasses import dataclass, field

from data.loader.config import LoaderConfig
from model.sequence_parallel import sequence_parallel_refusal
from model.transformer import TransformerConfig
from model.visual_tokenizer import VisualTokenizerConfig
from train.monitor.config import MonitorConfig
from train.schedule import SCHEDULES, LrChange
from train.skip_step import SkipStepConfig

TASKS = ("lm", "vtok")
COMPILE_CHOICES = ("auto", "true", "false")


# Off while a saved run's config is read back (``read_saved``): the checks are a new run's
VALUE_CHECKS: ContextVar[bool] = ContextVar("value_checks", default=True)


def refuse_first(*checks: tuple[bool, str]) -> None:
    """A ValueError with the message of the first check that fails (one line: the key, the value
    and what to give; earlyfuse-train prints it and exits 2)."""
    for ok, message in checks:
        if not ok and VALUE_CHECKS.get():
            raise ValueError(message)


def read_saved(node) -> RunConfig:
    """A run's saved config.yaml, merged onto the schema, as a ``RunConfig`` without the value
    checks of ``refuse_first``: the run trained with these values under the schema of its day
    (train.keep_last 0 was kept as 1, deepspeed.offload_optimizer at stage 0 was ignored), and
    its checkpoints must still release and evaluate (earlyfuse-convert, earlyfuse-eval)."""
    from omegaconf import OmegaConf

    token = VALUE_CHECKS.set(False)
    try:
        return OmegaConf.to_object(node)  # type: ignore[return-value]
    finally:
        VALUE_CHECKS.reset(token)


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # final lr = lr x this
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1  # not on norms, biases or embeddings
    schedule: str = "cosine"  # cosine | wsd | constant
    warmup_steps: int = 100
    decay_fraction: float = 0.2  # wsd: share of the steps spent decaying
    # lr x scale over step ranges, on top of the schedule (train/schedule.py LrChange):
    # e.g. [{step: 5000, scale: 0.5}] halves the lr from step 5000 on
    lr_changes: list[LrChange] = field(default_factory=list)
    clip_grad: float = 1.0  # 0 = no clipping
    skip_step: SkipStepConfig = field(default_factory=SkipStepConfig)

    def __post_init__(self) -> None:
        # Named here, as given: else the optimizer or the schedule refuses them with a traceback,
        # or the run trains through them (a negative warmup, a final lr above the peak).
        refuse_first(
            (self.lr >= 0, f"optim.lr {self.lr}: give a learning rate >= 0"),
            (
                0 <= self.min_lr_ratio <= 1,
                f"optim.min_lr_ratio {self.min_lr_ratio}: give the final lr as a fraction of "
                "optim.lr, from 0 to 1",
            ),
            (
                len(self.betas) == 2 and all(0 <= beta < 1 for beta in self.betas),
                f"optim.betas {list(self.betas)}: give two numbers from 0 to below 1, e.g. "
                "[0.9, 0.95]",
            ),
            (self.eps > 0, f"optim.eps {self.eps}: give a small positive number, e.g. 1e-8"),
            (self.weight_decay >= 0, f"optim.weight_decay {self.weight_decay}: give 0 or more"),
            (
                self.schedule in SCHEDULES,
                f"optim.schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}",
            ),
            (self.warmup_steps >= 0, f"optim.warmup_steps {self.warmup_steps}: give 0 or more"),
            (
                0 <= self.decay_fraction <= 1,
                f"optim.decay_fraction {self.decay_fraction}: give a fraction of the steps, 0 to 1",
            ),
            (
                self.clip_grad >= 0,
                f"optim.clip_grad {self.clip_grad}: give 0 (no clipping) or more",
            ),
        )


@dataclass(kw_only=True)
class TrainConfig:
    # Optimizer steps; -1: until the data ends (data.mode=epoch only: the loader counts the steps
    # of one pass at start, and the lr schedule is laid over them). In epoch mode a run whose
    # steps exceed the data also ends cleanly where the data ends.
    steps: int = 100
    micro_batch: int = 4  # samples per rank per micro-step
    grad_accum: int = 1  # micro-steps per optimizer step
    log_every: int = 10
    eval_every: int = 0  # 0: only at the end
    # Validation batches (micro_batch rows) per rank; 0: the whole held-out set, each token once
    # (data/loader/heldout.py; val/complete says whether a cap left some out)
    eval_batches: int = 8
    ckpt_every: int = 0  # 0: only at the end
    keep_last: int = 2  # checkpoints kept (older ones deleted)
    # Continue from run_dir's latest checkpoint; false: start at step 0, in a folder with no checkpoint
    resume: bool = True
    # On resume, changes to the data, its mix, seq_len, batch sizes, the schedule, the seeds or the
    # world size are refused (an exact resume would no longer hold) unless this says they are meant.
    allow_config_change: bool = False
    init_from: str = ""  # a release folder (earlyfuse-convert release) whose weights start a run
    # that has no checkpoint yet; checked against layout, tokenizer, shapes
    seed: int = 0  # the model's initialisation and the probes' draws; data.seed orders the data
    deterministic: bool = False  # bit-identical reruns/resumes on CPU (slower kernels)
    bf16: bool = False  # bf16 weights/activations, fp32 master weights and grad accumulation
    peak_tflops: float = (
        0.0  # for MFU; 0 = known GPU's dense bf16 peak, or a measured CPU matmul rate
    )
    progress: bool = True  # a progress bar on rank 0
    tensorboard: bool = True
    # Ranks that share one row, each holding a contiguous 1/N of its tokens (Ulysses sequence
    # parallelism, model/sequence_parallel.py); 1: off. N must divide model.attention.n_heads,
    # data.seq_len and the number of processes (docs/long_context.md).
    sequence_parallel: int = 1
    # Weights & Biases beside TensorBoard, same metric names (pip install 'earlyfuse[wandb]';
    # WANDB_MODE=offline logs to RUN_DIR/wandb without an account)
    wandb: bool = False
    wandb_project: str = "earlyfuse"
    # torch.compile each transformer block and the loss head (fullgraph; model.compile_blocks):
    # auto: on CUDA below ZeRO-3 (whose parameter hooks compiled code does not see), off on CPU,
    # where compiling a small model costs more than it saves; true | false: as said.
    compile: str = "auto"

    def __post_init__(self) -> None:
        self.compile = str(self.compile).lower()  # YAML's and the command line's true/false too
        if self.compile not in COMPILE_CHOICES:
            raise ValueError(
                f"train.compile {self.compile!r}: choose one of {', '.join(COMPILE_CHOICES)}"
            )
        refuse_first(
            (self.log_every >= 1, f"train.log_every {self.log_every}: give 1 or more steps"),
            (
                self.eval_every >= 0,
                f"train.eval_every {self.eval_every}: give a number of steps, 0 for only at the end",
            ),
            (
                self.ckpt_every >= 0,
                f"train.ckpt_every {self.ckpt_every}: give a number of steps, 0 for only at the end",
            ),
            (
                self.eval_batches >= 0,
                f"train.eval_batches {self.eval_batches}: give a number of batches, 0 for the "
                "whole held-out set",
            ),
            (self.keep_last >= 1, f"train.keep_last {self.keep_last}: keep 1 checkpoint or more"),
            (
                self.peak_tflops >= 0,
                f"train.peak_tflops {self.peak_tflops}: give 0 (the device's own) or more",
            ),
        )

    def compiles(self, device_type: str, zero_stage: int) -> bool:
        """Whether this run compiles its model (``compile`` resolved on its device)."""
        if self.compile == "auto":
            return device_type == "cuda" and zero_stage < 3
        return self.compile == "true"


@dataclass(kw_only=True)
class DeepSpeedConfig:
    zero_stage: int = 0  # 0..3
    offload_optimizer: bool = False  # ZeRO-Offload of optimizer states to CPU (stage >= 1)
    config: dict = field(default_factory=dict)  # merged last into the generated ds_config


@dataclass(kw_only=True)
class ImageDataConfig:
    """Image crops for the visual tokenizer, read from raw shard folders."""

    raw: list[str] = field(default_factory=list)  # raw shard folders
    # The text tokenizer's folder (train-text-tokenizer --out), or its vocab_layout.json: when
    # given, vtok.levels are taken from the layout's fsq_levels, so the two always agree.
    tokenizer: str = ""
    # source names to use (default: all with images, but not ingest's held-out split val/*)
    sources: list[str] = field(default_factory=list)
    crop: int = 32  # square training crops, a multiple of the spatial factor
    max_pixels: int = 128 * 128  # images are first resized into this budget (aspect kept)
    video_frames: bool = True  # also take frames from videos
    heldout_fraction: float = 0.1  # whole documents held out, chosen by key hash
    heldout_crops: int = 256  # fixed crops of the held-out documents used for eval
    scene_probe: int = 64  # generated scenes for the shape-identity check (0: off)
    cache_images: int = (
        20000  # decoded images kept in memory; documents past it are counted, warned
    )

    def __post_init__(self) -> None:
        # Else found only as "no training image" (every image shrunk below a crop, or all held
        # out) or as a shape error inside the network
        refuse_first(
            (
                0 <= self.heldout_fraction < 1,
                f"vtok_data.heldout_fraction {self.heldout_fraction}: give a fraction of the "
                "documents from 0 to below 1",
            ),
            (
                self.max_pixels >= self.crop**2,
                f"vtok_data.max_pixels {self.max_pixels}: give at least vtok_data.crop squared "
                f"({self.crop**2}): images are resized into it before a crop is cut",
            ),
        )


@dataclass(kw_only=True)
class RunConfig:
    task: str = "lm"
    name: str = "run"
    run_dir: str = "runs/run"  # one folder per run, the same on every rank
    model: TransformerConfig = field(default_factory=TransformerConfig)
    vtok: VisualTokenizerConfig = field(default_factory=VisualTokenizerConfig)
    data: LoaderConfig = field(default_factory=LoaderConfig)  # the LM's token stream
    vtok_data: ImageDataConfig = field(default_factory=ImageDataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)

    def __post_init__(self) -> None:
        d = self.data
        if self.task not in TASKS:
            raise ValueError(f"task {self.task!r}: choose one of {', '.join(TASKS)}")
        if self.deepspeed.zero_stage not in (0, 1, 2, 3):
            raise ValueError(
                f"deepspeed.zero_stage {self.deepspeed.zero_stage}: choose 0, 1, 2 or 3"
            )
        refuse_first(
            (
                self.deepspeed.zero_stage >= 1 or not self.deepspeed.offload_optimizer,
                "deepspeed.offload_optimizer=true needs deepspeed.zero_stage 1 or more (ZeRO-Offload "
                "moves ZeRO's partitioned optimizer states; at stage 0 it would be ignored)",
            ),
            (
                self.deepspeed.zero_stage >= 1 or not self.train.bf16,
                "train.bf16=true needs deepspeed.zero_stage 1 or more (deepspeed=zero1): bf16 keeps "
                "fp32 master weights and gradients, which DeepSpeed's stage 0 does not do",
            ),
            (
                self.deepspeed.zero_stage < 3 or self.train.compile != "true",
                "train.compile=true with deepspeed.zero_stage 3: ZeRO-3 gathers each layer's "
                "weights in hooks that compiled blocks cannot call (the first step would fail); "
                "use train.compile=auto (eager at stage 3) or ZeRO 1-2",
            ),
            # Empty, the run's files would go into the current folder, or into runs/ itself
            (bool(self.name.strip()), "name is empty: give the run a name (run_dir: runs/NAME)"),
            (bool(self.run_dir.strip()), "run_dir is empty: give the run's own folder"),
            (
                glob.escape(self.run_dir) == self.run_dir,
                f"run_dir {self.run_dir!r} holds [ ] * or ?: DeepSpeed finds a checkpoint's files "
                "by glob pattern, which those characters break (the run would save and never "
                "resume); name the folder without them",
            ),
            (d.seq_len >= 1, f"data.seq_len {d.seq_len}: give the row length in tokens, 1 or more"),
            (
                d.num_workers >= 0,
                f"data.num_workers {d.num_workers}: give 0 (load in the main process) or more",
            ),
            # Else the packer holds nothing aside and the run ends at step 0, exit code 0
            (d.max_pending >= 1, f"data.max_pending {d.max_pending}: give 1 or more documents"),
            *[
                (getattr(d, key) >= 0, f"data.{key} {getattr(d, key)}: give 0 or more")
                for key in ("shuffle_buffer", "mix_chunk", "doc_budget")
            ],
        )
        for key in ("micro_batch", "grad_accum"):
            if getattr(self.train, key) <= 0:
                raise ValueError(f"train.{key} {getattr(self.train, key)}: give 1 or more")
        if self.train.sequence_parallel != 1:
            self._check_sequence_parallel()
        if self.train.steps <= 0 and self.train.steps != -1:
            raise ValueError(
                f"train.steps {self.train.steps}: give a positive number of steps, or -1 to train "
                "until the data ends (data.mode=epoch)"
            )

    def _check_sequence_parallel(self) -> None:
        degree = self.train.sequence_parallel
        if self.task != "lm":
            raise ValueError(
                f"train.sequence_parallel={degree}: only the lm task splits its rows (task={self.task})"
            )
        heads, rows = self.model.attention.n_heads, self.data.seq_len
        if why := sequence_parallel_refusal(n_heads=heads, seq_len=rows, degree=degree):
            fit = [
                d
                for d in range(1, heads + 1)
                if not sequence_parallel_refusal(n_heads=heads, seq_len=rows, degree=d)
            ]
            raise ValueError(
                f"train.sequence_parallel={degree}: {why}. Degrees that fit this model and row: "
                f"{', '.join(map(str, fit))}; the stage presets named after a model "
                "(stage=125m_32k, 1b_128k, ...) set one that fits it"
            )
