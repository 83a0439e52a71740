"""The native runtime's count of host syncs (runtime/native/host_syncs.py): the ops that make the host
wait for the device's values are counted, others are not, and counting runs a compiled layer as
it runs uncounted (dynamo neither skips it nor compiles it again)."""

from __future__ import annotations

import pytest
import torch

from finetuning_pipeline.runtime.native.host_syncs import HostSyncCount

pytestmark = pytest.mark.native


def test_item_bool_and_a_boolean_mask_are_counted_and_nothing_else():
    x = torch.randn(4, 8)
    with HostSyncCount() as quiet:
        y = (x @ x.T).softmax(-1).sum(0)
        torch.where(y > 0, y, -y).cumsum(0)
    assert quiet.value == 0
    with HostSyncCount() as syncing:
        y.sum().item()  # _local_scalar_dense
        if bool(y.max() > 0):  # _local_scalar_dense
            x[x > 0].sum()  # nonzero: the output's shape is the mask's count
    assert syncing.value == 3


def test_a_compiled_module_runs_compiled_inside_the_count_and_compiles_once():
    from torch._dynamo.utils import counters

    calls = []

    def backend(graph, inputs):  # dynamo's graph, counted each time it runs
        def run(*args):
            calls.append(1)
            return graph.forward(*args)
        return run

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x):
            return self.b(torch.nn.functional.gelu(self.a(x)))

    torch._dynamo.reset()
    counters.clear()
    block = Block()
    block.compile(backend=backend, dynamic=False)
    x = torch.randn(2, 8)
    block(x).sum().backward()
    graphs, ran = counters["stats"]["unique_graphs"], len(calls)
    with HostSyncCount() as count:
        loss = block(x).sum()
        loss.backward()
        loss.item()
    assert count.value == 1
    assert len(calls) == ran + 1 and counters["stats"]["unique_graphs"] == graphs == 1


@pytest.mark.heavy
@pytest.mark.parametrize("prepared", [False, True])
def test_counting_on_the_replicas_thread_prints_no_kineto_error_once_the_process_is_prepared(prepared):
    """kineto prints "ERROR: External init callback must run in same thread as registerClient" when
    the profiler first starts on a thread other than the one that loaded torch: the native
    replica's, in every native run. NativeBackend.prepare_process starts it once on the main thread first. The
    unprepared process shows that the line is there to be silenced (torch 2.9 and 2.13 both print it)."""
    import subprocess
    import sys

    script = ("import threading\n"
              "from finetuning_pipeline.runtime.native.runtime import NativeBackend\n"
              "from finetuning_pipeline.runtime.native.host_syncs import HostSyncCount\n"
              f"if {prepared}: NativeBackend().prepare_process(None, first_process=True)\n"
              "def count():\n"
              "    with HostSyncCount() as c:\n"
              "        __import__('torch').ones(2).sum().item()\n"
              "    assert c.value == 1, c.value\n"
              "t = threading.Thread(target=count); t.start(); t.join(); print('counted')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and "counted" in proc.stdout, proc.stderr
    assert ("External init callback" in proc.stderr) is not prepared, proc.stderr
