"""Every preset in configs/ composes onto the typed schema and builds its model; a misspelt key
is an error that names it and the nearest known one, also when Hydra's `+key=` adds it; a resume
lists how the config changed and refuses the changes that break an exact resume."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

import train.app as app
from data.vocab import VocabLayout
from train.config import RunConfig
from train.config_check import (
    ConfigError,
    check_resume_config,
    config_diff,
    shown_change,
    unknown_keys,
    unknown_override_keys,
)

CONFIGS = Path(app.CONFIG_DIR)
LAYOUT = VocabLayout(text_size=512, fsq_levels=(8, 5, 5, 5), max_grid=16)


def composed(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return app.to_run_config(compose("config", overrides=overrides))[0]


def presets():
    for group in sorted(p for p in CONFIGS.iterdir() if p.is_dir()):
        for preset in sorted(group.glob("*.yaml")):
            yield f"{group.name}={preset.stem}"


def with_experiment(choice: str) -> list[str]:
    """A preset and what it composes over: a long-context stage over the gpu experiment of its
    model (a generic stage over gpu_1b, whose 32 heads take every stage's SP degree); the gpu
    training settings (bf16) over ZeRO 1, as the gpu experiments choose."""
    if choice == "train=gpu":
        return [choice, "deepspeed=zero1"]
    if not choice.startswith("stage="):
        return [choice]
    model = choice.removeprefix("stage=").split("_")[0]
    return [f"experiment=gpu_{model if model in ('125m', '1b') else '1b'}", choice]


@pytest.mark.parametrize("choice", list(presets()))
def test_every_preset_composes_and_builds(choice):
    cfg = composed(with_experiment(choice))
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


def test_a_key_added_with_plus_is_still_checked_against_the_schema():
    """Hydra's `+key=` adds a key even to the typed schema; to_run_config refuses it by name."""
    with pytest.raises(ConfigError, match=r"optim\.lrr \(did you mean optim\.lr\?\)"):
        composed(["+optim.lrr=1"])
    with pytest.raises(ConfigError, match="unknown config key"):
        composed(["+foo=1"])
    cfg = composed(["+deepspeed.config.foo=1"])  # a free-form dict: anything goes
    assert cfg.deepspeed.config["foo"] == 1


def test_a_key_given_at_the_wrong_level_is_pointed_to_where_it_lives():
    """``model.n_heads`` lives in ``model.attention``: the refusal names the full path, for an
    override and for a key in a composed config; a name found in many places names a few."""
    assert unknown_override_keys(["model.n_heads=7", "seq_len=9"], RunConfig, set()) == [
        "model.n_heads (did you mean model.attention.n_heads?)",
        "seq_len (did you mean data.seq_len?)",
    ]
    # A nested group of a user's --config-dir (data/extra) is Hydra's to find, as data=demo is
    assert unknown_override_keys(["+data/extra=x", "+dat/extra=x"], RunConfig, {"data"}) == [
        "dat/extra (did you mean data?)"
    ]
    (common,) = unknown_keys({"window": 3}, RunConfig)
    assert common.startswith("window (did you mean ") and common.endswith(" more?)")
    with pytest.raises(
        ConfigError, match=r"model\.n_heads \(did you mean model\.attention\.n_heads\?\)"
    ):
        composed(["+model.n_heads=7"])


@pytest.mark.parametrize("override", ["optim.lrr=1", "+optim.lrr=1", "++model.n_layer=3"])
def test_earlyfuse_train_refuses_an_unknown_key_in_either_form(override, tmp_path):
    p = run_app(["experiment=debug", f"run_dir={tmp_path / 'r'}", override])
    assert p.returncode == 2, p.stderr[-2000:]
    assert "unknown config key" in p.stderr and "did you mean" in p.stderr
    assert not (tmp_path / "r").exists()


def test_resume_config_differences_are_listed_and_the_breaking_ones_named():
    saved = "task: lm\ntrain:\n  steps: 150\n  micro_batch: 4\n  log_every: 10\n"
    new = "task: lm\ntrain:\n  steps: 70\n  micro_batch: 4\n  log_every: 5\n"
    assert config_diff(yaml.safe_load(saved), yaml.safe_load(new)) == [
        ("train.log_every", 10, 5),
        ("train.steps", 150, 70),
    ]
    check = dict(saved_world_size=1, where="ck/step_1/config.yaml", show=False)
    with pytest.raises(ConfigError, match=r"break an exact resume: train\.steps\. Undo"):
        check_resume_config(saved, new, world_size=1, allowed=False, **check)
    check_resume_config(saved, new, world_size=1, allowed=True, **check)
    check_resume_config(saved, saved.replace("10", "5"), world_size=1, allowed=False, **check)
    with pytest.raises(ConfigError, match=r"world size"):
        check_resume_config(saved, saved, world_size=2, allowed=False, **check)
    # A model setting computes another function (a RoPE base raised for a longer stage); the
    # blocks recomputed in the backward are the same values
    model = "task: lm\nmodel:\n  activation_checkpoint_every: 0\n  rope:\n    theta: 10000.0\n"
    with pytest.raises(ConfigError, match=r"break an exact resume: model\.rope\.theta\. Undo"):
        check_resume_config(
            model, model.replace("10000", "500000"), world_size=1, allowed=False, **check
        )
    check_resume_config(
        model, model.replace("every: 0", "every: 1"), world_size=1, allowed=False, **check
    )


def test_a_change_of_the_sources_is_shown_source_by_source():
    code, text = {"name": "code", "weight": 0.1}, {"name": "text", "weight": 0.2}
    more = [{**code, "weight": 0.4}, text, {"name": "new", "weight": 1.0}]
    assert shown_change([code, text], more) == "new added; code.weight 0.1 -> 0.4"
    assert shown_change([code, text], [code]) == "text removed"
    assert shown_change(1, 2) == "1 -> 2"
    assert shown_change([code, text], [text, code]).startswith("[{")  # the order: whole lists


@pytest.mark.parametrize(
    ("saved", "new", "named"),
    [
        ("model:\n  dim: 64\n", "model:\n  dim: 96\n", "model.dim"),
        ("data:\n  seq_len: 256\n", "data:\n  seq_len: 512\n", "data.seq_len"),
        (
            "data:\n  sources: [{name: a, weight: 1.0}]\n",
            "data:\n  sources: [{name: a, weight: 1.0}, {name: b, weight: 1.0}]\n",
            "data.sources",
        ),
    ],
)
def test_a_change_no_resume_can_carry_is_refused_as_such_even_when_changes_are_allowed(
    saved, new, named
):
    """The first refusal says a new run is needed, instead of offering
    train.allow_config_change, after which the weights or the data position are refused."""
    check = dict(saved_world_size=1, world_size=1, where="ck/step_1/config.yaml", show=False)
    for allowed in (False, True):
        with pytest.raises(
            ConfigError, match=rf"no resume can carry: {re.escape(named)} .*run_dir"
        ):
            check_resume_config("task: lm\n" + saved, "task: lm\n" + new, allowed=allowed, **check)
    # the visual tokenizer's run trains neither the model section nor on data's rows
    check_resume_config("task: vtok\n" + saved, "task: vtok\n" + new, allowed=True, **check)
    # new weights for the same sources: a resume carries them (with the flag)
    weights = "task: lm\ndata:\n  sources: [{name: a, weight: %s}]\n"
    check_resume_config(weights % 1.0, weights % 2.0, allowed=True, **check)


def test_data_sources_from_a_users_own_config_dir(tmp_path):
    """`earlyfuse-train --config-dir MY_CONFIGS data=mine`: the user's data/mine.yaml (here built
    on the demo's) composes onto the schema, also over an experiment's own data choice; a typo in
    it is one line naming the file and the key (inside a list item: with the item's path, which
    OmegaConf leaves out), exit code 2, as the same typo on the command line is (before: Hydra's
    multi-line ConfigKeyError report, exit code 1); so is a choice of a data config that is not
    there (before: Hydra's report, exit code 1)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.yaml").write_text(
        "defaults:\n  - demo\nsources:\n  - {name: notes, shards: [my/tokens/notes], weight: 1.0}\n"
        "seq_len: 1024\n"
    )
    cmd = ["--config-dir", str(tmp_path)]
    p = run_app(cmd + ["experiment=demo", "data=mine", "--cfg", "job"])
    assert p.returncode == 0, p.stderr
    assert "- my/tokens/notes" in p.stdout and "seq_len: 1024" in p.stdout
    assert "runs/demo/val_tokens" in p.stdout  # the rest comes from the demo's data config
    (tmp_path / "data" / "typo.yaml").write_text("sources: []\nseq_lenn: 3\n")
    (tmp_path / "data" / "typo_in_list.yaml").write_text("sources:\n  - {name: a, shardz: [x]}\n")
    (tmp_path / "data" / "not_a_number.yaml").write_text("seq_len: many\n")
    for choice, problem in [
        ("typo", "unknown config key data.seq_lenn (did you mean data.seq_len?)"),
        (
            "typo_in_list",
            "unknown config key data.sources[0].shardz (did you mean data.sources[0].shards?)",
        ),
        ("not_a_number", "data.seq_len: Value 'many' of type 'str' could not be converted"),
    ]:
        p = run_app(cmd + [f"data={choice}", "--cfg", "job"])
        assert p.returncode == 2, p.stderr
        line = f"earlyfuse-train: {tmp_path / 'data' / choice}.yaml: {problem}"
        assert p.stderr.startswith(line) and p.stderr.count("\n") == 1, p.stderr
    p = run_app(cmd + ["data=absent", "--cfg", "job"])
    assert p.returncode == 2, p.stderr
    assert p.stderr == (
        "earlyfuse-train: data=absent: config group data has no option 'absent' (there are: "
        "demo, mine, none, not_a_number, typo, typo_in_list)\n"
    )


def test_a_typo_in_a_list_item_of_a_nested_group_is_named_at_its_package(tmp_path):
    """A list item's misspelt key is named with the package Hydra put the file at: an override's
    ``GROUP@PACKAGE``, the header's (``_global_.data`` is ``data``), else the group's path
    (before: the file's folder alone, ``extra.sources[0].shardz`` for data/extra/x.yaml)."""
    from train.app import list_item_path

    (tmp_path / "data" / "extra").mkdir(parents=True)
    item = "sources:\n  - {name: a, shards: [x]}\n  - {name: b, shardz: [x]}\n"
    (tmp_path / "data" / "extra" / "x.yaml").write_text(item)
    p = run_app(["--config-dir", str(tmp_path), "+data/extra@data=x", "--cfg", "job"])
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr == (
        f"earlyfuse-train: {tmp_path}/data/extra/x.yaml: unknown config key "
        "data.sources[1].shardz (did you mean data.sources[1].shards?)\n"
    )
    nested = tmp_path / "data" / "extra" / "x.yaml"
    assert list_item_path(nested, "shardz", None, "data.extra") == "data.extra.sources[1]."
    for header, package in [
        ("_global_.data", "data."),
        ("_global_", ""),
        ("data.sub", "data.sub."),
    ]:
        nested.write_text(f"# @package {header}\n{item}")
        assert list_item_path(nested, "shardz", None, "data.extra") == f"{package}sources[1]."


def test_a_group_chosen_twice_names_each_option_at_its_own_package():
    """``+db@src=a +db@dst=b`` (Hydra's way to use one group twice): b's keys were named at the
    first override's package, src."""
    from train.app import config_package

    args = ["+data/extra@data=y", "+data/extra@data.two=x", "+data/more@data.three=[a,b]"]
    assert config_package("data/extra/x", args) == "data.two"
    assert config_package("data/more/b", args) == "data.three"  # a list of options
    assert config_package("data/extra/x", ["+data/extra@data.four='x'"]) == "data.four"
    assert config_package("data/extra/y", args) == "data"
    assert config_package("data/extra/z", args) == "data.extra"


def run_app(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """``earlyfuse-train ARGS`` for a config that stops before the run, HYDRA_FULL_ERROR as given
    (else unset): in this process, which has paid torch's import already (a subprocess pays
    3 s for it); HYDRA_FULL_ERROR=1, where Hydra raises, in a subprocess."""
    environ = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | env
    if env.get("HYDRA_FULL_ERROR") == "1":
        cmd = [sys.executable, "-m", "train.app", *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=300)
    from contextlib import redirect_stderr, redirect_stdout
    from io import StringIO
    from unittest import mock

    accepted = AssertionError("the config was accepted: the run would start in this process")
    out, err, code = StringIO(), StringIO(), 0
    # Hydra's job logging adds a handler on the redirected stdout and lowers the root level
    root, level, handlers = logging.getLogger(), logging.getLogger().level, logging.root.handlers[:]
    with (
        mock.patch.dict(os.environ, environ, clear=True),
        mock.patch.object(sys, "argv", ["earlyfuse-train", *args]),
        mock.patch.object(app, "run", side_effect=accepted),
        redirect_stdout(out),
        redirect_stderr(err),
    ):
        try:
            app.main()
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--config-dir", "{dir}", "data=tab"],
            "{dir}/data/tab.yaml, line 2, column 9: not valid YAML: found character '\\t' that "
            "cannot start any token (while scanning for the next token)",
        ),
        (
            ["--config-dir", "{dir}", "data=unclosed"],
            "{dir}/data/unclosed.yaml, line 2, column 8: not valid YAML: expected ',' or ']', but "
            "got ':' (while parsing a flow sequence)",
        ),
        (
            ["--config-dir", "{dir}", "data=a_list"],
            "{dir}/data/a_list.yaml: Merge error: list is not a subclass of LoaderConfig",
        ),
        (
            ["experiment=nope"],
            "experiment=nope: config group experiment has no option 'nope' (there are: debug, demo,",
        ),
        (
            ["train.steps=abc"],
            "override train.steps=abc: Value 'abc' of type 'str' could not be converted to Integer",
        ),
        (["train.steps==3"], "cannot parse override 'train.steps==3': extraneous input '='"),
        (  # OmegaConf's words were "OptimConfig (DictConfig) does not support deletion"
            ["~optim.lr"],
            "override '~optim.lr': a key of the schema cannot be removed; give it a value "
            "(optim.lr=...), or turn a feature off by its own key",
        ),
        (  # Hydra said "Multiple values for data. To override a value use 'override data: demo'"
            ["--config-dir", "{dir}", "experiment=no_override"],
            "{dir}/experiment/no_override.yaml: picks data with '- /data: ...', but data is "
            "chosen already (the primary config's defaults): write '- override /data: ...'",
        ),
        (  # said as if model=nosuch had been typed
            ["--config-dir", "{dir}", "experiment=no_option"],
            "{dir}/experiment/no_option.yaml: model=nosuch: config group model has no option",
        ),
        (  # a preset's name alone
            ["demo"],
            "cannot parse override 'demo': missing EQUAL at '<EOF>': did you mean experiment=demo "
            "or data=demo or model=demo?",
        ),
        (
            ["name='my run"],
            'cannot parse override "name=\'my run": cannot read "\'my run" (character 6): an '
            "unclosed quote?",
        ),
        (
            ["--config-dir", "{dir}/nowhere"],
            "--config-dir {dir}/nowhere: not there; give the folder that holds your config",
        ),
        (
            ["--config-dir", "{dir}/data/typo.yaml"],
            "--config-dir {dir}/data/typo.yaml: a file; give",
        ),
        (["hydra.run.dir={dir}/a_file/run"], "{dir}/a_file/run: Not a directory"),
        (
            ["=3"],
            "unknown config key(s): '=3' (no key before =; write KEY=VALUE, no spaces around =)",
        ),
        (  # a number's comma is a sweep: a list (the advice it was given) would not do either
            ["optim.lr=1e-3,1e-4"],
            "override 'optim.lr=1e-3,1e-4': one value per run (no sweeps): one earlyfuse-train "
            "per value, each with its own run_dir (docs/training.md)",
        ),
        (  # an optional number (int | None) too
            ["data.tokenize.video_max_tokens=1,2"],
            "override 'data.tokenize.video_max_tokens=1,2': one value per run (no sweeps)",
        ),
        (
            ["name=a,b"],
            "override 'name=a,b' holds a comma: give a string as name='a,b' (one run per "
            "command: no sweeps)",
        ),
        (["-m", "experiment=debug"], "--multirun (-m, hydra.mode=MULTIRUN) is not supported: a"),
        (  # a sweep's own settings: Hydra's traceback through OmegaConf, exit code 1
            ["experiment=debug", "hydra.sweeper.params={{a:1}}"],
            "--multirun (-m, hydra.mode=MULTIRUN) is not supported: a",
        ),
        (  # a list of a group's options merges them: the advice must not be to give one
            ["model=debug,demo"],
            "override 'model=debug,demo': one run per command (no sweeps): give model=debug or "
            "model=demo",
        ),
        (
            ["optim.lr=choice(1e-3,2e-3)"],
            "override 'optim.lr=choice(1e-3,2e-3)' is a sweep: one run per command (no sweeps)",
        ),
        (["++hydra.mode=multirun"], "--multirun (-m, hydra.mode=MULTIRUN) is not supported: a"),
        (
            ["experiment=null"],
            "experiment=null: a config group takes one of its options (debug, demo, ",
        ),
        (  # the habit of templates without an experiment default
            ["+experiment=debug"],
            "override '+experiment=debug': experiment is chosen in the config already; give "
            "experiment=debug (without the +)",
        ),
        (
            ["data.sources[0].weight=0.5"],
            "cannot parse override 'data.sources[0].weight=0.5': cannot read '[0].weight=0.5' "
            "(character 13): an override cannot index a list; give the whole list (KEY=[...])",
        ),
        (
            ["--config-dir", "{dir}", "experiment=no_header"],
            "{dir}/experiment/no_header.yaml: Could not override 'model@experiment.model'. A file "
            "that picks other groups' options (override /GROUP: ...) starts with '# @package "
            "_global_', as experiment files do",
        ),
        (  # a dict of free keys given new ones: Hydra's way to add them was left out of the line
            ["deepspeed.config={{zero_optimization:{{stage:2}}}}"],
            "Could not override 'deepspeed.config': Key 'zero_optimization' is not in struct (to "
            "add keys to it: +deepspeed.config={{zero_optimization:{{stage:2}}}})",
        ),
    ],
)
def test_a_mistake_found_while_composing_is_one_line_with_exit_code_2(args, line, tmp_path):
    """A YAML syntax error in the user's config file, a group option, an override that cannot be
    parsed or merged, a --config-dir or a hydra.run.dir that is not there: one line naming it,
    exit code 2 (before: Hydra's multi-line report, a traceback for the YAML and the run folder,
    exit code 1). A sweep (--multirun) is refused: the process ends with its first run's exit
    code (before: the sweep stopped after its first run, exit code 0)."""
    assert_one_line(args, line, tmp_path)


@pytest.mark.parametrize("full_error", ["0", ""])
@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--config-dir", "{dir}", "data=typo"],
            "{dir}/data/typo.yaml: unknown config key data.seq_lenn (did you mean data.seq_len?)",
        ),
        (["experiment=nope"], "experiment=nope: config group experiment has no option 'nope'"),
    ],
)
def test_hydra_full_error_other_than_1_keeps_the_one_line(args, line, full_error, tmp_path):
    """Hydra reads HYDRA_FULL_ERROR=0 or empty as unset (before: any value in the user's
    environment counted as asking for the full trace, and a misspelt key in a file became
    Hydra's multi-line report, exit code 1)."""
    assert_one_line(args, line, tmp_path, HYDRA_FULL_ERROR=full_error)


def assert_one_line(args: list[str], line: str, tmp_path: Path, **env: str) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tab.yaml").write_text("sources: []\nseq_len:\t256\n")
    (tmp_path / "data" / "unclosed.yaml").write_text("sources: [a, b\nseq_len: 256\n")
    (tmp_path / "data" / "typo.yaml").write_text("sources: []\nseq_lenn: 3\n")
    (tmp_path / "data" / "a_list.yaml").write_text("- a\n- b\n")
    (tmp_path / "a_file").write_text("")
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "no_header.yaml").write_text(
        "defaults:\n  - override /model: debug\ntrain:\n  steps: 3\n"
    )
    (tmp_path / "experiment" / "no_override.yaml").write_text(
        "# @package _global_\ndefaults:\n  - /data: demo\n"
    )
    (tmp_path / "experiment" / "no_option.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: nosuch\n"
    )
    # --cfg job: composed, printed, never run; the run folder is made only by a run
    stop = [] if args[0].startswith("hydra.run.dir") else ["--cfg", "job"]
    p = run_app([a.format(dir=tmp_path) for a in args] + stop, **env)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith(f"earlyfuse-train: {line.format(dir=tmp_path)}"), p.stderr
    assert p.stderr.count("\n") == 1, p.stderr


def test_a_runs_own_config_yaml_composes_as_the_primary_config(tmp_path, monkeypatch):
    """`--config-path RUN_DIR --config-name config`, Hydra's way to run a saved config again:
    the file has no defaults list, so it composed without the schema (before: a bare
    AssertionError, exit code 1, and Hydra's outputs/DATE/TIME/ and app.log in the cwd).
    Checked through a value the schema refuses."""
    shown = run_app(["experiment=debug", "--cfg", "job", "--resolve"])
    assert shown.returncode == 0, shown.stderr
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(shown.stdout)
    monkeypatch.chdir(tmp_path)
    for where in (str(tmp_path / "run"), "run", "--config-path=run"):
        # relative to the folder the command runs in (Hydra: to train/, as a Python package)
        given = [where] if where.startswith("--") else ["--config-path", where]
        p = run_app([*given, "--config-name", "config", "train.steps=0"])
        assert p.returncode == 2, p.stderr
        assert p.stderr.startswith("earlyfuse-train: train.steps 0"), p.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]


def test_hydra_full_error_1_still_gives_hydras_full_trace(tmp_path):
    p = run_app(["experiment=nope"], HYDRA_FULL_ERROR="1")
    assert p.returncode == 1 and "Traceback" in p.stderr
    assert "MissingConfigException: In 'config': Could not find 'experiment/nope'" in p.stderr


def test_a_run_given_its_own_data_config_is_named_after_it(tmp_path, monkeypatch):
    """`earlyfuse-train --config-dir DIR experiment=demo data=mine` (no name=) is the run "mine",
    its run folder runs/mine; a name= given wins; without data= the experiment's name stays."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.yaml").write_text("defaults:\n  - demo\nseq_len: 256\n")
    seen = []
    monkeypatch.setattr(
        app, "run", lambda cfg, resolved, extra=None, command=(): seen.append(cfg) or 0
    )
    for argv in (
        ["experiment=demo", "data=mine"],
        ["experiment=demo", "data=mine", "name=try2"],
        ["experiment=demo"],
        ["experiment=demo", "data=mine", "stage=long_8k"],  # not the run it continues
    ):
        monkeypatch.setattr("sys.argv", ["earlyfuse-train", "--config-dir", str(tmp_path), *argv])
        with pytest.raises(SystemExit) as done:
            app.main()
        assert done.value.code == 0
    assert [(cfg.name, cfg.run_dir, cfg.data.seq_len) for cfg in seen] == [
        ("mine", "runs/mine", 256),
        ("try2", "runs/try2", 256),
        ("demo", "runs/demo", 512),
        ("mine_long_8k", "runs/mine_long_8k", 8192),
    ]


def test_a_config_dir_one_level_too_deep_is_said(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\nname: mine\n")
    p = run_app(["--config-dir", str(tmp_path / "experiment"), "experiment=mine", "--cfg", "job"])
    assert p.returncode == 2, p.stderr
    assert p.stderr.endswith(
        f"; --config-dir {tmp_path / 'experiment'} is a group's own folder: give the folder that "
        "holds it\n"
    )


def test_a_users_config_named_like_one_of_ours_is_refused_naming_both(tmp_path):
    """Hydra searches the project's configs before a --config-dir (or hydra.searchpath): a
    user's experiment/demo.yaml was ignored for the project's without a word. A copy that is
    byte for byte ours changes nothing and is let through."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "data").mkdir()
    ours = Path(app.CONFIG_DIR)
    (tmp_path / "data" / "demo.yaml").write_bytes((ours / "data" / "demo.yaml").read_bytes())
    assert (
        run_app(["--config-dir", str(tmp_path), "experiment=demo", "--cfg", "job"]).returncode == 0
    )
    mine = tmp_path / "experiment" / "demo.yaml"
    mine.write_text("# @package _global_\nname: shadow\n")
    said = (
        f"earlyfuse-train: {mine}: earlyfuse has a config of that name "
        f"({ours / 'experiment' / 'demo.yaml'}), which Hydra finds before yours: yours would be "
        "ignored; rename it (e.g. experiment/my_demo.yaml) and choose it by its new name\n"
    )
    for where in (["--config-dir", str(tmp_path)], [f"hydra.searchpath=[file://{tmp_path}]"]):
        p = run_app([*where, "experiment=demo", "--cfg", "job"])
        assert p.returncode == 2 and p.stderr == said, p.stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ["--experiment=demo"],
            "--experiment: earlyfuse-train takes Hydra overrides, key=value "
            "without dashes (experiment=demo); its flags are Hydra's own",
        ),
        (
            ["--exp", "demo"],
            "--exp: earlyfuse-train takes Hydra overrides, key=value without dashes (exp=demo)",
        ),
        (
            ["--config_dir", "x"],
            "--config_dir: not a flag of earlyfuse-train (Hydra's); did you mean --config-dir?",
        ),
        (
            ["--steps"],
            "--steps: earlyfuse-train takes Hydra overrides, key=value without "
            "dashes (steps=VALUE)",
        ),
    ],
)
def test_an_override_written_as_a_flag_is_one_line(args, said):
    """argparse took --experiment=demo for an abbreviation of Hydra's --experimental-rerun,
    which failed with a traceback, exit code 1."""
    p = run_app(args)
    assert p.returncode == 2 and p.stderr.startswith(f"earlyfuse-train: {said}"), p.stderr
    assert p.stderr.count("\n") == 1


def test_a_run_dir_that_holds_data_is_refused_before_anything_is_written(tiny_tokens, tmp_path):
    """`experiment=debug data=demo` is named after its data, runs/demo, where make demo keeps its
    corpus and tokens: the run wrote its checkpoints and logs among them."""
    data = tmp_path / "demo"
    shutil.copytree(tiny_tokens, data / "tokens")
    before = sorted(data.rglob("*"))
    args = [f"run_dir={data}", "experiment=debug", "train.steps=1"]
    p = subprocess.run(
        [sys.executable, "-m", "train.app", *args], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 2, p.stderr[-2000:]
    said = f"earlyfuse-train: run_dir {data} holds data, not a run (tokens/): the run would write"
    assert said in p.stderr and sorted(data.rglob("*")) == before


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.sequence_parallel=3"], r"sequence_parallel=3: .*model\.attention\.n_heads = 4"),
        (["train.sequence_parallel=2", "data.seq_len=2047"], r"2047 tokens, data\.seq_len"),
        (["train.sequence_parallel=0"], "must be >= 1"),
        (["task=vtok", "train.sequence_parallel=2"], "only the lm task"),
    ],
)
def test_sequence_parallel_is_validated_against_heads_and_row_length(overrides, message):
    assert composed(["train.sequence_parallel=2"]).train.sequence_parallel == 2
    with pytest.raises(ValueError, match=message):
        composed(overrides)


def test_a_sequence_parallel_degree_must_divide_the_processes():
    from train.sequence_groups import check_run

    check_run(1, 3)
    check_run(2, 4)
    with pytest.raises(
        ConfigError,
        match=r"=2 .* \(3\); run a multiple of 2 processes, or train\.sequence_parallel one of \[1, 3\]$",
    ):
        check_run(2, 3)  # started by a launcher already: what would fit, no launcher hint
    with pytest.raises(
        ConfigError, match=r"processes \(1\); start it with earlyfuse-torchrun --nproc_per_node N"
    ):
        check_run(2, 1)
    # Only the degrees the model and row split over are suggested (6 processes, 2 heads: 1, 2)
    with pytest.raises(ConfigError, match=r"train\.sequence_parallel one of \[1, 2\]$"):
        check_run(4, 6, lambda n: 2 % n == 0)


def test_zero3_with_sequence_parallel_reduces_gradients_by_all_reduce():
    """DeepSpeed's ZeRO-3 reduce-scatter ignores the SP groups (gradients 1/P of the row's), so
    SP under ZeRO 3 turns it off, and a deepspeed.config that brings it back (reduce_scatter on,
    contiguous_gradients off, a reduce bucket smaller than a parameter) is refused."""
    from train.engine import ds_config

    sp = ["train.sequence_parallel=2", "deepspeed=zero3"]
    assert ds_config(composed(sp), 2)["zero_optimization"]["reduce_scatter"] is False
    assert "reduce_scatter" not in ds_config(composed(["deepspeed=zero3"]), 2)["zero_optimization"]
    for setting, refused in (
        ("reduce_scatter: true", r"reduce_scatter=true; leave reduce_scatter out"),
        ("contiguous_gradients: false", r"contiguous_gradients=false; leave it on"),
        (
            "reduce_bucket_size: 1000",
            r"reduce_bucket_size=1,000 is below the largest parameter .*; raise it to at least that",
        ),
    ):
        changed = composed([*sp, f"+deepspeed.config.zero_optimization={{{setting}}}"])
        with pytest.raises(  # ConfigError: one line and exit code 2, not a traceback
            ConfigError, match=rf"{refused} \(ZeRO 3 with train\.sequence_parallel=2"
        ):
            ds_config(changed, 2, largest_param=4096)
    # a bucket that holds the largest parameter takes the all-reduce path: allowed
    roomy = composed([*sp, "+deepspeed.config.zero_optimization={reduce_bucket_size: 4096}"])
    assert (
        ds_config(roomy, 2, largest_param=4096)["zero_optimization"]["reduce_bucket_size"] == 4096
    )


def test_zero_buckets_hold_the_model_at_most_unless_the_config_says_otherwise():
    """DeepSpeed's 5e8-element buckets were allocated afresh every ZeRO 1-2 micro-step, whatever
    the model: 2 GB a step. They are the model's size at most; deepspeed.config still wins."""
    from train.engine import ds_config

    zero = ds_config(composed(["deepspeed=zero1"]), 1, largest_param=64, params=1001)
    assert zero["zero_optimization"] | {"stage": 1} == {  # a multiple of ZeRO's alignment
        "stage": 1,
        "reduce_bucket_size": 1008,
        "allgather_bucket_size": 1008,
    }
    big = ds_config(composed(["deepspeed=zero2"]), 1, 64, params=10**10)["zero_optimization"]
    assert big["reduce_bucket_size"] == big["allgather_bucket_size"] == 500_000_000
    assert "reduce_bucket_size" not in ds_config(composed([]), 1, 64, 1000)["zero_optimization"]
    own = composed(
        ["deepspeed=zero1", "+deepspeed.config.zero_optimization={reduce_bucket_size: 7}"]
    )
    assert ds_config(own, 1, 64, 1000)["zero_optimization"]["reduce_bucket_size"] == 7


def test_another_data_parallel_size_breaks_an_exact_resume_another_sp_degree_alone_does_not():
    """Rows per step follow the data-parallel replicas (world size / SP degree, both from the
    checkpoint's meta and the running world): SP 1 on one process resumed at SP 2 on two reads the
    same rows; SP 2 resumed at SP 1 on as many processes doubles the replicas. Under MoE with a
    capacity limit another SP degree drops other tokens, so it breaks the resume too."""
    saved, new = "task: lm\n", "task: lm\n"
    check = dict(where="ck/step_1/config.yaml", show=False, allowed=False)
    check_resume_config(saved, new, saved_world_size=1, world_size=2, saved_sp=1, sp=2, **check)
    check_resume_config(saved, new, saved_world_size=2, world_size=1, saved_sp=2, sp=1, **check)
    with pytest.raises(ConfigError, match=r"break an exact resume: data-parallel replicas"):
        check_resume_config(saved, new, saved_world_size=2, world_size=2, saved_sp=2, **check)
    with pytest.raises(ConfigError, match=r"break an exact resume: data-parallel replicas"):
        check_resume_config(saved, new, saved_world_size=1, world_size=2, saved_sp=None, **check)
    moe = "task: lm\nmodel:\n  moe:\n    num_experts: 4\n    capacity_factor: 1.25\n"
    with pytest.raises(ConfigError, match=r"train\.sequence_parallel under MoE"):
        check_resume_config(moe, moe, saved_world_size=1, world_size=2, saved_sp=1, sp=2, **check)
    unlimited = moe.replace("1.25", "0")
    check_resume_config(
        unlimited, unlimited, saved_world_size=1, world_size=2, saved_sp=1, sp=2, **check
    )


def test_another_loader_worker_count_breaks_an_exact_resume_unless_it_is_one_consumer_alike():
    """Before: data.num_workers changed freely, and the resumed run differed from both
    uninterrupted ones (each worker is a consumer with a slice of its own)."""
    saved = "task: lm\ndata:\n  num_workers: 1\n"
    check = dict(saved_world_size=1, world_size=1, where="ck/step_1/config.yaml", show=False)
    with pytest.raises(ConfigError, match=r"break an exact resume: data\.num_workers\. Undo"):
        check_resume_config(saved, saved.replace("1", "2"), allowed=False, **check)
    check_resume_config(saved, saved.replace("1", "2"), allowed=True, **check)
    check_resume_config(saved, saved.replace("1", "0"), allowed=False, **check)  # one consumer
    vtok = "task: vtok\ndata:\n  num_workers: 1\n"  # the crops do not depend on it
    check_resume_config(vtok, vtok.replace("1", "3"), allowed=False, **check)


def test_a_typo_inside_a_list_element_of_an_override_names_the_key(tmp_path):
    """Before: Hydra's own error, a traceback without a suggestion, exit code 1."""
    from train.config import RunConfig
    from train.config_check import unknown_override_keys

    bad = "data.sources=[{name: a, shardz: [x]}, {name: b, shards: [y], wieght: 2}]"
    assert unknown_override_keys([bad], RunConfig, {"experiment"}) == [
        "data.sources[0].shardz (did you mean data.sources[0].shards?)",
        "data.sources[1].wieght (did you mean data.sources[1].weight?)",
    ]
    p = run_app(["experiment=debug", f"run_dir={tmp_path / 'r'}", bad])
    assert p.returncode == 2, p.stderr[-2000:]
    assert "did you mean data.sources[0].shards?" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.steps=0", "train.steps 0: give a positive number"),
        ("train.micro_batch=0", "train.micro_batch 0: give 1 or more"),
        ("train.grad_accum=-1", "train.grad_accum -1: give 1 or more"),
        ("model.dim=66", "model.dim 66 is not divisible by model.attention.n_heads 4; set "),
        ("deepspeed.zero_stage=4", "deepspeed.zero_stage 4: choose 0, 1, 2 or 3"),
        # Before: a traceback from the optimizer, the schedule or the loader, exit code 1 ...
        ("optim.lr=-1", "optim.lr -1.0: give a learning rate >= 0"),
        ("optim.betas=[0.9]", "optim.betas [0.9]: give two numbers from 0 to below 1"),
        ("optim.eps=0", "optim.eps 0.0: give a small positive number"),
        ("optim.weight_decay=-0.1", "optim.weight_decay -0.1: give 0 or more"),
        ("optim.schedule=linear", "optim.schedule 'linear': choose one of cosine, wsd, constant"),
        # skip only for the detectors that judge before the update (collapse judges after it)
        ("monitor.collapse.action=stop", "action 'stop': choose log, warn, rollback, halt"),
        ("train.log_every=0", "train.log_every 0: give 1 or more steps"),
        ("data.seq_len=-5", "data.seq_len -5: give the row length in tokens"),
        ("data.num_workers=-1", "data.num_workers -1: give 0 (load in the main process)"),
        # ... or a run that trained through it, exit code 0
        ("data.max_pending=0", "data.max_pending 0: give 1 or more"),  # 0 steps
        ("data.shuffle_buffer=-1", "data.shuffle_buffer -1: give 0 or more"),
        ("deepspeed.offload_optimizer=true", "offload_optimizer=true needs deepspeed.zero_stage 1"),
        (
            "train.bf16=true",
            "train.bf16=true needs deepspeed.zero_stage 1 or more",
        ),  # a DeepSpeed traceback
        ("run_dir=", "run_dir is empty"),  # the run's files went into the current folder
        ("run_dir='runs/try[1]'", "run_dir 'runs/try[1]' holds [ ] * or ?: DeepSpeed finds"),
        ("name=", "name is empty"),  # into runs/, the folder of every run
        ("data.seq_len=0", "data.seq_len 0: give the row length in tokens"),
        ("optim.warmup_steps=-1", "optim.warmup_steps -1: give 0 or more"),
        ("optim.min_lr_ratio=2", "optim.min_lr_ratio 2.0: give the final lr as a fraction"),
        ("optim.clip_grad=-1", "optim.clip_grad -1.0: give 0 (no clipping) or more"),
        ("train.ckpt_every=-1", "train.ckpt_every -1: give a number of steps, 0 for only at"),
        ("train.keep_last=0", "train.keep_last 0: keep 1 checkpoint or more"),
        # ... or found as "no training image" (vtok)
        ("vtok_data.heldout_fraction=1.5", "vtok_data.heldout_fraction 1.5: give a fraction"),
        ("vtok_data.max_pixels=0", "vtok_data.max_pixels 0: give at least vtok_data.crop squared"),
        # A value left ??? and an interpolation to nothing, found as the config is resolved
        # (before: Hydra's report of an OmegaConf error, exit code 1)
        (
            "data.sources=[{shards: [x]}]",
            "data.sources[0].name: Structured config of type `SourceConfig` has missing "
            "mandatory value: name",
        ),
        ("run_dir=${nme}", "run_dir: Interpolation key 'nme' not found"),
    ],
)
def test_a_value_the_schema_refuses_is_a_config_error(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        composed(["experiment=debug", override])


def test_compiling_under_zero_3_is_a_config_error():
    """Before: accepted, the model and engine built, then dynamo's traceback at the first
    forward (ZeRO-3's parameter hooks cannot run inside a fullgraph block); auto stays eager."""
    with pytest.raises(ConfigError, match="train.compile=true with deepspeed.zero_stage 3"):
        composed(["experiment=debug", "deepspeed=zero3", "train.compile=true"])
    cfg = composed(["experiment=debug", "deepspeed=zero3", "train.compile=auto"])
    assert not cfg.train.compiles("cuda", cfg.deepspeed.zero_stage)


def test_a_visual_tokenizer_crop_of_zero_is_a_config_error():
    """Before: a shape error inside the network, exit code 1."""
    from train.tasks.vtok import VtokTask

    for crop in (0, -4, 6):
        cfg = composed(["experiment=vtok_debug", f"vtok_data.crop={crop}"])
        with pytest.raises(ConfigError, match=f"crop {crop} must be a positive multiple of"):
            VtokTask(cfg, dist=None)  # type: ignore[arg-type]


def test_earlyfuse_train_refuses_a_bad_value_in_one_line_with_exit_code_2(tmp_path):
    """Before: the schema's ValueError came out as Hydra's traceback, exit code 1."""
    p = run_app(["experiment=debug", f"run_dir={tmp_path / 'r'}", "train.steps=0"])
    assert p.returncode == 2, p.stderr[-2000:]
    assert "earlyfuse-train: train.steps 0: give a positive number" in p.stderr
    assert "Traceback" not in p.stderr


def test_earlyfuse_train_names_an_override_interpolating_nothing_in_one_line():
    """The command line's overrides were resolved as they were read for the run's name: an
    interpolation to nothing came out as Hydra's traceback, exit code 1, before the config check."""
    p = run_app(["experiment=debug", "run_dir=${nme}"])
    assert p.returncode == 2, p.stderr[-2000:]
    assert "earlyfuse-train: run_dir: Interpolation key 'nme' not found" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("value", ["true", "false", "auto", "True"])
def test_train_compile_takes_auto_true_false(value):
    assert composed(["experiment=debug", f"train.compile={value}"]).train.compile == value.lower()
    with pytest.raises(Exception, match="train.compile 'sometimes'"):
        composed(["experiment=debug", "train.compile=sometimes"])


def test_train_compile_auto_compiles_on_cuda_below_zero3_only():
    from train.build import compile_model
    from train.config import TrainConfig

    auto = TrainConfig()
    assert auto.compiles("cuda", 2) and not auto.compiles("cuda", 3)
    assert not auto.compiles("cpu", 0)  # make demo and CPU CI stay eager
    assert TrainConfig(compile="true").compiles("cpu", 3)
    assert not TrainConfig(compile="false").compiles("cuda", 0)
    vtok = composed(["experiment=vtok_debug"]).vtok.build()
    assert compile_model(vtok, asked=False) is False  # auto: left eager
    with pytest.raises(ConfigError, match="no compiled form"):
        compile_model(vtok, asked=True)


def tokens_per_step(cfg, gpus: int = 8) -> int:
    return (
        cfg.train.micro_batch
        * cfg.data.seq_len
        * cfg.train.grad_accum
        * gpus
        // cfg.train.sequence_parallel
    )


@pytest.mark.parametrize("model", ["125m", "1b"])
def test_long_context_stages_raise_theta_and_keep_tokens_per_step(model):
    """Each model's stages over its gpu experiment: longer rows, a larger RoPE base, more ranks per
    row at 32k and 128k, as many tokens per optimizer step (on 8 GPUs) as the 2k experiment and
    at most twice its tokens per GPU per micro-step; every stage's mix is its own, summing to 1."""
    base = composed([f"experiment=gpu_{model}"])
    previous = base
    for length in ("8k", "32k", "128k"):
        cfg = composed([f"experiment=gpu_{model}", f"stage={model}_{length}"])
        assert cfg.data.seq_len == {"8k": 8192, "32k": 32768, "128k": 131072}[length]
        assert cfg.model.rope.theta > previous.model.rope.theta
        assert cfg.train.sequence_parallel >= previous.train.sequence_parallel
        assert cfg.model.attention.n_heads % cfg.train.sequence_parallel == 0
        assert tokens_per_step(cfg) == tokens_per_step(base)
        per_gpu = cfg.train.micro_batch * cfg.data.seq_len // cfg.train.sequence_parallel
        # At most twice the 2k run's (the 1b at 128k: SP 8 is a whole node), with activation
        # checkpointing on, which the 2k presets leave off.
        assert per_gpu <= 2 * base.train.micro_batch * base.data.seq_len
        assert cfg.model.activation_checkpoint_every == 1
        # Raw sources get a row's budget per document, as tokenize --doc-budget gives token ones
        assert cfg.data.whole_documents and cfg.data.doc_budget == cfg.data.seq_len
        assert cfg.model.dim == base.model.dim  # the same network: init_from loads it
        assert all(f"/long_{length}/" in s.shards[0] for s in cfg.data.sources if s.name != "short")
        assert sum(s.weight for s in cfg.data.sources) == pytest.approx(1.0)
        previous = cfg
    assert previous.train.sequence_parallel > 1


def test_whole_documents_breaks_a_resume_when_it_changes_or_is_missing():
    """``data.whole_documents`` changes the packing: turning it on breaks an exact resume, and so
    does a checkpoint whose config has no such key (another earlyfuse's)."""
    saved = "task: lm\ndata:\n  seq_len: 256\n  whole_documents: false\n"
    args = dict(saved_world_size=1, world_size=1, allowed=False, where="r/ckpt", show=False)
    with pytest.raises(ConfigError, match="data.whole_documents"):
        check_resume_config(
            "task: lm\ndata:\n  seq_len: 256\n",
            "task: lm\ndata:\n  seq_len: 256\n  whole_documents: false\n",
            **args,
        )
    for value, refused in (("false", False), ("true", True)):
        new = f"task: lm\ndata:\n  seq_len: 256\n  whole_documents: {value}\n"
        if refused:
            with pytest.raises(ConfigError, match="data.whole_documents"):
                check_resume_config(saved, new, **args)
        else:
            check_resume_config(saved, new, **args)


def test_another_doc_budget_breaks_a_resume():
    """``data.doc_budget`` changes the tokens of raw sources tokenized online: a resume with
    another budget is refused, one with the same is not."""
    config = "task: lm\ndata:\n  seq_len: 256\n  doc_budget: {}\n"
    args = dict(saved_world_size=1, world_size=1, allowed=False, where="r/ckpt", show=False)
    check_resume_config(config.format(256), config.format(256), **args)
    with pytest.raises(ConfigError, match="data.doc_budget"):
        check_resume_config(config.format(0), config.format(256), **args)


def test_remote_token_shards_without_data_tokenizers_is_a_config_error(tiny_tokens):
    """A run over token shards in object storage needs data.tokenizers (a remote tokenizers/ is
    not fetched): a ConfigError naming each source, which earlyfuse-train prints without a
    traceback and exits 2."""
    import fsspec

    from data.loader import SourceConfig
    from train.config import RunConfig
    from train.tasks.lm import tokenizer_folder

    fs = fsspec.filesystem("memory")
    for path in tiny_tokens.rglob("*"):
        if path.is_file():
            fs.pipe_file(f"/cfgtok/{path.relative_to(tiny_tokens)}", path.read_bytes())
    cfg = RunConfig()
    cfg.data.sources = [SourceConfig(name="code", shards=["memory://cfgtok/code"])]
    try:
        with pytest.raises(ConfigError, match=r"source code: remote shards\); set data.tokenizers"):
            tokenizer_folder(cfg)
    finally:
        fs.rm("/cfgtok", recursive=True)


def test_token_data_that_cannot_be_read_is_named_before_its_tokenizers(tiny_tokens, tmp_path):
    """A token folder whose manifest is gone, empty or not a manifest, or that an unfinished
    tokenize left: the data's own problem is the message (it was "cannot find the tokenizers/
    folder; set data.tokenizers", which no setting fixed)."""
    from data.loader import SourceConfig
    from train.config import RunConfig
    from train.tasks.lm import tokenizer_folder

    cases = {
        "gone": (
            None,
            ".tokenize holds the work of an earlyfuse-prep tokenize that did not finish",
        ),
        "empty": (b"", "manifest.json is empty: not a manifest of earlyfuse-token-shards"),
        "object": (b"{}", "manifest.json has no format: not a manifest of earlyfuse-token-shards"),
    }
    for name, (content, said) in cases.items():
        folder = tmp_path / name
        shutil.copytree(tiny_tokens, folder)
        (folder / ".tokenize").mkdir(exist_ok=True)
        if content is None:
            (folder / "manifest.json").unlink()
        else:
            (folder / "manifest.json").write_bytes(content)
        cfg = RunConfig()
        cfg.data.sources = [
            SourceConfig(name=s, shards=[str(folder / s)]) for s in ("code", "text")
        ]
        with pytest.raises(ConfigError) as refused:
            tokenizer_folder(cfg)
        assert str(refused.value).startswith(f"source code: {folder / 'code'}/shard-"), name
        assert said in str(refused.value), name
        assert str(refused.value).endswith("(1 more source(s) unreadable too)"), name


def test_a_tokenizer_folder_swapped_after_tokenize_is_a_config_error(
    tiny_tokens, tiny_raw, tiny_tokenizers, tmp_path
):
    """The run takes its vocabulary from the tokenizers/ beside the token shards. One put there
    after tokenize (here: fewer text ids) would build the model for another vocabulary, the
    loader skipping every document holding an id past it and passing the others as tokens of
    another vocabulary; the run is refused before training, naming the folder and the source."""
    import dataclasses
    import shutil

    from data.loader import SourceConfig
    from data.train_text_tokenizer import train_text_tokenizer
    from train.config import RunConfig
    from train.tasks.lm import layout_of_data

    tokens = shutil.copytree(tiny_tokens, tmp_path / "tokens")
    cfg = RunConfig()
    cfg.data.sources = [SourceConfig(name="text", shards=[str(tokens / "text")])]
    assert layout_of_data(cfg)[1] == tokens / "tokenizers"  # as made: accepted
    path = tokens / "tokenizers" / "vocab_layout.json"
    layout = VocabLayout.load(path)
    dataclasses.replace(layout, text_size=layout.text_size - 100).save(path)
    with pytest.raises(ConfigError, match=f"{path.parent}, found beside the token shards: .*"):
        layout_of_data(cfg)
    # a whole other tokenizer set in its place, consistent in itself
    shutil.rmtree(path.parent)
    train_text_tokenizer([tiny_raw], path.parent, vocab_size=600, max_grid=32)
    shutil.copytree(tiny_tokenizers[1], path.parent / "visual_tokenizer")
    said = f"source text was tokenized with other tokenizers than the tokenizers in {path.parent}"
    with pytest.raises(ConfigError, match=f"{said} .*manifest.json.*replaced after tokenize"):
        layout_of_data(cfg)


def test_tokenizers_without_the_visual_tokenizer_or_missing_are_config_errors(
    tiny_tokens, tmp_path
):
    """A token folder whose visual_tokenizer/ is gone, or a data.tokenizers of text alone, over
    a source holding images: refused at start (it trained, and only the release refused it); a
    data.tokenizers that is no folder: one line, not a traceback."""
    import shutil

    from data.loader import SourceConfig
    from train.config import RunConfig
    from train.tasks.lm import layout_of_data

    tokens = shutil.copytree(tiny_tokens, tmp_path / "tokens")
    cfg = RunConfig()
    cfg.data.sources = [SourceConfig(name="scenes", shards=[str(tokens / "scenes")])]
    shutil.rmtree(tokens / "tokenizers" / "visual_tokenizer")
    said = r"source scenes holds \d+ image and video blocks .*has no visual_tokenizer/ to read them"
    with pytest.raises(ConfigError, match=said):
        layout_of_data(cfg)
    cfg.data.sources = [SourceConfig(name="text", shards=[str(tokens / "text")])]
    assert layout_of_data(cfg)[1] == tokens / "tokenizers"  # text alone needs none
    cfg.data.tokenizers = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match="^data.tokenizers: .*nope/vocab_layout.json: not a"):
        layout_of_data(cfg)


def test_earlyfuse_train_help_says_what_it_is_its_exit_codes_and_where_to_read():
    """Before: Hydra's "app is powered by Hydra." and the config, nothing about the run folder,
    resuming or the exit codes."""
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "train.app", "--help"], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0 and p.stdout.startswith("earlyfuse-train: train the early-fusion LM")
    assert "resumes from its" in p.stdout and "3 halted by a monitor" in p.stdout
    assert "docs/training.md" in p.stdout and "experiment: debug, demo" in p.stdout


def test_a_run_logs_object_storage_lookups_only_from_warning_up():
    """Hydra's job logging as a run applies it: botocore's "Found credentials in environment
    variables." (INFO) stays out of the console of a run that reads s3:// shards."""
    import logging
    import logging.config

    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        hydra_cfg = compose("config", return_hydra_config=True).hydra
    before = {name: logging.getLogger(name).level for name in ("botocore", "s3fs", "aiobotocore")}
    try:
        logging.config.dictConfig(OmegaConf.to_container(hydra_cfg.job_logging, resolve=True))
        for name in before:
            assert not logging.getLogger(name).isEnabledFor(logging.INFO), name
        assert logging.getLogger("train").isEnabledFor(logging.INFO)
    finally:
        for name, level in before.items():
            logging.getLogger(name).setLevel(level)


def test_a_sequence_parallel_degree_the_heads_refuse_names_those_that_fit():
    """The long_128k stage (SP 8) on the 125m model (12 heads): the degrees that fit are named,
    and the stage presets sized for the model."""
    with pytest.raises(
        ConfigError, match=r"Degrees that fit this model and row: 1, 2, 4; .*125m_32k"
    ):
        composed(["experiment=gpu_125m", "stage=long_128k"])
    assert composed(["experiment=gpu_125m", "stage=125m_128k"]).train.sequence_parallel == 4


def test_a_sweep_set_in_a_config_file_is_refused_and_leaves_no_folder(tmp_path, monkeypatch):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "sweep.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: debug\nhydra:\n  mode: MULTIRUN\n"
    )
    monkeypatch.chdir(tmp_path)
    p = run_app(["--config-dir", str(tmp_path), "experiment=sweep"])
    assert p.returncode == 2 and "--multirun (-m, hydra.mode=MULTIRUN) is not" in p.stderr, p
    assert sorted(f.name for f in tmp_path.iterdir()) == ["experiment"]  # no multirun/DATE/TIME
    (tmp_path / "runs").mkdir()  # the user's own, empty: a sweep.dir of theirs keeps it
    p = run_app(["--config-dir", str(tmp_path), "experiment=sweep", "hydra.sweep.dir=."])
    assert p.returncode == 2 and sorted(f.name for f in tmp_path.iterdir()) == [
        "experiment",
        "runs",
    ]


def test_version_names_earlyfuse_and_hydra():
    p = run_app(["--version"])
    assert p.returncode == 0 and re.fullmatch(r"earlyfuse \S+ \(Hydra \S+\)\n", p.stdout), p


def test_hydras_own_groups_and_shell_completion_are_hydras():
    """`hydra/job_logging=disabled` and `-sc install=bash` were refused as unknown keys."""
    p = run_app(["hydra/job_logging=disabled", "experiment=debug", "--cfg", "job", "-p", "name"])
    assert p.returncode == 0 and p.stdout.strip() == "debug", p.stderr
    p = run_app(["-sc", "install=bash"])
    assert p.returncode == 0 and "complete -o nospace" in p.stdout, p.stderr


def test_an_interpolation_that_fails_under_cfg_is_said_once():
    """Under --cfg job --resolve the cause was appended to a line that held it already (or as
    OmegaConf's bare template, Value '$VALUE' of type '$VALUE_TYPE')."""
    p = run_app(["run_dir=${oc.env:NOPE_EF27}/r", "--cfg", "job", "--resolve"])
    assert p.returncode == 2
    assert p.stderr == (
        'earlyfuse-train: KeyError raised while resolving interpolation: "Environment variable '
        "'NOPE_EF27' not found\"\n"
    )


def test_hydra_job_chdir_is_refused():
    """Every relative path (run_dir, the shards) was then taken inside Hydra's output folder."""
    p = run_app(["hydra.job.chdir=true", "experiment=debug"])
    assert p.returncode == 2
    assert p.stderr.startswith("earlyfuse-train: hydra.job.chdir=true: every path of the run")


def test_added_overrides_go_beside_the_users_not_into_a_flags_value(tmp_path, monkeypatch):
    """A run named after its data= and a run's own config.yaml get overrides added to the
    command line: they went into a flag's value holding `=` (a Hydra-style folder name) or after
    a trailing --info, which took them."""
    shown = run_app(["experiment=debug", "--cfg", "job", "--resolve"])
    run = tmp_path / "lr=3e-4"
    run.mkdir()
    (run / "config.yaml").write_text(shown.stdout)
    (tmp_path / "a=b" / "data").mkdir(parents=True)
    (tmp_path / "a=b" / "data" / "mine.yaml").write_text("defaults:\n  - demo\nseq_len: 256\n")
    monkeypatch.chdir(tmp_path)
    p = run_app(
        ["--config-path", str(run), "--config-name", "config", "--cfg", "job", "-p", "name"]
    )
    assert p.returncode == 0 and p.stdout.strip() == "debug", p.stderr
    p = run_app(["-cp", str(run), "-cn", "config", "--info"])
    assert p.returncode == 0 and "Hydra" in p.stdout, p.stderr
    mine = ["--config-dir", str(tmp_path / "a=b"), "experiment=debug", "data=mine"]
    p = run_app([*mine, "--cfg", "job", "-p", "run_dir"])
    assert p.returncode == 0 and p.stdout.strip() == "runs/mine", p.stderr
