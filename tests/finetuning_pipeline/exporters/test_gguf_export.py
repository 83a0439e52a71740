"""The GGUF export without llama.cpp: its bytes against gguf-py's own quantizer, and every refusal
(one line, exit 2, nothing written). llama.cpp's verdict on the files: test_gguf_llama_cpp.py."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
from gguf_models import write_family_model, write_random_adapter
from transformers import AutoModelForCausalLM, GPT2Config

from finetuning_pipeline import export
from finetuning_pipeline.exporters import gguf_tensors
from finetuning_pipeline.exporters.gguf_tensors import OUTTYPES, encode


def hard_weights() -> torch.Tensor:
    """Rows that catch a wrong port of ggml's rounding: exact halves of the scale (C's roundf
    rounds them away from zero, torch.round to even), ties for the largest magnitude, zero and
    constant blocks, values at the limits."""
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randn(128, generator=generator) * scale for scale in (1e-3, 1.0, 300.0)]
    rows.append((torch.arange(128) % 32 - 15.5).float())  # x/d lands on .5
    rows.append(torch.cat([torch.full((32,), -2.0), torch.full((32,), 2.0), torch.zeros(64)]))
    return torch.stack(rows).float()


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0", "q4_0"])
def test_the_bytes_are_those_gguf_py_writes(outtype):
    weights = hard_weights()
    ours = encode(weights, OUTTYPES[outtype])
    theirs = gguf.quants.quantize(weights.numpy(), OUTTYPES[outtype])
    assert ours.tobytes() == theirs.tobytes()
    assert ours.nbytes == theirs.nbytes


def refused(capsys, *args) -> str:
    """Run the export, expect exit 2 with one line on stderr, and return that line."""
    capsys.readouterr()
    assert export.main([*map(str, args)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]


def nothing_written(directory) -> bool:
    return not any(path.suffix == ".gguf" or ".partial-" in path.name for path in directory.iterdir())


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    base = write_family_model(root / "base", "llama")
    return base, write_random_adapter(root / "adapter", base, "llama", seed=1)


def test_a_family_llama_cpp_lacks_is_refused_naming_it(tmp_path, capsys):
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt2")
    line = refused(capsys, "--format", "gguf", "--base", tmp_path / "gpt2", "--out", tmp_path / "out.gguf")
    assert "model_type 'gpt2' has no GGUF export" in line and "qwen3" in line
    assert nothing_written(tmp_path)


def test_what_llama_cpp_would_compute_otherwise_is_refused_naming_the_key(tmp_path, capsys):
    base = write_family_model(tmp_path / "base", "gemma2", query_pre_attn_scalar=256)
    line = refused(capsys, "--format", "gguf", "--base", base, "--out", tmp_path / "out.gguf")
    assert "query_pre_attn_scalar=256" in line and "1/sqrt(head_dim)" in line
    assert nothing_written(tmp_path)


def test_an_outtype_the_export_cannot_write_is_refused(llama_files, tmp_path, capsys):
    base, adapter = llama_files
    line = refused(capsys, "--format", "gguf", "--outtype", "q8_0", "--adapter-only", "--base", base,
                   "--adapter", adapter, "--out", tmp_path / "a.gguf")
    assert "--outtype q8_0" in line and "f32, f16, bf16" in line
    line = refused(capsys, "--format", "gguf", "--outtype", "q4_k_m", "--base", base, "--out", tmp_path / "m.gguf")
    assert "f32, f16, bf16, q8_0, q4_0" in line and "llama-quantize model-f16.gguf model-Q4_K_M.gguf Q4_K_M" in line
    line = refused(capsys, "--format", "gguf", "--outtype", "fp8", "--base", base, "--out", tmp_path / "m.gguf")
    assert "--outtype fp8" in line
    # A type the export writes, in capitals, is not sent to llama-quantize as a K-quant.
    for typed, adapter_only in (("Q8_0", []), ("F16", ["--adapter-only", "--adapter", adapter])):
        line = refused(capsys, "--format", "gguf", "--outtype", typed, *adapter_only, "--base", base, "--out",
                       tmp_path / "m.gguf")
        assert line.endswith(f"did you mean {typed.lower()}?") and "K-quant" not in line, line
    assert nothing_written(tmp_path)


@pytest.mark.parametrize("name", ["x" * 300 + ".gguf", "x" * 245 + ".gguf", "d" * 300 + "/m.gguf"],
                         ids=["file name over NAME_MAX", "staging name over NAME_MAX", "directory name over NAME_MAX"])
def test_a_name_the_file_system_refuses_is_bad_input_and_creates_nothing(llama_files, tmp_path, capsys, name):
    """An --out whose name the file system refuses is one line, not exit 3 ("Fix it (free space,
    permissions)"), and the directories made above it do not stay."""
    base, _ = llama_files
    out = tmp_path / "dir with space" / "below" / name
    line = refused(capsys, "--format", "gguf", "--base", base, "--out", out)
    assert "the file system takes names of" in line and "choose a shorter --out" in line, line
    assert list(tmp_path.iterdir()) == []


def test_an_adapter_for_another_base_is_refused(llama_files, tmp_path, capsys):
    base, _ = llama_files
    other = write_family_model(tmp_path / "other", "llama", intermediate_size=96)
    adapter = write_random_adapter(tmp_path / "other-adapter", other, "llama", seed=1)
    for flags in ([], ["--adapter-only"]):
        line = refused(capsys, "--format", "gguf", *flags, "--base", base, "--adapter", adapter,
                       "--out", tmp_path / "out.gguf")
        assert "in the adapter but" in line and "an adapter for another base" in line
    qwen = write_family_model(tmp_path / "qwen", "qwen2")
    line = refused(capsys, "--format", "gguf", "--base", qwen, "--adapter", adapter, "--out", tmp_path / "out.gguf")
    assert "an adapter for another base" in line
    assert nothing_written(tmp_path)


def test_an_existing_output_is_replaced_only_with_force_and_only_if_ours(llama_files, tmp_path, capsys):
    base, _ = llama_files
    out = tmp_path / "model.gguf"
    out.write_bytes(b"someone else's file")
    line = refused(capsys, "--format", "gguf", "--base", base, "--out", out)
    assert "already exists; pass --force" in line
    line = refused(capsys, "--format", "gguf", "--base", base, "--out", out, "--force")
    assert "did not write" in line
    assert out.read_bytes() == b"someone else's file"
    out.unlink()
    assert export.main(["--format", "gguf", "--base", str(base), "--out", str(out)]) == 0
    first = out.read_bytes()
    refused(capsys, "--format", "gguf", "--outtype", "q8_0", "--base", base, "--out", out)
    assert export.main(["--format", "gguf", "--outtype", "q8_0", "--base", str(base), "--out", str(out),
                        "--force"]) == 0
    assert out.read_bytes() != first
    assert gguf.GGUFReader(out).get_field("general.file_type").contents() == gguf.LlamaFileType.MOSTLY_Q8_0


def test_a_pre_tokenizer_llama_cpp_has_no_name_for_is_refused(llama_files, tmp_path, capsys):
    base = write_family_model(tmp_path / "base", "qwen2")
    tokenizer_json = base / "tokenizer.json"
    data = json.loads(tokenizer_json.read_text())
    data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\s+"
    tokenizer_json.write_text(json.dumps(data))
    line = refused(capsys, "--format", "gguf", "--base", base, "--out", tmp_path / "out.gguf")
    assert str(tokenizer_json) in line and "pre-tokenizer" in line
    assert nothing_written(tmp_path)


def test_a_window_llama_cpp_does_not_apply_is_said(tmp_path, capsys):
    base = write_family_model(tmp_path / "base", "mistral", sliding_window=6)
    assert export.main(["--format", "gguf", "--base", str(base), "--out", str(tmp_path / "m.gguf")]) == 0
    assert "sliding_window=6: llama.cpp's llama attends to the whole context" in capsys.readouterr().err


def test_options_of_the_other_format_are_refused(llama_files, tmp_path, capsys):
    base, adapter = llama_files
    for args, message in ((["--adapter", str(adapter), "--outtype", "q8_0"], "--outtype goes with --format gguf"),
                          (["--format", "gguf", "--dtype", "float16"], "--dtype goes with --format hf"),
                          ([], "--adapter is required")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            export.main(["--base", str(base), "--out", str(tmp_path / "x"), *args])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def test_q8_0_rows_that_are_not_blocks_fall_back_to_f16(tmp_path, capsys):
    base = write_family_model(tmp_path / "base", "llama", intermediate_size=48)
    assert export.main(["--format", "gguf", "--outtype", "q8_0", "--base", str(base),
                        "--out", str(tmp_path / "m.gguf")]) == 0
    assert "not a multiple of 32" in capsys.readouterr().err
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert types["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.F16  # rows of 48
    assert types["blk.0.ffn_up.weight"] == gguf.GGMLQuantizationType.Q8_0  # rows of 32
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_tensors_encoded_in_row_blocks_give_the_same_file(llama_files, tmp_path, monkeypatch, outtype):
    """The embedding and output are encoded a block of rows at a time (64 MiB of fp32 on a real
    model; here blocks of 5 rows of 32 values: 1032 rows end in an uneven block)."""
    base, adapter = llama_files
    args = ["--format", "gguf", "--outtype", outtype, "--base", str(base), "--adapter", str(adapter)]
    assert export.main([*args, "--out", str(tmp_path / "whole.gguf")]) == 0
    monkeypatch.setattr(gguf_tensors, "ROWS_VALUES", 5 * 32)
    assert export.main([*args, "--out", str(tmp_path / "blocks.gguf")]) == 0
    assert (tmp_path / "whole.gguf").read_bytes() == (tmp_path / "blocks.gguf").read_bytes()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_the_gguf_of_a_quantized_base_holds_the_bytes_a_quantized_run_trained_on(tmp_path, fmt):
    """A run with model.quantize=q8_0 (or q4_0) in bf16 on bf16 files, as most bases ship, trains
    against exactly the blocks this export writes for --outtype q8_0: the base's GGUF plus the
    adapter's LoRA GGUF serve in llama.cpp the weights the adapter was trained on (q and k rows
    in llama.cpp's order: ggml's blocks never cross a row, so the rows' blocks move with them)."""
    from finetuning_pipeline.exporters.gguf_families import permute_rotary_rows
    from finetuning_pipeline.model.loading import load_base
    from lora_logic.quantized_linear import QuantizedLinear

    base = write_family_model(tmp_path / "fp32", "llama")
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / "bf16" / name).write_bytes((base / name).read_bytes())
    assert export.main(["--format", "gguf", "--outtype", fmt, "--base", str(tmp_path / "bf16"),
                        "--out", str(tmp_path / "base.gguf")]) == 0
    written = {t.name: t.data for t in gguf.GGUFReader(tmp_path / "base.gguf").tensors}
    trained = load_base(tmp_path / "bf16", torch.bfloat16, quantize=fmt)
    config = trained.config
    compared = 0
    for name, module in trained.named_modules():
        if not isinstance(module, QuantizedLinear):
            continue
        layer, kind = name.split(".")[2], name.rsplit(".", 1)[-1]
        blocks = torch.cat([module.scales.view(torch.uint8).reshape(module.out_features, -1, 2),
                            module.codes.view(torch.uint8).reshape(module.out_features, module.scales.shape[1], -1)],
                           dim=2).reshape(module.out_features, -1)
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(kind)
        if heads:
            blocks = permute_rotary_rows(blocks, heads)
        gguf_kind = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                     "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}[kind]
        assert written[f"blk.{layer}.{gguf_kind}.weight"].tobytes() == blocks.numpy().tobytes(), name
        compared += 1
    assert compared == 7 * config.num_hidden_layers


def test_an_adapter_trained_on_a_quantized_base_says_which_base_serves_it(llama_files, tmp_path, capsys):
    """The base's GGUF in the run's format holds the blocks the adapter trained on only
    when the run quantized the files' own values: its model.dtype the files' dtype, or float32. A
    run in bf16 on fp16 files (or in fp16 on bf16 ones) quantized values rounded first."""
    from finetuning_pipeline.exporters.gguf_tensors import BaseTensors
    from finetuning_pipeline.model.lineage import model_lineage, quantized_with, write_lineage

    base, trained = llama_files
    with BaseTensors(base) as tensors:
        (stored,) = tensors.float_dtypes()
    rounding = "float16" if stored == "bfloat16" else "bfloat16"
    cases = [(stored, "serve it on the base's GGUF in --outtype q8_0, which holds the very blocks"),
             ("float32", "serve it on the base's GGUF in --outtype q8_0, which holds the very blocks"),
             (rounding, f"quantized from its values rounded to {rounding} (model.dtype); the base's GGUF in "
                        f"--outtype q8_0 is quantized from the files' {stored} values, so its blocks are close to, "
                        "not equal to"),
             (None, f"only if the run's model.dtype was the files' own ({stored}) or float32")]
    for k, (run_dtype, said) in enumerate(cases):
        adapter = tmp_path / f"adapter{k}"
        adapter.mkdir()
        for path in trained.iterdir():
            (adapter / path.name).write_bytes(path.read_bytes())
        lineage = quantized_with(model_lineage(base), "q8_0", run_dtype)
        if run_dtype is None:  # a run from before lineage.json recorded its dtype
            del lineage["quantized_from"]
        write_lineage(adapter, lineage)
        capsys.readouterr()
        assert export.main(["--format", "gguf", "--adapter-only", "--base", str(base), "--adapter", str(adapter),
                            "--out", str(tmp_path / f"a{k}.gguf")]) == 0
        err = capsys.readouterr().err
        assert said in err, (run_dtype, err)
        if run_dtype in (rounding, None):
            assert "which holds the very blocks" not in err
    assert export.main(["--format", "gguf", "--base", str(base), "--adapter", str(adapter),
                        "--out", str(tmp_path / "m.gguf")]) == 0
    assert "merged into the base's full-precision weights" in capsys.readouterr().err


@pytest.mark.parametrize("gguf_format", [True, False])
def test_a_combined_export_never_writes_into_an_adapter_it_combines(llama_files, tmp_path, capsys, gguf_format):
    """The adapters reach the writers as one temporary combined adapter: --out inside one of the
    originals is refused before anything is written, for GGUF and Hugging Face alike."""
    base, adapter = llama_files
    before = sorted(p.name for p in adapter.iterdir())
    out = adapter / ("combined.gguf" if gguf_format else "combined")
    line = refused(capsys, *(["--format", "gguf"] if gguf_format else []), "--base", base, "--adapter", adapter,
                   "--adapter", adapter, "--combine", "linear", "--out", out)
    assert "overlaps --adapter" in line
    assert sorted(p.name for p in adapter.iterdir()) == before
