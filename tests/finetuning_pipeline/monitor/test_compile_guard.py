"""The recompile guard: no new graph after warm-up (an error, or a warning), counted from where the
phase (re)started, with the host syncs per step. torch_xla's counters are replaced by a script of
readings, so what is tested is the guard's arithmetic, not which graphs this process has cached
(the trainer's own runs check the real counters, each in a fresh process: tests/e2e/test_trainer.py)."""

from __future__ import annotations

import pytest

from finetuning_pipeline.errors import RecompileError
from finetuning_pipeline.monitor import compile_guard
from finetuning_pipeline.runtime.xla import runtime as xla_runtime
from finetuning_pipeline.runtime.xla.counters import XlaCounters


class Counters:
    """torch_xla's process-wide counters, advanced by hand: `compile()` and `sync()` are what a
    step did since the last reading."""

    def __init__(self) -> None:
        self.now = XlaCounters(compiles=0, compile_seconds=0.0, host_syncs=0, transfers_from_device=0)
        self.donations: list[int] = []

    def __call__(self) -> XlaCounters:
        return self.now

    def add(self, compiles: int = 0, syncs: int = 0, donated: tuple = ()) -> None:
        """`donated`: the donations of the graphs compiled (one each; 0 for the rest)."""
        self.now = XlaCounters(self.now.compiles + compiles, self.now.compile_seconds + 2.0 * compiles,
                               self.now.host_syncs + syncs, self.now.transfers_from_device)
        self.donations += list(donated) + [0] * (compiles - len(donated))


def run_steps(guard, counters, first: int, graphs_per_step: dict[int, int], syncs_per_step: dict | None = None,
              donated_per_step: dict | None = None):
    for step in range(first, first + len(graphs_per_step)):
        guard.step_started()
        guard.data_ready()
        counters.add(compiles=graphs_per_step[step], syncs=(syncs_per_step or {}).get(step, 0),
                     donated=(donated_per_step or {}).get(step, ()))
        guard.step_ended(step)


@pytest.fixture
def counters(monkeypatch):
    fake = Counters()
    monkeypatch.setattr(xla_runtime, "read_counters", fake)
    monkeypatch.setattr(xla_runtime, "donations_of_last_graphs", lambda count: fake.donations[-count:])
    return fake


def guard_of(**settings):
    """The XLA runtime's guard (its counters are the fixture's)."""
    return compile_guard.CompileGuard(**settings, runtime=xla_runtime.XlaRuntime())


def test_graphs_compiled_in_the_warm_up_steps_are_allowed_and_counted(counters):
    counters.add(compiles=1)  # before the phase: not the phase's
    guard = guard_of(phase=1, warmup_steps=1, policy="error")
    counters.add(compiles=1)  # the eval graph, before step 1
    run_steps(guard, counters, 1, {1: 1, 2: 0, 3: 0, 4: 0})
    summary = guard.summary(steps_run=4, tokens_per_step=128)
    assert summary["compiles_total"] == 2 and summary["compile_seconds"] == 4.0
    assert summary["compiles_after_warmup"] == 0 and summary["host_syncs_per_step"] == 0
    assert summary["tokens_per_sec"] > 0


def test_a_graph_after_warm_up_stops_the_run_naming_the_step(counters):
    guard = guard_of(phase=2, warmup_steps=1, policy="error")
    with pytest.raises(RecompileError, match=r"phase 2 step 3: 1 new XLA graph\(s\) compiled after warm-up"):
        run_steps(guard, counters, 1, {1: 1, 2: 0, 3: 1})


def test_warn_counts_every_graph_after_warm_up_and_goes_on(counters, capsys):
    guard = guard_of(phase=1, warmup_steps=2, policy="warn")
    run_steps(guard, counters, 1, {1: 1, 2: 1, 3: 2, 4: 0, 5: 1}, syncs_per_step={4: 1})
    assert guard.compiles_after_warmup == 3
    assert capsys.readouterr().out.count("warning: phase 1 step") == 2
    assert guard.summary(steps_run=5, tokens_per_step=1)["host_syncs_per_step"] == pytest.approx(1 / 3)


def test_a_resumed_phase_warms_up_from_its_first_step(counters):
    """Resumed at step 10: step 11 compiles the step's graph (warm-up); step 12 may not."""
    guard = guard_of(phase=1, warmup_steps=1, policy="error")
    guard.resume_at(10)
    run_steps(guard, counters, 11, {11: 1, 12: 0})
    with pytest.raises(RecompileError, match="step 13"):
        run_steps(guard, counters, 13, {13: 1})


def test_no_warm_up_allowed_refuses_the_first_steps_graph(counters):
    guard = guard_of(phase=1, warmup_steps=0, policy="error")
    with pytest.raises(RecompileError, match="step 1:"):
        run_steps(guard, counters, 1, {1: 1})


def test_the_buffers_donated_by_the_first_steps_graph_are_reported(counters):
    """The donations of the graph compiled at the phase's first step (this process's first step of
    a resumed phase), not the evaluation's before it, once however many replica threads of the
    process compiled it; None when that step compiled nothing."""
    guard = guard_of(phase=1, warmup_steps=1, policy="error")
    counters.add(compiles=1)  # the eval graph donates nothing
    run_steps(guard, counters, 1, {1: 2, 2: 0, 3: 0}, donated_per_step={1: (31, 31)})  # two replica threads
    assert guard.summary(steps_run=3, tokens_per_step=128)["step_donated_buffers"] == 31
    resumed = guard_of(phase=1, warmup_steps=1, policy="error")
    resumed.resume_at(4)
    run_steps(resumed, counters, 5, {5: 0, 6: 0})  # the step's graph already compiled in this process
    assert resumed.summary(steps_run=2, tokens_per_step=128)["step_donated_buffers"] is None


class StepSyncs:
    """A count of one step's host syncs, as runtime/native/host_syncs.py's HostSyncCount gives it."""

    def __init__(self, syncs: int) -> None:
        self.syncs, self.value = syncs, None

    def __enter__(self) -> "StepSyncs":
        return self

    def __exit__(self, *exc) -> None:
        self.value = self.syncs


class OneStepCountingRuntime:
    """A runtime whose host syncs are counted on one step (native's profiler): a count made
    during step k gives the syncs the test says step k makes."""

    name = "native"
    counts_host_syncs_each_step = False

    def __init__(self, counters, syncs_per_step: dict[int, int]) -> None:
        self.counters, self.syncs_per_step = counters, syncs_per_step
        self.step, self.counted_steps = 0, []

    def wait(self) -> None:
        pass

    def first_step_donations(self, compiles: int) -> None:
        return None

    def recompile_message(self, phase: int, step: int, compiles: int) -> str:
        return f"phase {phase} step {step}: {compiles} new graph(s)"

    def counting_host_syncs(self) -> StepSyncs:
        self.counted_steps.append(self.step)
        return StepSyncs(self.syncs_per_step.get(self.step, 0))


def run_counted_steps(guard, runtime, first: int, steps: int) -> None:
    for step in range(first, first + steps):
        guard.step_started()
        guard.data_ready()
        runtime.step = step
        with guard.counting_host_syncs(step):
            pass
        guard.step_ended(step)


@pytest.mark.parametrize("warmup,resumed_at", [(1, 0), (3, 0), (0, 0), (2, 10)])
def test_a_runtime_that_counts_one_step_counts_the_first_after_warm_up_and_times_the_rest(counters, warmup,
                                                                                         resumed_at):
    """Native: the warm-up steps compile (and compiling runs ops of its own), so the first step
    after them is counted, untimed (the profiler's cost stays out of tokens/s); the summary gives
    that step's syncs, whatever the steps after it make; a graph compiled in it is refused."""
    counted = resumed_at + warmup + 1
    runtime = OneStepCountingRuntime(counters, {counted - 1: 7, counted: 2, counted + 1: 5})
    guard = compile_guard.CompileGuard(phase=1, warmup_steps=warmup, policy="error", runtime=runtime)
    guard.resume_at(resumed_at)
    run_counted_steps(guard, runtime, resumed_at + 1, warmup + 3)
    assert runtime.counted_steps == [counted]
    summary = guard.summary(steps_run=warmup + 3, tokens_per_step=1)
    assert summary["host_syncs_per_step"] == 2 and guard.steps_timed == 2
    guard = compile_guard.CompileGuard(phase=1, warmup_steps=warmup, policy="error", runtime=runtime)
    guard.resume_at(resumed_at)
    with pytest.raises(RecompileError, match=f"step {counted}:"):
        run_steps(guard, counters, resumed_at + 1, {step: 1 for step in range(resumed_at + 1, counted + 1)})
