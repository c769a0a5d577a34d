"""Names of a run's artifacts and metric namespaces: one spelling, shared by the trainer that
writes them and the tools that read them (``earlyfuse-report``, ``earlyfuse-convert``).

A run folder (``run_dir``, the same on every rank)::

    config.yaml          the resolved config (also inside every checkpoint)
    pass_configs/from_step_NNNNNNNN.yaml   the config of the pass that went on from step N
    launches.jsonl       one JSON object per start: the command, cwd, host, world size, versions
                         and the code's git commit
    metrics.jsonl        one record per optimizer step: {"step": N, "<namespace>/<name>": value}
    alarms.jsonl         the monitors' alarms, one JSON object per line
    final.json           written when the run completes: final evaluation and totals
    halted.json          written when a monitor halts the run: {"step", "reason"} (removed at the
                         next start)
    tb/                  TensorBoard events
    checkpoints/latest   the tag of the newest complete checkpoint
    checkpoints/step_NNNNNNNN/meta.json   step, world size, ZeRO stage of one checkpoint
    checkpoints/step_NNNNNNNN/tokenizers.json   (lm) the tokenizers its token sources were made with

Metric names are ``<namespace>/<name>`` (OLMo-core style), e.g. ``loss/image``.
"""

from __future__ import annotations

from pathlib import Path

CONFIG_FILE = "config.yaml"
CONFIGS_DIR = "pass_configs"  # each pass's config (pass_config_file): a resume may change it
LAUNCHES_FILE = "launches.jsonl"
METRICS_FILE = "metrics.jsonl"
ALARMS_FILE = "alarms.jsonl"
FINAL_FILE = "final.json"
HALTED_FILE = "halted.json"
TENSORBOARD_DIR = "tb"
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"  # inside checkpoints/
CHECKPOINT_META_FILE = "meta.json"  # inside checkpoints/<tag>/
CHECKPOINT_TOKENIZERS_FILE = "tokenizers.json"  # inside checkpoints/<tag>/ of an lm run


def pass_config_file(step: int) -> str:
    """The name, inside ``CONFIGS_DIR``, of the config of the pass that went on from ``step``."""
    return f"from_step_{step:08d}.yaml"


def pass_config_step(name: str) -> int | None:
    """The step of a ``pass_config_file`` name, else None."""
    digits = name.removeprefix("from_step_").removesuffix(".yaml")
    return int(digits) if digits.isdigit() and len(name) == len(digits) + 15 else None


def pass_configs(run_dir: Path) -> list[tuple[int, Path]]:
    """The config of each pass of a run, by the step it went on from, in step order."""
    found = ((pass_config_step(f.name), f) for f in (run_dir / CONFIGS_DIR).glob("*.yaml"))
    return sorted((step, f) for step, f in found if step is not None)


# Metric namespaces: every metric name is one of these followed by a name.
TRAIN = "train/"  # the objective: train/loss, train/z_loss, train/aux_loss
LOSS = "loss/"  # training CE per modality: loss/text, loss/image, ...
LOSS_NORM = "loss_norm/"  # CE / ln V per modality: 1.0 is chance
TOKENS = "tokens/"  # label tokens per modality in the step
MIX = "mix/"  # delivered token share per data source
VAL = "val/"  # validation: val/loss, val/loss/<modality>, val/ppl/<modality>
EVAL = "eval/"  # task evaluations (vtok: eval/psnr, eval/ssim, ...)
OPTIM = "optim/"  # optim/lr, optim/grad_norm, optim/skipped, optim/skipped_steps
THROUGHPUT = "throughput/"  # units/s, MFU, data wait, step and monitor seconds, ETA
MONITOR = "monitor/"  # detectors and probes: monitor/<signal>[/<modality>]
DATA = "data/"  # loader health: data/skipped; data/docs_new/<m>, data/docs_mass/<m> (tasks/documents.py)
VTOK = "vtok/"  # visual tokenizer training terms: vtok/l1, vtok/psnr, ...

TRAIN_LOSS = TRAIN + "loss"
GRAD_NORM = OPTIM + "grad_norm"
LEARNING_RATE = OPTIM + "lr"
DATA_SKIPPED = DATA + "skipped"

# The packed batch's fields the model's forward takes as keyword arguments (Transformer.forward);
# "labels" and "label_modality" only matter where it computes the loss.
MODEL_INPUTS = (
    "input_ids",
    "labels",
    "modality",
    "label_modality",
    "doc_ids",
    "position_ids",
    "position_thw",
    "image_ids",
)
