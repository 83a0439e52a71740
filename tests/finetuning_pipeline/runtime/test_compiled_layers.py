"""runtime.compile=layers compiles one layer's graphs, not the model's depth: the decoder layers
of the trainer's own loss (causal_lm_loss_sum) share them, in training and in evaluation."""

from __future__ import annotations

import pytest
import torch
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


def test_the_layers_share_their_compiled_graphs_whatever_the_depth():
    shallow, deep = graphs_compiled(2), graphs_compiled(12)  # 12: beyond dynamo's cache limit of 8
    assert 1 <= shallow == deep <= 3
