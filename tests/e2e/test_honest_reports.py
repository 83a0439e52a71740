"""Nothing silently wrong: an empty eval split is reported as such (never as a perfect score),
and a finished phase whose inputs changed since (re-prepared data, phase 1 trained again under
phase 2) is refused by name instead of reported as done."""

from __future__ import annotations

import json

import torch
from trainer_helpers import SEQ_LEN, write_run_config

from dataset import prepare
from dataset.samples import DOMAIN_TEXT
from finetuning_pipeline import main
from finetuning_pipeline.evaluate import main as evaluate_main
from finetuning_pipeline.monitor.metrics_log import read_metrics
from finetuning_pipeline.train.eval_loop import evaluate_loss

QUICK = {"train": {"max_steps": 3}, "checkpoint": {"every": 0}, "eval": {"every": 0, "max_batches": 2},
         "logging": {"every": 1, "progress_bar": False, "tensorboard": False}}


def prepare_phase1(tiny_model_dir, out, *extra) -> None:
    args = ["--input", str(DOMAIN_TEXT), "--tokenizer", str(tiny_model_dir), "--seq-len", str(SEQ_LEN),
            "--out", str(out), "--quiet", *extra]
    assert prepare.main(args) == 0


def test_an_empty_eval_split_is_reported_as_no_eval_data(tiny_model_dir, data, tmp_path, capsys):
    no_eval = tmp_path / "no_eval"
    prepare_phase1(tiny_model_dir, no_eval, "--eval-fraction", "0")
    config = write_run_config(
        tmp_path / "run.yaml", tiny_model_dir, {1: no_eval, 2: data[2]}, tmp_path / "out", **QUICK
    )
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    printed = capsys.readouterr().out
    assert "phase 1: no eval data (the eval split is empty, or eval.max_batches is 0)" in printed
    assert "phase 1: 3 steps, no eval data," in printed and "perplexity" not in printed
    summary = json.loads((tmp_path / "out" / "phase1" / "summary.json").read_text())
    assert [summary[k] for k in ("eval_loss_before", "eval_loss_after", "perplexity_before", "perplexity_after")] == [
        None
    ] * 4
    evals = [r for r in read_metrics(tmp_path / "out" / "phase1" / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals and all(r["loss"] is None and r["label_tokens"] == 0 for r in evals)
    assert (tmp_path / "out" / "loss.png").is_file()  # the plot draws the training loss alone

    assert evaluate_main(["--model", str(tiny_model_dir), "--data", str(no_eval), "--samples", "0"]) == 0
    assert capsys.readouterr().out.strip() == "eval: no eval data (the eval split is empty, or eval.max_batches is 0)"


def test_eval_max_batches_0_means_no_evaluation_not_a_zero_loss(tiny_model_dir, data):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    kwargs = dict(micro_batch=2, pad_id=0, packed=True, device=torch.device("cpu"))
    assert evaluate_loss(model, str(data[1]), max_batches=0, **kwargs) == {"loss": None, "perplexity": None,
                                                                           "label_tokens": 0}
    scored = evaluate_loss(model, str(data[1]), max_batches=1, **kwargs)
    assert scored["loss"] > 0 and scored["label_tokens"] > 0


def test_a_finished_phase_whose_inputs_changed_is_refused_by_name(tiny_model_dir, data, tmp_path, capsys):
    phase1_data = tmp_path / "phase1_data"
    prepare_phase1(tiny_model_dir, phase1_data)
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, {1: phase1_data, 2: data[2]}, tmp_path / "out",
                              **QUICK)
    run = lambda *args: main.main(["--config", str(config), *args])
    assert run() == 0
    capsys.readouterr()

    # Phase 1 trained again, under another LR: phase 2 was built on the old phase-1 adapter.
    assert run("--phase", "1", "--resume", "never", "--force", "phase1.lr=0.005") == 0
    capsys.readouterr()
    assert run("--phase", "all") == 2
    captured = capsys.readouterr()
    assert (
        "phase 1: already finished" in captured.out
        and "it finished under other settings: phase1.lr: 0.005 -> None" in captured.out
    )
    assert (
        f"phase 2 ({tmp_path / 'out' / 'phase2'}) finished on other inputs: phase 1 was trained again since "
        "phase 2 was built on its adapter. Train it again on these with --phase 2 --resume never --force"
    ) in captured.err
    assert run("--phase", "2", "--resume", "never", "--force") == 0
    assert run("--phase", "all", "phase1.lr=0.005") == 0
    assert capsys.readouterr().out.count("already finished") == 2

    # The phase-1 data prepared again from other options into the same directory.
    prepare_phase1(tiny_model_dir, phase1_data, "--force", "--seed", "7")
    assert run("--phase", "all", "phase1.lr=0.005") == 2
    assert f"phase 1 ({tmp_path / 'out' / 'phase1'}) finished on other inputs: {phase1_data} was prepared again" \
        in capsys.readouterr().err
