"""The chunked loss under fsdp keeps each chip on its own rows: the per-device program XLA's SPMD
partitioner compiles (4 CPU devices, the batch split over the mesh as parallel.py splits it)
computes the head for the local batch only, chunk after chunk, and never gathers the hidden
states of the global batch.

Chunks cut from the flattened [B*L, H] tokens (before) crossed the batch-sharded dimension: the
partitioner gathered every chip's rows, and each chip ran the head over all B*L tokens (4x the
head's FLOPs here, 8x at data=8)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO
from tolerances import assert_equal_in_exact_arithmetic

B, L, H, V, CHUNK, DEVICES = 8, 24, 16, 97, 32, 4
# float64: the sharded and the whole loss sum in other orders, equal in exact arithmetic
# (tests/tolerances.py); the program's shapes are then f64[...].
HLO_DTYPE = "f64"

PROGRAM = f"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_dump_to=" + sys.argv[1] + " --xla_dump_hlo_as_text"
import numpy as np, torch
import torch_xla, torch_xla.runtime as xr, torch_xla.distributed.spmd as xs
xr.use_spmd()
from transformers import Gemma2Config
from finetuning_pipeline.model.causal_lm_loss import chunked_loss_sum
from finetuning_pipeline.distributed.parallel import BATCH_AXES
device = torch_xla.device()
mesh = xs.Mesh(np.arange({DEVICES}), (2, 2), BATCH_AXES)
torch.manual_seed(0)
head = torch.nn.Linear({H}, {V}, bias=False).requires_grad_(False).double()
hidden = torch.randn({B}, {L}, {H}, dtype=torch.float64)
labels = torch.randint(0, {V}, ({B}, {L}))
labels[:, :5] = -100
config = Gemma2Config(vocab_size={V}, final_logit_softcapping=3.0)

def loss_and_grad(on_device):
    h = hidden.clone().to(device if on_device else "cpu").requires_grad_(True)
    y, lm = labels.to(h.device), torch.nn.Linear({H}, {V}, bias=False).requires_grad_(False).double().to(h.device)
    with torch.no_grad():
        lm.weight.copy_(head.weight.to(h.device))
    if on_device:
        xs.mark_sharding(h, mesh, (BATCH_AXES, None, None))
        xs.mark_sharding(y, mesh, (BATCH_AXES, None))
        xs.mark_sharding(lm.weight, mesh, (None, None))
    loss = chunked_loss_sum(h, y, lm, config, chunk_tokens={CHUNK})
    loss.backward()
    if on_device:
        torch_xla.sync()
    return loss.detach().cpu(), h.grad.cpu()

sharded, whole = loss_and_grad(True), loss_and_grad(False)
assert sharded[1].dtype == torch.float64
print(json.dumps({{"loss": [float(sharded[0]), float(whole[0])], "grad": [sharded[1].tolist(), whole[1].tolist()]}}))
"""


@pytest.mark.heavy
def test_each_chip_computes_the_head_for_its_own_rows_only(tmp_path):
    dump = tmp_path / "dump"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(DEVICES)}
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(dump)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    # The same loss and gradients as the loss on the host, unsharded.
    assert_equal_in_exact_arithmetic(figures["loss"][0], figures["loss"][1], "sharded loss")
    assert_equal_in_exact_arithmetic(figures["grad"][0], figures["grad"][1], "sharded hidden states' gradient")
    programs = [path.read_text() for path in dump.glob("*after_optimizations.txt")]
    step = max(programs, key=lambda text: text.count(f",{V}]"))  # the program with the head in it
    local_rows = B // DEVICES
    columns = CHUNK // B
    logits = {tuple(int(n) for n in shape.split(",")) for shape in re.findall(rf"{HLO_DTYPE}\[([0-9,]+),{V}\]", step)}
    assert logits == {(local_rows * columns,)}, logits  # one chunk of this chip's rows, never more
    hidden_shapes = {tuple(int(n) for n in shape.split(","))
                     for shape in re.findall(rf"{HLO_DTYPE}\[([0-9,]+),{H}\]", step)}
    assert not any(shape[0] == B for shape in hidden_shapes if len(shape) == 3), hidden_shapes  # no global gather
