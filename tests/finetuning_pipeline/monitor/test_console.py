"""What the console says of a step and of a finished phase: the figures the files hold."""

from __future__ import annotations

from finetuning_pipeline.monitor.console import step_line, summary_lines

TIMING = {"tokens_per_sec": 1234.5, "compiles_total": 3, "compiles_after_warmup": 0, "host_syncs_per_step": 0.0}


def test_a_step_line_gives_loss_lr_grad_norm_throughput_and_eta():
    values = {"loss": 2.34567, "lr": 0.01, "grad_norm": 0.5123, "skipped_steps": 0}
    assert step_line("phase 1", 5, 10, values, None, 1234.4, 62.4) == \
        "phase 1 step 5/10: loss 2.3457, lr 1.00e-02, grad norm 0.512, 1,234 tokens/s, ETA 0:01:02"
    # the first log step has no rate yet
    assert step_line("phase 2", 1, 10, values, None, None, None) == \
        "phase 2 step 1/10: loss 2.3457, lr 1.00e-02, grad norm 0.512"


def test_side_by_side_a_step_line_gives_each_stepping_adapters_loss():
    each = {"sql": {"loss": 1.5}, "chat": {"loss": float("nan")}}
    line = step_line("phase 1", 3, 12, {"loss": 1.5, "lr": None, "grad_norm": None, "skipped_steps": 1}, each,
                     None, None)
    assert line == "phase 1 step 3/12: loss sql 1.5000, chat nan, 1 skipped steps"


def summary(**changes) -> dict:
    return {"phase": 1, "steps": 10, "resumed_from_step": None, "eval_loss_before": 2.0, "eval_loss_after": 1.5,
            "perplexity_before": 7.389, "perplexity_after": 4.4817, **TIMING, **changes}


def test_a_phase_summary_line():
    assert summary_lines(summary()) == (
        "phase 1: 10 steps, eval loss 2.0000 -> 1.5000 (perplexity 7.4 -> 4.5), 1,234 tokens/s, compiles 3 "
        "(0 after warm-up), host syncs/step 0")


def test_a_runtime_that_counts_one_step_says_so():
    """The native runtime's profiler counts one step (summary: host_syncs_counted), XLA's counter every step."""
    one = {"runtime": "native", "host_syncs_counted": "one step"}
    assert summary_lines(summary(**one)).endswith("host syncs/step 0 (one step counted)")
    assert summary_lines(summary(**one, host_syncs_per_step=None)).endswith(
        "host syncs/step n/a (the profiler recorded nothing)")
    assert summary_lines(summary(runtime="xla", host_syncs_counted="every step")).endswith("host syncs/step 0")


def test_a_resume_that_took_no_step_says_so_not_zero_tokens_per_second():
    line = summary_lines(summary(resumed_from_step=10, tokens_per_sec=None, host_syncs_per_step=None))
    assert line == ("phase 1: 10 steps, eval loss 2.0000 -> 1.5000 (perplexity 7.4 -> 4.5) (every step was taken "
                    "before this resume from step 10; this run evaluated and wrote the outputs)")


def test_a_run_of_warm_up_steps_only_says_why_it_has_no_rate_not_zero_tokens_per_second():
    """A 1-step run has no timed step: n/a with the reason, not "0 tokens/s ... host syncs/step -"."""
    line = summary_lines(summary(steps=1, tokens_per_sec=None, host_syncs_per_step=None))
    assert line == ("phase 1: 1 steps, eval loss 2.0000 -> 1.5000 (perplexity 7.4 -> 4.5), compiles 3; tokens/s and "
                    "host syncs/step n/a: no step ran after the warm-up steps (train.warmup_compiles_steps), which "
                    "compile and are not timed")
    assert "0 tokens/s" not in line and "host syncs/step -" not in line


def test_side_by_side_each_adapter_has_its_own_line_with_its_own_evaluation():
    def adapter(name, steps, before, after, diverged=None):
        return {"adapter": f"out/phase1/adapters/{name}", "steps": steps, "diverged_at_step": diverged,
                "eval_loss_before": before, "eval_loss_after": after,
                "perplexity_before": None if before is None else 2.0,
                "perplexity_after": None if after is None else 1.0}

    lines = summary_lines(summary(adapters={
        "sql": adapter("sql", 10, 2.0, 1.25),
        "chat": adapter("chat", 6, None, None),  # no eval split: its own "no eval data", not the others' mean
        "code": adapter("code", 10, 2.5, float("nan"), diverged=4),
    })).splitlines()
    assert lines[0] == ("phase 1: 10 steps, 3 adapters side by side, 1,234 tokens/s, compiles 3 (0 after warm-up), "
                        "host syncs/step 0")
    assert lines[1] == ("  sql: 10 steps, eval loss 2.0000 -> 1.2500 (perplexity 2.0 -> 1.0); adapter "
                        "out/phase1/adapters/sql")
    assert lines[2] == "  chat: 6 steps, no eval data; adapter out/phase1/adapters/chat"
    assert lines[3] == ("  code: 10 steps, eval loss 2.5000 -> nan (perplexity 2.0 -> 1.0); stopped at step 4 on "
                        "non-finite losses (train.max_bad_steps), its weights as after its last good step; adapter "
                        "out/phase1/adapters/code")


def test_a_run_whose_only_step_after_warm_up_was_counted_gives_its_syncs_not_n_a():
    """A native run of 2 steps (or a resume with 2 left): step 1 warms up, step 2 is the one whose host
    syncs the profiler counts, untimed. Its count is in the summary, and the console says it (it said
    n/a beside a summary of 0)."""
    one = {"runtime": "native", "host_syncs_counted": "one step"}
    line = summary_lines(summary(**one, steps=2, tokens_per_sec=None, host_syncs_per_step=0))
    assert line.endswith("tokens/s n/a: no step ran after the warm-up steps (train.warmup_compiles_steps) and the "
                         "step after them, whose host syncs the runtime counts; host syncs/step 0 (one step counted)")
    assert "host syncs/step n/a" not in line
