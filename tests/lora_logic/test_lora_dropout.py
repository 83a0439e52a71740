"""LoRA dropout whose mask is a function of a seed (lora_logic/dropout.py)."""

from __future__ import annotations

import torch

from lora_logic.dropout import SeededDropout, keep_mask, set_dropout_seed

SHAPE = torch.Size([4, 64, 96])


def seed(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int32)


def test_a_mask_keeps_one_minus_p_and_changes_with_seed_and_salt():
    for p in (0.05, 0.1, 0.5):
        mask = keep_mask(seed(7), 0, SHAPE, p)
        assert mask.shape == SHAPE and mask.dtype == torch.bool
        assert abs(mask.float().mean().item() - (1 - p)) < 0.01
    p = 0.5
    base = keep_mask(seed(7), 0, SHAPE, p)
    assert torch.equal(base, keep_mask(seed(7), 0, SHAPE, p))
    for other in (keep_mask(seed(8), 0, SHAPE, p), keep_mask(seed(7), 1, SHAPE, p)):
        agreement = (other == base).float().mean().item()
        assert abs(agreement - 0.5) < 0.02  # independent masks agree on half the elements at p 0.5
    # no pattern along an axis: neighbouring rows are as independent as two seeds
    assert abs((base[:, 1:] == base[:, :-1]).float().mean().item() - 0.5) < 0.02


def test_the_xla_device_draws_the_cpu_mask():
    import torch_xla

    from finetuning_pipeline.runtime.xla.device import init_xla_device

    device = init_xla_device()
    for value, salt in ((0, 0), (123456789, 5), (2**31 - 2, 300)):
        on_xla = keep_mask(seed(value).to(device), salt, SHAPE, 0.1)
        torch_xla.sync()
        assert torch.equal(on_xla.cpu(), keep_mask(seed(value), salt, SHAPE, 0.1))


def test_seeded_dropout_scales_kept_values_and_is_off_in_eval():
    module = SeededDropout(0.25, salt=3)
    x = torch.randn(SHAPE)
    module.seed = seed(42)
    y = module(x)
    mask = keep_mask(seed(42), 3, SHAPE, 0.25)
    torch.testing.assert_close(y, torch.where(mask, x / 0.75, torch.zeros_like(x)))
    module.eval()
    assert torch.equal(module(x), x)


def test_without_a_seed_it_is_rng_dropout():
    model = torch.nn.Sequential(SeededDropout(0.5, 0), SeededDropout(0.5, 1))
    set_dropout_seed(model, seed(1))
    assert all(m.seed is not None for m in model)
    set_dropout_seed(model, None)
    x = torch.ones(10_000)
    torch.manual_seed(0)
    first = model[0](x)
    torch.manual_seed(1)
    assert not torch.equal(first, model[0](x))  # torch's RNG, not a seed
    assert abs((first == 0).float().mean().item() - 0.5) < 0.03


def test_a_seed_per_row_gives_each_row_its_own_mask_whatever_rows_surround_it():
    """The trainer's seeds are one per sequence ([rows, 1], from its place in the global stream): a row's
    mask is the same alone, among other rows, in another order, and with its tokens flattened
    ([rows * seq, in], as an expert layer sees them); rows with other seeds get other masks."""
    shape, p, salt = torch.Size([4, 6, 8]), 0.3, 17
    seeds = torch.tensor([[11], [22], [33], [44]], dtype=torch.int32)
    together = keep_mask(seeds, salt, shape, p)
    for row in range(4):
        alone = keep_mask(seeds[row:row + 1], salt, torch.Size([1, 6, 8]), p)
        assert torch.equal(alone[0], together[row])
    reordered = keep_mask(seeds.flip(0), salt, shape, p)
    assert torch.equal(reordered, together.flip(0))
    assert torch.equal(keep_mask(seeds, salt, torch.Size([24, 8]), p).view(shape), together)
    assert not torch.equal(together[0], together[1])
    assert abs(together.float().mean().item() - (1 - p)) < 0.1


def test_adapters_side_by_side_take_their_group_of_the_row_seeds():
    """A layer of K adapters gives dropout the k-th of K row groups: it takes the k-th part of the
    seeds, the masks its rows draw in a run of that adapter alone."""
    dropout = SeededDropout(0.5, salt=3).train()
    x = torch.ones(4, 5, 6)
    seeds = torch.arange(4, dtype=torch.int32).reshape(4, 1) + 100
    dropout.seed = seeds
    together = dropout(x)
    dropout.seed = seeds[2:]  # the second adapter's rows, alone
    assert torch.equal(dropout(x[2:]), together[2:])
    dropout.seed = seeds
    assert torch.equal(dropout(x[2:], group=(1, 2)), together[2:])
