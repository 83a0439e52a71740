"""`make tpu-check ... runtime.backend=native`: the native runtime's TPU paths (TorchTPU), tried
on a 2-layer copy of the run's model as the XLA runtime's are (device_check.py), one line each.

The copy trains phase 1 for CHECK_STEPS steps through main.py in one process on the run's
runtime.device ("as configured": on a TPU VM, TorchTPU's `tpu` device, its layers compiled by
its `tpu` backend), then once per path with that one setting changed, the losses of each pair
compared within the dtype's tolerance:

  TorchTPU        the as-configured run ran on the `tpu` device
  compiled layers runtime.compile=layers (torch.compile per decoder layer) vs eager
  bf16            model.dtype=bfloat16 vs float32
  quantized base  model.quantize as configured vs the same model holding its dequantized weights
  recompiles      no graph compiled after warm-up, no host sync in the step counted
  processes       several processes of the slice: not run by this check (the real run starts a
                  process per chip by torchrun over main.py: runtime/native/tpu_launch.py; DDP and
                  FSDP2 under torchrun are tested on a CPU)
  HBM             the plan's HBM against TorchTPU's figures: not compared by this check (a run's
                  summary reads the peak through torch.accelerator, n/a where TorchTPU keeps none)

On a CPU the same runs take the CPU's device (compiled layers by inductor), and what needs a TPU
says "skipped: needs a TPU".
"""

from __future__ import annotations

import datetime
import json
from dataclasses import asdict
from pathlib import Path

import yaml

from finetuning_pipeline.checks.device_check import (
    CHECK_STEPS,
    Check,
    Variant,
    check_copy,
    compare,
    precision_runs,
)
from finetuning_pipeline.checks.pod_hosts import ONE_HOST, HostBarrier, PodHost
from finetuning_pipeline.checks.rehearsal import run_trainer, small_run
from finetuning_pipeline.run_config import RunConfig

NEEDS_A_TPU = "needs a TPU (TorchTPU's tpu device)"


def native_variants(config: RunConfig, compiled: bool, dequantized: Path | None) -> tuple[list[Variant], list[Check]]:
    """(the runs to compare with "as configured", skipped lines); compiled: whether its decoder
    layers were compiled."""
    runs, skipped = [], []
    if config.model.dtype == "float64":
        skipped.append(Check("compiled layers", "skipped", "model.dtype=float64 runs eagerly"))
    else:
        other = "eager" if compiled else "layers"
        runs.append(Variant("compiled layers", {"runtime.compile": other},
                            "runtime.compile=eager" if compiled else "leave runtime.compile eager"))
    precision_runs(config.model.dtype, dequantized, runs, skipped)
    return runs, skipped


def native_check(config: RunConfig, model_config, root: Path, *, device: str, seq_len: int, scanned: bool = False,
                 host: PodHost = ONE_HOST, barrier: HostBarrier | None = None) -> dict:
    """The checks in `root` (output_dir/tpu_check, claimed and cleared); returns the report.
    device_check's signature (tpu_check.py calls either): this runtime scans no layers, and its
    check runs on one host (NativeBackend.checks_a_pod), so `scanned`, `host` and `barrier` are
    unread."""
    on_tpu = device == "TPU"
    checked_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    report = {"device": "TPU" if on_tpu else "CPU", "runtime": "native", "tpu_type": config.tpu.type,
              "checked_at": checked_at, "measured": {}, "hosts": 1}
    own = root / "host0"
    own.mkdir(parents=True)
    log = own / "tpu_check.log"
    made = check_copy(config, model_config, own, seq_len, on_tpu)
    data, dequantized = made.data, made.dequantized
    report.update(data=made.data_note, log=str(log), model=made.description)

    def train(name: str, overrides: dict) -> tuple[Path, str | None]:
        out = root / "runs" / name
        run = small_run(config, model_path=own / "model", output_dir=out, data={1: data}, steps=CHECK_STEPS,
                        on_cpu=not on_tpu)
        run["runtime"].update(backend="native", device="tpu" if on_tpu else "cpu")
        run["parallel"].update(mode="dp", launcher="auto")  # one process: the slice's processes are a line of their own
        run["train"]["recompile_policy"] = "warn"  # a recompile is one of the check's lines
        run["checkpoint"].update(every=0, keep=1)
        if not on_tpu:
            run["train"]["micro_batch"] = 1
        for key, value in overrides.items():
            section, field = key.split(".")
            run[section][field] = value
        path = own / f"{name}.yaml"
        path.write_text(yaml.safe_dump(run))
        proc = run_trainer(path, ["--phase", "1", "--resume", "never", "--force"], "dp", log,
                           "TPU" if on_tpu else "CPU")
        return out, None if proc.returncode == 0 else (proc.stdout + proc.stderr)[-1500:]

    reference, failure = train("as_configured", {})
    if failure:
        return {**report, "checks": [asdict(Check("as configured", "failed", f"the run failed: {failure}"))],
                "ok": False}
    summary = json.loads((reference / "phase1" / "summary.json").read_text())
    # (dynamo compiles the layers only: an eager native run compiles nothing)
    runs, checks = native_variants(config, summary["compiles_total"] > 0, dequantized)
    checks.insert(0, Check("TorchTPU", "passed", "the run trained on TorchTPU's tpu device") if on_tpu
                  else Check("TorchTPU", "skipped", NEEDS_A_TPU))
    for variant in runs:
        out, failure = train(variant.check.replace(" ", "_"), variant.overrides)
        changed = " ".join(f"{k}={v}" for k, v in variant.overrides.items())
        if failure:
            checks.append(Check(variant.check, "failed", f"the run with {changed} failed (as configured it ran): "
                                f"{failure[-300:]}", variant.avoid))
        else:
            dtype = "bfloat16" if "bfloat16" in (config.model.dtype, variant.overrides.get("model.dtype")) else \
                config.model.dtype
            checks.append(compare(variant.check, reference, out, dtype, variant.avoid))
    recompiles, syncs = summary["compiles_after_warmup"], summary["host_syncs_per_step"]
    checks.append(Check("recompiles", "passed" if recompiles == 0 and syncs == 0 else "failed",
                        f"{recompiles} graphs compiled after warm-up, {syncs} host syncs in the step counted",
                        "find the cause with TORCH_LOGS=recompiles (train.recompile_policy=warn lets a run go on)"))
    checks.append(Check("processes", "skipped", "this check runs one process; the run starts one per chip by torchrun "
                        "over main.py (DDP and FSDP2 under torchrun are tested on a CPU)" if on_tpu else NEEDS_A_TPU))
    checks.append(Check("HBM", "skipped", "this check does not compare TorchTPU's memory with the plan (a run's "
                        "summary reads its peak through torch.accelerator)" if on_tpu else NEEDS_A_TPU))
    report.update(checks=[asdict(c) for c in checks], ok=all(c.status != "failed" for c in checks))
    return report

