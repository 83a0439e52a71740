"""The training loop of one phase, run by every replica (one process per TPU chip).

Per optimizer step: `grad_accum` micro-batches arrive on the device (MpDeviceLoader prefetches
them on a background thread), `step.train_step` builds forwards, backwards, gradient
averaging, clipping and the masked AdamW update into one lazy graph, and `torch_xla.sync()`
marks the step boundary. Logging reads loss and grad norm in a step closure after the step has
run, so no step waits on the host between log steps. After `train.warmup_compiles_steps`
steps every step must replay a compiled graph: a new compile is a bug (a shape or a Python
scalar that changes), and by default stops the run.

Stopping: a step with a non-finite loss or gradient norm is skipped on the device and counted;
`train.max_bad_steps` in a row stop the run (the last good checkpoint stays). A stop request
(SIGTERM/SIGINT, see main.py) is honoured at the next step boundary: every replica
checkpoints, and the phase returns {"stopped_at_step": N}.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import numpy as np
import torch

from dataset.loader import ShardLoader, iter_eval_batches
from dataset.manifest import is_packed, read_manifest
from finetuning_pipeline.activation_checkpointing import enable_activation_checkpointing
from finetuning_pipeline.adamw import MaskedAdamW
from finetuning_pipeline.checkpointing import (
    clean_partial_checkpoints,
    complete_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from finetuning_pipeline.config import RunConfig
from finetuning_pipeline.lr_schedule import lr_table
from finetuning_pipeline.metrics_log import MetricsLog
from finetuning_pipeline.parallel import Parallel
from finetuning_pipeline.step import eval_sums, train_step
from lora_logic import LoraConfig, inject_lora, load_adapter, lora_parameters, merge_and_unload, save_adapter
from utils.atomic_io import atomic_write_json
from utils.xla_counters import read_counters

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def counter(value: float, device) -> torch.Tensor:
    """A [1]-shaped fp32 counter that reaches the device as data (see device_zeros)."""
    return torch.tensor([float(value)]).to(device)


def to_host(*tensors: torch.Tensor) -> list[float]:
    """Values of materialised device tensors, by plain transfers. (`torch.stack(...).cpu()`
    would first compile and run a small graph of its own.)"""
    return [t.cpu().item() for t in tensors]


class RunError(RuntimeError):
    """The run had to stop; the message says why and what to do (main.py exits with 3)."""


class RecompileError(RunError):
    pass


class TrainingDiverged(RunError):
    pass


class CheckpointWriteError(RunError):
    pass


def phase_dir(config: RunConfig, phase: int) -> Path:
    return Path(config.output_dir) / f"phase{phase}"


def seed_everything(seed: int) -> None:
    """The host RNGs (LoRA init, data order); the XLA RNG is seeded at every step (step_seed)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def step_seed(seed: int, phase: int, rank: int, step: int) -> int:
    """The XLA RNG seed of one training step (distinct per phase, replica and step; < 2**63)."""
    return (((seed * 3 + phase) * 1_000_003 + rank) * 1_000_000_007 + step) % (2**63 - 1)


def build_model(config: RunConfig, phase: int):
    """The base model (on CPU) with this phase's LoRA; returns (model, lora config).

    Phase 2 `continue` trains the phase-1 adapter further (its own r/alpha/targets);
    `merge` folds it into the base and starts config.lora fresh; `fresh` ignores phase 1.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=DTYPES[config.model.dtype])
    model.config.use_cache = False
    if config.model.gradient_checkpointing:
        enable_activation_checkpointing(model)
    lora_config = config.lora_config()
    if phase == 2 and config.phase2.init in ("continue", "merge"):
        loaded = load_adapter(model, phase_dir(config, 1) / "adapter")
        if config.phase2.init == "continue":
            return model, loaded
        merge_and_unload(model)
    inject_lora(model, lora_config)
    return model, lora_config


def evaluate(model, config: RunConfig, data_dir: str, manifest: dict, parallel: Parallel, device) -> dict:
    """Mean loss per label token and perplexity over the eval split (every replica's share)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    micro_batch = (config.eval.micro_batch or config.train.micro_batch) * parallel.chips_per_process
    packed, pad_id = is_packed(manifest), manifest["tokenizer"]["pad_id"]
    was_training = model.training
    model.eval()
    loss_sum, count = counter(0, device), counter(0, device)  # data: every batch runs one graph
    parallel.replicate([loss_sum, count])
    batches = iter_eval_batches(data_dir, micro_batch, pad_id=pad_id, rank=parallel.rank, world_size=parallel.world)
    sharding = parallel.input_sharding()
    for index, batch in enumerate(batches):
        if config.eval.max_batches is not None and index >= config.eval.max_batches:
            break
        batch_loss, batch_count = eval_sums(model, xm.send_cpu_data_to_device(batch, device, sharding), packed)
        loss_sum = loss_sum + batch_loss
        count = count + batch_count
        torch_xla.sync()  # one small graph per batch, the same every time
    if parallel.explicit_reduce:
        xm.all_reduce(xm.REDUCE_SUM, [loss_sum, count])
        torch_xla.sync()
    total_loss, total_count = to_host(loss_sum, count)  # the one host sync of an evaluation
    model.train(was_training)
    loss = total_loss / max(total_count, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "label_tokens": int(total_count)}


def run_phase(config: RunConfig, phase: int, *, parallel: Parallel, device, resume_from: Path | None,
              stop_requested=lambda: False) -> dict | None:
    """Train one phase on this replica; the master writes adapter, metrics, checkpoints and
    summary. Returns the summary on the master ({"stopped_at_step": N} after a stop request),
    None elsewhere."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl

    master = parallel.master
    out = phase_dir(config, phase)
    phase_cfg = config.phase(phase)
    t = config.train
    max_steps = config.max_steps(phase)
    peak_lr = config.lr(phase)
    started = time.perf_counter()
    counters_before = read_counters()

    seed_everything(t.seed + phase)
    model, lora_config = build_model(config, phase)
    sharded = parallel.place_model(model, device)
    model.train()
    params = lora_parameters(model)
    optimizer = MaskedAdamW(params, lr=peak_lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay)

    manifest = read_manifest(phase_cfg.data)
    seq_len = manifest["seq_len"]
    packed = is_packed(manifest)
    # Under fsdp a process reads the batches of all its chips; the global batch is the same
    # sequence of blocks as dp over the same number of chips.
    loader = ShardLoader(phase_cfg.data, t.micro_batch * parallel.chips_per_process, seed=t.seed,
                         rank=parallel.rank, world_size=parallel.world)
    batches_per_step = t.grad_accum * parallel.chips * t.micro_batch  # global blocks consumed per step
    tokens_per_step = batches_per_step * seq_len

    start_step, state = 0, {}
    if master:
        clean_partial_checkpoints(out / "checkpoints")
    if resume_from is not None:
        state = load_checkpoint(resume_from, model=model, optimizer=optimizer)
        start_step = state["step"]
        if state.get("global_batch", batches_per_step) != batches_per_step:
            raise RunError(f"{resume_from} was saved with a global batch of {state['global_batch']} sequences, this "
                           f"run has {batches_per_step} ({parallel.chips} chips); resume with the same chips and batch")
    loader.position = start_step * batches_per_step  # what the steps so far consumed
    log = None
    if master:
        tb = out / "tb" if config.logging.tensorboard else None
        log = MetricsLog(out / "metrics.jsonl", tb, resume_step=start_step if resume_from else None)

    eval_before = state.get("eval_before") or evaluate(model, config, phase_cfg.data, manifest, parallel, device)
    if master and resume_from is None:
        log.write({"kind": "eval", "step": 0, **eval_before})

    progress = None
    if master and config.logging.progress_bar:
        from tqdm import tqdm

        progress = tqdm(total=max_steps, initial=start_step, desc=f"phase {phase}", unit="step", dynamic_ncols=True)
    shown: dict = {"first_loss": state.get("train_loss_first"), "worst_bad_run": 0}

    # Device-side counters of skipped steps: read only at log steps.
    skipped_total = counter(state.get("skipped_steps", 0), device)
    bad_run = counter(0, device)
    worst_bad_run = counter(0, device)

    def log_step(step: int, results: dict, lr, steps_left: int, skipped, worst) -> None:
        # A step closure: runs once the step's graph has been issued; reading the results
        # waits for that step only, on log steps only. Every replica runs it (same values:
        # losses are all-reduced), so every replica takes the same stop decision.
        values = to_host(results["loss"], results["grad_norm"], results["tokens"], skipped, worst, lr)
        now = time.perf_counter()
        previous_time, previous_step = shown.get("time"), shown.get("step")
        rate = (step - previous_step) * tokens_per_step / (now - previous_time) if previous_time else None
        shown.update(time=now, step=step, rate=rate, skipped=int(values[3]), worst_bad_run=int(values[4]))
        if step == 1:
            shown["first_loss"] = values[0]
        if not master:
            return
        record = {"kind": "train", "step": step, "loss": values[0], "lr": values[5], "grad_norm": values[1],
                  "label_tokens": int(values[2]), "skipped_steps": int(values[3])}
        if rate:
            record["tokens_per_sec"] = round(rate, 1)
            record["eta_s"] = round(steps_left * tokens_per_step / rate, 1)
        log.write(record)
        if progress is not None:
            progress.set_postfix(loss=f"{values[0]:.4f}", tok_s=f"{rate:,.0f}" if rate else "-", refresh=False)

    def trainer_state() -> dict:
        return {"phase": phase, "eval_before": eval_before, "train_loss_first": shown["first_loss"],
                "skipped_steps": shown.get("skipped", 0), "global_batch": batches_per_step,
                "exactness": config.exactness_keys(phase)}

    # The step count indexes the schedule: an integer [1] on the device (see device_zeros).
    step_count = torch.tensor([start_step]).to(device)
    schedule = lr_table(peak=peak_lr, warmup_steps=t.warmup_steps, total_steps=max_steps,
                        min_lr_ratio=t.min_lr_ratio).to(device)
    label_tokens = counter(0, device)
    # No gradient buffers between steps: each step's first backward creates them and the
    # optimizer drops them (the same graph every step, and they are never graph outputs).
    parallel.replicate(params + optimizer.state_tensors()
                       + [step_count, schedule, label_tokens, skipped_total, bad_run, worst_bad_run])
    # A resumed run's checkpoint was copied into parameters and optimizer state: run those
    # copies now, or they would join step 1's graph and make it a graph of its own.
    torch_xla.sync()
    # We mark every step ourselves; by default the loader would also sync at each next().
    device_loader = pl.MpDeviceLoader(loader, device, batches_per_execution=1 << 30,
                                      input_sharding=parallel.input_sharding())
    batches = iter(device_loader)
    compiles_after_warmup = host_syncs_after_warmup = steps_after_warmup = 0
    data_wait = 0.0
    warm_time = None
    last_loss = None
    step = start_step
    stopped = False
    while step < max_steps:
        before = read_counters()
        wait_start = time.perf_counter()
        # Fetch first: MpDeviceLoader's next() marks a step itself, which would cut anything
        # already traced for this step (the LR below) into a graph of its own.
        micro_batches = [next(batches) for _ in range(t.grad_accum)]
        waited = time.perf_counter() - wait_start
        # The random numbers of step k (LoRA and attention dropout) depend on (seed, phase,
        # rank, k) only, so a resumed run draws the masks the uninterrupted one drew: restoring
        # torch_xla's saved RNG state did not (same state read back, different masks: verified
        # with lora.dropout 0.1). A new seed each step is data for the graph, not a recompile.
        xm.set_rng_state(step_seed(t.seed, phase, parallel.rank, step), device=device)
        optimizer.lr = schedule[step_count]
        results = train_step(model, optimizer, micro_batches, max_grad_norm=t.max_grad_norm,
                             reduce_across_replicas=parallel.explicit_reduce, packed=packed)
        label_tokens = label_tokens + results["tokens"]
        bad = (~results["applied"]).to(torch.float32)
        skipped_total = skipped_total + bad
        bad_run = (bad_run + 1) * bad  # consecutive skipped steps, 0 after a good one
        worst_bad_run = torch.maximum(worst_bad_run, bad_run)
        step_count = step_count + 1
        step += 1
        log_now = step % config.logging.every == 0 or step == max_steps or step == start_step + 1
        if log_now:
            xm.add_step_closure(log_step, args=(step, results, optimizer.lr, max_steps - step,
                                                skipped_total, worst_bad_run))
        last_loss = results["loss"]
        torch_xla.sync()
        delta = read_counters() - before
        if step == start_step + t.warmup_compiles_steps:
            # Warm-up done: the clock starts once its steps have run. (Between step boundaries
            # the host may run several steps ahead of the device, so only the time to the
            # end of the last step's execution measures the steps.)
            xm.wait_device_ops()
            warm_time = time.perf_counter()
        if step > start_step + t.warmup_compiles_steps:
            steps_after_warmup += 1
            data_wait += waited
            host_syncs_after_warmup += delta.host_syncs
            if delta.compiles:
                compiles_after_warmup += delta.compiles
                message = (f"phase {phase} step {step}: {delta.compiles} new XLA graph(s) compiled after warm-up "
                           "(a changing shape or Python scalar); rerun with PT_XLA_DEBUG_LEVEL=2 to see the cause")
                if t.recompile_policy == "error":
                    raise RecompileError(message)
                print(f"warning: {message}", flush=True)
        if progress is not None:
            progress.update(1)
        if log_now and shown["worst_bad_run"] >= t.max_bad_steps:
            latest = complete_checkpoints(out / "checkpoints")
            raise TrainingDiverged(
                f"phase {phase} stopped at step {step}: {shown['worst_bad_run']} consecutive steps had a non-finite "
                f"loss or gradient norm (train.max_bad_steps={t.max_bad_steps}); their updates were skipped, nothing "
                f"non-finite was saved. Last good checkpoint: {latest[-1] if latest else 'none'}. Lower train.lr or "
                "check the data, then resume with --resume auto"
            )
        if config.eval.every and step % config.eval.every == 0 and step < max_steps:
            result = evaluate(model, config, phase_cfg.data, manifest, parallel, device)
            if log is not None:
                log.write({"kind": "eval", "step": step, **result})
        # One host vote per log step (a vote is a round trip between hosts); alone, every step.
        stopped = parallel.any_process(stop_requested(), f"stop-{step}") if (parallel.world == 1 or log_now) else False
        if (config.checkpoint.every and step % config.checkpoint.every == 0 and step < max_steps) or stopped:
            checkpoint(model, optimizer, lora_config, config, out, step, trainer_state(), parallel)
        if stopped:
            break

    xm.wait_device_ops()
    train_seconds = time.perf_counter() - (warm_time or started)
    if progress is not None:
        progress.close()
    if stopped:
        if log is not None:
            log.close()
        return {"phase": phase, "stopped_at_step": step} if master else None

    eval_after = evaluate(model, config, phase_cfg.data, manifest, parallel, device)
    final_state = trainer_state()
    checkpoint(model, optimizer, lora_config, config, out, step, final_state, parallel)
    totals = to_host(last_loss, label_tokens) if last_loss is not None else [None, 0]
    if not master:
        return None
    log.write({"kind": "eval", "step": step, **eval_after})
    log.close()
    save_adapter(model, out / "adapter", lora_config, config.model.path)
    timed_steps = steps_after_warmup if warm_time is not None else step - start_step
    counters = read_counters()
    summary = {
        "phase": phase,
        "steps": step,
        "resumed_from_step": start_step if resume_from else None,
        "tokens": step * tokens_per_step,
        "label_tokens_this_run": int(totals[1]),
        "skipped_steps": final_state["skipped_steps"],
        "train_loss_first": final_state["train_loss_first"],
        "train_loss_last": totals[0],
        "eval_loss_before": eval_before["loss"],
        "eval_loss_after": eval_after["loss"],
        "perplexity_before": eval_before["perplexity"],
        "perplexity_after": eval_after["perplexity"],
        "tokens_per_sec": round(timed_steps * tokens_per_step / train_seconds, 1) if timed_steps else None,
        "step_time_s": round(train_seconds / timed_steps, 4) if timed_steps else None,
        "data_wait_fraction": round(data_wait / train_seconds, 4) if steps_after_warmup else None,
        "compiles_total": counters.compiles - counters_before.compiles,
        # With the persistent cache warm, "compiles" load executables from disk: fast.
        "compile_seconds": round(counters.compile_seconds - counters_before.compile_seconds, 2),
        "compiles_after_warmup": compiles_after_warmup,
        "host_syncs_per_step": host_syncs_after_warmup / steps_after_warmup if steps_after_warmup else None,
        "wall_time_s": round(time.perf_counter() - started, 2),
        "world_size": parallel.world,
        "parallel": {**parallel.describe(), "sharded_base_parameters": len(sharded)},
        "seq_len": seq_len,
        "global_batch": batches_per_step,
    }
    atomic_write_json(out / "summary.json", summary)  # written last: marks the phase as done
    return summary


def checkpoint(model, optimizer, lora_config: LoraConfig, config: RunConfig, out: Path, step: int,
               state: dict, parallel: Parallel) -> None:
    """Every replica reaches this together; the master writes; all wait for it."""
    import torch_xla

    torch_xla.sync()
    if parallel.master:
        root = out / "checkpoints"
        try:
            save_checkpoint(root, step, model=model, optimizer=optimizer, lora_config=lora_config,
                            base_model=config.model.path, trainer_state=state, keep=config.checkpoint.keep)
        except OSError as err:
            latest = complete_checkpoints(root)
            raise CheckpointWriteError(
                f"could not write checkpoint step {step} under {root}: {err.strerror or err}. "
                f"{'The previous checkpoint ' + str(latest[-1]) + ' is intact' if latest else 'No earlier checkpoint exists'}; "
                "free space (or fix permissions) and rerun with --resume auto"
            ) from None
    parallel.barrier(f"checkpoint-{step}")

