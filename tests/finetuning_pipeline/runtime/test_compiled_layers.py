"""runtime.compile=layers compiles one layer's graphs, not the model's depth: the decoder layers
of the trainer's own loss (causal_lm_loss_sum) share them, in training and in evaluation, and
with activation checkpointing (full, selective) traced inside them."""

from __future__ import annotations

import pytest
import torch
from conftest import saved_for_backward
from transformers import MistralConfig, MistralForCausalLM

from finetuning_pipeline.model.causal_lm_loss import causal_lm_loss_sum
from finetuning_pipeline.runtime.native.step import compile_decoder_layers
from lora_logic.config import LoraConfig
from lora_logic.dropout import set_dropout_seed
from lora_logic.inject import inject_lora

pytestmark = pytest.mark.native


def graphs_compiled(layers: int) -> int:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=128))
    inject_lora(model, LoraConfig(r=4, alpha=8, dropout=0.1))
    assert compile_decoder_layers(model, backend="aot_eager") == layers
    tokens = torch.randint(3, 256, (2, 32))
    batch = {"input_ids": tokens, "labels": tokens}
    for seed in (1, 2):  # a second step, with another dropout seed: the same graphs
        model.train()
        set_dropout_seed(model, torch.tensor([seed], dtype=torch.int32))
        loss, _ = causal_lm_loss_sum(model, batch, packed=False)
        loss.backward()
        model.eval()
        with torch.no_grad():
            causal_lm_loss_sum(model, batch, packed=False)
    assert not counters["recompiles"] and not counters["graph_break"]
    return counters["stats"]["unique_graphs"]


@pytest.mark.heavy
def test_the_layers_share_their_compiled_graphs_whatever_the_depth():
    shallow, deep = graphs_compiled(2), graphs_compiled(12)  # 12: beyond dynamo's cache limit of 8
    assert 1 <= shallow == deep <= 3


def checkpointed_run(layers: int, quantize: str, checkpointing: str | None, compiled: bool):
    """Two training steps of a float64 LoRA model (dropout on: each step its own seed) under
    `checkpointing` (None: off), its decoder layers compiled or eager: (losses, the LoRA's
    gradients, dynamo's counters)."""
    from torch._dynamo.utils import counters

    from finetuning_pipeline.model.activation_checkpointing import enable_activation_checkpointing
    from finetuning_pipeline.model.quantized_base import quantize_base
    from utils.precision import float64_throughout

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=128)).double()
    if quantize != "none":
        quantize_base(model, quantize)
    inject_lora(model, LoraConfig(r=4, alpha=8, dropout=0.1))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # nonzero B: A's gradients are not trivially zero
            torch.nn.init.normal_(param, std=0.1)
    if checkpointing:
        assert enable_activation_checkpointing(model, checkpointing) == layers
    if compiled:
        compile_decoder_layers(model, backend="aot_eager")
    tokens = torch.randint(3, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    losses, grads = [], []
    model.train()
    for seed in (1, 2):
        set_dropout_seed(model, torch.tensor([seed], dtype=torch.int32))
        for param in model.parameters():
            param.grad = None
        with float64_throughout(torch.float64):
            loss, _ = causal_lm_loss_sum(model, {"input_ids": tokens, "labels": tokens}, packed=False)
            loss.backward()
        losses.append(loss.detach())
        grads += [param.grad.clone() for param in model.parameters() if param.requires_grad]
    return losses, grads, {key: dict(value) for key, value in counters.items()}


@pytest.mark.heavy
@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_checkpointed_layers_compile_to_one_graph_and_equal_the_unchecked_eager_run(quantize):
    """Activation checkpointing inside the compiled layers (transformers checkpoints in the layer's
    forward): no graph break (the LoRA's shared A products, a side effect dynamo refuses inside the
    checkpoint, left every layer eager before), no recompile at 12 layers (beyond dynamo's limit of
    8), the layers' graphs shared; full and selective both give the unchecked eager run's losses
    and gradients in float64, LoRA dropout and a quantized base included."""
    losses, grads, _ = checkpointed_run(12, quantize, None, compiled=False)
    for checkpointing in ("full", "selective"):
        ours, our_grads, counters = checkpointed_run(12, quantize, checkpointing, compiled=True)
        assert not counters.get("graph_break") and not counters.get("recompiles"), counters
        assert 1 <= counters["stats"]["unique_graphs"] <= 3, counters["stats"]
        for index, (a, b) in enumerate(zip([*ours, *our_grads], [*losses, *grads], strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"{checkpointing}: loss or gradient {index}")


@pytest.mark.heavy
def test_a_compiled_checkpoint_keeps_less_for_the_backward_full_least():
    """What the compiled layers keep for their backward beyond the model's own weights (bytes, by
    saved_tensors_hooks), with inductor's partitioner (its code generation left out): full keeps
    each layer's input, selective that and the attention's outputs, unchecked far more (the
    checkpoint traced with the layer recomputes: it is not only traced)."""
    from finetuning_pipeline.model.activation_checkpointing import enable_activation_checkpointing

    saved = {}
    for checkpointing in (None, "full", "selective"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MistralForCausalLM(MistralConfig(vocab_size=256, hidden_size=256, intermediate_size=896,
                                                 num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                                 max_position_embeddings=256))
        inject_lora(model, LoraConfig(r=8, alpha=16))
        model.train()
        if checkpointing:
            enable_activation_checkpointing(model, checkpointing)
        compile_decoder_layers(model, backend="aot_eager_decomp_partition")
        tokens = torch.randint(3, 256, (1, 256), generator=torch.Generator().manual_seed(1))
        with saved_for_backward(model) as kept:
            loss, _ = causal_lm_loss_sum(model, {"input_ids": tokens, "labels": tokens}, packed=False)
        loss.backward()
        saved[checkpointing] = sum(kept)
    assert saved["full"] < saved["selective"] < saved[None] / 2, saved


def test_dynamos_warning_on_our_selective_checkpoint_is_dropped_as_proven_safe():
    """Dynamo warns, for any selective checkpoint under torch.compile, that the region must hold
    no in-place op; ours is proven equal to the unchecked layer above, so the warning a user can do
    nothing about is dropped, and only it (its words read from this torch's own source)."""
    import inspect
    import logging

    import torch._higher_order_ops.wrap as wrap

    from finetuning_pipeline.model.activation_checkpointing import PROVEN_SAFE, enable_activation_checkpointing

    assert PROVEN_SAFE.WARNING in inspect.getsource(wrap)
    model = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2))
    enable_activation_checkpointing(model, "selective")
    logger = logging.getLogger(wrap.__name__)
    assert PROVEN_SAFE in logger.filters

    def record(message: str) -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 1, message, None, None)

    assert not logger.filter(record(f"\nDetected that {PROVEN_SAFE.WARNING}.\nPlease make sure ..."))
    assert logger.filter(record("another warning of dynamo's"))
