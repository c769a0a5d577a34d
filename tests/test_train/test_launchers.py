"""The `deepspeed` launcher starts earlyfuse-train as it would on a GPU node: two processes on
CPU (gloo), each given `--local_rank=N`, which Hydra alone would reject (train/dist.py strips it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from ray_cluster import free_port


def test_deepspeed_launcher_runs_two_ranks(tiny_raw, tmp_path):
    run = tmp_path / "run"
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or shutil.which(
        "deepspeed"
    )
    assert launcher, "the deepspeed launcher is installed with deepspeed"
    cmd = [
        launcher,
        "--num_nodes",
        "1",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "--module",
        "train.app",
        "experiment=vtok_debug",
        f"vtok_data.raw=[{tiny_raw}]",
        f"run_dir={run}",
        "train.steps=3",
        "vtok_data.heldout_crops=32",
        "vtok_data.video_frames=false",
        "train.progress=false",
        "deepspeed.zero_stage=2",
    ]
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "--local_rank=1" in out and "2 rank(s)" in out and "step 3/3 | loss" in out
    meta = json.loads((run / "checkpoints" / "step_00000003" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["zero_stage"] == 2


def test_earlyfuse_torchrun_clears_the_stop_notes_whenever_the_workers_start(tmp_path, monkeypatch):
    """A restart (``--max-restarts``, a membership change) stops the old workers with a signal,
    and the notes they leave are not the new attempt's: an attempt that then ends normally would
    be reported as stopped after its checkpoint, its exit barrier cut short."""
    from torch.distributed.elastic.agent.server import api

    from train.launch import all_stopped, watch_the_agent

    started = []
    monkeypatch.setattr(
        api.SimpleElasticAgent, "_initialize_workers", lambda a, g: started.append(g)
    )
    monkeypatch.setattr(api.SimpleElasticAgent, "_exit_barrier", lambda agent: None)
    for rank in (0, 1):
        (tmp_path / f"rank_{rank:05d}").write_text("2\n")  # an earlier attempt's
    assert all_stopped(tmp_path)
    watch_the_agent(tmp_path)
    api.SimpleElasticAgent._initialize_workers(object(), "group")
    assert started == ["group"] and not all_stopped(tmp_path) and not list(tmp_path.iterdir())


def test_earlyfuse_torchrun_help_says_its_own_defaults_and_exit_codes(capsys):
    """Its --help was torchrun's alone: a 30 s shutdown timeout, no SIGUSR1, no exit codes."""
    from train.launch import main

    try:
        code = main(["--help"])
    except SystemExit as done:  # argparse's way; torchrun's main returns instead
        code = done.code
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("earlyfuse-torchrun: torchrun for earlyfuse")
    assert "--shutdown-timeout is 300 s" in out and "SIGQUIT,SIGUSR1" in out
    assert "3 halted\nby a monitor" in out and "usage: " in out  # then torchrun's
