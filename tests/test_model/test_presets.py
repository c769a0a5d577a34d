"""configs/model/*.yaml is the one source of the model presets: what Hydra composes for a run and
what ``model.presets`` reads are the same config, and every parameter count the docs and the
config comments write is the one the preset builds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from model.flops import param_counts
from model.presets import count_text, markdown_table, preset, preset_names, reference_layout

ROOT = Path(__file__).resolve().parents[2]


def counted(name: str, kind: str) -> str:
    counts = param_counts(preset(name))
    value = {
        "total": counts.total,
        "non_embedding": counts.non_embedding,
        "embeddings": counts.embedding + counts.output,  # input table and untied LM head
    }[kind]
    return count_text(value)


# Each claim: a file, a pattern whose groups are parameter counts as written, and for each group
# the preset and which count it states. A claim whose text is reworded fails (the pattern no
# longer matches) rather than going unchecked.
CLAIMS = [
    ("configs/model/debug.yaml", r"^# (\S+) parameters", [("debug", "total")]),
    (
        "configs/model/demo.yaml",
        r"^# (\S+) parameters with the demo's .*? \((\S+) of them in the input and output embeddings",
        [("demo", "total"), ("demo", "embeddings")],
    ),
    *(
        (
            f"configs/model/{name}.yaml",
            r"GPU preset: (\S+) parameters outside the embeddings \((\S+) with",
            [(name, "non_embedding"), (name, "total")],
        )
        for name in ("125m", "350m", "1b")
    ),
    ("configs/experiment/demo.yaml", r"the (\S+)-parameter demo model", [("demo", "total")]),
    ("configs/experiment/debug.yaml", r"the (\S+) debug model", [("debug", "total")]),
    ("docs/training.md", r"`model=debug` \((\S+)\)", [("debug", "total")]),
    ("docs/training.md", r"`model=demo` \((\S+)\)", [("demo", "total")]),
    (
        "docs/training.md",
        r"named by their parameters \*\*outside the embeddings\*\* \((\S+), (\S+), (\S+)\)",
        [("125m", "non_embedding"), ("350m", "non_embedding"), ("1b", "non_embedding")],
    ),
    (
        "docs/training.md",
        r"embeddings add (\S+), (\S+) and (\S+) \(totals (\S+), (\S+), (\S+)\)",
        [
            ("125m", "embeddings"),
            ("350m", "embeddings"),
            ("1b", "embeddings"),
            ("125m", "total"),
            ("350m", "total"),
            ("1b", "total"),
        ],
    ),
    ("docs/benchmarks.md", r"On the (\S+)-parameter debug model", [("debug", "total")]),
]


def flattened(path: Path) -> str:
    """The file's text with YAML comment continuations and line breaks joined into one line each
    paragraph, so a claim wrapped over two lines still matches."""
    text = re.sub(r"\n#\s*", " ", path.read_text())
    return re.sub(r"[ \t]*\n[ \t]*(?=\S)", " ", text)


@pytest.mark.parametrize("path, pattern, counts", CLAIMS, ids=lambda c: str(c)[:40])
def test_documented_parameter_counts_are_the_presets(path, pattern, counts):
    matches = re.findall(pattern, flattened(ROOT / path), flags=re.M)
    assert matches, f"{path}: no text matches {pattern!r} (reworded? update the claim here)"
    for match in matches:
        written = (match,) if isinstance(match, str) else match
        truth = tuple(counted(name, kind) for name, kind in counts)
        assert written == truth, f"{path}: writes {written}, the presets build {truth}"


def test_the_docs_preset_table_is_generated_from_the_yaml_files():
    text = (ROOT / "docs/model.md").read_text()
    table = re.search(r"<!-- presets:begin[^\n]*-->\n(.*?)<!-- presets:end -->", text, re.S)
    assert table, "docs/model.md lost its presets:begin/end markers"
    assert table.group(1) == markdown_table(), (
        "docs/model.md's preset table is out of date; replace it with:\n" + markdown_table()
    )


def test_hydra_and_the_plain_reader_build_the_same_config():
    from hydra import compose, initialize_config_dir

    import train.app as app

    names = preset_names()
    assert set(names) == {p.stem for p in (ROOT / "configs/model").glob("*.yaml")}
    with initialize_config_dir(config_dir=app.CONFIG_DIR, version_base="1.3"):
        for name in names:
            run_cfg = app.to_run_config(compose("config", overrides=[f"model={name}"]))[0]
            assert run_cfg.model.with_layout(reference_layout(name)) == preset(name), name


def test_an_unknown_preset_or_key_is_an_error_naming_it(tmp_path, monkeypatch):
    import model.presets as presets

    with pytest.raises(KeyError, match="unknown model preset 'huge'"):
        preset("huge")
    (tmp_path / "typo.yaml").write_text("dim: 64\nn_layer: 2\n")
    monkeypatch.setattr(presets, "PRESET_DIR", tmp_path)
    with pytest.raises(ValueError, match="n_layer"):
        preset("typo")


def test_the_vocabulary_sizes_come_from_the_layout_and_a_hand_set_one_is_refused():
    """A hand-set model.vocab_size was replaced by the layout's without a word."""
    from data.vocab import VocabLayout
    from model.transformer import TransformerConfig

    layout = VocabLayout(text_size=300, fsq_levels=(8, 5, 5, 5), max_grid=16)
    cfg = TransformerConfig().with_layout(layout)
    assert (cfg.vocab_size, cfg.text_vocab_size, cfg.visual_offset) == (
        layout.size,
        300,
        layout.visual_offset,
    )
    assert cfg.with_layout(layout) == cfg  # the layout's own values are fine
    with pytest.raises(ValueError, match=r"model.vocab_size=9999: set from the tokenizers"):
        TransformerConfig(vocab_size=9999).with_layout(layout)
    # a checkpoint's config.yaml: it trained on the layout's sizes, whatever it says
    assert TransformerConfig(vocab_size=9999).with_layout(layout, strict=False) == cfg
