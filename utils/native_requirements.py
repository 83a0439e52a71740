"""The requirement set of the native runtime's environment (`make setup-native`): the project's
dependencies from pyproject.toml without torch_xla, torch in TorchTPU's range instead of the
pinned 2.9.0, and the test runner. One per line, for `pip install`.

    python utils/native_requirements.py     # what `make setup-native` installs

torch 2.13.0: within TorchTPU's range (torch >= 2.11 and <= 2.15), and a CPU build of it is
what pip finds first on this project's CI machines; a GPU machine or a TorchTPU VM installs its
own torch of that range instead."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

NATIVE_TORCH = "torch==2.13.0"
LEFT_OUT = {"torch", "torch_xla", "torch-xla"}
TEST_TOOLS = ["pytest>=8"]


def native_requirements(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    kept = [r for r in project["dependencies"] if re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0] not in LEFT_OUT]
    return [NATIVE_TORCH, *kept, *TEST_TOOLS]


if __name__ == "__main__":
    print("\n".join(native_requirements(Path(__file__).resolve().parent.parent / "pyproject.toml")))
