"""`earlyfuse-convert release` and `import` on real debug runs (DeepSpeed on CPU): a ZeRO-0 and a
ZeRO-3 checkpoint become releases whose model gives the checkpoint's own logits and the run's own
validation loss; a bf16 ZeRO-1 release holds the fp32 master weights; a vtok run releases its
visual tokenizer; a run started from a release (`train.init_from`, ZeRO 2) sees exactly the
release's weights; truncated, corrupted and pickled-object files are clear errors naming the file."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from factories import plant_pickle
from trainrun import metrics, train

from tools.convert import main as convert_main
from tools.convert_deepspeed import CheckpointError, load_run_config
from tools.convert_release import make_release
from train.checkpoint import verify_folder
from train.release import Release, ReleaseError

SOURCES = {"scenes": 0.4, "text": 0.4, "code": 0.2}


def sources(tokens) -> str:
    return (
        "["
        + ",".join(
            f"{{name: {s}, shards: [{tokens / s}], weight: {w}}}" for s, w in SOURCES.items()
        )
        + "]"
    )


def base(tokens, run_dir, steps, *extra):
    val = f"[{{name: heldout, shards: [{tokens / 'scenes'}], weight: 1.0}}]"
    return [
        "experiment=debug",
        f"data.sources={sources(tokens)}",
        f"data.validation={val}",
        "train.eval_batches=2",
        f"run_dir={run_dir}",
        f"train.steps={steps}",
        "train.micro_batch=2",
        *extra,
    ]


def quiet(*_a, **_k):
    pass


@pytest.fixture(scope="module")
def runs(tiny_tokens, tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    out = {}
    for stage in (0, 3):
        train(base(tiny_tokens, root / f"zero{stage}", 3, f"deepspeed.zero_stage={stage}"))
        out[stage] = root / f"zero{stage}"
    return out


def first_batch(cfg):
    from train.dist import DistInfo
    from train.names import MODEL_INPUTS
    from train.tasks.lm import LMTask

    batch = next(iter(LMTask(cfg, DistInfo(0, 1, 0, torch.device("cpu"))).batches()))
    return {k: batch[k] for k in MODEL_INPUTS}


def val_loss(model, cfg, world_size: int = 1) -> float:
    """The run's final evaluation, recomputed: the same held-out pass, each rank's share of its
    batches and the same sums as LMTask.evaluate."""
    from data.loader.heldout import HeldoutPass, RankShare
    from data.token_docs import source_tables
    from train.names import MODEL_INPUTS

    ce = cnt = 0.0
    tables = source_tables(cfg.data.validation)
    with torch.no_grad():
        for rank in range(world_size):
            heldout = HeldoutPass(
                tables,
                seq_len=cfg.data.seq_len,
                batch_rows=cfg.train.micro_batch,
                whole_documents=cfg.data.whole_documents,
            )
            share = RankShare(
                heldout, rank=rank, world_size=world_size, limit=cfg.train.eval_batches
            )
            for part in share:
                if part is None:
                    continue
                b = heldout.tensors(part)
                r = model(**{k: b[k] for k in MODEL_INPUTS})
                ce, cnt = ce + r.ce_sum.double().sum().item(), cnt + r.count.double().sum().item()
    return ce / cnt


def test_zero0_release_gives_the_checkpoints_logits(runs, tmp_path, capsys):
    run, out = runs[0], tmp_path / "rel"
    assert convert_main(["release", str(run), str(out)]) == 0
    assert "shapes match the model config" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert (
        cfg["format"] == "earlyfuse-release" and cfg["task"] == "lm" and cfg["dtype"] == "float32"
    )
    assert cfg["source"]["step"] == 3 and cfg["source"]["zero_stage"] == 0 and cfg["tensors"] == 25
    assert set(cfg["files"]) == {
        "model.safetensors",
        "vocab_layout.json",
        "tokenizer.json",
        "visual_tokenizer/config.json",
        "visual_tokenizer/model.safetensors",
    }
    assert cfg["tokenize"]["image_max_pixels"] == 32 * 32  # from the token manifest
    rel = Release(out)
    model = rel.build_model()
    assert model.cfg.vocab_size == rel.layout.size
    # The reference: the module DeepSpeed saved, read directly.
    module = torch.load(
        run / "checkpoints" / "step_00000003" / "mp_rank_00_model_states.pt", weights_only=True
    )["module"]
    ref = load_run_config(run / "config.yaml").model.with_layout(rel.layout).build()
    ref.load_state_dict(module)
    batch = first_batch(load_run_config(run / "config.yaml"))
    ids = batch["input_ids"]
    with torch.no_grad():
        assert torch.equal(
            model(ids, doc_ids=batch["doc_ids"]), ref.eval()(ids, doc_ids=batch["doc_ids"])
        )
    assert rel.text_tokenizer().decode(rel.text_tokenizer().encode("héllo ✓")) == "héllo ✓"
    assert rel.visual_tokenizer().cfg.levels == list(rel.layout.fsq_levels)
    # The same checkpoint gives the same bytes
    again = make_release(run, tmp_path / "again", log=quiet)
    assert again["files"]["model.safetensors"] == cfg["files"]["model.safetensors"]
    # bf16: the same tensors rounded, half the bytes.
    make_release(run, tmp_path / "bf16", dtype="bf16", log=quiet)
    half = Release(tmp_path / "bf16").state_dict(dtype=None)
    full = rel.state_dict()
    assert all(
        half[k].dtype == torch.bfloat16 and torch.equal(half[k], full[k].bfloat16()) for k in full
    )


def test_a_zero3_checkpoint_is_refused_on_another_world_size(runs, tmp_path):
    """Its universal conversion does not restore the optimizer as saved: a resume on another
    world size is refused with what to do instead, and so is the conversion itself."""
    from tools.convert_deepspeed import CheckpointError
    from tools.convert_universal import make_universal
    from train.checkpoint import Checkpointer
    from train.dist import DistInfo

    two = DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    run = tmp_path / "zero3"
    shutil.copytree(runs[3], run)
    checkpointer = Checkpointer(run, two, 2)
    with pytest.raises(ValueError, match=r"resumes only on the world size that wrote it"):
        checkpointer.check_compatible(checkpointer.latest(), 3)
    with pytest.raises(CheckpointError, match=r"ZeRO-3 checkpoint resumes only on the world size"):
        make_universal(run, log=quiet)
    assert not list(run.rglob("universal"))
    same = Checkpointer(run, dataclasses.replace(two, world_size=1), 2)
    assert same.check_compatible(same.latest(), 3)["zero_stage"] == 3


def test_zero3_release_reproduces_the_runs_validation_loss(runs, tmp_path):
    run = runs[3]
    cfg = make_release(run, tmp_path / "rel", log=quiet)
    assert cfg["source"]["zero_stage"] == 3
    model = Release(tmp_path / "rel").build_model()
    final = json.loads((run / "final.json").read_text())
    # The engine evaluated with the same weights the checkpoint holds; fp32 on CPU: (near) bit-identical.
    assert abs(val_loss(model, load_run_config(run / "config.yaml")) - final["val/loss"]) < 1e-6
    # Stages differ in arithmetic order only: the two runs' weights agree closely.
    make_release(runs[0], tmp_path / "z0", log=quiet)
    z0 = Release(tmp_path / "z0").state_dict()
    z3 = Release(tmp_path / "rel").state_dict()
    assert max((z0[k] - z3[k]).abs().max().item() for k in z0) < 1e-3


@pytest.mark.slow
def test_two_rank_zero2_checkpoint_releases_on_one_process(tiny_tokens, tmp_path):
    run = tmp_path / "w2"
    train(base(tiny_tokens, run, 3, "deepspeed.zero_stage=2"), nproc=2)
    cfg = make_release(run, tmp_path / "rel", log=quiet)
    assert cfg["source"]["world_size"] == 2
    model = Release(tmp_path / "rel").build_model()
    final = json.loads((run / "final.json").read_text())
    assert (
        abs(val_loss(model, load_run_config(run / "config.yaml"), world_size=2) - final["val/loss"])
        < 1e-6
    )


def test_bf16_zero1_release_holds_the_fp32_master_weights(tiny_tokens, tmp_path):
    """bf16 at ZeRO 1 is DeepSpeed's BF16_Optimizer (files zero_to_fp32 cannot read): the release
    holds its fp32 masters, which round to exactly the bf16 weights the module trained with."""
    run = tmp_path / "bf16"
    train(
        base(tiny_tokens, run, 2, "deepspeed.zero_stage=1", "train.bf16=true", "data.validation=[]")
    )
    make_release(run, tmp_path / "rel", log=quiet)
    masters = Release(tmp_path / "rel").state_dict()
    module = torch.load(
        run / "checkpoints" / "step_00000002" / "mp_rank_00_model_states.pt", weights_only=True
    )["module"]
    assert module.keys() == masters.keys()
    assert all(
        module[k].dtype == torch.bfloat16 and torch.equal(masters[k].bfloat16(), module[k])
        for k in module
    )
    assert any(
        not torch.equal(masters[k], module[k].float()) for k in module
    )  # more precise than bf16


def test_import_starts_a_run_with_exactly_the_release_weights(runs, tiny_tokens, tmp_path, capsys):
    rel = tmp_path / "rel"
    make_release(runs[0], rel, log=quiet)
    new = tmp_path / "new"
    args = base(tiny_tokens, new, 1, "deepspeed.zero_stage=2", "optim.lr=0.0")
    assert convert_main(["import", str(rel), str(new), *args]) == 0
    out = capsys.readouterr().out
    assert "fits the release" in out and f"train.init_from={rel.resolve()}" in out
    assert "\n  earlyfuse-train " in out
    # A run over ranks of sequence parallelism starts under a launcher with that many
    assert convert_main(["import", str(rel), str(new), *args, "train.sequence_parallel=2"]) == 0
    assert "\n  earlyfuse-torchrun --nproc_per_node 2 -m train.app " in capsys.readouterr().out
    # A run whose shapes differ is refused before it starts, naming the tensor and the field.
    assert convert_main(["import", str(rel), str(new), *args, "model.dim=32"]) == 2
    err = capsys.readouterr().err
    assert "tok_embeddings.weight" in err and "model.dim: release 64, run 32" in err
    # RUN_DIR and RELEASE name these two: another value given as an override was dropped unsaid
    for override, said in (
        (f"run_dir={tmp_path / 'other'}", f"run_dir is this command's RUN_DIR ({new})"),
        (
            f"train.init_from={tmp_path}",
            f"train.init_from is this command's RELEASE ({rel.resolve()})",
        ),
    ):
        assert convert_main(["import", str(rel), str(new), *args, override]) == 2
        assert f"{override}: {said}; give it there, not as an override" in capsys.readouterr().err

    p = train([*args, f"train.init_from={rel}"])
    assert "initialised from release" in p.stdout
    cfg = load_run_config(new / "config.yaml")
    model = Release(rel).build_model().train()
    with torch.no_grad():
        loss = model(**first_batch(cfg)).loss.item()
    assert metrics(new)[1]["train/loss"] == pytest.approx(loss, abs=1e-6)
    # lr 0: the run's checkpoint, released again, is the release bit for bit.
    make_release(new, tmp_path / "again", log=quiet)
    again = Release(tmp_path / "again").state_dict()
    orig = Release(rel).state_dict()
    assert all(torch.equal(again[k], orig[k]) for k in orig)
    # The run now has a checkpoint: import refuses, a rerun resumes and ignores init_from.
    assert convert_main(["import", str(rel), str(new)]) == 2
    assert "already has a checkpoint" in capsys.readouterr().err
    # Data in a config folder of the user's (own_data.md's way): --config-dir, as for training.
    mine = tmp_path / "my-configs"
    (mine / "data").mkdir(parents=True)
    srcs = "\n".join(f"  - {{name: {s}, shards: [{tiny_tokens / s}]}}" for s in ("text", "code"))
    (mine / "data" / "mine.yaml").write_text(f"defaults:\n  - demo\nsources:\n{srcs}\n")
    argv = ["import", "--config-dir", str(mine), str(rel), str(tmp_path / "other")]
    assert convert_main([*argv, "experiment=debug", "data=mine"]) == 0
    out = capsys.readouterr().out
    assert "fits the release" in out and f"earlyfuse-train --config-dir {mine} " in out
    # ... given after RELEASE RUN_DIR, between overrides, as earlyfuse-train takes it anywhere
    late = ["import", str(rel), str(tmp_path / "other"), "experiment=debug"]
    assert convert_main([*late, "--config-dir", str(mine), "data=mine"]) == 0
    assert capsys.readouterr().out == out
    with pytest.raises(SystemExit):
        convert_main([*late, "--config-dirr", str(mine), "data=mine"])
    assert "unrecognized arguments: --config-dirr" in capsys.readouterr().err
    # Override mistakes are said as earlyfuse-train says them, one line each
    for override, said in (
        ("optim.lrr=1", "unknown config key(s): optim.lrr (did you mean optim.lr?)"),
        ("data=theirs", "data=theirs: config group data has no option 'theirs' (there are: "),
        ("train.steps=abc", "override train.steps=abc: Value 'abc' of type 'str' could not be"),
    ):
        assert convert_main([*argv, "experiment=debug", override]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"earlyfuse-convert import: error: {said}"), err
        assert err.count("\n") == 1, err


def test_an_init_from_that_is_no_release_is_a_config_error(tmp_path):
    """earlyfuse-train train.init_from=/nowhere: a ConfigError, which it prints in one line with
    exit code 2 (before: the ReleaseError's traceback, exit code 1)."""
    from train.config import RunConfig
    from train.config_check import ConfigError
    from train.init_from import init_from_release

    cfg = RunConfig(run_dir=str(tmp_path / "run"))
    cfg.train.init_from = str(tmp_path / "nowhere")
    said = re.escape(f"train.init_from: {tmp_path}/nowhere: not a folder")
    with pytest.raises(ConfigError, match=f"^{said}"):
        init_from_release(None, cfg, None)


def test_init_from_continues_at_longer_rows_with_a_larger_rope_base(runs, tiny_tokens, tmp_path):
    """A long-context stage starts from a release with ``train.init_from`` (weights only, a new
    optimizer): rows 4x the release's (256 -> 1024), its documents kept whole, and a 10x RoPE
    base. The base changes no shape, so the release loads and the difference is reported; the
    first step's loss is the release's weights under the new base on the longer rows, positions
    past the old row length included."""
    import dataclasses

    rel = tmp_path / "rel"
    make_release(runs[0], rel, log=quiet)
    new = tmp_path / "long"
    stage = ["data.seq_len=1024", "model.rope.theta=100000.0", "data.whole_documents=true"]
    p = train([*base(tiny_tokens, new, 1, "optim.lr=0.0", *stage), f"train.init_from={rel}"])
    assert "initialised from release" in p.stdout
    assert "model.rope.theta: release 10000.0, run 100000.0" in p.stdout
    assert "not raised" not in p.stdout
    cfg = load_run_config(new / "config.yaml")
    batch = first_batch(cfg)
    assert batch["input_ids"].shape[1] == 1024 and int(batch["position_ids"].max()) >= 256
    release = Release(rel)
    net = release.transformer_config
    longer = dataclasses.replace(net, rope=dataclasses.replace(net.rope, theta=100000.0))
    model = longer.build("cpu")
    model.load_state_dict(release.state_dict())
    model.train()
    with torch.no_grad():
        loss = model(**batch).loss.item()
        at_old_base = release.build_model().train()(**batch).loss.item()
    assert metrics(new)[1]["train/loss"] == pytest.approx(loss, abs=1e-6)
    assert abs(loss - at_old_base) > 1e-4  # the new base is the one in use


def test_init_from_at_longer_rows_says_when_the_rope_base_is_not_raised(
    runs, tiny_tokens, tmp_path
):
    """Rows 4x the release's with the base left as it was: the run goes on (a base may already be
    large enough) and says so in one line, which is all a forgotten ``model.rope.theta`` leaves."""
    rel = tmp_path / "rel"
    make_release(runs[0], rel, log=quiet)
    p = train(
        [*base(tiny_tokens, tmp_path / "same", 1, "data.seq_len=1024"), f"train.init_from={rel}"]
    )
    assert p.returncode == 0
    assert (
        "rows of 1024 tokens, 4x the release's 256, with model.rope.theta not raised (10000"
        in p.stdout
    )
    assert "other image or frame sizes" not in p.stdout  # its own data's


def test_init_from_data_of_other_image_sizes_says_so(runs, tiny_raw, tiny_tokenizers, tmp_path):
    """A long stage's data tokenized as the long-context guide said (--seq-len, --doc-budget,
    the tokenize command's default image and frame sizes): the model started on images up to
    64 times the area it trained on, and only earlyfuse-eval said so."""
    from data.tokenize.encoder import TokenizeOptions
    from data.tokenize.run import tokenize

    rel = tmp_path / "rel"
    make_release(runs[0], rel, log=quiet)
    other = TokenizeOptions(
        image_max_pixels=48 * 48, video_max_pixels=32 * 32, video_max_tokens=240
    )
    tokenize(tiny_raw, tmp_path / "tokens", rel, tiny_tokenizers[1], opts=other)
    p = train([*base(tmp_path / "tokens", tmp_path / "new", 1), f"train.init_from={rel}"])
    assert p.returncode == 0
    assert (
        "note: source scenes was tokenized at other image or frame sizes than the release's "
        "training data (image_max_pixels 2304, the training data's 1024)"
    ) in p.stdout
    assert (
        "--image-max-pixels 1024 --video-max-pixels 1024 --video-fps 4 (and this stage's"
        in p.stdout
    )


def test_an_edited_checkpoint_config_cannot_change_the_network_released(runs, tmp_path):
    """The config.yaml beside a checkpoint is a copy people may edit (paths after a move); the
    network released is the one meta.json recorded at the save, and a value edited is said."""
    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    saved = run / "checkpoints" / "step_00000003" / "config.yaml"
    cfg = yaml.safe_load(saved.read_text())
    theta = cfg["model"]["rope"]["theta"]
    cfg["model"]["rope"]["theta"] = theta * 50
    saved.write_text(yaml.safe_dump(cfg))
    lines: list[str] = []
    assert make_release(run, tmp_path / "rel", log=lines.append)["model"]["rope"]["theta"] == theta
    assert (
        f"note: {saved} says model.rope.theta: {theta * 50}, but the checkpoint trained with "
        f"{theta} (its meta.json): the trained value is used"
    ) in lines
    saved.unlink()
    with pytest.raises(CheckpointError, match="config.yaml: missing; copy there the config of"):
        make_release(run, tmp_path / "rel2", log=quiet)


def test_damaged_files_are_errors_naming_the_file(runs, tmp_path, capsys):
    rel = tmp_path / "rel"
    make_release(runs[0], rel, log=quiet)
    w = rel / "model.safetensors"
    data = w.read_bytes()
    # A flipped byte inside a tensor: safetensors loads it, the recorded sha256 does not match.
    w.write_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:])
    with pytest.raises(ReleaseError, match="model.safetensors: sha256 differs"):
        Release(rel).state_dict()
    # Truncated: unreadable even without the sha256 check.
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        ReleaseError, match=r"model.safetensors: unreadable, truncated or corrupted"
    ):
        Release(rel).state_dict(verify=False)
    assert convert_main(["import", str(rel), str(tmp_path / "x")]) == 2
    assert "model.safetensors" in capsys.readouterr().err

    for stage, name in (
        (0, "mp_rank_00_model_states.pt"),
        (3, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ):
        run = tmp_path / f"run{stage}"
        shutil.copytree(runs[stage], run)
        f = run / "checkpoints" / "step_00000003" / name
        f.write_bytes(f.read_bytes()[:5000])
        # Found by the sizes meta.json records, before anything is read.
        with pytest.raises(CheckpointError, match=f"{name}: 5000 bytes, the manifest says"):
            make_release(run, tmp_path / f"out{stage}", log=quiet)
        assert not (tmp_path / f"out{stage}").exists()
    # A pickled object of any other class is refused, not executed (even with its hash in
    # meta.json made to match).
    run = tmp_path / "run0"
    f = run / "checkpoints" / "step_00000003" / "mp_rank_00_model_states.pt"
    plant_pickle(f, tmp_path / "MARKER")
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        make_release(run, tmp_path / "out", log=quiet)
    assert not (tmp_path / "MARKER").exists()


def test_an_error_reading_a_run_in_training_says_the_run_is_live(runs, tmp_path, capsys):
    """A trainer writing a checkpoint every step and keeping one removed each checkpoint while
    it was read: the errors blamed the checkpoint ("missing", "damaged") or the disk. An error
    reading a run whose lock names a live process (here this one) says the run is training."""
    import os
    import socket

    from train.run_lock import LOCK_NAME, process_start

    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "start": process_start(os.getpid())}
    (run / LOCK_NAME).write_text(json.dumps({**me, "started": "now"}))
    assert convert_main(["release", str(run), str(tmp_path / "rel"), "--step", "9"]) == 2
    err = capsys.readouterr().err
    assert "no such checkpoint" in err and f"({run} is training now: pid {os.getpid()}" in err
    assert "convert a checkpoint it keeps with --step, or after the run)" in err
    # A lock a run left when it ended (emptied), or one naming a process that is gone: no word.
    for left in ("", json.dumps({**me, "start": -1})):
        (run / LOCK_NAME).write_text(left)
        assert convert_main(["release", str(run), str(tmp_path / "rel"), "--step", "9"]) == 2
        assert "training now" not in capsys.readouterr().err


def test_a_checkpoint_set_aside_or_not_finished_is_named_for_what_it_is(runs, tmp_path):
    """Before: latest naming a folder an earlier start set aside as damaged was "no such
    checkpoint" (the trainer says damaged, and why), and a folder without meta.json (a save in
    progress) "damaged"."""
    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    root = run / "checkpoints"
    shutil.copytree(root / "step_00000003", root / "step_00000002")
    (root / "step_00000002" / "meta.json").unlink()  # a save in progress
    (root / "step_00000003").rename(root / "step_00000003.damaged")
    (root / "step_00000003.damaged" / "DAMAGED.txt").write_text("rank_00000.pt: 0 bytes\n")
    with pytest.raises(CheckpointError) as said:
        make_release(run, tmp_path / "out", log=quiet)
    assert str(said.value) == (
        f"{root / 'latest'} names 'step_00000003': step_00000003 is damaged (rank_00000.pt: 0 "
        "bytes); an earlier start set it aside as step_00000003.damaged; complete steps: none"
    )
    with pytest.raises(CheckpointError, match="step_00000002: an incomplete checkpoint .no meta"):
        make_release(run, tmp_path / "out", step=2, log=quiet)
    for attempt in (2, 10):  # the newest note is the highest attempt's (10 sorted before 2)
        (root / f"step_00000003.damaged{attempt}").mkdir()
        (root / f"step_00000003.damaged{attempt}" / "DAMAGED.txt").write_text(f"attempt {attempt}")
    with pytest.raises(
        CheckpointError, match=r"damaged \(attempt 10\); .* as step_00000003.damaged10;"
    ):
        make_release(run, tmp_path / "out", log=quiet)


def test_a_release_starts_no_run_on_data_of_other_tokenizers(runs, tiny_tokens, tmp_path, capsys):
    """The release's fingerprints (text, layout, visual) against the tokenizers the run's data was
    made with: a visual tokenizer swapped under the same levels was accepted (only the layout and
    a text BPE file were compared), and any BPE for a release made with --no-tokenizers."""
    full, bare, new = tmp_path / "full", tmp_path / "bare", tmp_path / "new"
    make_release(runs[0], full, log=quiet)
    make_release(runs[0], bare, no_tokenizers=True, log=quiet)
    assert Release(bare).config["tokenizers"] == Release(full).config["tokenizers"]
    args = base(tiny_tokens, new, 1)
    assert convert_main(["import", str(bare), str(new), *args]) == 0
    assert "fits the release (layout, tokenizers, every tensor shape)" in capsys.readouterr().out
    config = json.loads((bare / "config.json").read_text())
    config["tokenizers"]["visual"] = "0" * 16  # another visual tokenizer, the same levels
    (bare / "config.json").write_text(json.dumps(config))
    assert convert_main(["import", str(bare), str(new), *args]) == 2
    err = capsys.readouterr().err
    assert "its visual tokenizer differs from those the run's token data was made with" in err


def test_a_zero_checkpoint_under_a_glob_character_is_named_with_the_way_out(runs, tmp_path):
    """DeepSpeed globs a ZeRO checkpoint's files: under br[a] it said the files were not there."""
    run = shutil.copytree(runs[3], tmp_path / "br[a]")
    with pytest.raises(CheckpointError, match=r"under a path holding \[ \] \* or \?: DeepSpeed"):
        make_release(run, tmp_path / "out", log=quiet)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "checkpoints").symlink_to(run / "checkpoints")  # the way out it names
    assert make_release(tmp_path / "plain", tmp_path / "out", log=quiet)["source"]["step"] == 3


def test_a_checkpoint_or_release_without_its_task_is_refused(runs, tmp_path):
    """Every save records the task in meta.json and every release in config.json: one without
    it was not written by this earlyfuse, and no task is assumed for it."""
    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    meta_path = run / "checkpoints" / "step_00000003" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["task"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"meta.json: missing or unreadable .*'task'"):
        make_release(run, tmp_path / "out", log=quiet)
    rel = tmp_path / "rel"
    make_release(runs[0], rel, log=quiet)
    config = json.loads((rel / "config.json").read_text())
    del config["task"]
    (rel / "config.json").write_text(json.dumps(config))
    with pytest.raises(ReleaseError, match=r"config.json: task None, expected 'lm' or 'vtok'"):
        Release(rel)
    # Without its files' record nothing would be checked: it was accepted without a word
    config["task"] = "lm"
    del config["files"]
    (rel / "config.json").write_text(json.dumps(config))
    with pytest.raises(ReleaseError, match=r"config.json: no 'files' record of the release's"):
        Release(rel)


def test_missing_tokenizers_and_bad_arguments_are_named(
    runs, tmp_path, tiny_tokens, tiny_tokenizers
):
    run = tmp_path / "moved"
    shutil.copytree(runs[0], run)
    for p in (run / "config.yaml", run / "checkpoints" / "step_00000003" / "config.yaml"):
        p.write_text(p.read_text().replace(str(tiny_tokens), "/nonexistent/tokens"))
    with pytest.raises(ReleaseError) as refused:  # the data's own problem comes first
        make_release(run, tmp_path / "a", log=quiet)
    said = str(refused.value)
    assert said.startswith(f"{run}: no tokenizers found through the run's data (source ")
    assert "/nonexistent/tokens" in said and "does not exist" in said and "--tokenizers DIR" in said
    # tokenizer.json + layout, no visual_tokenizer/, for a run whose scenes have images
    text_only, _ = tiny_tokenizers
    with pytest.raises(
        ReleaseError,
        match=r"not the tokenizers of the run.s tokens \(source scenes .*made with a visual tokenizer",
    ):
        make_release(runs[0], tmp_path / "b", tokenizers=text_only, log=quiet)
    partial = shutil.copytree(text_only, tmp_path / "with_part")
    (partial / "visual_tokenizer").mkdir()  # a visual tokenizer folder without its files
    with pytest.raises(ReleaseError, match="visual_tokenizer/model.safetensors"):
        make_release(run, tmp_path / "b", tokenizers=partial, log=quiet)
    cfg = make_release(run, tmp_path / "c", no_tokenizers=True, log=quiet)
    assert set(cfg["files"]) == {"model.safetensors", "vocab_layout.json"}
    with pytest.raises(ReleaseError, match="no tokenizer.json"):
        Release(tmp_path / "c").text_tokenizer()
    with pytest.raises(CheckpointError, match=r"complete steps: \[3\]"):
        make_release(run, tmp_path / "d", step=7, log=quiet)
    with pytest.raises(ReleaseError, match="exists and is not empty"):
        make_release(run, tmp_path / "c", no_tokenizers=True, log=quiet)


def test_a_folder_that_is_no_run_folder_is_named_with_what_to_give(runs, tmp_path):
    """A path that is not there, the checkpoints/ folder itself or one of its step folders are
    each named with what to give instead (the run folder, and the step); a step folder copied on its own releases as the
    message says: inside a checkpoints/ folder of its own, with --step."""
    step = runs[0] / "checkpoints" / "step_00000003"
    for given, said in (
        (tmp_path / "typo", "no such folder; give an earlyfuse-train run folder"),
        (
            runs[0] / "checkpoints",
            f"the checkpoints folder of a run; give the run folder ({runs[0]})",
        ),
        (step, f"one checkpoint of a run; give the run folder and its step ({runs[0]} --step 3)"),
    ):
        with pytest.raises(CheckpointError) as refused:
            make_release(given, tmp_path / "out", log=quiet)
        assert str(refused.value).startswith(f"{given}: {said}")
    assert "with --step N" not in str(refused.value)  # the step is named, not described
    shutil.copytree(step, tmp_path / "copied" / "checkpoints" / step.name)
    # no latest came with it, or an empty one: the step to name is said
    (tmp_path / "copied" / "checkpoints" / "step_00000009").mkdir()  # a save cut short: no meta
    latest = tmp_path / "copied" / "checkpoints" / "latest"
    for what in ("missing", "empty"):
        with pytest.raises(CheckpointError) as refused:
            make_release(tmp_path / "copied", tmp_path / "out", log=quiet)
        said = f"{latest}: {what}; name a checkpoint with --step (complete steps: [3])"
        assert str(refused.value) == said
        latest.write_text("")
    latest.write_text("step_00000099\n")  # latest names a step not there: latest is named
    with pytest.raises(CheckpointError) as refused:
        make_release(tmp_path / "copied", tmp_path / "out", log=quiet)
    assert str(refused.value) == (
        f"{latest} names 'step_00000099': no such checkpoint; complete steps: [3]"
    )
    with pytest.raises(CheckpointError) as refused:
        make_release(tmp_path / "copied", tmp_path / "out", step=-1, log=quiet)
    assert str(refused.value) == "--step -1: no such step; complete steps: [3]"
    cfg = make_release(tmp_path / "copied", tmp_path / "out", step=3, log=quiet)
    assert cfg["source"]["step"] == 3


def test_the_tokenizer_folder_is_found_through_any_source_or_every_try_named(tiny_tokens):
    """One lookup for training and releases: the tokenizers/ its first usable token source names
    (``TokenTable.layout_url``), else an error naming each place tried."""
    from pathlib import Path

    from data.loader import SourceConfig
    from tools.convert_release import find_tokenizers
    from train.config import RunConfig
    from train.tasks.lm import layout_of_data

    cfg = RunConfig()
    gone = SourceConfig(name="gone", shards=["/nonexistent/tokens/code"])
    cfg.data.sources = [gone, SourceConfig(name="code", shards=[str(tiny_tokens / "code")])]
    assert find_tokenizers(cfg, Path("run")) == tiny_tokens / "tokenizers"
    assert layout_of_data(cfg)[1] == tiny_tokens / "tokenizers"  # training's lookup
    cfg.data.sources = [gone]
    with pytest.raises(ReleaseError, match=r"data \(source gone: shard /nonexistent/tokens/code "):
        find_tokenizers(cfg, Path("run"))


def test_vtok_run_releases_its_visual_tokenizer(tiny_raw, tmp_path):
    from safetensors.torch import load_file

    from data.tokenize.visual import load_visual_tokenizer
    from data.vocab import VocabLayout

    run = tmp_path / "vtok"
    train(
        [
            "experiment=vtok_debug",
            f"vtok_data.raw=[{tiny_raw}]",
            f"run_dir={run}",
            "train.steps=2",
            "vtok_data.heldout_crops=16",
            "deepspeed.zero_stage=1",
        ]
    )
    cfg = make_release(run, tmp_path / "rel", log=quiet)
    assert cfg["task"] == "vtok" and set(cfg["files"]) == {
        "visual_tokenizer/config.json",
        "visual_tokenizer/model.safetensors",
    }
    a = load_file(str(tmp_path / "rel" / "visual_tokenizer" / "model.safetensors"))
    b = load_file(str(run / "visual_tokenizer" / "model.safetensors"))  # the run's own export
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    load_visual_tokenizer(tmp_path / "rel" / "visual_tokenizer", VocabLayout(text_size=10))


@pytest.mark.parametrize("version", [None, 0, 2])
def test_a_release_of_another_version_is_refused_by_name(debug_release, tmp_path, version):
    """Only the version this code writes is read: there is no older release format to accept."""
    rel = tmp_path / "rel"
    shutil.copytree(debug_release, rel)
    config = json.loads((rel / "config.json").read_text())
    if version is None:
        del config["version"]
    else:
        config["version"] = version
    (rel / "config.json").write_text(json.dumps(config))
    with pytest.raises(ReleaseError, match=rf"config.json: release version {version}, this"):
        Release(rel)


def test_a_saved_config_the_new_value_checks_refuse_still_reads_back(tmp_path):
    """A run that trained with train.keep_last=0 (kept as 1) and deepspeed.offload_optimizer at
    stage 0 (ignored), before earlyfuse-train refused them: its config.yaml still reads back, so
    that its checkpoints release; a value of the wrong type is still refused, naming the file."""
    from train.config import RunConfig

    saved = tmp_path / "config.yaml"
    saved.write_text("train: {keep_last: 0}\ndeepspeed: {zero_stage: 0, offload_optimizer: true}\n")
    cfg = load_run_config(saved)
    assert cfg.train.keep_last == 0 and cfg.deepspeed.offload_optimizer
    with pytest.raises(ValueError, match="keep_last 0"):  # a new run is still refused
        RunConfig(train=dataclasses.replace(cfg.train))
    saved.write_text("train: {keep_last: many}\n")
    with pytest.raises(CheckpointError, match=f"{saved}: not a readable run config"):
        load_run_config(saved)


def test_printed_overrides_read_back_as_the_values_they_print():
    """What ``earlyfuse-convert import`` prints is parsed by Hydra into the same values."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from tools.convert_import import hydra_value

    parser = OverridesParser.create()
    for value in (None, True, False, 3, 1e-05, 10000.0, [], [16, 24, 24], "swiglu"):
        assert parser.parse_override(f"model.x={hydra_value(value)}").value() == value


def test_a_releases_visual_tokenizer_is_checked_against_its_recorded_sha256(
    tiny_tokenizers, tmp_path
):
    """Release.visual_tokenizer (earlyfuse-generate's) and Release.state_dict of a vtok release
    (train.init_from's) load through data/tokenize/visual.py's loader, with the sha256 the
    release recorded: a changed byte that safetensors would load is refused, naming the file."""
    from safetensors.torch import load_file

    from tools.convert_release import write_release
    from train.release import FORMAT, VERSION

    out = tmp_path / "rel"
    config = {"format": FORMAT, "version": VERSION, "task": "vtok"}
    write_release(
        out, config, lambda f: shutil.copytree(tiny_tokenizers[1], f / "visual_tokenizer")
    )
    weights = out / "visual_tokenizer" / "model.safetensors"
    rel = Release(out)
    stored, state = load_file(str(weights)), rel.state_dict()
    assert stored.keys() == state.keys() and all(torch.equal(stored[k], state[k]) for k in state)
    data = bytearray(weights.read_bytes())
    data[-4] ^= 1  # the lowest bit of the last weight: safetensors loads it without complaint
    weights.write_bytes(bytes(data))
    for load in (rel.visual_tokenizer, rel.state_dict):
        with pytest.raises(
            ReleaseError, match="visual_tokenizer/model.safetensors: sha256 differs"
        ):
            load()
    rel.visual_tokenizer(verify=False)  # what state_dict(verify=True) uses once it has checked


def test_a_text_only_corpus_needs_no_visual_tokenizer_from_tokenize_to_generate(
    tiny_corpus, tiny_tokenizers, tiny_tokens, tmp_path, capsys
):
    """Before: tokenize required --visual-tokenizer whatever the corpus held. Now prose and code
    tokenize without one; a run over them (beside a source with images, made with one) trains,
    and its release carries the image source's visual tokenizer; a run over them alone gives a
    release that continues text and refuses images by name (a corpus with images is still
    refused without one: tests/test_data/test_tokenize.py)."""
    from data.cli import main as prep_main
    from data.ingest import ingest
    from tools.generate import main as generate_main

    raw, tokens = tmp_path / "raw", tmp_path / "tokens"
    sources = [f"text:{tiny_corpus / 'text'}", f"code:{tiny_corpus / 'code'}"]
    assert ingest(raw, sources)["finalized"]
    argv = ["tokenize", "--in", str(raw), "--tokenizer", str(tiny_tokenizers[0]), "--no-progress"]
    assert prep_main([*argv, "--out", str(tokens)]) == 0
    manifest = json.loads((tokens / "manifest.json").read_text())
    assert manifest["tokenizers"]["visual"] is None
    assert not (tokens / "tokenizers" / "visual_tokenizer").exists()
    capsys.readouterr()

    def run(name, srcs, *extra):
        listed = ",".join(f"{{name: {n}, shards: [{path}], weight: 1.0}}" for n, path in srcs)
        train(["experiment=debug", f"data.sources=[{listed}]", f"run_dir={tmp_path / name}",
               "train.steps=2", "train.micro_batch=2", *extra])  # fmt: skip
        make_release(tmp_path / name, tmp_path / f"{name}_rel", log=lambda *a, **k: None)
        return tmp_path / f"{name}_rel"

    mixed = run("mixed", [("text", tokens / "text"), ("scenes", tiny_tokens / "scenes")])
    assert (mixed / "visual_tokenizer" / "model.safetensors").is_file()
    alone = run("alone", [("text", tokens / "text"), ("code", tokens / "code")])
    assert sorted(p.name for p in alone.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "vocab_layout.json"
    ]  # fmt: skip
    assert generate_main([str(alone), "--prompt", "def f", "--max-new-tokens", "3"]) == 0
    # The same tokenizers copied elsewhere, named by data.tokenizers: no manifest beside them,
    # still a folder of text and code alone, released as such.
    mine = shutil.copytree(tokens / "tokenizers", tmp_path / "my_tokenizers")
    copied = run("copied", [("text", tokens / "text")], f"data.tokenizers='{mine}'")
    assert sorted(p.name for p in copied.iterdir()) == sorted(p.name for p in alone.iterdir())
    assert Release(copied).config["tokenizers"] == Release(alone).config["tokenizers"]
    out = tmp_path / "x.png"
    assert generate_main([str(alone), "--draw", "a red square", "--out", str(out)]) == 2
    said = "no visual_tokenizer/ (released with --no-tokenizers, or its model was trained on "
    assert said + "tokens of text and code alone)" in capsys.readouterr().err
    # an image to caption is refused for the same reason, not blamed as unreadable
    photo = sorted((tiny_corpus / "scenes").rglob("*.png"))[0]
    assert generate_main([str(alone), "--image", str(photo)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"earlyfuse-generate: error: {alone}: {said}") and str(photo) not in err


def test_an_output_folder_that_is_the_input_or_cannot_be_written_is_refused_first(
    runs, tmp_path, capsys
):
    """Before: --force deleted the run (OUT = RUN_DIR or its checkpoints/) or the release (hf
    OUT = RELEASE) and wrote over it; OUT under a file was a traceback after the consolidation."""
    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    for out in (run, run / "checkpoints", run / "checkpoints" / "step_00000003"):
        assert convert_main(["release", str(run), str(out), "--force"]) == 2
        err = capsys.readouterr().err
        assert f"earlyfuse-convert release: error: {out}: " in err and "the input" in err, err
    assert verify_folder(run / "checkpoints" / "step_00000003") == []
    rel = tmp_path / "rel"
    make_release(run, rel, log=quiet)
    for out in (rel, tmp_path, rel / "hf"):
        assert convert_main(["hf", str(rel), str(out), "--force"]) == 2
        assert f"earlyfuse-convert hf: error: {out}: " in capsys.readouterr().err
    assert Release(rel).state_dict()  # every file there, every sha256 as recorded
    (tmp_path / "file").write_text("x")
    for command, source in (("release", run), ("hf", rel)):
        assert convert_main([command, str(source), str(tmp_path / "file" / "out")]) == 2
        out, err = capsys.readouterr()
        assert err.strip().splitlines() == [
            f"earlyfuse-convert {command}: error: {tmp_path / 'file' / 'out'}: cannot be written "
            f"({tmp_path / 'file'} is a file, not a folder)"
        ]
        assert "consolidated" not in out  # refused before any work
    # A folder that takes no new folder is found before the work (was an errno naming
    # OUT.partial after it)
    assert convert_main(["release", str(run), "/proc/rel"]) == 2
    out, err = capsys.readouterr()
    assert "/proc/rel: cannot be written (/proc takes no new folder: " in err
    assert "consolidated" not in out
    # A link to a folder: was refused only after the work, by rmtree (exit code 1)
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    for command, source in (("release", run), ("hf", rel)):
        assert convert_main([command, str(source), str(tmp_path / "link"), "--force"]) == 2
        out, err = capsys.readouterr()
        assert f"{tmp_path / 'link'}: a symbolic link (to {tmp_path / 'target'})" in err
        assert "consolidated" not in out


def test_an_object_storage_url_is_refused_not_taken_for_a_local_folder(
    runs, tmp_path, monkeypatch, capsys
):
    """Before: OUT s3://bucket/rel wrote the local folder ./s3:/bucket/rel and said 'wrote
    s3://bucket/rel'; an input URL was looked for as the local folder s3:/bucket/..."""
    monkeypatch.chdir(tmp_path)
    for argv in (
        ["release", str(runs[0]), "s3://bucket/rel"],
        ["release", "s3://bucket/run", "out"],
        ["release", str(runs[0]), "out", "--tokenizers", "s3://bucket/tokenizers"],
        ["hf", "s3://bucket/rel", "out"],
        ["import", "s3://bucket/rel", "out"],
        ["universal", "s3://bucket/run"],
    ):
        with pytest.raises(SystemExit) as refused:
            convert_main(argv)
        assert refused.value.code == 2
        err = capsys.readouterr().err
        assert ": s3://bucket/" in err and "an object storage URL; this command reads and" in err
    assert list(tmp_path.iterdir()) == []


def other_visual_tokenizer(tokens, folder):
    """A copy of the token data's tokenizers with another visual tokenizer of the same levels
    (the same layout): only the fingerprints tell it apart."""
    import torch

    from model.visual_tokenizer import vtok_debug
    from train.tasks.vtok import save_visual_tokenizer

    shutil.copytree(tokens / "tokenizers", folder)
    shutil.rmtree(folder / "visual_tokenizer")
    torch.manual_seed(123)
    cfg = vtok_debug()
    save_visual_tokenizer(cfg.build().state_dict(), cfg, folder / "visual_tokenizer")
    return folder


def test_tokenizers_other_than_the_runs_tokens_were_made_with_are_refused(
    runs, tiny_tokens, tmp_path
):
    """Another visual tokenizer of the same levels (the same layout) passed every check before:
    the release shipped it, and its images would decode and encode with other codes."""
    other = other_visual_tokenizer(tiny_tokens, tmp_path / "tokenizers")
    with pytest.raises(ReleaseError) as refused:
        make_release(runs[0], tmp_path / "rel", tokenizers=other, log=quiet)
    assert str(refused.value).startswith(
        f"{other}: not the tokenizers of the run's tokens (source scenes ("
    )
    # The checkpoint's record, not the shards as they are now, says what the model learned from
    assert "tokenizers.json records it): visual tokenizer differs (visual: " in str(refused.value)
    assert not (tmp_path / "rel").exists()
    assert make_release(runs[0], tmp_path / "rel", tokenizers=tiny_tokens / "tokenizers", log=quiet)


def test_tokenizers_are_checked_against_the_checkpoints_record_once_the_tokens_moved(
    runs, tiny_tokens, tmp_path
):
    """Before: with the run's token shards moved away, any tokenizer folder of the same layout was
    released with the model. Every checkpoint records the tokenizers its token sources were made
    with (tokenizers.json, in its manifest): a release checks --tokenizers against that record
    when the shards cannot be read. A checkpoint without the record checks nothing, as before."""
    run = tmp_path / "moved"
    shutil.copytree(runs[0], run)
    step = run / "checkpoints" / "step_00000003"
    for p in (run / "config.yaml", step / "config.yaml"):
        p.write_text(p.read_text().replace(str(tiny_tokens), str(tmp_path / "gone")))
    other = other_visual_tokenizer(tiny_tokens, tmp_path / "other")
    with pytest.raises(ReleaseError) as refused:
        make_release(run, tmp_path / "rel", tokenizers=other, log=quiet)
    said = str(refused.value)
    assert said.startswith(f"{other}: not the tokenizers of the run's tokens (source scenes (")
    assert f"as {step / 'tokenizers.json'} records it): " in said
    assert "\n" not in said  # one line
    recorded = json.loads((step / "tokenizers.json").read_text())[0]["visual"]
    assert f"visual tokenizer differs (visual: {recorded} recorded, " in said
    assert not (tmp_path / "rel").exists()
    right = tiny_tokens / "tokenizers"
    assert make_release(run, tmp_path / "rel", tokenizers=right, log=quiet)["tokenizers"]
    # A checkpoint saved before the record existed: nothing to check the folder against.
    (step / "tokenizers.json").unlink()
    meta = json.loads((step / "meta.json").read_text())
    del meta["files"]["tokenizers.json"]
    (step / "meta.json").write_text(json.dumps(meta))
    assert make_release(run, tmp_path / "old", tokenizers=other, log=quiet)


def test_help_imports_only_the_command_given():
    """`earlyfuse-convert --help` lists every command without importing torch (it answers at
    once); a command's own help brings its module, and its options."""
    probe = (
        "import sys; from tools.convert import SUBCOMMANDS, build_parser; h = build_parser([])."
        "format_help(); print(all(h.count(n) for n in SUBCOMMANDS), 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.split() == ["True", "False"], done.stderr
    from tools.convert import build_parser

    hf = build_parser(["hf", "--help"])._subparsers._group_actions[0].choices["hf"]
    assert "--force" in hf.format_help() and "Qwen3ForCausalLM" in hf.format_help()


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    import tools.convert as convert
    import tools.convert_release as release

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(release, "run", interrupted)
    code = convert.main(["release", "runs/x", "somewhere"])
    assert code == 130
    assert (
        capsys.readouterr().err
        == "earlyfuse-convert release: interrupted; run the same command again\n"
    )
