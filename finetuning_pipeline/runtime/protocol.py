"""What the trainer asks of a runtime, declared: the one seam between the backend-neutral trainer
(train/, model/, monitor/, run/, distributed/, lora_logic/) and the code that executes its steps.

Two runtimes implement it whole, as siblings: `runtime/xla/` (torch_xla over PJRT: lazy tensors,
the captured step, scanned layers, the TPU launcher; the TPU's path) and `runtime/native/`
(PyTorch as it runs: a CPU, a GPU, TorchTPU; torch.compile per layer, DDP and FSDP2 under
torchrun). Neither inherits from the other; what they share (the step's arithmetic, the loss,
the LoRA, the optimizer, the data) is the neutral code they both call. torchtitan's per-model
`parallelize` and torchtune's recipe protocols are the models: a runtime is a few functions, not
a class hierarchy.

`Backend` is a runtime before a replica exists (the process, the checks, the launch); `Runtime`
is what a replica's phase holds (`start` makes it with the replica's Parallel and device);
`StepExecution` is how a runtime runs one optimizer step for train.stepper.Stepper.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch

from finetuning_pipeline.distributed.parallel import Parallel
from finetuning_pipeline.model.attention_choice import TargetMachine
from finetuning_pipeline.run_config import RunConfig


@dataclass
class Parallelized:
    """What `Runtime.parallelize` did to a phase's model: the names of the base's sharded tensors,
    whether its decoder layers run as one loop, whether each was compiled on its own (torch.compile:
    the native runtime's runtime.compile=layers; XLA compiles the whole step either way), and a
    line for the log (attention, layers)."""

    sharded: list[str] = field(default_factory=list)
    scanned_layers: bool = False
    compiled_layers: bool = False
    description: str = ""


class StepExecution(Protocol):
    """One optimizer step on a runtime: the micro-batches' gradients, their sum over the replicas,
    and the update (train/step.py's arithmetic), executed the runtime's way."""

    note: str | None  # said once when the phase starts (a reason the step runs another way), or None

    def run(self, micro_batches: list[dict], seeds: list[int], lr_and_active: Callable, lr_examples: Callable) -> dict:
        """The step's results (train/step.py's apply_update: loss, tokens, grad_norm, applied; side
        by side skipped too), device tensors. micro_batches carry their LoRA dropout seeds; seeds[i]
        seeds the model's own random draws of micro-batch i; lr_and_active() gives the step's LR and
        which adapters step (the run sets the optimizer's LR to it), lr_examples() host zeros of
        their shapes (Stepper.lr_examples)."""

    @property
    def updated_state_tensors(self) -> int | None:
        """How many state tensors the step updates in place, where the runtime can donate their
        buffers (None elsewhere, or before its first step)."""

    @property
    def updated_state_bytes(self) -> int | None:
        """Those tensors' bytes (None likewise)."""


class Runtime(Protocol):
    """A replica's runtime, for one run: what the phase loop, the checks and the monitors ask."""

    name: str  # "xla" or "native": the phase's summary records it
    counts_host_syncs_each_step: bool  # False: it counts one step, around which CompileGuard asks

    # -- the model on the device --------------------------------------------------------------
    def parallelize(self, model: torch.nn.Module, config: RunConfig, parallel: Parallel, device,
                    seq_len: int) -> Parallelized:
        """Everything the runtime does to a phase's model before it trains, in place: its layers
        scanned or compiled, placed and sharded on the device, its attention kernels (after its
        checkpoint was loaded, on the host; before the optimizer is built)."""

    def step_execution(self, model: torch.nn.Module, optimizer, *, train, parallel: Parallel, device, packed: bool,
                       loss_chunk: int, activation_checkpointing: bool, objective=None) -> StepExecution:
        """How this runtime runs the phase's optimizer steps (train/stepper.py drives it). objective: a
        preference phase's loss (train/step.py's; its step's results then hold "metric_sums"), or
        None for next-token loss."""

    # -- batches and step boundaries ----------------------------------------------------------
    def device_batches(self, data, device) -> Iterator[dict]:
        """The phase's training micro-batches (train/phase_data.PhaseData) on the device; closed
        at the phase's end."""

    def to_device(self, batch: dict, device, input_sharding=None) -> dict:
        """One host batch (an evaluation's) on the device, sharded as `input_sharding` says."""

    def step_boundary(self) -> None:
        """The end of a step's (or an evaluation batch's) work: what was queued is dispatched."""

    def after_step(self, fn: Callable, args: tuple) -> None:
        """fn(*args) once the step's results exist."""

    def wait(self) -> None:
        """Until the device has finished what was queued."""

    # -- what the monitors read ---------------------------------------------------------------
    def counters(self):
        """Compiles and compile seconds so far (and host syncs, where counted every step); the
        difference of two readings is a reading."""

    def counting_host_syncs(self):
        """A context counting the host syncs of what runs in it (.value after), for a runtime that
        counts one step."""

    def first_step_donations(self, compiles: int) -> int | None:
        """Of the `compiles` graphs the first step compiled, the most inputs one donated to its
        outputs (None where buffers are not donated)."""

    def recompile_message(self, phase: int, step: int, compiles: int) -> str:
        """What a compile after warm-up says, with how to find its cause on this runtime."""

    def peak_memory_bytes(self, device) -> int | None:
        """The device's peak memory in use so far, or None where it reports none."""


class Backend(Protocol):
    """A runtime before a replica exists: the process, the machine the checks judge, the launch."""

    name: str
    reason: str  # why runtime.backend chose it (runtime/__init__.backend)
    device_environment: tuple[str, ...]  # what picks a run's devices: the printed resume command keeps it
    plan_note: str | None  # what preflight's TPU plan means for this runtime (None: it is its own)
    # tpu_check's check of this runtime's TPU paths: a function of checks/ by its name (runtime/ imports
    # nothing above it, so the runtime names its check and the command looks it up there)
    self_check: str
    checks_a_pod: bool  # whether that check runs on every host of a pod at once, one run of the slice each

    def plans_gpu(self, config: RunConfig) -> bool:
        """Whether preflight plans gpu.type's GPUs for this run (planning/gpu_plan.py), else tpu.type's TPU."""

    def prepare_process(self, config: RunConfig, first_process: bool) -> None:
        """Before anything imports transformers (first_process: the first of a host's processes)."""

    def target_machine(self, config: RunConfig) -> TargetMachine:
        """The machine this process's run will train on, for the input checks."""

    def device_name(self, config: RunConfig) -> str:
        """The device the run takes, in words, for its first line (after prepare_process)."""

    def before_run(self, config: RunConfig, command: list[str], script: str) -> int | None:
        """Before anything of the run is written: where this runtime's launcher is the same command
        run again in other processes (TorchTPU's torchrun), this process runs them (script: main.py's
        path; command: its arguments) and returns the run's exit status; None where it trains itself."""

    def launch(self, config: RunConfig, replica: Callable, args: tuple) -> None:
        """replica(*args) on every replica this process starts (its launcher's processes and
        threads, or this process itself), once the run is planned."""

    def start(self, config: RunConfig) -> tuple[Runtime, Parallel, object]:
        """On a replica: (its Runtime, its Parallel, its device), the device and its collectives
        initialised; the Parallel's collectives sum device tensors this runtime's way."""
