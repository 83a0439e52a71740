"""A run's plan on its TPU (or, for the native runtime, its GPUs), phase by phase: the
architecture it plans with (the model's own config.json, or the copy shipped in
finetuning_pipeline/model_configs/), the plan's inputs read from the run config (sequence length,
attention as chosen for the planned TPU, loss chunk, scanned layers, and the chip figures make
tpu-check measured when there are any), and the plan of every phase (tpu_plan.py has the model;
gpu_plan.py the native runtime's memory on a GPU). Used by preflight and by make tpu-check."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from dataset.manifest import MANIFEST_NAME, read_manifest
from dataset.shards import PREFERENCE
from finetuning_pipeline.distributed.parallel import mesh_shape
from finetuning_pipeline.model.activation_checkpointing import checkpointing_mode
from finetuning_pipeline.model.attention_choice import choose_attention
from finetuning_pipeline.model.causal_lm_loss import resolve_chunk_tokens
from finetuning_pipeline.planning.gpu_cards import parse_gpu_type
from finetuning_pipeline.planning.gpu_plan import native_memory, native_mode_advice
from finetuning_pipeline.planning.tpu_chips import parse_tpu_type
from finetuning_pipeline.planning.tpu_plan import (
    ModelShape,
    PlanInputs,
    mode_advice,
    plan,
    suggestions,
    tpu_memory,
)
from finetuning_pipeline.run.run_layout import RunLayout
from finetuning_pipeline.run_config import ConfigError, PreferenceConfig, RunConfig
from finetuning_pipeline.runtime.xla.scan_choice import scan_decision
from utils.durations import parse_duration
from utils.hub_models import hub_cache, hub_unavailable, is_hub_id

SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "model_configs"


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
                                        local_files_only=hub_unavailable()))
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
    """The phases with data (or adapters side by side, each with its own)."""
    return [p for p in config.phase_numbers() if config.phase(p).data or config.phase(p).adapters]


def seq_len_of(config: RunConfig, phase: int) -> int:
    """The phase's sequence length: its prepared data's (side by side: one for all its adapters), else
    phaseN.seq_len."""
    data = next(iter(config.data_dirs(phase).values()))
    if (Path(data) / MANIFEST_NAME).is_file():
        return read_manifest(data)["seq_len"]
    if config.phase(phase).seq_len:
        return config.phase(phase).seq_len
    raise ConfigError(f"phase{phase}.seq_len: {data} is not prepared yet, so set the sequence "
                      f"length to plan with (e.g. phase{phase}.seq_len=2048)")


def preference_of(config: RunConfig, phase: int) -> PreferenceConfig | None:
    """The phase's preference settings when its prepared data is preference pairs, else None (data
    not prepared yet is planned as next-token data)."""
    data = next(iter(config.data_dirs(phase).values()))
    if (Path(data) / MANIFEST_NAME).is_file() and read_manifest(data).get("phase") == PREFERENCE:
        return config.phase(phase).preference
    return None


def planned_generation(config: RunConfig) -> str:
    """The generation of tpu.type: the TPU the attention kernels are judged for, with the tested
    install (`pip install -e '.[tpu]'`), whatever machine preflight runs on."""
    try:
        return parse_tpu_type(config.tpu.type).generation.name
    except ValueError as err:
        raise ConfigError(str(err)) from None


def planned_dp_processes(config: RunConfig, mode: str) -> int:
    """The processes a dp run on tpu.type starts (one per chip; one with parallel.single_chip);
    1 under fsdp (one SPMD process per host, which is not what the count is for)."""
    if mode != "dp" or config.parallel.single_chip:
        return 1
    return parse_tpu_type(config.tpu.type).chips


def measured_figures(config: RunConfig) -> dict | None:
    """The chip's figures a TPU self-check wrote for this output_dir (mfu, compile_s_fixed and
    compile_s_per_layer, or compile_s_scanned), when it ran on the generation tpu.type plans for;
    else None."""
    path = RunLayout(config.output_dir).tpu_check
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    if not report.get("measured") or report.get("device") != "TPU":
        return None
    try:
        same = parse_tpu_type(report["tpu_type"]).generation == parse_tpu_type(config.tpu.type).generation
    except ValueError:
        return None
    return {**report["measured"], "source": str(path), "checked_at": report["checked_at"]} if same else None


def plan_inputs(config: RunConfig, phase: int, mode: str | None = None, devices: int | None = None,
                model_config=None, devices_from: str | None = None) -> PlanInputs:
    """The plan's inputs from the config; `devices` (the slice's chips, or the GPUs) resolves
    parallel.mesh, `model_config` the loss chunk; `devices_from`: the keys that gave `devices`, for
    a mesh that does not divide them (tpu.type's by default)."""
    fsdp_axis = config.parallel.mesh.fsdp
    loss_chunk, attention, attention_reason = 0, "dense", ""
    if model_config is not None:
        try:
            loss_chunk = resolve_chunk_tokens(config.train.loss_chunk_tokens, model_config)
            attention, attention_reason = choose_attention(
                config.model.attention, model_config, tpu=planned_generation(config),
                spmd_mesh=(mode or config.parallel.mode) == "fsdp", seq_len=seq_len_of(config, phase),
                dp_processes=planned_dp_processes(config, mode or config.parallel.mode))
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if devices is not None and (mode or config.parallel.mode) == "fsdp":
        try:
            fsdp_axis = mesh_shape(devices, config.parallel.mesh.data, config.parallel.mesh.fsdp)[1]
        except ValueError as err:
            raise ConfigError(f"{err} ({devices_from or f'tpu.type={config.tpu.type}'})") from None
    # The chip's own figures when make tpu-check measured them on this generation, else the config's.
    measured = measured_figures(config) or {}
    preference = preference_of(config, phase)
    if preference is not None:
        loss_chunk = 0  # a preference phase builds its full logits (model/preference_loss.py)
    return PlanInputs(mode=mode or config.parallel.mode, dtype=config.model.dtype, micro_batch=config.train.micro_batch,
                      grad_accum=config.train.grad_accum, seq_len=seq_len_of(config, phase),
                      checkpointing=checkpointing_mode(config.model.activation_checkpointing) or False,
                      lora_r=config.lora.r,
                      lora_targets=list(config.lora.target_modules), lora_dropout=config.lora.dropout,
                      steps=config.max_steps(phase), adapters=max(1, len(config.phase(phase).adapters)),
                      quantize=config.model.quantize, fsdp_axis=fsdp_axis, loss_chunk=loss_chunk,
                      attention=attention, attention_reason=attention_reason,
                      capture_step=config.train.capture_step,
                      scanned_layers=model_config is not None and layers_scanned(config, model_config, mode),
                      assumed_mfu=measured.get("mfu", config.tpu.assumed_mfu),
                      compile_s_per_layer=measured.get("compile_s_per_layer", config.tpu.compile_s_per_layer),
                      compile_s_fixed=measured.get("compile_s_fixed", config.tpu.compile_s_fixed),
                      compile_s_scanned=measured.get("compile_s_scanned", config.tpu.compile_s_scanned),
                      rows_per_item=2 if preference is not None else 1,
                      reference_forward=preference is not None and not preference.precompute_reference,
                      **trained_embeddings(config, model_config))


def trained_embeddings(config: RunConfig, model_config) -> dict:
    """PlanInputs' embedding_params, output_layer_trained and new_token_rows_params: the weights
    trained beside the LoRA (lora.modules_to_save's embed_tokens and lm_head whole, a tied pair
    once; lora.trainable_token_indices' rows; by default the new tokens' rows), from the config
    alone (the vocabulary grown by model.new_tokens at most)."""
    if model_config is None:
        return {}
    hidden, lora = model_config.hidden_size, config.lora
    vocab = model_config.vocab_size + len(config.model.new_tokens)
    tied = bool(getattr(model_config, "tie_word_embeddings", False))
    saved = {name.rsplit(".", 1)[-1] for name in lora.modules_to_save or []}
    whole = {"embed_tokens", "lm_head"} & saved
    if tied and whole:
        whole = {"embed_tokens"}  # one weight: the pair trained once
    rows_each = 1 if tied else 2
    new_rows = len(config.model.new_tokens) * hidden * rows_each
    rows = lora.trainable_token_indices
    if rows is None:
        row_params = 0 if lora.modules_to_save else new_rows
    elif isinstance(rows, dict):
        shared = [name for name in rows if tied and name.endswith("lm_head")]  # a tied output layer's: the embedding's
        row_params = sum(len(ids) for name, ids in rows.items() if name not in shared) * hidden
    else:
        row_params = len(rows) * hidden  # a list: the input embedding's rows (PEFT's; a tied head shares them)
    return {"embedding_params": len(whole) * vocab * hidden + row_params,
            "output_layer_trained": "lm_head" in saved or (tied and bool(whole)), "new_token_rows_params": new_rows}


def layers_scanned(config: RunConfig, model_config, mode: str | None = None) -> bool:
    """Whether the trainer will scan this model's decoder layers (train.scan_layers, asked of a
    weightless model of the architecture as the trainer asks its model; true where they cannot
    be is a ConfigError here)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return scan_decision(model, config.train.scan_layers, (mode or config.parallel.mode) == "fsdp") is None


def one_after_another(config: RunConfig, phase: int, shape, tpu, inputs: PlanInputs, together: dict,
                      model_config, memory=tpu_memory) -> dict:
    """Adapters side by side against the same adapters trained one after another, each a run of
    its own steps with a compile of its own: the TPU-hours side by side saves. The plan's step
    time is its FLOPs at the assumed MFU, which side by side does not change per token, so what
    it saves here are the compiles (and model loads, not counted); the base's weights read once
    for K adapters per step are not credited (`make bench-side-by-side` measures that on a CPU)."""
    # Alone, an adapter's layers may be scanned (XLA's plan; the native runtime scans none).
    scanned = memory is tpu_memory and layers_scanned(config, model_config)
    alone = [plan(shape, tpu, dataclasses.replace(inputs, adapters=1, steps=config.adapter_max_steps(phase, name),
                                                  scanned_layers=scanned), memory)
             for name in config.phase(phase).adapters]
    hours = round(sum(p["tpu_hours"] for p in alone), 3)
    return {"tpu_hours": hours, "tpu_hours_saved": round(hours - together["tpu_hours"], 3),
            "hbm_per_chip_gib": max(p["hbm_per_chip_gib"] for p in alone)}


ATTENTION_ON_A_GPU = {
    "sdpa": "torch's scaled_dot_product_attention (keeps no [heads, seq_len] scores)",
    "eager": "eager, as transformers runs this model (its soft-capping): [heads, seq_len] scores kept per token",
}


def gpu_plan_inputs(config: RunConfig, phase: int, devices: int, model_config, shape: ModelShape) -> PlanInputs:
    """The plan's inputs for the native runtime on gpu.type: plan_inputs' with the GPU's figures
    (gpu.assumed_mfu, gpu.compile_s: the layers share one compiled graph) and the attention
    transformers runs for the model (torch's kernel, or eager where it picks that)."""
    try:
        loss_chunk = resolve_chunk_tokens(config.train.loss_chunk_tokens, model_config)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if preference_of(config, phase) is not None:
        loss_chunk = 0  # a preference phase builds its full logits (model/preference_loss.py)
    return dataclasses.replace(
        plan_inputs(config, phase, devices=devices, devices_from=f"gpu.count={config.gpu.count}"),
        loss_chunk=loss_chunk, attention=shape.attn_implementation,
        attention_reason=ATTENTION_ON_A_GPU.get(shape.attn_implementation, shape.attn_implementation),
        assumed_mfu=config.gpu.assumed_mfu, compile_s_fixed=config.gpu.compile_s, compile_s_per_layer=0.0,
        capture_step=True, scanned_layers=False)


def make_plan(config: RunConfig, model_config, gpu: bool = False) -> dict:
    """The plan of every phase plus the totals preflight.json promises at its top level: on
    tpu.type's TPU, or with `gpu` (the runtime's Backend.plans_gpu) on gpu.type's GPUs (gpu_plan.py)."""
    shape = ModelShape.from_config(model_config)
    try:  # gpu.type is checked whichever is planned: a card it does not know is named, never passed over
        gpus = parse_gpu_type(config.gpu.type, config.gpu.count)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    machine, memory = (gpus, native_memory) if gpu else (parse_tpu_type(config.tpu.type), tpu_memory)
    phases = {}
    for phase in phases_of(config):
        inputs = (gpu_plan_inputs(config, phase, machine.devices, model_config, shape) if gpu
                  else plan_inputs(config, phase, devices=machine.devices, model_config=model_config))
        phases[f"phase{phase}"] = plan(shape, machine, inputs, memory)
        phases[f"phase{phase}"]["parallel_advice"] = (native_mode_advice(shape, machine, inputs) if gpu
                                                      else mode_advice(shape, machine, inputs))
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
            phases[f"phase{phase}"]["to_fit"] = suggestions(shape, machine, inputs, memory)
        if inputs.adapters > 1:
            phases[f"phase{phase}"]["one_after_another"] = one_after_another(config, phase, shape, machine, inputs,
                                                                            phases[f"phase{phase}"], model_config,
                                                                            memory)
    first = next(iter(phases.values()))
    return {
        "target": "gpu" if gpu else "tpu",  # what the memory, hours and figures below are of
        "device_type": machine.type,
        "tpu_type": config.tpu.type,
        "parallel_mode": config.parallel.mode,
        "fits": all(p["fits"] for p in phases.values()),
        "hbm_per_chip_gib": max(p["hbm_per_chip_gib"] for p in phases.values()),
        "hbm_capacity_gib": first["hbm_capacity_gib"],
        "step_time_s": first["step_time_s"],
        "tokens_per_sec": first["tokens_per_sec"],
        "tpu_hours": round(sum(p["tpu_hours"] for p in phases.values()), 3),
        # (the phases' hours times the devices, not the sum of each phase's rounded figure)
        "chip_hours": round(sum(p["tpu_hours"] for p in phases.values()) * machine.chips, 2),
        "assumed_mfu": first["inputs"]["assumed_mfu"],
        "chip_figures": None if gpu else measured_figures(config),  # None: the config's assumed figures
        "max_wall_time": config.train.max_wall_time,
        "phases": phases,
    }
