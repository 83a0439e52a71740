"""torch.compile traces a LoRA-wrapped decoder layer whole (no graph break), its A products still
shared (q, k, v and gate, up: one product each), and computes what eager PyTorch computes: the
native runtime compiles per decoder layer, as torchtitan does. The shared products are handed
between the layers by SharedInput, not on the input tensor itself (`x.__dict__`), which dynamo cannot trace."""

from __future__ import annotations

import operator
import re

import pytest
import torch
from conftest import VOCAB, random_tokens, saved_for_backward, tiny_causal_lm
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from lora_logic.adapters import lora_modules
from lora_logic.config import DEFAULT_ADAPTER, LoraConfig
from lora_logic.inject import inject_lora

pytestmark = pytest.mark.native  # (make test-native: under torch 2.13 too)

PRODUCTS = (operator.matmul, torch.matmul)  # the LoRA's A products (the bases' are F.linear, B's in a Function)


def wrapped_layer(arch: str, dtype: torch.dtype):
    """Decoder layer 0 of a tiny LoRA-wrapped model (B random: B = 0 would hide the update), and
    the inputs of its forward."""
    model = tiny_causal_lm(arch).to(dtype)
    inject_lora(model, LoraConfig(r=4, alpha=8))
    for _, layer in lora_modules(model):
        nn.init.normal_(layer.lora_B[DEFAULT_ADAPTER].weight, std=0.1)
    tokens = random_tokens()
    hidden = model.get_input_embeddings()(tokens).detach().requires_grad_(True)
    positions = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
    return model.model.layers[0], hidden, model.model.rotary_emb(hidden, positions)


def forward_backward(layer, hidden, position_embeddings) -> list[torch.Tensor]:
    """The layer's output and the gradients of a weighted sum of it: the input's and the LoRA's."""
    hidden.grad = None
    for p in layer.parameters():
        p.grad = None
    out = layer(hidden, position_embeddings=position_embeddings, attention_mask=None)
    out = out[0] if isinstance(out, tuple) else out
    (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
    return [out.detach(), hidden.grad, *(p.grad for p in layer.parameters() if p.requires_grad)]


@pytest.mark.heavy
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_decoder_layer_compiles_whole_with_its_a_products_shared_and_equals_eager(arch):
    layer, hidden, position_embeddings = wrapped_layer(arch, torch.float64)
    eager = forward_backward(layer, hidden, position_embeddings)
    graphs = []

    def recording(graph_module, example_inputs):  # dynamo's graph, run as traced: the eager ops, in its order
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(layer, backend=recording, fullgraph=True)  # a graph break is an error
    ours = forward_backward(compiled, hidden, position_embeddings)
    assert len(graphs) == 1
    products = [node for node in graphs[0].graph.nodes if node.op == "call_function" and node.target in PRODUCTS]
    # 7 targets, 4 A products: q/k/v's one, o's, gate/up's one, down's.
    assert len(products) == 4, graphs[0].code
    for index, (a, b) in enumerate(zip(ours, eager, strict=True)):
        assert torch.equal(a, b), f"{arch}: output or gradient {index}"
    shared = [module._shared_input for _, module in lora_modules(layer)]
    assert all(s.pending() == 0 and s._input is None for s in shared)  # nothing kept after the compiled call


@pytest.mark.heavy
def test_the_compiled_layer_runs_inductors_kernels_within_rounding_of_eager():
    """Inductor (torch.compile's default backend) fuses and reorders: float32 within rounding."""
    layer, hidden, position_embeddings = wrapped_layer("llama", torch.float32)
    eager = forward_backward(layer, hidden, position_embeddings)
    ours = forward_backward(torch.compile(layer, fullgraph=True), hidden, position_embeddings)
    for index, (a, b) in enumerate(zip(ours, eager, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"output or gradient {index}")


@pytest.mark.heavy
def test_lora_dropout_compiles_to_int32_constants_that_triton_accepts():
    """LoRA dropout's hash multiplies element indices by a constant. Inductor folds an arange times
    a constant into an index expression and prints it unwrapped: with rows of 64, row * -104994018240
    in an int32 kernel, which Triton refuses (found on an H100: compiled layers with lora.dropout).
    A CPU runs the same lowering, so the kernels' source may hold no integer beyond int32, and the
    compiled masks are eager's (the output within rounding; a changed mask moves it by far more)."""
    from torch._inductor.utils import run_and_get_code

    from lora_logic.dropout import SeededDropout, set_dropout_seed

    model = tiny_causal_lm("llama")
    inject_lora(model, LoraConfig(r=4, alpha=8, dropout=0.1))
    model.train()
    layer = model.model.layers[0]
    for module in layer.modules():
        if isinstance(module, SeededDropout):
            module.salt_as_data(torch.device("cpu"))  # as the native runtime's compiled layers do
    set_dropout_seed(layer, torch.tensor([7], dtype=torch.int32))
    tokens = random_tokens()
    hidden = model.get_input_embeddings()(tokens).detach().requires_grad_(True)
    positions = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
    rotary = model.model.rotary_emb(hidden, positions)
    eager = forward_backward(layer, hidden, rotary)
    torch._dynamo.reset()
    compiled, sources = run_and_get_code(forward_backward, torch.compile(layer, fullgraph=True), hidden, rotary)
    integers = [int(m) for source in sources for m in re.findall(r"(?<![\w.])(-?\d{10,})L?(?![\w.])", source)]
    assert integers, "the kernels' source holds the hash's constants"
    assert [v for v in integers if not -2**31 <= v < 2**31] == []
    for index, (a, b) in enumerate(zip(compiled, eager, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"output or gradient {index}")


@pytest.mark.heavy
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "nf4"])
def test_a_compiled_quantized_layer_saves_for_its_backward_what_the_full_precision_one_saves(fmt):
    """What one compiled decoder layer keeps for its backward beyond its own weights (bytes, by
    saved_tensors_hooks): with a quantized base no more than with the full-precision one, since its
    dequantization is recomputed in the backward (lora_logic/quantized_linear.py's
    recomputed_for_backward). Left to itself, AOTAutograd's min-cut partitioner, inductor's (run here
    without its code generation), saved every dequantized weight: 25.3 MiB against 10.3 at hidden
    512. The compiled layer's outputs and gradients stay the eager quantized layer's (float64)."""
    from finetuning_pipeline.model.quantized_base import quantize_base

    saved, results = {}, {}
    for quantize, compiled in (("none", True), (fmt, True), (fmt, False)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        config = AutoConfig.for_model("llama", vocab_size=VOCAB, hidden_size=128, intermediate_size=512,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
        model = AutoModelForCausalLM.from_config(config).double()
        if quantize != "none":
            quantize_base(model, quantize)
        inject_lora(model, LoraConfig(r=4, alpha=8))
        for _, module in lora_modules(model):
            nn.init.normal_(module.lora_B[DEFAULT_ADAPTER].weight, std=0.1)
        layer = model.model.layers[0]
        hidden = torch.randn(2, 64, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(1),
                             requires_grad=True)
        rotary = model.model.rotary_emb(hidden, torch.arange(64)[None].expand(2, -1))
        run = torch.compile(layer, backend="aot_eager_decomp_partition", fullgraph=True) if compiled else layer
        with saved_for_backward(model) as kept:
            results[quantize, compiled] = forward_backward(run, hidden, rotary)
        saved[quantize, compiled] = sum(kept)
    assert saved[fmt, True] <= saved["none", True], f"{fmt}: {saved[fmt, True]} bytes saved, full precision " \
                                                    f"{saved['none', True]}"
    for index, (a, b) in enumerate(zip(results[fmt, True], results[fmt, False], strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"{fmt}: output or gradient {index}")
