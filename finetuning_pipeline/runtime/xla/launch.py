"""How replicas are started: the TPU host's way, and the same way on a CPU (parallel.launcher).

  tpu      what a TPU host does under dp (and what `auto` picks there): this process starts
           torch_xla's number of worker processes (one per chip; on v2/v3 one per chip of two
           cores), each sets up its chips' topology and runs one replica per device it owns on
           a worker thread (torch_xla's own `_run_thread_per_device`). On a CPU: one worker
           process with CPU_NUM_DEVICES replica threads; CPU_NUM_DEVICES=2 is the v2/v3 shape.
  process  this process is the replica: one replica, or one of the processes torchrun started,
           or under fsdp the one SPMD process of this host (SPMD drives all its chips from one
           process; torch_xla.launch refuses it). What `auto` picks everywhere but dp on a TPU.

Why not torch_xla.launch itself: it runs the replica function on worker threads, and only a
process's main thread can install signal handlers, so a spot VM's SIGTERM would kill every
replica without a checkpoint; it has no hook on the main thread. This launcher is
torch_xla 2.9's `run_multiprocess` (same process count, start method, topology set-up and
threads) with the stop handlers and the compile cache set up on each worker process's main
thread first. The parent passes SIGTERM/SIGINT on to its workers, each once it catches them
(distributed/stop_relay.py: a worker still importing is not killed by one), so `kill PARENT`
stops the run the way a preemption does (every replica checkpoints the same step, or stops before
its first, exit 0); a worker whose
parent died without a word (SIGKILL) stops the same way rather than train on as an orphan.

Every wait ends in bounded time, because on a TPU a replica whose peer died waits in a device
all-reduce that never returns: the main threads (launcher and workers) wait in short timeouts,
and a worker's other threads block the stop signals, so a signal runs its handler at once;
once a replica fails the others get FAILURE_GRACE_S to end, then their worker process is left
(`os._exit`) and the launcher kills what remains; and a worker reports to the launcher and leaves with
`os._exit`, never through an interpreter shutdown that waits on device work or walks its heap.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import sys
import threading
import time

from finetuning_pipeline.distributed.stop_relay import StopRelay
from finetuning_pipeline.distributed.whole_lines import whole_lines_on_stdout_and_stderr
from finetuning_pipeline.errors import ConfigError, ReplicaLost
from finetuning_pipeline.run.stop_signal import (
    PROCESS_SIGNALS,
    threads_started_here_leave_signals_to_this_one,
    watch_parent,
)
from finetuning_pipeline.runtime.xla.compile_cache import use_compile_cache
from finetuning_pipeline.runtime.xla.device import device_kind
from utils.stack_dump import dump_stacks_on_signal

# What torch_xla and libtpu read to give a process one chip of a multi-chip host (torch_xla's
# tpu.configure_one_chip_topology; with them tpu.num_local_processes() is 1), and the slice of
# that one process: task 0 of one address. torch_xla's configure_topology, which the launcher's
# worker runs, sets the task and the addresses from the VM's metadata (setdefault): on a single
# host these very values, on a pod's host N task N and every host's address, a slice of one
# process that names several (its task 1 of 1 never starts). TPU_NUM_DEVICES is declared by
# torch_xla 2.9 but read nowhere.
SINGLE_CHIP_ENV = {"TPU_VISIBLE_CHIPS": "0", "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "1,1,1",
                   "CLOUD_TPU_TASK_ID": "0", "TPU_PROCESS_ADDRESSES": "localhost:8476", "TPU_PROCESS_PORT": "8476"}


def resolve_launcher(setting: str, mode: str, kind: str, torchrun_processes: int) -> str:
    """parallel.launcher -> "tpu" or "process" (see the module docstring)."""
    if torchrun_processes > 1:
        if setting == "tpu":
            raise ConfigError("parallel.launcher=tpu starts the replicas itself; under torchrun leave it auto "
                              "(each torchrun process is one replica)")
        return "process"
    if mode == "fsdp":
        return "process"  # one SPMD process per host, on a TPU as on a CPU
    if setting == "auto":
        return "tpu" if kind != "CPU" else "process"
    return setting


def apply_single_chip(kind: str) -> None:
    """parallel.single_chip: one replica on one chip (the rest of the host's chips left free),
    through the environment torch_xla reads; on a CPU (kind "CPU"), one device. On a pod, chip 0
    of host 0 alone, a slice of its own: the other hosts are refused, since each would train a
    run of its own into the one output_dir."""
    if kind == "CPU":
        os.environ["CPU_NUM_DEVICES"] = "1"
        return
    from torch_xla._internal import tpu

    hosts = len(tpu.get_worker_ips())  # (["localhost"] on a single host)
    if hosts > 1 and tpu.worker_id() != 0:
        raise ConfigError(f"parallel.single_chip trains on one chip of host 0 of this pod's {hosts} hosts; this is "
                          f"host {tpu.worker_id()}: run it on host 0 alone, or leave single_chip false here")
    for name, value in SINGLE_CHIP_ENV.items():
        os.environ.setdefault(name, value)


class HiddenTorchXla:
    """USE_TORCH_XLA=0 for the process that starts the TPU launcher's workers, until it starts them.

    That process trains nothing: it reads the config, the data's manifests and the model's
    architecture (a weightless model: run/input_checks.py), then waits on its workers. transformers'
    modeling code imports accelerate, which imports torch_xla whole (its dynamo and inductor too)
    unless USE_TORCH_XLA=0, which both read at their import; the workers import it themselves, and
    train with it. Their environment (a spawned process's is its parent's as it starts) gets back
    what the user had. On a CPU the launching process then never imports torch_xla (a 12-step run
    of the tiny model took 14.7 CPU-s against 15.7, farm-bench, 4 pairs); on a TPU host it still
    does, once its checks are done, to count the chips as torch_xla's launcher does
    (local_process_count), so there it saves nothing but keeps transformers' view of it out."""

    NAME = "USE_TORCH_XLA"

    def __init__(self) -> None:
        self.hidden = False
        self.users: str | None = None

    def hide(self) -> None:
        if not self.hidden:
            self.users, self.hidden = os.environ.get(self.NAME), True
            os.environ[self.NAME] = "0"

    def show(self) -> None:
        if self.hidden:
            if self.users is None:
                del os.environ[self.NAME]
            else:
                os.environ[self.NAME] = self.users
            self.hidden = False


HIDDEN_TORCH_XLA = HiddenTorchXla()  # one a process: the demo's inputs are built before the run's backend exists


def local_process_count() -> int:
    """How many worker processes this host starts: torch_xla 2.9's own rule (run_multiprocess):
    on a TPU the chips found on the PCI bus, capped by TPU_PROCESS_BOUNDS; elsewhere one."""
    if device_kind() != "TPU":
        return 1
    from torch_xla._internal import tpu

    return tpu.num_local_processes()


# After a replica fails, how long the others get to end on their own before they are ended: a
# replica waiting in a device all-reduce for a dead chip never returns (on a CPU the sums go
# through gloo, whose closed group ends the waiters at once; on a TPU nothing ends them).
FAILURE_GRACE_S = 20.0
WAIT_S = 0.2  # how often a waiting main thread wakes, free to run the signal handlers


class WorkerDied(ReplicaLost):
    """A worker process ended without a word: killed (SIGKILL, out of memory) or crashed."""


def launch_replicas(replica, args: tuple, *, compile_cache: str, mode: str, grace_s: float = FAILURE_GRACE_S) -> None:
    """Run `replica(*args)` once per device of this host, the TPU host's way (module
    docstring); returns when every replica has returned, raises the first replica's error.
    A worker process that dies (SIGKILL, out of memory) is a ReplicaLost (exit 3). Once one
    fails, the rest get `grace_s` to end, then are killed: the run ends in bounded time."""
    processes = local_process_count()
    context = multiprocessing.get_context("spawn")  # torch_xla's default: a fresh runtime per process
    pipes = [context.Pipe(duplex=False) for _ in range(processes)]  # (reader, writer): a worker's report
    workers = [context.Process(target=_worker_main, name=f"replica-worker-{local}", args=(local,),
                               kwargs=dict(processes=processes, replica=replica, args=args, compile_cache=compile_cache,
                                           mode=mode, report=pipes[local][1], grace_s=grace_s))
               for local in range(processes)]
    # A stop signal to this process goes on to each worker once it catches it (stop_relay.py)
    relay = StopRelay(lambda: [worker.pid for worker in workers if worker.pid is not None])
    with PROCESS_SIGNALS.caught():
        for worker, (_, writer) in zip(workers, pipes):
            worker.start()
            writer.close()  # the worker's copy is its own: a worker that dies closes its pipe
        failures = await_workers(workers, [reader for reader, _ in pipes], grace_s, relay.pass_on)
    if failures:
        raise first_cause(failures) from None


def await_workers(workers: list, reports: list, grace_s: float, woke=lambda: None) -> list[BaseException]:
    """Wait until every worker has exited, WAIT_S at a time so that this main thread runs the
    signal handlers at once and then `woke()` (passing a stop on); returns their errors in local
    order (a worker reports None or its error on its pipe in `reports`). A worker's failure, or
    death, starts the grace period after which the others are killed."""
    from multiprocessing.connection import wait

    errors: dict[int, BaseException] = {}
    reported: set[int] = set()
    closed: set[int] = set()  # pipes closed without a report
    deadline = None
    while True:
        exited = [local for local, worker in enumerate(workers) if not worker.is_alive()]
        for local, pipe in enumerate(reports):  # (read after the check: an exited worker's report is in its pipe)
            if local not in reported and local not in closed and pipe.poll():
                try:
                    error = pipe.recv()
                except EOFError:
                    closed.add(local)  # without a report: it died (below, once it has exited)
                    continue
                reported.add(local)
                if error is not None:
                    errors[local] = error
        for local in exited:
            if local not in reported and local not in errors:
                errors[local] = WorkerDied(f"a replica process died (worker {local}, exit code "
                                           f"{workers[local].exitcode}: killed, or out of memory)")
        if len(exited) == len(workers):
            return [errors[local] for local in sorted(errors)]
        if errors and deadline is None:
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() > deadline:
            for local, worker in enumerate(workers):
                if worker.is_alive():
                    worker.kill()
                    errors.setdefault(local, ReplicaLost(f"replica worker {local} did not end within {grace_s:.0f} s "
                                                         "of another's failure and was killed"))
                    reported.add(local)
        waiting = [pipe for local, pipe in enumerate(reports) if local not in reported | closed]
        wait([worker.sentinel for worker in workers if worker.is_alive()] + waiting, timeout=WAIT_S)
        woke()


def first_cause(failures: list[BaseException]) -> BaseException:
    """The error to report of several replicas' (in rank order): not one that only saw a peer
    go away (ReplicaLost) when the peer's own error is there; a dead worker process (its
    replicas could say nothing) before its peers' ReplicaLost."""
    causes = [err for err in failures if not isinstance(err, ReplicaLost)]
    if causes:
        return causes[0]
    died = [err for err in failures if isinstance(err, WorkerDied)]
    if died:
        return ReplicaLost(f"{died[0]}; the others were stopped. The run resumes from its last complete checkpoint "
                           "with --resume auto")
    return failures[0]


def _worker_main(local: int, *, report, **kwargs) -> None:
    """A worker process's whole life: its replicas, its report to the launcher, then `os._exit`,
    so that the end is bounded (no interpreter finalization, which walks the whole heap, nor
    torch_xla's exit hook, which waits on device work a dead peer never finishes)."""
    launcher = os.getppid()
    error = None
    try:
        with whole_lines_on_stdout_and_stderr():  # its replica threads print to one stdout
            _worker_process(local, launcher=launcher, **kwargs)
    except BaseException as err:  # reported to the launcher, which raises it
        error = err
    if os.getppid() != launcher and error is not None:  # nobody to report to
        print(f"error: {error}", file=sys.stderr, flush=True)
    try:
        pickle.dumps(error)
    except Exception:  # an error that cannot be pickled: its type and message
        error = RuntimeError(f"{type(error).__name__}: {error}")
    with contextlib.suppress(OSError):  # a launcher that died closed the pipe: nobody to tell
        report.send(error)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if error is None else 1)


def _worker_process(local: int, *, launcher: int, processes: int, replica, args: tuple, compile_cache: str,
                    mode: str, grace_s: float) -> None:
    """One worker process, on its main thread: stop handlers and compile cache first, then
    torch_xla's topology set-up and one replica thread per device, all on a thread of their
    own while this main thread waits, WAIT_S at a time, and takes every stop signal the process
    is sent (the other threads block them), so its handler runs at once, not when the replicas
    return. A replica that fails gives the others `grace_s`."""
    with threads_started_here_leave_signals_to_this_one():
        replicas, failures, outcome = _start_replicas(local, launcher=launcher, processes=processes, replica=replica,
                                                      args=args, compile_cache=compile_cache, mode=mode)
    failed_at = None
    while replicas.is_alive():
        replicas.join(WAIT_S)
        if failures and failed_at is None:
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            break  # the others wait on the failed one (a device collective): they are left to os._exit
    if failures or outcome:
        # torch_xla raises the failure of the lowest device, maybe one that only saw its peer go.
        raise first_cause([failure for _, failure in sorted(failures.items())] or [outcome["error"]])


def _start_replicas(local: int, *, launcher: int, processes: int, replica, args: tuple, compile_cache: str,
                    mode: str) -> tuple[threading.Thread, dict[int, BaseException], dict[str, BaseException]]:
    """The stop handlers and the compile cache, then a thread that sets up torch_xla's topology
    and runs the replica threads; what they raise lands in the two dicts."""
    import torch_xla.runtime as xr
    from torch_xla._internal import pjrt

    PROCESS_SIGNALS.install()
    dump_stacks_on_signal()  # a fresh interpreter: kill -USR1 shows its replica threads too
    watch_parent(launcher, PROCESS_SIGNALS, "its launching process's exit")
    use_compile_cache(compile_cache, mode, local)
    failures: dict[int, BaseException] = {}
    outcome: dict[str, BaseException] = {}

    def run_replica_thread() -> None:
        try:
            replica(*args)
        except BaseException as err:
            failures[xr.global_ordinal()] = err
            raise

    def run_replicas() -> None:
        try:
            pjrt._run_thread_per_device(local, processes, run_replica_thread, pjrt.initialize_multiprocess)
        except BaseException as err:  # handed to the main thread
            outcome["error"] = err

    replicas = threading.Thread(target=run_replicas, name="replicas", daemon=True)
    replicas.start()
    return replicas, failures, outcome
