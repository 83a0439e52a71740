"""The recompile guard and the phase's clock.

After `train.warmup_compiles_steps` steps every step must replay a compiled graph: a new
compile is a bug (a shape or a Python scalar that changes) that would cost minutes of TPU time
per occurrence, so by default it stops the run. The same per-step counter reads give the
host syncs per step (0 is the target: the host never waits for the device inside a step). A
runtime whose count is not free (native: the profiler's) counts one step instead, the first after
the warm-up (which compiles, and compiling runs ops of its own), and starts the clock after it:
`counting_host_syncs(step)` goes around the stepper.

The clock starts once the warm-up steps have *run* (the runtime's `wait`): the host runs a
step ahead of the device (run_ahead.py), so only the time to the end of the last step's
execution measures the steps.
"""

from __future__ import annotations

import contextlib
import time

from finetuning_pipeline.errors import RecompileError


class CompileGuard:
    """Made when the phase starts (its compile and wall-time figures count from there);
    `resume_at(step)` once the first step is known."""

    def __init__(self, phase: int, warmup_steps: int, policy: str, runtime) -> None:
        """runtime: whose counters, device wait and diagnostics to use (runtime/protocol.py)."""
        self.read_counters = runtime.counters
        self.wait = runtime.wait
        self.runtime = runtime
        self.syncs_each_step = runtime.counts_host_syncs_each_step
        self.sync_count = None  # the counted step's (runtimes that count one step)
        self.phase = phase
        self.warmup_steps = warmup_steps
        self.warm_after = warmup_steps
        self.policy = policy
        self.started = time.perf_counter()
        self.at_start = self.read_counters()
        self.warm_time: float | None = None
        self.steps_timed = 0
        self.compiles_after_warmup = 0
        self.first_step = 1
        self.first_step_donations: int | None = None
        self.host_syncs_after_warmup = 0
        self.data_wait = 0.0
        self._before = None
        self._wait_started = 0.0
        self._waited = 0.0

    def resume_at(self, start_step: int) -> None:
        self.warm_after = start_step + self.warmup_steps
        self.first_step = start_step + 1

    def counting_host_syncs(self, step: int):
        """Around the stepper's call for `step` (1-based: the step it takes), on every runtime.
        (Not the whole of step_started..step_ended: a log step's reads of its results, which the
        XLA runtime's closures make by transfers, would count natively.)"""
        if self.syncs_each_step or step != self.warm_after + 1:
            return contextlib.nullcontext()
        self.sync_count = self.runtime.counting_host_syncs()
        return self.sync_count

    def clock_after(self) -> int:
        """The step after which the clock starts: the last warm-up step (XLA), or the step after it,
        whose host syncs a runtime that counts one step counts (native)."""
        return self.warm_after + (0 if self.syncs_each_step else 1)

    def step_started(self) -> None:
        """Call before fetching the step's batches."""
        self._before = self.read_counters()
        self._wait_started = time.perf_counter()

    def data_ready(self) -> None:
        """Call once the step's batches are in hand."""
        self._waited = time.perf_counter() - self._wait_started

    def step_ended(self, step: int) -> None:
        """Call after the step's boundary; raises RecompileError (policy "error")."""
        delta = self.read_counters() - self._before
        if step == self.first_step and delta.compiles:
            self.first_step_donations = self.runtime.first_step_donations(delta.compiles)
        if step == self.clock_after():
            self.wait()
            self.warm_time = time.perf_counter()
        if step > self.clock_after():
            self.steps_timed += 1
            self.data_wait += self._waited
            if self.syncs_each_step:
                self.host_syncs_after_warmup += delta.host_syncs
        if step > self.warm_after and delta.compiles:
            self.compiles_after_warmup += delta.compiles
            message = self.runtime.recompile_message(self.phase, step, delta.compiles)
            if self.policy == "error":
                raise RecompileError(message)
            print(f"warning: {message}", flush=True)

    def summary(self, steps_run: int, tokens_per_step: int) -> dict:
        """Throughput and compile figures of this process's run of the phase (after the device
        finished: call the runtime's wait() first)."""
        if self.clock_after() < self.first_step:  # no untimed step: the clock runs from the start
            seconds, timed = time.perf_counter() - self.started, steps_run
        else:
            seconds, timed = time.perf_counter() - (self.warm_time or self.started), self.steps_timed
        counters = self.read_counters()
        return {
            "tokens_per_sec": round(timed * tokens_per_step / seconds, 1) if timed else None,
            "step_time_s": round(seconds / timed, 4) if timed else None,
            "data_wait_fraction": round(self.data_wait / seconds, 4) if self.steps_timed else None,
            "compiles_total": counters.compiles - self.at_start.compiles,
            # With the persistent cache warm, "compiles" load executables from disk: fast.
            "compile_seconds": round(counters.compile_seconds - self.at_start.compile_seconds, 2),
            "compiles_after_warmup": self.compiles_after_warmup,
            "host_syncs_per_step": self.host_syncs_per_step(),
            # None when the first step compiled nothing here (its graph was cached in this process)
            "step_donated_buffers": self.first_step_donations,
        }

    def host_syncs_per_step(self) -> float | None:
        if not self.syncs_each_step:
            return self.sync_count.value if self.sync_count is not None else None
        return self.host_syncs_after_warmup / self.steps_timed if self.steps_timed else None

    def elapsed(self) -> float:
        """Seconds since the phase started."""
        return time.perf_counter() - self.started

