"""The training loop of one phase, run by every replica (one process per TPU chip under dp,
one per host under fsdp).

Per optimizer step: `grad_accum` micro-batches arrive on the device (torch_xla's ParallelLoader prefetches
them on a background thread), the `Stepper` puts forwards, backwards, the sums over replicas,
clipping and the masked AdamW update into one graph (traced at step 1 and replayed after:
step_capture.py), and `torch_xla.sync()` marks the step boundary. Nothing in a step waits
for the device: logging reads the step's results in a step closure on log steps, and the
stop vote is a host collective on a host flag.

`run_phase` is the loop; each concern is a small part with its own state:
  CompileGuard (compile_guard.py)       no new graph after warm-up; the phase's clock
  DivergenceMonitor (divergence.py)     skipped non-finite steps, counted on the device
  Checkpointer (checkpointing.py)       cadence, the collective save, a failed write
  StepLogger (metrics_log.py)           metrics.jsonl, TensorBoard, progress bar
  StopVote (stop_signal.py)             any replica signalled -> all stop at the same step
Each decision is taken from values every replica has (all-reduced losses, voted flags), so
every replica takes it at the same step by construction.
"""

from __future__ import annotations

import contextlib
import functools
import random
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dataset.loader import ShardLoader
from dataset.manifest import is_packed, read_manifest
from finetuning_pipeline.activation_checkpointing import enable_activation_checkpointing
from finetuning_pipeline.adamw import MaskedAdamW
from finetuning_pipeline.checkpointing import Checkpointer, load_checkpoint, load_optimizer_state, resume_keys
from finetuning_pipeline.chunked_loss import resolve_chunk_tokens
from finetuning_pipeline.compile_guard import CompileGuard
from finetuning_pipeline.config import RunConfig
from finetuning_pipeline.divergence import DivergenceMonitor
from finetuning_pipeline.errors import ConfigError, OutputWriteError
from finetuning_pipeline.evaluation import describe_eval, evaluate_loss
from finetuning_pipeline.kernel_attention import choose_attention, enable_kernel_attention
from finetuning_pipeline.lr_schedule import lr_table
from finetuning_pipeline.metrics_log import MetricsLog, StepLogger
from finetuning_pipeline.micro_batch_loop import summed_over_micro_batches
from finetuning_pipeline.model_loading import DTYPES, load_base, load_model
from finetuning_pipeline.parallel import Parallel
from finetuning_pipeline.run_layout import RunLayout
from finetuning_pipeline.scan_choice import model_dropouts, scan_layers
from finetuning_pipeline.step import apply_update, micro_batch_gradients, train_step
from finetuning_pipeline.step_capture import CapturedStep
from finetuning_pipeline.stop_signal import StopVote
from lora_logic import ScannedLayers, inject_lora, lora_parameters, save_adapter
from utils.atomic_io import atomic_write_json
from utils.hub_models import model_dir
from utils.xla_runtime import device_counter, device_kind, to_host


@dataclass
class PhaseResult:
    """What a phase returns on every replica: stopped_at_step after a stop request; the
    summary (master only) when the phase finished."""

    phase: int
    stopped_at_step: int | None = None
    summary: dict | None = None


# Replicas that are threads of one process (launch.py: TPU v2/v3, the CPU rehearsal) share the
# host's RNGs (LoRA's init draws from torch's global generator) and transformers' lazy imports,
# which are not thread-safe (measured: "cannot import name 'AutoModelForCausalLM'" in one of two
# threads). They build their models one at a time, each from the same seed, as processes would.
HOST_BUILD = threading.Lock()


def seed_everything(seed: int) -> None:
    """The host RNGs (LoRA init, data order); the XLA RNG is seeded at every step (step_seed)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def step_seed(seed: int, phase: int, rank: int, step: int) -> int:
    """The XLA RNG seed of one training step (distinct per phase, replica and step; < 2**63)."""
    return (((seed * 3 + phase) * 1_000_003 + rank) * 1_000_000_007 + step) % (2**63 - 1)


def micro_batch_seeds(seed: int, phase: int, rank: int, step: int, count: int) -> list[int]:
    """The seed of each micro-batch of a step: torch_xla's RNG seed for it and, mod 2**31, its
    LoRA dropout masks' (lora_logic/dropout.py)."""
    first = step_seed(seed, phase, rank, step)
    return [(first * 1_000_003 + i) % (2**63 - 1) for i in range(count)]


def build_model(config: RunConfig, phase: int):
    """The base model (on CPU) with this phase's LoRA; returns (model, lora config).

    Phase 2 `continue` trains the phase-1 adapter further (its own r/alpha/targets);
    `merge` folds it into the base and starts config.lora fresh; `fresh` ignores phase 1.
    """
    dtype = DTYPES[config.model.dtype]
    init = config.phase2.init if phase == 2 else "fresh"
    files = model_dir(config.model.path, config.model.revision)  # a Hub id: its snapshot, pinned by main.py
    if init == "fresh":
        model, lora_config = load_base(files, dtype), None
    else:
        phase1_adapter = RunLayout(config.output_dir).adapter(1)
        model, lora_config = load_model(files, [phase1_adapter], dtype, keep_last=init == "continue")
    if config.model.gradient_checkpointing:
        enable_activation_checkpointing(model)
    if init != "continue":
        lora_config = config.lora_config()
        inject_lora(model, lora_config)
    return model, lora_config


class Stepper:
    """One optimizer step on the device: the micro-batches' seeds (LoRA dropout masks, torch_xla's
    RNG), the LR from the schedule table, gradients, the sums over replicas, the update, and the
    running label-token count. The step count lives on the device (an integer [1]: see
    device_zeros), so nothing per step crosses from the host but the seeds.

    With train.capture_step (the default) the gradients (all micro-batches, in one XLA loop)
    and the update are each traced once, at the first step, and replayed after (step_capture.py);
    the sums over replicas sit between the two, as they need a host round trip under torchrun
    on a CPU. Otherwise `step.train_step` traces everything every step."""

    def __init__(self, model, optimizer, config: RunConfig, phase: int, parallel: Parallel, device,
                 start_step: int, packed: bool) -> None:
        t = config.train
        self.model, self.optimizer, self.parallel, self.device = model, optimizer, parallel, device
        self.seed, self.phase, self.packed = t.seed, phase, packed
        self.loss_chunk = resolve_chunk_tokens(t.loss_chunk_tokens, model.config)
        self.max_grad_norm = t.max_grad_norm
        self.step_count = torch.tensor([start_step]).to(device)
        self.schedule = lr_table(peak=config.lr(phase), warmup_steps=t.warmup_steps,
                                 total_steps=config.max_steps(phase), min_lr_ratio=t.min_lr_ratio).to(device)
        self.label_tokens = device_counter(0, device)
        self.keys: list[str] = []
        self.gradients = self.update = None
        self.capture_note = None
        dropouts = model_dropouts(model.config) if config.model.gradient_checkpointing else {}
        if t.capture_step and dropouts:
            # torch random numbers in a recomputed layer cannot be replayed (step_capture.lower refuses them)
            named = ", ".join(f"{name} {p}" for name, p in dropouts.items())
            self.capture_note = (f"the step is traced every time: dropout in the model ({named}) with gradient "
                                 "checkpointing draws random numbers the captured step cannot replay")
        elif t.capture_step:
            # The traced functions are bound to the pieces they read, not to this Stepper: a
            # CapturedStep holding the Stepper's own methods would be a reference cycle that kept
            # the phase's model and optimizer alive after it (until a garbage collection happened
            # to run), while the next phase loads its own.
            self.gradients = CapturedStep(
                functools.partial(gradient_sums, model, optimizer, self.keys, packed, self.loss_chunk),
                functools.partial(model_state, model), name="gradients")
            self.update = CapturedStep(functools.partial(update_from_sums, optimizer, self.max_grad_norm),
                                       functools.partial(optimizer_state, optimizer), name="update")

    def device_state(self) -> list[torch.Tensor]:
        return [self.step_count, self.schedule, self.label_tokens]

    def __call__(self, step: int, micro_batches: list[dict]) -> dict:
        # The random numbers of step k (LoRA and the model's dropout) depend on (seed, phase,
        # rank, k) and the micro-batch only, so a resumed run draws the masks the uninterrupted
        # one drew: restoring torch_xla's saved RNG state did not (same state read back,
        # different masks: verified with lora.dropout 0.1). New seeds each step are data for
        # the graph, not a recompile.
        seeds = micro_batch_seeds(self.seed, self.phase, self.parallel.rank, step, len(micro_batches))
        micro_batches = [{**batch, "lora_seed": torch.tensor([seed % 2**31], dtype=torch.int32).to(self.device)}
                         for batch, seed in zip(micro_batches, seeds)]
        if self.gradients is None:
            self.optimizer.lr = self.schedule[self.step_count]
            results = train_step(self.model, self.optimizer, micro_batches, max_grad_norm=self.max_grad_norm,
                                 collectives=self.parallel.collectives, packed=self.packed,
                                 loss_chunk=self.loss_chunk, seeds=seeds)
        else:
            self.keys[:] = sorted(micro_batches[0])  # (the gradients' partial holds this list)
            inputs = [batch[k] for batch in micro_batches for k in self.keys]
            inputs.append(torch.tensor(seeds, dtype=torch.int64).to(self.device))
            if not self.gradients.captured:
                self._capture(inputs)
            sums = self.gradients(inputs)
            sums = [sums["grad"], sums["loss_total"], sums["tokens"]]
            sums = self.parallel.collectives.sum_device(sums)
            lr = self.schedule[self.step_count]
            results = self.update(sums + [lr])
            self.optimizer.lr = lr  # (the update's trace left its example there)
        self.label_tokens = self.label_tokens + results["tokens"]
        self.step_count = self.step_count + 1
        return {**results, "lr": self.optimizer.lr}

    def _capture(self, inputs: list[torch.Tensor]) -> None:
        """Both traces, before anything of the first step is pending (see CapturedStep.capture):
        the gradients on the first step's inputs, the update on zeros of their results' shapes."""
        sums = self.gradients.capture(inputs)
        examples = [torch.zeros(sums[k][0], dtype=sums[k][1]) for k in ("grad", "loss_total", "tokens")]
        examples.append(torch.zeros(self.step_count.shape, dtype=self.schedule.dtype))
        self.update.capture([t.to(self.device) for t in examples])



def model_state(model) -> list[torch.Tensor]:
    return list(model.parameters()) + list(model.buffers())


def optimizer_state(optimizer: MaskedAdamW) -> list[torch.Tensor]:
    return optimizer.params + optimizer.state_tensors()


def gradient_sums(model, optimizer: MaskedAdamW, keys: list[str], packed: bool, loss_chunk,
                  inputs: list[torch.Tensor]) -> dict:
    """Traced once: the step's micro-batches (flat, `keys` order) and their seeds -> sums."""
    per_batch = len(keys)
    micro_batches = [dict(zip(keys, inputs[i:i + per_batch])) for i in range(0, len(inputs) - 1, per_batch)]
    grad, loss_total, tokens = summed_over_micro_batches(
        lambda batch: micro_batch_gradients(model, optimizer, batch, packed, loss_chunk),
        micro_batches, inputs[-1], reads=model_state(model))
    # [1], not 0-dim: the update is traced on zeros of these shapes, and a 0-dim zero
    # reaches the device as a constant, not as data.
    return {"grad": grad, "loss_total": loss_total.reshape(1), "tokens": tokens.reshape(1)}


def update_from_sums(optimizer: MaskedAdamW, max_grad_norm: float, inputs: list[torch.Tensor]) -> dict:
    """Traced once: the summed gradient, loss and label tokens, and the LR -> the update."""
    grad, loss_total, tokens, lr = inputs
    optimizer.lr = lr
    return apply_update(optimizer, grad, loss_total.reshape(()), tokens.reshape(()), max_grad_norm)


@dataclass
class Phase:
    """Everything one replica's phase is made of, built by `start_phase`."""

    config: RunConfig
    number: int
    parallel: Parallel
    device: object
    model: torch.nn.Module
    lora_config: object
    optimizer: MaskedAdamW
    data: "PhaseData"
    stepper: Stepper
    guard: CompileGuard
    monitor: DivergenceMonitor
    checkpointer: Checkpointer
    logger: StepLogger
    stop: StopVote
    start_step: int
    resumed: bool
    eval_before: dict
    sharded: list
    settings: dict  # what the phase is built on (checkpointing.resume_keys), fixed for the phase
    accepted_changes: dict  # settings changed at a resume with --accept-changes: {key: [saved, now]}

    @property
    def max_steps(self) -> int:
        return self.config.max_steps(self.number)

    def evaluate(self) -> dict:
        return evaluate_loss(self.model, self.data.dir, micro_batch=self.data.eval_micro_batch, pad_id=self.data.pad_id,
                             packed=self.data.packed, device=self.device, max_batches=self.config.eval.max_batches,
                             loss_chunk=self.stepper.loss_chunk,
                             collectives=self.parallel.collectives, input_sharding=self.parallel.input_sharding(),
                             replicate=self.parallel.replicate)

    def trainer_state(self) -> dict:
        """What a checkpoint records besides weights and optimizer, as of the step just run."""
        return {"phase": self.number, "eval_before": self.eval_before, **self.logger.state_dict(),
                **self.monitor.state_dict(), "global_batch": self.data.batches_per_step, "chips": self.parallel.chips,
                "exactness": self.settings, "accepted_changes": self.accepted_changes}

    def save(self, step: int, state: dict | None = None) -> None:
        state = state if state is not None else self.trainer_state()
        self.checkpointer.save(step, model=self.model, optimizer=self.optimizer, trainer_state=state)


def run_phase(config: RunConfig, phase: int, *, parallel: Parallel, device, resume_from: Path | None,
              stop_requested=lambda: False, accepted_changes: dict | None = None) -> PhaseResult:
    """Train one phase on this replica; the master writes adapter, metrics, checkpoints and summary.
    accepted_changes: settings changed at this resume (main.py --accept-changes), recorded."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    p = start_phase(config, phase, parallel, device, resume_from, stop_requested, accepted_changes)
    # Closed on every way out (a stop, an error): its threads hold phase data until joined.
    with contextlib.closing(p.data.device_batches(device)) as batches:
        step = p.start_step
        while step < p.max_steps:
            p.guard.step_started()
            # Fetch first: the loader's next() marks a step itself, which would cut anything
            # already traced for this step (the LR) into a graph of its own.
            micro_batches = [next(batches) for _ in range(config.train.grad_accum)]
            p.guard.data_ready()
            results = p.stepper(step, micro_batches)
            p.monitor.update(results["applied"])
            step += 1
            log_now = step % config.logging.every == 0 or step == p.max_steps or step == p.start_step + 1
            if log_now:
                xm.add_step_closure(log_step, args=(p.logger, p.monitor, step, results, p.monitor.skipped,
                                                    p.monitor.worst_bad_run))
            torch_xla.sync()
            p.guard.step_ended(step)
            p.logger.advance()
            if log_now:
                p.monitor.check(phase, step, p.checkpointer.latest)
            if config.eval.every and step % config.eval.every == 0 and step < p.max_steps:
                p.logger.log_eval(step, p.evaluate())
            stopping = p.stop.due()
            if stopping or p.checkpointer.due(step, p.max_steps):
                p.save(step)
            if stopping:
                p.logger.close()
                return PhaseResult(phase, stopped_at_step=step)
        return finish_phase(p, step, results["loss"] if step > p.start_step else None)


def start_phase(config: RunConfig, phase: int, parallel: Parallel, device, resume_from: Path | None,
                stop_requested, accepted_changes: dict | None = None) -> Phase:
    """Model, optimizer, data and the loop's parts, resumed from `resume_from` when given, with
    the phase's first evaluation done (or taken from the checkpoint)."""
    import torch_xla

    t, layout = config.train, RunLayout(config.output_dir)
    guard = CompileGuard(phase, t.warmup_compiles_steps, t.recompile_policy)  # counts from here
    with HOST_BUILD:
        seed_everything(t.seed + phase)
        model, lora_config = build_model(config, phase)
        # The resumed adapter goes into the layers before they are stacked (on the host), the
        # optimizer's moments into the optimizer built on the stacks.
        state = load_checkpoint(resume_from, model=model) if resume_from else {}
        scanned = scan_layers(model, t.scan_layers, remat=config.model.gradient_checkpointing,
                              spmd=parallel.mesh is not None)
    checkpointer = Checkpointer(layout.checkpoints(phase), every=config.checkpoint.every, keep=config.checkpoint.keep,
                                collectives=parallel.collectives, base_model=config.model.path, lora_config=lora_config)
    checkpointer.clean()
    sharded = parallel.place_model(model, device)
    attention, why = choose_attention(config.model.attention, model.config, on_tpu=device_kind() == "TPU",
                                      spmd_mesh=parallel.mesh is not None)
    if attention != "dense":
        enable_kernel_attention(model, attention, parallel.mesh)
    if parallel.master:
        print(f"phase {phase}: {why}; {scanned}", flush=True)
    model.train()
    optimizer = MaskedAdamW(lora_parameters(model), lr=config.lr(phase), betas=tuple(t.betas), eps=t.eps,
                            weight_decay=t.weight_decay)
    if resume_from:
        load_optimizer_state(resume_from, model=model, optimizer=optimizer)
    data = PhaseData(config, phase, parallel)
    start_step = data.resume(state, resume_from)
    guard.resume_at(start_step)
    monitor = DivergenceMonitor(device, t.max_bad_steps)
    monitor.load_state_dict(state, device)
    stepper = Stepper(model, optimizer, config, phase, parallel, device, start_step, data.packed)
    if parallel.master and stepper.capture_note:
        print(f"phase {phase}: {stepper.capture_note}", flush=True)
    p = Phase(config, phase, parallel, device, model, lora_config, optimizer, data, stepper, guard, monitor,
              checkpointer, make_logger(config, phase, parallel, data, start_step, resume_from, state),
              StopVote(parallel.collectives, stop_requested), start_step, resume_from is not None,
              state.get("eval_before"), sharded, resume_keys(config, phase, data.manifest),
              {**state.get("accepted_changes", {}), **(accepted_changes or {})})
    if p.eval_before is None:
        p.eval_before = p.evaluate()
        p.logger.log_eval(0, p.eval_before)
    if parallel.master and p.eval_before["loss"] is None:
        print(f"phase {phase}: {describe_eval(p.eval_before)}; the summary will have no eval loss", flush=True)
    parallel.replicate(optimizer.params + optimizer.state_tensors() + stepper.device_state() + monitor.device_state())
    # A resumed run's checkpoint was copied into parameters and optimizer state: run those
    # copies now, or they would join step 1's graph and make it a graph of its own.
    torch_xla.sync()
    return p


def finish_phase(p: Phase, step: int, last_loss) -> PhaseResult:
    """The final evaluation and checkpoint (every replica); adapter and summary (the master)."""
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()
    timing = p.guard.summary(step - p.start_step, p.data.tokens_per_step)
    eval_after = p.evaluate()
    final_state = p.trainer_state()
    p.save(step, final_state)
    last_loss, label_tokens = to_host(last_loss, p.stepper.label_tokens) if last_loss is not None else (None, 0)
    p.logger.log_eval(step, eval_after)
    summary, error = None, None
    if p.parallel.master:
        try:
            summary = write_phase_outputs(p, step, final_state, last_loss, label_tokens, timing, eval_after)
        except OSError as err:
            error = err
    p.logger.close(summary)
    # Phase 2 loads this adapter on every replica: none goes on before the master has written
    # it, and a failed write stops them all (the master's error names the file).
    if not p.parallel.collectives.all(error is None):
        if error is not None:
            raise error
        raise OutputWriteError(f"the master could not write phase {p.number}'s adapter or summary (see its error); "
                               "fix the disk and rerun with --resume auto")
    return PhaseResult(p.number, summary=summary)


def write_phase_outputs(p: Phase, step: int, final_state: dict, last_loss, label_tokens, timing: dict,
                        eval_after: dict) -> dict:
    """The master's adapter, then the summary that marks the phase as done; returns the summary."""
    layout = RunLayout(p.config.output_dir)
    save_adapter(p.model, layout.adapter(p.number), p.lora_config, p.config.model.path, p.config.model.revision)
    summary = {
        "phase": p.number,
        "steps": step,
        "resumed_from_step": p.start_step if p.resumed else None,
        "resumed_on_other_chips": p.data.chips_changed,
        "resumed_with_changes": p.accepted_changes or None,
        "settings": p.settings,
        "tokens": step * p.data.tokens_per_step,
        "label_tokens_this_run": int(label_tokens),
        "skipped_steps": final_state["skipped_steps"],
        "train_loss_first": final_state["train_loss_first"],
        "train_loss_last": last_loss,
        "eval_loss_before": p.eval_before["loss"],
        "eval_loss_after": eval_after["loss"],
        "perplexity_before": p.eval_before["perplexity"],
        "perplexity_after": eval_after["perplexity"],
        **timing,
        "wall_time_s": round(p.guard.elapsed(), 2),
        "world_size": p.parallel.world,
        "parallel": {**p.parallel.describe(), "sharded_base_parameters": len(p.sharded)},
        "attention": p.model.config._attn_implementation,
        "scanned_layers": any(isinstance(m, ScannedLayers) for m in p.model.modules()),
        "seq_len": p.data.seq_len,
        "global_batch": p.data.batches_per_step,
    }
    atomic_write_json(layout.summary(p.number), summary)  # written last: marks the phase as done
    return summary


def log_step(logger: StepLogger, monitor: DivergenceMonitor, step: int, results: dict, skipped, worst) -> None:
    # A step closure: runs once the step's graph has been issued; reading the results waits
    # for that step only, on log steps only. Every replica runs it with the same values
    # (losses are summed over replicas), so every replica takes the same stop decision.
    loss, grad_norm, tokens, skipped, worst, lr = to_host(results["loss"], results["grad_norm"], results["tokens"],
                                                          skipped, worst, results["lr"])
    monitor.observe(worst)
    logger.log_train(step, {"loss": loss, "lr": lr, "grad_norm": grad_norm, "label_tokens": tokens,
                            "skipped_steps": skipped})


def make_logger(config: RunConfig, phase: int, parallel: Parallel, data: "PhaseData", start_step: int,
                resume_from: Path | None, state: dict) -> StepLogger:
    layout = RunLayout(config.output_dir)
    log = progress = None
    if parallel.master:
        tb = layout.tensorboard(phase) if config.logging.tensorboard else None
        wandb = None
        if config.logging.wandb.project:
            from finetuning_pipeline.wandb_log import WandbLog

            wandb = WandbLog(config.logging.wandb, phase, layout.phase_dir(phase), config.to_dict(),
                             resuming=resume_from is not None)
        log = MetricsLog(layout.metrics(phase), tb, resume_step=start_step if resume_from else None, wandb=wandb)
        if config.logging.progress_bar:
            from tqdm import tqdm

            progress = tqdm(total=config.max_steps(phase), initial=start_step, desc=f"phase {phase}", unit="step",
                            dynamic_ncols=True)
    return StepLogger(log, progress, data.tokens_per_step, config.max_steps(phase), state.get("train_loss_first"))


class PhaseData:
    """The phase's prepared data on this replica: its manifest, the resumable shard loader,
    and the batch arithmetic. Under fsdp a process reads the batches of all its chips; the
    global batch is the same sequence of blocks as dp over the same number of chips, and the
    cursor counts global blocks, so a run may resume on another number of chips as long as
    the global batch is the same."""

    def __init__(self, config: RunConfig, phase: int, parallel: Parallel) -> None:
        t = config.train
        self.dir = config.phase(phase).data
        self.manifest = read_manifest(self.dir)
        self.seq_len = self.manifest["seq_len"]
        self.packed = is_packed(self.manifest)
        self.pad_id = self.manifest["tokenizer"]["pad_id"]
        self.parallel = parallel
        self.loader = ShardLoader(self.dir, t.micro_batch * parallel.chips_per_process, seed=t.seed,
                                  rank=parallel.rank, world_size=parallel.world)
        self.eval_micro_batch = (config.eval.micro_batch or t.micro_batch) * parallel.chips_per_process
        self.batches_per_step = t.grad_accum * parallel.chips * t.micro_batch  # global blocks per step
        self.tokens_per_step = self.batches_per_step * self.seq_len
        self.chips_changed = None

    def resume(self, state: dict, resume_from: Path | None) -> int:
        """The first step to run; positions the loader at the global block it starts with."""
        start_step = state.get("step", 0)
        saved_batch = state.get("global_batch", self.batches_per_step)
        if saved_batch != self.batches_per_step:
            raise ConfigError(
                f"--resume: {resume_from} was saved with a global batch of {saved_batch} sequences, this run has "
                f"{self.batches_per_step} (train.micro_batch x train.grad_accum x {self.parallel.chips} chips); set "
                f"them so the product is {saved_batch}"
            )
        saved_chips = state.get("chips", self.parallel.chips)
        if saved_chips != self.parallel.chips:
            self.chips_changed = {"saved_on": saved_chips, "resumed_on": self.parallel.chips}
            if self.parallel.master:
                print(f"note: {resume_from} was saved on {saved_chips} chips, resuming on {self.parallel.chips} with the "
                      f"same global batch of {saved_batch}: the data continues at global block "
                      f"{start_step * saved_batch}", flush=True)
        self.loader.position = start_step * self.batches_per_step
        return start_step

    def device_batches(self, device):
        """The phase's batches on the device, prefetched by torch_xla's loader thread. That thread
        drops an exception of the reader (a shard that became unreadable: EIO, a vanished
        network disk) and simply ends the iteration, which the loop would take for a
        StopIteration traceback; the reader's error is kept and raised here instead. Closing
        this generator stops and joins the loader's threads (they hold this PhaseData)."""
        import torch_xla.distributed.parallel_loader as pl

        failure: list[BaseException] = []

        def read():  # runs on the loader's thread
            try:
                yield from self.loader
            except Exception as err:  # noqa: BLE001 - handed to the training thread below
                failure.append(err)

        # We mark every step ourselves; by default the loader would also sync at each next().
        loader = pl.ParallelLoader(read(), [device], batches_per_execution=1 << 30,
                                   input_sharding=self.parallel.input_sharding())
        try:
            yield from loader.per_device_loader(device)
        finally:
            loader.close()
        raise failure[0] if failure else RuntimeError("the data loader stopped without an error (a bug)")
