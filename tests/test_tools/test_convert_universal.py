"""Resuming on another world size: a 2-process ZeRO-1 run converted with `earlyfuse-convert
universal` resumes on 1 process and its loss curve continues; a ZeRO-0 LM run resumes on 1
process directly, its loader's position redistributed from the 2 old ranks (said on the console);
a damaged conversion stops only the resume that reads it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainrun import metrics, run_checkout, train

from tools.convert import main as convert_main
from train.checkpoint import Checkpointer, verify_universal
from train.dist import DistInfo
from train.safe_load import CheckpointError


def vtok(tiny_raw, run, steps, *extra):
    return [
        "experiment=vtok_debug",
        f"vtok_data.raw=[{tiny_raw}]",
        f"run_dir={run}",
        f"train.steps={steps}",
        "train.log_every=1",
        "vtok_data.heldout_crops=32",
        "vtok_data.video_frames=false",
        "train.ckpt_every=4",
        *extra,
    ]


def lm(tiny_tokens, run) -> list[str]:
    srcs = ",".join(
        f"{{name: {s}, shards: [{tiny_tokens / s}], weight: 1.0}}" for s in ("scenes", "text")
    )
    return ["experiment=debug", f"data.sources=[{srcs}]", f"run_dir={run}"]


def test_universal_checkpoint_resumes_a_zero1_run_on_another_world_size(tiny_raw, tmp_path, capsys):
    run = tmp_path / "run"
    train(vtok(tiny_raw, run, 4, "deepspeed.zero_stage=1"), nproc=2)
    assert convert_main(["universal", str(run)]) == 0
    assert "as a universal checkpoint" in capsys.readouterr().out
    assert (run / "checkpoints" / "step_00000004" / "universal" / "zero").is_dir()
    # More steps on another world size: meant, so said (train.allow_config_change).
    p = train(vtok(tiny_raw, run, 10, "deepspeed.zero_stage=1", "train.allow_config_change=true"))
    assert (
        "resuming step_00000004 of 2 rank(s) on 1 from its universal checkpoint"
        in p.stdout + p.stderr
    )
    m = metrics(run)
    assert sorted(m) == list(range(1, 11))
    late = sum(m[s]["train/loss"] for s in range(5, 11)) / 6
    assert (
        late < m[1]["train/loss"] and late < 1.5 * m[4]["train/loss"]
    )  # continues, does not restart
    assert m[5]["optim/lr"] < m[4]["optim/lr"] * 1.5  # the schedule continued too
    assert (
        json.loads((run / "checkpoints" / "step_00000010" / "meta.json").read_text())["world_size"]
        == 1
    )
    assert convert_main(["universal", str(run), "--step", "4"]) == 2  # exists: --force to redo


def test_a_run_resumed_from_a_universal_checkpoint_rolls_back_to_its_own_checkpoints(
    tiny_tokens, tmp_path, capsys
):
    """After a ZeRO-1 resume on another world size, a rollback loads one of the run's own later
    checkpoints the ordinary way (DeepSpeed went on reading universal ones: the load failed)."""
    run = tmp_path / "run"
    args = [
        *lm(tiny_tokens, run),
        "deepspeed.zero_stage=1",
        "train.ckpt_every=10",
        "train.keep_last=9",
        "train.log_every=5",
        "optim.skip_step.min_steps=20",
        "optim.schedule=constant",
        "data.mix_chunk=64",  # every step carries the mix: the fault's spike stands out
    ]
    train([*args, "train.steps=30"])
    assert convert_main(["universal", str(run)]) == 0
    capsys.readouterr()
    later = [*args, "train.steps=75", "train.allow_config_change=true"]
    p = train(later, nproc=2, faults={"lr_x100_at": 60})
    out = p.stdout + p.stderr
    assert "resuming step_00000030 of 1 rank(s) on 2 from its universal checkpoint" in out
    assert "back to the checkpoint of step 50" in out, out[-3000:]
    assert max(metrics(run)) == 75


def test_zero0_lm_run_resumes_on_another_world_size_directly(tiny_tokens, tmp_path, capsys):
    run = tmp_path / "run"
    args = [
        *lm(tiny_tokens, run),
        "train.micro_batch=2",
        "train.ckpt_every=3",
        "train.log_every=1",
        "train.allow_config_change=true",  # each resume below adds steps or changes the world
    ]
    train(args + ["train.steps=3"], nproc=2)
    # Nothing to convert: said, exit 0 and nothing written (a script may convert every run).
    assert convert_main(["universal", str(run)]) == 0
    assert "resumes on any world size as it is" in capsys.readouterr().out
    assert not (run / "checkpoints" / "step_00000003" / "universal").exists()
    p = train(args + ["train.steps=6"])
    out = p.stdout + p.stderr
    assert "resuming step_00000003 of 2 rank(s) on 1" in out and "fresh pass" not in out
    assert "the loader's state was redistributed from 2 to 1 consumers" in out
    m = metrics(run)
    assert sorted(m) == list(range(1, 7)) and m[6]["train/loss"] < m[1]["train/loss"]
    p = train(args + ["train.steps=10", "data.num_workers=2"], nproc=2)  # more ranks, workers
    out = p.stdout + p.stderr
    assert "resuming step_00000006 of 1 rank(s) on 2" in out
    assert "the loader's state was redistributed from 1 to 4 consumers" in out
    assert sorted(metrics(run)) == list(range(1, 11))
    # A refusal both ranks decide alike is said once, not once a rank
    strict = [arg for arg in args if not arg.startswith("train.allow_config_change")]
    p = train([*strict, "train.steps=12", "data.num_workers=2"], nproc=2, check=False)
    assert p.returncode != 0
    assert p.stderr.count("with changes that break an exact resume: train.steps") == 1, p.stderr


@pytest.fixture(scope="module")
def zero1_run(tiny_tokens, tmp_path_factory) -> Path:
    """Two steps of the debug LM under ZeRO 1 on one process, a checkpoint at the end; tests
    convert copies of it."""
    run = tmp_path_factory.mktemp("zero1") / "run"
    srcs = ",".join(f"{{name: {s}, shards: [{tiny_tokens / s}], weight: 1.0}}" for s in ("text",))
    train(
        ["experiment=debug", f"data.sources=[{srcs}]", f"run_dir={run}", "train.steps=2"]
        + ["train.micro_batch=2", "deepspeed.zero_stage=1"]
    )
    return run


def test_a_damaged_universal_conversion_stops_only_the_resume_that_reads_it(zero1_run, tmp_path):
    """Before: its checkpoint was taken for damaged, set aside at the next start on any world
    size (the only one: 'delete latest to start over from step 0'), and refused by `release` and
    by `universal --force`, the way to make the conversion again."""
    run = Path(shutil.copytree(zero1_run, tmp_path / "run"))
    assert convert_main(["universal", str(run)]) == 0
    part = next((run / "checkpoints" / "step_00000002" / "universal").rglob("fp32.pt"))
    part.write_bytes(part.read_bytes()[:100])
    two = Checkpointer(run, DistInfo(0, 2, 0, torch.device("cpu")), 2)
    assert two.check_latest() == "step_00000002"  # kept: it resumes on 1 rank as it is
    with pytest.raises(CheckpointError) as refused:
        two.check_compatible("step_00000002", 1)
    assert str(refused.value).startswith(
        f"{run}/checkpoints/step_00000002/universal: the universal conversion is damaged ({part}: "
        "100 bytes, the manifest says"
    )
    assert f"`earlyfuse-convert universal {run} --step 2 --force`" in str(refused.value)
    assert convert_main(["release", str(run), str(tmp_path / "rel")]) == 0
    assert convert_main(["universal", str(run), "--force"]) == 0
    assert two.check_compatible("step_00000002", 1)["step"] == 2
    # Same size, other bytes: found by rank 0's hashes; the other ranks check sizes only (each
    # hashing the whole conversion would read it once per rank from shared storage)
    part = next((run / "checkpoints" / "step_00000002" / "universal").rglob("fp32.pt"))
    part.write_bytes(bytes(len(part.read_bytes())))
    with pytest.raises(CheckpointError, match="the universal conversion is damaged"):
        two.check_compatible("step_00000002", 1)
    other = Checkpointer(run, DistInfo(1, 2, 1, torch.device("cpu")), 2)
    assert other.check_compatible("step_00000002", 1)["step"] == 2
    # A conversion stopped before its last file: the command to make it again replaces it
    (run / "checkpoints" / "step_00000002" / "universal" / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=f"`earlyfuse-convert universal {run} --force`"):
        two.check_compatible("step_00000002", 1)


def test_a_conversion_cut_short_leaves_the_previous_one_whole(zero1_run, tmp_path, monkeypatch):
    """Before: --force deleted the old conversion first, and a conversion cut short (Ctrl-C, kill
    -9) left a universal/ of part of the files, which the next command refused as "exists". Now
    it is built beside it and moved into place whole."""
    import deepspeed.checkpoint.ds_to_universal as ds

    run = Path(shutil.copytree(zero1_run, tmp_path / "run"))
    step = run / "checkpoints" / "step_00000002"
    assert convert_main(["universal", str(run)]) == 0
    before = {p: p.read_bytes() for p in (step / "universal").rglob("*") if p.is_file()}

    def cut_short(args):
        (Path(args.output_folder) / "zero").mkdir()
        (Path(args.output_folder) / "zero" / "part.pt").write_bytes(b"x")
        raise KeyboardInterrupt

    monkeypatch.setattr(ds, "main", cut_short)
    assert convert_main(["universal", str(run), "--force"]) == 130  # Ctrl-C: one line
    after = {p: p.read_bytes() for p in (step / "universal").rglob("*") if p.is_file()}
    assert after == before
    assert not [p for p in step.parent.iterdir() if p.name.startswith(".")]  # nothing set aside
    assert not (step / "universal.partial").exists()
    # kill -9 after the old one was set aside: the next command puts it back first
    aside = step.parent / ".step_00000002.universal-abc"
    aside.mkdir()
    (step / "universal").rename(aside / "universal")
    assert convert_main(["universal", str(run)]) == 2  # it exists again: --force to remake it
    assert {p: p.read_bytes() for p in (step / "universal").rglob("*") if p.is_file()} == before
    assert not aside.exists()
    monkeypatch.undo()
    assert convert_main(["universal", str(run), "--force"]) == 0
    assert (step / "latest_universal").read_text() == "universal"
    assert verify_universal(step) == []


def convert(*argv: str, file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    """``earlyfuse-convert ARGV`` of this checkout in a subprocess."""
    cmd = [sys.executable, "-m", "tools.convert", *argv]
    return run_checkout(cmd, file_size_limit=file_size_limit)


def test_a_conversion_that_cannot_be_written_says_why_in_one_line(zero1_run, tmp_path):
    """A full disk (here a file-size limit, which fails torch's writer the same way) said
    'DeepSpeed could not make a universal checkpoint ([enforce fail at inline_container.cc:672]
    . unexpected pos 704 vs 598)', with exit code 2, that of a user's mistake."""
    run = Path(shutil.copytree(zero1_run, tmp_path / "run"))
    out = run / "checkpoints" / "step_00000002" / "universal"
    p = convert("universal", str(run), file_size_limit=100_000)
    said = p.stderr.splitlines()[-1]  # after DeepSpeed's progress bars
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert said.startswith(
        f"earlyfuse-convert universal: error: {out} could not be written: a file reached the "
        "file-size limit of this process (ulimit -f: 100000 bytes)"
    )
    assert said.endswith(
        "nothing of it is left and step_00000002 is unchanged: run the same command again once "
        "this is fixed"
    )
    assert not out.exists()
    assert convert("universal", str(run)).returncode == 0 and (out / "source.json").is_file()


def test_a_conversion_on_a_full_disk_says_the_disk_is_full(zero1_run, small_tmpfs):
    """A real ENOSPC: the run on a file system with room for it and for half a conversion."""
    run = Path(shutil.copytree(zero1_run, small_tmpfs / "run"))
    used = sum(f.stat().st_size for f in run.rglob("*") if f.is_file())
    size_kb = (used + used // 2) // 1024
    subprocess.run(["mount", "-o", f"remount,size={size_kb}k", str(small_tmpfs)], check=True)
    p = convert("universal", str(run))
    out = run / "checkpoints" / "step_00000002" / "universal"
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.splitlines()[-1].startswith(
        f"earlyfuse-convert universal: error: {out} could not be written: the disk is full"
    )
    assert not out.exists()


def test_a_read_only_run_folder_is_refused_before_the_conversion(zero1_run, small_tmpfs, capsys):
    """Found only after DeepSpeed's work, with exit code 1 (the machine's) and the path twice."""
    run = Path(shutil.copytree(zero1_run, small_tmpfs / "run"))
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    out = run / "checkpoints" / "step_00000002" / "universal"
    assert convert_main(["universal", str(run)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"earlyfuse-convert universal: error: {out}: cannot be written ({out.parent} takes no new "
        "file: Read-only file system)"
    )


def test_converting_a_step_other_than_latest_says_the_resume_takes_latest(zero1_run, tmp_path):
    run = Path(shutil.copytree(zero1_run, tmp_path / "run"))
    (run / "checkpoints" / "latest").write_text("step_00000009\n")  # a later save, say
    lines: list[str] = []
    from tools.convert_universal import make_universal

    make_universal(run, 2, log=lines.append)
    assert lines[-1].endswith(
        "a run resumes from latest (step_00000009), not from it: convert step_00000009 to resume "
        "on other ranks"
    )
