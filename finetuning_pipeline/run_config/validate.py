"""What a setting's type cannot say: the domain of every number, and the settings that
depend on each other. Needs no files; `finetuning_pipeline.run.input_checks` checks the
model, data and outputs a config names."""

from __future__ import annotations

import dataclasses
import math
import re

from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.run_config.schema import RunConfig
from utils.durations import parse_duration


def non_finite_settings(node, prefix: str = "") -> list[tuple[str, float]]:
    """(key, value) of every float setting (in lists too) that is NaN or infinite: a NaN passes
    every `<` check (a NaN clip norm would switch clipping off), so finiteness comes first."""
    found = []
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            found += non_finite_settings(value, f"{key}.")
        elif isinstance(node, RunConfig) and f.name == "phases":
            for number, phase in enumerate(value, start=1):
                found += non_finite_settings(phase, f"phase{number}.")
        elif isinstance(value, dict):  # named sections (phaseN.adapters)
            for name, section in value.items():
                found += non_finite_settings(section, f"{key}.{name}.")
        elif isinstance(value, list):
            found += [(f"{key}[{i}]", v) for i, v in enumerate(value) if isinstance(v, float) and not math.isfinite(v)]
        elif isinstance(value, float) and not math.isfinite(value):
            found.append((key, value))
    return found


def validate(config: RunConfig) -> None:
    """Checks that need no files (the choices of Literal settings are checked as the config is
    built, load.py); `run.input_checks` adds the ones that do. Every numeric setting is checked
    for its domain here, before any device is touched."""
    for key, value in non_finite_settings(config)[:1]:
        raise ConfigError(f"{key} must be a finite number, got {value}")
    if not config.output_dir.strip():
        raise ConfigError("output_dir: empty; set a directory for the run's outputs (e.g. outputs/run1): an empty "
                          "one would write into the current directory")
    if not config.model.path.strip():
        raise ConfigError("model.path: not set; set it to a local Hugging Face model directory (config.json, weights "
                          "and tokenizer files) or a Hub id such as google/gemma-3-270m")
    t = config.train
    positive = {
        "train.max_steps": t.max_steps, "train.micro_batch": t.micro_batch, "train.grad_accum": t.grad_accum,
        "train.warmup_steps": t.warmup_steps, "checkpoint.keep": config.checkpoint.keep,
        "logging.every": config.logging.every, "train.max_bad_steps": t.max_bad_steps,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    for key, value in {"eval.every": config.eval.every, "checkpoint.every": config.checkpoint.every,
                       "train.max_grad_norm": t.max_grad_norm, "train.weight_decay": t.weight_decay}.items():
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")
    if t.max_wall_time is not None:
        try:
            if parse_duration(t.max_wall_time) <= 0:
                raise ValueError(f"train.max_wall_time must be positive, got {t.max_wall_time!r}")
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if t.embedding_lr is not None and not t.embedding_lr > 0:
        raise ConfigError(f"train.embedding_lr must be > 0 (unset: the phase's lr), got {t.embedding_lr}")
    embeddings = config.lora.modules_to_save or config.lora.trainable_token_indices is not None
    if t.embedding_lr is not None and not (embeddings or config.model.new_tokens):
        raise ConfigError(f"train.embedding_lr={t.embedding_lr}: the learning rate of lora.modules_to_save, "
                          "lora.trainable_token_indices and model.new_tokens' rows, and none is set; set one (e.g. "
                          "lora.modules_to_save=[embed_tokens,lm_head]) or unset it")
    if (embeddings or config.model.new_tokens) and any(phase.adapters for phase in config.phases):
        raise ConfigError("lora.modules_to_save, lora.trainable_token_indices or model.new_tokens with adapters "
                          "side by side (phaseN.adapters): each adapter would need its own copy of the embeddings; "
                          "train such adapters one at a time")
    if t.loss_chunk_tokens is not None and t.loss_chunk_tokens < 0:
        raise ConfigError(f"train.loss_chunk_tokens must be >= 0 (0: full logits), got {t.loss_chunk_tokens}")
    if t.warmup_compiles_steps < 0:
        raise ConfigError(f"train.warmup_compiles_steps must be >= 0, got {t.warmup_compiles_steps}")
    phases = len(config.phases)
    if not 0 <= t.seed < 2**32 - phases:  # numpy's seed range, less the phase number added to it
        raise ConfigError(f"train.seed must be >= 0 and < {2**32 - phases}, got {t.seed}")
    if not t.eps > 0:
        raise ConfigError(f"train.eps must be > 0 (AdamW divides by sqrt(v) + eps), got {t.eps}")
    if config.eval.micro_batch is not None and config.eval.micro_batch < 1:
        raise ConfigError(f"eval.micro_batch must be >= 1 (or unset: train.micro_batch), got {config.eval.micro_batch}")
    if config.eval.max_batches is not None and config.eval.max_batches < 0:
        raise ConfigError(f"eval.max_batches must be >= 0 (0: no evaluation; unset: the whole eval split), "
                          f"got {config.eval.max_batches}")
    if not t.lr > 0:
        raise ConfigError(f"train.lr must be > 0, got {t.lr}")
    if not 0 < t.min_lr_ratio <= 1:
        raise ConfigError(
            f"train.min_lr_ratio must be in (0, 1] (a zero LR costs an extra XLA graph), got {t.min_lr_ratio}"
        )
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        raise ConfigError(f"train.betas must be two numbers in [0, 1), got {t.betas}")
    mesh = config.parallel.mesh
    for key, value in (("parallel.mesh.data", mesh.data), ("parallel.mesh.fsdp", mesh.fsdp)):
        if value == 0 or value < -1:
            raise ConfigError(
                f"{key} must be a chip count >= 1, or -1 for the chips the other axis leaves; got {value}"
            )
    if mesh.data == -1 and mesh.fsdp == -1:
        raise ConfigError("parallel.mesh: at most one of data and fsdp may be -1")
    if config.parallel.single_chip and config.parallel.mode != "dp":
        raise ConfigError("parallel.single_chip: one chip is one replica under parallel.mode=dp; set "
                          "parallel.mode=dp, or leave single_chip false")
    if not config.parallel.host_timeout_s > 0:
        raise ConfigError(f"parallel.host_timeout_s must be > 0, got {config.parallel.host_timeout_s}")
    if not 0 < config.tpu.assumed_mfu <= 1:
        raise ConfigError(f"tpu.assumed_mfu must be in (0, 1], got {config.tpu.assumed_mfu}")
    for key in ("compile_s_per_layer", "compile_s_fixed", "compile_s_scanned"):
        if not getattr(config.tpu, key) >= 0:
            raise ConfigError(f"tpu.{key} must be >= 0, got {getattr(config.tpu, key)}")
    if not 0 < config.gpu.assumed_mfu <= 1:
        raise ConfigError(f"gpu.assumed_mfu must be in (0, 1], got {config.gpu.assumed_mfu}")
    if not config.gpu.compile_s >= 0:
        raise ConfigError(f"gpu.compile_s must be >= 0, got {config.gpu.compile_s}")
    if config.gpu.count < 1:
        raise ConfigError(f"gpu.count must be >= 1, got {config.gpu.count}")
    validate_runtime(config)
    for number in config.phase_numbers():
        phase = config.phase(number)
        if phase.seq_len is not None and phase.seq_len < 2:
            raise ConfigError(f"phase{number}.seq_len must be >= 2, got {phase.seq_len}")
        if phase.max_steps is not None and phase.max_steps < 1:
            raise ConfigError(f"phase{number}.max_steps must be >= 1, got {phase.max_steps}")
        if phase.lr is not None and not phase.lr > 0:
            raise ConfigError(f"phase{number}.lr must be > 0, got {phase.lr}")
        if phase.preference.loss == "orpo" and phase.preference.precompute_reference:
            raise ConfigError(f"phase{number}.preference.precompute_reference: ORPO has no reference; set it to "
                              "false, or another preference.loss")
        if not phase.preference.beta > 0:
            raise ConfigError(f"phase{number}.preference.beta must be > 0 (the reward's temperature; TRL's default "
                              f"is 0.1), got {phase.preference.beta}")
        if phase.adapters:
            validate_side_by_side(config, number)
    for number in config.phase_numbers():
        if not (config.phase(number).data or config.phase(number).adapters):
            continue  # a phase not written (phase 2 of a phase-1-only config) builds on nothing
        merged, continued = config.lineage(number)
        for earlier in merged + ([continued] if continued else []):
            if config.phase(earlier).adapters:
                raise ConfigError(
                    f"phase{number}.init={config.phase(number).init} builds on phase {earlier}'s adapter, but phase "
                    f"{earlier} trains several side by side ({', '.join(config.phase(earlier).adapters)}); set "
                    f"phase{number}.init=fresh (or merge one of them into the base with `export` and train on that)")


def validate_runtime(config: RunConfig) -> None:
    """runtime.*: the settings of the other runtime are refused rather than ignored, and what the
    native runtime cannot do (torch_xla's launcher, scan and Pallas kernels) is refused by name.
    runtime.backend=auto is checked once resolved (finetuning_pipeline/runtime/__init__.py)."""
    r = config.runtime
    if r.backend == "auto":
        return
    if r.backend == "xla":
        for key, value in (("device", r.device), ("compile", r.compile)):
            if value != "auto":
                raise ConfigError(f"runtime.{key}={value} is the native runtime's setting; with runtime.backend=xla "
                                  "PJRT_DEVICE picks the device and the step is always compiled. Set "
                                  f"runtime.backend=native, or leave runtime.{key} auto")
        if config.model.activation_checkpointing == "selective":
            raise ConfigError("model.activation_checkpointing=selective is PyTorch's selective checkpoint, the native "
                              "runtime's; the XLA runtime recomputes whole layers: set it to full (or true), or "
                              "runtime.backend=native")
        return
    p = config.parallel
    if p.launcher == "tpu":
        raise ConfigError("parallel.launcher=tpu is torch_xla's launcher; the native runtime's processes are started "
                          "by torchrun (torchrun --nproc-per-node N finetuning_pipeline/main.py ...); set "
                          "parallel.launcher=auto, or runtime.backend=xla")
    if config.train.scan_layers:
        raise ConfigError("train.scan_layers=true: the layer scan is torch_xla's; the native runtime runs the layer "
                          "loop (runtime.compile=layers compiles each layer); unset train.scan_layers")
    if r.compile == "layers" and config.model.dtype == "float64":
        raise ConfigError("runtime.compile=layers with model.dtype=float64: the float64 proofs run eagerly (a compiled "
                          "layer does not keep utils/precision.py's float64 throughout); set runtime.compile=eager")
    if config.model.attention in ("splash", "flash"):
        raise ConfigError(f"model.attention={config.model.attention}: that Pallas kernel is torch_xla's; the native "
                          "runtime uses the model's own attention; set model.attention=auto or dense")


ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
# A name becomes a directory (its adapter's, and one in every checkpoint), a TensorBoard tag and
# a metrics key: short enough for any file system's 255-byte names with room to spare.
ADAPTER_NAME_MAX = 64


def validate_side_by_side(config: RunConfig, number: int) -> None:
    """A phase of adapters side by side: two or more, named as directories can be, each with its
    own data and its own lr and steps in range; fresh or on a merged base."""
    phase, key = config.phase(number), f"phase{number}.adapters"
    if len(phase.adapters) < 2:
        raise ConfigError(f"{key}: side by side needs two adapters or more, got {list(phase.adapters)}; for one, "
                          f"set phase{number}.data instead")
    if phase.data:
        raise ConfigError(f"phase{number}.data and {key}: one or the other (each adapter side by side has its own "
                          f"data: {key}.<name>.data); remove phase{number}.data")
    if number > 1 and phase.init == "continue":
        raise ConfigError(f"phase{number}.init=continue: adapters side by side start fresh, not from phase "
                          f"{number - 1}'s adapter; set phase{number}.init=fresh, or merge to train them on the base "
                          "with it merged")
    folded = {}
    for name, adapter in phase.adapters.items():
        if not ADAPTER_NAME.fullmatch(name) or len(name) > ADAPTER_NAME_MAX:
            shown = name if len(name) <= ADAPTER_NAME_MAX else f"{name[:20]}... ({len(name)} characters)"
            raise ConfigError(f"{key}.{shown}: an adapter's name is its output directory's: up to {ADAPTER_NAME_MAX} "
                              "letters, digits, _ and -, starting with a letter or digit")
        if name.lower() in folded:
            raise ConfigError(f"{key}: {folded[name.lower()]} and {name} differ only in case, so they would share "
                              "one directory on a case-insensitive disk (macOS, Windows); rename one")
        folded[name.lower()] = name
        if adapter.max_steps is not None and adapter.max_steps < 1:
            raise ConfigError(f"{key}.{name}.max_steps must be >= 1, got {adapter.max_steps}")
        if adapter.lr is not None and not adapter.lr > 0:
            raise ConfigError(f"{key}.{name}.lr must be > 0, got {adapter.lr}")
