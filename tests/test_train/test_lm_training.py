"""The early-fusion LM under DeepSpeed on CPU, on real token shards: every ZeRO stage trains and
resumes bit-identically from its own checkpoint, the global RNG states included; a 2-process
torchrun run killed with -9 resumes bit-identically too."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter

import pytest
from trainrun import metrics, rng_digests, train

SOURCES = {"scenes": 0.3, "clips": 0.3, "text": 0.3, "code": 0.1}  # short documents first


def base(tokens, run_dir, steps, *extra):
    srcs = ",".join(
        f"{{name: {s}, shards: [{tokens / s}], weight: {w}}}" for s, w in SOURCES.items()
    )
    return [
        "experiment=debug",
        f"data.sources=[{srcs}]",
        f"run_dir={run_dir}",
        f"train.steps={steps}",
        "train.log_every=1",
        "train.micro_batch=2",
        *extra,
    ]


def test_lm_debug_run_logs_every_modality(tiny_tokens, tmp_path):
    run = tmp_path / "run"
    srcs = f"[{{name: heldout, shards: [{tiny_tokens / 'scenes'}], weight: 1.0}}]"
    p = train(base(tiny_tokens, run, 8, "train.eval_batches=2", f"data.validation={srcs}"))
    assert "step 8/8 | loss" in p.stdout
    m = metrics(run)
    seen = {k for rec in m.values() for k in rec if k.startswith("loss/")}
    assert {"loss/text", "loss/code", "loss/image", "loss/video"} <= seen
    assert all(
        abs(sum(m[s][f"mix/{k}"] for k in SOURCES) - 1) < 1e-9 for s in m
    )  # shares of each step
    assert all(sum(m[s][f"mix/{k}"] for s in m) > 0 for k in SOURCES)
    final = json.loads((run / "final.json").read_text())
    assert "val/loss/image" in final and "val/ppl/image" in final
    # The unigram baseline beside every loss: console, metrics.jsonl, final.json.
    assert "(u " in p.stdout
    assert any("unigram/image" in rec for rec in m.values())
    assert final["val/margin/image"] == pytest.approx(
        final["val/unigram/image"] - final["val/loss/image"]
    )
    assert final["val/complete"] in (0.0, 1.0) and final["val/batches"] <= 2
    assert (run / "checkpoints" / "step_00000008" / "vocab_layout.json").is_file()
    # The final evaluation (the only one: train.eval_every=0) is in TensorBoard at the last step.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    board.Reload()
    logged = [(e.step, e.value) for e in board.Scalars("val/loss/image")]
    assert logged == [(8, pytest.approx(final["val/loss/image"]))]
    assert [e.step for e in board.Scalars("train/loss")] == list(range(1, 9))


def test_a_compiled_run_probes_and_evaluates_on_a_few_graphs_a_function(tiny_tokens, tmp_path):
    """What a GPU run does by default (train.compile=auto compiles on CUDA), here with inductor
    on the CPU: every probe each second step (the code-use probe draws), validation every
    fourth. Before: the first drawing probe recompiled the static fullgraph blocks at each decode
    step until dynamo's limit (8) ended the run; each probe's rows were graphs of their own
    toward that limit. Now the probes run eager: a compiled function here has a graph for
    training and one for evaluation (no grad), each again for rows of one document (no mask)."""
    srcs = f"[{{name: heldout, shards: [{tiny_tokens / 'scenes'}], weight: 1.0}}]"
    probes = [
        f"monitor.{probe}.{key}={value}"
        for probe in ("attention", "dependence", "code_use")
        for key, value in (("every", 2), ("min_steps", 0))
    ]
    run = tmp_path / "run"
    extra = ["train.compile=true", "train.eval_every=4", f"data.validation={srcs}", *probes]
    p = train(base(tiny_tokens, run, 8, *extra), env={"TORCH_LOGS": "recompiles"})
    out = p.stdout + p.stderr
    assert "compiled, steps 0->8" in out and "step 8/8 | loss" in p.stdout
    recompiled = Counter(re.findall(r"Recompiling function \w+ in (\S+)", out))
    assert recompiled and max(recompiled.values()) <= 3, recompiled  # train -> eval: grad mode
    assert "GLOBAL_STATE changed: grad_mode" in out
    m = metrics(run)
    assert "monitor/gen_code_entropy" in m[8] and "monitor/attn_entropy" in m[8]


# ZeRO 1's partitioning is ZeRO 2's without the gradients': its resume runs with the slow tests
@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=pytest.mark.slow), 2, 3])
def test_every_zero_stage_trains_and_resumes_bit_identically(tiny_tokens, tmp_path, stage):
    ref, run = tmp_path / "ref", tmp_path / "run"
    args = [f"deepspeed.zero_stage={stage}"]
    rng_ref, rng_run = tmp_path / "ref.rng", tmp_path / "run.rng"
    train(base(tiny_tokens, ref, 4, *args), faults={"rng_log": rng_ref})
    p = train(
        base(tiny_tokens, run, 4, "train.ckpt_every=2", *args),
        faults={"kill_at_step": 3, "rng_log": rng_run},
        check=False,
    )
    assert p.returncode == -9  # SIGKILL, as kill -9
    train(base(tiny_tokens, run, 4, "train.ckpt_every=2", *args), faults={"rng_log": rng_run})
    a, b = metrics(ref), metrics(run)
    assert [a[s]["train/loss"] for s in range(1, 5)] == [b[s]["train/loss"] for s in range(1, 5)]
    assert a[4]["train/loss"] < a[1]["train/loss"]
    # the documents new to each modality too: the counter's memory is in the checkpoint
    counts = [{k: v for k, v in a[s].items() if k.startswith("data/docs_new/")} for s in (3, 4)]
    assert counts[0] and counts == [
        {k: v for k, v in b[s].items() if k.startswith("data/docs_new/")} for s in (3, 4)
    ]
    # The global RNG before every step, the killed run's and the resumed run's steps 3 and 4
    # included, is the uninterrupted run's: nothing draws from it between restore and step 3.
    want, got = rng_digests(rng_ref), rng_digests(rng_run, every=True)
    assert sorted(want) == [1, 2, 3, 4] and [s for s, _ in got] == [1, 2, 3, 3, 4]
    assert all(digest == want[s] for s, digest in got), (want, got)


def test_a_resume_with_another_lr_trains_at_it_from_its_first_step(tiny_tokens, tmp_path):
    """DeepSpeed's load brings back the saved peak lr (and betas, weight decay): the config's
    must win, from the first update after the resume. Reference: a run whose lr doubles from
    step 5 (optim.lr_changes; the same lr to the bit); its step-4 checkpoint is a plain lr 1e-3
    run's, and resumed at lr 2e-3 without the change its steps 5 and 6 must be the reference's."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    args = ["deepspeed.zero_stage=2", "train.ckpt_every=2", "train.keep_last=3"]
    change = "optim.lr_changes=[{step: 4, scale: 2}]"
    train(base(tiny_tokens, ref, 6, *args, "optim.lr=1e-3", change))
    shutil.copytree(ref, run)
    shutil.rmtree(run / "checkpoints" / "step_00000006")
    (run / "checkpoints" / "latest").write_text("step_00000004\n")
    p = train(base(tiny_tokens, run, 6, *args, "optim.lr=2e-3", "train.allow_config_change=true"))
    assert "optim.lr: 0.001 -> 0.002 (breaks an exact resume)" in p.stdout
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 6, 5, 6]  # the copy's, then the resumed run's own
    a, b = metrics(ref), metrics(run)  # the last record of each step
    for step in (5, 6):
        for key in ("train/loss", "optim/grad_norm", "optim/lr"):
            assert a[step][key] == b[step][key], (step, key)


@pytest.mark.slow
def test_two_process_run_killed_mid_run_resumes_bit_identically(tiny_tokens, tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    args = ["deepspeed.zero_stage=2"]
    rng_ref, rng_run = tmp_path / "ref.rng", tmp_path / "run.rng"
    train(base(tiny_tokens, ref, 6, *args), nproc=2, faults={"rng_log": rng_ref})
    p = train(
        base(tiny_tokens, run, 6, "train.ckpt_every=2", *args),
        nproc=2,
        faults={"kill_at_step": 5, "rng_log": rng_run},
        check=False,
    )
    assert p.returncode != 0
    train(
        base(tiny_tokens, run, 6, "train.ckpt_every=2", *args), nproc=2, faults={"rng_log": rng_run}
    )
    a, b = metrics(ref), metrics(run)
    assert [a[s]["train/loss"] for s in range(1, 7)] == [b[s]["train/loss"] for s in range(1, 7)]
    for rank in (0, 1):
        want = rng_digests(rng_ref, rank=rank)
        got = rng_digests(rng_run, rank=rank, every=True)
        assert all(digest == want[s] for s, digest in got), (rank, want, got)


def test_lm_trains_on_raw_shards_tokenized_by_the_loader(tiny_raw, tiny_tokens, tmp_path):
    """A raw source (tokenized in the loader's worker) mixed with a token source of the same tokenizers."""
    run = tmp_path / "run"
    srcs = (
        f"[{{name: scenes, shards: [{tiny_raw / 'scenes'}], weight: 0.5}}, "
        f"{{name: code, shards: [{tiny_tokens / 'code'}], weight: 0.5}}]"
    )
    p = train(
        [
            "experiment=debug",
            f"data.sources={srcs}",
            f"run_dir={run}",
            "train.steps=3",
            "train.log_every=1",
            "train.micro_batch=2",
            f"data.tokenizers={tiny_tokens / 'tokenizers'}",
            "data.tokenize.image_max_pixels=1024",
            "data.tokenize.video_max_pixels=1024",
        ]
    )
    assert "step 3/3 | loss" in p.stdout
    m = metrics(run)
    assert sum(m[s]["tokens/image"] for s in m) > 0 and sum(m[s]["tokens/code"] for s in m) > 0
    assert all(m[s]["data/skipped"] == 0 for s in m)
    # Raw shards cannot be a validation source: refused at start, not at the first evaluation.
    val = f"[{{name: v, shards: [{tiny_raw / 'scenes'}]}}]"
    p = train(
        [
            "experiment=debug",
            f"data.sources={srcs}",
            f"run_dir={tmp_path / 'val'}",
            "train.steps=3",
            f"data.tokenizers={tiny_tokens / 'tokenizers'}",
            f"data.validation={val}",
        ],
        check=False,
    )
    assert p.returncode != 0 and "data.validation source v holds raw shards" in p.stderr
    assert not (tmp_path / "val" / "metrics.jsonl").exists()


def test_blocks_longer_than_a_row_stop_the_run_or_are_counted_when_allowed(tiny_tokens, tmp_path):
    """Rows of 96 tokens cannot hold the clips' video blocks (~220 tokens): the run stops before
    training naming the source, the budget and seq_len; with data.allow_block_drops it trains and
    every drop is counted per source and modality (console, metrics.jsonl, final.json)."""
    run = tmp_path / "run"
    args = base(tiny_tokens, run, 3, "data.seq_len=96")
    fits = "[{name: scenes, shards: [" + str(tiny_tokens / "scenes") + "]}]"
    held = "[{name: v, shards: [" + str(tiny_tokens / "clips") + "]}]"
    p = train(args + [f"data.validation={held}"], check=False)
    said = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in said and not (run / "metrics.jsonl").exists()
    assert (
        "source clips:" in said and "data.seq_len=96" in said and "--video-max-tokens 240" in said
    )
    assert "data.validation source v:" in said  # every source that does not fit, in one message
    # FlexAttention cannot train on a CPU: said at start, not by the first backward's traceback
    p = train(args + ["model.attention.backend=flex"], check=False)
    said = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in said and "backend=flex: FlexAttention" in said
    # A validation source is checked at start too, not at the first evaluation.
    only = [a for a in args if not a.startswith("data.sources=")]
    p = train(only + [f"data.sources={fits}", f"data.validation={held}"], check=False)
    said = p.stdout + p.stderr  # a user error as the training sources' is: exit 2, no traceback
    assert p.returncode == 2 and "Traceback" not in said and "data.validation source v:" in said
    p = train(args + ["data.allow_block_drops=true"])
    assert "| dropped " in p.stdout
    m = metrics(run)
    per_step = sum(m[s].get("data/dropped_blocks/clips/video", 0) for s in m)
    assert per_step > 0 and per_step == sum(m[s]["data/dropped_blocks"] for s in m)
    final = json.loads((run / "final.json").read_text())
    assert final["data/dropped_blocks/clips/video"] == per_step == final["data/dropped_blocks"]
    # A manifest whose block summaries say the clips fit (edited, or merged by hand): the start's
    # check passes, the drops are said once and counted, final.json included
    tokens = shutil.copytree(tiny_tokens, tmp_path / "tokens")
    manifest = json.loads((tokens / "manifest.json").read_text())

    def shorten(node):
        if isinstance(node, dict):
            if isinstance(node.get("video"), dict) and "longest" in node["video"]:
                node["video"]["longest"] = 90
            for value in node.values():
                shorten(value)
        elif isinstance(node, list):
            for value in node:
                shorten(value)

    shorten(manifest)
    (tokens / "manifest.json").write_text(json.dumps(manifest))
    p = train(base(tokens, tmp_path / "run2", 3, "data.seq_len=96"))
    assert (p.stdout + p.stderr).count("were dropped (clips/video) although the manifests") == 1
    assert json.loads((tmp_path / "run2" / "final.json").read_text())["data/dropped_blocks"] > 0


def test_the_probes_read_rows_no_longer_than_monitor_probe_seq_len(tiny_tokens, caplog):
    """A long stage's probes ran its whole rows on every rank: at 8k on a CPU four times the
    memory and ten times the time of its training steps, at 32k on a GPU tens of GB. Blocks
    longer than the probe rows are left out of them, and the first probe says how many."""
    from contextlib import closing

    import torch
    from factories import tiny_loader_config

    from train.config import RunConfig
    from train.dist import DistInfo
    from train.tasks.lm import LMTask

    cfg = RunConfig()
    cfg.data = tiny_loader_config(tiny_tokens, seq_len=512)
    one = DistInfo(0, 1, 0, torch.device("cpu"))
    for probe_seq_len, width, said in ((128, 128, True), (0, 512, False), (4096, 512, False)):
        cfg.monitor.probe_seq_len = probe_seq_len
        caplog.clear()
        with caplog.at_level("INFO", logger="train.tasks.lm"):
            with closing(iter(LMTask(cfg, one).probe_stream())) as batches:
                assert next(batches)["input_ids"].shape[1] == width
        lines = [
            r.getMessage() for r in caplog.records if "left out of the probe" in r.getMessage()
        ]
        assert len(lines) == said, lines
        if said:  # the tiny clips, up to 223 tokens, are longer than probe rows of 128
            assert "clips: 4 of its 4 video blocks (the longest 223)" in lines[0], lines


def test_a_source_with_fewer_documents_than_consumers_is_refused_at_start(tiny_tokens):
    """Before: a loader worker raised "fewer samples than consumers" at the first batch, a
    traceback and exit code 1. The loader's start-up check (fit.check_mix) reaches the run as a
    ConfigError: one line, exit code 2. The tiny clips source holds 4 documents."""
    import torch
    from factories import tiny_loader_config

    from train.config import RunConfig
    from train.config_check import ConfigError
    from train.dist import DistInfo
    from train.tasks.lm import LMTask

    cfg = RunConfig()
    cfg.data = tiny_loader_config(tiny_tokens, num_workers=3)
    cfg.data.sources = [s for s in cfg.data.sources if s.name in ("clips", "scenes")]
    two_ranks = DistInfo(0, 2, 0, torch.device("cpu"))
    with pytest.raises(
        ConfigError, match=r"source clips: 4 document\(s\), fewer than the 6 consumers"
    ):
        LMTask(cfg, two_ranks).batches()
    cfg.data.mode = "epoch"  # a consumer without a document of a source is done with it
    LMTask(cfg, two_ranks).batches()


def test_the_probes_read_the_training_sources_when_validation_holds_no_image(tiny_tokens):
    """Before: an image-heavy run validated on text alone probed the text, so the cross-modal
    dependence probe and the generated-code rule were off for the run without a word."""
    from factories import tiny_loader_config

    from data.names import LAYOUT_FILE
    from data.unigram import Unigram
    from data.vocab import VocabLayout
    from train.streams import TableCache
    from train.tasks.lm import probe_sources

    data = tiny_loader_config(tiny_tokens)
    by_name = {source.name: source for source in data.sources}
    tables = TableCache()

    def chosen(train: list[str], held_out: list[str]) -> list[str]:
        data.sources = [by_name[name] for name in train]
        data.validation = [by_name[name] for name in held_out]
        layout = VocabLayout.load(tiny_tokens / "tokenizers" / LAYOUT_FILE)
        unigram = Unigram.from_tables(tables.get(data.sources), layout)
        return [source.name for source in probe_sources(data, tables, unigram)]

    assert chosen(["scenes", "code"], ["text"]) == ["scenes", "code"]
    assert chosen(["scenes", "code"], ["scenes", "text"]) == ["scenes", "text"]
    assert chosen(["text", "code"], ["text"]) == ["text"]  # no images anywhere: held-out as is
    # a long-context stage's held-out long documents and clips: clips are no captioned image
    assert chosen(["scenes", "clips"], ["text", "clips"]) == ["scenes", "clips"]
    assert chosen(["clips", "code"], ["clips"]) == ["clips"]


def test_settings_that_do_nothing_at_these_rows_are_noted(tiny_tokens, tiny_raw):
    """A local window as long as the row, and clips tokenized to fewer tokens than a longer
    stage's rows hold, trained without a word. Raw sources (tokenized by the run) get none."""
    from factories import tiny_loader_config

    from data.loader import SourceConfig
    from data.loader.table_load import load_table
    from model.attention import AttentionConfig
    from train.tasks.lm import long_row_notes

    data = tiny_loader_config(tiny_tokens, seq_len=1024)
    tables = [load_table(s) for s in data.sources]
    notes = long_row_notes(data, AttentionConfig(local_window=1024, global_every=2), tables)
    assert notes[0].startswith("note: model.attention.local_window=1024 >= data.seq_len=1024")
    # The two sources with clips (the interleaved documents have some), tokenized to 240 at most
    assert [n.split("'")[0] for n in notes[1:]] == ["note: source clips", "note: source docs"]
    assert all("at most 240 tokens each" in n and "--doc-budget 1024" in n for n in notes[1:])
    windowed = AttentionConfig(local_window=128, global_every=2)
    assert long_row_notes(tiny_loader_config(tiny_tokens), windowed, tables) == []
    raw = [load_table(SourceConfig(name="scenes", shards=[str(tiny_raw / "scenes")]))]
    assert long_row_notes(data, windowed, raw) == []
    assert long_row_notes(data, AttentionConfig(sliding_window=4096), raw) == [
        "note: model.attention.sliding_window=4096 >= data.seq_len=1024: every layer sees the "
        "whole row, as without a window"
    ]


def test_rows_too_long_for_the_cpu_are_a_user_error_not_a_traceback(tiny_tokens, tmp_path):
    """Rows of 120k tokens want a dense mask of ~90 GB on the CPU: one line naming the setting,
    exit code 2, as a config that cannot be used (not Hydra's traceback and exit code 1)."""
    p = train(
        base(tiny_tokens, tmp_path / "run", 1, "data.seq_len=120000", "train.micro_batch=1"),
        check=False,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert "120,000 tokens on the CPU needs a dense" in p.stderr
    assert "use shorter rows (--seq-len, data.seq_len)" in p.stderr
