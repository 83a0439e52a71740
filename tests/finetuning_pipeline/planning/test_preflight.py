"""`python -m finetuning_pipeline.preflight`: checks, the HBM/time plan, and the CPU rehearsal."""

from __future__ import annotations

import pytest
import torch
import yaml
from conftest import REPO
from trainer_helpers import SEQ_LEN, run_preflight, write_run_config
from transformers import AutoConfig, AutoModelForCausalLM

from finetuning_pipeline.planning import phase_plan
from finetuning_pipeline.planning.tpu_chips import parse_tpu_type
from finetuning_pipeline.planning.tpu_plan import ModelShape
from lora_logic.adapters import lora_parameters
from lora_logic.config import DEFAULT_TARGET_MODULES, LoraConfig
from lora_logic.inject import inject_lora

CONFIGS = REPO / "finetuning_pipeline" / "configs"
MISTRAL = CONFIGS / "mistral7b_v6e8.yaml"
SHIPPED = sorted(p.name for p in phase_plan.SHIPPED_CONFIGS.iterdir() if p.is_dir())


@pytest.mark.parametrize(
    "tpu_type, mode, fits",
    [("v5e-8", "dp", False), ("v5e-8", "fsdp", True), ("v6e-8", "dp", True)],
)
def test_mistral_7b_plan(tmp_path, tpu_type, mode, fits):
    code, report = run_preflight(tmp_path, MISTRAL, f"tpu.type={tpu_type}", f"parallel.mode={mode}")
    assert report["fits"] is fits and code == (0 if fits else 1)
    assert report["model_config"].endswith("model_configs/Mistral-7B-v0.3/config.json")  # before any download
    for key in ("hbm_per_chip_gib", "hbm_capacity_gib", "step_time_s", "tokens_per_sec", "tpu_hours"):
        assert report[key] > 0, key
    phase = report["phases"]["phase1"]
    assert phase["inputs"]["tpu_type"] == tpu_type
    assert phase["inputs"]["mode"] == mode and phase["inputs"]["seq_len"] == 2048
    assert phase["inputs"]["base_params"] == 7_248_023_552 and phase["inputs"]["lora_params"] == 41_943_040
    assert report["hbm_capacity_gib"] == pytest.approx(14.9 if tpu_type == "v5e-8" else 29.8, abs=0.05)
    # 13.5 GiB of bf16 weights per chip under dp; an eighth (plus two gathered layers) under fsdp.
    assert phase["hbm_breakdown_gib"]["weights"] == pytest.approx(13.5 if mode == "dp" else 2.5, abs=0.05)
    assert phase["activations_gib_with_checkpointing"] < phase["activations_gib_without_checkpointing"]
    if not fits:
        assert phase["to_fit"][0]["overrides"] == {"parallel.mode": "fsdp"}
    assert report["checks"]["lora_targets"]["status"] == "passed"
    assert report["checks"]["data"]["status"] == "skipped"  # the model is not downloaded here


def test_the_plan_scales_with_the_slice_and_the_steps(tmp_path):
    _, v6e8 = run_preflight(tmp_path / "a", MISTRAL, "tpu.type=v6e-8")
    _, v6e16 = run_preflight(tmp_path / "b", MISTRAL, "tpu.type=v6e-16", "train.max_steps=1000", "phase2.max_steps=500")
    # Twice the chips: twice the global batch per step at the same step time; half the steps.
    assert v6e16["step_time_s"] == pytest.approx(v6e8["step_time_s"], rel=1e-3)
    assert v6e16["tokens_per_sec"] == pytest.approx(2 * v6e8["tokens_per_sec"], rel=1e-3)
    # Half the steps, the same compile (one per phase; the layers scanned: tpu.compile_s_scanned).
    compile_h = {name: sum(p["compile_s"] for p in r["phases"].values()) / 3600 for name, r in
                 (("v6e8", v6e8), ("v6e16", v6e16))}
    assert compile_h["v6e8"] == compile_h["v6e16"] == pytest.approx(2 * 2.8 / 3600, abs=1e-4)
    assert v6e16["tpu_hours"] - compile_h["v6e16"] == pytest.approx((v6e8["tpu_hours"] - compile_h["v6e8"]) / 2,
                                                                    rel=1e-2)


def test_compile_time_follows_the_layers_not_grad_accum_and_counts_every_session(tmp_path):
    loop = ("train.scan_layers=false", "tpu.compile_s_per_layer=10", "train.grad_accum=8")
    _, captured = run_preflight(tmp_path / "a", MISTRAL, *loop)
    _, traced = run_preflight(tmp_path / "b", MISTRAL, *loop, "train.capture_step=false")
    assert captured["phases"]["phase1"]["compile_s"] == 320  # 32 layers x 10 s, once for the 8 micro-batches
    assert traced["phases"]["phase1"]["compile_s"] == 8 * 320  # traced: the graph holds 8 micro-batches
    _, sessions = run_preflight(tmp_path / "c", MISTRAL, *loop, "train.max_wall_time=20m")
    phase = sessions["phases"]["phase1"]
    steps_h = captured["phases"]["phase1"]["tpu_hours"] - 320 / 3600
    assert phase["sessions"] > 1
    assert phase["tpu_hours"] == pytest.approx(steps_h + phase["sessions"] * 320 / 3600, abs=2e-3)


def test_scanned_layers_compile_once_whatever_the_depth_where_the_model_allows(tmp_path):
    """The plan asks a weightless model what the trainer will do: Mistral's identical layers
    are scanned (tpu.compile_s_scanned, whatever layers and grad_accum) except under fsdp;
    Gemma 3's sliding and full layers differ, so it compiles per layer."""
    _, scanned = run_preflight(tmp_path / "a", MISTRAL, "tpu.compile_s_scanned=7", "train.grad_accum=8")
    assert scanned["phases"]["phase1"]["compile_s"] == 7 and scanned["phases"]["phase1"]["inputs"]["scanned_layers"]
    _, fsdp = run_preflight(tmp_path / "b", MISTRAL, "tpu.compile_s_per_layer=10", "parallel.mode=fsdp")
    assert fsdp["phases"]["phase1"]["compile_s"] == 320 and not fsdp["phases"]["phase1"]["inputs"]["scanned_layers"]
    _, gemma = run_preflight(tmp_path / "c", CONFIGS / "gemma3_270m_single_chip.yaml", "tpu.compile_s_per_layer=10")
    assert (
        gemma["phases"]["phase1"]["compile_s"] == 18 * 10 and not gemma["phases"]["phase1"]["inputs"]["scanned_layers"]
    )


def test_scan_layers_true_on_a_model_that_cannot_be_scanned_is_refused_on_the_cpu(tmp_path, capsys):
    """Not after the model has loaded on a rented TPU: preflight asks a weightless model."""
    code, _ = run_preflight(tmp_path, CONFIGS / "gemma3_270m_single_chip.yaml", "train.scan_layers=true")
    assert code == 2
    assert "train.scan_layers=true, but decoder layers 0 and 5 differ in" in capsys.readouterr().err


@pytest.mark.parametrize("name", SHIPPED)
def test_the_plans_layer_shapes_match_the_architecture(name):
    """The projection shapes the FLOP and LoRA counts use are the real model's."""
    config = AutoConfig.from_pretrained(phase_plan.SHIPPED_CONFIGS / name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    inject_lora(model, LoraConfig(r=16, alpha=32))
    shape = ModelShape.from_config(config)
    assert shape.lora_params(16, list(DEFAULT_TARGET_MODULES)) == sum(p.numel() for p in lora_parameters(model))
    assert (
        shape.matmul_params
        < shape.total_params
        == sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    )


@pytest.mark.parametrize(
    "tpu_type, chips, devices, hosts",
    [("v5e-8", 8, 8, 1), ("v5litepod-16", 16, 16, 4), ("v6e-8", 8, 8, 1), ("v4-8", 4, 4, 1), ("v4-32", 16, 16, 4),
     ("v5p-8", 4, 4, 1), ("v3-8", 4, 8, 1), ("v2-8", 4, 8, 1)],
)
def test_accelerator_types(tpu_type, chips, devices, hosts):
    tpu = parse_tpu_type(tpu_type)
    assert (tpu.chips, tpu.devices, tpu.hosts) == (chips, devices, hosts)


def test_bad_inputs_name_what_to_fix(tmp_path, capsys):
    code, _ = run_preflight(tmp_path, MISTRAL, "tpu.type=v9-8")
    assert code == 2 and "tpu.type 'v9-8'" in capsys.readouterr().err
    code, _ = run_preflight(tmp_path, MISTRAL, "model.path=models/NoSuchModel-1B")
    assert code == 2 and "no shipped copy matches" in capsys.readouterr().err
    code, _ = run_preflight(tmp_path, MISTRAL, "phase1.seq_len=null")
    assert code == 2 and "phase1.seq_len" in capsys.readouterr().err
    code, report = run_preflight(tmp_path, MISTRAL, "tpu.type=v6e-8", "lora.target_modules=[q_proj,c_attn]")
    assert code == 1 and report["checks"]["lora_targets"]["status"] == "failed"
    assert "c_attn" in report["checks"]["lora_targets"]["detail"]


def test_data_is_checked_against_the_tokenizer_and_seq_len(tmp_path, tiny_model_dir, data):
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out")
    code, report = run_preflight(tmp_path, config, f"phase1.seq_len={SEQ_LEN * 2}")
    assert code == 1 and report["checks"]["data"]["status"] == "failed"
    assert f"phase1.seq_len is {SEQ_LEN * 2}" in report["checks"]["data"]["detail"]


def test_kernels_are_judged_for_the_planned_tpu_not_the_machine_preflight_runs_on(tmp_path, tiny_model_dir, data,
                                                                                  capsys):
    """On this CPU, planning a v5e with flash attention passes the data check (on main it failed:
    "Pallas kernels run on TPU only"); planning a v3, which gets no Pallas kernel, is refused."""
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out")
    code, report = run_preflight(tmp_path, config, "tpu.type=v5e-8", "model.attention=flash")
    assert report["checks"]["data"]["status"] == "passed", report["checks"]["data"]
    assert report["phases"]["phase1"]["inputs"]["attention"] == "flash"
    # auto: not flash in 8 dp processes (unproven), but on one chip
    capsys.readouterr()
    code, report = run_preflight(tmp_path, config, "tpu.type=v5e-8")
    assert report["phases"]["phase1"]["inputs"]["attention"] == "dense"
    assert "attention: dense attention, not flash: flash in 8 dp processes" in capsys.readouterr().out
    code, report = run_preflight(tmp_path, config, "tpu.type=v5e-8", "parallel.single_chip=true")
    assert report["phases"]["phase1"]["inputs"]["attention"] == "flash"
    code, _ = run_preflight(tmp_path, config, "tpu.type=v3-8", "model.attention=flash")
    assert code == 2 and "model.attention=flash: torch_xla's Pallas kernels are reported not to work on TPU v3" \
        in capsys.readouterr().err
    code, report = run_preflight(tmp_path, config, "tpu.type=v3-8", "parallel.mode=fsdp")
    assert report["phases"]["phase1"]["inputs"]["attention"] == "dense"
    # Colab's and Kaggle's v2-8: planned (8 devices of 8 GiB), no kernel either.
    code, report = run_preflight(tmp_path, config, "tpu.type=v2-8")
    assert code == 0 and report["phases"]["phase1"]["inputs"]["attention"] == "dense"
    code, _ = run_preflight(tmp_path, config, "tpu.type=v2-8", "model.attention=flash")
    assert code == 2 and "reported not to work on TPU v2" in capsys.readouterr().err


@pytest.mark.parametrize("tpu_type, attention, fits", [("v6e-8", "auto", True), ("v6e-8", "dense", False),
                                                        ("v5e-8", "auto", False)])
def test_a_9b_model_at_32k_context_fits_a_v6e_8_only_with_kernel_attention(tmp_path, tpu_type, attention, fits):
    """Gemma 2 9B at seq_len 32,768 under fsdp with activation checkpointing and the chunked
    loss: splash attention (what auto picks on an SPMD mesh) keeps no [heads, L, L] scores."""
    config = tmp_path / "gemma2_9b_32k.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": "models/gemma-2-9b", "dtype": "bfloat16", "activation_checkpointing": True},
        "train": {"max_steps": 100, "micro_batch": 1, "grad_accum": 4}, "parallel": {"mode": "fsdp"},
        "phase1": {"data": str(tmp_path / "none1"), "seq_len": 32768},
        "phase2": {"data": str(tmp_path / "none2"), "seq_len": 32768}}))
    code, report = run_preflight(tmp_path, config, f"tpu.type={tpu_type}", f"model.attention={attention}")
    phase = report["phases"]["phase1"]
    assert report["fits"] is fits and code == (0 if fits else 1)
    assert phase["inputs"]["seq_len"] == 32768 and phase["inputs"]["attention"] == (
        "splash" if attention == "auto" else "dense"
    )
    assert phase["hbm_breakdown_gib"]["logits"] < 1  # one chunk of 256 tokens x 256k vocabulary
    if attention == "dense":
        assert phase["hbm_breakdown_gib"]["activations"] > 60  # the [heads, L, L] scores of a layer


def test_adapters_side_by_side_are_planned_against_the_same_adapters_one_after_another(tmp_path):
    """The shipped four-adapter config: K adapters' rows and K LoRAs with their optimizers on
    one base held once; one after another costs the same steps plus K compiles. An adapter with
    fewer steps than the longest makes side by side cost more (its rows still run)."""
    config = CONFIGS / "qwen25_05b_four_adapters_v3_8.yaml"
    code, report = run_preflight(tmp_path, config)
    assert code == 0
    phase = report["phases"]["phase1"]
    assert phase["inputs"]["adapters"] == 4 and phase["inputs"]["scanned_layers"]
    code, alone = run_preflight(tmp_path / "alone", config, "phase1.adapters={}", "phase1.data=d")
    assert code == 0
    one = alone["phases"]["phase1"]
    assert one["inputs"]["adapters"] == 1
    assert phase["tokens_per_step"] == 4 * one["tokens_per_step"]
    assert phase["hbm_breakdown_gib"]["weights"] == one["hbm_breakdown_gib"]["weights"]
    assert phase["hbm_breakdown_gib"]["lora_and_optimizer"] == pytest.approx(
        4 * one["hbm_breakdown_gib"]["lora_and_optimizer"], abs=2e-3)
    apart = phase["one_after_another"]
    assert apart["tpu_hours"] == pytest.approx(4 * one["tpu_hours"], abs=2e-3)
    assert apart["tpu_hours_saved"] == pytest.approx(3 * one["compile_s"] / 3600, abs=2e-3)  # one compile, not 4
    _, uneven = run_preflight(tmp_path / "uneven", config, "phase1.adapters.docs.max_steps=500")
    assert uneven["phases"]["phase1"]["one_after_another"]["tpu_hours_saved"] < 0


MISTRAL_ON_ONE_CHIP = CONFIGS / "mistral7b_v5e1_q8.yaml"


# nf4 above q4_0 (the same bytes a weight, nominally): its scale rows of 64 fp32 values (4096 / 64)
# are padded to 128 lanes on a TPU, 0.28 GiB more.
@pytest.mark.parametrize("quantize, weights_gib, fits", [("none", 13.5, False), ("q8_0", 8.2, True),
                                                           ("q4_0", 5.0, True), ("nf4", 5.28, True)])
def test_mistral_7b_fits_one_v5e_chip_with_a_quantized_base(tmp_path, quantize, weights_gib, fits):
    """The shipped one-chip config: in bf16 the weights alone take 13.5 of 14.9 GiB; quantized,
    the decoder's Linears hold codes and scales (as the TPU pads them) and two layers' dequantized copies."""
    code, report = run_preflight(tmp_path, MISTRAL_ON_ONE_CHIP, f"model.quantize={quantize}")
    phase = report["phases"]["phase1"]
    assert report["fits"] is fits and code == (0 if fits else 1)
    assert phase["inputs"]["quantize"] == quantize and phase["inputs"]["tpu_type"] == "v5e-1"
    assert phase["hbm_breakdown_gib"]["weights"] == pytest.approx(weights_gib, abs=0.05)
    if not fits:
        assert {"model.quantize": "q8_0"} in [suggestion["overrides"] for suggestion in phase["to_fit"]]
    else:
        assert report["checks"]["quantize"]["status"] == "passed"


def test_a_format_the_model_cannot_store_fails_its_check(tmp_path):
    model = tmp_path / "odd_model"
    AutoConfig.for_model("llama", vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2).save_pretrained(model)
    config = tmp_path / "odd.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(model), "quantize": "q4_0"}, "train": {"max_steps": 10},
                                      "tpu": {"type": "v5e-1"},
                                      "phase1": {"data": str(tmp_path / "none"), "seq_len": 32}}))
    code, report = run_preflight(tmp_path, config)
    assert code == 1 and report["checks"]["quantize"]["status"] == "failed"
    assert "input dimension 48 is not a multiple of q4_0's block of 32" in report["checks"]["quantize"]["detail"]


def test_gemma_2_9b_at_2k_fits_one_v5e_chip_only_in_4_bits(tmp_path):
    """Gemma 2 9B, seq_len 2048, micro-batch 4, checkpointing: 8 bits are not enough on 14.9 GiB;
    the plan at q8_0 names q4_0, which fits."""
    config = tmp_path / "gemma2_9b_v5e1.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": "models/gemma-2-9b", "dtype": "bfloat16", "activation_checkpointing": True,
                  "quantize": "q8_0"},
        "train": {"max_steps": 100, "micro_batch": 4, "grad_accum": 4}, "tpu": {"type": "v5e-1"},
        "phase1": {"data": str(tmp_path / "none1"), "seq_len": 2048}}))
    code, report = run_preflight(tmp_path, config)
    assert code == 1 and report["fits"] is False
    assert {"model.quantize": "q4_0"} in [s["overrides"] for s in report["phases"]["phase1"]["to_fit"]]
    code, report = run_preflight(tmp_path / "q4", config, "model.quantize=q4_0")
    # (12.9 before the plan counted the TPU's tile padding: 3584 / 32 = 112 scales a row take 128 lanes)
    assert code == 0 and report["hbm_per_chip_gib"] == pytest.approx(12.97, abs=0.02)


def test_a_preference_phase_is_planned_as_two_rows_a_pair_and_its_references_forward(tmp_path, tiny_model_dir, data):
    """The same micro-batch of pairs holds twice the rows of a micro-batch of text, builds its full
    logits, and a step runs the reference's forward too (a third of a step's FLOPs: no backward)
    unless its log-probabilities are precomputed."""
    text = write_run_config(tmp_path / "text.yaml", tiny_model_dir, data, tmp_path / "out")
    pairs = write_run_config(tmp_path / "pairs.yaml", tiny_model_dir, {1: data["pairs"], 2: data[2]},
                             tmp_path / "out")
    plans = {}
    for name, config, overrides in (("text", text, []), ("pairs", pairs, []),
                                    ("precomputed", pairs, ["phase1.preference.precompute_reference=true"])):
        code, report = run_preflight(tmp_path / name, config, "tpu.type=v5e-8", *overrides)
        assert code == 0, report
        plans[name] = report["phases"]["phase1"]
    assert plans["pairs"]["inputs"]["rows_per_item"] == 2 and plans["text"]["inputs"]["rows_per_item"] == 1
    assert plans["pairs"]["inputs"]["loss_chunk"] == 0 and plans["pairs"]["inputs"]["reference_forward"]
    assert not plans["precomputed"]["inputs"]["reference_forward"]
    assert plans["pairs"]["tokens_per_step"] == 2 * plans["text"]["tokens_per_step"]
    assert plans["precomputed"]["flops_per_token"] == plans["text"]["flops_per_token"]
    assert plans["pairs"]["flops_per_token"] == pytest.approx(plans["text"]["flops_per_token"] * 4 / 3)
    assert plans["pairs"]["flops_per_step"] == pytest.approx(plans["text"]["flops_per_step"] * 2 * 4 / 3)
    assert plans["precomputed"]["flops_per_step"] == pytest.approx(plans["text"]["flops_per_step"] * 2)


def test_trained_embeddings_are_planned_and_their_rows_named_where_the_whole_matrices_do_not_fit(tmp_path):
    """Mistral-7B on one v5e chip (q8_0): its two 32,768 x 4,096 matrices trained whole
    (lora.modules_to_save) are 268M weights, 16 bytes each (fp32 copy, gradient, AdamW's two
    moments): 4.0 GiB more, past the chip; the plan names the new tokens' rows alone, which fit.
    Gemma 3's tied pair is one weight, planned once."""
    new = ["model.new_tokens=[Brașovului,Clujului]"]
    _, rows = run_preflight(tmp_path / "rows", MISTRAL_ON_ONE_CHIP, "model.quantize=q8_0", *new)
    code, whole = run_preflight(tmp_path / "whole", MISTRAL_ON_ONE_CHIP, "model.quantize=q8_0", *new,
                                "lora.modules_to_save=[embed_tokens,lm_head]", "train.embedding_lr=2e-5")
    inputs = whole["phases"]["phase1"]["inputs"]
    vocab = 32_768 + 2
    assert inputs["embedding_params"] == 2 * vocab * 4096 and inputs["output_layer_trained"]
    assert rows["phases"]["phase1"]["inputs"]["embedding_params"] == inputs["new_token_rows_params"] == 2 * 2 * 4096
    extra = whole["phases"]["phase1"]["hbm_breakdown_gib"]["lora_and_optimizer"] - \
        rows["phases"]["phase1"]["hbm_breakdown_gib"]["lora_and_optimizer"]
    assert extra == pytest.approx((2 * vocab * 4096 - 4 * 4096) * 16 / 2**30, abs=1e-3)
    assert rows["fits"] and code == 1 and not whole["fits"]
    assert {"lora.modules_to_save": None} in [s["overrides"] for s in whole["phases"]["phase1"]["to_fit"]]
    assert whole["phases"]["phase1"]["step_time_s"] > rows["phases"]["phase1"]["step_time_s"]  # lm_head's gradient
    config = tmp_path / "gemma.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": "models/gemma-3-270m"}, "tpu": {"type": "v5e-1"},
                                      "lora": {"modules_to_save": ["embed_tokens", "lm_head"]},
                                      "phase1": {"data": str(tmp_path / "none"), "seq_len": 512}}))
    _, tied = run_preflight(tmp_path / "gemma", config)
    assert tied["phases"]["phase1"]["inputs"]["embedding_params"] == 262_144 * 640
