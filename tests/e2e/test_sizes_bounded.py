"""Every size a user types that allocates is bounded before it allocates: a
block length over the model's context, a batch over the data, an answer over the context, a rank
over a layer's side. Each is one line and exit 2, not a traceback or an OOM kill (or, where the
result is the same either way, capped at the data's size)."""

from __future__ import annotations

import json
import shutil

import pytest
from trainer_helpers import write_run_config

from dataset import prepare
from dataset.samples import DOMAIN_TEXT
from finetuning_pipeline import main
from finetuning_pipeline.evaluate import main as evaluate_main
from finetuning_pipeline.generate import main as generate_main

SHORT = {"train": {"max_steps": 2}, "eval": {"every": 0, "max_batches": 1}, "checkpoint": {"every": 0}}


def context_of(model_dir) -> int:
    return json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]


def test_prepare_refuses_blocks_longer_than_the_models_context(tiny_model_dir, tmp_path, capsys):
    """--seq-len 99999999999 was a numpy allocation traceback (373 GiB); 4294967304 an OOM kill."""
    context = context_of(tiny_model_dir)
    for seq_len in (99999999999, 4294967304, context + 1):
        assert prepare.main(["--input", str(DOMAIN_TEXT), "--tokenizer", str(tiny_model_dir), "--seq-len",
                             str(seq_len), "--out", str(tmp_path / "out"), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "--seq-len" in err, err
        if seq_len == context + 1:
            assert f"longer than the model's context length ({context:,} tokens, max_position_embeddings in " in err
    # A tokenizer without its model's config: the bound that holds for any model.
    bare = tmp_path / "tokenizer_only"
    bare.mkdir()
    for path in tiny_model_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, bare / path.name)
    assert prepare.main(["--input", str(DOMAIN_TEXT), "--tokenizer", str(bare), "--seq-len", "4294967304",
                         "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert "seq_len: must be an integer from 8 to 16,777,216" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_evaluate_caps_its_batch_at_the_datas_size(tiny_model_dir, data, capsys, monkeypatch):
    """--micro-batch 100000 padded every batch to 100000 rows (24 GB, then the OOM killer): the
    batch is the split's size at most, and the loss is the one smaller batches give."""
    import finetuning_pipeline.evaluate as evaluate

    seen = []
    real = evaluate.evaluate_loss
    monkeypatch.setattr(evaluate, "evaluate_loss", lambda *args, **kw: seen.append(kw["micro_batch"]) or real(*args,
                                                                                                                **kw))
    losses = []
    for micro_batch in ("100000", "1"):
        assert evaluate_main(["--model", str(tiny_model_dir), "--data", str(data[1]), "--samples", "0",
                              "--micro-batch", micro_batch, "--json"]) == 0
        losses.append(json.loads(capsys.readouterr().out)["loss"])
    eval_blocks = json.loads((data[1] / "manifest.json").read_text())["counts"]["eval"]
    assert seen == [eval_blocks, 1] and losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_an_answer_longer_than_the_context_is_refused_before_generating(tiny_model_dir, data, capsys):
    context = context_of(tiny_model_dir)
    assert generate_main(["--model", str(tiny_model_dir), "--prompt", "Salut", "--max-new-tokens",
                          str(10 ** 9)]) == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens 1000000000: the prompt (" in err and f"exceed the model's context of {context} tokens" \
           in err and "Traceback" not in err
    assert evaluate_main(["--model", str(tiny_model_dir), "--data", str(data[2]), "--samples", "1",
                          "--max-new-tokens", str(context + 1)]) == 2
    assert f"exceed the model's context of {context} tokens" in capsys.readouterr().err


@pytest.mark.parametrize("setting, expected", [
    ("train.micro_batch=100000", "train.micro_batch=100000: more rows than phase1.data holds"),
    ("eval.micro_batch=100000", "eval.micro_batch=100000: more rows than phase1.data holds"),
    ("lora.r=100000", "lora.r 100000 exceeds model.layers.0.self_attn.q_proj's smaller side"),
])
def test_the_trainer_bounds_its_sizes_before_the_device(setting, expected, tiny_model_dir, data, tmp_path, capsys):
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out", **SHORT)
    assert main.main(["--config", str(config), "--phase", "1", setting]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()

