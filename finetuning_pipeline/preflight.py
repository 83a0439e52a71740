"""Check a run and plan its TPU time on a CPU, before any TPU is rented.

    python -m finetuning_pipeline.preflight --config CONFIG.yaml [tpu.type=v5e-8] [parallel.mode=fsdp] [key=value ...]
    make preflight CONFIG=CONFIG.yaml

1. Checks: the config; the model architecture (model.path/config.json, or the copy shipped in
   finetuning_pipeline/model_configs/ when the model is not downloaded yet); that every LoRA
   target exists in it (a weightless model on the meta device); the prepared shards against
   the tokenizer (when both are on disk).
2. Plan, for tpu.type and parallel.mode: HBM per chip against its capacity, FLOPs per step,
   step time and tokens/s at tpu.assumed_mfu, compile time (tpu.compile_s_per_layer), wall time
   and TPU-hours per phase (compiles included), and when it
   does not fit, the overrides that make it fit (finetuning_pipeline/planning/tpu_plan.py has the model).
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
import math
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dataset.errors import DataError
from dataset.manifest import MANIFEST_NAME, read_manifest
from finetuning_pipeline.model.chunked_loss import resolve_chunk_tokens
from finetuning_pipeline.model.kernel_attention import choose_attention
from finetuning_pipeline.model.loading import check_lora_targets
from finetuning_pipeline.model.scan_choice import scan_decision
from finetuning_pipeline.planning.rehearsal import rehearse
from finetuning_pipeline.planning.tpu_chips import parse_tpu_type
from finetuning_pipeline.planning.tpu_plan import ModelShape, PlanInputs, mode_advice, plan, suggestions
from finetuning_pipeline.run.parallel import mesh_shape
from finetuning_pipeline.run.run_layout import RunLayout
from finetuning_pipeline.run_config import ConfigError, RunConfig, load_config
from utils.atomic_io import atomic_write_json
from utils.durations import parse_duration
from utils.hub_models import HubModelError, hub_cache, is_hub_id, model_dir, offline

SHIPPED_CONFIGS = Path(__file__).resolve().parent / "model_configs"


def architecture_source(model_path: str, revision: str | None = None) -> Path:
    """The config.json to plan with: the model's own (a Hub id's from the Hub when online, or
    from the Hugging Face cache), else our shipped copy of it."""
    own = Path(model_path) / "config.json"
    if own.is_file():
        return own
    if is_hub_id(model_path):
        from huggingface_hub import hf_hub_download

        try:
            return Path(hf_hub_download(model_path, "config.json", revision=revision, cache_dir=hub_cache(),
                                        local_files_only=offline()))
        except (OSError, ValueError):  # offline and not cached, gated, unreachable (huggingface_hub's errors
            pass                       # are OSErrors), a malformed id: plan with the shipped copy
    shipped = SHIPPED_CONFIGS / Path(model_path).name / "config.json"
    if shipped.is_file():
        return shipped
    known = sorted(p.name for p in SHIPPED_CONFIGS.iterdir() if p.is_dir())
    raise ConfigError(f"model.path: {model_path} has no config.json and no shipped copy matches its name "
                      f"(shipped: {known}); download the model, or copy its config.json there")


def load_architecture(model_path: str, revision: str | None = None):
    from transformers import AutoConfig

    source = architecture_source(model_path, revision)
    return AutoConfig.from_pretrained(source.parent), source


def phases_of(config: RunConfig) -> list[int]:
    return [p for p in (1, 2) if config.phase(p).data]


def seq_len_of(config: RunConfig, phase: int) -> int:
    data = config.phase(phase).data
    if (Path(data) / MANIFEST_NAME).is_file():
        return read_manifest(data)["seq_len"]
    if config.phase(phase).seq_len:
        return config.phase(phase).seq_len
    raise ConfigError(f"phase{phase}.seq_len: {config.phase(phase).data} is not prepared yet, so set the sequence "
                      f"length to plan with (e.g. phase{phase}.seq_len=2048)")


def planned_generation(config: RunConfig) -> str:
    """The generation of tpu.type: the TPU the attention kernels are judged for, with the tested
    install (`pip install -e '.[tpu]'`), whatever machine preflight runs on."""
    try:
        return parse_tpu_type(config.tpu.type).generation.name
    except ValueError as err:
        raise ConfigError(str(err)) from None


def plan_inputs(config: RunConfig, phase: int, mode: str | None = None, devices: int | None = None,
                model_config=None) -> PlanInputs:
    """The plan's inputs from the config; `devices` (the slice's chips) resolves parallel.mesh,
    `model_config` the loss chunk."""
    fsdp_axis = config.parallel.mesh.fsdp
    loss_chunk, attention = 0, "dense"
    if model_config is not None:
        try:
            loss_chunk = resolve_chunk_tokens(config.train.loss_chunk_tokens, model_config)
            attention = choose_attention(config.model.attention, model_config, tpu=planned_generation(config),
                                         spmd_mesh=(mode or config.parallel.mode) == "fsdp",
                                         seq_len=seq_len_of(config, phase))[0]
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if devices is not None and (mode or config.parallel.mode) == "fsdp":
        try:
            fsdp_axis = mesh_shape(devices, config.parallel.mesh.data, config.parallel.mesh.fsdp)[1]
        except ValueError as err:
            raise ConfigError(f"{err} (tpu.type={config.tpu.type})") from None
    return PlanInputs(mode=mode or config.parallel.mode, dtype=config.model.dtype, micro_batch=config.train.micro_batch,
                      grad_accum=config.train.grad_accum, seq_len=seq_len_of(config, phase),
                      checkpointing=config.model.activation_checkpointing, lora_r=config.lora.r,
                      lora_targets=list(config.lora.target_modules), lora_dropout=config.lora.dropout,
                      assumed_mfu=config.tpu.assumed_mfu, steps=config.max_steps(phase), fsdp_axis=fsdp_axis,
                      loss_chunk=loss_chunk, attention=attention, compile_s_per_layer=config.tpu.compile_s_per_layer,
                      capture_step=config.train.capture_step, compile_s_scanned=config.tpu.compile_s_scanned,
                      scanned_layers=model_config is not None and layers_scanned(config, model_config, mode))


def layers_scanned(config: RunConfig, model_config, mode: str | None = None) -> bool:
    """Whether the trainer will scan this model's decoder layers (train.scan_layers, asked of a
    weightless model of the architecture as the trainer asks its model; true where they cannot
    be is a ConfigError here)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return scan_decision(model, config.train.scan_layers, (mode or config.parallel.mode) == "fsdp") is None


def make_plan(config: RunConfig, model_config) -> dict:
    """The plan of every phase plus the totals preflight.json promises at its top level."""
    shape = ModelShape.from_config(model_config)
    tpu = parse_tpu_type(config.tpu.type)
    phases = {}
    for phase in phases_of(config):
        inputs = plan_inputs(config, phase, devices=tpu.devices, model_config=model_config)
        phases[f"phase{phase}"] = plan(shape, tpu, inputs)
        phases[f"phase{phase}"]["parallel_advice"] = mode_advice(shape, tpu, inputs)
        if config.train.max_wall_time:  # sessions of that budget the phase needs; each compiles again
            budget = parse_duration(config.train.max_wall_time)
            planned = phases[f"phase{phase}"]
            compile_s = planned["compile_s"]
            steps_s = planned["tpu_hours"] * 3600 - compile_s
            sessions = max(1, math.ceil(steps_s / max(budget - compile_s, 1.0)))
            planned["sessions"] = sessions
            planned["tpu_hours"] = round((steps_s + sessions * compile_s) / 3600, 3)
            planned["chip_hours"] = round(planned["tpu_hours"] * planned["inputs"]["chips"], 2)
        if not phases[f"phase{phase}"]["fits"]:
            phases[f"phase{phase}"]["to_fit"] = suggestions(shape, tpu, inputs)
    first = next(iter(phases.values()))
    return {
        "tpu_type": config.tpu.type,
        "parallel_mode": config.parallel.mode,
        "fits": all(p["fits"] for p in phases.values()),
        "hbm_per_chip_gib": max(p["hbm_per_chip_gib"] for p in phases.values()),
        "hbm_capacity_gib": first["hbm_capacity_gib"],
        "step_time_s": first["step_time_s"],
        "tokens_per_sec": first["tokens_per_sec"],
        "tpu_hours": round(sum(p["tpu_hours"] for p in phases.values()), 3),
        "chip_hours": round(sum(p["chip_hours"] for p in phases.values()), 2),
        "assumed_mfu": config.tpu.assumed_mfu,
        "max_wall_time": config.train.max_wall_time,
        "phases": phases,
    }


# -- the command -----------------------------------------------------------------------------
def check_data(config: RunConfig) -> dict:
    """The trainer's own start-up checks (shards against the tokenizer, seq_len, phases), when
    the model's tokenizer and the data are on disk."""
    from finetuning_pipeline.run.input_checks import check_inputs

    phases = phases_of(config)
    try:
        on_disk = (Path(model_dir(config.model.path, config.model.revision)) / "config.json").is_file()
    except HubModelError:  # a Hub id not downloaded yet
        on_disk = False
    missing = [] if on_disk else [f"model.path {config.model.path} (config.json)"]
    missing += [f"phase{p}.data {config.phase(p).data}" for p in phases if not Path(config.phase(p).data).is_dir()]
    if missing:
        return {"status": "skipped", "detail": f"not on disk yet: {', '.join(missing)}; run preflight again once "
                "the model is downloaded and the data prepared"}
    try:
        check_inputs(config, phases, planned_tpu=planned_generation(config))
    except (ConfigError, DataError, HubModelError) as err:
        return {"status": "failed", "detail": str(err)}
    return {"status": "passed", "detail": f"tokenizer fingerprint and seq_len match for phases {phases}"}


def format_report(report: dict) -> str:
    p = report
    lines = [f"preflight: {report['config']} on {p['tpu_type']} ({p['parallel_mode']})"]
    for name, check in report["checks"].items():
        lines.append(f"  {check['status']:>7}  {name}: {check.get('detail', '')}")
    for name, phase in p["phases"].items():
        b = phase["hbm_breakdown_gib"]
        scanned = phase["inputs"]["scanned_layers"]
        compile_setting = "layers scanned: tpu.compile_s_scanned" if scanned else "tpu.compile_s_per_layer"
        lines.append(
            f"  {name}: HBM {phase['hbm_per_chip_gib']:.1f} of {phase['hbm_capacity_gib']:.1f} GiB per chip "
            f"({'fits' if phase['fits'] else 'DOES NOT FIT'}; weights {b['weights']}, LoRA+optimizer "
            f"{b['lora_and_optimizer']}, activations {b['activations']}, logits {b['logits']}), "
            f"{phase['step_time_s']:.2f} s/step, {phase['tokens_per_sec']:,.0f} tokens/s at MFU {p['assumed_mfu']}, "
            f"compile ~{phase['compile_s']:.0f} s a session ({compile_setting}), "
            f"{phase['tpu_hours']:.2f} TPU-hours with compiles ({phase['chip_hours']:.1f} chip-hours)"
        )
        for fix in phase.get("to_fit", [])[:3]:
            overrides = " ".join(f"{k}={v}" for k, v in fix["overrides"].items())
            lines.append(f"      to fit: {overrides}  ({fix['hbm_per_chip_gib']} GiB, {fix['step_time_s']} s/step)")
        lines.append(f"      parallel: {phase['parallel_advice']}")
        if "sessions" in phase:
            lines.append(f"      sessions: {phase['sessions']} of train.max_wall_time={report['max_wall_time']}")
    lines.append(f"  total: {p['tpu_hours']:.2f} TPU-hours on {p['tpu_type']}; fits: {p['fits']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m finetuning_pipeline.preflight", description=__doc__.split("\n\n")[0],
        epilog="Plan another slice or mode with overrides: tpu.type=v6e-8 parallel.mode=fsdp. "
        "Exit status: 0 all checks passed and the plan fits, 1 a check failed or it does not fit, 2 bad config.")
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("--no-rehearsal", action="store_true", help="only check and plan (seconds, not minutes)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = parser.parse_args(argv)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    checks: dict[str, dict] = {}
    try:
        config = load_config(args.config, args.overrides)
        checks["config"] = {"status": "passed", "detail": "keys and values valid"}
        if not phases_of(config):
            raise ConfigError("phase1.data / phase2.data: neither is set; nothing to plan")
        model_config, source = load_architecture(config.model.path, config.model.revision)
        checks["architecture"] = {"status": "passed", "detail": f"{model_config.model_type} from {source}"}
        plan_result = make_plan(config, model_config)
    except (ConfigError, DataError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        found = check_lora_targets(model_config, config.lora_config())
        checks["lora_targets"] = {"status": "passed", "detail": f"{found['wrapped_modules']} modules wrapped in "
                                  f"{found['architecture']} for targets {config.lora.target_modules}"}
    except ValueError as err:
        checks["lora_targets"] = {"status": "failed", "detail": str(err)}
    checks["data"] = check_data(config)
    output_dir = Path(config.output_dir)
    if args.no_rehearsal:
        checks["rehearsal"] = {"status": "skipped", "detail": "--no-rehearsal"}
    elif checks["lora_targets"]["status"] == "failed" or checks["data"]["status"] == "failed":
        checks["rehearsal"] = {"status": "skipped", "detail": "a check above failed"}
    else:
        result = rehearse(config, model_config, output_dir / "preflight_rehearsal",
                          checks["data"]["status"] == "passed", phases=phases_of(config),
                          scan_layers=layers_scanned(config, model_config))
        checks["rehearsal"] = {"status": "passed" if result["passed"] else "failed",
                               "detail": f"{result.get('architecture')}: {result.get('data')}; "
                               + ("train, checkpoint, bitwise resume, export: ok" if result["passed"]
                                  else f"failed at {result['failed_at']}: {result.get('detail', '')[-500:]}"),
                               **{k: v for k, v in result.items() if k not in ("passed",)}}
    report = {"config": args.config, "overrides": args.overrides, "model_config": str(source), **plan_result,
              "checks": checks}
    ok = plan_result["fits"] and all(c["status"] != "failed" for c in checks.values())
    report["ok"] = ok
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RunLayout(output_dir).preflight, report)
    print(format_report(report))
    print(f"wrote {RunLayout(output_dir).preflight}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
