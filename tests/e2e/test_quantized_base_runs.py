"""model.quantize through the trainer: a run on a quantized base takes the steps of the same run on
a base whose decoder Linears hold the dequantized weights (what the quantized base stands for),
on the paths the TPU takes: the captured step with the layer loop's activation checkpointing,
scanned layers with activation checkpointing and LoRA dropout, bf16 with buffer donation under
recompile_policy=error, fsdp over four devices (codes and scales sharded by rows), two replicas
through torchrun (each quantizes its own base); a checkpoint resumes bitwise, and not under
another format.

Tolerance: the same arithmetic on the same values (the weight x scale product, then the same
matmuls), so the losses and adapters are held bitwise, fp32 and bf16 alike."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from replica_helpers import torchrun
from trainer_helpers import adapter_tensors, metric_records, train_in_fresh_process, train_losses, write_run_config

from finetuning_pipeline import export, main
from finetuning_pipeline.model.quantized_base import write_dequantized_copy
from finetuning_pipeline.run.checkpointing import checkpoint_name, complete_checkpoints

RUN = {"train": {"max_steps": 8}, "checkpoint": {"every": 4, "keep": 3}, "eval": {"every": 4, "max_batches": 2},
       "logging": {"every": 1, "progress_bar": False, "tensorboard": False}}
# name: (model.quantize, config changes, runs in a process of its own with this environment)
VARIANTS = {
    "captured": ("q4_0", {"model": {"activation_checkpointing": True}}, None),  # the layer loop's checkpoint
    "scanned": ("nf4", {"train": {"scan_layers": True}, "model": {"activation_checkpointing": True},
                        "lora": {"dropout": 0.1}}, None),
    "bf16_donated": ("q8_0", {"model": {"dtype": "bfloat16"}, "train": {"scan_layers": True, "loss_chunk_tokens": 50,
                                                                         "recompile_policy": "error"}},
                     {"XLA_ENABLE_PARAM_ALIASING": "1"}),
    "fsdp": ("q4_0", {"parallel": {"mode": "fsdp"}, "train": {"micro_batch": 1}, "eval": {"micro_batch": 1}},
             {"CPU_NUM_DEVICES": "4"}),
    "replicas": ("q8_0", {"train": {"max_steps": 4, "micro_batch": 1}, "checkpoint": {"every": 0}}, {}),
}
TORCHRUN = {"replicas": 2}  # variants run as this many torchrun processes


def dtype_of(name: str) -> str:
    return VARIANTS[name][1].get("model", {}).get("dtype", "float32")


@pytest.fixture(scope="module")
def dequantized_bases(tiny_model_dir, tmp_path_factory):
    """{(format, dtype): a copy of the tiny model whose decoder Linears hold, in fp32, the
    dequantized weights of the base loaded in `dtype` (what a run in that dtype quantizes)}."""
    root = tmp_path_factory.mktemp("dequantized")
    return {(fmt, dtype): write_dequantized_copy(tiny_model_dir, fmt, getattr(torch, dtype), root / f"{fmt}_{dtype}")
            for fmt, dtype in sorted({(fmt, dtype_of(name)) for name, (fmt, _, _) in VARIANTS.items()})}


def config_of(root, name: str, model_dir, data, quantize: str, out=None):
    _, changes, _ = VARIANTS[name]
    sections = {k: dict(v) for k, v in RUN.items()}
    for section, values in changes.items():
        sections.setdefault(section, {}).update(values)
    sections["model"] = {"path": str(model_dir), "dtype": "float32", **sections.get("model", {}), "quantize": quantize}
    label = f"{name}_{quantize}"
    return write_run_config(root / f"{label}.yaml", model_dir, data, out or root / label, **sections)


def train(config, name: str, *args: str) -> None:
    env = VARIANTS[name][2]
    if name in TORCHRUN:
        torchrun(TORCHRUN[name], config, "--phase", "1", *args, env=env)
    elif env is None:
        assert main.main(["--config", str(config), "--phase", "1", *args]) == 0
    else:
        proc = train_in_fresh_process(config, "--phase", "1", *args, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def assert_same_steps(out, reference) -> None:
    assert train_losses(out) == train_losses(reference) and train_losses(out)
    assert [r["loss"] for r in metric_records(out, "eval")] == [r["loss"] for r in metric_records(reference, "eval")]
    ours, theirs = adapter_tensors(out), adapter_tensors(reference)
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_quantized_base_trains_as_its_dequantized_weights_do(name, tiny_model_dir, dequantized_bases, data,
                                                                tmp_path, capsys):
    fmt = VARIANTS[name][0]
    quantized = config_of(tmp_path, name, tiny_model_dir, data, fmt)
    reference = config_of(tmp_path, name, dequantized_bases[fmt, dtype_of(name)], data, "none")
    train(quantized, name)
    train(reference, name)
    out, ref = tmp_path / f"{name}_{fmt}", tmp_path / f"{name}_none"
    assert_same_steps(out, ref)
    summary = json.loads((out / "phase1" / "summary.json").read_text())
    assert summary["quantized_base"]["format"] == fmt and summary["quantized_base"]["linears"] == 14
    assert summary["quantized_base"]["weight_bytes"] <= 0.55 * summary["quantized_base"]["bf16_bytes"]
    assert summary["resume_keys"]["model.quantize"] == fmt
    # the checkpointing mode it ran in (true is full's alias)
    assert summary["activation_checkpointing"] == ("full" if VARIANTS[name][1].get("model", {}).get(
        "activation_checkpointing") else None)
    assert json.loads((ref / "phase1" / "summary.json").read_text())["quantized_base"] is None
    # lineage.json records the dtype the base was quantized from (#54.3), which tells whether the
    # base's GGUF in the same format holds the blocks the adapter trained on.
    lineage = json.loads((out / "phase1" / "adapter" / "lineage.json").read_text())
    assert (lineage["quantize"], lineage["quantized_from"]) == (fmt, dtype_of(name))
    if name == "bf16_donated":
        assert summary["compiles_after_warmup"] == 0 and summary["host_syncs_per_step"] == 0
        assert summary["step_donated_buffers"] == summary["step_updated_state_tensors"] > 0
        # The tiny model's files are float32: the run quantized them rounded to bf16 first.
        capsys.readouterr()
        assert export.main(["--format", "gguf", "--adapter-only", "--base", str(tiny_model_dir), "--adapter",
                            str(out / "phase1" / "adapter"), "--out", str(tmp_path / "adapter.gguf")]) == 0
        assert (f"quantized from its values rounded to bfloat16 (model.dtype); the base's GGUF in --outtype {fmt} is "
                "quantized from the files' float32 values, so its blocks are close to, not equal to") \
            in capsys.readouterr().err
    if name == "replicas":
        assert summary["parallel"]["processes"] == 2
    if name == "fsdp":  # each Linear's weight sharded there, its codes and its scales here
        unquantized = json.loads((ref / "phase1" / "summary.json").read_text())["parallel"]["sharded_base_parameters"]
        assert summary["parallel"]["sharded_base_parameters"] == unquantized + 14 > 14
    if name == "captured":
        resumes_bitwise_and_not_under_another_format(out, tmp_path, tiny_model_dir, data)
        assert json.loads((out / "phase1" / "adapter" / "lineage.json").read_text())["quantize"] == fmt
        capsys.readouterr()
        assert export.main(["--base", str(tiny_model_dir), "--adapter", str(out / "phase1" / "adapter"),
                            "--out", str(tmp_path / "merged")]) == 0
        assert "was trained on the base stored as q4_0 (model.quantize); it is merged into the base's " \
               "full-precision weights" in capsys.readouterr().err


def resumes_bitwise_and_not_under_another_format(out, tmp_path, tiny_model_dir, data) -> None:
    """The quantized base is rebuilt from the base at a resume (a checkpoint holds the LoRA only):
    from step 4, the uninterrupted run's steps, bitwise; under another model.quantize, refused."""
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "phase1" / "checkpoints", resumed / "phase1" / "checkpoints")
    for checkpoint in complete_checkpoints(resumed / "phase1" / "checkpoints"):
        if checkpoint.name != checkpoint_name(4):
            shutil.rmtree(checkpoint)
    other = config_of(tmp_path, "captured", tiny_model_dir, data, "q8_0", out=resumed)
    assert main.main(["--config", str(other), "--phase", "1", "--resume", "auto"]) == 2
    same = config_of(tmp_path, "captured", tiny_model_dir, data, "q4_0", out=resumed)
    assert main.main(["--config", str(same), "--phase", "1", "--resume", "auto"]) == 0
    assert train_losses(resumed)[-4:] == train_losses(out)[-4:]
    ours, theirs = adapter_tensors(resumed), adapter_tensors(out)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


def loop_state_shapes(dump) -> set[str]:
    """The 2-D float arrays every XLA While loop carries, in the optimized HLO of every graph the
    run compiled (XLA_FLAGS --xla_dump_to): what a loop holds for its whole run."""
    import re

    shapes = set()
    for path in dump.glob("*after_optimizations.txt"):
        for state in re.findall(r"= \(([^)]*)\) while\(", path.read_text()):
            shapes.update(re.findall(r"(?:f32|bf16|f16)\[\d+,\d+\]", state))
    return shapes


def dequantized_shapes(model_dir, fmt: str) -> set[str]:
    """Every shape a decoder Linear's dequantized weight takes: [out, in], transposed, and its
    blocks' layout [out * in / block, block], in any float type."""
    from transformers import AutoConfig

    from finetuning_pipeline.planning.tpu_plan import ModelShape
    from lora_logic.quantize import BLOCK

    config = AutoConfig.from_pretrained(model_dir)
    config.num_hidden_layers = 1  # (the shape needs no parameter count: projections only)
    shape = ModelShape(layers=1, hidden=config.hidden_size, intermediate=config.intermediate_size,
                       heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                       head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                       vocab=config.vocab_size, total_params=0)
    found = set()
    for in_features, out_features in shape.projections().values():
        for dims in ((out_features, in_features), (in_features, out_features),
                     (out_features * in_features // BLOCK[fmt], BLOCK[fmt])):
            found.update(f"{kind}[{dims[0]},{dims[1]}]" for kind in ("f32", "bf16", "f16"))
    return found


@pytest.mark.parametrize("fmt, sections", [
    ("q8_0", {"train": {"scan_layers": False}}),
    ("q4_0", {"train": {"scan_layers": False}, "model": {"activation_checkpointing": True}}),
    ("nf4", {"train": {"scan_layers": False, "grad_accum": 4}}),
    ("q8_0", {"train": {"scan_layers": True}}),
], ids=["q8_0", "q4_0-checkpointed", "nf4-grad_accum_4", "q8_0-scanned"])
def test_no_loop_of_the_step_carries_a_dequantized_weight(fmt, sections, tiny_model_dir, data, tmp_path):
    """The micro-batch loop (grad_accum 2, and 4) carries no decoder Linear's dequantized weight,
    which XLA's loop-invariant code motion would move out of it (it reads only codes and scales):
    the memory the quantization saves, kept for the whole step. The optimized
    HLO of the trainer's own step, compiled by the real command: no loop holds one (the control:
    the LoRA's A products, [r, in], are there)."""
    import os

    dump = tmp_path / "hlo"
    merged = {"model": {"quantize": fmt}, "train": {"max_steps": 2, "grad_accum": 2},
              "eval": {"every": 0, "max_batches": 1}, "checkpoint": {"every": 0, "keep": 1}}
    for section, values in sections.items():
        merged[section] = {**merged.get(section, {}), **values}
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out", **merged)
    done = train_in_fresh_process(config, "--phase", "1", env={
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text"})
    assert done.returncode == 0, done.stdout + done.stderr
    carried = loop_state_shapes(dump)
    assert carried, "no While loop found in the step's HLO"
    assert any(shape.startswith("f32[") and ",64]" in shape for shape in carried)  # the control: LoRA's A
    assert not carried & dequantized_shapes(tiny_model_dir, fmt)


def all_gathered(dump) -> set[str]:
    """The shape of every all-gather's result in the optimized HLO of every graph the run
    compiled: what the partitioner moves between chips to make a sharded tensor whole."""
    import re

    return {shape for path in dump.glob("*after_optimizations.txt")
            for shape in re.findall(r"([a-z]+\d*\[\d+(?:,\d+)*\])\{[^}]*\} all-gather\(", path.read_text())}


@pytest.mark.parametrize("fmt, grad_accum, checkpointed", [("q8_0", 1, False), ("q4_0", 4, True), ("nf4", 4, False)])
def test_fsdp_gathers_a_quantized_weights_codes_and_scales_never_the_dequantized_weight(
        fmt, grad_accum, checkpointed, tiny_model_dir, data, tmp_path):
    """Under fsdp (4 devices, codes and scales sharded by rows) the partitioner, left to itself,
    dequantizes each chip's rows and all-gathers the dequantized weight for the matmul: 2 to 4
    times the bytes of the codes. In the optimized HLO of the trainer's own step, the all-gathers
    now carry the codes (s8 in q8_0, two 4-bit codes a u8 in q4_0 and nf4) and the scales, and no
    float array shaped like a decoder weight (or its blocks); the embedding, not quantized, is
    still gathered as floats (the control)."""
    import os

    dump = tmp_path / "hlo"
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out",
                              model={"quantize": fmt, "activation_checkpointing": checkpointed},
                              parallel={"mode": "fsdp"},
                              train={"max_steps": 2, "grad_accum": grad_accum, "micro_batch": 1},
                              eval={"every": 0, "max_batches": 1, "micro_batch": 1}, checkpoint={"every": 0, "keep": 1})
    done = train_in_fresh_process(config, "--phase", "1", env={
        "CPU_NUM_DEVICES": "4",
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text"})
    assert done.returncode == 0, done.stdout + done.stderr
    gathered = all_gathered(dump)
    codes = "s8[" if fmt == "q8_0" else "u8["
    assert any(shape.startswith(codes) for shape in gathered), gathered
    assert any(shape.startswith("f32[") for shape in gathered), gathered  # the control: the embedding
    assert not gathered & dequantized_shapes(tiny_model_dir, fmt), gathered
