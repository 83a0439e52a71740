"""A long sequence through the real trainer on XLA:CPU: seq_len 4096 with a sliding window of
512 (the tiny demo model with its positions and window raised) and the chunked loss in chunks
of 1,000 tokens (a ragged last one: its tiny vocabulary would otherwise take one piece), one
graph per step kind."""

from __future__ import annotations

import json
import shutil

from trainer_helpers import write_run_config

from dataset import prepare
from dataset.samples import DOMAIN_TEXT
from finetuning_pipeline import main

SEQ_LEN = 4096


def test_training_at_seq_len_4096_compiles_nothing_after_warm_up(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(max_position_embeddings=SEQ_LEN, sliding_window=512)
    (model_dir / "config.json").write_text(json.dumps(config))
    data = tmp_path / "data"
    assert prepare.main(["--tokenizer", str(model_dir), "--seq-len", str(SEQ_LEN), "--out", str(data),
                         "--input", str(DOMAIN_TEXT), "--quiet"]) == 0
    run = write_run_config(tmp_path / "run.yaml", model_dir, {1: data, 2: data}, tmp_path / "out",
                           train={"max_steps": 4, "micro_batch": 1, "grad_accum": 2, "warmup_steps": 1,
                                  "loss_chunk_tokens": 1000},
                           eval={"every": 2, "max_batches": 1}, checkpoint={"every": 0},
                           logging={"every": 1, "progress_bar": False, "tensorboard": False})
    assert main.main(["--config", str(run), "--phase", "1"]) == 0
    summary = json.loads((tmp_path / "out" / "phase1" / "summary.json").read_text())
    assert summary["seq_len"] == SEQ_LEN and summary["steps"] == 4
    assert summary["compiles_after_warmup"] == 0 and summary["host_syncs_per_step"] == 0
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
