"""docs/own_data.md's commands, read from the page as written, agree with each other: every
command parses with its real parser (an unknown flag fails here), every Hydra preset and key it
names composes onto the schema, and for the CPU try and the GPU run alike the text tokenizer's
FSQ levels, the visual tokenizer's levels (read from the layout the text tokenizer writes), the
grid, the row length of tokenize and of the LM run, and the folders handed from step to step
are the same."""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

import pytest
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

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "own_data.md"
RECIPES = ("CPU try", "GPU run")
CPU_VOCAB_MAX = 8192  # the demo's 4096 makes 1.1M of its model's 1.9M parameters


def blocks(kind: str) -> list[tuple[str | None, str]]:
    """(recipe or None for both, text) of every fenced block of ``kind``, in page order."""
    out = []
    for body in re.findall(rf"```{kind}\n(.*?)```", GUIDE.read_text(), re.S):
        first = body.splitlines()[0].lstrip("# ").strip() if body.strip() else ""
        out.append((first if first in RECIPES else None, body))
    return out


def commands(recipe: str) -> list[list[str]]:
    """The recipe's commands, continuation lines joined, comments dropped."""
    out = []
    for label, body in blocks("bash"):
        if label not in (None, recipe):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
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
    with initialize_config_dir(config_dir=app.CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", overrides=overrides + search)
    app.name_after_data(cfg, overrides)
    return cfg


@pytest.fixture
def user_configs(tmp_path) -> Path:
    """The guide's own data config, written where its first line says (under a temp home)."""
    (body,) = [text for _, text in blocks("yaml")]
    where = body.splitlines()[0].lstrip("# ").strip()
    assert where == "~/my-configs/data/mine.yaml"
    path = tmp_path / "my-configs" / "data" / "mine.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(body)
    return tmp_path / "my-configs"


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
    for folder in ("code", "notes", "photos", "videos"):
        (tmp_path / "corpus" / folder).mkdir(parents=True)
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
    ingested = {spec.name for spec in parse_sources(ingest.source)}
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


def small_corpus(home: Path) -> None:
    """~/corpus as the guide lays it out: a source tree, prose, captioned photos and videos."""
    from factories import jpeg_bytes, mp4_bytes

    corpus = home / "corpus"
    for folder in ("code/pkg", "notes", "photos", "videos"):
        (corpus / folder).mkdir(parents=True)
    for i in range(30):
        (corpus / "code" / "pkg" / f"mod{i}.py").write_text(
            f'"""Module {i}."""\n\n\ndef value_{i}(x):\n    return x * {i} + {i % 7}\n'
        )
        (corpus / "notes" / f"note{i}.txt").write_text(
            f"Note {i}: the river rose {i} feet in the night and the town counted its boats."
        )
    for i in range(1, 13):
        (corpus / "photos" / f"IMG_{i:04d}.jpg").write_bytes(jpeg_bytes(96, 72, seed=i))
        (corpus / "photos" / f"IMG_{i:04d}.txt").write_text(f"photo number {i} of the trip")
    for i in range(4):
        (corpus / "videos" / f"clip{i}.mp4").write_bytes(mp4_bytes(frames=16, w=64, h=48))
        (corpus / "videos" / f"clip{i}.txt").write_text(f"clip {i}: a square moves")


@pytest.mark.slow
def test_the_cpu_try_runs_as_written(tmp_path, user_configs):
    """Every command of the CPU try, run by bash as the page writes it (the two training runs
    cut to 4 steps), on a small corpus with every source kind the guide names."""
    import os
    import subprocess
    import sys

    small_corpus(tmp_path)
    env = {
        **os.environ,
        "HOME": str(tmp_path),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
    }
    lines, said = [], {}
    for label, body in blocks("bash"):
        if label in (None, "CPU try"):
            lines += [line for line in body.replace("\\\n", " ").splitlines() if line.strip()]
    for line in lines:
        line = line.split("#")[0].strip() if not line.lstrip().startswith("#") else ""
        if not line or "runs/mine/config.yaml" in line and not (tmp_path / "runs/mine").exists():
            continue
        line += next((extra for key, extra in SHORTER.items() if f" {key} " in f"{line} "), "")
        done = subprocess.run(
            ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        said[line.split()[0]] = done.stdout
    assert (tmp_path / "runs/mine/report/report.png").is_file()
    assert (tmp_path / "bicycle.png").is_file()
    assert (tmp_path / "hf/mine/config.json").is_file()
    assert "text" in said["earlyfuse-eval"]  # its table, per modality
