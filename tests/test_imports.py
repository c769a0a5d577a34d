"""Import directions between the four packages (docs/design.md, "Where each concern lives").

    model/  imports nothing from train/, tools/ or data/, except data/vocab.py (the vocabulary
            contract: the id space and modality ids that tokenizers and the model share)
    data/   imports nothing from train/ or tools/ (it may use model/: tokenizing images runs the
            visual tokenizer network)
    train/  imports nothing from tools/
    tools/  is imported by nothing outside tools/
    data/vocab.py imports nothing from the project, so the model's one exception pulls in no
            other part of data/
    the loader (data/loader/) does not import a command module (data/cli/, data/ingest/,
            data/tokenize/run.py and its jobs, data/tokenize/shard_job.py): what it shares
            with them lives in library modules
    model/ and data/ do not import Hydra or OmegaConf (Hydra stays at the entry points)

Every import counts, wherever it is written: module level, inside a function, under
``if TYPE_CHECKING``; relative imports are resolved.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data", "model", "train", "tools")
VOCAB_CONTRACT = "data.vocab"
COMMANDS = ("data.cli", "data.ingest", "data.tokenize.run", "data.tokenize.shard_job")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module ``source`` imports (absolute names), at any depth of the syntax tree."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = package[: len(package) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.add(prefix)
            # `from pkg import name` may import a submodule pkg.name: count both readings.
            found.update(f"{prefix}.{alias.name}" for alias in node.names)
    return found


def project_modules() -> dict[str, set[str]]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = module_name(path)
            out[name] = imports_of(path.read_text(), name, path.name == "__init__.py")
    return out


MODULES = project_modules()


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(importer_in: str, forbidden: tuple[str, ...], allowed=()) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in MODULES.items()
        if within(module, importer_in)
        for target in targets
        if any(within(target, f) for f in forbidden) and not any(within(target, a) for a in allowed)
    )


def test_the_scanner_sees_local_relative_and_type_checking_imports():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from train.config import RunConfig\n"
        "def f():\n    import tools.report\n    from . import clips\n    from ..vocab import Modality\n"
    )
    found = imports_of(source, "data.demo_corpus.build")
    assert {"train.config", "tools.report", "data.demo_corpus.clips", "data.vocab"} <= found
    assert "data.demo_corpus" in imports_of("from . import wds\n", "data.demo_corpus", True)
    assert len(MODULES) > 100 and "model.transformer" in MODULES


def test_model_imports_only_the_vocabulary_contract_from_other_packages():
    assert violations("model", ("data", "train", "tools"), allowed=(VOCAB_CONTRACT,)) == []


def test_the_vocabulary_contract_imports_nothing_from_the_project():
    assert not [t for t in MODULES[VOCAB_CONTRACT] if t.split(".")[0] in PACKAGES]


def test_data_imports_nothing_from_train_or_tools():
    assert violations("data", ("train", "tools")) == []


@pytest.mark.parametrize("package", ["data", "model", "train"])
def test_nothing_imports_tools(package):
    assert violations(package, ("tools",)) == []


def test_the_loader_does_not_import_a_command_module():
    # A command renamed or moved would make this check pass for nothing: each must exist.
    assert all(command in MODULES for command in COMMANDS)
    assert violations("data.loader", COMMANDS) == []


@pytest.mark.parametrize("package", ["data", "model"])
def test_hydra_stays_at_the_entry_points(package):
    assert violations(package, ("hydra", "omegaconf")) == []
