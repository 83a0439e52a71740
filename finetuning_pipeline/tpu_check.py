"""The TPU self-check: the first command on a TPU VM, a few minutes before the long run.

    PJRT_DEVICE=TPU python -m finetuning_pipeline.tpu_check --config CONFIG.yaml [key=value ...]
    make tpu-check CONFIG=CONFIG.yaml

On a 2-layer copy of the configured model (the real width on a TPU), in the configured parallel
mode and dtype, it trains a few steps as configured and once per TPU-only path with that path
turned off, and prints one line per check: kernel vs dense attention, captured vs traced step,
scanned vs looped layers, bf16 vs fp32, the replicas' sums vs one chip, no recompile and no host
sync, buffer donation, HBM in use vs the plan, compile seconds and MFU (checks/device_check.py).
A failed line names the setting that avoids it. On a CPU it runs what a CPU can and says what it
skipped. With runtime.backend=native it checks the native runtime's TPU paths instead (TorchTPU:
checks/native_check.py).

On a pod, run the same command on every host at once (`gcloud ... ssh --worker=all`): each of
the check's runs is a run of the whole slice, as the real run is, and host 0 writes the report
(checks/pod_hosts.py).

Writes output_dir/tpu_check.json. Measured on a TPU, its MFU and compile seconds are what the
next `make preflight` plans with, for the same TPU generation, instead of tpu.assumed_mfu and
tpu.compile_s_* (the XLA:CPU figures). Exit status: 0 every check passed or was skipped, 1 a
check failed, 2 a bad config.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from finetuning_pipeline.checks import self_check_of
from finetuning_pipeline.checks.device_check import format_report, write_report
from finetuning_pipeline.checks.pod_hosts import ONE_HOST, HostBarrier, PodCheckError, PodHost, pod_host
from finetuning_pipeline.planning.phase_plan import layers_scanned, load_architecture, seq_len_of
from finetuning_pipeline.run.run_layout import RunLayout
from finetuning_pipeline.run_config import ConfigError, load_config
from finetuning_pipeline.runtime import backend, torch_xla_installed
from finetuning_pipeline.runtime.xla.device import choose_device
from utils.output_guard import OutputConflict, claim_output, mark_written_by

COMMAND = "finetuning_pipeline.tpu_check"


def refuse_outputs(layout: RunLayout, force: bool) -> None:
    """An earlier check's report and runs are replaced with --force only (and only ours): raises
    OutputConflict, changing nothing."""
    report = layout.tpu_check
    if report.exists():
        if not force:
            raise OutputConflict(f"output_dir: {report} exists (an earlier check); pass --force to replace it")
        try:
            ours = {"checks", "device"} <= set(json.loads(report.read_text()))
        except (OSError, ValueError, TypeError):
            ours = False
        if not ours:
            raise OutputConflict(f"output_dir: {report} was not written by this command; move it away")
    claim_output(layout.tpu_check_runs, force=force, command=COMMAND, flag="output_dir")


def clear_runs(layout: RunLayout) -> None:
    """The check's directory, emptied (on a pod by host 0 alone, before any host writes there)."""
    shutil.rmtree(layout.tpu_check_runs, ignore_errors=True)
    layout.tpu_check_runs.mkdir(parents=True)
    mark_written_by(layout.tpu_check_runs, COMMAND)


class CheckRefused(Exception):
    """A host's config or output_dir refused the check (every host's reasons): exit 2."""


def load_and_claim(args: argparse.Namespace, host: PodHost, barrier: HostBarrier):
    """(config, its runtime's Backend, model_config, seq_len, layout, scanned: whether the
    full-depth run scans its decoder layers), once every host has loaded the config and host 0
    has cleared the check's directory: nothing is deleted unless every host can run the check,
    and no host writes there before it is cleared. Raises CheckRefused otherwise."""
    failure = None
    try:
        config = load_config(args.config, args.overrides)
        runtime = backend(config)  # runtime.backend=auto resolved: the runtime whose TPU paths are checked
        if not runtime.checks_a_pod and host.hosts > 1:
            raise ConfigError(f"runtime.backend={config.runtime.backend}: the {runtime.name} runtime's check runs one "
                              "process on one host (it has no pod rehearsal); run it on one host of the slice")
        if not any(config.data_dirs(1).values()) and not config.phase(1).seq_len:
            raise ConfigError("phase1.seq_len: the check trains at phase 1's sequence length; set phase1.data (or "
                              "its adapters' data side by side) or phase1.seq_len")
        seq_len = seq_len_of(config, 1)
        model_config, _ = load_architecture(config.model.path, config.model.revision)
        scanned = layers_scanned(config, model_config)  # train.scan_layers=true where it cannot be: refused here
        layout = RunLayout(config.output_dir)
        if host.writer:
            refuse_outputs(layout, args.force)
    except (ConfigError, ValueError) as err:
        failure = str(err)
    failures = barrier.ready("config", failure)
    if not failures and host.writer:
        try:
            clear_runs(layout)
        except OSError as err:
            failure = f"output_dir: cannot clear {layout.tpu_check_runs}: {err}"
    failures = failures or barrier.ready("claim", failure)
    if failures:
        raise CheckRefused("; ".join(failures))
    return config, runtime, model_config, seq_len, layout, scanned


def check_device() -> str:
    """CPU or TPU, the device the check's runs take: choose_device's (PJRT_DEVICE as set, or, unset,
    the TPU where this machine's PCI bus has TPU chips), which reads no torch_xla; said with its
    advice to set PJRT_DEVICE only where torch_xla is there to read it. A PJRT_DEVICE of another
    device is a ConfigError."""
    return choose_device() if torch_xla_installed() else choose_device(say=lambda line: None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tpu-lora tpu-check", description=__doc__.split("\n\n")[0],
        epilog="On a pod, run the same command on every host at once (gcloud ... ssh --worker=all): host 0 writes "
               "tpu_check.json. Exit status: 0 every check passed or was skipped, 1 a check failed (or a host of "
               "the pod never came), 2 a bad config.")
    parser.add_argument("--config", required=True, help="YAML run config (the run to check)")
    parser.add_argument("--force", action="store_true", help="replace an earlier check's tpu_check.json and runs")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = parser.parse_intermixed_args(argv)  # key=value overrides before and after the flags
    try:
        device = check_device()
    except ConfigError as err:  # a PJRT_DEVICE the check does not run on
        print(f"error: {err}", file=sys.stderr)
        return 2
    # (a pod's hosts are torch_xla's to read from the VM's metadata; without it, only the native
    # runtime can be checked, on one host: its check has no pod rehearsal)
    host = pod_host(device) if torch_xla_installed() else ONE_HOST
    try:
        barrier = HostBarrier(host)
        config, runtime, model_config, seq_len, layout, scanned = load_and_claim(args, host, barrier)
        check = self_check_of(runtime)  # the runtime's own check of its TPU paths
        report = check(config, model_config, layout.tpu_check_runs, device=device, seq_len=seq_len, scanned=scanned,
                       host=host, barrier=barrier)
    except CheckRefused as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except PodCheckError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    report["config"], report["overrides"] = args.config, args.overrides
    print(format_report(report))
    if host.writer:
        print(f"wrote {write_report(config, report)}")
    else:
        print(f"host {host.index} of {host.hosts}: host 0 writes the report ({layout.tpu_check})")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
