"""The long-context part of the GPU check (``tools/gpu_check.sh OUT long``), run on the CPU at
tiny sizes: its two benchmarks write the JSON the table reads, the table renders, and the
script's steps are the ones the docs list, within their time budget. Not marked ``gpu``: these
run in the CPU suite (the GPU check itself runs only the ``gpu`` tests of this folder).

The scripts are loaded from their paths, as ``python tools/bench/X.py`` runs them (tools/bench is
a folder of scripts, not a package one imports)."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench"
# Past the 47-bit address space of a process even as a [T, T] boolean mask (256 TiB): the
# allocation fails at once on any machine, whatever its memory or overcommit setting.
TOO_LONG = 2**24


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def long_out(tmp_path_factory) -> Path:
    """One OUT folder as the long part leaves it, at tiny sizes on the CPU."""
    import torch._dynamo.config as dynamo_config

    limit = dynamo_config.recompile_limit  # the benches raise it; the other tests keep theirs
    out = tmp_path_factory.mktemp("gpu_check_long")
    load("bench_block_mask").main(
        ["--device", "cpu", "--builder", "eager", "--lengths", "256,512", "--window", "64"]
        + ["--docs", "2", "--repeats", "1", "--json", str(out / "blockmask.json")]
    )
    bench_gpu = load("bench_gpu")
    common = ["--preset", "debug", "--device", "cpu", "--dtype", "float32", "--micro-batch", "1"]
    common += ["--docs", "4", "--activation-checkpoint", "--warmup", "1", "--steps", "1"]
    # The document mask at 256 tokens, then rows too long to allocate: "OOM at N", not a crash,
    # and the longer row after it is skipped.
    lengths = f"256,{TOO_LONG},{2 * TOO_LONG}"
    bench_gpu.main(common + ["--seq-len", lengths, "--json", str(out / "long-debug-doc.json")])
    bench_gpu.main(
        common
        + ["--seq-len", "256", "--attention", "local-global", "--local-window", "32"]
        + [
            "--global-every",
            "2",
            "--local-theta",
            "1000",
            "--json",
            str(out / "long-debug-lg.json"),
        ]
    )
    (out / "summary.txt").write_text(
        "env: rc 0 in 1 s (limit 15 s)\nlong-1b-lg: rc 124 in 100 s (limit 100 s)\n"
    )
    dynamo_config.recompile_limit = limit
    return out


def test_block_mask_bench_writes_both_masks_at_each_length(long_out):
    report = json.loads((long_out / "blockmask.json").read_text())
    results = report["results"]
    assert [(res["seq_len"], res["kind"]) for res in results] == [
        (256, "doc"),
        (256, "local"),
        (512, "doc"),
        (512, "local"),
    ]
    for res in results:
        blocks = res["seq_len"] // 128
        # Per mask: [1, 1, n] counts and [1, 1, n, n] indices, partial and full, by key and by
        # query, int32.
        assert res["index_mib"] * 2**20 == 4 * 4 * (blocks * blocks + blocks)
        assert res["build_s"] > 0 and res["first_build_s"] > 0 and res["builds"] == 1
        assert res["peak_build_mib"] is None  # device memory is CUDA's only
    assert [res["window"] for res in results] == [0, 64, 0, 64]


def test_block_mask_bench_reports_out_of_memory_and_goes_on(tmp_path):
    report = load("bench_block_mask").main(
        ["--device", "cpu", "--builder", "eager", "--lengths", f"{TOO_LONG},256", "--kinds", "doc"]
        + ["--repeats", "1", "--json", str(tmp_path / "blockmask.json")]
    )
    first, second = report["results"]
    assert first["error"] == f"OOM at {TOO_LONG:,}"
    assert second["seq_len"] == 256 and "error" not in second
    assert json.loads((tmp_path / "blockmask.json").read_text()) == report


@pytest.mark.slow
def test_block_mask_bench_with_the_compiled_builder(tmp_path):
    """The builder the GPU check uses (a compile of about 30 s on two busy cores)."""
    report = load("bench_block_mask").main(
        ["--device", "cpu", "--lengths", "256", "--kinds", "local", "--window", "64"]
        + ["--repeats", "1", "--json", str(tmp_path / "blockmask.json")]
    )
    assert report["builder"] == "compiled"
    assert report["results"][0]["index_mib"] * 2**20 == 4 * 4 * (2 * 2 + 2)


def test_long_bench_measures_both_attention_kinds(long_out):
    doc = json.loads((long_out / "long-debug-doc-256.json").read_text())
    local_global = json.loads((long_out / "long-debug-lg.json").read_text())
    for res in (doc, local_global):
        assert res["seq_len"] == 256 and res["micro_batch"] == 1 and res["docs_per_row"] == 4
        assert res["activation_checkpoint"] and res["tokens_per_s"] > 0
        assert res["estimate_gib"] > res["estimate_above_states_gib"] > 0
    assert (doc["attention"], doc["local_window"], doc["local_theta"]) == ("doc", 0, 0.0)
    assert local_global["attention"] == "local-global"
    assert (local_global["local_window"], local_global["global_every"]) == (32, 2)
    assert local_global["local_theta"] == 1000.0
    # train.memory keeps a second mask for the local layers (SDPA's dense one on the CPU)
    assert local_global["estimate_above_states_gib"] > doc["estimate_above_states_gib"]


def test_long_bench_lets_dynamo_compile_once_per_length():
    """Past dynamo's limit of compiled variants a function runs eagerly: the blocks and the
    BlockMask builder compile again for every length one process measures."""
    import torch._dynamo.config as dynamo_config

    # dynamo's own patch restores the setting; after monkeypatch's restore dynamo could no
    # longer read it, and every later compile in the test process failed
    with dynamo_config.patch(recompile_limit=8):
        load("bench_gpu").allow_recompiles(3)
        assert dynamo_config.recompile_limit == 24


def test_long_bench_reports_out_of_memory_as_oom_at_n(long_out):
    for seq_len in (TOO_LONG, 2 * TOO_LONG):
        res = json.loads((long_out / f"long-debug-doc-{seq_len}.json").read_text())
        assert res["oom"] == f"OOM at {TOO_LONG:,}" and res["seq_len"] == seq_len
        assert "tokens_per_s" not in res and res["estimate_gib"] > 0


def test_gpu_table_renders_the_long_tables(long_out):
    load("gpu_table").main([str(long_out)])
    text = (long_out / "long_table.md").read_text()
    assert not (long_out / "table.md").exists()  # no throughput results in this folder
    assert text.startswith("| model | tokens/row | attention | tokens/s |")
    assert "| debug | 256 | document |" in text
    assert "| debug | 256 | local/global (window 32, global every 2) |" in text
    assert f"| debug | {TOO_LONG:,} | document | OOM at {TOO_LONG:,} |" in text
    assert "| 512 | local (window 64) |" in text and "| 256 | doc |" in text
    assert "Failed: long-1b-lg: rc 124" in text and "env:" not in text


def listed_steps(part: str) -> tuple[list[list[str]], int]:
    listing = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh"), "--list", part],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert listing[-1].startswith("total of the limits: ")
    total = int(listing[-1].split(": ")[1].split()[0])
    steps = [line.split(" ", 2) for line in listing[:-1] if not line.startswith("(")]
    return steps, total


def test_long_part_lists_its_steps_within_450_seconds():
    steps, total = listed_steps("long")
    assert [name for name, _, _ in steps] == [
        "env",
        "block-mask",
        "long-125m-doc",
        "long-125m-lg",
        "long-1b-doc",
        "long-1b-lg",
        "table",
    ]
    assert sum(int(limit) for _, limit, _ in steps) == total <= 450
    # Every benchmark's arguments parse with its script's own parser (a misspelt flag would
    # otherwise be found on the GPU)
    parsers = {
        "tools/bench/bench_gpu.py": load("bench_gpu").parser(),
        "tools/bench/bench_block_mask.py": load("bench_block_mask").parser(),
    }
    benches = {}
    for name, _, command in steps:
        words = shlex.split(command)
        if len(words) > 1 and words[1] in parsers:
            benches[name] = parsers[words[1]].parse_args(words[2:])
    assert benches["block-mask"].lengths == "131072,1048576"
    assert benches["block-mask"].builder == "compiled"
    for name in ("long-125m-doc", "long-125m-lg", "long-1b-doc", "long-1b-lg"):
        args = benches[name]
        assert args.seq_len == "8192,32768,131072" and args.micro_batch == 1
        assert args.activation_checkpoint and args.compile and args.docs > 1
        assert args.preset == name.split("-")[1]
        assert args.attention == ("doc" if name.endswith("doc") else "local-global")


def test_throughput_part_is_still_the_default():
    steps, total = listed_steps("throughput")
    assert steps[1][0] == "gpu-tests" and total == 435
    unknown = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh"), "--list", "longer"], capture_output=True
    )
    assert unknown.returncode == 2 and b"unknown part 'longer'" in unknown.stderr


def test_gpu_table_names_a_truncated_result(tmp_path):
    (tmp_path / "long-1b-doc-131072.json").write_text('{"preset": "1b", "seq_')
    with pytest.raises(SystemExit, match="long-1b-doc-131072.json: not valid JSON"):
        load("gpu_table").main([str(tmp_path)])
