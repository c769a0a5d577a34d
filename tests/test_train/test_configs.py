"""Every preset in configs/ composes onto the typed schema and builds its model; a misspelt key
is an error that names it."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

import train.app as app
from data.vocab import VocabLayout

CONFIGS = Path(app.CONFIG_DIR)
LAYOUT = VocabLayout(text_size=512, fsq_levels=(8, 5, 5, 5), max_grid=16)


def composed(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return app.to_run_config(compose("config", overrides=overrides))[0]


def presets():
    for group in sorted(p for p in CONFIGS.iterdir() if p.is_dir()):
        for yaml in sorted(group.glob("*.yaml")):
            yield f"{group.name}={yaml.stem}"


@pytest.mark.parametrize("choice", list(presets()))
def test_every_preset_composes_and_builds(choice):
    cfg = composed([choice])
    if cfg.task == "vtok" or choice.startswith("vtok="):
        model = cfg.vtok.build()
    else:
        model = cfg.model.with_layout(LAYOUT).build("meta")
    assert sum(p.numel() for p in model.parameters()) > 0


def test_a_misspelt_override_names_the_key():
    with pytest.raises(ConfigCompositionException, match="lrr"):
        composed(["optim.lrr=1"])
    with pytest.raises(Exception, match="n_layer"):
        composed(["model.n_layer=3"])


def test_data_sources_from_a_users_own_config_dir(tmp_path):
    """`earlyfuse-train --config-dir MY_CONFIGS data=mine`: the user's data/mine.yaml (here built
    on the demo's) composes onto the schema, also over an experiment's own data choice; a typo in
    it is an error naming the key."""
    import subprocess
    import sys

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.yaml").write_text(
        "defaults:\n  - demo\nsources:\n  - {name: notes, shards: [my/tokens/notes], weight: 1.0}\n"
        "seq_len: 1024\n"
    )
    cmd = [sys.executable, "-m", "train.app", "--config-dir", str(tmp_path)]
    p = subprocess.run(
        cmd + ["experiment=demo", "data=mine", "--cfg", "job"], capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    assert "- my/tokens/notes" in p.stdout and "seq_len: 1024" in p.stdout
    assert "runs/demo/val_tokens" in p.stdout  # the rest comes from the demo's data config
    (tmp_path / "data" / "typo.yaml").write_text("sources: []\nseq_lenn: 3\n")
    p = subprocess.run(cmd + ["data=typo", "--cfg", "job"], capture_output=True, text=True)
    assert p.returncode != 0 and "seq_lenn" in p.stderr
