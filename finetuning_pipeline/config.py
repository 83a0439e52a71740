"""Run configuration: one documented dataclass per concern, loaded from YAML with dotted
`key=value` overrides, validated before any device is touched.

    cfg = load_config("finetuning_pipeline/configs/demo.yaml", ["train.max_steps=20", "lora.r=4"])

An unknown key, a wrongly typed value or an impossible setting is a `ConfigError` naming the
key (and the file). Override values are parsed as YAML scalars, so `train.lr=3e-4`,
`model.gradient_checkpointing=true` and `lora.target_modules=[q_proj,v_proj]` all work.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.launch import LAUNCHERS
from finetuning_pipeline.parallel import MODES
from finetuning_pipeline.stop_signal import parse_duration
from finetuning_pipeline.wandb_log import MODES as WANDB_MODES
from lora_logic import DEFAULT_TARGET_MODULES, LoraConfig
from utils.yaml_file import read_yaml_mapping

__all__ = ["ConfigError", "RunConfig", "load_config"]


@dataclass
class ModelConfig:
    """path: a local Hugging Face model directory (config.json + weights), or a Hub id
        (`google/gemma-3-270m`: downloaded once into the Hugging Face cache, safetensors and
        tokenizer files only; see utils/hub_models.py).
    revision: a Hub id's branch, tag or commit (default: main). The run pins it to the commit
        it resolves to: the summary records it, and a resume on another commit is refused.
    tokenizer: tokenizer directory; defaults to `path`.
    dtype: weights' dtype on the device: bfloat16 on TPU; float32 for exact CPU tests.
    gradient_checkpointing: recompute activations in backward (less HBM, ~30% more compute).
    attention: "auto" (a Pallas kernel on TPU where it covers the model: splash under
        parallel.mode=fsdp, flash under dp for models without window or soft-cap; dense
        elsewhere, and the log says why), "dense", "splash" or "flash" (TPU only; refused where
        the kernel cannot run the model). See finetuning_pipeline/kernel_attention.py.
    """

    path: str = ""
    revision: str | None = None
    tokenizer: str | None = None
    dtype: str = "bfloat16"
    gradient_checkpointing: bool = False
    attention: str = "auto"


@dataclass
class LoraSection:
    """The LoRA: see `lora_logic.LoraConfig` for each field."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    use_rslora: bool = False


@dataclass
class TrainConfig:
    """Optimisation, shared by both phases unless a phase overrides max_steps or lr.

    max_steps: optimizer steps per phase.
    micro_batch: sequences per replica per forward (the per-chip batch).
    grad_accum: micro-batches per optimizer step; global batch = micro_batch * grad_accum * replicas.
    lr: peak learning rate (AdamW, LoRA parameters only).
    warmup_steps: linear warm-up from lr/warmup_steps (never 0: a zero LR is a separate XLA graph).
    min_lr_ratio: the cosine decay ends at lr * min_lr_ratio (> 0 for the same reason).
    weight_decay, betas, eps: AdamW's.
    max_grad_norm: global gradient-norm clip; 0 disables.
    max_bad_steps: a step whose loss or gradient norm is NaN/inf is skipped on the device
        (adapter and optimizer unchanged) and counted; this many in a row stop the run.
    seed: model init of LoRA weights, dropout and data order.
    max_wall_time: a session budget such as "8h30m" (Kaggle ends sessions at 9 h, Colab sooner,
        without a signal): the run checkpoints and exits 0 before it is spent, and the same
        command continues in the next session. None: no budget.
    loss_chunk_tokens: tokens per chunk of the output projection and loss, so the full
        [tokens, vocab] logits never exist (finetuning_pipeline/chunked_loss.py). None (default):
        about 256 MiB of fp32 logits per chunk for the model types the chunked loss is verified
        on, full logits otherwise; 0: full logits.
    warmup_compiles_steps: steps after which no new graph may compile (the recompile guard);
        a phase compiles two graphs (a training step, an eval batch), both before or in step 1.
    recompile_policy: "error" stops the run at a recompile after warm-up, "warn" logs it.
    capture_step: trace the step once and replay its compiled graph (step_capture.py), with
        the micro-batches in one XLA loop (micro_batch_loop.py): host time per step and compile
        time do not grow with grad_accum. false traces every step (the reference path: the
        same numbers, for debugging).
    scan_layers: run the decoder layers as one XLA loop over their weights stacked once
        (lora_logic/layer_scan.py): one layer is traced and compiled whatever the depth, so
        compile time does not grow with the number of layers. Unset (the default): scanned
        where the model allows it (identical layers, no dropout of the model's own,
        parallel.mode dp) and has 16 layers or more, the layer loop otherwise, and the log
        says why; true: scanned or an error saying why not (preflight says it too); false:
        the layer loop. Checkpoints and adapters are the same either way (a run may resume
        with the other setting).
    """

    max_steps: int = 100
    micro_batch: int = 4
    grad_accum: int = 1
    lr: float = 2e-4
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    max_bad_steps: int = 10
    seed: int = 0
    loss_chunk_tokens: int | None = None
    max_wall_time: str | None = None
    warmup_compiles_steps: int = 1
    recompile_policy: str = "error"
    capture_step: bool = True
    scan_layers: bool | None = None


@dataclass
class EvalConfig:
    """every: eval every N optimizer steps (and always at the start and end of a phase); 0: only those.
    micro_batch: eval batch per replica; defaults to train.micro_batch.
    max_batches: cap on eval batches per replica (None: the whole eval split; 0: no evaluation,
        reported as "no eval data", never as a loss)."""

    every: int = 0
    micro_batch: int | None = None
    max_batches: int | None = None


@dataclass
class CheckpointConfig:
    """every: save every N optimizer steps (and at the end of each phase); 0: only at the end.
    keep: how many complete checkpoints to keep per phase (the newest is never deleted)."""

    every: int = 0
    keep: int = 2


@dataclass
class WandbConfig:
    """Weights & Biases (optional: `pip install 'tpu-lora[wandb]'`; see wandb_log.py).
    project: set it to log each phase as a W&B run there (the same records as metrics.jsonl,
        the config, the summary); unset (default): no W&B.
    entity, name: the W&B entity, and the run name's stem (default: output_dir's name).
    mode: online, offline or disabled; default: W&B's own (WANDB_MODE)."""

    project: str | None = None
    entity: str | None = None
    name: str | None = None
    mode: str | None = None


@dataclass
class LoggingConfig:
    """every: log loss, lr, grad norm, tokens/s every N steps (through a step closure, no sync).
    tensorboard: also write TensorBoard events under output_dir/phaseN/tb.
    progress_bar: a tqdm bar on the master process.
    wandb: Weights & Biases, off unless wandb.project is set."""

    every: int = 10
    tensorboard: bool = True
    progress_bar: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class MeshConfig:
    """The SPMD mesh of parallel.mode=fsdp: data x fsdp = every chip of the run; -1 takes the
    chips the other axis leaves. The frozen base is sharded over `fsdp` (each chip holds 1/fsdp
    of every matrix) and the batch over both axes. fsdp=-1 (default): shard over every chip,
    for models that do not fit one chip. data=-1 fsdp=1: pure data parallelism in one SPMD
    process per host (one compile per host; Pallas splash attention needs this mesh)."""

    data: int = 1
    fsdp: int = -1


@dataclass
class ParallelConfig:
    """mode: "dp": one process per chip, each with the whole model, gradients all-reduced (for
    models that fit one chip's HBM). "fsdp": one SPMD process per host over a (data, fsdp)
    mesh of every chip (see mesh). Both give the same steps for the same global batch; see
    finetuning_pipeline/parallel.py and the README for which to choose.
    host_timeout_s: how long a replica waits for the others at a host collective (a stop
    vote, a checkpoint) before it gives up and exits (a hung peer; a dead one fails at once).
    launcher: how the replicas are started (finetuning_pipeline/launch.py). "auto": the TPU
    host's way on a TPU (a process per chip, a replica thread per device), this process (or
    torchrun's processes) on a CPU. "tpu": the TPU host's way on a CPU too, the rehearsal of a
    TPU run (CPU_NUM_DEVICES=2: two replica threads in one process, as on TPU v2/v3).
    "process": this process is the one replica.
    single_chip: train on one chip of a multi-chip host (chip 0), one replica: sets the
    environment torch_xla and libtpu read (TPU_VISIBLE_CHIPS=0, TPU_PROCESS_BOUNDS=1,1,1,
    TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1; a value you exported wins). On a CPU: one device."""

    mode: str = "dp"
    mesh: MeshConfig = field(default_factory=MeshConfig)
    host_timeout_s: float = 1800.0
    launcher: str = "auto"
    single_chip: bool = False


@dataclass
class XlaConfig:
    """compile_cache_dir: XLA's persistent compilation cache, so a restarted or resumed run (a
    preempted spot VM) loads its compiled graphs instead of compiling them again. "auto":
    ~/.cache/tpu-lora/xla (XDG_CACHE_HOME respected) on TPU, off on XLA:CPU (it cannot load
    its entries there); "" turns it off; a path turns it on. Each process gets its own
    subdirectory, keyed by torch_xla version, device type and parallel mode."""

    compile_cache_dir: str = "auto"


@dataclass
class TpuConfig:
    """What `python -m finetuning_pipeline.preflight` plans for (training itself uses whatever
    devices it finds).
    type: the accelerator type as gcloud names it, e.g. v5e-8, v6e-8, v5p-16, v4-32.
    assumed_mfu: the fraction of peak bf16 FLOP/s the plan assumes a step reaches.
    compile_s_per_layer: seconds to compile a phase's graphs per decoder layer, which the plan
        adds to every session (a warm xla.compile_cache_dir loads them instead). The default is
        what `make bench-host` measured on XLA:CPU for the layer loop (13.1 s for 32 layers); a
        TPU run's summary reports compile_seconds: divide by the layers and set it here.
    compile_s_scanned: the same for a run whose decoder layers are scanned (train.scan_layers:
        one layer compiled whatever the depth), per phase and session; the default is what
        `make bench-host` measured on XLA:CPU; a TPU run's summary compile_seconds sets it."""

    type: str = "v5e-8"
    assumed_mfu: float = 0.4
    compile_s_per_layer: float = 0.41
    compile_s_scanned: float = 2.8


@dataclass
class PhaseConfig:
    """data: a directory written by `python -m dataset.prepare` for this phase.
    seq_len: the sequence length the data is prepared at (optional): checked against the data's
        manifest, and what preflight plans with before the data exists.
    max_steps, lr: override train.max_steps / train.lr for this phase.
    init (phase 2 only): "continue" trains the phase-1 adapter further; "merge" merges it into
    the base weights and starts a fresh adapter; "fresh" starts a fresh adapter on the
    untouched base (instruction tuning only)."""

    data: str = ""
    seq_len: int | None = None
    max_steps: int | None = None
    lr: float | None = None
    init: str = "continue"


@dataclass
class RunConfig:
    output_dir: str = "outputs/run"
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraSection = field(default_factory=LoraSection)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    tpu: TpuConfig = field(default_factory=TpuConfig)
    xla: XlaConfig = field(default_factory=XlaConfig)
    phase1: PhaseConfig = field(default_factory=PhaseConfig)
    phase2: PhaseConfig = field(default_factory=PhaseConfig)

    def lora_config(self) -> LoraConfig:
        return LoraConfig(**dataclasses.asdict(self.lora))

    def phase(self, number: int) -> PhaseConfig:
        return self.phase1 if number == 1 else self.phase2

    def max_steps(self, number: int) -> int:
        return self.phase(number).max_steps or self.train.max_steps

    def lr(self, number: int) -> float:
        return self.phase(number).lr or self.train.lr

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def exactness_keys(self, phase: int) -> dict:
        """The settings a resumed phase must share with the run that saved the checkpoint for
        the result to equal an uninterrupted run's (logging, eval and checkpoint cadence may change).
        micro_batch and grad_accum may change with the number of chips as long as the global
        batch stays the same: the trainer checks that product itself."""
        flat = {"model.path": self.model.path, "model.revision": self.model.revision, "model.dtype": self.model.dtype}
        flat.update({f"lora.{k}": v for k, v in dataclasses.asdict(self.lora).items()})
        skip = {"warmup_compiles_steps", "recompile_policy", "max_bad_steps", "micro_batch", "grad_accum",
                "max_wall_time", "capture_step", "scan_layers"}
        flat.update({f"train.{k}": v for k, v in dataclasses.asdict(self.train).items() if k not in skip})
        phase_cfg = dataclasses.asdict(self.phase(phase))
        if phase == 1:
            phase_cfg.pop("init")
        flat.update({f"phase{phase}.{k}": v for k, v in phase_cfg.items()})
        return flat


DTYPES = ("float32", "bfloat16", "float16")


# -- building from plain data, with keys named in every error ---------------------------------
def _coerce(value, annotation, key: str):
    """Check `value` against a field's annotation; ints are accepted where floats are expected."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        try:  # PyYAML reads "3e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if annotation in (int, float, str, bool):
        if not isinstance(value, annotation) or (annotation is int and isinstance(value, bool)):
            raise ConfigError(f"{key}: expected {annotation.__name__}, got {value!r}")
        return value
    return value


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]}; known keys under {prefix or 'the top level'}: {sorted(known)}")
    kwargs = {}
    for name, value in data.items():
        annotation = hints[name]
        if dataclasses.is_dataclass(annotation):
            kwargs[name] = _build(annotation, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, annotation, f"{prefix}{name}")
    return cls(**kwargs)


def apply_override(data: dict, override: str) -> None:
    """Apply one `dotted.key=value` to the nested dict `data` (value parsed as YAML)."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r}: expected key=value, e.g. train.max_steps=100")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    parts = key.split(".")
    node = data
    cls = RunConfig
    for depth, part in enumerate(parts):
        names = {f.name: f for f in dataclasses.fields(cls)}
        if part not in names:
            where = ".".join(parts[:depth]) or "the top level"
            raise ConfigError(f"override {key}: unknown key {part!r} under {where}; known: {sorted(names)}")
        annotation = typing.get_type_hints(cls)[part]
        if depth == len(parts) - 1:
            node[part] = value
        else:
            if not dataclasses.is_dataclass(annotation):
                raise ConfigError(f"override {key}: {'.'.join(parts[: depth + 1])} is not a section")
            node = node.setdefault(part, {})
            cls = annotation


def read_config_file(path: str | Path) -> dict:
    """The YAML mapping in `path`; every way a file can fail to be one is a ConfigError naming it."""
    data = read_yaml_mapping(path, ConfigError, "a mapping of sections (model:, train:, ...)")
    if data is None:
        raise ConfigError(f"{path}: the config is empty; start from one in finetuning_pipeline/configs/ "
                          "(at least model.path and phase1.data / phase2.data)")
    return data


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """The validated RunConfig from a YAML file (or defaults) and dotted overrides."""
    data = read_config_file(path) if path is not None else {}
    try:
        for override in overrides:
            apply_override(data, override)
        config = _build(RunConfig, data, "")
        validate(config)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}" if path else str(err)) from None
    return config


def non_finite_settings(node, prefix: str = "") -> list[tuple[str, float]]:
    """(key, value) of every float setting (in lists too) that is NaN or infinite: a NaN passes
    every `<` check (a NaN clip norm would switch clipping off), so finiteness comes first."""
    found = []
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            found += non_finite_settings(value, f"{key}.")
        elif isinstance(value, list):
            found += [(f"{key}[{i}]", v) for i, v in enumerate(value) if isinstance(v, float) and not math.isfinite(v)]
        elif isinstance(value, float) and not math.isfinite(value):
            found.append((key, value))
    return found


def validate(config: RunConfig) -> None:
    """Checks that need no files; `preflight_checks` in main.py adds the ones that do. Every
    numeric setting is checked for its domain here, before any device is touched."""
    for key, value in non_finite_settings(config)[:1]:
        raise ConfigError(f"{key} must be a finite number, got {value}")
    if not config.output_dir.strip():
        raise ConfigError("output_dir: empty; set a directory for the run's outputs (e.g. outputs/run1): an empty "
                          "one would write into the current directory")
    if not config.model.path.strip():
        raise ConfigError("model.path: not set; set it to a local Hugging Face model directory (config.json, weights "
                          "and tokenizer files) or a Hub id such as google/gemma-3-270m")
    if config.logging.wandb.mode not in (None, *WANDB_MODES):
        raise ConfigError(f"logging.wandb.mode: must be {', '.join(WANDB_MODES[:-1])} or {WANDB_MODES[-1]}, got "
                          f"{config.logging.wandb.mode!r}")
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
    if t.loss_chunk_tokens is not None and t.loss_chunk_tokens < 0:
        raise ConfigError(f"train.loss_chunk_tokens must be >= 0 (0: full logits), got {t.loss_chunk_tokens}")
    if t.warmup_compiles_steps < 0:
        raise ConfigError(f"train.warmup_compiles_steps must be >= 0, got {t.warmup_compiles_steps}")
    if not 0 <= t.seed < 2**32 - 2:  # numpy's seed range, less the phase number added to it
        raise ConfigError(f"train.seed must be >= 0 and < {2**32 - 2}, got {t.seed}")
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
        raise ConfigError(f"train.min_lr_ratio must be in (0, 1] (a zero LR costs an extra XLA graph), got {t.min_lr_ratio}")
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        raise ConfigError(f"train.betas must be two numbers in [0, 1), got {t.betas}")
    if t.recompile_policy not in ("error", "warn"):
        raise ConfigError(f"train.recompile_policy must be 'error' or 'warn', got {t.recompile_policy!r}")
    if config.model.attention not in ("auto", "dense", "splash", "flash"):
        raise ConfigError(f"model.attention must be auto, dense, splash or flash, got {config.model.attention!r}")
    if config.model.dtype not in DTYPES:
        raise ConfigError(f"model.dtype must be one of {list(DTYPES)}, got {config.model.dtype!r}")
    if config.parallel.mode not in MODES:
        raise ConfigError(f"parallel.mode must be 'dp' or 'fsdp', got {config.parallel.mode!r}")
    mesh = config.parallel.mesh
    for key, value in (("parallel.mesh.data", mesh.data), ("parallel.mesh.fsdp", mesh.fsdp)):
        if value == 0 or value < -1:
            raise ConfigError(f"{key} must be a chip count >= 1, or -1 for the chips the other axis leaves; got {value}")
    if mesh.data == -1 and mesh.fsdp == -1:
        raise ConfigError("parallel.mesh: at most one of data and fsdp may be -1")
    if config.parallel.launcher not in LAUNCHERS:
        raise ConfigError(f"parallel.launcher must be one of {', '.join(LAUNCHERS)}, got {config.parallel.launcher!r}")
    if config.parallel.single_chip and config.parallel.mode != "dp":
        raise ConfigError("parallel.single_chip: one chip is one replica under parallel.mode=dp; set "
                          "parallel.mode=dp, or leave single_chip false")
    if not config.parallel.host_timeout_s > 0:
        raise ConfigError(f"parallel.host_timeout_s must be > 0, got {config.parallel.host_timeout_s}")
    if not 0 < config.tpu.assumed_mfu <= 1:
        raise ConfigError(f"tpu.assumed_mfu must be in (0, 1], got {config.tpu.assumed_mfu}")
    for key in ("compile_s_per_layer", "compile_s_scanned"):
        if not getattr(config.tpu, key) >= 0:
            raise ConfigError(f"tpu.{key} must be >= 0, got {getattr(config.tpu, key)}")
    if config.phase2.init not in ("continue", "merge", "fresh"):
        raise ConfigError(f"phase2.init must be 'continue', 'merge' or 'fresh', got {config.phase2.init!r}")
    for number in (1, 2):
        phase = config.phase(number)
        if phase.seq_len is not None and phase.seq_len < 2:
            raise ConfigError(f"phase{number}.seq_len must be >= 2, got {phase.seq_len}")
        if phase.max_steps is not None and phase.max_steps < 1:
            raise ConfigError(f"phase{number}.max_steps must be >= 1, got {phase.max_steps}")
        if phase.lr is not None and not phase.lr > 0:
            raise ConfigError(f"phase{number}.lr must be > 0, got {phase.lr}")
    try:
        config.lora_config()
    except ValueError as err:
        raise ConfigError(str(err)) from None
