"""model.quantize on every family: the decoder's Linears (and nothing else) are stored quantized,
and the model computes what the same model holding their dequantized weights computes (loss,
LoRA gradients, the activations' gradient); the scanned layers keep no dequantized weight from
their forward loop to their backward loop; shapes a format cannot hold are refused, naming the
key; the stored bytes shrink as the formats say; a base whose files hold another dtype is
quantized as it is read, into what a model read in the run's dtype would hold."""

from __future__ import annotations

import pytest
import torch
import torch_xla
from model_families import FAMILIES, batch, with_family_lora
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from finetuning_pipeline.model.loading import check_quantizable, load_base
from finetuning_pipeline.model.quantized_base import (
    decoder_linears,
    decoder_weight_bytes,
    quantize_base,
    reading_dtype,
)
from finetuning_pipeline.runtime.xla.layer_scan import scan_decoder_layers
from lora_logic.config import LoraConfig
from lora_logic.inject import inject_lora
from lora_logic.quantized_linear import QuantizedLinear

FORMATS = ["q8_0", "q4_0", "nf4"]


def wide_family(name: str) -> nn.Module:
    """The family's tiny model at width 64 (nf4's block): fp32, every decoder Linear's input a
    multiple of 64."""
    config = FAMILIES[name]()
    config.hidden_size, config.intermediate_size, config.head_dim = 64, 128, 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    model.config.use_cache = False
    return model


def with_family_lora_seeded(model: nn.Module, name: str) -> nn.Module:
    torch.manual_seed(5)  # the same LoRA on both models
    return with_family_lora(model, name)


def loss_and_gradients(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    inputs = batch(packed=True)
    embeddings = model.get_input_embeddings()(inputs["input_ids"]).detach().requires_grad_(True)
    out = model(inputs_embeds=embeddings, labels=inputs["labels"], position_ids=inputs["position_ids"])
    out.loss.backward()
    assert embeddings.grad is not None  # the activations' gradient crosses the quantized layers
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    return out.loss.detach(), grads, embeddings.grad


# Every family in q4_0 (ggml's nibble layout), and the other formats on three families (Phi-3's
# fused projections among them): the arithmetic is the format's, where its Linears sit the family's.
CASES = [(name, "q4_0") for name in sorted(FAMILIES)] + [(name, fmt) for fmt in ("q8_0", "nf4")
                                                         for name in ("llama", "gemma3", "phi3")]


@pytest.mark.parametrize(("name", "fmt"), CASES)
def test_a_quantized_base_computes_what_its_dequantized_weights_compute(name, fmt):
    quantized = wide_family(name)
    assert quantize_base(quantized, fmt) == len(decoder_linears(wide_family(name)))
    reference = wide_family(name)
    stored = dict(quantized.named_modules())
    with torch.no_grad():
        for linear_name, linear in decoder_linears(reference):
            linear.weight.copy_(stored[linear_name].dequantized_weight())
    loss, grads, activation_grad = loss_and_gradients(with_family_lora_seeded(quantized, name))
    want_loss, want_grads, want_activation_grad = loss_and_gradients(with_family_lora_seeded(reference, name))
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for key in grads:
        assert torch.equal(grads[key], want_grads[key]), key
    assert torch.equal(activation_grad, want_activation_grad)


@pytest.mark.parametrize("activation_checkpointing", [False, True])
def test_scanned_layers_carry_codes_not_dequantized_weights_from_the_forward_to_the_backward(
        activation_checkpointing):
    # What the scan's forward loop hands its backward loop are the tensors autograd saves, stacked
    # a layer each ([layers, ...]): a dequantized weight among them would cost every layer's
    # weights in the compute dtype, the memory the quantization saves.
    model = wide_family("llama")
    quantize_base(model, "q8_0")
    model = with_family_lora_seeded(model, "llama")
    weights = {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, QuantizedLinear)}
    device = torch_xla.device()
    model.to(device).train()
    layers = scan_decoder_layers(model, activation_checkpointing=activation_checkpointing)
    inputs = {key: value[:, :20].to(device) for key, value in batch(packed=True).items()}  # 40 tokens: no weight's size
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.shape, t.dtype)) or t, lambda t: t):
        model(**inputs).loss.backward()
    stacked = [(shape[1:], dtype) for shape, dtype in saved if len(shape) == 3 and shape[0] == len(layers)]
    assert {tuple(shape) for shape, dtype in stacked if dtype == torch.int8} == weights  # q8_0: a byte a value
    assert not [(shape, dtype) for shape, dtype in stacked if tuple(shape) in weights and dtype.is_floating_point]


def test_only_the_decoder_linears_are_quantized():
    model = wide_family("gemma2")
    plain = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    quantize_base(model, "q4_0")
    now = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert now == {"lm_head"} and {n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)} == plain - now
    assert all(p.dtype == torch.float32 for p in model.parameters())  # embeddings, norms: model.dtype


@pytest.mark.parametrize(("fmt", "ratio"), [("q8_0", 0.55), ("q4_0", 0.30), ("nf4", 0.30)])
def test_the_decoder_weights_bytes_shrink_against_bf16(tiny_model_dir, fmt, ratio):
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    quantized = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    quantize_base(quantized, fmt)
    inject_lora(quantized, LoraConfig(r=8, alpha=16))  # the LoRA's own A and B are not the base's
    assert decoder_weight_bytes(quantized) <= ratio * decoder_weight_bytes(bf16)


def test_a_shape_a_format_cannot_hold_is_refused_naming_the_key_and_what_to_do():
    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2)
    check_quantizable(config, "none")
    with pytest.raises(ValueError) as err:
        check_quantizable(config, "q4_0")
    message = str(err.value)
    assert message.startswith("model.quantize=q4_0: cannot store the decoder's q_proj (its input dimension 48 is "
                              "not a multiple of q4_0's block of 32)")
    assert message.endswith("; no format fits this model: set model.quantize=none")
    # The rule is stated once, as the problem, and the way out names the formats that fit (a
    # hint stating another rule would be one a refused 96 x 96 weight meets).
    wider = AutoConfig.for_model("llama", vocab_size=64, hidden_size=96, intermediate_size=192, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError) as err:
        check_quantizable(wider, "nf4")
    assert str(err.value) == ("model.quantize=nf4: cannot store the decoder's q_proj (its input dimension 96 is not a "
                              "multiple of nf4's block of 64); set model.quantize to one that fits this model (q8_0, "
                              "q4_0) or to none")
    model = wide_family("llama")
    with pytest.raises(ValueError, match="model.quantize=q8_0: cannot store"):
        quantize_base(AutoModelForCausalLM.from_config(config), "q8_0")
    assert quantize_base(model, "none") == 0 and not any(isinstance(m, QuantizedLinear) for m in model.modules())


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, the non-persistent ones too (rotary tables, embedding scales)."""
    return dict([*model.named_parameters(), *model.named_buffers()])


# Every family from fp16 files (Llama 2's) in several shards, and fp32 files (one) on three,
# read into a bf16 run.
FILE_CASES = [(name, torch.float16) for name in sorted(FAMILIES)] + [
    (name, torch.float32) for name in ("llama", "gemma3", "phi3")]


@pytest.mark.parametrize(("name", "stored"), FILE_CASES)
def test_a_base_stored_in_another_dtype_is_quantized_as_read_into_what_a_bf16_read_gives(tmp_path, name, stored):
    sharded = stored == torch.float16
    wide_family(name).to(stored).save_pretrained(tmp_path, max_shard_size="100KB" if sharded else "5GB")
    files = len(list(tmp_path.glob("*.safetensors")))
    assert files > 1 if sharded else files == 1
    assert reading_dtype(tmp_path, torch.bfloat16) == stored  # read as stored: no whole-model copy in bf16
    assert reading_dtype(tmp_path, stored) == stored
    got = load_base(tmp_path, torch.bfloat16, quantize="q4_0")
    want = load_base(tmp_path, torch.bfloat16)  # the whole model in bf16, then quantized
    quantize_base(want, "q4_0")
    assert got.config.dtype == want.config.dtype == torch.bfloat16
    got_state, want_state = state(got), state(want)
    assert got_state.keys() == want_state.keys()
    for key, tensor in want_state.items():
        assert got_state[key].dtype == tensor.dtype and torch.equal(got_state[key], tensor), key
    inputs = batch(packed=True)
    with torch.no_grad():
        assert torch.equal(got(**inputs).logits, want(**inputs).logits)
