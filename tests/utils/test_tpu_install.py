"""The TPU install: what the project's `tpu` extra resolves to, and the check main.py and preflight
make before a kernel is chosen (utils/tpu_install.py)."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys

import pytest
import tomllib
from conftest import REPO

from utils import tpu_install


def test_torch_xla_pins_jax_for_its_kernels_and_libtpu_for_the_chips():
    assert tpu_install.extra_pins("pallas") == {"jax": "0.7.1", "jaxlib": "0.7.1"}
    assert tpu_install.extra_pins("tpu") == {"libtpu": "0.0.21"}


def test_a_missing_or_other_jax_is_named_with_the_install_command(monkeypatch):
    installed = {"jax": "0.8.0"}

    def version(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(tpu_install.importlib.metadata, "version", version)
    problem = tpu_install.pallas_problem()
    assert "jax 0.8.0 is installed, torch_xla's pallas extra pins jax==0.7.1" in problem
    assert "jaxlib is not installed" in problem and problem.endswith("(pip install -e '.[tpu]')")
    installed.update(jax="0.7.1", jaxlib="0.7.1")
    assert tpu_install.pallas_problem() is None


def test_a_tpu_run_without_libtpu_is_refused_before_the_device(monkeypatch):
    """main.py's input checks on PJRT_DEVICE=TPU: no libtpu (and no TPU_LIBRARY_PATH) is a config
    error naming the install, before torch_xla would fail to find a TPU runtime."""
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    monkeypatch.setattr(tpu_install.importlib.util, "find_spec", lambda name: None)
    assert "libtpu is not installed (torch_xla's tpu extra pins libtpu==0.0.21" in tpu_install.libtpu_problem()
    monkeypatch.setenv("TPU_LIBRARY_PATH", "/usr/lib/libtpu.so")
    assert tpu_install.libtpu_problem() is None


def vm_python() -> str:
    """The Python version utils/tpu_vm/ installs the TPU stack for (VENV_PYTHON in tpu_vm_lib.sh)."""
    lib = (REPO / "utils" / "tpu_vm" / "tpu_vm_lib.sh").read_text()
    return re.search(r"^VENV_PYTHON=([0-9.]+)$", lib, re.MULTILINE).group(1)


def resolve_tpu_extra(tmp_path, python_version: str) -> tuple[int, str, dict]:
    """pip's resolution of what `pip install -e '.[tpu]'` installs on a TPU VM, for an interpreter
    of `python_version`."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["tpu"]
    return resolve(tmp_path, extra, python_version, "torch==2.9.0")


@pytest.mark.slow
@pytest.mark.parametrize("python_version", sorted({vm_python(), f"{sys.version_info.major}.{sys.version_info.minor}"}))
def test_the_tpu_extra_resolves_to_the_versions_torch_xla_pins(tmp_path, python_version):
    """For the VM's venv and for this machine's Python: jax, jaxlib and libtpu at torch_xla 2.9's
    own pins. (The TPU images' own python3, 3.10, cannot take it: the test below.)"""
    code, stderr, resolved = resolve_tpu_extra(tmp_path, python_version)
    assert code == 0, stderr[-3000:]
    pins = {**tpu_install.extra_pins("pallas"), **tpu_install.extra_pins("tpu")}
    assert {"jax", "jaxlib", "libtpu"} <= set(pins)
    for name, version in pins.items():
        assert resolved.get(name) == version, (name, resolved.get(name), version)
    assert resolved["torch-xla"] == "2.9.0" and resolved["torch"] == "2.9.0"


@pytest.mark.slow
def test_the_tpu_images_own_python_cannot_take_the_tpu_extra(tmp_path):
    """Python 3.10, the Ubuntu 22.04 TPU images' python3: jax 0.7.1 requires 3.11 or newer, so the
    install must make its own venv (VENV_PYTHON, by uv)."""
    code, stderr, _ = resolve_tpu_extra(tmp_path, "3.10")
    assert code != 0 and "jax" in stderr
    assert tuple(map(int, vm_python().split("."))) >= (3, 11)


def extra_set(extra: str) -> list[str]:
    """What `pip install '.[EXTRA]'` asks for: the project's dependencies and the extra's."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + project["optional-dependencies"][extra]


def resolve(tmp_path, requirements: list[str], python_version: str, *pinned: str) -> tuple[int, str, dict]:
    """pip's resolution (--dry-run: nothing installed, whatever is installed here) of `requirements`
    for an interpreter of `python_version` (wheels only, as pip requires for another interpreter
    than its own): (exit status, stderr, {name: version}). fast-deps: pip reads each wheel's
    metadata by HTTP range requests where the index gives no metadata file of its own (as this
    project's CI mirror does not) instead of downloading the whole wheel: torch's stack is 4 GB a
    resolution, 44 s and 25 CPU-s of it against 8 s and 3.5 CPU-s, the same resolution."""
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--use-feature=fast-deps",
                           "--python-version", python_version, "--only-binary=:all:",
                           "--report", str(tmp_path / "report.json"), *pinned, *requirements],
                          capture_output=True, text=True, timeout=600)
    resolved = {}
    if proc.returncode == 0:
        resolved = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
                    for item in json.loads((tmp_path / "report.json").read_text())["install"]}
    return proc.returncode, proc.stderr, resolved


def resolve_native_tpu_vm(tmp_path, python_version: str):
    """What `cloud-clone-public.sh --runtime native` installs on a TPU VM: torch's 2.13 (CPU) build,
    then the project's tpu-native extra."""
    return resolve(tmp_path, extra_set("tpu-native"), python_version, "torch==2.13.0")


@pytest.mark.slow
def test_the_xla_extra_resolves_to_torch_xlas_stack(tmp_path):
    """`make setup`'s extra: torch 2.9.0 and torch_xla 2.9.0, whatever newer torch there is."""
    code, stderr, resolved = resolve(tmp_path, extra_set("xla"), vm_python())
    assert code == 0, stderr[-3000:]
    assert resolved["torch"].split("+")[0] == "2.9.0" and resolved["torch-xla"] == "2.9.0"


@pytest.mark.slow
def test_the_gpu_extra_resolves_to_a_torch_of_its_range_without_torch_xla(tmp_path):
    """A GPU machine's install from nothing: a torch the native runtime runs under, no torch_xla, no jax."""
    code, stderr, resolved = resolve(tmp_path, extra_set("gpu"), vm_python())
    assert code == 0, stderr[-3000:]
    version = tuple(int(part) for part in resolved["torch"].split("+")[0].split(".")[:2])
    assert (2, 9) <= version <= (2, 15)
    assert not {"torch-xla", "jax", "jaxlib", "libtpu"} & set(resolved)


@pytest.mark.slow
@pytest.mark.native
def test_the_gpu_extra_keeps_the_torch_that_is_installed(tmp_path):
    """`pip install -e '.[gpu]'` into an environment that holds a torch of the range (a CUDA 2.11 one
    on a GPU machine; here torch 2.9.0, or 2.13.0 in the native environment) installs no other."""
    import torch

    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report",
                           str(tmp_path / "report.json"), "-e", f"{REPO}[gpu]"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    installing = {item["metadata"]["name"].lower() for item in report["install"]}
    assert "torch" not in installing and "torch-xla" not in installing, (torch.__version__, installing)


@pytest.mark.slow
def test_the_native_runtimes_tpu_vm_install_resolves_to_torchtpu_and_its_libtpu_without_torch_xla(tmp_path):
    """For the VM's venv Python: torch-tpu 0.2.0 with torch 2.13.0 (its range: 2.11 to 2.15) and a
    libtpu it accepts (>= 0.0.50); nothing of torch_xla or jax."""
    code, stderr, resolved = resolve_native_tpu_vm(tmp_path, vm_python())
    assert code == 0, stderr[-3000:]
    assert resolved["torch-tpu"] == "0.2.0" and resolved["torch"].split("+")[0] == "2.13.0"  # (+cpu: a CPU build)
    assert tuple(map(int, resolved["libtpu"].split(".")[:3])) >= (0, 0, 50)
    assert not {"torch-xla", "jax", "jaxlib"} & set(resolved)


@pytest.mark.slow
def test_the_tpu_images_own_python_cannot_take_torchtpu(tmp_path):
    """Python 3.10, the TPU images' python3: torch-tpu needs 3.11 or newer, which the venv has."""
    code, stderr, _ = resolve(tmp_path, ["torch-tpu==0.2.0"], "3.10", "torch==2.13.0")
    assert code != 0 and "torch-tpu" in stderr
