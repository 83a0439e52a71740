"""make tpu-check on a CPU takes, by default, the way a TPU host runs it: two replica threads
started by the TPU's launcher (the v2/v3 shape), buffer donation on; here with bf16 and a q4_0
base (model.quantize: its run equals the run on its dequantized weights). Every check
a CPU can run passes; the TPU-only ones say they were skipped; nothing measured on a CPU reaches
the plan. (The scanned-layers pair is left to its unit test and to
test_scan_trainer: the tiny model is not scanned by default, and each pair is a run.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml
from conftest import REPO
from trainer_helpers import write_run_config

from finetuning_pipeline.checks.device_check import TIMED_STEPS


def tpu_check(config, *args, env):
    return subprocess.run([sys.executable, "-m", "finetuning_pipeline.tpu_check", "--config", str(config), *args],
                          capture_output=True, text=True, timeout=900, cwd=REPO, env=env)


def test_the_self_check_runs_every_path_a_cpu_can_and_skips_the_rest(tiny_model_dir, data, tmp_path):
    import os

    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out",
                              model={"dtype": "bfloat16", "quantize": "q4_0"}, train={"grad_accum": 2})
    env = {k: v for k, v in os.environ.items() if k not in ("CPU_NUM_DEVICES", "XLA_ENABLE_PARAM_ALIASING")}
    env["PJRT_DEVICE"] = "CPU"
    done = tpu_check(config, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "tpu_check.json").read_text())
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status == {"attention": "skipped", "captured step": "passed", "scanned layers": "skipped", "bf16": "passed",
                      "quantized base": "passed", "quantized step": "measured", "collectives": "passed",
                      "recompiles": "passed", "donation": "passed", "HBM": "measured", "compile": "measured",
                      "MFU": "skipped"}, done.stdout
    assert "passed  quantized base: 6 steps, largest loss gap 0.00e+00" in done.stdout
    assert re.search(r"passed  donation: \d+ buffers donated .*; compiled, it aliases [0-9.]+ MiB", done.stdout)
    assert report["ok"] is True and report["device"] == "CPU" and report["measured"] == {}
    for name in status:
        assert f"  {status[name]:>8}  {name}: " in done.stdout
    runs, own = tmp_path / "out" / "tpu_check" / "runs", tmp_path / "out" / "tpu_check" / "host0"
    assert json.loads((runs / "as_configured" / "phase1" / "summary.json").read_text())["world_size"] == 2
    assert yaml.safe_load((own / "as_configured.yaml").read_text())["parallel"]["launcher"] == "tpu"
    # The compile of 2 layers against 1 (the run's layers are not scanned: 2 layers compile as fast
    # unrolled), and the step time of a run that logs its first step and its last only.
    one_layer = json.loads((runs / "compile_one_layer" / "phase1" / "summary.json").read_text())
    assert one_layer["compiles_after_warmup"] == 0 and "s for 1: " in done.stdout
    timed = [json.loads(line) for line in (runs / "timed" / "phase1" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in timed if r["kind"] == "train"] == [1, 1 + TIMED_STEPS]
    again = tpu_check(config, env=env)
    assert again.returncode == 2 and "pass --force to replace it" in again.stderr


def test_the_self_check_of_adapters_side_by_side_in_an_fsdp_run_on_four_devices(tiny_model_dir, data, tmp_path):
    """parallel.mode=fsdp (the mode splash attention needs): the check's runs get four virtual
    devices, donation on; the replicas' sums are inside the SPMD graph, so that line is skipped.
    Two adapters side by side: both train on the check's data, each one's losses compared."""
    import os

    adapters = {"text": {"data": str(data[1])}, "chat": {"data": str(data[2]), "lr": 3e-3}}
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out",
                              train={"grad_accum": 2}, parallel={"mode": "fsdp"},
                              phase1={"data": "", "adapters": adapters}, phase2={"init": "fresh"})
    env = {k: v for k, v in os.environ.items() if k != "XLA_ENABLE_PARAM_ALIASING"}
    env["PJRT_DEVICE"] = "CPU"
    done = tpu_check(config, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "tpu_check.json").read_text())
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert {name: status[name] for name in ("captured step", "quantized base", "collectives", "recompiles",
                                            "donation")} == {
        "captured step": "passed", "quantized base": "skipped", "collectives": "skipped", "recompiles": "passed",
        "donation": "passed"}, done.stdout
    assert "inside the SPMD graph" in done.stdout
    # no memory query for the SPMD virtual device: the compiled graphs' per-device sizes, reported
    assert re.search(r"measured  HBM: the largest compiled graph's [0-9.]+ MiB a device \(XLA:CPU's", done.stdout)
    # (the config file lists them sorted, yaml.safe_dump: chat first, and its data)
    assert f"the run's prepared data ({data[2]}); the 2 adapters side by side (chat, text) each train on it" \
        in done.stdout
    assert "passed  captured step: 6 steps of each of 2 adapters side by side, largest loss gap" in done.stdout
    runs = tmp_path / "out" / "tpu_check" / "runs"
    summary = json.loads((runs / "as_configured" / "phase1" / "summary.json").read_text())
    assert summary["parallel"]["mode"] == "fsdp" and summary["parallel"]["sharded_base_parameters"] > 0


def test_a_pod_of_two_hosts_checks_as_one_slice_each_host_in_its_own_directory(tiny_model_dir, data, tmp_path):
    """make tpu-check on every host of a pod at once, rehearsed by two processes that stand for
    two hosts (torchrun's environment, one replica a host, as the launcher's tests do): each run
    of the check is one run of both hosts in the shared output_dir; each host writes its own
    model, data (the bundled text: phase1.data is not prepared) and log in a directory of its own,
    the same bytes on both; host 0 alone writes the report. A second check without --force is
    refused on both hosts by host 0's claim; with --force but a bad config on host 1, both stop at
    the barrier at once, saying why, and nothing of the first check is deleted."""
    from trainer_helpers import Replicas

    out = tmp_path / "out"
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, out, train={"grad_accum": 2},
                              phase1={"data": str(tmp_path / "not_prepared"), "seq_len": 64})
    # each process a host of its own; donation on, as on a TPU
    hosts = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "XLA_ENABLE_PARAM_ALIASING": "1"}
    args = ["--config", str(config)]

    def check(log: str, *more: str, rank_args=lambda rank: []) -> Replicas:
        return Replicas(2, [*args, *more], tmp_path / log, env=hosts, script="finetuning_pipeline/tpu_check.py",
                        rank_args=rank_args)

    pod = check("logs")
    assert pod.wait(timeout=900) == [0, 0], pod.outputs()
    report = json.loads((out / "tpu_check.json").read_text())
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert report["ok"] is True and report["hosts"] == 2, pod.outputs()
    assert {name: status[name] for name in ("captured step", "recompiles", "donation", "collectives")} == {
        "captured step": "passed", "recompiles": "passed", "donation": "passed", "collectives": "passed"
    }, pod.outputs()
    # the hosts' 2 replicas against host 0 alone with both replicas' rows (as a TPU VM's host 0 takes
    # one chip, a slice of its own: runtime/xla/launch.py, tests/finetuning_pipeline/distributed/test_launch.py)
    alone = json.loads((out / "tpu_check" / "runs" / "collectives" / "phase1" / "summary.json").read_text())
    assert alone["world_size"] == 1 and alone["global_batch"] == 4, pod.outputs()
    # taken as a single host's run is, by the TPU's launcher, as a TPU VM's host 0 takes it
    assert yaml.safe_load((out / "tpu_check" / "host0" / "collectives.yaml").read_text())["parallel"]["launcher"] \
        == "tpu"
    assert not (out / "tpu_check" / "host1" / "collectives.yaml").exists()  # host 1 waited
    assert "host 0 ran it alone" in pod.output(1), pod.outputs()
    assert f"wrote {out / 'tpu_check.json'}" in pod.output(0)
    assert "host 1 of 2: host 0 writes the report" in pod.output(1) and "wrote " not in pod.output(1)
    runs = out / "tpu_check" / "runs"
    for name in ("as_configured", "captured_step", "compile_one_layer", "timed"):
        assert json.loads((runs / name / "phase1" / "summary.json").read_text())["world_size"] == 2, name
    own = [out / "tpu_check" / f"host{index}" for index in (0, 1)]
    for directory in own:
        run = yaml.safe_load((directory / "as_configured.yaml").read_text())
        assert run["model"]["path"] == str(directory / "model") and run["output_dir"] == str(runs / "as_configured")
        assert run["phase1"]["data"] == str(directory / "data")
        assert "$ main.py" in (directory / "tpu_check.log").read_text()

    def files(directory):  # the models, the tokenizer and the token shards (the manifests name their paths)
        return {p.relative_to(directory): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file() and (
            p.parent.name in ("train", "eval") or p.suffix == ".safetensors" or p.name == "tokenizer.json")}

    assert len(files(own[0])) >= 6 and files(own[0]) == files(own[1])

    again = check("again")
    assert again.wait(timeout=300) == [2, 2], again.outputs()
    assert "pass --force to replace it" in again.output(0) and "host 0: output_dir: " in again.output(1)
    bad = check("bad", "--force", rank_args=lambda rank: ["train.grad_accum=0"] if rank == 1 else [])
    assert bad.wait(timeout=300) == [2, 2], bad.outputs()
    assert all("host 1: " in bad.output(rank) and "train.grad_accum must be >= 1" in bad.output(rank)
               for rank in (0, 1)), bad.outputs()
    assert (runs / "timed" / "phase1" / "summary.json").is_file() and files(own[1])  # the first check's, kept


@pytest.mark.native
def test_the_native_runtimes_check_runs_what_a_cpu_can_and_says_what_needs_a_tpu(tiny_model_dir, data, tmp_path):
    """runtime.backend=native: the native runtime's TPU paths (checks/native_check.py) on the CPU's
    device: compiled layers (inductor here, TorchTPU's tpu backend on a TPU) against eager, bf16
    against fp32 and a q8_0 base against its dequantized weights pass, no recompile or host sync;
    TorchTPU, its processes and HBM say they need a TPU."""
    import os

    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out",
                              model={"dtype": "bfloat16", "quantize": "q8_0"})
    done = tpu_check(config, "runtime.backend=native", env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "tpu_check.json").read_text())
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status == {"TorchTPU": "skipped", "compiled layers": "passed", "bf16": "passed", "quantized base": "passed",
                      "recompiles": "passed", "processes": "skipped", "HBM": "skipped"}, done.stdout
    assert "skipped  TorchTPU: needs a TPU (TorchTPU's tpu device)" in done.stdout
    assert "passed  quantized base: 6 steps, largest loss gap 0.00e+00" in done.stdout
    runs = tmp_path / "out" / "tpu_check" / "runs"
    compiled = json.loads((runs / "compiled_layers" / "phase1" / "summary.json").read_text())
    assert compiled["runtime"] == "native" and compiled["compiles_total"] >= 1  # (layers compiled by inductor)
    assert compiled["compiled_layers"] is True  # the summary says how its layers ran
    assert json.loads((runs / "as_configured" / "phase1" / "summary.json").read_text())["compiled_layers"] is False
    assert report["ok"] is True and report["runtime"] == "native"
