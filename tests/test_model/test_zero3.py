"""The model under DeepSpeed ZeRO-3 (one CPU process, gloo): same loss as plain PyTorch before
and after an AdamW step, for a dense model and an MoE model with activation checkpointing. ZeRO-3
partitions every weight and gathers it around each module's forward and backward; this catches
a weight used outside its module or an output type whose tensors DeepSpeed cannot hook (a
dataclass LossResult made backward fail). Runs in a subprocess so that the process group does
not leak into other tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

SCRIPT = r"""
import dataclasses, json, os, sys, torch
import deepspeed
from train.ds_env import prepare_deepspeed
prepare_deepspeed()  # no shm_comm op built (train/ds_env.py)
from model import preset
from model.moe import MoEConfig
out = {}
for variant in ("dense", "moe+ckpt"):
    cfg = preset("debug")
    if variant == "moe+ckpt":
        cfg = dataclasses.replace(cfg, moe=MoEConfig(num_experts=4, top_k=2), activation_checkpoint_every=1)
    torch.manual_seed(0)
    ref = cfg.build()
    m = cfg.build()
    m.load_state_dict(ref.state_dict())
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}}}
    eng, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=ds)
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    doc = torch.tensor([[0] * 16 + [1] * 16] * 2)
    r = eng(ids, labels=labels, doc_ids=doc)
    eng.backward(r.loss)
    eng.step()
    after = eng(ids, labels=labels, doc_ids=doc).loss.item()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    r0 = ref(ids, labels=labels, doc_ids=doc)
    r0.loss.backward()
    opt.step()
    out[variant] = [r.loss.item(), r0.loss.item(), after, ref(ids, labels=labels, doc_ids=doc).loss.item()]
print("RESULT " + json.dumps(out))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_zero3_matches_plain_pytorch():
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(root),
    }
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert p.returncode == 0 and line, p.stderr[-3000:]
    for variant, (ds0, ref0, ds1, ref1) in json.loads(line[7:]).items():
        assert abs(ds0 - ref0) < 1e-5, variant
        assert abs(ds1 - ref1) < 1e-3 and ds1 < ds0 - 0.1, (variant, ds1, ref1)
