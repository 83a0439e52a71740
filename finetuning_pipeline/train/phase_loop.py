"""The training loop of one phase, run by every replica (one process per chip under dp, one per
host under XLA's fsdp), and its end: the final evaluation, checkpoint, adapters and summary.

Per optimizer step: `grad_accum` micro-batches arrive on the device (`runtime.device_batches`),
the `Stepper` runs forwards, backwards, the sums over replicas, clipping and the masked AdamW
update the runtime's way (runtime/protocol.py: on XLA one graph traced at step 1 and replayed
after; natively PyTorch as it goes), and `runtime.step_boundary()` marks the step's end. Nothing
in a step waits for the device: logging reads the step's results after the step
(`runtime.after_step`) on log steps, and the stop vote is a host collective on a host flag.
Between steps the host waits for the step before the one it just dispatched (run_ahead.py), so
that a stop is never queued behind more than two steps. The phase's parts are built by
`start_phase` (phase_start.py). Each decision is taken from values every replica has (all-reduced losses,
voted flags), so every replica takes it at the same step by construction.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from finetuning_pipeline.distributed.parallel import Parallel
from finetuning_pipeline.errors import SEE_THE_MASTERS, OutputWriteError
from finetuning_pipeline.model.lineage import write_lineage
from finetuning_pipeline.model.preference_loss import BASE_REFERENCE, REFERENCE_FREE, metrics_of
from finetuning_pipeline.monitor.divergence import DivergenceMonitor
from finetuning_pipeline.monitor.metrics_log import StepLogger
from finetuning_pipeline.run.checkpointing import checkpoint_step
from finetuning_pipeline.run.stop_signal import StopVote
from finetuning_pipeline.run_config import RunConfig
from finetuning_pipeline.train.adapter_results import weighted_mean
from finetuning_pipeline.train.phase_start import Phase, start_phase
from finetuning_pipeline.train.run_ahead import RunAheadBound
from lora_logic.adapter_io import save_adapters
from lora_logic.adapters import is_whole_module_weight
from utils.atomic_io import atomic_write_json
from utils.device_tensors import to_host


@dataclass
class PhaseResult:
    """What a phase returns on every replica: stopped_at_step after a stop request; the
    summary (master only) when the phase finished."""

    phase: int
    stopped_at_step: int | None = None
    summary: dict | None = None
    # A stop signal during the phase's start, before its first step here: the step it would have
    # started from (0, or its checkpoint's); nothing trained, nothing written
    stopped_before_step: int | None = None


def run_phase(config: RunConfig, phase: int, *, parallel: Parallel, device, resume_from: Path | None,
              stop_requested=lambda: False, signalled=lambda: False, accepted_changes: dict | None = None,
              runtime) -> PhaseResult:
    """Train one phase on this replica; the master writes adapter, metrics, checkpoints and summary.
    stop_requested: asked after each step (a signal, the session budget); signalled: a stop signal
    alone, asked before the model is built and again before the first step, so that a stop during
    the start (minutes for a 7B's weights, the first evaluation) is honoured before a step is
    compiled. Both are voted on: every replica stops at the same place.
    accepted_changes: settings changed at this resume (main.py --accept-changes), recorded.
    runtime: what executes the steps, torch_xla's or native PyTorch's (runtime/protocol.py)."""
    if StopVote(parallel.collectives, signalled).due():
        return PhaseResult(phase, stopped_before_step=checkpoint_step(resume_from))
    p = start_phase(config, phase, parallel, device, resume_from, stop_requested, accepted_changes, runtime=runtime)
    if StopVote(parallel.collectives, signalled).due():
        p.logger.close()
        return PhaseResult(phase, stopped_before_step=p.start_step)
    # Closed on every way out (a stop, an error): its threads hold phase data until joined.
    with contextlib.closing(runtime.device_batches(p.data, device)) as batches:
        run_ahead = RunAheadBound()
        step = p.start_step
        while step < p.max_steps:
            p.guard.step_started()
            # Fetch first: the loader's next() marks a step itself, which would cut anything
            # already traced for this step (the LR) into a graph of its own.
            micro_batches = [next(batches) for _ in range(config.train.grad_accum)]
            p.guard.data_ready()
            with p.guard.counting_host_syncs(step + 1):
                results = p.stepper(step, micro_batches)
            p.monitor.update(results["applied"], results.get("skipped"))
            step += 1
            # (and each adapter's last step side by side: its summary's last training loss)
            log_now = (step % config.logging.every == 0 or step == p.max_steps or step == p.start_step + 1
                       or step in p.adapters.values())
            if log_now:
                runtime.after_step(log_step, (p.logger, p.monitor, step, results, p.monitor.skipped,
                                              p.monitor.worst_bad_run, p.adapters))
            runtime.step_boundary()
            run_ahead.dispatched(p.stepper.step_count)  # (a tensor this step's graph computed)
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


def finish_phase(p: Phase, step: int, last_loss) -> PhaseResult:
    """The final evaluation and checkpoint (every replica); adapter and summary (the master)."""
    p.runtime.wait()
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
        raise OutputWriteError(f"the master could not write phase {p.number}'s adapter or summary {SEE_THE_MASTERS}; "
                               "fix the disk and rerun with --resume auto")
    return PhaseResult(p.number, summary=summary)


def parallel_summary(p: Phase) -> dict:
    """The summary's `parallel`: the mode and mesh, the base's sharded tensors and, where embeddings
    train whole under fsdp, their sharded copies (and how XLA holds the optimizer's moments)."""
    trained = sum(is_whole_module_weight(name) for name in p.parallelized.sharded)
    return {**p.parallel.describe(), "sharded_base_parameters": len(p.parallelized.sharded) - trained,
            **({"sharded_trained_parameters": trained} if trained else {})}


def write_phase_outputs(p: Phase, step: int, final_state: dict, last_loss, label_tokens, timing: dict,
                        eval_after: dict) -> dict:
    """The master's adapter, then the summary that marks the phase as done; returns the summary."""
    layout = p.layout
    directories = layout.adapters(p.number, list(p.lora_config))
    if p.tokenizer is not None:  # the extended tokenizer, before the adapter's config marks it written
        for directory in directories.values():
            p.tokenizer.save_pretrained(directory)
    written = save_adapters(p.model, directories, p.lora_config, p.base_model, p.base_revision)
    for directory in written.values():
        write_lineage(directory, p.trained_on)
    summary = {
        "phase": p.number,
        "steps": step,
        "resumed_from_step": p.start_step if p.resumed else None,
        "resumed_on_other_chips": p.data.chips_changed,
        "resumed_with_changes": p.accepted_changes or None,
        # What serves this phase's adapter: the base with these merged first (export takes them
        # as --adapter each, then this phase's).
        "merged_adapters": p.merged_adapters,
        "resume_keys": p.resume_keys,
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
        "step_updated_state_bytes": p.stepper.updated_state_bytes,
        "device_memory_peak_bytes": p.runtime.peak_memory_bytes(p.device),
        "runtime": p.runtime.name,
        # how host_syncs_per_step was counted: on every timed step, or on one step (a profiler's)
        "host_syncs_counted": "every step" if p.runtime.counts_host_syncs_each_step else "one step",
        "wall_time_s": round(p.guard.elapsed(), 2),
        "world_size": p.parallel.world,
        "parallel": parallel_summary(p),
        "attention": p.model.config._attn_implementation,
        "scanned_layers": p.parallelized.scanned_layers,
        "compiled_layers": p.parallelized.compiled_layers,  # each by torch.compile (native runtime.compile)
        "activation_checkpointing": p.activation_checkpointing,  # null, "full" or "selective"
        "quantized_base": p.quantized_base,
        "seq_len": p.data.seq_len,
        "global_batch": p.data.batches_per_step,
    }
    if p.objective is not None:
        summary["preference"] = preference_summary(p.objective, p.eval_before, eval_after)
    if p.adapters:
        summary["skipped_steps"] = sum(final_state["skipped_steps"].values())
        summary["adapters"] = adapter_summaries(p, final_state, eval_after)
    atomic_write_json(layout.summary(p.number), summary)  # written last: marks the phase as done
    return summary


def preference_summary(objective, eval_before: dict, eval_after: dict) -> dict:
    """A preference phase's loss, its reference, and its evaluations' pairs and TRL metrics."""
    def metrics(result: dict) -> dict:
        return {key: value for key, value in result.items() if key == "pairs" or "/" in key}

    reference = "base" if objective.reference == BASE_REFERENCE else "the continued adapter, frozen"
    return {"loss": objective.settings.loss, "beta": objective.settings.beta,
            "reference": "none (reference-free)" if objective.settings.loss in REFERENCE_FREE else reference,
            "eval_before": metrics(eval_before), "eval_after": metrics(eval_after)}


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
        **({"preference": preference_summary(p.objective, p.eval_before["adapters"][name],
                                             eval_after["adapters"][name])} if p.objective is not None else {}),
    } for name, max_steps in p.adapters.items()}


def log_step(logger: StepLogger, monitor: DivergenceMonitor, step: int, results: dict, skipped, worst,
             adapters: dict[str, int]) -> None:
    # A step closure: runs once the step's graph has been issued; reading the results waits
    # for that step only, on log steps only. Every replica runs it with the same values
    # (losses are summed over replicas), so every replica takes the same stop decision.
    preference = [results["metric_sums"]] if "metric_sums" in results else []  # a preference phase's
    loss, grad_norm, tokens, skipped, worst, lr, *metric_sums = to_host(
        results["loss"], results["grad_norm"], results["tokens"], skipped, worst, results["lr"], *preference)
    monitor.observe(worst)
    if not adapters:
        logger.log_train(step, {"loss": loss, "lr": lr, "grad_norm": grad_norm, "label_tokens": tokens,
                                "skipped_steps": skipped, **(metrics_of(metric_sums[0], tokens) if preference else {})})
        return
    # Side by side: each adapter's values, while it steps (an adapter whose steps are done has none).
    each = {name: {"loss": loss[k], "lr": lr[k], "grad_norm": grad_norm[k], "label_tokens": tokens[k],
                   "skipped_steps": skipped[k], **(metrics_of(metric_sums[0][k], tokens[k]) if preference else {})}
            for k, (name, max_steps) in enumerate(adapters.items()) if step <= max_steps}
    logger.log_train(step, {"loss": weighted_mean(each), "lr": None, "grad_norm": None,
                            "label_tokens": sum(v["label_tokens"] for v in each.values()),
                            "skipped_steps": sum(skipped)}, adapters=each)


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
