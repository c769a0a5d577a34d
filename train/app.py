"""``earlyfuse-train``: the Hydra entry point. The only place that sees Hydra: it composes
``configs/`` onto the typed schema (``train.config.RunConfig``), turns the result into
dataclasses once and hands them to ``train.run.Run``.

    earlyfuse-train experiment=vtok_debug
    earlyfuse-train experiment=vtok_demo train.steps=200 optim.lr=1e-3
    torchrun --nproc_per_node 2 -m train.app experiment=vtok_debug deepspeed.zero_stage=2
    deepspeed --num_gpus 8 --module train.app experiment=...   (--local_rank is handled)
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from train.config import RunConfig
from train.dist import strip_launcher_args

ConfigStore.instance().store(name="run_schema", node=RunConfig)
# An absolute path: Hydra would otherwise look for a Python package "configs".
CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


def to_run_config(cfg: DictConfig) -> tuple[RunConfig, str]:
    """The typed config and its resolved YAML (saved with every checkpoint)."""
    resolved = OmegaConf.to_yaml(cfg, resolve=True)
    run_cfg = OmegaConf.to_object(cfg)  # the structured schema makes this a RunConfig
    assert isinstance(run_cfg, RunConfig)
    return run_cfg, resolved


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def hydra_main(cfg: DictConfig) -> None:
    from train.run import Run, RunHalted

    run_cfg, resolved = to_run_config(cfg)
    try:
        Run(run_cfg, resolved)()
    except RunHalted as e:  # a monitor's decision, not a crash: no traceback, a distinct exit code
        print(f"earlyfuse-train: {e}", file=sys.stderr)
        sys.exit(3)


def main() -> None:
    sys.argv = strip_launcher_args(sys.argv)
    hydra_main()


if __name__ == "__main__":
    main()
