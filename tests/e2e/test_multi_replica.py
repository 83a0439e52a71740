"""Several replicas on a CPU, equal to one: the real trainer as N replicas talking through gloo on the
loopback (collectives.py), started the way a TPU host starts them (parallel.launcher=tpu: a
launching process, a worker process, a replica thread per device; CPU_NUM_DEVICES=2 is the TPU
v2/v3 shape) or as N torchrun processes, the way a pod's hosts run side by side.

XLA:CPU has no collectives across processes or threads, so here the device sums go through
the host; everything else (the launcher, signals, the data split, stop votes, the collective
checkpoint, failure handling) is the code a TPU runs. Each failure these tests inject is one a
one-replica run cannot show: a stop signal that reaches some replicas or processes only, a
master whose disk fails, a replica that dies, hosts that do not share their output_dir.
"""

from __future__ import annotations

import json
import signal

import pytest
from replica_helpers import (
    HANG,
    HUB_COMMIT,
    HUB_ID,
    checkpoint_steps,
    config_for,
    out_of,
    patched_main,
    run_replicas,
    stop_lines,
    torchrun,
    wait_for_replicas,
)
from tolerances import assert_equal_in_exact_arithmetic
from trainer_helpers import (
    adapter_tensors,
    assert_same_run,
    metric_records,
    publish_to_hub_cache,
    train_losses,
)

from finetuning_pipeline import main

# Phase 2 loads phase 1's adapter on every replica: a replica that went on without waiting for
# the master would find no adapter when the master is slow to write it (a race CI once lost).
SLOW_MASTER_ADAPTER = """
write = trainer.save_adapters
def late(*args, **kwargs):
    time.sleep(3)
    return write(*args, **kwargs)
trainer.save_adapters = late
"""


@pytest.fixture(scope="module")
def torchrun_and_single(tiny_model_dir, data, tmp_path_factory):
    """LoRA dropout on (each sequence's masks from its place in the global stream, whichever replica
    holds it), the same global batch of 8: 2 replicas
    through torchrun (micro-batch 2, both phases, the master slow to write its adapters, W&B
    on, offline), 4 replicas (micro-batch 1, phase 1, the base named by a Hub id, read from a
    Hub-layout cache), and 1 replica (micro-batch 4)."""
    root = tmp_path_factory.mktemp("torchrun")
    common = {"train": {"max_steps": 6}, "lora": {"dropout": 0.1}, "checkpoint": {"every": 3, "keep": 3},
              "model": {"dtype": "float64"}}  # equal in exact arithmetic: float64 (tests/tolerances.py)
    two = config_for(root, tiny_model_dir, data, "two", **common,
                     logging={"wandb": {"project": "tpu-lora-tests", "mode": "offline"}})
    four = config_for(root, tiny_model_dir, data, "four", **{**common, "train": {"max_steps": 6, "micro_batch": 1},
                                                             "model": {"path": HUB_ID, "dtype": "float64"}})
    one = config_for(root, tiny_model_dir, data, "one", **{**common, "train": {"max_steps": 6, "micro_batch": 4}})
    torchrun(2, two, script=patched_main(root, SLOW_MASTER_ADAPTER), env={"WANDB_SILENT": "true"})
    publish_to_hub_cache(root / "hub", HUB_ID, HUB_COMMIT, tiny_model_dir, "main")
    torchrun(4, four, "--phase", "1", env={"HF_HUB_CACHE": str(root / "hub")})
    assert main.main(["--config", str(one)]) == 0
    return out_of(two), out_of(one), one, out_of(four)


@pytest.mark.parametrize("replicas, phase", [(2, 1), (2, 2), (4, 1)])
def test_replicas_through_torchrun_equal_one_replica(torchrun_and_single, replicas, phase):
    two, one, _, four = torchrun_and_single
    several = two if replicas == 2 else four
    ours, single = metric_records(several, "train", phase), metric_records(one, "train", phase)
    assert [r["step"] for r in ours] == [r["step"] for r in single] == list(range(1, 7))
    # the same blocks, split over the replicas
    assert [r["label_tokens"] for r in ours] == [r["label_tokens"] for r in single]
    assert_equal_in_exact_arithmetic([r["loss"] for r in ours], [r["loss"] for r in single], "losses")
    evals = [metric_records(several, "eval", phase), metric_records(one, "eval", phase)]
    assert len(evals[0]) == len(evals[1]) > 0
    assert_equal_in_exact_arithmetic(*([r["loss"] for r in each] for each in evals), "evaluations")
    ours_adapter, single_adapter = adapter_tensors(several, phase), adapter_tensors(one, phase)
    assert ours_adapter.keys() == single_adapter.keys()
    for key in single_adapter:
        assert_equal_in_exact_arithmetic(ours_adapter[key], single_adapter[key], key)
    summary = json.loads((several / f"phase{phase}" / "summary.json").read_text())
    assert summary["parallel"]["processes"] == replicas and summary["global_batch"] == 8
    assert summary["compiles_after_warmup"] == 0


def test_replicas_share_one_wandb_run_per_phase_and_one_pinned_hub_commit(torchrun_and_single):
    """Only the master opens a W&B run; every replica trains the commit the Hub id resolved to
    (their losses equal one replica's on the same weights: test above)."""
    two, _, _, four = torchrun_and_single
    for phase in (1, 2):
        [run] = (two / f"phase{phase}" / "wandb").glob("offline-run-*")
        assert run.name.endswith((two / f"phase{phase}" / "wandb_run_id").read_text().strip())
    settings = json.loads((four / "phase1" / "summary.json").read_text())["resume_keys"]
    assert settings["model.path"] == HUB_ID and settings["model.revision"] == HUB_COMMIT


def test_resume_on_another_number_of_chips_with_the_same_global_batch(torchrun_and_single, tmp_path, capsys):
    """A spot v6e-8 that comes back as something else: the two-replica run's step-3 checkpoint
    resumed by one replica with micro-batch 4 continues the same stream of global blocks."""
    two, _, one_config, _ = torchrun_and_single
    checkpoint = two / "phase1" / "checkpoints" / "step_00000003"
    out = tmp_path / "resumed"
    args = ["--config", str(one_config), "--phase", "1", "--resume", str(checkpoint), f"output_dir={out}"]
    assert main.main(args) == 0
    summary = json.loads((out / "phase1" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 3
    assert summary["resumed_on_other_chips"] == {"saved_on": 2, "resumed_on": 1}
    assert "saved on 2 devices, resuming on 1 with the same global batch of 8" in capsys.readouterr().out
    resumed, original = dict(train_losses(out)), dict(train_losses(two))
    assert sorted(resumed) == [4, 5, 6]
    assert_equal_in_exact_arithmetic([resumed[s] for s in (4, 5, 6)], [original[s] for s in (4, 5, 6)],
                                     "losses resumed on one chip")

    # Another global batch would be another run: refused, naming both values.
    assert main.main([*args[:-1], f"output_dir={tmp_path / 'other'}", "train.micro_batch=2"]) == 2
    err = capsys.readouterr().err
    assert "global batch of 8 sequences, this run has 4" in err


# -- fsdp with several hosts: one SPMD process per host, two virtual chips each -------------------
@pytest.fixture(scope="module")
def fsdp_runs(tiny_model_dir, data, tmp_path_factory):
    """Phase 1, LoRA dropout on: one dp replica (micro-batch 4) and two fsdp "hosts" of two chips
    each (micro-batch 1 per chip): the same global batch of 8."""
    root = tmp_path_factory.mktemp("fsdp-hosts")
    common = {"train": {"max_steps": 12}, "lora": {"dropout": 0.1}, "model": {"dtype": "float64"}}
    single = config_for(
        root, tiny_model_dir, data, "single", **{**common, "train": {"max_steps": 12, "micro_batch": 4}}
    )
    assert main.main(["--config", str(single), "--phase", "1"]) == 0
    fsdp = config_for(root, tiny_model_dir, data, "fsdp", **{**common, "train": {"max_steps": 12, "micro_batch": 1}},
                      parallel={"mode": "fsdp"})
    replicas = run_replicas(2, fsdp, root / "logs", env={"CPU_NUM_DEVICES": "2"})
    assert replicas.wait(HANG) == [0, 0], replicas.outputs()
    return out_of(single), out_of(fsdp), fsdp


def test_fsdp_on_two_hosts_equals_one_replica(fsdp_runs):
    single, fsdp, _ = fsdp_runs
    assert [s for s, _ in train_losses(fsdp)] == list(range(1, 13))
    assert_equal_in_exact_arithmetic([loss for _, loss in train_losses(fsdp)],
                                     [loss for _, loss in train_losses(single)], "fsdp hosts' losses")
    ours, theirs = adapter_tensors(fsdp, 1), adapter_tensors(single, 1)
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert_equal_in_exact_arithmetic(ours[key], theirs[key], key)
    summary = json.loads((fsdp / "phase1" / "summary.json").read_text())
    assert summary["parallel"]["processes"] == 2 and summary["parallel"]["chips"] == 4
    assert summary["parallel"]["mesh"] == {"data": 1, "fsdp": 2}
    assert summary["global_batch"] == 8 and summary["compiles_after_warmup"] == 0


def test_fsdp_hosts_stop_together_and_resume_exactly(fsdp_runs, tmp_path):
    _, reference, config = fsdp_runs
    stopped_config = tmp_path / "fsdp.yaml"
    stopped_config.write_text(config.read_text().replace(str(reference), str(tmp_path / "fsdp")))
    replicas = run_replicas(2, stopped_config, tmp_path / "logs", "checkpoint.every=0", env={"CPU_NUM_DEVICES": "2"})
    wait_for_replicas(replicas, tmp_path / "fsdp", 2)
    replicas.procs[1].send_signal(signal.SIGTERM)
    assert replicas.wait(HANG) == [0, 0], replicas.outputs()
    stopped = checkpoint_steps(tmp_path / "fsdp")
    assert len(stopped) == 1 and stop_lines(replicas) == [stopped[0]] * 2
    resumed = run_replicas(2, stopped_config, tmp_path / "logs-resumed", env={"CPU_NUM_DEVICES": "2"})
    assert resumed.wait(HANG) == [0, 0], resumed.outputs()
    assert_same_run(tmp_path / "fsdp", reference)
