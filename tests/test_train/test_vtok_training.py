"""The visual tokenizer trained by `earlyfuse-train experiment=vtok_debug` on real shards, under
DeepSpeed on CPU: metrics, export, reconstruction grid, crash and resume."""

from __future__ import annotations

import json

import torch
from trainrun import metrics, train

from data.tokenize.visual import load_visual_tokenizer
from data.vocab import VocabLayout
from train.tasks.vtok import below_baselines


def base(tiny_raw, run_dir, steps=6, *extra):
    return [
        "experiment=vtok_debug",
        f"vtok_data.raw=[{tiny_raw}]",
        f"run_dir={run_dir}",
        f"train.steps={steps}",
        "train.log_every=1",
        "vtok_data.heldout_crops=32",
        *extra,
    ]


def test_vtok_run_writes_metrics_export_and_grid(tiny_raw, tmp_path):
    run = tmp_path / "run"
    # The levels come from the text tokenizer's layout (vtok_data.tokenizer), not the preset's.
    VocabLayout(text_size=300, fsq_levels=(8, 6, 5), max_grid=16).save(tmp_path / "layout.json")
    p = train(base(tiny_raw, run, 6, f"vtok_data.tokenizer={tmp_path / 'layout.json'}"))
    assert "step 6/6 | loss" in p.stdout and "image" in p.stdout
    assert "vtok.levels [8, 5, 5, 5] -> [8, 6, 5]" in p.stdout
    saved = json.loads((run / "visual_tokenizer" / "config.json").read_text())
    assert saved["levels"] == [8, 6, 5]
    m = metrics(run)
    assert sorted(m) == [1, 2, 3, 4, 5, 6]
    assert m[6]["loss/image"] < m[1]["loss/image"]
    final = json.loads((run / "final.json").read_text())
    for k in (
        "eval/psnr",
        "eval/ssim",
        "eval/baseline_psnr",
        "eval/code_fraction",
        "eval/code_perplexity",
    ):
        assert k in final
    # Six steps end far below the equal-bits baselines: said on the console and in final.json.
    assert final["eval/psnr"] < final["eval/baseline_psnr"]
    assert "is below the equal-bits baseline(s) mean-colour" in p.stdout
    assert any("below the equal-bits" in line for line in final["warnings"])
    assert final["skipped_images"] == sum(
        got["small"] + got["unreadable"] for got in final["skipped_by_source"].values()
    )
    assert (run / "vtok_reconstructions.png").stat().st_size > 0
    assert (run / "tb").is_dir() and (
        run / "checkpoints" / "latest"
    ).read_text().strip() == "step_00000006"
    model = load_visual_tokenizer(
        run / "visual_tokenizer", VocabLayout(text_size=10, fsq_levels=(8, 6, 5))
    )
    codes = model.encode(torch.zeros(1, 3, 16, 24))
    assert codes.shape == (1, 4, 6)


def test_killed_run_resumes_bit_identically(tiny_raw, tmp_path):
    """Killed (-9) at a step and in the middle of a save: each resumes to the uninterrupted
    run's losses and gradient norms, bit for bit."""
    ref = tmp_path / "ref"
    train(base(tiny_raw, ref, 8))
    a = metrics(ref)
    for where, faults in (("step", {"kill_at_step": 5}), ("save", {"kill_in_save": 6})):
        run = tmp_path / where
        p = train(base(tiny_raw, run, 8, "train.ckpt_every=3"), faults=faults, check=False)
        assert p.returncode == -9  # SIGKILL, as kill -9
        latest = (run / "checkpoints" / "latest").read_text().strip()
        assert latest == "step_00000003"  # a save cut short never moves `latest`
        train(base(tiny_raw, run, 8, "train.ckpt_every=3"))
        b = metrics(run)
        for step in range(1, 9):
            assert a[step]["train/loss"] == b[step]["train/loss"], (where, step)
            assert a[step]["optim/grad_norm"] == b[step]["optim/grad_norm"], (where, step)
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
            "latest",
            "step_00000006",
            "step_00000008",
        ]


def test_a_typo_in_an_override_names_the_key(tiny_raw, tmp_path):
    p = train(base(tiny_raw, tmp_path / "r", 2, "vtok.factr=4"), check=False)
    assert p.returncode != 0 and "factr" in p.stderr


def test_raw_shards_that_cannot_be_used_are_one_line_and_exit_code_2(tiny_raw, tmp_path):
    p = train(base(tiny_raw, tmp_path / "r", 2, "vtok_data.sources=[nope]"), check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert f"earlyfuse-train: vtok_data: {tiny_raw}: no source 'nope' (it has [" in p.stderr


def test_resuming_zero_shards_on_another_world_size_asks_for_a_universal_checkpoint(
    tiny_raw, tmp_path
):
    run = tmp_path / "run"
    train(base(tiny_raw, run, 2, "deepspeed.zero_stage=1"))
    meta = run / "checkpoints" / "step_00000002" / "meta.json"
    m = json.loads(meta.read_text())
    m["world_size"] = 2
    meta.write_text(json.dumps(m))
    p = train(base(tiny_raw, run, 4, "deepspeed.zero_stage=1"), check=False)
    assert p.returncode != 0 and "written by 2 rank(s)" in p.stderr
    assert f"earlyfuse-convert universal {run}" in p.stderr


def test_below_baselines_names_the_baselines_beaten_and_what_to_do():
    figures = {"eval/psnr": 20.0, "eval/baseline_psnr": 20.14, "eval/palette_psnr": 20.62}
    said = below_baselines(figures)
    assert "held-out PSNR 20.00 dB is below" in said
    assert "mean-colour 20.14 dB, palette 20.62 dB" in said and "vtok.entropy" in said
    # Without a held-out image the figure is on training crops, and says so.
    assert below_baselines({**figures, "eval/heldout": 0.0}).startswith(
        "PSNR on training crops 20.00 dB is below"
    )
    assert below_baselines({**figures, "eval/psnr": 21.0}) == ""
    assert below_baselines({}) == ""
