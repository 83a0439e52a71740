"""Shared by the trainer tests: prepared tiny datasets and small run configs."""

from __future__ import annotations

from pathlib import Path

import yaml

from dataset import prepare
from dataset.samples import ALPACA, CHAT_QA, DOMAIN_TEXT

SEQ_LEN = 64


def prepare_demo_data(tokenizer_dir: Path, root: Path) -> dict[int, Path]:
    """Phase-1 and phase-2 shards of the bundled corpora at SEQ_LEN."""
    inputs = {1: [DOMAIN_TEXT], 2: [CHAT_QA, ALPACA]}
    out = {}
    for phase, files in inputs.items():
        out[phase] = root / f"phase{phase}"
        args = ["--tokenizer", str(tokenizer_dir), "--seq-len", str(SEQ_LEN), "--out", str(out[phase]), "--quiet"]
        for f in files:
            args += ["--input", str(f)]
        assert prepare.main(args) == 0
    return out


def write_run_config(path: Path, model_dir: Path, data: dict[int, Path], output_dir: Path, **sections) -> Path:
    """A small, fast run: 12 steps a phase, fp32, eval and checkpoints along the way."""
    config = {
        "output_dir": str(output_dir),
        "model": {"path": str(model_dir), "dtype": "float32"},
        "lora": {"r": 8, "alpha": 16},
        "train": {"max_steps": 12, "micro_batch": 4, "grad_accum": 2, "lr": 1e-2, "warmup_steps": 2, "seed": 0},
        "eval": {"every": 6, "max_batches": 4},
        "checkpoint": {"every": 4, "keep": 2},
        "logging": {"every": 3, "progress_bar": False, "tensorboard": True},
        "phase1": {"data": str(data[1])},
        "phase2": {"data": str(data[2]), "init": "continue"},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            config.setdefault(section, {}).update(values)
        else:
            config[section] = values
    path.write_text(yaml.safe_dump(config))
    return path
