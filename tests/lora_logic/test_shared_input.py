"""Layers that read one input (q, k, v; gate, up) compute their A products as one matmul.

Each test counts the matrix products the layers run (a TorchFunctionMode sees every `@`), so
it fails both when the sharing stops happening and when it gives other numbers than each
layer alone (float64, held to FLOAT64_EXACT)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ARCHITECTURES, random_tokens, tiny_causal_lm
from tolerances import assert_equal_in_exact_arithmetic
from torch import nn
from torch.overrides import TorchFunctionMode

from lora_logic.adapters import lora_modules
from lora_logic.config import DEFAULT_ADAPTER, LoraConfig
from lora_logic.dropout import set_dropout_seed
from lora_logic.inject import inject_lora
from lora_logic.layer import LoRALinear, share_input

IN, OUTS, RANKS = 24, (32, 16, 16), (4, 8, 2)  # q, k, v of different widths and ranks


class CountMatmuls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in ("matmul", "__matmul__", "mm", "linear"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def siblings(groups=(DEFAULT_ADAPTER,), dropout: float = 0.0, shared: bool = True) -> list[LoRALinear]:
    """Three float64 layers with every adapter of `groups`, B random (B = 0 would hide its product)."""
    torch.manual_seed(0)
    layers = [LoRALinear(nn.Linear(IN, out, dtype=torch.float64), list(groups)) for out in OUTS]
    for layer, r in zip(layers, RANKS):
        for salt, name in enumerate(groups):
            layer.add_adapter(name, LoraConfig(r=r, alpha=2 * r, dropout=dropout), dropout_salt=salt)
            nn.init.normal_(layer.lora_B[name].weight)
    if shared:
        share_input(layers)
    return layers


def run(layers: list[LoRALinear], inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """Each layer's output on its input, the gradients of their sum (inputs and LoRA weights),
    and how many matrix products the layers ran."""
    with CountMatmuls() as counter:
        outputs = [layer(x) for layer, x in zip(layers, inputs)]
    sum((out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum() for out in outputs).backward()
    grads = [p.grad for layer in layers for p in layer.parameters() if p.requires_grad]
    return outputs + grads + [x.grad for x in inputs if x.grad is not None], counter.count


def test_siblings_run_one_a_product_equal_to_each_alone():
    x = torch.randn(2, 5, IN, dtype=torch.float64, requires_grad=True)
    alone, alone_products = run(siblings(shared=False), [x] * 3)
    x.grad = None
    layers = siblings()
    shared, shared_products = run(layers, [x] * 3)
    # The three bases' products, then three A and three B products alone; one A and three B shared.
    assert (alone_products, shared_products) == (3 + 6, 3 + 4)
    # Every part taken: nothing kept for the next forward, and nothing on the input tensor.
    assert layers[0]._shared_input.pending() == 0 and layers[0]._shared_input._input is None and not vars(x)
    assert_all_equal(shared, alone, "q, k, v sharing their A product against each alone")


def test_siblings_called_with_other_tensors_compute_their_own():
    inputs = [torch.randn(2, 5, IN, dtype=torch.float64, requires_grad=True) for _ in OUTS]
    alone, _ = run(siblings(shared=False), inputs)
    for x in inputs:
        x.grad = None
    shared, products = run(siblings(), inputs)
    assert_all_equal(shared, alone, "siblings given different inputs against each alone")
    # No sibling finds its part on its own input: each computes all three parts (a wasted product
    # each, never a wrong one), then its B product.
    assert products == 3 + 3 + 3


@pytest.mark.parametrize("training", [True, False])
def test_siblings_with_dropout_share_only_outside_training(training):
    x = torch.randn(2, 5, IN, dtype=torch.float64, requires_grad=True)
    results, counts = [], []
    for shared in (False, True):
        layers = siblings(dropout=0.3, shared=shared)
        for layer in layers:
            layer.train(training)
            set_dropout_seed(layer, torch.tensor([7], dtype=torch.int32))  # each layer's own mask (its salt)
        x.grad = None
        outputs, products = run(layers, [x] * 3)
        results.append(outputs)
        counts.append(products)
    # Training, each layer drops its own elements of x: three A products; in eval none drops: one.
    assert counts == ([3 + 6, 3 + 6] if training else [3 + 6, 3 + 4])
    assert_all_equal(results[1], results[0], "siblings with LoRA dropout against each alone")


def test_side_by_side_siblings_share_per_adapter():
    groups = ("first", "second")
    x = torch.randn(4, 5, IN, dtype=torch.float64, requires_grad=True)
    alone, alone_products = run(siblings(groups, shared=False), [x] * 3)
    x.grad = None
    shared, shared_products = run(siblings(groups), [x] * 3)
    # The bases once for both adapters' rows; per adapter 3 + 3 products alone, 1 + 3 shared.
    assert (alone_products, shared_products) == (3 + 12, 3 + 8)
    assert_all_equal(shared, alone, "adapters side by side sharing their A products")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_injected_model_shares_q_k_v_and_gate_up(arch):
    model = tiny_causal_lm(arch).double()
    inject_lora(model, LoraConfig(r=4, alpha=8))
    groups = {frozenset(n.rsplit(".", 1)[-1] for n, m in lora_modules(model) if m in layer._shared_input.layers)
              for _, layer in lora_modules(model)}
    assert groups == {frozenset({"q_proj", "k_proj", "v_proj"}), frozenset({"gate_proj", "up_proj"}),
                      frozenset({"o_proj"}), frozenset({"down_proj"})}
    for _, layer in lora_modules(model):
        nn.init.normal_(layer.lora_B[DEFAULT_ADAPTER].weight, std=0.1)
    alone = copy.deepcopy(model)
    for _, layer in lora_modules(alone):
        share_input([layer])
    tokens = random_tokens()
    results, counts = [], []
    for each in (alone, model):
        with CountMatmuls() as counter:
            loss = each(tokens, labels=tokens).loss
        loss.backward()
        results.append([loss] + [p.grad for p in each.parameters() if p.requires_grad])
        counts.append(counter.count)
    sets = {id(layer._shared_input): layer._shared_input.layers for _, layer in lora_modules(model)}
    fewer = sum(len(siblings) - 1 for siblings in sets.values())  # A products no longer run
    # Each of the 2 layers: q, k, v's A products one (2 fewer), gate and up's one (1 fewer).
    assert fewer == 2 * 3 and counts[0] - counts[1] == fewer
    assert_all_equal(results[1], results[0], f"{arch}: shared A products against each alone")


def assert_all_equal(ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str) -> None:
    assert len(ours) == len(theirs)
    for index, (a, b) in enumerate(zip(ours, theirs)):
        assert_equal_in_exact_arithmetic(a, b, f"{what} (output or gradient {index})")

