"""MaskedAdamW: torch.optim.AdamW's arithmetic, and a skipped step that changes nothing."""

from __future__ import annotations

import torch
from tolerances import assert_equal_in_exact_arithmetic

from finetuning_pipeline.train.adamw import MaskedAdamW


def make_params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(5, 3, generator=generator, dtype=dtype)),
        torch.nn.Parameter(torch.randn(7, generator=generator, dtype=dtype)),
    ]


def set_grads(params, step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype)


def test_matches_torch_adamw_over_several_steps():
    """Our update is torch's written in other operations (its rounding differs): float64."""
    ours, theirs = make_params(dtype=torch.float64), make_params(dtype=torch.float64)
    optimizer = MaskedAdamW(ours, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    reference = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for step in range(6):
        set_grads(ours, step)
        set_grads(theirs, step)
        optimizer.lr = reference.param_groups[0]["lr"] = 1e-2 * (step + 1) / 6  # a schedule too
        optimizer.step()
        reference.step()
        for a, b in zip(ours, theirs):
            assert_equal_in_exact_arithmetic(a, b, f"step {step}")
    assert optimizer.steps.item() == 6


def test_a_parameters_lr_multiple_is_torchs_second_parameter_group():
    """lr_scales (train.embedding_lr: the modules trained in full beside the LoRA): torch's AdamW
    with a second parameter group whose LR is that multiple of the first's at every step of the
    schedule (a LambdaLR scales both alike), weight decay included."""
    ours, theirs = make_params(dtype=torch.float64), make_params(dtype=torch.float64)
    optimizer = MaskedAdamW(ours, lr=1e-2, weight_decay=0.1, lr_scales=[1.0, 0.25])
    reference = torch.optim.AdamW([{"params": [theirs[0]]}, {"params": [theirs[1]]}], lr=1e-2, weight_decay=0.1)
    for step in range(4):
        set_grads(ours, step)
        set_grads(theirs, step)
        optimizer.lr = 1e-2 * (step + 1) / 4
        reference.param_groups[0]["lr"], reference.param_groups[1]["lr"] = optimizer.lr, optimizer.lr * 0.25
        optimizer.step()
        reference.step()
        for a, b in zip(ours, theirs):
            assert_equal_in_exact_arithmetic(a, b, f"step {step}")
    assert not torch.equal(ours[1], make_params(dtype=torch.float64)[1])


def test_a_skipped_step_changes_nothing_even_with_nan_gradients():
    params = make_params()
    optimizer = MaskedAdamW(params, lr=1e-2, weight_decay=0.1)
    set_grads(params, 0)
    optimizer.step()
    before = [p.detach().clone() for p in params]
    moments = [m.clone() for m in optimizer.exp_avg + optimizer.exp_avg_sq]
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    optimizer.step(apply=torch.tensor(False))
    for p, b in zip(params, before):
        assert torch.equal(p, b)
    for m, b in zip(optimizer.exp_avg + optimizer.exp_avg_sq, moments):
        assert torch.equal(m, b)
    assert optimizer.steps.item() == 1
    # ...and the next good step is the one an uninterrupted run would have taken.
    reference = make_params()
    ref_opt = MaskedAdamW(reference, lr=1e-2, weight_decay=0.1)
    for step in (0, 1):
        set_grads(reference, step)
        ref_opt.step()
    set_grads(params, 1)
    optimizer.step()
    for p, r in zip(params, reference):
        assert torch.equal(p, r)


def test_state_dict_round_trip():
    params = make_params()
    optimizer = MaskedAdamW(params, lr=1e-3)
    set_grads(params, 0)
    optimizer.step()
    clone = MaskedAdamW(make_params(), lr=1e-3)
    clone.load_state_dict(optimizer.state_dict())
    assert clone.steps.item() == 1
    for a, b in zip(clone.exp_avg + clone.exp_avg_sq, optimizer.exp_avg + optimizer.exp_avg_sq):
        assert torch.equal(a, b)


def test_groups_step_as_optimizers_of_their_own():
    """Adapters side by side: each group's own lr, skips and step count give, bit for bit, what
    an optimizer of its parameters alone gives."""
    params = make_params(0) + make_params(1)
    groups = [0, 0, 1, 1]
    together = MaskedAdamW(params, lr=torch.zeros(2), betas=(0.9, 0.99), weight_decay=0.1, groups=groups)
    alone = [make_params(0), make_params(1)]
    solo = [MaskedAdamW(p, lr=torch.zeros(()), betas=(0.9, 0.99), weight_decay=0.1) for p in alone]
    for step in range(6):
        set_grads(params, step)
        for k in (0, 1):
            for theirs, ours in zip(alone[k], params[2 * k:2 * k + 2]):
                theirs.grad = ours.grad.clone()
        lr = torch.tensor([1e-2 * (step + 1) / 6, 3e-3])
        apply = torch.tensor([step != 2, step != 4])  # each group skips a step of its own
        together.lr = lr
        together.step(apply)
        for k in (0, 1):
            solo[k].lr = lr[k]
            solo[k].step(apply[k])
            for theirs, ours in zip(alone[k], params[2 * k:2 * k + 2]):
                assert torch.equal(theirs, ours), (step, k)
    assert together.steps.tolist() == [5.0, 5.0]
    assert [s.steps.item() for s in solo] == [5.0, 5.0]
    # Each group's values reach its elements by parameter: no index per element stays on the
    # device (8 bytes an element: 1.3 GB for four 7B adapters of r 16 on all 7 targets).
    assert all(t.numel() <= len(params) for t in together.device_constants())


def test_on_the_xla_device_the_write_back_reads_each_parameter_as_a_row_at_a_number_held_as_data():
    # Sliced at constant offsets, each parameter's write-back was a kernel of its own for XLA to
    # compile (112 parameters: 2.1 s of the update's compile, docs/benchmarks.md). Here each is
    # one row of its size's block, read at a row number that is a graph parameter: a gather of
    # one index, which XLA compiles as a dynamic-slice, one kernel for all parameters of one
    # shape (`make bench-lora-cost` counts them); the only constant slices are the blocks, one
    # per size. Each parameter gets its own part (XLA's arithmetic against the CPU's: the
    # float64 bound).
    import re

    import torch_xla

    device = torch_xla.device()
    generator = torch.Generator().manual_seed(0)
    host = [torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=torch.float64))
            for shape in [(4, 6), (3,), (6, 4), (4, 6), (6, 4), (2, 5)]]
    params = [torch.nn.Parameter(p.detach().to(device)) for p in host]
    ours, reference = MaskedAdamW(params, lr=1e-2), MaskedAdamW(host, lr=1e-2)
    set_grads(host, 0)
    for p, h in zip(params, host):
        p.grad = h.grad.to(device)
    ours.step()
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(params)
    gathers = [line for line in hlo.splitlines() if " gather(" in line]
    # One per parameter, each a whole row of its size's block, at one index (s32[1]).
    rows = sorted(int(re.search(r"slice_sizes=\{1,(\d+)\}", g)[1]) for g in gathers)
    assert rows == sorted(p.numel() for p in params)
    assert all(re.search(r"gather\(f64\[\d+,\d+\]\{1,0\} %[\w.]+, s32\[1\]\{0\} ", g) for g in gathers), gathers
    assert len(set(re.findall(r"slice=\{\[\d+:\d+\]\}", hlo))) == len({p.numel() for p in params})  # the blocks
    reference.step()
    for p, h in zip(params, host):
        assert_equal_in_exact_arithmetic(p.cpu(), h, "the update written back on the XLA device")


def test_on_the_xla_device_a_long_gradients_norm_keeps_its_precision():
    # A 7B model's r 16 adapter on all seven targets has 40M gradient elements. XLA:CPU sums one
    # long reduction in a few lanes of running sums (its tree reduction rewriter is off by
    # default, runtime/xla/device), whose error grows with the length; group_norms sums in short
    # levels. Here a layer's worth of such parameters (19M elements) and sizes with few divisors
    # (a prime, 3 x 5), in one group and in two, against float64.
    import torch_xla

    device = torch_xla.device()
    shapes = [(16, 4096)] * 64 + [(14336, 16)] * 32 + [(16, 14336)] * 32 + [(7919,), (3, 5)]
    generator = torch.Generator().manual_seed(0)
    grads = [torch.rand(shape, generator=generator) for shape in shapes]
    params = [torch.nn.Parameter(torch.zeros(shape, device=device)) for shape in shapes]
    groups = [i % 2 for i in range(len(shapes))]
    by_group = torch.stack([norm64([g for g, k in zip(grads, groups) if k == group]) for group in (0, 1)])
    for optimizer, expected in ((MaskedAdamW(params, lr=1e-3), norm64(grads)),
                                (MaskedAdamW(params, lr=1e-3, groups=groups), by_group)):
        flat = optimizer._flatten([g.to(device) for g in grads])
        norms = optimizer.group_norms(flat).cpu().double()
        assert norms.shape == expected.shape
        assert torch.all((norms / expected - 1).abs() < 5e-7), (norms, expected)
    # The case is a hard one: one sum over the same vector is off by far more.
    assert abs(torch.linalg.vector_norm(flat).cpu().double() / norm64(grads) - 1) > 5e-6


def norm64(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.sqrt(sum((t.double() ** 2).sum() for t in tensors))
