"""The training loop of one phase, run by every replica (one process per TPU chip under dp,
one per host under fsdp).

Per optimizer step: `grad_accum` micro-batches arrive on the device (torch_xla's ParallelLoader
prefetches them on a background thread), the `Stepper` puts forwards, backwards, the sums over replicas,
clipping and the masked AdamW update into one graph (traced at step 1 and replayed after:
step_capture.py), and `torch_xla.sync()` marks the step boundary. Nothing in a step waits
for the device: logging reads the step's results in a step closure on log steps, and the
stop vote is a host collective on a host flag.

`run_phase` is the loop; each concern is a small part with its own state, and `start_phase`
hands each part the settings it reads, not the whole RunConfig:
  build_model (here)                    model section, lora section, the phase's lineage (init)
  PhaseData (phase_data.py)             the phase's data, train (batch shape, seed), eval (batch)
  Stepper (stepper.py)                  train section, the phase's lr and max_steps
  CompileGuard (monitor/compile_guard)  no new graph after warm-up; the phase's clock
  DivergenceMonitor (monitor/divergence) skipped non-finite steps, counted on the device
  Checkpointer (run/checkpointing)      cadence, the collective save, a failed write (checkpoint section)
  StepLogger (monitor/metrics_log)      metrics.jsonl, TensorBoard, progress bar (logging section)
  StopVote (run/stop_signal)            any replica signalled -> all stop at the same step
The whole config goes only where a record of it is the point: the resume keys a checkpoint
keeps (run/checkpointing.resume_keys) and the W&B run's config. Each decision is taken from
values every replica has (all-reduced losses, voted flags), so every replica takes it at the
same step by construction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from finetuning_pipeline.errors import OutputWriteError
from finetuning_pipeline.model.activation_checkpointing import enable_activation_checkpointing
from finetuning_pipeline.model.kernel_attention import attention_here, enable_kernel_attention
from finetuning_pipeline.model.loading import DTYPES, load_base, load_model
from finetuning_pipeline.model.scan_choice import scan_layers
from finetuning_pipeline.monitor.compile_guard import CompileGuard
from finetuning_pipeline.monitor.divergence import DivergenceMonitor
from finetuning_pipeline.monitor.metrics_log import MetricsLog, StepLogger
from finetuning_pipeline.run.checkpointing import Checkpointer, load_checkpoint, load_optimizer_state, resume_keys
from finetuning_pipeline.run.parallel import Parallel
from finetuning_pipeline.run.run_layout import RunLayout
from finetuning_pipeline.run.stop_signal import StopVote
from finetuning_pipeline.run_config import LoggingConfig, ModelConfig, RunConfig
from finetuning_pipeline.train.adamw import MaskedAdamW
from finetuning_pipeline.train.eval_loop import describe_eval, evaluate_loss
from finetuning_pipeline.train.phase_data import PhaseData
from finetuning_pipeline.train.stepper import Stepper
from lora_logic import (
    ScannedLayers,
    inject_lora,
    inject_side_by_side,
    lora_parameters,
    lora_parameters_by_adapter,
    only_adapter,
    save_adapter,
    save_side_by_side,
)
from lora_logic.config import LoraConfig
from utils.atomic_io import atomic_write_json
from utils.hub_models import model_dir
from utils.xla_runtime import peak_memory_bytes, to_host


@dataclass
class PhaseResult:
    """What a phase returns on every replica: stopped_at_step after a stop request; the
    summary (master only) when the phase finished."""

    phase: int
    stopped_at_step: int | None = None
    summary: dict | None = None


# Replicas that are threads of one process (run/launch.py: TPU v2/v3, the CPU rehearsal) share the
# host's RNGs (LoRA's init draws from torch's global generator) and transformers' lazy imports,
# which are not thread-safe (measured: "cannot import name 'AutoModelForCausalLM'" in one of two
# threads). They build their models one at a time, each from the same seed, as processes would.
HOST_BUILD = threading.Lock()


def seed_everything(seed: int) -> None:
    """The host RNGs (LoRA init, data order); the XLA RNG is seeded at every step (step_seed)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_model(model_settings: ModelConfig, lora: LoraConfig, *, merged: list[Path], continued: Path | None,
                side_by_side: list[str] | None = None):
    """The base model (on CPU) with this phase's LoRA; returns (model, lora config).

    merged: earlier phases' adapters folded into the base weights, in order; continued: the
    adapter this phase trains further (its own r/alpha/targets), or None to start `lora`
    fresh (RunConfig.lineage says which, from the phases' `init`).
    side_by_side: the names of adapters to train side by side, each a fresh `lora` that starts
    as it would alone (lora_logic/side_by_side.py); the lora config is then {name: config}.
    """
    dtype = DTYPES[model_settings.dtype]
    files = model_dir(model_settings.path, model_settings.revision)  # a Hub id: its snapshot, pinned by main.py
    adapters = merged + ([continued] if continued else [])
    if adapters:
        model, lora_config = load_model(files, adapters, dtype, keep_last=continued is not None)
    else:
        model, lora_config = load_base(files, dtype), None
    if model_settings.activation_checkpointing:
        enable_activation_checkpointing(model)
    if side_by_side:
        lora_config = {name: dataclasses.replace(lora) for name in side_by_side}
        inject_side_by_side(model, lora_config)
    elif continued is None:
        lora_config = dataclasses.replace(lora)
        inject_lora(model, lora_config)
    return model, lora_config


@dataclass
class Phase:
    """Everything one replica's phase is made of, built by `start_phase`."""

    number: int
    max_steps: int
    layout: RunLayout
    base_model: str  # model.path and model.revision, recorded in the adapter
    base_revision: str | None
    eval_max_batches: int | None
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
    merged_adapters: list[str]  # earlier phases' adapters merged into the base beneath this one's, in order
    accepted_changes: dict  # settings changed at a resume with --accept-changes: {key: [saved, now]}
    adapters: dict[str, int]  # adapters side by side, in their rows' order -> their max_steps ({}: one adapter)

    def evaluate(self) -> dict:
        """The eval loss; side by side, each adapter's on its own data (alone on every row), and
        their token-weighted mean at the top (side_by_side_results)."""
        if not self.adapters:
            return self._evaluate(self.data.dir)
        each = {}
        for name in self.adapters:
            with only_adapter(self.model, name):
                each[name] = self._evaluate(self.data.dirs[name])
        return side_by_side_results(each)

    def _evaluate(self, data_dir: str) -> dict:
        return evaluate_loss(self.model, data_dir, micro_batch=self.data.eval_micro_batch, pad_id=self.data.pad_id,
                             packed=self.data.packed, device=self.device, max_batches=self.eval_max_batches,
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
            p.monitor.update(results["applied"], results.get("skipped"))
            step += 1
            # (and each adapter's last step side by side: its summary's last training loss)
            log_now = (step % config.logging.every == 0 or step == p.max_steps or step == p.start_step + 1
                       or step in p.adapters.values())
            if log_now:
                xm.add_step_closure(log_step, args=(p.logger, p.monitor, step, results, p.monitor.skipped,
                                                    p.monitor.worst_bad_run, p.adapters))
            torch_xla.sync()
            p.guard.step_ended(step)
            p.logger.advance()
            if log_now:
                stop_stepping(p, step)
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
    merged, continued = config.lineage(phase)
    adapters = list(config.phase(phase).adapters)
    with HOST_BUILD:
        seed_everything(t.seed + phase)
        model, lora_config = build_model(config.model, config.lora, merged=[layout.adapter(n) for n in merged],
                                         continued=layout.adapter(continued) if continued else None,
                                         side_by_side=adapters)
        # The resumed adapter goes into the layers before they are stacked (on the host), the
        # optimizer's moments into the optimizer built on the stacks.
        state = load_checkpoint(resume_from, model=model) if resume_from else {}
        scanned = scan_layers(model, t.scan_layers, activation_checkpointing=config.model.activation_checkpointing,
                              spmd=parallel.mesh is not None)
    checkpointer = Checkpointer(layout.checkpoints(phase), every=config.checkpoint.every, keep=config.checkpoint.keep,
                                collectives=parallel.collectives, base_model=config.model.path, lora_config=lora_config)
    checkpointer.clean()
    sharded = parallel.place_model(model, device)
    data = PhaseData(config.data_dirs(phase), train=t, eval=config.eval, parallel=parallel)
    attention, why = attention_here(config.model.attention, model.config, spmd_mesh=parallel.mesh is not None,
                                    seq_len=data.seq_len)
    if attention != "dense":
        enable_kernel_attention(model, attention, parallel.mesh)
    if parallel.master:
        print(f"phase {phase}: {why}; {scanned}", flush=True)
    model.train()
    params, groups = lora_parameters(model), None
    if adapters:  # one optimizer, a group per adapter (adamw.py)
        params, owners = lora_parameters_by_adapter(model)
        groups = [adapters.index(owner) for owner in owners]
    optimizer = MaskedAdamW(params, lr=config.lr(phase), betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay,
                            groups=groups)
    if resume_from:
        load_optimizer_state(resume_from, model=model, optimizer=optimizer)
    start_step = data.resume(state, resume_from)
    guard.resume_at(start_step)
    monitor = DivergenceMonitor(device, t.max_bad_steps, adapters=adapters or None)
    monitor.load_state_dict(state, device)
    lr, max_steps = config.lr(phase), config.max_steps(phase)
    if adapters:
        lr = [config.adapter_lr(phase, name) for name in adapters]
        max_steps = [config.adapter_max_steps(phase, name) for name in adapters]
    stepper = Stepper(model, optimizer, t, phase=phase, lr=lr, max_steps=max_steps,
                      activation_checkpointing=config.model.activation_checkpointing, parallel=parallel,
                      device=device, start_step=start_step, packed=data.packed)
    if monitor.diverged:  # adapters stopped before the checkpoint stay stopped
        stepper.disable([adapters.index(name) for name in monitor.diverged])
    if parallel.master and stepper.capture_note:
        print(f"phase {phase}: {stepper.capture_note}", flush=True)
    logger = make_logger(config.logging, layout=layout, phase=phase, max_steps=config.max_steps(phase),
                         master=parallel.master, tokens_per_step=data.tokens_per_step, start_step=start_step,
                         resume_from=resume_from, state=state, run_settings=config.to_dict())
    p = Phase(number=phase, max_steps=config.max_steps(phase), layout=layout, base_model=config.model.path,
              base_revision=config.model.revision, eval_max_batches=config.eval.max_batches, parallel=parallel,
              device=device, model=model, lora_config=lora_config, optimizer=optimizer, data=data, stepper=stepper,
              guard=guard, monitor=monitor, checkpointer=checkpointer, logger=logger,
              stop=StopVote(parallel.collectives, stop_requested), start_step=start_step,
              resumed=resume_from is not None, eval_before=state.get("eval_before"), sharded=sharded,
              settings=resume_keys(config, phase, data.manifests),
              merged_adapters=[str(layout.adapter(n)) for n in merged],
              accepted_changes={**state.get("accepted_changes", {}), **(accepted_changes or {})},
              adapters={name: config.adapter_max_steps(phase, name) for name in adapters})
    if p.eval_before is None:
        p.eval_before = p.evaluate()
        p.logger.log_eval(0, p.eval_before)
    if parallel.master and p.eval_before["loss"] is None:
        print(f"phase {phase}: {describe_eval(p.eval_before)}; the summary will have no eval loss", flush=True)
    parallel.replicate(optimizer.params + optimizer.state_tensors() + optimizer.device_constants()
                       + stepper.device_state() + monitor.device_state())
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
    layout = p.layout
    if p.adapters:
        save_side_by_side(p.model, layout.side_by_side_adapters(p.number), p.lora_config, p.base_model,
                          p.base_revision)
    else:
        save_adapter(p.model, layout.adapter(p.number), p.lora_config, p.base_model, p.base_revision)
    summary = {
        "phase": p.number,
        "steps": step,
        "resumed_from_step": p.start_step if p.resumed else None,
        "resumed_on_other_chips": p.data.chips_changed,
        "resumed_with_changes": p.accepted_changes or None,
        # What serves this phase's adapter: the base with these merged first (export takes them
        # as --adapter each, then this phase's).
        "merged_adapters": p.merged_adapters,
        "settings": p.settings,
        "tokens": step * p.data.tokens_per_step,
        "label_tokens_this_run": int(sum(label_tokens) if isinstance(label_tokens, list) else label_tokens),
        "skipped_steps": final_state["skipped_steps"],
        "train_loss_first": final_state["train_loss_first"],
        "train_loss_last": weighted_mean(p.logger.adapter_losses["last"]) if p.adapters else last_loss,
        "eval_loss_before": p.eval_before["loss"],
        "eval_loss_after": eval_after["loss"],
        "perplexity_before": p.eval_before["perplexity"],
        "perplexity_after": eval_after["perplexity"],
        **timing,
        "step_updated_state_tensors": p.stepper.updated_state_tensors,
        "device_memory_peak_bytes": peak_memory_bytes(p.device),
        "wall_time_s": round(p.guard.elapsed(), 2),
        "world_size": p.parallel.world,
        "parallel": {**p.parallel.describe(), "sharded_base_parameters": len(p.sharded)},
        "attention": p.model.config._attn_implementation,
        "scanned_layers": any(isinstance(m, ScannedLayers) for m in p.model.modules()),
        "seq_len": p.data.seq_len,
        "global_batch": p.data.batches_per_step,
    }
    if p.adapters:
        summary["skipped_steps"] = sum(final_state["skipped_steps"].values())
        summary["adapters"] = adapter_summaries(p, final_state, eval_after)
    atomic_write_json(layout.summary(p.number), summary)  # written last: marks the phase as done
    return summary


def adapter_summaries(p: Phase, final_state: dict, eval_after: dict) -> dict[str, dict]:
    """Side by side: what each adapter's summary would say had it been trained alone."""
    losses = p.logger.adapter_losses
    return {name: {
        "adapter": str(p.layout.side_by_side_adapters(p.number) / name),
        "steps": max_steps,
        "diverged_at_step": p.monitor.diverged.get(name),
        "skipped_steps": final_state["skipped_steps"][name],
        "train_loss_first": (losses["first"].get(name) or {}).get("loss"),
        "train_loss_last": (losses["last"].get(name) or {}).get("loss"),
        "eval_loss_before": p.eval_before["adapters"][name]["loss"],
        "eval_loss_after": eval_after["adapters"][name]["loss"],
        "perplexity_before": p.eval_before["adapters"][name]["perplexity"],
        "perplexity_after": eval_after["adapters"][name]["perplexity"],
    } for name, max_steps in p.adapters.items()}


def log_step(logger: StepLogger, monitor: DivergenceMonitor, step: int, results: dict, skipped, worst,
             adapters: dict[str, int]) -> None:
    # A step closure: runs once the step's graph has been issued; reading the results waits
    # for that step only, on log steps only. Every replica runs it with the same values
    # (losses are summed over replicas), so every replica takes the same stop decision.
    loss, grad_norm, tokens, skipped, worst, lr = to_host(results["loss"], results["grad_norm"], results["tokens"],
                                                          skipped, worst, results["lr"])
    monitor.observe(worst)
    if not adapters:
        logger.log_train(step, {"loss": loss, "lr": lr, "grad_norm": grad_norm, "label_tokens": tokens,
                                "skipped_steps": skipped})
        return
    # Side by side: each adapter's values, while it steps (an adapter whose steps are done has none).
    each = {name: {"loss": loss[k], "lr": lr[k], "grad_norm": grad_norm[k], "label_tokens": tokens[k],
                   "skipped_steps": skipped[k]}
            for k, (name, max_steps) in enumerate(adapters.items()) if step <= max_steps}
    logger.log_train(step, {"loss": weighted_mean(each), "lr": None, "grad_norm": None,
                            "label_tokens": sum(v["label_tokens"] for v in each.values()),
                            "skipped_steps": sum(skipped)}, adapters=each)


def weighted_mean(each: dict[str, dict]) -> float | None:
    """The label-token-weighted mean loss of adapters side by side (the loss of their rows together)."""
    tokens = sum(v["label_tokens"] for v in each.values() if v["loss"] is not None)
    if not tokens:
        return None
    return sum(v["loss"] * v["label_tokens"] for v in each.values() if v["loss"] is not None) / tokens


def side_by_side_results(each: dict[str, dict]) -> dict:
    """Evaluation results of adapters side by side: each adapter's, and their mean at the top."""
    loss = weighted_mean(each)
    return {"loss": loss, "perplexity": None if loss is None else math.exp(min(loss, 50.0)),
            "label_tokens": sum(v["label_tokens"] for v in each.values()), "adapters": each}


def stop_stepping(p: Phase, step: int) -> None:
    """Side by side: an adapter that reached train.max_bad_steps skipped steps in a row stops
    stepping (as it would stop alone, where the run would end); the others go on undisturbed."""
    if not p.adapters:
        return
    names = list(p.adapters)
    new = p.monitor.newly_diverged(step)
    if new:
        p.stepper.disable(new)
        if p.parallel.master:
            print(f"phase {p.number}: adapter{'s' if len(new) > 1 else ''} {', '.join(names[k] for k in new)} "
                  f"stopped at step {step}: {p.monitor.max_bad_steps} consecutive steps had a non-finite loss or "
                  "gradient norm (train.max_bad_steps); its weights stay as after its last good step, the other "
                  "adapters go on. Lower its lr or check its data", flush=True)


def make_logger(logging: LoggingConfig, *, layout: RunLayout, phase: int, max_steps: int, master: bool,
                tokens_per_step: int, start_step: int, resume_from: Path | None, state: dict,
                run_settings: dict) -> StepLogger:
    """The phase's step logger; only the master writes metrics, TensorBoard, W&B (which records
    `run_settings`, the whole config) and draws the progress bar."""
    log = progress = None
    if master:
        tb = layout.tensorboard(phase) if logging.tensorboard else None
        wandb = None
        if logging.wandb.project:
            from finetuning_pipeline.monitor.wandb_log import WandbLog

            wandb = WandbLog(logging.wandb, phase, layout.phase_dir(phase), run_settings,
                             resuming=resume_from is not None)
        log = MetricsLog(layout.metrics(phase), tb, resume_step=start_step if resume_from else None, wandb=wandb)
        if logging.progress_bar:
            from tqdm import tqdm

            progress = tqdm(total=max_steps, initial=start_step, desc=f"phase {phase}", unit="step",
                            dynamic_ncols=True)
    return StepLogger(log, progress, tokens_per_step, max_steps, state.get("train_loss_first"),
                      state.get("adapter_losses"))
