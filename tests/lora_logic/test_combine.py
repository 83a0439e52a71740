"""Adapters combined (lora_logic/combine.py) against PEFT's add_weighted_adapter on the same
adapters: the deterministic methods give PEFT's matrices; DARE's random drop is held to its
statistics; a combination that cannot be made is refused naming why."""

from __future__ import annotations

import pytest
import torch
from adapter_helpers import CONFIGS, DTYPE, peft_combined, write_random_adapters
from tolerances import assert_equal_in_exact_arithmetic

from lora_logic.adapter_io import read_adapter_config, read_adapter_weights
from lora_logic.combine import Adapter, combine_adapters, random_prune

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return write_random_adapters(tmp_path_factory.mktemp("adapters"))

def ours(root, names, weights, method, **options):
    loaded = [Adapter(name, read_adapter_config(root / name)[0], read_adapter_weights(root / name)) for name in names]
    return combine_adapters(loaded, weights, method, **options)


@pytest.mark.parametrize("method, options", [("linear", {}), ("cat", {}), ("svd", {}), ("ties", {"density": 0.5})])
def test_each_method_gives_peft_s_adapter(adapters, method, options):
    # Weights fp32 holds exactly: PEFT's svd path puts them in an fp32 tensor, which would round
    # 0.7 by 1.2e-8 (relative) and part its result from ours by that, not by a mistake.
    config, combined = ours(adapters, ["a1", "a2"], [0.75, -0.375], method, **options)
    theirs_config, theirs, _ = peft_combined(adapters, ["a1", "a2"], [0.75, -0.375], method, **options)
    assert combined.keys() == theirs.keys() and len(combined) == 2 * 3  # q (both), v (a1), o (a2) in 2 layers
    assert (config.r, config.alpha, set(config.target_modules)) == (theirs_config.r, theirs_config.lora_alpha,
                                                                    set(theirs_config.target_modules))
    for module, (lora_a, lora_b) in combined.items():
        their_a, their_b = theirs[module]
        assert lora_a.dtype == lora_b.dtype == DTYPE
        if method == "svd":  # the product: an SVD's factors are its to choose up to sign
            assert_equal_in_exact_arithmetic(lora_b @ lora_a, their_b @ their_a, f"{method} {module} B A")
        else:
            assert_equal_in_exact_arithmetic(lora_a, their_a, f"{method} {module} A")
            assert_equal_in_exact_arithmetic(lora_b, their_b, f"{method} {module} B")


@pytest.mark.parametrize("method", ["cat", "svd"])
def test_adapters_of_different_ranks_combine_where_peft_allows_it(adapters, method):
    config, combined = ours(adapters, ["a1", "a3"], [0.5, 0.5], method)
    theirs_config, theirs, _ = peft_combined(adapters, ["a1", "a3"], [0.5, 0.5], method)
    assert config.r == theirs_config.r == (12 if method == "cat" else 8)
    for module, (lora_a, lora_b) in combined.items():
        their_a, their_b = theirs[module]
        assert_equal_in_exact_arithmetic(lora_b @ lora_a, their_b @ their_a, f"{method} {module} B A")
    with pytest.raises(ValueError, match=r"--combine linear needs adapters of one rank, got r=4 \(a1\), r=8 \(a3\)"):
        ours(adapters, ["a1", "a3"], [0.5, 0.5], "linear")
    with pytest.raises(ValueError, match="same r value"):
        peft_combined(adapters, ["a1", "a3"], [0.5, 0.5], "linear")


def test_cat_is_exactly_the_weighted_sum_of_the_updates(adapters):
    """cat keeps every update: B A = sum(w_i s_i B_i A_i), module by module."""
    _, combined = ours(adapters, ["a1", "a2"], [0.7, -0.3], "cat")
    parts = {name: read_adapter_weights(adapters / name) for name in ("a1", "a2")}
    for module, (lora_a, lora_b) in combined.items():
        expected = sum(w * CONFIGS[name].scaling * parts[name][module][1] @ parts[name][module][0]
                       for name, w in (("a1", 0.7), ("a2", -0.3)) if module in parts[name])
        assert_equal_in_exact_arithmetic(lora_b @ lora_a, expected, f"cat {module} B A")


def test_dare_drops_at_the_density_and_keeps_the_expectation(adapters):
    tensor = torch.randn(400, 250, generator=torch.Generator().manual_seed(0))
    pruned = random_prune(tensor, 0.3, torch.Generator().manual_seed(1))
    kept = pruned != 0
    assert abs(kept.float().mean().item() - 0.3) < 4 * (0.3 * 0.7 / tensor.numel()) ** 0.5
    torch.testing.assert_close(pruned[kept], tensor[kept] / 0.3)
    # Over many draws dare_linear averages to linear, entry by entry (the drop is unbiased): every
    # entry's mean within 5 standard errors of linear's value.
    draws = [ours(adapters, ["a1", "a2"], [0.7, 0.3], "dare_linear", density=0.5,
                  generator=torch.Generator().manual_seed(seed))[1] for seed in range(300)]
    _, linear = ours(adapters, ["a1", "a2"], [0.7, 0.3], "linear")
    for module, pair in linear.items():
        for side, exact in enumerate(pair):
            samples = torch.stack([d[module][side] for d in draws])
            error = samples.std(0) / len(draws) ** 0.5
            assert ((samples.mean(0) - exact).abs() <= 5 * error + 1e-7).all(), (module, side)
    def dare_ties(seed):
        return ours(adapters, ["a1", "a2"], [0.7, 0.3], "dare_ties", density=0.5,
                    generator=torch.Generator().manual_seed(seed))

    again, same, other = dare_ties(3), dare_ties(3), dare_ties(4)
    module = next(iter(again[1]))
    assert torch.equal(again[1][module][0], same[1][module][0])
    assert not torch.equal(again[1][module][0], other[1][module][0])


@pytest.mark.parametrize("names, weights, method, options, message", [
    (["a1", "a2"], [1.0], "linear", {}, "--weights has 1 values for 2 adapters"),
    (["a1", "a2"], [1.0, 1.0], "ties", {}, "--combine ties needs --density"),
    (["a1", "a2"], [1.0, 1.0], "linear", {"density": 0.5}, "--density 0.5: it applies to ties"),
    (["a1", "a2"], [1.0, 1.0], "dare_ties", {"density": 1.5}, r"in \(0, 1\]"),
    (["a1", "a2"], [1.0, 1.0], "mean", {}, "--combine must be one of linear, cat, svd"),
    # Each is refused in one line naming the flag (not a traceback, nor a silent default).
    (["a1", "a2"], [float("nan"), 1.0], "linear", {}, "--weights nan,1.0: every weight must be a finite number"),
    (["a1", "a2"], [float("inf"), 1.0], "linear", {}, "every weight must be a finite number"),
    (["a1", "a2"], [1.0, 1.0], "svd", {"svd_rank": 999}, r"--svd-rank 999: the smallest adapted layer's update has "
                                                         r"rank \d+ at most"),
    (["a1", "a2"], [1.0, 1.0], "svd", {"svd_rank": 0}, "--svd-rank 0: it applies to --combine svd only, and is at "
                                                       "least 1"),
    (["a1", "a2"], [1.0, 1.0], "linear", {"svd_rank": 2}, "--svd-rank 2: it applies to --combine svd only"),
])
def test_combinations_that_cannot_be_made_are_refused(adapters, names, weights, method, options, message):
    with pytest.raises(ValueError, match=message):
        ours(adapters, names, weights, method, **options)


def test_an_adapter_with_nan_weights_or_no_weights_is_refused(adapters, tmp_path):
    """An empty safetensors is refused (it would combine as zeros, exit 0), and so is a NaN adapter, in one line."""
    from safetensors.torch import save_file

    a1 = Adapter("a1", CONFIGS["a1"], read_adapter_weights(adapters / "a1"))
    poisoned = {name: (a.clone().fill_(float("nan")), b) for name, (a, b) in a1.modules.items()}
    with pytest.raises(ValueError, match=r"nan: .*q_proj holds NaN/inf weights; the adapter is corrupt"):
        combine_adapters([a1, Adapter("nan", CONFIGS["a1"], poisoned)], [0.5, 0.5], "linear")
    empty = tmp_path / "empty"
    empty.mkdir()
    save_file({}, empty / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"empty/adapter_model\.safetensors: holds no tensors, so it is no trained "
                                         "adapter"):
        read_adapter_weights(empty)


def test_adapters_of_layers_of_other_shapes_are_refused_naming_the_module(adapters):
    """Two bases that share module names but not their sizes: the first module that differs is named."""
    a1 = Adapter("a1", CONFIGS["a1"], read_adapter_weights(adapters / "a1"))
    wider = {name: (torch.zeros(4, a.shape[1] * 2), b) for name, (a, b) in a1.modules.items()}
    with pytest.raises(ValueError, match=r"q_proj: a1 adapts a \[\d+, \d+\] layer, wide a \[\d+, \d+\] one: "
                                         "adapters of different bases"):
        combine_adapters([a1, Adapter("wide", CONFIGS["a1"], wider)], [0.5, 0.5], "linear")
