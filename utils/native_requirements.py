"""The requirement set of the native runtime's environment (`make setup-native`): the project's
dependencies from pyproject.toml without torch_xla, torch in TorchTPU's range instead of the
pinned 2.9.0, and the test runner. One per line, for `pip install`.

    python utils/native_requirements.py                            # what `make setup-native` installs
    python utils/native_requirements.py --tpu-vm --output FILE     # a TPU VM's (utils/tpu_vm/ --runtime native)

A TPU VM's set has TorchTPU (`torch-tpu`, which brings its libtpu) and no test runner.

torch 2.13.0: within TorchTPU's range (torch >= 2.11 and <= 2.15), and a CPU build of it is
what pip finds first on this project's CI machines; a GPU machine or a TorchTPU VM installs its
own torch of that range instead."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import tomllib

NATIVE_TORCH = "torch==2.13.0"
TORCH_TPU = "torch-tpu==0.2.0"  # needs torch >= 2.11 and <= 2.15, Python >= 3.11, libtpu >= 0.0.50
LEFT_OUT = {"torch", "torch_xla", "torch-xla"}
TEST_TOOLS = ["pytest>=8"]


def native_requirements(pyproject: Path, tpu_vm: bool = False) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    kept = [r for r in project["dependencies"] if re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0] not in LEFT_OUT]
    return [NATIVE_TORCH, TORCH_TPU, *kept] if tpu_vm else [NATIVE_TORCH, *kept, *TEST_TOOLS]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tpu-vm", action="store_true", help="a TPU VM's set: TorchTPU, no test runner")
    parser.add_argument("--output", help="write the set to this file (default: print it)")
    args = parser.parse_args(argv)
    text = "\n".join(native_requirements(Path(__file__).resolve().parent.parent / "pyproject.toml", args.tpu_vm))
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
