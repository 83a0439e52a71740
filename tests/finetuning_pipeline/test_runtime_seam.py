"""The seam between the trainer and its runtimes holds (finetuning_pipeline/runtime/protocol.py):
outside runtime/, the code the runtimes share imports no torch_xla, no runtime's own module, and
branches on no backend. Read from the source (its syntax tree, so a word in a docstring or a
comment is not a branch), so a new one fails here with its file and line.

What may know the runtimes by name: runtime/ itself, the run config's validation of runtime.*
(run_config/validate.py), and the commands on top and their checks, which pick a runtime's
Backend (main, preflight, tpu_check, evaluate --device, export and generate's host-only device,
checks/), which then ask it what the runtime decides, never compare its name. planning/ asks the
XLA runtime's scan decision for its TPU plan, so it may import runtime/, but names no backend
either."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.native

PACKAGE = REPO / "finetuning_pipeline"
SHARED = ["train", "distributed", "model", "monitor", "run", "exporters", "demo", "planning", "run_config"]
ALLOWED = {PACKAGE / "run_config" / "validate.py"}
BACKEND_NAMES = {"xla", "native"}


def shared_files() -> list[Path]:
    files = [path for room in SHARED for path in sorted((PACKAGE / room).rglob("*.py"))]
    files += [path for package in ("lora_logic", "utils", "dataset") for path in sorted((REPO / package).rglob("*.py"))]
    files += [PACKAGE / "errors.py"]
    return [path for path in files if path not in ALLOWED]


def names_runtime(node: ast.AST) -> bool:
    """`runtime`, `self.runtime`, `p.runtime`, ...: a runtime object."""
    return (isinstance(node, ast.Name) and node.id == "runtime") or (
        isinstance(node, ast.Attribute) and node.attr == "runtime")


def backend_knowledge(path: Path) -> list[str]:
    """Each place in `path` that imports torch_xla or a runtime's own module, or branches on which
    runtime runs: a comparison with "xla" or "native", with a `.backend`, a runtime's `.name` or
    `runtime is None`, a mesh's presence (`parallel.mesh is None`: SPMD, or FSDP2's DeviceMesh?),
    or PJRT_DEVICE read as the runtime's name."""
    found = []
    where = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            modules = []
        for module in modules:
            if module.split(".")[0] == "torch_xla":
                found.append(f"{where}:{line} imports {module}")
            elif path.parent.name != "planning" and module.startswith(("finetuning_pipeline.runtime.xla",
                                                                          "finetuning_pipeline.runtime.native")):
                found.append(f"{where}:{line} imports {module}")
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(side, ast.Constant) and side.value in BACKEND_NAMES for side in sides):
                found.append(f"{where}:{line} compares with a backend's name")
            if any(isinstance(side, ast.Attribute) and side.attr == "backend" for side in sides):
                found.append(f"{where}:{line} compares runtime.backend")
            if any(isinstance(side, ast.Attribute) and side.attr == "name" and names_runtime(side.value)
                   for side in sides):
                found.append(f"{where}:{line} compares a runtime's name")
            if any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops) and any(
                    names_runtime(side) or (isinstance(side, ast.Attribute) and side.attr == "mesh") for side in sides):
                found.append(f"{where}:{line} asks whether a runtime or a mesh is there")
        if isinstance(node, ast.Constant) and node.value == "PJRT_DEVICE":
            found.append(f"{where}:{line} reads PJRT_DEVICE")
    return found


def test_the_shared_code_is_where_it_is_looked_for():
    files = shared_files()
    assert len(files) > 100 and all(path.is_file() for path in files)
    assert PACKAGE / "train" / "phase_loop.py" in files and REPO / "lora_logic" / "layer.py" in files


@pytest.mark.parametrize("path", shared_files(), ids=lambda path: str(path.relative_to(REPO)))
def test_the_shared_code_imports_no_torch_xla_and_branches_on_no_backend(path):
    assert backend_knowledge(path) == []


COMMANDS = ["main", "evaluate", "export", "generate", "preflight", "tpu_check", "cli"]


def command_files() -> list[Path]:
    return [PACKAGE / f"{name}.py" for name in COMMANDS] + sorted((PACKAGE / "checks").glob("*.py"))


@pytest.mark.parametrize("path", command_files(), ids=lambda path: str(path.relative_to(REPO)))
def test_the_commands_and_checks_ask_the_runtime_what_it_does_not_its_name(path):
    """On top of the seam a command may pick a device (evaluate --device xla, PJRT_DEVICE) and
    import a runtime's own modules, but what depends on the runtime (its launch, its check of its
    TPU paths, its pod policy) is asked of its Backend: none compares runtime.backend or a
    runtime's name."""
    assert path.is_file()
    assert [hit for hit in backend_knowledge(path)
            if hit.endswith(("compares runtime.backend", "compares a runtime's name"))] == []


def test_the_check_finds_each_kind_of_backend_knowledge(tmp_path):
    """Each rule fires on the kind of line it is for (the history this test guards against), and
    not on a docstring or comment that names a runtime."""
    lines = {
        "import torch_xla.core.xla_model as xm": "imports torch_xla.core.xla_model",
        "from finetuning_pipeline.runtime.xla.device import device_kind": "imports finetuning_pipeline.runtime.xla",
        "if config.runtime.backend == 'xla': pass": "compares runtime.backend",
        "if tensor.device.type != 'xla': pass": "compares with a backend's name",
        "native = runtime is not None and runtime.name != 'xla'": "asks whether a runtime or a mesh is there",
        "spmd = parallel.mesh is not None": "asks whether a runtime or a mesh is there",
        "if p.runtime.name == kind: pass": "compares a runtime's name",
        "kind = os.environ['PJRT_DEVICE']": "reads PJRT_DEVICE",
    }
    for line, message in lines.items():
        source = tmp_path / "case.py"
        source.write_text(f'"""On XLA, PJRT_DEVICE picks the device; runtime.backend == "xla" is the default."""\n'
                          f"# runtime is None on the XLA path\n{line}\n")
        found = backend_knowledge(source)
        assert any(message in hit for hit in found), (line, found)
    source.write_text('"""runtime.backend == "xla": PJRT_DEVICE=TPU."""\n# if device.type == "xla"\nx = 1\n')
    assert backend_knowledge(source) == []
