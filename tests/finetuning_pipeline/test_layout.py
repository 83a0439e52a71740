"""The package's layout holds: the commands sit on top and import no other command, nothing below
them imports a command, each folder imports only the folders below it, and the run config
imports no runtime module; across the repository, each package imports only the packages below
it and no module imports itself back through others (no circle). Read from the source's import
statements (function-level imports included), so a new import that breaks a rule fails here,
with its file and line."""

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
    "exporters": {"model"},
    "run": {"model", "run_config"},
    "distributed": {"run", "run_config"},
    "monitor": {"run"},
    "train": {"distributed", "model", "monitor", "run", "run_config"},
    "runtime": {"distributed", "model", "monitor", "run", "run_config", "train"},
    "planning": {"distributed", "model", "run", "run_config", "runtime"},
    "checks": {"demo", "distributed", "exporters", "model", "planning", "run", "run_config", "runtime"},
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


# The repository's packages, bottom up: each may import only those before it.
PACKAGES = ["utils", "lora_logic", "dataset", "finetuning_pipeline", "benchmarks"]
MAY_IMPORT_PACKAGES = {"utils": set(), "lora_logic": {"utils"}, "dataset": {"utils"},
                       "finetuning_pipeline": {"utils", "lora_logic", "dataset"},
                       "benchmarks": {"utils", "lora_logic", "dataset", "finetuning_pipeline"}}


def module_files() -> dict[str, Path]:
    """{dotted module: its file} of every first-party module (a package as its __init__)."""
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """{module: {first-party module it imports: the line}}; `from a.b import c` imports a.b.c
    when that is a module, else a.b."""
    files = module_files()
    graph = {}
    for name, path in files.items():
        edges = {}
        for line, module in imports_of(path):
            while module and module not in files:
                module = module.rpartition(".")[0]
            if module and module != name:
                edges.setdefault(module, line)
        graph[name] = edges
    return graph


def test_each_package_imports_only_the_packages_below_it():
    wrong = [f"{module_files()[a].relative_to(REPO)}:{line} imports {b}"
             for a, edges in import_graph().items() for b, line in edges.items()
             if a.split(".")[0] != b.split(".")[0] and b.split(".")[0] not in MAY_IMPORT_PACKAGES[a.split(".")[0]]]
    assert wrong == []


def test_no_module_imports_itself_back_through_others():
    graph = import_graph()
    assert "lora_logic.adapters" in graph["lora_logic.adapter_io"]  # the graph is read, not empty
    circles, done = [], set()

    def walk(module: str, path: list[str]) -> None:
        for imported in graph[module]:
            if imported in path:
                circles.append(" -> ".join(path[path.index(imported):] + [imported]))
            elif imported not in done:
                walk(imported, path + [imported])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            walk(module, [module])
    assert circles == []
