"""The package's layout holds: the commands sit on top and import no other command, nothing below
them imports a command, each folder imports only the folders below it, and the run config
imports no runtime module. Read from the source's import statements (function-level imports
included), so a new import that breaks a rule fails here, with its file and line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "finetuning_pipeline"
COMMANDS = {"main", "evaluate", "export", "generate", "preflight"}
RUNTIME = ("torch", "torch_xla", "transformers", "numpy", "jax")


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in `path`; `from finetuning_pipeline import main` is
    finetuning_pipeline.main."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def command_imports(path: Path) -> list[str]:
    return [f"{path.relative_to(REPO)}:{line} imports {module}" for line, module in imports_of(path)
            if module.split(".")[:2] in (["finetuning_pipeline", c] for c in COMMANDS)
            and module.split(".")[1] != path.stem]


def test_the_commands_import_no_other_command():
    commands = [PACKAGE / f"{name}.py" for name in sorted(COMMANDS)]
    assert all(path.is_file() for path in commands)
    assert [hit for path in commands for hit in command_imports(path)] == []


def test_nothing_below_the_commands_imports_one():
    below = [path for path in PACKAGE.rglob("*.py") if path.parent != PACKAGE]
    assert len(below) > 30
    assert [hit for path in below for hit in command_imports(path)] == []


@pytest.mark.parametrize("path", sorted((PACKAGE / "run_config").glob("*.py")), ids=lambda path: path.name)
def test_the_run_config_imports_no_runtime_module(path):
    allowed = ("finetuning_pipeline.run_config", "finetuning_pipeline.errors")
    bad = [f"{line}: {module}" for line, module in imports_of(path)
           if module.split(".")[0] in RUNTIME
           or (module.startswith("finetuning_pipeline.") and not module.startswith(allowed))]
    assert bad == []


# What each folder may import of the others: a one-way order, so a reader can start at the
# bottom (the settings, the model's pieces) and never be sent back up. (errors.py: anyone.)
MAY_IMPORT = {
    "run_config": set(),
    "model": set(),
    "demo": {"run_config"},
    "run": {"model", "run_config"},
    "monitor": {"run"},
    "planning": {"demo", "model", "run", "run_config"},
    "train": {"model", "monitor", "run", "run_config"},
}


def test_each_folder_imports_only_the_folders_below_it():
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert folders == sorted(MAY_IMPORT)  # a new folder takes its place in the order
    wrong = []
    for folder in folders:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            for line, module in imports_of(path):
                parts = module.split(".")
                if (parts[0] == "finetuning_pipeline" and len(parts) > 1 and parts[1] in MAY_IMPORT
                        and parts[1] != folder and parts[1] not in MAY_IMPORT[folder]):
                    wrong.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert wrong == []
