"""Shared by the native runtime's end-to-end tests (tests/e2e/test_native_runtime.py,
test_native_processes.py): their overrides, run sections, and the float64 comparison of two
runs' losses and adapters."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file
from tolerances import assert_equal_in_exact_arithmetic
from trainer_helpers import metric_records

NATIVE = ["runtime.backend=native", "runtime.device=cpu"]
# LoRA dropout on, two micro-batches a step: the masks and the accumulation must match too.
SMALL = {"train": {"max_steps": 6, "grad_accum": 2}, "lora": {"r": 8, "alpha": 16, "dropout": 0.1},
         "model": {"dtype": "float64"}, "eval": {"every": 3, "max_batches": 1}, "checkpoint": {"every": 3, "keep": 2},
         "logging": {"every": 1, "progress_bar": False, "tensorboard": False}}


def sections_with(**extra) -> dict:
    merged = {k: dict(v) for k, v in SMALL.items()}
    for section, values in extra.items():
        if isinstance(values, dict):
            merged.setdefault(section, {}).update(values)
        else:
            merged[section] = values
    return merged


def adapters_of(out: Path, phase: int) -> dict[str, dict]:
    """{adapter directory relative to the phase: its tensors}: the one adapter, or each side by side."""
    root = out / f"phase{phase}"
    return {str(path.parent.relative_to(root)): load_file(path)
            for path in sorted(root.glob("**/adapter_model.safetensors")) if "checkpoints" not in path.parts}


def assert_runs_equal(ours: Path, theirs: Path, phases: list[int]) -> None:
    """Every logged train and eval loss (per adapter side by side) and every adapter, within float64's bound."""
    for phase in phases:
        for kind in ("train", "eval"):
            mine, other = metric_records(ours, kind, phase), metric_records(theirs, kind, phase)
            assert [r["step"] for r in mine] == [r["step"] for r in other] and mine, (phase, kind)
            values = [[r["loss"]] + [a["loss"] for a in r.get("adapters", {}).values()] for r in mine]
            expected = [[r["loss"]] + [a["loss"] for a in r.get("adapters", {}).values()] for r in other]
            assert_equal_in_exact_arithmetic(sum(values, []), sum(expected, []), f"phase {phase} {kind} losses")
        mine, other = adapters_of(ours, phase), adapters_of(theirs, phase)
        assert mine.keys() == other.keys() and mine
        for name, tensors in mine.items():
            assert tensors.keys() == other[name].keys()
            for key, tensor in tensors.items():
                assert_equal_in_exact_arithmetic(tensor, other[name][key], f"phase {phase} {name} {key}")


def side_by_side(data) -> dict:
    return {"phase1": {"data": "", "adapters": {"text": {"data": str(data[1]), "max_steps": 4},
                                                 "chat": {"data": str(data[2]), "lr": 5e-3}}},
            "phase2": {"data": str(data[2]), "init": "fresh"}}
