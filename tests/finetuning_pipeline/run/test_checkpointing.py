"""Checkpoints on disk: every piece of state round-trips, interrupted saves are never resumed."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, tiny_causal_lm

from finetuning_pipeline.run.checkpointing import (
    clean_partial_checkpoints,
    complete_checkpoints,
    load_checkpoint,
    load_optimizer_state,
    save_checkpoint,
    verify_checkpoint,
)
from finetuning_pipeline.train.adamw import MaskedAdamW
from lora_logic.adapters import adapter_groups, lora_parameters, lora_state_dict, named_lora_parameters
from lora_logic.config import LoraConfig
from lora_logic.inject import inject_lora


def model_and_optimizer(seed: int = 0):
    model = tiny_causal_lm("mistral", seed=seed)
    config = LoraConfig(r=4, alpha=8)
    inject_lora(model, config)
    optimizer = MaskedAdamW(lora_parameters(model), lr=1e-2)
    return model, optimizer, config


def take_a_step(model, optimizer):
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    model(tokens, labels=tokens, use_cache=False).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def save(root, step, model, optimizer, config, keep=3, state=None):
    return save_checkpoint(root, step, model=model, optimizer=optimizer, lora_config=config, base_model="tiny",
                           trainer_state=state or {"phase": 1}, keep=keep)


def test_every_piece_of_state_round_trips_through_files(tmp_path):
    model, optimizer, config = model_and_optimizer()
    take_a_step(model, optimizer)
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    path = save(tmp_path, 7, model, optimizer, config, state={"phase": 1, "eval_before": {"loss": 2.5}})
    expected_draws = (random.random(), np.random.rand(), torch.rand(1).item())

    fresh, fresh_optimizer, _ = model_and_optimizer(seed=1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    state = load_checkpoint(path, model=fresh)
    load_optimizer_state(path, model=fresh, optimizer=fresh_optimizer)
    assert state == {"phase": 1, "eval_before": {"loss": 2.5}, "step": 7}
    for key, value in lora_state_dict(model).items():
        assert torch.equal(lora_state_dict(fresh)[key], value), key
    assert torch.equal(fresh_optimizer.steps, optimizer.steps)
    for a, b in zip(fresh_optimizer.exp_avg + fresh_optimizer.exp_avg_sq, optimizer.exp_avg + optimizer.exp_avg_sq):
        assert torch.equal(a, b)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected_draws  # RNG restored
    assert sorted(p.name for p in path.iterdir()) == [
        "COMPLETE", "adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json"
    ]


def side_by_side(names: list[str]):
    """A model with adapters side by side in the order `names` (same shapes: a mix-up would
    load silently), and its optimizer with a group per adapter, as the trainer builds it."""
    model = tiny_causal_lm("mistral", seed=0)
    configs = {name: LoraConfig(r=4, alpha=8) for name in names}
    inject_lora(model, configs)
    optimizer = MaskedAdamW(lora_parameters(model), lr=1e-2, groups=adapter_groups(model))
    return model, optimizer, configs


def test_optimizer_state_is_kept_by_name_so_adapters_resume_in_any_order(tmp_path):
    """Each moment and step count is restored by its adapter's name: restored by position, each
    adapter would take another's state once the adapters are listed in another order."""
    model, optimizer, configs = side_by_side(["sql", "chat"])
    tokens = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(3))
    model(tokens, labels=tokens, use_cache=False).loss.backward()
    optimizer.step(apply=torch.tensor([True, False]))  # sql stepped once, chat not: their states differ
    optimizer.zero_grad()
    model(tokens, labels=tokens, use_cache=False).loss.backward()
    optimizer.step()
    path = save(tmp_path, 2, model, optimizer, configs)

    swapped, swapped_optimizer, _ = side_by_side(["chat", "sql"])
    load_checkpoint(path, model=swapped)
    load_optimizer_state(path, model=swapped, optimizer=swapped_optimizer)
    ours = dict(zip([n for n, _ in named_lora_parameters(model)], zip(optimizer.exp_avg, optimizer.exp_avg_sq)))
    theirs = zip([n for n, _ in named_lora_parameters(swapped)],
                 zip(swapped_optimizer.exp_avg, swapped_optimizer.exp_avg_sq))
    for name, (exp_avg, exp_avg_sq) in theirs:
        assert torch.equal(exp_avg, ours[name][0]) and torch.equal(exp_avg_sq, ours[name][1]), name
    assert optimizer.steps.tolist() == [2.0, 1.0] and swapped_optimizer.steps.tolist() == [1.0, 2.0]
    for name in configs:
        assert all(torch.equal(a, b) for a, b in zip(lora_parameters(swapped, name), lora_parameters(model, name)))

    other, other_optimizer, _ = side_by_side(["chat", "docs"])
    with pytest.raises(ValueError, match=r"optimizer.pt does not fit this model's LoRA: its LoRA weights are not this "
                                         r"model's: 28 missing \(first \['model.layers.0.self_attn.q_proj.lora_A.docs"):
        load_optimizer_state(path, model=other, optimizer=other_optimizer)


def test_optimizer_state_by_name_holds_with_scanned_layers_in_another_order(tmp_path):
    """The hard case of the above: both models' decoder layers scanned (their LoRA weights and
    moments stacked), the adapters listed in another order; each moment reaches the weight of its
    name, through the checkpoint's per-layer layout."""
    from finetuning_pipeline.runtime.xla.layer_scan import scan_decoder_layers
    from lora_logic.adapters import per_layer_lora, per_layer_lora_names

    def scanned(names, checkpoint=None):
        model = tiny_causal_lm("mistral", seed=0)
        inject_lora(model, {name: LoraConfig(r=4, alpha=8) for name in names})
        if checkpoint is not None:
            load_checkpoint(checkpoint, model=model)  # adapters before the layers are stacked, as the trainer does
        scan_decoder_layers(model)
        return model, MaskedAdamW(lora_parameters(model), lr=1e-2, groups=adapter_groups(model)), names

    model, optimizer, names = scanned(["sql", "chat"])
    with torch.no_grad():  # distinct moments everywhere, and step counts per adapter
        optimizer.exp_avg_flat.copy_(torch.arange(optimizer.exp_avg_flat.numel(), dtype=torch.float32))
        optimizer.exp_avg_sq_flat.copy_(torch.arange(optimizer.exp_avg_sq_flat.numel(), dtype=torch.float32) * 2)
        optimizer.steps.copy_(torch.tensor([5.0, 3.0]))
    path = save(tmp_path, 5, model, optimizer, {name: LoraConfig(r=4, alpha=8) for name in names})

    swapped, swapped_optimizer, _ = scanned(["chat", "sql"], checkpoint=path)
    load_optimizer_state(path, model=swapped, optimizer=swapped_optimizer)
    by_name = [dict(zip(per_layer_lora_names(m), per_layer_lora(m, moments)))
               for m, moments in ((model, optimizer.exp_avg), (swapped, swapped_optimizer.exp_avg))]
    assert by_name[0].keys() == by_name[1].keys() and len(by_name[0]) == 2 * 2 * 7 * 2  # layers x adapters x targets
    for name, moment in by_name[0].items():
        assert torch.equal(by_name[1][name], moment), name
    assert swapped_optimizer.steps.tolist() == [3.0, 5.0]


def test_keep_last_k_and_order(tmp_path):
    model, optimizer, config = model_and_optimizer()
    for step in (2, 4, 10, 6):  # a resumed run may write an older step after a newer one
        save(tmp_path, step, model, optimizer, config, keep=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000006", "step_00000010"]


def test_corrupt_file_is_detected(tmp_path):
    model, optimizer, config = model_and_optimizer()
    path = save(tmp_path, 1, model, optimizer, config)
    data = bytearray((path / "optimizer.pt").read_bytes())
    data[-10] ^= 0xFF
    (path / "optimizer.pt").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="optimizer.pt: missing or corrupt"):
        verify_checkpoint(path)


WRITER = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path[:0] = sys.argv[2:]  # this test's folder and tests/ (conftest)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    from finetuning_pipeline.runtime.xla.device import init_xla_device
    init_xla_device()
    from test_checkpointing import model_and_optimizer, save
    import finetuning_pipeline.run.checkpointing as ckpt
    model, optimizer, config = model_and_optimizer()
    save(sys.argv[1], 2, model, optimizer, config)
    real_save = torch.save
    def save_then_die(obj, path, *a, **k):
        real_save(obj, path, *a, **k)
        if str(path).endswith("optimizer.pt"):
            os.kill(os.getpid(), signal.SIGKILL)  # the writer dies in the middle of checkpoint 4
    ckpt.torch.save = save_then_die
    save(sys.argv[1], 4, model, optimizer, config)
""")


@pytest.mark.heavy
def test_a_writer_killed_midway_leaves_no_checkpoint_that_looks_complete(tmp_path):
    root = tmp_path / "checkpoints"
    here = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, "-c", WRITER, str(root), str(here), str(REPO / "tests")],
                          capture_output=True, text=True, env={**os.environ, "PJRT_DEVICE": "CPU"}, cwd=REPO)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004"]
    assert (root / "step_00000004" / "optimizer.pt").is_file()  # written in place, up to the kill
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000002"]  # never the half-written one
    assert clean_partial_checkpoints(root) == ["step_00000004"]
    assert [p.name for p in root.iterdir()] == ["step_00000002"]
    verify_checkpoint(root / "step_00000002")


def test_a_checkpoint_is_written_without_renaming_a_directory(tmp_path, monkeypatch):
    """gcsfuse on a flat-namespace bucket (a pod's usual output_dir) cannot rename a directory:
    a save renames files only, and the same step saved again is replaced."""
    real_replace, real_rename = os.replace, os.rename

    def files_only(rename):
        def move(source, destination, *args, **kwargs):
            if Path(source).is_dir():
                raise OSError(errno.ENOTSUP, "directory rename not supported", str(source))
            return rename(source, destination, *args, **kwargs)
        return move

    monkeypatch.setattr(os, "replace", files_only(real_replace))
    monkeypatch.setattr(os, "rename", files_only(real_rename))
    model, optimizer, config = model_and_optimizer()
    first = save(tmp_path, 4, model, optimizer, config)
    first_weights = (first / "adapter_model.safetensors").read_bytes()
    with torch.no_grad():
        lora_parameters(model)[0].add_(1.0)
    again = save(tmp_path, 4, model, optimizer, config)
    assert first == again and [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000004"]
    assert (again / "adapter_model.safetensors").read_bytes() != first_weights
    verify_checkpoint(again)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]  # no temporary left beside it


def test_a_directory_without_marker_is_incomplete(tmp_path):
    model, optimizer, config = model_and_optimizer()
    path = save(tmp_path, 3, model, optimizer, config)
    (path / "COMPLETE").unlink()
    assert complete_checkpoints(tmp_path) == []
    with pytest.raises(ValueError, match="incomplete checkpoint"):
        verify_checkpoint(path)
    assert clean_partial_checkpoints(tmp_path) == ["step_00000003"]


def test_nan_weights_are_never_saved(tmp_path):
    model, optimizer, config = model_and_optimizer()
    with torch.no_grad():
        lora_parameters(model)[0][0, 0] = float("nan")
    with pytest.raises(ValueError, match="refusing to write NaN/inf"):
        save(tmp_path, 1, model, optimizer, config)
    assert complete_checkpoints(tmp_path) == [] and list(tmp_path.iterdir()) == []
