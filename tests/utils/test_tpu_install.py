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
from utils.native_requirements import native_requirements


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


def resolve_tpu_extra(tmp_path, python_version: str) -> subprocess.CompletedProcess:
    """pip's resolution (--dry-run: nothing installed) of what `pip install -e '.[tpu]'` installs
    on a TPU VM, for an interpreter of `python_version` (wheels only, as pip requires for another
    interpreter than its own)."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["tpu"]
    return subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--python-version", python_version, "--only-binary=:all:",
                           "--report", str(tmp_path / "report.json"), "torch==2.9.0", *extra],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("python_version", sorted({vm_python(), f"{sys.version_info.major}.{sys.version_info.minor}"}))
def test_the_tpu_extra_resolves_to_the_versions_torch_xla_pins(tmp_path, python_version):
    """For the VM's venv and for this machine's Python: jax, jaxlib and libtpu at torch_xla 2.9's
    own pins. (Before, the scripts installed into the TPU images' python3, 3.10, for which it
    cannot resolve: the test below.)"""
    proc = resolve_tpu_extra(tmp_path, python_version)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
                for item in json.loads((tmp_path / "report.json").read_text())["install"]}
    pins = {**tpu_install.extra_pins("pallas"), **tpu_install.extra_pins("tpu")}
    assert {"jax", "jaxlib", "libtpu"} <= set(pins)
    for name, version in pins.items():
        assert resolved.get(name) == version, (name, resolved.get(name), version)
    assert resolved["torch-xla"] == "2.9.0" and resolved["torch"] == "2.9.0"


@pytest.mark.slow
def test_the_tpu_images_own_python_cannot_take_the_tpu_extra(tmp_path):
    """Python 3.10, the Ubuntu 22.04 TPU images' python3: jax 0.7.1 requires 3.11 or newer, so the
    install must make its own venv (VENV_PYTHON, by uv)."""
    proc = resolve_tpu_extra(tmp_path, "3.10")
    assert proc.returncode != 0 and "jax" in proc.stderr
    assert tuple(map(int, vm_python().split("."))) >= (3, 11)


def resolve_native_tpu_vm(tmp_path, python_version: str) -> subprocess.CompletedProcess:
    """pip's resolution (--dry-run) of what `cloud-clone-public.sh --runtime native` installs on a
    TPU VM (utils/native_requirements.py --tpu-vm), for an interpreter of `python_version`."""
    requirements = native_requirements(REPO / "pyproject.toml", tpu_vm=True)
    return subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--python-version", python_version, "--only-binary=:all:",
                           "--report", str(tmp_path / "report.json"), *requirements],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_native_runtimes_tpu_vm_install_resolves_to_torchtpu_and_its_libtpu_without_torch_xla(tmp_path):
    """For the VM's venv Python: torch-tpu 0.2.0 with torch 2.13.0 (its range: 2.11 to 2.15) and a
    libtpu it accepts (>= 0.0.50); nothing of torch_xla or jax."""
    proc = resolve_native_tpu_vm(tmp_path, vm_python())
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
                for item in json.loads((tmp_path / "report.json").read_text())["install"]}
    assert resolved["torch-tpu"] == "0.2.0" and resolved["torch"].split("+")[0] == "2.13.0"  # (+cpu: a CPU build)
    assert tuple(map(int, resolved["libtpu"].split(".")[:3])) >= (0, 0, 50)
    assert not {"torch-xla", "jax", "jaxlib"} & set(resolved)


@pytest.mark.slow
def test_the_tpu_images_own_python_cannot_take_torchtpu(tmp_path):
    """Python 3.10, the TPU images' python3: torch-tpu needs 3.11 or newer, which the venv has."""
    proc = resolve_native_tpu_vm(tmp_path, "3.10")
    assert proc.returncode != 0 and "torch-tpu" in proc.stderr
