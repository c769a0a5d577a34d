"""Checkpoints that cannot take a run over or stop it, on real
DeepSpeed checkpoints written by real runs:

- a crafted pickle (its unpickling would create a marker file) in the model states, the
  optimizer states or our own rank state file runs nothing, on resume and in every tool that
  reads checkpoints or releases; the error names the file;
- a truncated model states file of the newest checkpoint, a truncated ``latest`` pointer and a
  checkpoint whose deletion was cut short make the run fall back to the newest intact
  checkpoint with a warning naming the bad file (never to step 0); none intact is an error;
- a one-process run compiles no DeepSpeed op;
- a save that cannot be written (a file-size limit, as a full disk; a folder that cannot be
  written) says so, where, and that ``latest`` still names the intact previous checkpoint;
  refused and damaged checkpoints (one of another ZeRO stage, a rank state of another format)
  end the run with one line and exit code 2; a checkpoint set aside as damaged is reported damaged by later starts too, not missing; a first checkpoint
  complete but for ``latest`` (a kill between the two) is resumed from, with a warning.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from factories import plant_pickle
from trainrun import metrics, train

from train.checkpoint import Checkpointer, remove_checkpoint, verify_folder
from train.dist import DistInfo
from train.safe_load import CheckpointError
from train.save_errors import CheckpointWriteError, describe_write_failure

SOURCES = {"scenes": 0.4, "text": 0.4, "code": 0.2}
ONE = DistInfo(0, 1, 0, torch.device("cpu"))


def base(tokens, run_dir, steps, *extra):
    srcs = ",".join(
        f"{{name: {s}, shards: [{tokens / s}], weight: {w}}}" for s, w in SOURCES.items()
    )
    return [
        "experiment=debug",
        f"data.sources=[{srcs}]",
        f"run_dir={run_dir}",
        f"train.steps={steps}",
        "train.micro_batch=2",
        "train.log_every=1",
        # the tests resume copies of these runs with more steps: a change they mean
        "train.allow_config_change=true",
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(tiny_tokens, tmp_path_factory):
    """A ZeRO-0 fp32 run with a checkpoint at every step (its console output and an emptied
    TORCH_EXTENSIONS_DIR kept), and a ZeRO-2 bf16 run (optimizer states of DeepSpeed's classes)."""
    root = tmp_path_factory.mktemp("ckpt_safety")
    ext = root / "torch_extensions"
    ext.mkdir()
    p = train(
        base(tiny_tokens, root / "zero0", 3, "train.ckpt_every=1", "train.keep_last=3"),
        env={"TORCH_EXTENSIONS_DIR": str(ext)},
    )
    train(base(tiny_tokens, root / "zero2", 2, "deepspeed.zero_stage=2", "train.bf16=true"))
    return {"zero0": root / "zero0", "zero2": root / "zero2", "ext": ext, "log": p}


def copy(runs, name, tmp_path):
    shutil.copytree(runs[name], tmp_path / name)
    return tmp_path / name


def step_folder(run, step):
    return run / "checkpoints" / f"step_{step:08d}"


def test_a_one_process_run_compiles_no_deepspeed_op(runs):
    assert list(runs["ext"].iterdir()) == []
    out = runs["log"].stdout + runs["log"].stderr
    assert "Building extension" not in out and "shm_comm" not in out


def test_every_checkpoint_records_each_files_size_and_hash(runs):
    folder = step_folder(runs["zero2"], 2)
    files = json.loads((folder / "meta.json").read_text())["files"]
    assert {"mp_rank_00_model_states.pt", "rank_00000.pt", "vocab_layout.json"} <= set(files)
    assert "config.yaml" not in files  # a copy for people and tools, editable
    assert any(n.endswith("optim_states.pt") for n in files)
    assert all(len(v["sha256"]) == 64 and v["bytes"] > 0 for v in files.values())
    assert verify_folder(folder) == []


def test_a_checkpoint_without_its_manifest_is_refused_not_loaded_unchecked(runs, tmp_path, capsys):
    r = copy(runs, "zero0", tmp_path)
    meta = step_folder(r, 3) / "meta.json"
    fields = json.loads(meta.read_text())
    meta.write_text(json.dumps({key: value for key, value in fields.items() if key != "files"}))
    assert verify_folder(step_folder(r, 3)) == [
        f"{meta}: no manifest of the checkpoint's files (not written by a save)"
    ]
    # Resume takes the newest intact one instead, and says why.
    assert Checkpointer(r, ONE, 3).latest() == "step_00000002"
    assert "step_00000003 is damaged" in capsys.readouterr().err


@pytest.mark.parametrize(
    "run,step,name",
    [
        ("zero0", 3, "mp_rank_00_model_states.pt"),
        ("zero2", 2, "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ],
)
def test_resume_runs_nothing_from_a_crafted_deepspeed_file(
    runs, tiny_tokens, tmp_path, run, step, name
):
    """Before: DeepSpeed's engine unpickled it with weights_only=False and the payload ran."""
    r = copy(runs, run, tmp_path)
    marker = tmp_path / "MARKER"
    plant_pickle(step_folder(r, step) / name, marker)  # its hash updated in meta.json too
    extra = ["deepspeed.zero_stage=2", "train.bf16=true"] if run == "zero2" else []
    p = train(base(tiny_tokens, r, step + 1, *extra), check=False)
    assert p.returncode == 2  # one line saying why, no traceback
    assert f"{step_folder(r, step) / name}: holds objects other than tensors" in p.stderr
    assert "Traceback" not in p.stderr
    assert not marker.exists()


def test_a_crafted_rank_state_file_runs_nothing(runs, tmp_path):
    r = copy(runs, "zero0", tmp_path)
    marker = tmp_path / "MARKER"
    f = step_folder(r, 3) / "rank_00000.pt"
    plant_pickle(f, marker)
    with pytest.raises(CheckpointError, match=f"{f}: holds objects other than tensors"):
        Checkpointer(r, ONE, 3).load_streams("step_00000003")
    assert not marker.exists()


def test_every_checkpoint_tool_runs_nothing_from_a_crafted_file(runs, tmp_path, capsys):
    from tools.convert import main as convert_main
    from tools.convert_release import make_release
    from tools.convert_universal import make_universal
    from train.release import Release, ReleaseError

    marker = tmp_path / "MARKER"
    z0, z2 = copy(runs, "zero0", tmp_path), copy(runs, "zero2", tmp_path)
    rel = tmp_path / "rel"
    make_release(z0, rel, log=lambda *a, **k: None)  # from the intact checkpoint
    plant_pickle(step_folder(z0, 3) / "mp_rank_00_model_states.pt", marker)
    plant_pickle(step_folder(z2, 2) / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", marker)
    for call in (
        lambda: make_release(z0, tmp_path / "out0", log=lambda *a, **k: None),
        lambda: make_release(z2, tmp_path / "out2", log=lambda *a, **k: None),
        lambda: make_universal(z2, log=lambda *a, **k: None),
    ):
        with pytest.raises(CheckpointError, match="holds objects other than tensors"):
            call()
    assert not (step_folder(z2, 2) / "universal").exists()
    # The release tools (hf, import, train.init_from) read safetensors only: a pickle in its
    # place is refused as unreadable, naming it.
    weights = rel / "model.safetensors"
    plant_pickle(weights, marker)
    with pytest.raises(ReleaseError, match="model.safetensors"):
        Release(rel).state_dict()  # what train.init_from reads
    for argv in (["hf", str(rel), str(tmp_path / "hf")], ["import", str(rel), str(tmp_path / "x")]):
        assert convert_main(argv) == 2
        assert "model.safetensors" in capsys.readouterr().err
    assert not marker.exists()


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(runs, tiny_tokens, tmp_path):
    """Before: torch's 'PytorchStreamReader ... central directory', naming no file, at every start."""
    r = copy(runs, "zero0", tmp_path)
    bad = step_folder(r, 3) / "mp_rank_00_model_states.pt"
    bad.write_bytes(bad.read_bytes()[:100_000])
    p = train(base(tiny_tokens, r, 4, "train.ckpt_every=1", "train.keep_last=3"))
    assert f"resuming from {step_folder(r, 2)}" in p.stderr and str(bad) in p.stderr
    assert "steps 2->4" in p.stdout
    # Resumed exactly: step 3 again, the same loss as the uninterrupted run's step 3.
    assert metrics(r)[3]["train/loss"] == metrics(runs["zero0"])[3]["train/loss"]
    assert (r / "checkpoints" / "step_00000003.damaged").is_dir()
    assert verify_folder(step_folder(r, 3)) == [] and verify_folder(step_folder(r, 4)) == []


@pytest.mark.parametrize("content", ["", "step_000", "\x00\x00\x00"])
def test_a_truncated_latest_pointer_falls_back_to_the_newest_intact(
    runs, tmp_path, capsys, content
):
    r = copy(runs, "zero0", tmp_path)
    (r / "checkpoints" / "latest").write_text(content)
    assert Checkpointer(r, ONE, 3).latest() == "step_00000003"
    assert "checkpoints/latest is unreadable" in capsys.readouterr().err
    assert (r / "checkpoints" / "latest").read_text().strip() == "step_00000003"


def test_damaged_checkpoints_are_set_aside_never_silently_step_0(runs, tmp_path, capsys):
    r = copy(runs, "zero0", tmp_path)
    # A deletion cut short by a kill, as the old keep-last could leave it: meta.json still there.
    (step_folder(r, 3) / "rank_00000.pt").unlink()
    (step_folder(r, 3) / "vocab_layout.json").unlink()
    # A flipped byte inside the model states of step 2 (sizes agree, the hash does not).
    f = step_folder(r, 2) / "mp_rank_00_model_states.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    ck = Checkpointer(r, ONE, 3)
    assert ck.latest() == "step_00000001"
    err = capsys.readouterr().err
    assert "rank_00000.pt: missing" in err and "mp_rank_00_model_states.pt: SHA-256 differs" in err
    assert ck.complete_steps() == [1]
    # Nothing intact left: an error naming every damaged checkpoint, not a fresh start.
    (step_folder(r, 1) / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no intact checkpoint.*step_00000001 is damaged"):
        Checkpointer(r, ONE, 3).latest()


def test_a_deletion_cut_short_never_leaves_a_folder_that_looks_complete(runs, tmp_path):
    r = copy(runs, "zero0", tmp_path)
    # A kill during keep-last deletion, after its first step (the rename): some files are gone.
    doomed = step_folder(r, 1).with_name("step_00000001.deleting")
    step_folder(r, 1).rename(doomed)
    (doomed / "mp_rank_00_model_states.pt").unlink()
    ck = Checkpointer(r, ONE, 3)
    assert ck.complete_steps() == [2, 3]
    assert not doomed.exists()  # removed when the run started again
    remove_checkpoint(step_folder(r, 2))
    assert not step_folder(r, 2).exists()
    assert sorted(d.name for d in (r / "checkpoints").iterdir()) == ["latest", "step_00000003"]


def test_a_save_past_a_file_size_limit_says_so_and_keeps_the_previous_checkpoint(
    runs, tiny_tokens, tmp_path
):
    """Before: 'RuntimeError: basic_ios::clear: iostream error' (or 'unexpected pos ...'), a
    traceback naming no file. A full disk reaches torch the same way (checked with a tmpfs)."""
    r = copy(runs, "zero0", tmp_path)
    args = base(tiny_tokens, r, 5, "train.ckpt_every=1", "train.keep_last=3")
    p = train(args, check=False, file_size_limit=1 << 20)  # the model states are ~3.6 MB
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    folder = step_folder(r, 4)
    assert (
        f"checkpoint {folder} could not be written: a file reached the file-size limit of this "
        "process (ulimit -f: 1048576 bytes)"
    ) in p.stderr
    assert f"{r / 'checkpoints' / 'latest'} still names step_00000003, which is intact" in p.stderr
    assert (r / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert verify_folder(step_folder(r, 3)) == []


def test_metrics_the_disk_refuses_stop_the_run_with_one_line_naming_the_file(
    runs, tiny_tokens, tmp_path
):
    """A full (or read-only) disk met outside a checkpoint save: before, two chained tracebacks
    (the metrics' flush, then their close) naming no file, exit code 1."""
    r = copy(runs, "zero0", tmp_path)
    limit = (r / "metrics.jsonl").stat().st_size + 100  # the next record does not fit
    args = base(tiny_tokens, r, 6, "train.ckpt_every=0", "train.allow_config_change=true")
    p = train(args, check=False, file_size_limit=limit)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert (
        f"earlyfuse-train: stopped: {r / 'metrics.jsonl'}: File too large; "
        f"{r / 'checkpoints' / 'latest'} names step_00000003: the same command resumes from it"
    ) in p.stderr


def test_a_save_on_a_full_disk_says_so_and_keeps_the_previous_checkpoint(
    runs, tiny_tokens, small_tmpfs
):
    """A real ENOSPC: the run folder on a file system with room for what it holds and less than
    one more checkpoint."""
    r = small_tmpfs / "zero0"
    shutil.copytree(runs["zero0"], r)
    used = sum(f.stat().st_size for f in r.rglob("*") if f.is_file())
    checkpoint = sum(f.stat().st_size for f in step_folder(r, 3).rglob("*") if f.is_file())
    size_kb = (used + checkpoint // 2) // 1024
    subprocess.run(["mount", "-o", f"remount,size={size_kb}k", str(small_tmpfs)], check=True)
    p = train(base(tiny_tokens, r, 5, "train.ckpt_every=1", "train.keep_last=3"), check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert "could not be written: the disk is full" in p.stderr, p.stderr[-3000:]
    assert f"{r / 'checkpoints' / 'latest'} still names step_00000003, which is intact" in p.stderr
    assert (r / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert verify_folder(step_folder(r, 3)) == []


def test_a_folder_that_cannot_be_written_is_named():
    """Before: 'Parent directory .../step_00000008 does not exist' from torch."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        blocker = Path(tmp) / "step_00000008"
        blocker.write_text("a file where the checkpoint's folder should be")
        try:
            torch.save({"x": torch.zeros(3)}, blocker / "rank_00000.pt")
        except (OSError, RuntimeError) as e:
            why = describe_write_failure(blocker, e)
        assert why.startswith(f"{blocker} cannot be written") and "not a folder" in why


def test_a_damaged_only_checkpoint_stays_reported_damaged_and_stops_with_one_line(
    runs, tiny_tokens, tmp_path
):
    """keep_last=1: the only checkpoint damaged. Before: set aside, then the next start said
    'step_00000003 is missing', and either start ended in a traceback with exit code 1."""
    r = copy(runs, "zero0", tmp_path)
    for step in (1, 2):
        remove_checkpoint(step_folder(r, step))
    (step_folder(r, 3) / "rank_00000.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="step_00000003 is damaged .*rank_00000.pt: 0 bytes"):
        Checkpointer(r, ONE, 1).latest()
    p = train(base(tiny_tokens, r, 4, "train.keep_last=1"), check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "no intact checkpoint to resume from (step_00000003 is damaged" in p.stderr
    assert (
        "rank_00000.pt: 0 bytes" in p.stderr and "set it aside as step_00000003.damaged" in p.stderr
    )
    assert "is missing" not in p.stderr


def test_a_resume_under_another_zero_stage_is_refused_with_one_line(runs, tiny_tokens, tmp_path):
    """Before: Hydra's report of a ValueError, a traceback and exit code 1."""
    r = copy(runs, "zero2", tmp_path)
    p = train(base(tiny_tokens, r, 3, "deepspeed.zero_stage=1", "train.bf16=true"), check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    said = (  # and the way to the new stage: a release, then a new run from it
        f"earlyfuse-train: {step_folder(r, 2)} was written with ZeRO stage 2; this run uses 1. "
        "Resume with deepspeed.zero_stage=2, or, to go on under ZeRO 1, release its weights "
        f"(`earlyfuse-convert release {r} OUT`) and start a new run from them with "
        "train.init_from=OUT (the optimizer starts again)."
    )
    assert said in p.stderr.splitlines(), p.stderr[-2000:]


def test_a_rank_state_of_another_format_is_refused_with_one_line(runs, tiny_tokens, tmp_path):
    """The task's state of an older version (the document counter's memory without its token
    totals): before, a ValueError from deep inside the counter, a traceback and exit code 1."""
    from train.checkpoint import file_manifest

    r = copy(runs, "zero0", tmp_path)
    folder = step_folder(r, 3)
    own = torch.load(folder / "rank_00000.pt", weights_only=True)
    counter = own["task"]["documents"]
    assert counter["previous"] and all(len(entry) == 4 for entry in counter["previous"])
    counter["previous"] = [entry[:3] for entry in counter["previous"]]
    torch.save(own, folder / "rank_00000.pt")
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"] |= file_manifest(folder, ["rank_00000.pt"])
    (folder / "meta.json").write_text(json.dumps(meta))
    p = train(base(tiny_tokens, r, 4), check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert (
        f"earlyfuse-train: {folder}: the task's state is not in the format this code writes"
        in p.stderr
    )
    assert "or start the run over" in p.stderr


def test_a_kill_between_the_first_meta_and_latest_resumes_from_it_with_a_warning(
    runs, tmp_path, capsys, monkeypatch
):
    """Before: no `latest` meant step 0, and the complete checkpoint was deleted without a word."""
    r = copy(runs, "zero0", tmp_path)
    (r / "checkpoints" / "latest").unlink()
    for step in (2, 3):
        remove_checkpoint(step_folder(r, step))
    shutil.copytree(step_folder(r, 1), step_folder(r, 2))  # a save of step 2 cut short ...
    (step_folder(r, 2) / "meta.json").unlink()  # ... before its meta.json
    ck = Checkpointer(r, ONE, 3)
    ck.clean_partial()
    assert ck.latest() == "step_00000001"
    err = capsys.readouterr().err
    assert "latest is missing but" in err and "step_00000001 is complete" in err
    assert f"removing {step_folder(r, 2)}: newer than latest" in err
    assert not step_folder(r, 2).exists()
    # the same kill at a later checkpoint: latest names the one before. It was removed, and the
    # warning blamed a rollback: it is resumed from, as the first one is
    r = copy(runs, "zero0", tmp_path / "later")
    (r / "checkpoints" / "latest").write_text("step_00000002\n")
    ck = Checkpointer(r, ONE, 3)
    ck.clean_partial()
    assert ck.latest() == "step_00000003" and step_folder(r, 3).exists()
    said = f"{step_folder(r, 3)} is complete and newer than step_00000002, which latest names"
    assert said in capsys.readouterr().err
    # ... but one whose files came back empty after a power loss is set aside as damaged
    r = copy(runs, "zero0", tmp_path / "lost")
    (r / "checkpoints" / "latest").write_text("step_00000002\n")
    (step_folder(r, 3) / "mp_rank_00_model_states.pt").write_bytes(b"")
    ck = Checkpointer(r, ONE, 3)
    ck.clean_partial()
    said = f"{step_folder(r, 3)} is newer than step_00000002 and damaged ("
    assert said in capsys.readouterr().err and ck.latest() == "step_00000002"
    assert (r / "checkpoints" / "step_00000003.damaged" / "DAMAGED.txt").is_file()
    # a rollback's abandoned folders never look like such a save, even killed before latest
    # moved back: the next start goes back to where the rollback was going
    r = copy(runs, "zero0", tmp_path / "rewound")
    Checkpointer(r, ONE, 3).rewind(1, {"skip_batches": 4})
    # what the rollback does stays said until a checkpoint holds it
    left = ["latest", "rollback.json", "step_00000001"]
    assert sorted(p.name for p in (r / "checkpoints").iterdir()) == left
    assert Checkpointer(r, ONE, 3).pending_rollback() == {"skip_batches": 4, "to_step": 1}
    import train.checkpoint as checkpoint

    r = copy(runs, "zero0", tmp_path / "rewind_killed")
    removed: list = []

    def remove_then_die(folder):  # the kill comes after the first abandoned folder is gone
        if removed:
            sys.exit("killed")
        removed.append(folder)
        original(folder)

    original = checkpoint.remove_checkpoint
    with monkeypatch.context() as patched:
        patched.setattr("train.checkpoint.remove_checkpoint", remove_then_die)
        with pytest.raises(SystemExit):
            Checkpointer(r, ONE, 3).rewind(1)
    assert (r / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    capsys.readouterr()
    ck = Checkpointer(r, ONE, 3)
    ck.clean_partial()
    assert ck.latest() == "step_00000001"
    assert "finishing a rollback to step_00000001" in capsys.readouterr().err
    assert sorted(p.name for p in (r / "checkpoints").iterdir()) == left
    ck = Checkpointer(r, ONE, 3)  # finished: a later start says nothing of it
    ck.clean_partial()
    assert ck.latest() == "step_00000001" and "finishing" not in capsys.readouterr().err
    # a save past the rollback, complete, killed before `latest` moved: taken, and it holds the
    # rollback (the record goes); never "finished" as one the rollback abandons
    shutil.copytree(step_folder(copy(runs, "zero0", tmp_path / "donor"), 3), step_folder(r, 3))
    ck = Checkpointer(r, ONE, 3)
    ck.clean_partial()
    assert ck.latest() == "step_00000003" and "finishing" not in capsys.readouterr().err
    assert ck.pending_rollback() is None


def test_a_save_syncs_its_files_to_disk_before_meta_and_latest(tmp_path, monkeypatch):
    """meta.json declares a checkpoint complete: after a node's crash or a power loss its files
    came back empty when only meta.json and latest had been synced. (The engine here writes one
    file as DeepSpeed's would: what is checked is the order of the save's own steps.)"""
    import os

    class Engine:
        def save_checkpoint(self, save_dir, tag, client_state, save_latest):
            (Path(save_dir) / tag).mkdir(parents=True)
            (Path(save_dir) / tag / "mp_rank_00_model_states.pt").write_bytes(b"x" * 10)

    seen = []
    monkeypatch.setattr(
        os, "sync", lambda: seen.append(sorted(p.name for p in tmp_path.rglob("*")))
    )
    tag = Checkpointer(tmp_path / "run", ONE, 3).save(
        Engine(), 1, client={}, own={}, meta={"world_size": 1}, files={"config.yaml": "a: 1\n"}
    )
    assert tag == "step_00000001" and len(seen) == 1
    assert "mp_rank_00_model_states.pt" in seen[0] and "rank_00000.pt" in seen[0]
    assert "meta.json" not in seen[0] and "latest" not in seen[0]  # synced before both
    meta = json.loads((tmp_path / "run" / "checkpoints" / tag / "meta.json").read_text())
    assert "mp_rank_00_model_states.pt" in meta["files"]


def test_a_rank_lost_mid_save_is_not_said_as_a_write_failure(tmp_path):
    """Another rank killed while a checkpoint is written: gloo's error reached the user as
    "checkpoint ... could not be written: RuntimeError: ... Connection reset by peer ... GLHF",
    with advice for a full disk; it goes on as a lost rank (train/app.py says it so)."""
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer.")

    class Engine:
        def save_checkpoint(self, save_dir, tag, client_state, save_latest):
            raise lost

    two = DistInfo(0, 2, 0, torch.device("cpu"))
    with pytest.raises(RuntimeError) as raised:
        Checkpointer(tmp_path / "run", two, 3).save(
            Engine(), 1, client={}, own={}, meta={}, files={}
        )
    assert raised.value is lost
    with pytest.raises(CheckpointWriteError):  # alone, the same error is the save's own
        Checkpointer(tmp_path / "run", ONE, 3).save(
            Engine(), 1, client={}, own={}, meta={}, files={}
        )


def test_a_damaged_checkpoint_that_cannot_be_set_aside_says_both(runs, tmp_path, monkeypatch):
    """checkpoints/ not writable for this user: before, a PermissionError traceback from the
    rename, and the damage itself was never said."""
    import os

    import train.checkpoint

    r = copy(runs, "zero0", tmp_path)
    with open(step_folder(r, 3) / "mp_rank_00_model_states.pt", "r+b") as f:
        f.truncate(1000)

    def refused(src, dst):
        raise PermissionError(13, "Permission denied", str(src), None, str(dst))

    monkeypatch.setattr(train.checkpoint.os, "replace", refused)
    with pytest.raises(CheckpointError) as caught:
        Checkpointer(r, ONE, 3).clean_partial()
    said = str(caught.value)
    assert f"{step_folder(r, 3)} is damaged (" in said and "1000 bytes" in said
    assert "cannot be set aside as step_00000003.damaged: Permission denied" in said
    assert os.path.isdir(step_folder(r, 3))
