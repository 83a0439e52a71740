"""Adapters side by side over one frozen base (lora_logic/layer.py, one LoRALinear holding several
adapters): each adapter's rows, outputs, gradients, initial weights and dropout masks are those
of a model of it alone; one adapter on every row is a model of it alone; each is written and read
as a PEFT adapter; none merges."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import random_tokens, tiny_causal_lm
from tolerances import assert_equal_in_exact_arithmetic

from lora_logic.adapter_io import load_adapters, save_adapters
from lora_logic.adapters import adapter_names, lora_parameters, lora_state_dict, only_adapter
from lora_logic.config import DEFAULT_ADAPTER, LoraConfig
from lora_logic.dropout import set_dropout_seed
from lora_logic.inject import inject_lora
from lora_logic.layer import LoRALinear
from utils.precision import float64_throughout

ADAPTERS = {  # different ranks, scalings, dropout and targets
    "sql": LoraConfig(r=4, alpha=8, dropout=0.1, target_modules=["q_proj", "v_proj"]),
    "chat": LoraConfig(r=8, alpha=8),
    "docs": LoraConfig(r=2, alpha=4, use_rslora=True, target_modules=["down_proj", "q_proj"]),
}
SEED, ROWS, SEQ = 3, 2, 12


def loss_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@pytest.fixture
def models():
    return side_by_side_and_alone(torch.float32)


@pytest.fixture
def models64():
    """For the claims of equality: K adapters' rows in one batch and one adapter's are equal in
    exact arithmetic, not in rounding, so float64 (tests/tolerances.py)."""
    return side_by_side_and_alone(torch.float64)


def side_by_side_and_alone(dtype: torch.dtype):
    """The side-by-side model and one model per adapter alone, same base, same seed; every B
    made non-zero (the same in both) so the updates are not trivially equal."""
    base = tiny_causal_lm("llama").to(dtype)
    together = copy.deepcopy(base)
    torch.manual_seed(SEED)
    inject_lora(together, ADAPTERS)
    alone = {}
    for name, config in ADAPTERS.items():
        alone[name] = copy.deepcopy(base)
        torch.manual_seed(SEED)
        inject_lora(alone[name], config)
    generator = torch.Generator().manual_seed(0)
    for name in ADAPTERS:
        for ours, theirs in zip(lora_parameters(together, name), lora_parameters(alone[name]), strict=True):
            with torch.no_grad():
                theirs.normal_(0, 0.2, generator=generator)
                ours.copy_(theirs)
    return together, alone


def test_each_adapter_starts_as_it_would_alone():
    base = tiny_causal_lm("llama")
    together = copy.deepcopy(base)
    torch.manual_seed(SEED)
    torch.rand(3)  # wherever the generator stands, each adapter starts from that same point
    wrapped = inject_lora(together, ADAPTERS)
    assert len(wrapped) == 2 * 7  # the union of the targets, in each of the 2 layers
    for name, config in ADAPTERS.items():
        alone = copy.deepcopy(base)
        torch.manual_seed(SEED)
        torch.rand(3)
        inject_lora(alone, config)
        ours, theirs = lora_state_dict(together, name), lora_state_dict(alone, DEFAULT_ADAPTER)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name
    assert all(not p.requires_grad for n, p in together.named_parameters() if "lora_" not in n)


def test_each_adapters_rows_outputs_and_gradients_are_its_own(models64):
    together, alone = models64
    together.train()
    tokens = {name: random_tokens(ROWS, SEQ, seed=k) for k, name in enumerate(ADAPTERS)}
    dropout_seed = torch.tensor([11], dtype=torch.int32)
    set_dropout_seed(together, dropout_seed)
    with float64_throughout(torch.float64):
        logits = together(torch.cat(list(tokens.values()))).logits
        total = sum(loss_of(logits[k * ROWS:(k + 1) * ROWS], tokens[name]) for k, name in enumerate(ADAPTERS))
        total.backward()
    assert logits.dtype == torch.float64
    for k, name in enumerate(ADAPTERS):
        model = alone[name].train()
        set_dropout_seed(model, dropout_seed)
        with float64_throughout(torch.float64):
            own = model(tokens[name]).logits
            loss_of(own, tokens[name]).backward()
        assert_equal_in_exact_arithmetic(logits[k * ROWS:(k + 1) * ROWS].detach(), own.detach(), f"{name} logits")
        for ours, theirs in zip(lora_parameters(together, name), lora_parameters(model), strict=True):
            assert_equal_in_exact_arithmetic(ours.grad, theirs.grad, f"{name} gradient")


def test_the_base_weights_are_read_once_for_every_adapter(models):
    together, _ = models
    layer = together.model.layers[0].self_attn.q_proj
    assert isinstance(layer, LoRALinear) and layer.adapters == layer.groups == ["sql", "chat", "docs"]
    calls = []
    layer.base_layer.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    together(random_tokens(3 * ROWS, SEQ))
    assert calls == [3 * ROWS]  # one product over every adapter's rows


def test_rows_that_do_not_split_into_the_adapters_groups_are_refused(models):
    together, _ = models
    with pytest.raises(ValueError, match="5 rows do not split into 3 equal groups, one per adapter"):
        together(random_tokens(5, SEQ))


def test_one_adapter_alone_on_every_row_is_a_model_of_it_alone(models64):
    """only_adapter (evaluation, generation): every row through one adapter, as its model alone."""
    together, alone = models64
    together.eval()
    tokens = random_tokens(ROWS, SEQ, seed=5)
    for name in ADAPTERS:
        with only_adapter(together, name), float64_throughout(torch.float64), torch.no_grad():
            ours = together(tokens).logits
            theirs = alone[name].eval()(tokens).logits
        assert_equal_in_exact_arithmetic(ours, theirs, f"{name} logits")
    assert adapter_names(together) == list(ADAPTERS)  # the rows' groups are back


def test_each_adapter_is_written_as_its_own_peft_adapter_and_read_back(models, tmp_path):
    together, alone = models
    written = save_adapters(together, {name: tmp_path / name for name in ADAPTERS}, ADAPTERS, "tiny-base")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(ADAPTERS)
    for name, directory in written.items():
        fresh = copy.deepcopy(alone[name])
        for p in lora_parameters(fresh):
            torch.nn.init.zeros_(p)
        load_adapters(fresh, directory)  # a PEFT adapter of one adapter: what a model of it alone loads
        assert all(torch.equal(a, b) for a, b in zip(lora_parameters(fresh), lora_parameters(alone[name])))
    copy_of = copy.deepcopy(together)
    for p in lora_parameters(copy_of):
        torch.nn.init.zeros_(p)
    load_adapters(copy_of, written)
    assert all(torch.equal(a, b) for a, b in zip(lora_parameters(copy_of), lora_parameters(together), strict=True))
    fresh = tiny_causal_lm("llama")
    load_adapters(fresh, written)  # a model without LoRA takes the set as it was written: side by side
    assert adapter_names(fresh) == list(ADAPTERS)
    assert all(torch.equal(a, b) for a, b in zip(lora_parameters(fresh), lora_parameters(together), strict=True))
    (tmp_path / "docs" / "adapter_model.safetensors").write_bytes(
        (tmp_path / "chat" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"docs/adapter_model\.safetensors does not fit adapter 'docs'"):
        load_adapters(copy_of, written)
    with pytest.raises(ValueError, match=r"the model's adapters are \['sql', 'chat', 'docs'\]"):
        load_adapters(copy_of, {"sql": written["sql"]})


def test_adapters_side_by_side_do_not_merge(models):
    """Each serves its own rows, so no one base weight holds them: a merge is refused, base untouched."""
    from lora_logic.merge import merge_lora

    together, _ = models
    before = together.model.layers[0].self_attn.q_proj.base_layer.weight.clone()
    with pytest.raises(ValueError, match="cannot merge adapters side by side"):
        merge_lora(together)
    assert torch.equal(together.model.layers[0].self_attn.q_proj.base_layer.weight, before)


def test_a_mistake_of_a_thousandth_is_far_above_the_float64_bound(models64):
    """The negative control of the float64 rule: a scaling off by 0.1% in one adapter moves its
    rows' logits by orders of magnitude more than the bound the equality proofs hold to."""
    from tolerances import FLOAT64_EXACT, largest_difference

    from lora_logic.adapters import lora_modules
    from lora_logic.layer import scaling_buffer

    together, alone = models64
    together.eval()
    for _, module in lora_modules(together):
        if "chat" in module.lora_A:
            getattr(module, scaling_buffer("chat")).mul_(1.001)
    tokens = random_tokens(ROWS, SEQ, seed=5)
    with only_adapter(together, "chat"), float64_throughout(torch.float64), torch.no_grad():
        difference = largest_difference(together(tokens).logits, alone["chat"].eval()(tokens).logits)
    assert difference > 1e4 * FLOAT64_EXACT, difference
