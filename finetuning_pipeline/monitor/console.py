"""What a run prints to the console (the master only): a line per log step when the progress
bar is off, and each phase's closing lines, one per adapter side by side.

The figures are the ones `metrics.jsonl` and `summary.json` record; these functions only say
them, so that a user reading a terminal (or a notebook cell) sees what the files hold.
"""

from __future__ import annotations

import datetime


def step_line(label: str, step: int, max_steps: int, values: dict, adapters: dict[str, dict] | None,
              tokens_per_sec: float | None, eta_s: float | None) -> str:
    """'phase 1 step 5/10: loss 2.3456, lr 1.00e-02, grad norm 0.512, 1,234 tokens/s, ETA 0:01:02';
    side by side, each stepping adapter's loss (an adapter whose steps are done has none)."""
    if adapters:
        losses = ", ".join(f"{name} {number(each['loss'], '.4f')}" for name, each in adapters.items())
        parts = [f"loss {losses}"]
    else:
        parts = [f"loss {number(values['loss'], '.4f')}", f"lr {number(values['lr'], '.2e')}",
                 f"grad norm {number(values['grad_norm'], '.3f')}"]
        if "rewards/margins" in values:  # a preference phase's
            parts += [f"margin {number(values['rewards/margins'], '.4f')}",
                      f"accuracy {number(values['rewards/accuracies'], '.2f')}"]
    if values.get("skipped_steps"):
        parts.append(f"{values['skipped_steps']} skipped steps")
    if tokens_per_sec:
        parts.append(f"{tokens_per_sec:,.0f} tokens/s")
    if eta_s is not None:
        parts.append(f"ETA {datetime.timedelta(seconds=round(eta_s))}")
    return f"{label} step {step}/{max_steps}: {', '.join(parts)}"


def summary_lines(summary: dict) -> str:
    """A finished phase: its steps, evaluation and throughput; side by side, a line per adapter
    with its own steps and evaluation (the top line then gives none: a mean of different tasks'
    losses says nothing of any of them)."""
    ran = summary["steps"] - (summary["resumed_from_step"] or 0)
    head = f"phase {summary['phase']}: {summary['steps']} steps"
    adapters = summary.get("adapters") or {}
    if adapters:
        head += f", {len(adapters)} adapters side by side"
    else:
        head += f", {evaluation(summary)}"
    if ran == 0:
        head += (f" (every step was taken before this resume from step {summary['resumed_from_step']}; this run "
                 "evaluated and wrote the outputs)")
    elif summary["tokens_per_sec"] is None and summary["host_syncs_per_step"] is None:  # only warm-up steps ran
        head += (f", compiles {summary['compiles_total']}; tokens/s and host syncs/step n/a: no step ran after the "
                 "warm-up steps (train.warmup_compiles_steps), which compile and are not timed")
        if counted_on_one_step(summary):
            head += ", nor after the step after them, whose host syncs the runtime counts"
    elif summary["tokens_per_sec"] is None:  # the one step after the warm-up was the counted one, untimed
        head += (f", compiles {summary['compiles_total']}; tokens/s n/a: no step ran after the warm-up steps "
                 "(train.warmup_compiles_steps) and the step after them, whose host syncs the runtime counts; "
                 f"host syncs/step {host_syncs(summary)}")
    else:
        head += (f", {summary['tokens_per_sec']:,.0f} tokens/s, compiles {summary['compiles_total']} "
                 f"({summary['compiles_after_warmup']} after warm-up), host syncs/step {host_syncs(summary)}")
    lines = [head]
    for name, each in adapters.items():
        line = f"  {name}: {each['steps']} steps, {evaluation(each)}"
        if each.get("diverged_at_step") is not None:
            line += (f"; stopped at step {each['diverged_at_step']} on non-finite losses (train.max_bad_steps), its "
                     "weights as after its last good step")
        lines.append(f"{line}; adapter {each['adapter']}")
    return "\n".join(lines)


def evaluation(result: dict) -> str:
    if result["eval_loss_after"] is None:
        return "no eval data"
    preference = result.get("preference")
    if preference:  # a preference phase: no perplexity; its reward margin and accuracy instead
        before, after = preference["eval_before"], preference["eval_after"]
        return (f"eval loss {number(result['eval_loss_before'], '.4f')} -> {number(result['eval_loss_after'], '.4f')} "
                f"(reward margin {number(before['rewards/margins'], '.4f')} -> "
                f"{number(after['rewards/margins'], '.4f')}, accuracy {number(before['rewards/accuracies'], '.2f')} -> "
                f"{number(after['rewards/accuracies'], '.2f')} over {after['pairs']} pairs)")
    return (f"eval loss {number(result['eval_loss_before'], '.4f')} -> {number(result['eval_loss_after'], '.4f')} "
            f"(perplexity {number(result['perplexity_before'], '.1f')} -> "
            f"{number(result['perplexity_after'], '.1f')})")


def counted_on_one_step(summary: dict) -> bool:
    """The host syncs were counted on one step (the native runtime's profiler), not on every
    timed step (torch_xla's counter)."""
    return summary.get("host_syncs_counted") == "one step"


def host_syncs(summary: dict) -> str:
    syncs = summary["host_syncs_per_step"]
    if not counted_on_one_step(summary):
        return number(syncs, "g")
    return "n/a (the profiler recorded nothing)" if syncs is None else f"{syncs:g} (one step counted)"


def number(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)
