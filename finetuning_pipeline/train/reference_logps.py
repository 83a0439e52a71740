"""A preference phase's reference log-probabilities computed once, before its first step
(`phaseN.preference.precompute_reference`): each training pair's chosen and rejected completion
under the phase's reference, in the order of the pairs on disk. The step then reads them with its
batch (the loader indexes them as it indexes the pairs) instead of running the reference's
forward: the reference costs one forward over the data instead of one a step.

They are kept in `phaseN/reference_logps.npy` (written atomically by the master), so a resumed
phase reads them again instead of recomputing them; a fresh start of the phase computes them anew.
Each replica computes all of them (they are the same on every replica, and a pod's hosts do not
share a disk). The forward runs in evaluation mode: the model's own dropout, if it has any, is
off (the step's reference forward runs in training mode; LoRA's reference has no dropout either
way, and the tiny and common models have none of their own).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from dataset.loader import iter_eval_batches, open_shards
from finetuning_pipeline.model.preference_loss import pair_rows, reference_logps
from utils.atomic_io import atomic_write_bytes
from utils.precision import float64_throughout


@torch.no_grad()
def compute_reference_logps(model, reference: str, data_dir: str, *, micro_batch: int, pad_id: int, device,
                            to_device, boundary, input_sharding=None) -> np.ndarray:
    """[pairs, 2]: every training pair's (chosen, rejected) completion log-probability under the
    model routed through `reference` (preference_loss.reference_logps), in the pairs' order; in
    float64 for a float64 model, else float32 (what the step's batch carries to the device)."""
    pairs = next(iter(open_shards(data_dir, "train").values())).shape[0]
    was_training = model.training
    model.eval()
    found = []
    for batch in iter_eval_batches(data_dir, micro_batch, pad_id=pad_id, split="train"):
        batch = to_device(batch, device, input_sharding)
        with float64_throughout(model.dtype):
            found.append(torch.stack(reference_logps(model, *pair_rows(batch), reference).chunk(2), dim=1))
        boundary()  # one graph per batch, the same every time
    model.train(was_training)
    dtype = np.float64 if model.dtype == torch.float64 else np.float32
    return torch.cat([values.cpu() for values in found])[:pairs].numpy().astype(dtype)


def kept_reference_logps(path: Path, pairs: int, compute, *, resuming: bool, master: bool) -> tuple[np.ndarray, bool]:
    """(the phase's reference log-probabilities, whether they were read rather than computed): a
    resumed phase reads those kept at `path` (when they are there, for its `pairs`), a fresh start
    computes them (compute()) and the master keeps them there."""
    if resuming and path.is_file():
        values = np.load(path)
        if values.shape == (pairs, 2):
            return values, True
    values = compute()
    if master:
        buffer = io.BytesIO()
        np.save(buffer, values)
        atomic_write_bytes(path, buffer.getvalue())
    return values, False
