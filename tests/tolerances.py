"""The bound an equality proof is held to, and why (docs/development.md: "How the tests prove equality").

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

Where the claim must be made in fp32 (an evaluation of the default fp32 run, a merged export
in the base's fp32), the bound is derived from fp32's unit roundoff, the chain of sums the value
passes through and its magnitude: fp32_forward_bound. A bf16 run (the TPU's dtype) against the
same run in fp32: bf16_loss_bound, from bf16's unit roundoff, the tokens and the steps.

Set TPU_LORA_MARGINS=FILE to append every comparison's largest difference to FILE (JSON lines),
and TPU_LORA_TEST_SEED=N to train the end-to-end runs with train.seed N (LoRA init, data order,
dropout): the margins docs/development.md reports, across seeds.
"""

from __future__ import annotations

import json
import math
import os

import torch

FLOAT64_EXACT = 1e-10
FP32_UNIT_ROUNDOFF = 2.0 ** -24
BF16_UNIT_ROUNDOFF = 2.0 ** -8


def fp32_forward_bound(magnitude: float, config, merged: bool = False) -> float:
    """How far apart two fp32 forwards of one model may put a value of size `magnitude` (a loss,
    a logit) when they sum in other orders (XLA against the CPU's kernels, another batch shape),
    or when one runs on the merged weights (each W0 + s B A rounded once to fp32: merged=True).

    The value passes through a chain of sums: per decoder layer the norm, q/k/v, the scores,
    the softmax, the weighted values, o, the norm, gate/up and down (9), then the final norm,
    the head, the log-sum-exp and the mean (4); merged weights add one rounding to each of a
    layer's 7 projections. A sum of n terms taken in another order moves by about sqrt(n)
    unit roundoffs of its size (Higham & Mary 2019, the probabilistic bound), with n at most the
    widest of hidden, intermediate and vocabulary sizes; the chain's are added, as in the worst
    case. For the demo's model (2 layers, vocabulary 1024) that is 22 x 32 x 6e-8 = 4.2e-5 of
    the value (the tests' largest difference: 1.0e-6 on losses of about 6, 0.4% of it)."""
    depth = (9 + (7 if merged else 0)) * config.num_hidden_layers + 4
    width = max(config.hidden_size, config.intermediate_size, config.vocab_size)
    return depth * math.sqrt(width) * FP32_UNIT_ROUNDOFF * abs(float(magnitude))


def bf16_loss_bound(loss: float, label_tokens: int, step: int) -> float:
    """How far a run on bf16 base weights may put its train loss at `step` (from 1) from the same
    run's in fp32, on a loss of size `loss` over `label_tokens` tokens.

    Rounding the weights and activations to bf16 (unit roundoff 2^-8) moves each token's loss by
    about 2^-8 of itself, independently from token to token, so their mean moves by
    2^-8 / sqrt(label_tokens) of itself; each step before carries its own difference on in the
    LoRA weights it updated, added as in the worst case: step x that. For a step of 512 label
    tokens on a loss of 7: 1.2e-3 at step 1, 9.7e-3 at step 8 (the tests' runs: 9% of it at
    most; their losses fall by about 0.3 over those 8 steps)."""
    return step * BF16_UNIT_ROUNDOFF / math.sqrt(label_tokens) * abs(loss)


def largest_difference(ours, theirs) -> float:
    """max |ours - theirs| over tensors, lists of numbers or numbers."""
    a, b = (torch.as_tensor(x.detach() if isinstance(x, torch.Tensor) else x, dtype=torch.float64)
            for x in (ours, theirs))
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max()) if a.numel() else 0.0


def assert_equal_in_exact_arithmetic(ours, theirs, what: str, bound: float = FLOAT64_EXACT) -> None:
    """ours and theirs agree within `bound` (FLOAT64_EXACT for float64 runs, else a derived one:
    fp32_forward_bound); the difference goes to the margins file when one is set."""
    difference = largest_difference(ours, theirs)
    margins = os.environ.get("TPU_LORA_MARGINS")
    if margins:
        with open(margins, "a") as f:
            test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
            f.write(json.dumps({"test": test, "what": what, "difference": difference, "bound": bound}) + "\n")
    assert difference <= bound, f"{what}: differs by {difference:.3g}, beyond its bound {bound:.3g} (tolerances.py)"


def assert_within_bf16_rounding(losses: list[float], fp32_records: list[dict], what: str = "loss") -> None:
    """Each step's bf16 loss within bf16_loss_bound of the fp32 run's, and not equal to all of
    them (equal: the run was not in another precision)."""
    gaps = []
    for step, (loss, theirs) in enumerate(zip(losses, fp32_records, strict=True), start=1):
        bound = bf16_loss_bound(theirs["loss"], theirs["label_tokens"], step)
        assert_equal_in_exact_arithmetic(loss, theirs["loss"], f"{what} at step {step}", bound)
        gaps.append(abs(loss - theirs["loss"]))
    assert max(gaps) > 0, what
