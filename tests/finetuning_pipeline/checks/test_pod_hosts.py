"""tpu-check on a pod: which host this is (a TPU VM's metadata, read through torch_xla, or
torchrun's environment in the CPU rehearsal), and the barrier every host passes before the
check's first run: a host's failure reaches the others at once; a host that never comes is
named after the timeout, not waited for without end."""

from __future__ import annotations

import threading
import time

import pytest
from trainer_helpers import free_port

from finetuning_pipeline.checks.pod_hosts import ONE_HOST, HostBarrier, PodCheckError, PodHost, pod_host

TORCHRUN = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_a_tpu_vm_of_a_pod_is_the_worker_its_metadata_names(monkeypatch):
    """torch_xla's own reading of the metadata (here from the variables it reads instead of the
    metadata server): worker 1 of two; its barrier is served by worker 0; run k rendezvous on a
    port of its own."""
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    monkeypatch.setenv("TPU_WORKER_ID", "1")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "10.130.0.7,10.130.0.9")
    host = pod_host("TPU")
    assert host == PodHost(1, 2, "10.130.0.7", 12355) and not host.writer
    assert [host.run_environment(k) for k in (0, 1)] == [{"MASTER_PORT": "12356"}, {"MASTER_PORT": "12357"}]
    monkeypatch.setenv("TPU_WORKER_ID", "0")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "10.130.0.7")
    assert pod_host("TPU") == ONE_HOST and ONE_HOST.writer and ONE_HOST.run_environment(3) == {}
    assert pod_host("CPU") == ONE_HOST


def test_the_cpu_rehearsal_of_a_pod_is_torchruns_environment(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "check")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29400")
    assert pod_host("CPU") == PodHost(1, 3, "127.0.0.1", 29400)


def barrier_on_threads(hosts: int, failures: dict[int, str], come: list[int], timeout_s: float) -> dict:
    """Each host in `come` on a thread of its own, as a separate host's check would be: what its
    barrier's ready("set-up", ...) returned or raised."""
    port, results = free_port(), {}

    def host(index: int) -> None:
        try:
            barrier = HostBarrier(PodHost(index, hosts, "127.0.0.1", port), timeout_s=timeout_s)
            results[index] = barrier.ready("set-up", failures.get(index))
        except PodCheckError as err:
            results[index] = err

    threads = [threading.Thread(target=host, args=(index,)) for index in come]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    return results


def test_every_host_learns_at_the_barrier_why_another_could_not_set_up():
    results = barrier_on_threads(3, {2: "OSError: [Errno 28] No space left on device"}, [0, 1, 2], timeout_s=30)
    assert results == {index: ["host 2: OSError: [Errno 28] No space left on device"] for index in range(3)}
    assert barrier_on_threads(2, {}, [0, 1], timeout_s=30) == {0: [], 1: []}


@pytest.mark.heavy
def test_a_host_that_never_comes_is_named_after_the_timeout():
    started = time.monotonic()
    results = barrier_on_threads(3, {}, [0, 2], timeout_s=2)
    assert all(isinstance(result, PodCheckError) for result in results.values())
    assert "host 1 did not reach the check's set-up within 2 s" in str(results[0])
    (alone,) = barrier_on_threads(2, {}, [1], timeout_s=2).values()  # host 0's check never started
    assert isinstance(alone, PodCheckError) and "host 0's check at 127.0.0.1:" in str(alone)
    assert time.monotonic() - started < 30


def test_a_single_host_waits_for_nobody():
    assert HostBarrier(ONE_HOST).ready("set-up", "why") == ["why"] and HostBarrier(ONE_HOST).ready("set-up") == []


def test_a_runtime_whose_check_has_no_pod_rehearsal_is_refused_on_every_host(tiny_model_dir, data, tmp_path):
    """tpu_check asks the run's runtime (its Backend.checks_a_pod) whether its check runs across a
    pod: the native runtime's does not, so each host of a pod is refused at the barrier, naming
    the runtime and what to do, before anything is cleared or written."""
    import argparse

    from trainer_helpers import write_run_config

    from finetuning_pipeline import tpu_check

    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out")
    args = argparse.Namespace(config=str(config), overrides=["runtime.backend=native"], force=False)
    port, results = free_port(), {}

    def host(index: int) -> None:
        pod = PodHost(index, 2, "127.0.0.1", port)
        try:
            results[index] = tpu_check.load_and_claim(args, pod, HostBarrier(pod, timeout_s=60))
        except tpu_check.CheckRefused as err:
            results[index] = str(err)

    threads = [threading.Thread(target=host, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    why = ("runtime.backend=native: the native runtime's check runs one process on one host (it has no pod "
           "rehearsal); run it on one host of the slice")
    assert results == {0: f"host 0: {why}; host 1: {why}", 1: f"host 0: {why}; host 1: {why}"}
    assert not (tmp_path / "out").exists()
