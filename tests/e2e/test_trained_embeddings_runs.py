"""A new language's phase 1: the embeddings and the output layer trained beside the LoRA, end to
end on XLA:CPU in float64. Two shared runs: the whole matrices (lora.modules_to_save, at
train.embedding_lr; phase 2 continues them), and new tokens' rows (model.new_tokens on data
prepared with --new-tokens: their rows trained by default, lora.trainable_token_indices).

Claims: the step is one captured graph (no compile after warm-up, no host sync); the adapter on
disk is in PEFT's layout with the embeddings' weights or rows, which moved from where they
started (the new rows from the mean of the others), and holds the extended tokenizer; a run
resumed from a checkpoint is the uninterrupted one bitwise (their AdamW moments included); data
prepared without the new tokens is refused in one line; PEFT (on the base grown to the extended
tokenizer) and the merged export (a plain model and tokenizer) give the adapter's logits, and
llama.cpp on the merged model's GGUF tokenizes the new tokens and computes transformers' logits;
fsdp (the copies and their AdamW state sharded) and 2 torchrun processes equal one device; a LoRA
GGUF or a combination of such an adapter is refused in one line; a merging phase starts where the
phase before ended; the TPU's path (launcher threads, bf16, donation) runs them in one graph; a
preference phase continuing the adapter takes its embeddings into its reference."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from tolerances import assert_equal_in_exact_arithmetic
from trainer_helpers import adapter_tensors, train_losses, write_run_config

from finetuning_pipeline import export, main
from finetuning_pipeline.exporters.merged import export_merged
from finetuning_pipeline.model.loading import load_model
from finetuning_pipeline.run.checkpointing import complete_checkpoints

SAVED = ["embed_tokens", "lm_head"]
SECTIONS = {"model": {"dtype": "float64"}, "lora": {"r": 8, "alpha": 16, "modules_to_save": SAVED},
            "train": {"max_steps": 6, "embedding_lr": 2e-3}, "eval": {"every": 3, "max_batches": 2},
            "checkpoint": {"every": 3, "keep": 2}, "logging": {"every": 1, "progress_bar": False, "tensorboard": False}}


@pytest.fixture(scope="module")
def run(tiny_model_dir, data, tmp_path_factory):
    root = tmp_path_factory.mktemp("modules_to_save")
    config = write_run_config(root / "run.yaml", tiny_model_dir, data, root / "out", **SECTIONS)
    assert main.main(["--config", str(config), "--phase", "all"]) == 0
    return {"config": config, "out": root / "out", "model": tiny_model_dir, "data": data}


def test_the_modules_train_beside_the_lora_in_one_graph_and_are_saved_in_peft_layout(run):
    base = load_file(run["model"] / "model.safetensors")
    for phase in (1, 2):
        summary = json.loads((run["out"] / f"phase{phase}" / "summary.json").read_text())
        assert summary["compiles_after_warmup"] == 0 and summary["host_syncs_per_step"] == 0, summary
        config = json.loads((run["out"] / f"phase{phase}" / "adapter" / "adapter_config.json").read_text())
        assert config["modules_to_save"] == SAVED
        tensors = adapter_tensors(run["out"], phase)
        for key, base_key in (("model.embed_tokens.weight", "model.embed_tokens.weight"),
                              ("lm_head.weight", "lm_head.weight")):
            trained = tensors[f"base_model.model.{key}"]
            assert trained.shape == base[base_key].shape and not torch.equal(trained, base[base_key].to(trained.dtype))
    # Phase 2 continued them: its modules moved on from phase 1's.
    first, second = adapter_tensors(run["out"], 1), adapter_tensors(run["out"], 2)
    assert not torch.equal(first["base_model.model.lm_head.weight"], second["base_model.model.lm_head.weight"])


@pytest.mark.parametrize("which", ["run", "new_tokens_run"])
def test_a_resumed_run_is_the_uninterrupted_one_bitwise(which, request, tmp_path):
    run = request.getfixturevalue(which)
    checkpoint = complete_checkpoints(run["out"] / "phase1" / "checkpoints")[0]
    assert checkpoint.name.endswith("00000003")
    out = tmp_path / "out"
    assert main.main(["--config", str(run["config"]), "--phase", "1", f"output_dir={out}",
                      "--resume", str(checkpoint)]) == 0
    assert json.loads((out / "phase1" / "summary.json").read_text())["resumed_from_step"] == 3
    assert train_losses(out) == train_losses(run["out"])[3:]
    ours, theirs = adapter_tensors(out), adapter_tensors(run["out"])
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("how", ["fsdp over 2 chips", "2 processes (torchrun)"])
def test_fsdp_and_replicas_equal_one_device_fsdp_sharding_the_copies_and_their_adamw_state(run, how, tmp_path):
    """The same global batch over 2 devices: parallel.mode=fsdp over 2 virtual chips (a process of
    its own: SPMD is process-wide), the trainable copies sharded as the base's matrices and the
    optimizer's moments split over the chips as XLA holds them; or 2 torchrun processes, the
    embeddings' gradients summed with the LoRA's through gloo. Either: the run of one device within
    float64's bound."""
    from native_helpers import assert_runs_equal
    from replica_helpers import torchrun
    from trainer_helpers import train_in_fresh_process

    out = tmp_path / "out"
    arguments = ["--phase", "1", f"output_dir={out}", "train.micro_batch=2"]
    if how.startswith("fsdp"):
        done = train_in_fresh_process(run["config"], *arguments, "parallel.mode=fsdp", env={"CPU_NUM_DEVICES": "2"})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        parallel = json.loads((out / "phase1" / "summary.json").read_text())["parallel"]
        assert parallel["sharded_trained_parameters"] == 2 and parallel["sharded_base_parameters"] == 16, parallel
        assert parallel["optimizer_state_sharding"] == ["{devices=[2]0,1}"] * 2, parallel
    else:
        torchrun(2, run["config"], *arguments)
    assert_runs_equal(out, run["out"], [1])


def test_the_merged_export_is_a_plain_model_with_the_adapters_logits(run, tmp_path):
    """Exported from the base stored in float64 (the run's own weights, exactly: it trained on the
    fp32 base read in float64), so the merge is float64's and the bound float64's."""
    import shutil

    from transformers import AutoModelForCausalLM

    base = tmp_path / "base64"
    shutil.copytree(run["model"], base)
    AutoModelForCausalLM.from_pretrained(run["model"], dtype=torch.float64).save_pretrained(base)
    adapters = [str(run["out"] / "phase2" / "adapter")]  # (phase 2 continued phase 1's)
    ids = torch.randint(1, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    adapted, _ = load_model(base, adapters, torch.float64, keep_last=True, warn=lambda message: None)
    export_merged(str(base), adapters, str(tmp_path / "merged"), warn=lambda message: None)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float64)
    assert not any(".modules_to_save." in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        expected = adapted.eval()(input_ids=ids, use_cache=False).logits
        assert_equal_in_exact_arithmetic(merged.eval()(input_ids=ids, use_cache=False).logits, expected,
                                         "the merged model's logits")
    assert not math.isnan(float(expected.sum()))


NEW_TOKENS = ["Vizitatorii", "anotimpurile", "<|ro|>"]


@pytest.fixture(scope="module")
def new_tokens_run(tiny_model_dir, data, tmp_path_factory):
    """Phase 1 with model.new_tokens on data prepared with them (float64): their rows trained by
    default (lora.trainable_token_indices), the input embedding's and the output layer's."""
    from trainer_helpers import SEQ_LEN

    from dataset.prepare import PrepareOptions, prepare
    from dataset.samples import DOMAIN_TEXT

    root = tmp_path_factory.mktemp("new_tokens")
    prepare(PrepareOptions(inputs=[str(DOMAIN_TEXT)], tokenizer=str(tiny_model_dir), seq_len=SEQ_LEN,
                           out=str(root / "text"), quiet=True, new_tokens=NEW_TOKENS))
    sections = {**SECTIONS, "lora": {"r": 8, "alpha": 16}, "model": {"dtype": "float64", "new_tokens": NEW_TOKENS},
                "phase1": {"data": str(root / "text")}}
    config = write_run_config(root / "run.yaml", tiny_model_dir, data, root / "out", **sections)
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    return {"config": config, "out": root / "out", "model": tiny_model_dir, "data": data}


def test_new_tokens_rows_train_beside_the_lora_and_the_adapter_holds_its_tokenizer(new_tokens_run):
    from transformers import AutoTokenizer

    out = new_tokens_run["out"]
    summary = json.loads((out / "phase1" / "summary.json").read_text())
    assert summary["compiles_after_warmup"] == 0 and summary["host_syncs_per_step"] == 0
    adapter = out / "phase1" / "adapter"
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    base_tokens = len(AutoTokenizer.from_pretrained(new_tokens_run["model"]))
    ids = list(range(base_tokens, base_tokens + len(NEW_TOKENS)))
    assert tokenizer.convert_tokens_to_ids(NEW_TOKENS) == ids
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["trainable_token_indices"] == {"model.embed_tokens": ids, "lm_head": ids}
    tensors = adapter_tensors(out)
    rows = {k: v for k, v in tensors.items() if "trainable_tokens_delta" in k}
    assert sorted(rows) == ["base_model.model.lm_head.token_adapter.trainable_tokens_delta",
                            "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"]
    base = load_file(new_tokens_run["model"] / "model.safetensors")
    mean = base["model.embed_tokens.weight"][:base_tokens].to(torch.float64).mean(0)
    embedding_rows = rows["base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"]
    assert embedding_rows.shape == (len(NEW_TOKENS), mean.shape[0])
    # Rows of tokens in the data moved from where they started (the mean); "<|ro|>" is in no text.
    moved = [not torch.allclose(row, mean.to(row.dtype), rtol=0, atol=1e-12) for row in embedding_rows]
    assert moved == [True, True, False]


def test_data_prepared_without_the_new_tokens_is_refused_in_one_line(new_tokens_run, capsys):
    data = new_tokens_run["data"]
    code = main.main(["--config", str(new_tokens_run["config"]), "--phase", "1", f"phase1.data={data[1]}",
                      "--resume", "never", "--force"])
    err = capsys.readouterr().err
    assert code == 2 and "tokenized with new tokens none, but the run's model.new_tokens are" in err, err
    assert "re-run prepare with --new-tokens Vizitatorii anotimpurile <|ro|>" in err


def test_peft_and_the_merged_export_serve_the_new_tokens_as_the_adapter(new_tokens_run, tmp_path):
    """PEFT on the base grown to the extended tokenizer (any rows there: the adapter's replace them)
    and the merged export (a plain model and its extended tokenizer) give the adapter's logits."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = new_tokens_run["out"] / "phase1" / "adapter"
    base = tmp_path / "base64"
    shutil.copytree(new_tokens_run["model"], base)
    AutoModelForCausalLM.from_pretrained(new_tokens_run["model"], dtype=torch.float64).save_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    ids = tokenizer("Vizitatorii vin aici în toate anotimpurile <|ro|>", return_tensors="pt").input_ids
    assert set(tokenizer.convert_tokens_to_ids(NEW_TOKENS)) <= set(ids[0].tolist())
    ours, _ = load_model(base, [str(adapter)], torch.float64, keep_last=True, warn=lambda message: None)
    theirs = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    theirs.resize_token_embeddings(len(tokenizer))
    theirs = PeftModel.from_pretrained(theirs, adapter)
    export_merged(str(base), [str(adapter)], str(tmp_path / "merged"), warn=lambda message: None)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float64)
    assert len(AutoTokenizer.from_pretrained(tmp_path / "merged")) == len(tokenizer)
    with torch.no_grad():
        expected = ours.eval()(input_ids=ids, use_cache=False).logits
        assert expected.shape[-1] == len(tokenizer)
        for name, model in (("PEFT", theirs), ("the merged model", merged)):
            assert_equal_in_exact_arithmetic(model.eval()(input_ids=ids, use_cache=False).logits, expected,
                                             f"{name}'s logits")
    # llama.cpp on the merged model's GGUF: the new tokens are tokens of its vocabulary, and its
    # logits are transformers' (tests/finetuning_pipeline/exporters/test_gguf_llama_cpp.py's bound).
    llama_cpp = pytest.importorskip("llama_cpp") if not os.environ.get("REQUIRE_LLAMA_CPP") else \
        __import__("llama_cpp")
    assert export.main(["--format", "gguf", "--outtype", "f32", "--base", str(tmp_path / "merged"),
                        "--out", str(tmp_path / "merged.gguf")]) == 0
    served = llama_cpp.Llama(str(tmp_path / "merged.gguf"), n_ctx=64, n_batch=64, logits_all=True, verbose=False,
                             n_threads=2, type_k=0, type_v=0, flash_attn=False, seed=0)
    try:
        text = "În toate anotimpurile <|ro|> Vizitatorii vin aici"  # (a word first: llama.cpp's leading space)
        assert served.tokenize((" " + text).encode(), add_bos=False, special=True) == \
            tokenizer(text, add_special_tokens=False).input_ids
        served.eval(ids[0].tolist())
        logits = torch.from_numpy(np.array(served.scores[:ids.shape[1]])).double()
    finally:
        served.close()
    merged32 = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert_equal_in_exact_arithmetic(logits, merged32(input_ids=ids).logits[0], "llama.cpp's logits", 1e-4)


@pytest.mark.parametrize("how", [["--format", "gguf", "--adapter-only"], ["--combine", "linear"]])
def test_a_lora_gguf_or_a_combination_of_such_an_adapter_is_refused_in_one_line(run, how, tmp_path, capsys):
    """llama.cpp's LoRA format and a weighted combination hold LoRA matrices only: refused, naming
    the merged export (then a GGUF of it), with nothing written."""
    adapter = str(run["out"] / "phase1" / "adapter")
    code = export.main(["--base", str(run["model"]), "--adapter", adapter, "--out", str(tmp_path / "out"), *how])
    err = capsys.readouterr().err
    assert code == 2 and "only a merged model carries; export it merged" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_merging_phase_starts_where_the_phase_before_ended(run, tmp_path):
    """phase2.init=merge on phase 1's own data: the trained embeddings replace the base's, a fresh
    adapter (and fresh copies of the merged embeddings) starts there, so phase 2's first evaluation
    is phase 1's last within float64's bound."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(run["out"] / "phase1", out / "phase1")
    config = yaml.safe_load(run["config"].read_text())
    assert main.main(["--config", str(run["config"]), "--phase", "2", f"output_dir={out}", "phase2.init=merge",
                      f"phase2.data={config['phase1']['data']}", "train.max_steps=1"]) == 0
    first, second = (json.loads((out / f"phase{n}" / "summary.json").read_text()) for n in (1, 2))
    assert second["merged_adapters"] == [str(out / "phase1" / "adapter")]
    assert_equal_in_exact_arithmetic(second["eval_loss_before"], first["eval_loss_after"], "the merged start")


def test_the_tpus_path_two_replica_threads_a_bf16_base_and_donated_buffers(run, tmp_path):
    """Phase 1 with the embeddings trained whole as a TPU host runs it: the TPU launcher's worker
    with two replica threads (2 rows each a micro-batch: the same global batch), a bf16 base under
    fp32 copies, buffer donation on, recompile_policy=error: no graph after warm-up, no host sync,
    every updated state tensor donated (the copies and their moments among them), fp32 copies on
    disk; step 1's loss (one forward of the same weights) within bf16's bound of the float64 run's
    (tests/tolerances.py), and the run trains. The later steps are not held to that bound, which is
    the LoRA's: AdamW's first steps move every element of the whole matrices by about lr times the
    sign of its gradient, and bf16 flips the sign of the smallest gradients (measured: 0.0058 at
    step 2 against the LoRA's bound of 0.0024)."""
    from tolerances import bf16_loss_bound
    from trainer_helpers import LaunchedRun, metric_records

    out = tmp_path / "out"
    launched = LaunchedRun(["--config", str(run["config"]), "--phase", "1", f"output_dir={out}",
                            "train.micro_batch=2", "model.dtype=bfloat16", "train.recompile_policy=error"],
                           tmp_path / "run.log", devices=2, env={"XLA_ENABLE_PARAM_ALIASING": "1"})
    assert launched.wait(300) == [0], launched.output()
    summary = json.loads((out / "phase1" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["compiles_after_warmup"] == 0
    assert summary["host_syncs_per_step"] == 0
    assert 0 < summary["step_updated_state_tensors"] == summary["step_donated_buffers"], summary
    tensors = adapter_tensors(out)
    assert tensors["base_model.model.lm_head.weight"].dtype == torch.float32
    ours, exact = metric_records(out), metric_records(run["out"])
    assert [r["step"] for r in ours] == [r["step"] for r in exact]
    assert abs(ours[0]["loss"] - exact[0]["loss"]) <= bf16_loss_bound(exact[0]["loss"], exact[0]["label_tokens"], 1)
    assert ours[-1]["loss"] < ours[0]["loss"] and all(math.isfinite(r["loss"]) for r in ours)


def test_a_preference_phase_continuing_the_adapter_starts_from_it_embeddings_included(run, tmp_path):
    """A DPO phase continuing an adapter that trained the embeddings: its reference is the adapter
    as the phase starts, its embeddings' copies frozen beside it too, so the first evaluation is ln 2
    with every reward 0; a reference that left them out (the base's embeddings) would not be."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(run["out"] / "phase1", out / "phase1")
    assert main.main(["--config", str(run["config"]), "--phase", "2", f"output_dir={out}",
                      f"phase2.data={run['data']['pairs']}", "train.max_steps=2"]) == 0
    first = [json.loads(line) for line in (out / "phase2" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "eval"][0]
    assert abs(first["loss"] - math.log(2)) <= 1e-15 and first["rewards/margins"] == 0.0, first
    assert json.loads((out / "phase2" / "summary.json").read_text())["preference"]["reference"] == \
        "the continued adapter, frozen"
