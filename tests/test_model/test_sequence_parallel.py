"""Sequence parallelism (model/sequence_parallel.py, train/sequence_groups.py): the Ulysses layer
over 2 and 4 gloo processes gives the single-process forward, loss and gradients on packed rows
whose documents and image blocks straddle the shard boundaries; the row is prepared whole and
then sharded; bad degrees are refused by name."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ray_cluster import free_port
from safetensors.torch import save_file

from data.vocab import Modality
from model.attention import AttentionConfig
from model.rope import RopeConfig
from model.sequence_parallel import check_sequence_parallel, kv_repeats, shard_row
from train.sequence_groups import sequence_parallel_ranks

# fp32 on CPU: the SP path runs the same kernels on the same numbers in another order (the loss
# is summed per shard first), so differences sit at rounding level, far below this.
TOLERANCE = 1e-5


def packed_rows(kit) -> dict:
    """Two rows of 64: text, code and captioned-image documents packed back to back, so that at
    2 and 4 shards documents and image blocks cross the boundaries."""
    gen = torch.Generator().manual_seed(0)
    text, code = Modality.TEXT, Modality.CODE
    row0 = kit.pack(
        [kit.text_doc(20, text, gen), kit.image_doc(3, 4, gen), kit.text_doc(14, code, gen)], 64
    )
    row1 = kit.pack(
        [
            kit.image_doc(2, 5, gen, caption=5),
            kit.text_doc(18, code, gen),
            kit.text_doc(10, text, gen),
        ],
        64,
    )
    return kit.cat_rows([row0, row1])


def test_sp_matches_one_process_on_2_and_4_ranks(kit, tmp_path):
    """torchrun with 4 gloo processes: SP 2 (two groups: data parallel 2 x SP 2) and SP 4.
    Case ``images``: M-RoPE, grid embeddings, bidirectional image blocks, 4 query heads over 2 KV
    heads (split at SP 2, replicated at SP 4), local/global layers (layer 0 local: window 12 and
    its own RoPE base; layer 1 global), also run with FlexAttention's BlockMasks (forward).
    Case ``mqa``: one KV head (replicated 2 and 4 times), a sliding window of 12 and activation
    checkpointing (backward recomputes each block, all-to-alls included).
    Then DeepSpeed ZeRO 1 and 2 over DP 2 x SP 2 (``parallel_state_sp`` as its mpu): one SGD
    step equals the single-process step on the two rows."""
    batch = packed_rows(kit)
    cases = {
        "images": (
            kit.tiny_config(
                attention=AttentionConfig(
                    n_heads=4,
                    n_kv_heads=2,
                    bidirectional_images=True,
                    local_window=12,
                    global_every=2,
                ),
                rope=RopeConfig(mrope_sections=[2, 1, 1], local_theta=100.0),
                grid_embedding=True,
            ),
            True,
        ),
        "mqa": (
            kit.tiny_config(
                attention=AttentionConfig(n_heads=4, n_kv_heads=1, sliding_window=12),
                activation_checkpoint_every=1,
            ),
            False,
        ),
    }
    case_dir, out = tmp_path / "cases", tmp_path / "out"
    case_dir.mkdir()
    out.mkdir()
    for name, (cfg, flex) in cases.items():
        spec = {"config": dataclasses.asdict(cfg), "degrees": [2, 4], "flex": flex}
        (case_dir / f"{name}.json").write_text(json.dumps(spec))
        save_file(
            {key: value.contiguous() for key, value in batch.items()},
            case_dir / f"{name}.safetensors",
        )
    root = Path(__file__).resolve().parents[2]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "4",
        "--master_port",
        str(free_port()),
        str(Path(__file__).with_name("sp_worker.py")),
        str(case_dir),
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(4):
        results = json.loads((out / f"rank_{rank}.json").read_text())
        layer = {f"{name}/sp{degree}" for name in cases for degree in (2, 4)}
        assert set(results) == layer | {"deepspeed/zero1", "deepspeed/zero2"}
        for stage in (1, 2):
            got = results.pop(f"deepspeed/zero{stage}")
            assert got["loss"] < TOLERANCE and got["weights"] < TOLERANCE, (stage, got)
        for key, got in results.items():
            docs, images = got["straddle"]
            assert docs > 0 and images > 0, (key, got)  # the boundaries cut documents and images
            assert got["logits"] < TOLERANCE, (key, got)
            assert got["loss"] < TOLERANCE and got["ce"] < TOLERANCE, (key, got)
            assert got["count"] and got["num_tokens"], (key, got)
            assert got["grad"] < TOLERANCE and got["grad_scale"] > 1e-2, (key, got)
            if key.startswith("images"):
                assert got["flex_logits"] < TOLERANCE, (key, got)


def test_shard_row_prepares_the_whole_row_then_cuts_it(kit):
    batch = packed_rows(kit)
    cfg = kit.tiny_config(attention=AttentionConfig(n_heads=4, n_kv_heads=2))
    shards = [shard_row(batch, cfg, rank=rank, degree=4) for rank in range(4)]
    for key in ("input_ids", "labels", "position_ids", "position_thw", "doc_ids", "image_ids"):
        assert torch.equal(torch.cat([shard[key] for shard in shards], dim=1), batch[key]), key
    # The target of a shard's last token is the next shard's first: its modality comes from the
    # whole row, not from the shard (which would repeat its own).
    whole = torch.cat([shard["label_modality"] for shard in shards], dim=1)
    modality = batch["modality"]
    assert torch.equal(whole[:, :-1], modality[:, 1:])
    # One mask for the whole row, the same on every rank; scalars pass through.
    assert shards[0]["mask"].dense.shape == (2, 1, 64, 64)
    assert torch.equal(shards[0]["mask"].dense, shards[3]["mask"].dense)
    assert torch.equal(shards[2]["num_real_tokens"], batch["num_real_tokens"])
    # Positions are derived from the whole row's documents when the batch has none.
    no_positions = {key: value for key, value in batch.items() if key != "position_ids"}
    cut = shard_row(no_positions, cfg, rank=1, degree=2)
    assert torch.equal(cut["position_ids"], batch["position_ids"][:, 32:])


def test_bad_degrees_are_refused_by_name(kit):
    with pytest.raises(ValueError, match=r"model\.attention\.n_heads = 6"):
        check_sequence_parallel(n_heads=6, seq_len=64, degree=4)
    with pytest.raises(ValueError, match=r"66 tokens, data\.seq_len"):
        check_sequence_parallel(n_heads=4, seq_len=66, degree=4)
    batch = packed_rows(kit)
    with pytest.raises(ValueError, match="n_heads"):
        shard_row(batch, kit.tiny_config(), rank=0, degree=8)  # 4 heads
    with pytest.raises(ValueError, match="outside"):
        shard_row(batch, kit.tiny_config(), rank=2, degree=2)
    with pytest.raises(ValueError, match=r"train\.sequence_parallel=4 .* \(6\)"):
        sequence_parallel_ranks(6, 4)
    assert sequence_parallel_ranks(8, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize(
    ("kv_heads", "degree", "repeats"), [(2, 2, 1), (4, 2, 1), (2, 4, 2), (1, 4, 4), (2, 3, 3)]
)
def test_kv_heads_are_repeated_only_when_the_degree_does_not_divide_them(kv_heads, degree, repeats):
    assert kv_repeats(kv_heads, degree) == repeats
