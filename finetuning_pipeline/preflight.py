"""Check a run and plan its TPU time on a CPU, before any TPU is rented.

    python -m finetuning_pipeline.preflight --config CONFIG.yaml [tpu.type=v5e-8] [parallel.mode=fsdp] [key=value ...]
    make preflight CONFIG=CONFIG.yaml

1. Checks: the config; the model architecture (model.path/config.json, or the copy shipped in
   finetuning_pipeline/model_configs/ when the model is not downloaded yet); that every LoRA
   target exists in it (a weightless model on the meta device); the prepared shards against
   the tokenizer (when both are on disk).
2. Plan, for tpu.type and parallel.mode: HBM per chip against its capacity, FLOPs per step,
   step time and tokens/s at tpu.assumed_mfu, compile time (tpu.compile_s_*), wall time
   and TPU-hours per phase (compiles included), and when it
   does not fit, the overrides that make it fit (finetuning_pipeline/planning/tpu_plan.py has the model).
   Under runtime.backend=native (off TorchTPU's runtime.device=tpu) the same for gpu.type x gpu.count:
   each GPU's allocator peak for compiled layers (planning/gpu_plan.py), at gpu.assumed_mfu.
3. Rehearsal (skip with --no-rehearsal): the real trainer on XLA:CPU with a shrunken model of
   the same architecture (2 layers, hidden 64) under the same LoRA, parallel mode and
   checkpointing settings: a few steps of each phase with the recompile guard on, a
   checkpoint resumed to the same adapter bit for bit, and a merged export that loads in
   plain transformers. It uses the prepared data when it is there, else the bundled samples.

Writes output_dir/preflight.json and prints a summary. Exit status: 0 all checks passed and
the plan fits; 1 a check failed or the plan does not fit; 2 a bad config.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dataset.errors import DataError
from finetuning_pipeline.checks.rehearsal import rehearse
from finetuning_pipeline.model.attention_choice import TargetMachine
from finetuning_pipeline.model.loading import check_lora_targets, check_quantizable
from finetuning_pipeline.planning.phase_plan import (
    layers_scanned,
    load_architecture,
    make_plan,
    phases_of,
    planned_generation,
)
from finetuning_pipeline.run.input_checks import check_inputs, phase_data
from finetuning_pipeline.run.run_layout import RunLayout
from finetuning_pipeline.run_config import ConfigError, RunConfig, load_config
from finetuning_pipeline.runtime import backend
from utils.atomic_io import atomic_write_json
from utils.hub_models import HubModelError, model_dir


def check_data(config: RunConfig) -> dict:
    """The trainer's own start-up checks (shards against the tokenizer, seq_len, phases), when
    the model's tokenizer and the data are on disk."""
    phases = phases_of(config)
    try:
        on_disk = (Path(model_dir(config.model.path, config.model.revision)) / "config.json").is_file()
    except HubModelError:  # a Hub id not downloaded yet
        on_disk = False
    missing = [] if on_disk else [f"model.path {config.model.path} (config.json)"]
    missing += [f"{key} {data}" for _, key, data in phase_data(config, phases) if not Path(data).is_dir()]
    if missing:
        return {"status": "skipped", "detail": f"not on disk yet: {', '.join(missing)}; run preflight again once "
                "the model is downloaded and the data prepared"}
    try:
        check_inputs(config, phases, machine=TargetMachine(tpu=planned_generation(config)))
    except (ConfigError, DataError, HubModelError) as err:
        return {"status": "failed", "detail": str(err)}
    return {"status": "passed", "detail": f"tokenizer fingerprint and seq_len match for phases {phases}"}


# (whether the rehearsal ran, and on which runtime, is its own line: --no-rehearsal skips it)
GPU_NOTE = ("runtime: native on gpu.type: memory is the allocator's peak with compiled layers "
            "(planning/gpu_plan.py); gpu.assumed_mfu and gpu.compile_s are assumptions")


def format_report(report: dict) -> str:
    p = report
    gpu = p["target"] == "gpu"
    # hours: the slice's (TPU-hours, as TPU pricing quotes a slice) or the run's wall-clock (on GPUs,
    # whose GPU-hours are that times the GPUs: chip_hours)
    memory, device, hours = ("memory", "GPU", "hours") if gpu else ("HBM", "chip", "TPU-hours")
    lines = [f"preflight: {report['config']} on {p['device_type']} ({p['parallel_mode']})"]
    for name, check in report["checks"].items():
        lines.append(f"  {check['status']:>7}  {name}: {check.get('detail', '')}")
    if report.get("runtime_note"):
        lines.append(f"  {report['runtime_note']}")
    chip = p["chip_figures"]
    if gpu:
        lines.append("  GPU figures: assumed (gpu.assumed_mfu, gpu.compile_s)")
    else:
        lines.append(f"  chip figures: measured by make tpu-check at {chip['checked_at']} ({chip['source']})" if chip
                     else "  chip figures: assumed (tpu.assumed_mfu, tpu.compile_s_*); make tpu-check measures them")
    for name, phase in p["phases"].items():
        b = phase["hbm_breakdown_gib"]
        scanned = phase["inputs"]["scanned_layers"]
        compile_setting = ("gpu.compile_s" if gpu else "layers scanned: tpu.compile_s_scanned" if scanned
                           else "tpu.compile_s_fixed + tpu.compile_s_per_layer x layers")
        lines.append(
            f"  {name}: {memory} {phase['hbm_per_chip_gib']:.1f} of {phase['hbm_capacity_gib']:.1f} GiB per {device} "
            f"({'fits' if phase['fits'] else 'DOES NOT FIT'}; weights {b['weights']}, LoRA+optimizer "
            f"{b['lora_and_optimizer']}, activations {b['activations']}, logits {b['logits']}), "
            f"{phase['step_time_s']:.2f} s/step, {phase['tokens_per_sec']:,.0f} tokens/s at MFU {p['assumed_mfu']}, "
            f"compile ~{phase['compile_s']:.0f} s a session ({compile_setting}), "
            f"{phase['tpu_hours']:.2f} {hours} with compiles"
            + (f" ({phase['chip_hours']:.2f} GPU-hours)" if gpu else f" ({phase['chip_hours']:.1f} chip-hours)")
        )
        for fix in phase.get("to_fit", [])[:3]:
            overrides = " ".join(f"{k}={v}" for k, v in fix["overrides"].items())
            lines.append(f"      to fit: {overrides}  ({fix['hbm_per_chip_gib']} GiB, {fix['step_time_s']} s/step)")
        lines.append(f"      parallel: {phase['parallel_advice']}")
        if phase["inputs"].get("attention_reason"):
            lines.append(f"      attention: {phase['inputs']['attention_reason']}")
        if "sessions" in phase:
            lines.append(f"      sessions: {phase['sessions']} of train.max_wall_time={report['max_wall_time']}")
        if "one_after_another" in phase:
            apart, saved = phase["one_after_another"], phase["one_after_another"]["tpu_hours_saved"]
            why = (f"saves {saved:.2f}: one compile" if saved >= 0 else
                   f"costs {-saved:.2f} more: an adapter with fewer steps than the longest still runs its rows")
            lines.append(f"      side by side: {phase['inputs']['adapters']} adapters in {phase['tpu_hours']:.2f} "
                         f"{hours}; one after another {apart['tpu_hours']:.2f} ({why}; the plan counts FLOPs, so "
                         "the base's weights read once for all adapters are not credited: see docs/several-tasks.md)")
    gpu_hours = f" ({p['chip_hours']:.2f} GPU-hours)" if gpu else ""
    lines.append(f"  total: {p['tpu_hours']:.2f} {hours}{gpu_hours} on {p['device_type']}; fits: {p['fits']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tpu-lora preflight", description=__doc__.split("\n\n")[0],
        epilog="Plan another slice or mode with overrides: tpu.type=v6e-8 parallel.mode=fsdp; GPUs under "
        "runtime.backend=native with gpu.type=h100-80gb gpu.count=8 (cards: planning/gpu_cards.py). "
        "Exit status: 0 all checks passed and the plan fits, 1 a check failed or it does not fit, 2 bad config.")
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("--no-rehearsal", action="store_true", help="only check and plan (seconds, not minutes)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = parser.parse_intermixed_args(argv)  # key=value overrides before and after the flags
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    checks: dict[str, dict] = {}
    try:
        config = load_config(args.config, args.overrides)
        runtime = backend(config)  # runtime.backend=auto resolved (on this CPU: xla, the TPU's)
        checks["config"] = {"status": "passed", "detail": "keys and values valid"}
        if not phases_of(config):
            raise ConfigError("phaseN.data: no phase has data set (phase1.data, phase2.data, ...); nothing to plan")
        model_config, source = load_architecture(config.model.path, config.model.revision)
        checks["architecture"] = {"status": "passed", "detail": f"{model_config.model_type} from {source}"}
        plan_result = make_plan(config, model_config, gpu=runtime.plans_gpu(config))
    except (ConfigError, DataError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        found = check_lora_targets(model_config, config.lora_config())
        checks["lora_targets"] = {"status": "passed", "detail": f"{found['wrapped_modules']} modules wrapped in "
                                  f"{found['architecture']} for targets {config.lora.target_modules}"}
    except ValueError as err:
        checks["lora_targets"] = {"status": "failed", "detail": str(err)}
    if config.model.quantize != "none":
        try:
            check_quantizable(model_config, config.model.quantize)
            checks["quantize"] = {"status": "passed",
                                  "detail": f"every decoder Linear stores as {config.model.quantize}"}
        except ValueError as err:
            checks["quantize"] = {"status": "failed", "detail": str(err)}
    checks["data"] = check_data(config)
    output_dir = Path(config.output_dir)
    if args.no_rehearsal:
        checks["rehearsal"] = {"status": "skipped", "detail": "--no-rehearsal"}
    elif any(checks[key]["status"] == "failed" for key in ("lora_targets", "quantize", "data") if key in checks):
        checks["rehearsal"] = {"status": "skipped", "detail": "a check above failed"}
    else:
        result = rehearse(config, model_config, output_dir / "preflight_rehearsal",
                          checks["data"]["status"] == "passed", phases=phases_of(config),
                          scan_layers=layers_scanned(config, model_config))
        checks["rehearsal"] = {"status": "passed" if result["passed"] else "failed",
                               "detail": f"the {config.runtime.backend} runtime on this CPU, "
                               f"{result.get('architecture')}: {result.get('data')}; "
                               + ("train, checkpoint, bitwise resume, export: ok" if result["passed"]
                                  else f"failed at {result['failed_at']}: {result.get('detail', '')[-500:]}"),
                               **{k: v for k, v in result.items() if k not in ("passed",)}}
    report = {"config": args.config, "overrides": args.overrides, "model_config": str(source), **plan_result,
              "checks": checks, "runtime": runtime.name,
              "runtime_note": GPU_NOTE if plan_result["target"] == "gpu" else runtime.plan_note}
    ok = plan_result["fits"] and all(c["status"] != "failed" for c in checks.values())
    report["ok"] = ok
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RunLayout(output_dir).preflight, report)
    print(format_report(report))
    print(f"wrote {RunLayout(output_dir).preflight}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
