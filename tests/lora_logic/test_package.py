"""`from lora_logic import LoraConfig, inject_lora` as PEFT's users write it, and the
config still readable without torch."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from conftest import REPO

import lora_logic


def test_the_public_names_import_from_the_package_as_their_modules_define_them():
    from lora_logic import LoraConfig, inject_lora, load_adapters, merge_and_unload, save_adapters  # noqa: F401

    assert len(lora_logic.__all__) >= 15
    for module, names in lora_logic.PUBLIC.items():
        for name in names:
            assert getattr(lora_logic, name) is getattr(importlib.import_module(f"lora_logic.{module}"), name), name
            assert name in dir(lora_logic)


def test_an_unknown_name_says_which_names_there_are():
    with pytest.raises(AttributeError, match="no attribute 'LoRAConfig'; its public names: .*LoraConfig"):
        lora_logic.LoRAConfig


def test_the_config_imports_without_torch():
    code = ("import sys; from lora_logic import LoraConfig, DEFAULT_ADAPTER; "
            "print(LoraConfig(r=4, alpha=8).scaling, DEFAULT_ADAPTER, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    scaling, _, torch_loaded = done.stdout.split()
    assert (float(scaling), torch_loaded) == (2.0, "False")
