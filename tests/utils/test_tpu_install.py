"""The TPU install: what the project's `tpu` extra resolves to, and the check main.py and preflight
make before a kernel is chosen (utils/tpu_install.py)."""

from __future__ import annotations

import importlib.metadata
import json
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


@pytest.mark.slow
def test_the_tpu_extra_resolves_to_the_versions_torch_xla_pins(tmp_path):
    """What `pip install -e '.[tpu]'` would install on a TPU VM, resolved from the package index
    (pip --dry-run: nothing is installed): jax, jaxlib and libtpu at torch_xla 2.9's own pins.
    On main before this change the extra was torch_xla[tpu] only, and jax was not in the set."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["tpu"]
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                    "--report", str(report), "torch==2.9.0", *extra], check=True, capture_output=True, timeout=600)
    resolved = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    pins = {**tpu_install.extra_pins("pallas"), **tpu_install.extra_pins("tpu")}
    assert {"jax", "jaxlib", "libtpu"} <= set(pins)
    for name, version in pins.items():
        assert resolved.get(name) == version, (name, resolved.get(name), version)
    assert resolved["torch-xla"] == "2.9.0" and resolved["torch"] == "2.9.0"
