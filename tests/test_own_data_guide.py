"""docs/own_data.md's commands, read from the page as written, agree with each other: every
command parses with its real parser (an unknown flag fails here), every Hydra preset and key it
names composes onto the schema, and for the CPU try and the GPU run alike the text tokenizer's
FSQ levels, the visual tokenizer's levels (read from the layout the text tokenizer writes), the
grid, the row length of tokenize and of the LM run, and the folders handed from step to step
are the same."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest
from guide_run import GUIDE, RECIPES, blocks, write_user_configs
from hydra import compose, initialize_config_dir

import train.app as app
from data.cli import build_parser as prep_parser
from data.layout import image_block_len
from data.names import LAYOUT_FILE
from data.sources import parse_sources
from data.vocab import VocabLayout
from tools.convert import build_parser as convert_parser
from tools.evaluate import build_parser as eval_parser
from tools.generate import build_parser as generate_parser
from tools.report import parse_args as report_args
from train.config import RunConfig
from train.config_check import unknown_override_keys

CPU_VOCAB_MAX = 8192  # the demo's 4096 makes 1.1M of its model's 1.9M parameters


def commands(recipe: str) -> list[list[str]]:
    """The recipe's commands, continuation lines joined, comments and `export` lines (the
    object store's settings) dropped."""
    out = []
    for label, body in blocks("bash"):
        if label not in (None, recipe):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv and argv[0] != "export":
                out.append(argv)
    return out


def one(cmds: list[list[str]], *head: str) -> list[str]:
    found = [argv for argv in cmds if argv[: len(head)] == list(head)]
    assert len(found) == 1, f"expected one `{' '.join(head)}` command, found {len(found)}"
    return found[0]


def same_path(a, b) -> bool:
    return Path(str(a)).expanduser() == Path(str(b)).expanduser()


def train_overrides(argv: list[str], config_dir: Path) -> tuple[list[str], str | None]:
    """(overrides, --config-dir) of an earlyfuse-train command line."""
    args, extra = list(argv[1:]), None
    if "--config-dir" in args:
        at = args.index("--config-dir")
        extra = args[at + 1]
        del args[at : at + 2]
    return args, extra


def composed(overrides: list[str], config_dir: Path | None):
    """The DictConfig Hydra composes for these overrides (the user's folder on the search path)."""
    unknown = unknown_override_keys(overrides, RunConfig, app.config_groups())
    assert not unknown, f"unknown keys in the guide: {unknown}"
    search = [f"hydra.searchpath=[file://{config_dir}]"] if config_dir else []
    named = app.name_after_data(overrides)
    with initialize_config_dir(config_dir=app.CONFIG_DIR, version_base="1.3"):
        return compose("config", overrides=overrides + named + search)


@pytest.fixture
def user_configs(tmp_path) -> Path:
    """The guide's own data config, written where its first line says (under a temp home)."""
    return write_user_configs(tmp_path)


def test_every_command_parses():
    parsers = {
        "earlyfuse-prep": prep_parser().parse_args,
        "earlyfuse-convert": convert_parser().parse_args,
        "earlyfuse-generate": generate_parser().parse_args,
        "earlyfuse-eval": eval_parser().parse_args,
        "earlyfuse-report": report_args,
    }
    seen = set()
    for recipe in RECIPES:
        for argv in commands(recipe):
            assert argv[0] in {*parsers, "earlyfuse-train"}, f"unknown command {argv}"
            seen.add(argv[0])
            if argv[0] in parsers:
                parsers[argv[0]](argv[1:])  # argparse exits (fails the test) on an unknown flag
    assert {"earlyfuse-prep", "earlyfuse-train", "earlyfuse-generate"} <= seen


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_recipe_agrees_with_itself(recipe, user_configs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))  # ~/corpus, ~/my-configs
    for folder in ("code", "notes", "photos", "videos", "pages", "wiki_hf"):
        (tmp_path / "corpus" / folder).mkdir(parents=True)
    (tmp_path / "corpus" / "pages" / "pages.jsonl").touch()
    cmds = commands(recipe)
    prep = prep_parser()
    ingest = prep.parse_args(one(cmds, "earlyfuse-prep", "ingest")[1:])
    text = prep.parse_args(one(cmds, "earlyfuse-prep", "train-text-tokenizer")[1:])
    tokenize = prep.parse_args(one(cmds, "earlyfuse-prep", "tokenize")[1:])
    levels = [int(level) for level in text.fsq_levels.split(",")]
    assert [same_path(folder, ingest.out) for folder in text.inputs] == [True]
    assert same_path(tokenize.inp, ingest.out) and same_path(tokenize.tokenizer, text.out)
    if recipe == "CPU try":
        assert text.vocab_size <= CPU_VOCAB_MAX, "a CPU try needs a CPU-sized vocabulary"

    # The layout train-text-tokenizer writes, so the visual tokenizer run can read it.
    layout = VocabLayout(text_size=text.vocab_size, fsq_levels=levels, max_grid=text.max_grid)
    (tmp_path / text.out).mkdir(parents=True)
    layout.save(tmp_path / text.out / LAYOUT_FILE)

    trains = [argv for argv in cmds if argv[0] == "earlyfuse-train"]
    vtok_runs = [argv for argv in trains if any(a.startswith("experiment=vtok") for a in argv)]
    lm_runs = [argv for argv in trains if argv not in vtok_runs]
    assert len(vtok_runs) == 1 and len(lm_runs) == 1, trains

    overrides, extra = train_overrides(vtok_runs[0], user_configs)
    vtok_cfg = composed(overrides, None)
    app.levels_from_layout(vtok_cfg)  # what earlyfuse-train does with vtok_data.tokenizer
    vtok = app.to_run_config(vtok_cfg)[0]
    assert vtok.task == "vtok" and vtok.vtok.levels == levels, (
        f"{recipe}: the visual tokenizer trains FSQ levels {vtok.vtok.levels}, the vocabulary "
        f"layout has {levels}: tokenize would refuse it"
    )
    assert any(same_path(raw, ingest.out) for raw in vtok.vtok_data.raw)
    ingested = source_names(ingest.source)
    assert set(vtok.vtok_data.sources) <= ingested, (
        "the visual tokenizer names a source not ingested"
    )
    assert same_path(tokenize.visual_tokenizer, Path(vtok.run_dir) / "visual_tokenizer")

    # The image budget: a square image's grid within the layout's, and its block within a row.
    side = int(math.isqrt(tokenize.image_max_pixels)) // vtok.vtok.factor
    assert side <= text.max_grid, f"{recipe}: {side} tokens a side > --max-grid {text.max_grid}"
    assert image_block_len(side, side) <= tokenize.seq_len

    overrides, extra = train_overrides(lm_runs[0], user_configs)
    assert extra == "~/my-configs"
    lm_cfg = composed(overrides, user_configs)
    lm = app.to_run_config(lm_cfg)[0]
    assert lm.task == "lm" and lm.name == "mine"
    assert lm.data.seq_len == tokenize.seq_len, (
        f"{recipe}: the run's rows are {lm.data.seq_len} tokens, tokenize fitted blocks to "
        f"{tokenize.seq_len}"
    )
    for source in [*lm.data.sources, *lm.data.validation]:
        assert all(Path(shard).parts[0] == str(tokenize.out).rstrip("/") for shard in source.shards)
    assert {source.name for source in lm.data.sources} == ingested

    release = convert_parser().parse_args(one(cmds, "earlyfuse-convert", "release")[1:])
    assert same_path(release.run_dir, lm.run_dir)
    for argv in cmds:
        if argv[0] == "earlyfuse-generate":
            assert same_path(generate_parser().parse_args(argv[1:]).release, release.out)
        if argv[0] == "earlyfuse-report":
            assert same_path(report_args(argv[1:]).run_dir, lm.run_dir)


def source_names(sources: list[str]) -> set[str]:
    """The names ingest gives its ``--source`` arguments; one in object storage is named by the
    guide (its stem would do too), so naming it needs no server here."""
    remote = [arg for arg in sources if "://" in arg]
    assert all(re.match(r"[A-Za-z0-9_-]+=", arg) for arg in remote), remote
    local = [arg for arg in sources if arg not in remote]
    return {spec.name for spec in parse_sources(local)} | {arg.split("=")[0] for arg in remote}


def vocabulary_of(argv: list[str]) -> tuple[int, str, int]:
    args = prep_parser().parse_args(argv[1:])
    return args.vocab_size, args.fsq_levels, args.max_grid


def tokenizer_commands(text: str) -> list[list[str]]:
    """Every `earlyfuse-prep train-text-tokenizer` command in a text (continuations joined)."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line.startswith("earlyfuse-prep train-text-tokenizer"):
            out.append(shlex.split(line, comments=True))
    return out


def test_the_readme_and_the_help_give_the_guide_s_vocabularies():
    """README and `train-text-tokenizer --help` show the guide's pairs, and nothing else."""
    guide = {
        vocabulary_of(one(commands(r), "earlyfuse-prep", "train-text-tokenizer")) for r in RECIPES
    }
    readme = (GUIDE.parents[1] / "README.md").read_text()
    helped = prep_parser()._subparsers._group_actions[0].choices["train-text-tokenizer"].epilog  # type: ignore[union-attr]
    for where, text in (("README.md", readme), ("--help", helped)):
        shown = {vocabulary_of(argv) for argv in tokenizer_commands(text)}
        assert shown == guide, f"{where} shows {shown}, docs/own_data.md {guide}"
        assert "vtok_data.tokenizer=tok/" in text


# Appended to a command of the guide to keep the run short: Hydra takes the last value of a key.
SHORTER = {"experiment=vtok_demo": " train.steps=4", "experiment=demo": " train.steps=4"}


@pytest.mark.slow
def test_the_cpu_try_runs_as_written(tmp_path):
    """Every command of the CPU try, run by bash as the page writes it (the two training runs
    cut to 4 steps, the object store's settings filled in with the local server's), on a corpus
    with every source kind the guide names: the image table is read from ``s3://`` on a local
    S3-compatible server, and every source reaches the token shards."""
    pytest.importorskip("moto")
    from guide_run import BUCKET, build_corpus, run_recipe, upload
    from s3_server import s3_with_bucket

    write_user_configs(tmp_path)
    table = build_corpus(tmp_path)
    with s3_with_bucket(BUCKET) as s3:
        upload(table)
        said = run_recipe(tmp_path, s3.env, extra=SHORTER)
    assert (tmp_path / "runs/mine/report/report.png").is_file()
    assert (tmp_path / "bicycle.png").is_file()
    assert (tmp_path / "hf/mine/config.json").is_file()
    assert "text" in said["earlyfuse-eval"]  # its table, per modality

    # Every source, the remote table's too, whole: nothing rejected, every row a document.
    raw = json.loads((tmp_path / "shards/manifest.json").read_text())
    assert raw["totals"]["rejects_by_reason"] == {}
    documents = {name: 0 for name in KINDS_IN_THE_GUIDE}
    for source in raw["sources"]:
        documents[source["name"].removeprefix("val/")] += source["samples"]
    assert documents == KINDS_IN_THE_GUIDE
    # The portrait clip, and the photo larger than a row, fitted to a row by tokenize.
    sizes = [
        (media["width"], media["height"])
        for record in index_records(tmp_path / "shards", "videos")
        for media in record["media"]
    ]
    assert any(height > width for width, height in sizes), sizes
    tokens = json.loads((tmp_path / "tokens/manifest.json").read_text())
    by_name = {source["name"]: source for source in tokens["sources"]}
    assert set(by_name) - {f"val/{name}" for name in KINDS_IN_THE_GUIDE} == set(KINDS_IN_THE_GUIDE)
    photos = [by_name[name] for name in ("photos", "val/photos") if name in by_name]
    assert max(source["blocks"]["image"]["longest"] for source in photos) <= 512


# Documents per source of guide_run.build_corpus, training and held-out together.
KINDS_IN_THE_GUIDE = {
    "code": 33,  # the package's 30 modules, its __init__, a test and its pyproject.toml
    "notes": 40,  # .txt, .md, .rst and man pages as text
    "photos": 13,  # one of them 320x240: 4,860 tokens at its size
    "videos": 4,  # one portrait
    "pages": 8,  # interleaved JSONL
    "wiki": 20,  # a Hugging Face save_to_disk folder
    "catalog": 10,  # a parquet table in the bucket
}


def index_records(shards: Path, source: str) -> list[dict]:
    """The index records of a raw source's shards, training and held-out."""
    return [
        json.loads(line)
        for folder in (shards / source, shards / "val" / source)
        for index in sorted(folder.glob("*.idx.jsonl"))
        for line in index.read_text().splitlines()
        if line.strip()
    ]
