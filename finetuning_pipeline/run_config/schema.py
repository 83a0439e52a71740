"""The run configuration's schema: one documented dataclass per section, and the choices a
setting can take as `Literal` types. A leaf: it imports no runtime module (torch, torch_xla,
the trainer), so reading and checking a config is cheap and safe anywhere; `load.py` builds it
from YAML and overrides, `validate.py` checks what a type cannot say.

    cfg = load_config("finetuning_pipeline/configs/demo.yaml", ["train.max_steps=20", "lora.r=4"])
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal

from lora_logic.config import DEFAULT_ADAPTER, LoraConfig

Dtype = Literal["bfloat16", "float32", "float16", "float64"]
Attention = Literal["auto", "dense", "splash", "flash"]
Quantize = Literal["none", "q8_0", "q4_0", "nf4"]
Checkpointing = Literal[False, True, "full", "selective"]
RecompilePolicy = Literal["error", "warn"]
WandbMode = Literal["online", "offline", "disabled"]
ParallelMode = Literal["dp", "fsdp"]
Launcher = Literal["auto", "tpu", "process"]
PhaseInit = Literal["continue", "merge", "fresh"]
PreferenceLoss = Literal["sigmoid", "ipo", "hinge", "orpo"]
PreferenceReference = Literal["auto", "base"]
Backend = Literal["auto", "xla", "native"]
NativeDevice = Literal["auto", "cpu", "cuda", "tpu"]
NativeCompile = Literal["auto", "layers", "eager"]


@dataclass
class ModelConfig:
    """path: a local Hugging Face model directory (config.json + weights), or a Hub id
        (`google/gemma-3-270m`: downloaded once into the Hugging Face cache, safetensors and
        tokenizer files only; see utils/hub_models.py).
    revision: a Hub id's branch, tag or commit (default: main). The run pins it to the commit
        it resolves to: the summary records it, and a resume on another commit is refused.
    tokenizer: tokenizer directory; defaults to `path`.
    dtype: weights' dtype on the device: bfloat16 on TPU; float32 for exact CPU tests; float64
        for the tests' equality proofs on a CPU (the LoRA and the loss then float64 too; a TPU
        refuses it).
    activation_checkpointing: recompute each decoder layer's activations in the backward (less
        memory, more compute): false (default); "full" (or true) recomputes the whole layer;
        "selective" (native runtime only) keeps its attention kernel's outputs and recomputes the
        rest (a little more memory than full, no attention recompute). `model.gradient_checkpointing`, its old
        name, is accepted. See finetuning_pipeline/model/activation_checkpointing.py.
    attention: "auto" (a Pallas kernel on TPU where it covers the model: splash under
        parallel.mode=fsdp, flash under dp for models without window or soft-cap; dense
        elsewhere, and the log says why), "dense", "splash" or "flash" (TPU only; refused where
        the kernel cannot run the model). See finetuning_pipeline/runtime/xla/kernel_attention.py.
    quantize: store the frozen base's decoder Linears block-quantized under the LoRA (QLoRA), so a
        7B-9B model fits one 16 GiB chip: "none" (default), "q8_0" or "q4_0" (ggml's formats, the
        values llama.cpp serves from a GGUF of that type) or "nf4" (QLoRA's). Embeddings, LM head
        and norms stay in `dtype`; the LoRA's A and B stay fp32. See lora_logic/quantize.py.
    new_tokens: tokens the tokenizer lacks (a new language's words, special markers), added after
        its vocabulary, as `dataset.prepare --new-tokens` adds them to the data's: their embedding
        and output rows start at the mean of the others' (finetuning_pipeline/model/new_tokens.py)
        and train beside the LoRA (lora.trainable_token_indices defaults to them, unless
        lora.modules_to_save trains the whole matrices); each phase's adapter holds the extended
        tokenizer. [] (default): none.
    """

    path: str = ""
    revision: str | None = None
    tokenizer: str | None = None
    dtype: Dtype = "bfloat16"
    activation_checkpointing: Checkpointing = False
    attention: Attention = "auto"
    quantize: Quantize = "none"
    new_tokens: list[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    """Optimisation, shared by every phase unless a phase overrides max_steps or lr.

    max_steps: optimizer steps per phase.
    micro_batch: sequences per replica per forward (the per-chip batch).
    grad_accum: micro-batches per optimizer step; global batch = micro_batch * grad_accum * replicas.
    lr: peak learning rate (AdamW, LoRA parameters only).
    embedding_lr: the peak learning rate of the modules trained in full beside the LoRA
        (lora.modules_to_save: the embeddings and output layer), on the same schedule; None: the
        phase's lr. Unsloth's continued-pretraining guide takes it 2-10x smaller than lr.
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
        [tokens, vocab] logits never exist (finetuning_pipeline/model/causal_lm_loss.py). None (default):
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
        (finetuning_pipeline/runtime/xla/layer_scan.py): one layer is traced and compiled whatever the depth, so
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
    embedding_lr: float | None = None
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
    recompile_policy: RecompilePolicy = "error"
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
    mode: WandbMode | None = None


@dataclass
class LoggingConfig:
    """every: log loss, lr, grad norm, tokens/s every N steps (through a step closure, no sync).
    tensorboard: also write TensorBoard events under output_dir/phaseN/tb.
    progress_bar: a tqdm bar on the master process (off: a line per log step instead, for logs and
    notebooks).
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
    finetuning_pipeline/distributed/parallel.py and docs/training.md for which to choose.
    host_timeout_s: how long a replica waits for the others at a host collective (a stop
    vote, a checkpoint) before it gives up and exits (a hung peer; a dead one fails at once).
    launcher: how the replicas are started (finetuning_pipeline/runtime/xla/launch.py). "auto": the TPU
    host's way on a TPU (a process per chip, a replica thread per device), this process (or
    torchrun's processes) on a CPU. "tpu": the TPU host's way on a CPU too, the rehearsal of a
    TPU run (CPU_NUM_DEVICES=2: two replica threads in one process, as on TPU v2/v3).
    "process": this process is the one replica.
    single_chip: train on one chip of a multi-chip host (chip 0), one replica: sets the
    environment torch_xla and libtpu read (TPU_VISIBLE_CHIPS=0, TPU_PROCESS_BOUNDS=1,1,1,
    TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1, and a slice of that one process: CLOUD_TPU_TASK_ID=0,
    TPU_PROCESS_ADDRESSES=localhost:8476; a value you exported wins). On a pod, host 0 alone
    (the others are refused). On a CPU: one device."""

    mode: ParallelMode = "dp"
    mesh: MeshConfig = field(default_factory=MeshConfig)
    host_timeout_s: float = 1800.0
    launcher: Launcher = "auto"
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
class RuntimeConfig:
    """Which runtime executes the steps (finetuning_pipeline/runtime/); everything else (data,
    LoRA, curricula, checkpoints, metrics, export) is the same under both.
    backend: "auto" (default): xla where a TPU is attached or PJRT_DEVICE is set, native where a
        GPU is present and no TPU is, xla elsewhere, native wherever torch_xla is not installed
        (the run's first line says which, and why). "xla": torch_xla over PJRT, the TPU's path
        (PJRT_DEVICE picks the device, the step is captured once and replayed). "native": plain
        PyTorch (eager, or each decoder layer under torch.compile), the path of a GPU and of
        TorchTPU, one process or torchrun's (DDP under parallel.mode=dp, FSDP2 under fsdp); no
        torch_xla is imported.
    device (native only): "auto" (cuda when PyTorch sees a GPU, else cpu), "cpu", "cuda", or
        "tpu": TorchTPU's `tpu` device (the torch-tpu package; refused where it is not installed).
    compile (native only): "layers" compiles each decoder layer with torch.compile (its shared
        LoRA A products kept); "eager" runs without compiling; "auto" (default): layers on an accelerator,
        off on a CPU (where inductor's compile costs more than it saves on a short run)."""

    backend: Backend = "auto"
    device: NativeDevice = "auto"
    compile: NativeCompile = "auto"


@dataclass
class TpuConfig:
    """What `python -m finetuning_pipeline.preflight` plans for (training itself uses whatever
    devices it finds).
    type: the accelerator type as gcloud names it, e.g. v5e-8, v6e-8, v5p-16, v4-32.
    assumed_mfu: the fraction of peak bf16 FLOP/s the plan assumes a step reaches.
    compile_s_per_layer: seconds to compile a phase's graphs per decoder layer, which the plan
        adds to every session (a warm xla.compile_cache_dir loads them instead). The default is
        what `make bench-host` measured on XLA:CPU for the layer loop (13.1 s for 32 layers); a
        TPU run's summary reports compile_seconds: divide by the layers and set it here, or let
        `make tpu-check` measure it (with compile_s_fixed) from compiles of 2 layers and of 1.
    compile_s_fixed: seconds to compile the rest of a phase's graphs (embedding, head, loss,
        optimizer, evaluation), added once to the layers' figure. 0 by default: the default
        per-layer figure was measured on 32 layers and carries this part spread over them.
    compile_s_scanned: the same for a run whose decoder layers are scanned (train.scan_layers:
        one layer compiled whatever the depth), per phase and session; the default is what
        `make bench-host` measured on XLA:CPU; a TPU run's summary compile_seconds sets it."""

    type: str = "v5e-8"
    assumed_mfu: float = 0.4
    compile_s_per_layer: float = 0.41
    compile_s_fixed: float = 0.0
    compile_s_scanned: float = 2.8


@dataclass
class GpuConfig:
    """What `python -m finetuning_pipeline.preflight` plans for under runtime.backend=native on a GPU
    (finetuning_pipeline/planning/gpu_plan.py; training itself uses whatever GPUs it finds).
    type: the card, one of finetuning_pipeline/planning/gpu_cards.py's: h200, h100-80gb,
        a100-80gb, a100-40gb, l40s, l4.
    count: GPUs the run uses (torchrun's processes: --nproc-per-node).
    assumed_mfu: the fraction of the card's peak bf16 FLOP/s the plan assumes a step reaches.
    compile_s: seconds torch.compile takes a session for one decoder layer's graphs (the layers
        share them) and inductor's kernels; an assumption until measured on the card."""

    type: str = "h100-80gb"
    count: int = 1
    assumed_mfu: float = 0.4
    compile_s: float = 60.0


@dataclass
class AdapterConfig:
    """One adapter of a phase that trains several side by side (PhaseConfig.adapters).
    data: its prepared data (as phaseN.data); lr, max_steps: its own, else the phase's, else
    train's. Everything else (the LoRA shape, batch, clipping, schedule shape, seed) is the run's."""

    data: str = ""
    lr: float | None = None
    max_steps: int | None = None


@dataclass
class PreferenceConfig:
    """A preference phase's loss (`phaseN.preference`): a phase is one when its data is preference
    pairs (`dataset.prepare --format preference`); these keys say how it trains on them
    (finetuning_pipeline/model/preference_loss.py: equal to TRL 1.16's DPOTrainer).
    loss: sigmoid (DPO), ipo or hinge, TRL's formulas over each completion's summed log-probability;
        or orpo (TRL's ORPO, reference-free: the chosen rows' next-token loss plus beta times the
        log odds-ratio term).
    beta: the reward's temperature, beta times the log-ratio to the reference (TRL's default 0.1);
        ORPO's lambda.
    reference: "auto", the model the phase starts from: with init continue a frozen copy of the
        adapter it continues (held beside it in the same layers: rank-r matrices, not a second
        model), with merge the merged base, with fresh the base; "base": the phase's base weights
        alone, its adapter switched off (TRL's choice for a new adapter), whatever the init.
    precompute_reference: compute each training pair's reference log-probabilities once, before
        the first step, and keep them with the phase (phaseN/reference_logps.npy, read again by a
        resume): the step then runs no reference forward (train/reference_logps.py)."""

    loss: PreferenceLoss = "sigmoid"
    beta: float = 0.1
    reference: PreferenceReference = "auto"
    precompute_reference: bool = False


@dataclass
class PhaseConfig:
    """One phase of the curriculum, `phaseN:` in the YAML (phase1, phase2, phase3, ...; any
    number of them, run in order; `phaseN.key=value` overrides).
    data: a directory written by `python -m dataset.prepare` for this phase: raw text (every
        token trained on) or chat/instruction data (assistant tokens only), whichever it holds.
    seq_len: the sequence length the data is prepared at (optional): checked against the data's
        manifest, and what preflight plans with before the data exists.
    max_steps, lr: override train.max_steps / train.lr for this phase.
    init (every phase after the first; phase 1 starts a fresh adapter on the base): "continue"
    trains the previous phase's adapter further (its own r/alpha/targets); "merge" merges it
    into the weights it was trained on and starts a fresh adapter there; "fresh" starts a fresh
    adapter on the untouched base. RunConfig.lineage says what a phase is built on.
    adapters: instead of `data`, several named adapters trained side by side in this phase over
    one frozen base (lora_logic/layer.py), each with its own data, lr and max_steps, and
    its own output `phaseN/adapters/<name>/`. Such a phase starts fresh or on a merged base
    (init fresh or merge), and no later phase continues or merges its adapters.
    preference: a preference phase's loss (PreferenceConfig), read where the data is preference pairs."""

    data: str = ""
    seq_len: int | None = None
    max_steps: int | None = None
    lr: float | None = None
    init: PhaseInit = "continue"
    adapters: dict[str, AdapterConfig] = field(default_factory=dict)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)


# The curriculum's sections: phase1, phase2, phase3, ... (RunConfig.phases).
PHASE_SECTION = re.compile(r"phase([1-9][0-9]*)")


def phase_number(section: str) -> int | None:
    """N of a `phaseN` section name; None for any other name."""
    match = PHASE_SECTION.fullmatch(section)
    return int(match.group(1)) if match else None


@dataclass
class RunConfig:
    output_dir: str = "outputs/run"
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # lora_logic's own, fields and checks
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    tpu: TpuConfig = field(default_factory=TpuConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    xla: XlaConfig = field(default_factory=XlaConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    # phase1, phase2, ...: the YAML's `phaseN:` sections in order (load.py): the phases it has,
    # and `--phase all` runs them all.
    phases: list[PhaseConfig] = field(default_factory=lambda: [PhaseConfig()])

    def lora_config(self) -> LoraConfig:
        return dataclasses.replace(self.lora)  # a copy: the caller may keep it

    def phase(self, number: int) -> PhaseConfig:
        if not 1 <= number <= len(self.phases):
            raise IndexError(f"phase {number}: the config has phases 1-{len(self.phases)}")
        return self.phases[number - 1]

    def phase_numbers(self) -> list[int]:
        return list(range(1, len(self.phases) + 1))

    def lineage(self, number: int) -> tuple[list[int], int | None]:
        """What phase `number` is built on: (the phases whose adapters are merged into the base
        beneath it, in order; the phase whose adapter it continues, or None for a fresh one).
        Its served model is the base with `merged` merged, plus its own adapter on top."""
        merged: list[int] = []
        continued = None
        for n in range(2, number + 1):
            init = self.phase(n).init
            if init == "continue":
                continued = n - 1
            elif init == "merge":
                merged, continued = merged + [n - 1], None
            else:
                merged, continued = [], None
        return merged, continued

    def max_steps(self, number: int) -> int:
        """The phase's steps; a phase of adapters side by side runs until its longest is done."""
        if self.phase(number).adapters:
            return max(self.adapter_max_steps(number, name) for name in self.phase(number).adapters)
        return self.phase(number).max_steps or self.train.max_steps

    def lr(self, number: int) -> float:
        return self.phase(number).lr or self.train.lr

    def adapter_max_steps(self, number: int, name: str) -> int:
        return self.phase(number).adapters[name].max_steps or self.phase(number).max_steps or self.train.max_steps

    def adapter_lr(self, number: int, name: str) -> float:
        return self.phase(number).adapters[name].lr or self.lr(number)

    def adapters(self, number: int) -> dict[str, LoraConfig]:
        """The phase's set of adapters, {name: its LoRA settings} in the order of their rows:
        those it trains side by side, or its one adapter (DEFAULT_ADAPTER). Each takes `lora`."""
        names = list(self.phase(number).adapters) or [DEFAULT_ADAPTER]
        return {name: dataclasses.replace(self.lora) for name in names}

    def data_dirs(self, number: int) -> dict[str, str]:
        """The phase's prepared data, {adapter: its data}, in the adapters' order."""
        phase = self.phase(number)
        return {name: a.data for name, a in phase.adapters.items()} if phase.adapters else {DEFAULT_ADAPTER: phase.data}

    def data_key(self, number: int, adapter: str) -> str:
        """The config key that sets an adapter's data: phaseN.data, or phaseN.adapters.<name>.data."""
        return f"phase{number}.adapters.{adapter}.data" if self.phase(number).adapters else f"phase{number}.data"

    def to_dict(self) -> dict:
        """The config as its YAML would write it (phases as `phaseN` sections)."""
        data = dataclasses.asdict(self)
        for number, phase in enumerate(data.pop("phases"), start=1):
            data[f"phase{number}"] = phase
        return data

    def resume_keys(self, phase: int) -> dict:
        """The config's resume keys: the settings a resumed phase must share with the run that
        saved the checkpoint for the result to equal an uninterrupted run's (logging, eval and
        checkpoint cadence may change). micro_batch and grad_accum may change with the number of
        chips as long as the global batch stays the same: the trainer checks that product itself."""
        flat = {"model.path": self.model.path, "model.revision": self.model.revision, "model.dtype": self.model.dtype,
                "model.quantize": self.model.quantize}
        flat.update({f"lora.{k}": v for k, v in dataclasses.asdict(self.lora).items()})
        skip = {"warmup_compiles_steps", "recompile_policy", "max_bad_steps", "micro_batch", "grad_accum",
                "max_wall_time", "capture_step", "scan_layers"}
        flat.update({f"train.{k}": v for k, v in dataclasses.asdict(self.train).items() if k not in skip})
        phase_cfg = dataclasses.asdict(self.phase(phase))
        if phase == 1:
            phase_cfg.pop("init")  # phase 1 always starts fresh
        # The set of adapters (not their order: each one's state is kept by its name), then each
        # side-by-side adapter's keys on their own.
        flat[f"phase{phase}.adapters"] = sorted(self.adapters(phase))
        for name, adapter in phase_cfg.pop("adapters").items():
            flat.update({f"phase{phase}.adapters.{name}.{k}": v for k, v in adapter.items()})
        flat.update({f"phase{phase}.preference.{k}": v for k, v in phase_cfg.pop("preference").items()})
        flat.update({f"phase{phase}.{k}": v for k, v in phase_cfg.items()})
        return flat
