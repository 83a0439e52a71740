"""The start of one phase on a replica: its model with the phase's set of adapters, the
optimizer, the data and the loop's parts, resumed from a checkpoint when there is one.

Each concern is a small part with its own state, and `start_phase` hands each part the settings
it reads, not the whole RunConfig:
  build_model (here)                    model section, the phase's adapters (lora), its lineage (init)
  PhaseData (phase_data.py)             the phase's data, train (batch shape, seed), eval (batch)
  Stepper (stepper.py)                  train section, the phase's lr and max_steps
  CompileGuard (monitor/compile_guard)  no new graph after warm-up; the phase's clock
  DivergenceMonitor (monitor/divergence) skipped non-finite steps, counted on the device
  Checkpointer (run/checkpointing)      cadence, the collective save, a failed write (checkpoint section)
  StepLogger (monitor/metrics_log)      metrics.jsonl, TensorBoard, progress bar (logging section)
  StopVote (run/stop_signal)            any replica signalled -> all stop at the same step
The whole config goes only where a record of it is the point: the resume keys a checkpoint
keeps (run/checkpointing.resume_keys) and the W&B run's config.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from finetuning_pipeline.distributed.parallel import Parallel
from finetuning_pipeline.model.activation_checkpointing import checkpointing_mode, enable_activation_checkpointing
from finetuning_pipeline.model.lineage import lineage_with, quantized_with
from finetuning_pipeline.model.loading import DTYPES, load_model
from finetuning_pipeline.model.preference_loss import (
    BASE_REFERENCE,
    REFERENCE_ADAPTER,
    REFERENCE_FREE,
    PreferenceObjective,
    PreferenceSettings,
)
from finetuning_pipeline.model.quantized_base import quantized_summary
from finetuning_pipeline.monitor.compile_guard import CompileGuard
from finetuning_pipeline.monitor.divergence import DivergenceMonitor
from finetuning_pipeline.monitor.metrics_log import MetricsLog, StepLogger
from finetuning_pipeline.run.checkpointing import Checkpointer, load_checkpoint, load_optimizer_state, resume_keys
from finetuning_pipeline.run.run_layout import RunLayout
from finetuning_pipeline.run.stop_signal import StopVote
from finetuning_pipeline.run_config import LoggingConfig, ModelConfig, PreferenceConfig, RunConfig
from finetuning_pipeline.train.adamw import MaskedAdamW
from finetuning_pipeline.train.adapter_results import side_by_side_results
from finetuning_pipeline.train.eval_loop import describe_eval, evaluate_loss, evaluate_pairs
from finetuning_pipeline.train.phase_data import PhaseData
from finetuning_pipeline.train.reference_logps import compute_reference_logps, kept_reference_logps
from finetuning_pipeline.train.stepper import Stepper
from lora_logic.adapters import (
    adapter_groups,
    is_embedding_weight,
    is_whole_module_weight,
    lora_modules,
    lora_parameters,
    named_lora_parameters,
    only_adapter,
)
from lora_logic.config import DEFAULT_ADAPTER, LoraConfig
from lora_logic.inject import inject_lora
from lora_logic.modules_to_save import saved_modules
from utils.hub_models import model_dir
from utils.tokenizer_loading import load_extended_tokenizer

# Replicas that are threads of one process (the TPU launcher: TPU v2/v3, the CPU rehearsal) share the
# host's RNGs (LoRA's init draws from torch's global generator) and transformers' lazy imports,
# which are not thread-safe (measured: "cannot import name 'AutoModelForCausalLM'" in one of two
# threads). They build their models one at a time, each from the same seed, as processes would.
HOST_BUILD = threading.Lock()


def seed_everything(seed: int) -> None:
    """The host RNGs (LoRA init, data order); the XLA RNG is seeded at every step (step_seed)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_model(model_settings: ModelConfig, adapters: dict[str, LoraConfig], *, merged: list[Path],
                continued: Path | None, tokenizer=None):
    """The base model (on CPU) with this phase's set of adapters; returns (model, {adapter: config}).

    adapters: the phase's adapters, {name: config} (RunConfig.adapters): one, or several trained
    side by side, each starting as it would alone (lora_logic/inject.py).
    merged: earlier phases' adapters folded into the base weights, in order; continued: the
    adapter this phase trains further (its own r/alpha/targets), or None to start `adapters`
    fresh (RunConfig.lineage says which, from the phases' `init`).
    tokenizer: the tokenizer model.new_tokens extended (extended_tokenizer), or None: their rows
    added to the base first (new_tokens.py), and a fresh adapter that trains no embeddings
    otherwise trains theirs (lora.trainable_token_indices).
    """
    dtype = DTYPES[model_settings.dtype]
    files = model_dir(model_settings.path, model_settings.revision)  # a Hub id: its snapshot, pinned by main.py
    tokenizer_dir = model_settings.tokenizer or files
    new_ids = tokenizer.convert_tokens_to_ids(model_settings.new_tokens) if tokenizer is not None else []
    earlier = merged + ([continued] if continued else [])
    model, continued_config = load_model(files, earlier, dtype, keep_last=continued is not None,
                                         quantize=model_settings.quantize, tokenizer=tokenizer_dir,
                                         token_rows=(new_ids[0], len(new_ids)) if new_ids else None)
    if model_settings.activation_checkpointing:
        enable_activation_checkpointing(model, checkpointing_mode(model_settings.activation_checkpointing))
    if continued is not None:
        return model, continued_config
    if new_ids:
        adapters = {name: with_new_token_rows(config, model, new_ids) for name, config in adapters.items()}
    inject_lora(model, adapters)
    return model, adapters


def extended_tokenizer(model_settings: ModelConfig):
    """The run's tokenizer extended by model.new_tokens (written beside each phase's adapter), or
    None without new tokens."""
    if not model_settings.new_tokens:
        return None
    files = model_dir(model_settings.path, model_settings.revision)
    return load_extended_tokenizer(model_settings.tokenizer or files,
                                   "model.tokenizer" if model_settings.tokenizer else "model.path",
                                   model_settings.new_tokens, "model.new_tokens")


def with_new_token_rows(config: LoraConfig, model, new_ids: list[int]) -> LoraConfig:
    """`config`, training the new tokens' rows where it trains no embeddings of its own: the input
    embedding's and an untied output layer's (a tied one shares them)."""
    if config.modules_to_save or config.trainable_token_indices is not None:
        return config
    names = {id(m): n for n, m in model.named_modules()}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    rows = list(new_ids)
    if head is not None and head.weight is not embedding.weight:
        rows = {names[id(embedding)]: list(new_ids), names[id(head)]: list(new_ids)}
    return dataclasses.replace(config, trainable_token_indices=rows)


def preference_objective(model, settings: PreferenceConfig, continues: bool) -> PreferenceObjective:
    """A preference phase's loss, its reference in the model: with reference auto and a continued
    adapter, a frozen copy of that adapter as it is now, beside it in every layer it adapts
    (REFERENCE_ADAPTER); otherwise the base the phase's adapter is on (BASE_REFERENCE)."""
    reference = BASE_REFERENCE
    if settings.reference == "auto" and continues and settings.loss not in REFERENCE_FREE:
        for _, module in [*lora_modules(model), *saved_modules(model)]:  # (modules trained in full too)
            module.add_frozen_copy(DEFAULT_ADAPTER, REFERENCE_ADAPTER)
        reference = REFERENCE_ADAPTER
    return PreferenceObjective(PreferenceSettings(settings.loss, settings.beta), reference)


def precompute_reference(data: PhaseData, objective: PreferenceObjective, path: Path, *, model, device,
                         parallel: Parallel, runtime, resuming: bool, phase: int) -> None:
    """The training pairs' reference log-probabilities, computed once (or read again on a resume)
    and attached to the phase's batches (train/reference_logps.py)."""
    (data_dir,) = data.dirs.values()  # (one adapter a preference phase: input_checks)
    pairs = data.manifests[next(iter(data.dirs))]["counts"]["train"]
    values, read = kept_reference_logps(
        path, pairs, lambda: compute_reference_logps(
            model, objective.reference, data_dir, micro_batch=data.eval_micro_batch, pad_id=data.pad_id,
            device=device, to_device=runtime.to_device, boundary=runtime.step_boundary,
            input_sharding=parallel.input_sharding()),
        resuming=resuming, master=parallel.master)
    data.attach_reference_logps(values)
    if parallel.master:
        print(f"phase {phase}: the reference log-probabilities of {pairs} pairs "
              f"{'read from' if read else 'computed once, kept in'} {path}", flush=True)


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
    runtime: object  # what executes the steps (runtime/protocol.py's Runtime)
    model: torch.nn.Module
    lora_config: dict  # the phase's set of adapters, {name: LoraConfig}
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
    parallelized: object  # what the runtime did to the model (runtime/protocol.py's Parallelized)
    resume_keys: dict  # what the phase is built on (checkpointing.resume_keys), fixed for the phase
    merged_adapters: list[str]  # earlier phases' adapters merged into the base beneath this one's, in order
    trained_on: dict  # the base and those adapters by content, recorded with the phase's adapters (lineage.py)
    accepted_changes: dict  # settings changed at a resume with --accept-changes: {key: [saved, now]}
    adapters: dict[str, int]  # adapters side by side, in their rows' order -> their max_steps ({}: one adapter)
    quantized_base: dict | None  # model.quantize's decoder Linears (quantized_base.quantized_summary), or None
    activation_checkpointing: str | None  # the mode its decoder layers were checkpointed in (full, selective), or None
    objective: object = None  # a preference phase's loss (model/preference_loss.PreferenceObjective), or None
    tokenizer: object = None  # the tokenizer model.new_tokens extended: written beside the adapter; else None

    def evaluate(self) -> dict:
        """The eval loss; side by side, each adapter's on its own data (alone on every row), and
        their token-weighted mean at the top (side_by_side_results)."""
        each = {}
        for name, data_dir in self.data.dirs.items():
            with only_adapter(self.model, name):
                each[name] = self._evaluate(data_dir)
        return side_by_side_results(each) if self.adapters else each[DEFAULT_ADAPTER]

    def _evaluate(self, data_dir: str) -> dict:
        if self.objective is not None:
            return evaluate_pairs(self.model, data_dir, self.objective, micro_batch=self.data.eval_micro_batch,
                                  pad_id=self.data.pad_id, device=self.device, max_batches=self.eval_max_batches,
                                  collectives=self.parallel.collectives, input_sharding=self.parallel.input_sharding(),
                                  replicate=self.parallel.replicate, to_device=self.runtime.to_device,
                                  boundary=self.runtime.step_boundary)
        return evaluate_loss(self.model, data_dir, micro_batch=self.data.eval_micro_batch, pad_id=self.data.pad_id,
                             packed=self.data.packed, device=self.device, max_batches=self.eval_max_batches,
                             loss_chunk=self.stepper.loss_chunk,
                             collectives=self.parallel.collectives, input_sharding=self.parallel.input_sharding(),
                             replicate=self.parallel.replicate, to_device=self.runtime.to_device,
                             boundary=self.runtime.step_boundary)

    def trainer_state(self) -> dict:
        """What a checkpoint records besides weights and optimizer, as of the step just run."""
        return {"phase": self.number, "eval_before": self.eval_before, **self.logger.state_dict(),
                **self.monitor.state_dict(), "global_batch": self.data.batches_per_step, "chips": self.parallel.chips,
                "resume_keys": self.resume_keys, "accepted_changes": self.accepted_changes}

    def save(self, step: int, state: dict | None = None) -> None:
        state = state if state is not None else self.trainer_state()
        self.checkpointer.save(step, model=self.model, optimizer=self.optimizer, trainer_state=state)


def start_phase(config: RunConfig, phase: int, parallel: Parallel, device, resume_from: Path | None,
                stop_requested, accepted_changes: dict | None = None, *, runtime) -> Phase:
    """Model, optimizer, data and the loop's parts, resumed from `resume_from` when given, with
    the phase's first evaluation done (or taken from the checkpoint). runtime: what executes the
    steps (runtime/protocol.py)."""
    t, layout = config.train, RunLayout(config.output_dir)
    guard = CompileGuard(phase, t.warmup_compiles_steps, t.recompile_policy, runtime)  # counts from here
    merged, continued = config.lineage(phase)
    adapters = list(config.phase(phase).adapters)
    # First: its batch checked against the data on the devices now known, before a 7B is loaded
    data = PhaseData(config.data_dirs(phase), train=t, eval=config.eval, parallel=parallel, phase=phase)
    with HOST_BUILD:
        seed_everything(t.seed + phase)
        tokenizer = extended_tokenizer(config.model)
        model, lora_config = build_model(config.model, config.adapters(phase), tokenizer=tokenizer,
                                         merged=[layout.adapter(n) for n in merged],
                                         continued=layout.adapter(continued) if continued else None)
        # A preference phase's reference: the adapter as the phase starts (before a checkpoint's
        # weights are loaded into it), or the base.
        objective = preference_objective(model, config.phase(phase).preference, continued is not None) \
            if data.preference else None
        # The resumed adapter goes into the layers before they are stacked (on the host), the
        # optimizer's moments into the optimizer built on the stacks.
        state = load_checkpoint(resume_from, model=model) if resume_from else {}
        quantized = quantized_summary(model)  # before the runtime reshapes the layers (parallelize)
    checkpointer = Checkpointer(layout.checkpoints(phase), every=config.checkpoint.every, keep=config.checkpoint.keep,
                                collectives=parallel.collectives, base_model=config.model.path, lora_config=lora_config,
                                sync=runtime.step_boundary)
    checkpointer.clean()
    parallelized = runtime.parallelize(model, config, parallel, device, data.seq_len)
    if parallel.master:
        print(f"phase {phase}: {parallelized.description}", flush=True)
        if quantized:
            size, bf16 = quantized["weight_bytes"], quantized["bf16_bytes"]
            print(f"phase {phase}: base quantized: {quantized['linears']} decoder Linears in {quantized['format']}, "
                  f"{size / 2**20:,.1f} MiB ({size / bf16:.2f}x their bf16 size)", flush=True)
    if objective is not None and config.phase(phase).preference.precompute_reference:
        precompute_reference(data, objective, layout.reference_logps(phase), model=model, device=device,
                             parallel=parallel, runtime=runtime, resuming=resume_from is not None, phase=phase)
    model.train()
    # One optimizer; side by side, a group per adapter (adamw.py).
    groups = adapter_groups(model) if adapters else None
    # The modules trained in full take train.embedding_lr: a multiple of the phase's LR schedule.
    embedding_scale = (t.embedding_lr or config.lr(phase)) / config.lr(phase)
    optimizer = MaskedAdamW(lora_parameters(model), lr=config.lr(phase), betas=tuple(t.betas), eps=t.eps,
                            weight_decay=t.weight_decay, groups=groups,
                            lr_scales=[embedding_scale if is_embedding_weight(n) else 1.0
                                       for n, _ in named_lora_parameters(model)])
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
                      device=device, start_step=start_step, packed=data.packed, runtime=runtime, objective=objective)
    if monitor.diverged:  # adapters stopped before the checkpoint stay stopped
        stepper.disable([adapters.index(name) for name in monitor.diverged])
    if parallel.master and stepper.note:
        print(f"phase {phase}: {stepper.note}", flush=True)
    logger = make_logger(config.logging, layout=layout, phase=phase, max_steps=config.max_steps(phase),
                         master=parallel.master, tokens_per_step=data.tokens_per_step, start_step=start_step,
                         resume_from=resume_from, state=state, run_settings=config.to_dict())
    p = Phase(number=phase, max_steps=config.max_steps(phase), layout=layout, base_model=config.model.path,
              base_revision=config.model.revision, eval_max_batches=config.eval.max_batches, parallel=parallel,
              device=device, runtime=runtime, model=model, lora_config=lora_config, optimizer=optimizer, data=data,
              stepper=stepper, guard=guard, monitor=monitor, checkpointer=checkpointer, logger=logger,
              stop=StopVote(parallel.collectives, stop_requested), start_step=start_step,
              resumed=resume_from is not None, eval_before=state.get("eval_before"), parallelized=parallelized,
              resume_keys=resume_keys(config, phase, data.manifests),
              merged_adapters=[str(layout.adapter(n)) for n in merged],
              trained_on=quantized_with(lineage_with(model_dir(config.model.path, config.model.revision),
                                                     [layout.adapter(n) for n in merged], config.model.path,
                                                     config.model.revision), config.model.quantize, config.model.dtype),
              accepted_changes={**state.get("accepted_changes", {}), **(accepted_changes or {})},
              adapters={name: config.adapter_max_steps(phase, name) for name in adapters}, quantized_base=quantized,
              activation_checkpointing=checkpointing_mode(config.model.activation_checkpointing), objective=objective,
              tokenizer=tokenizer)
    if p.eval_before is None:
        p.eval_before = p.evaluate()
        p.logger.log_eval(0, p.eval_before)
    if parallel.master and p.eval_before["loss"] is None:
        print(f"phase {phase}: {describe_eval(p.eval_before)}; the summary will have no eval loss", flush=True)
    moments = optimizer.state_tensors()[1:]  # (the flat exp_avg and exp_avg_sq)
    whole = any(is_whole_module_weight(name) for name, _ in named_lora_parameters(model))
    parallel.replicate(optimizer.params + optimizer.state_tensors()[:1] + (moments if not whole else [])
                       + optimizer.device_constants() + stepper.device_state() + monitor.device_state())
    if whole:  # embeddings trained whole: their AdamW state split over the chips (runtime/xla/spmd.py)
        parallel.shard_optimizer_state(moments)
    # A resumed run's checkpoint was copied into parameters and optimizer state: run those
    # copies now, or they would join step 1's graph and make it a graph of its own.
    runtime.step_boundary()
    return p


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
                      state.get("adapter_losses"),
                      print_steps_as=f"phase {phase}" if master and not logging.progress_bar else None)
