"""The bound an equality proof is held to, and why (README: "How the tests prove equality").

Two computations that are equal in exact arithmetic but run different shapes (K adapters' rows
in one batch against one adapter's, a sharded matmul against a whole one, scanned layers against
a loop) sum in different orders. In fp32 that rounding (epsilon 1.2e-7) then grows over the
training steps, and no fixed bound on the weights both holds on every machine and catches a
small mistake. So these proofs train in float64 (model.dtype=float64, XLA:CPU computes in it:
the LoRA, the loss and the host sums follow, utils/precision.py) and are held to FLOAT64_EXACT.

The derivation: float64's epsilon is 2.2e-16; the tiny models' values are of order 1 (losses
about 2, LoRA weights under 1, hidden 64, sums of at most a few thousand terms), so one step's
rounding differs by ~1e-13 at most, and a few steps of Adam (which divides by sqrt(v), raising a
relative difference of the gradient by at most its inverse size, >1e-3 here) keep it under 1e-11.
A real mistake (a wrong row group, a missed scaling, a wrong shard) moves a loss or a weight by
1e-4 or more: six orders of magnitude apart. Bitwise claims (a resume against the uninterrupted
run, on the same shapes) stay bitwise (torch.equal).

Set TPU_LORA_MARGINS=FILE to append every comparison's largest difference to FILE (JSON lines),
and TPU_LORA_TEST_SEED=N to train the end-to-end runs with train.seed N (LoRA init, data order,
dropout): the margins the README reports, across seeds.
"""

from __future__ import annotations

import json
import os

import torch

FLOAT64_EXACT = 1e-10


def largest_difference(ours, theirs) -> float:
    """max |ours - theirs| over tensors, lists of numbers or numbers."""
    a, b = (torch.as_tensor(x.detach() if isinstance(x, torch.Tensor) else x, dtype=torch.float64)
            for x in (ours, theirs))
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max()) if a.numel() else 0.0


def assert_equal_in_exact_arithmetic(ours, theirs, what: str, bound: float = FLOAT64_EXACT) -> None:
    """ours and theirs (float64 runs) agree within `bound`; the difference goes to the margins
    file when one is set."""
    difference = largest_difference(ours, theirs)
    margins = os.environ.get("TPU_LORA_MARGINS")
    if margins:
        with open(margins, "a") as f:
            test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
            f.write(json.dumps({"test": test, "what": what, "difference": difference, "bound": bound}) + "\n")
    assert difference <= bound, f"{what}: differs by {difference:.3g}, beyond the float64 bound {bound:g}"
