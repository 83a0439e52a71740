"""The Colab/Kaggle notebook runs top to bottom (nbclient, a real Jupyter kernel) on the tiny
model, on CPU: a few steps per phase, in a temporary directory, in this venv (no install)."""

from __future__ import annotations

import json

import nbclient
import nbformat
from conftest import REPO

ROOT = REPO
NOTEBOOK = ROOT / "notebooks" / "tpu_lora_demo.ipynb"


def test_the_notebook_runs_the_demo_top_to_bottom(tmp_path, monkeypatch):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    [parameters] = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    parameters.source = f'OUT = "{tmp_path / "out"}"\nSTEPS = 3\nPRETRAIN_STEPS = 5\nREPO = "unused"'
    monkeypatch.setenv("TPU_LORA_STACK_INSTALLED", "1")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()  # raises on a failing cell

    printed = "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for output in cell.get("outputs", []))
    assert "running on CPU" in printed
    assert "phase 1: 3 steps" in printed and "phase 2: 3 steps" in printed and "phase 3: 3 steps" in printed
    assert "phase 1 step 3/3: loss " in printed  # a line per log step, shown as it comes (demo.streamed)
    assert "after phases 1, 2 and 3:" in printed
    out = tmp_path / "out"
    for phase in (1, 2, 3):
        assert json.loads((out / f"phase{phase}" / "summary.json").read_text())["steps"] == 3
    assert (out / "merged" / "model.safetensors").is_file() and (out / "loss.png").is_file()
    # Two adapters side by side in one run, each written as its own adapter.
    assert "side by side: text: eval loss" in printed and "side by side: chat: eval loss" in printed
    side_by_side = json.loads((out / "side_by_side" / "phase1" / "summary.json").read_text())
    assert {name: s["steps"] for name, s in side_by_side["adapters"].items()} == {"text": 3, "chat": 3}
    for name in ("text", "chat"):
        assert (out / "side_by_side" / "phase1" / "adapters" / name / "adapter_model.safetensors").is_file()
    assert any(output.get("output_type") == "execute_result" and "image/png" in output.get("data", {})
               for output in notebook.cells[-1].outputs)  # the loss plot is shown
