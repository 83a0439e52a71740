"""The host's run-ahead bound: after step N's dispatch it waits for step N-1, in order."""

from __future__ import annotations

import torch

from finetuning_pipeline.train.run_ahead import RunAheadBound


def test_after_each_dispatch_the_host_waits_for_the_step_before_it():
    waited = []
    bound = RunAheadBound(wait=lambda marker: waited.append(int(marker)))
    for step in range(1, 5):
        bound.dispatched(torch.tensor(step))
        assert waited == list(range(1, step))  # all but the step just dispatched
    assert [int(t) for t in bound.in_flight] == [4]


def test_two_steps_ahead_waits_for_the_step_two_before():
    waited = []
    bound = RunAheadBound(steps_ahead=2, wait=lambda marker: waited.append(int(marker)))
    for step in range(1, 5):
        bound.dispatched(torch.tensor(step))
    assert waited == [1, 2]
