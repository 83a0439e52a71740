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
thread first. The parent forwards SIGTERM/SIGINT to its workers, so `kill PARENT` stops the run
the way a preemption does (every replica checkpoints the same step, exit 0); a worker whose
parent died without a word (SIGKILL) stops the same way rather than train on as an orphan.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures.process import BrokenProcessPool

from finetuning_pipeline.distributed.parallel import use_compile_cache
from finetuning_pipeline.errors import ConfigError, ReplicaLost
from finetuning_pipeline.run.stop_signal import PROCESS_SIGNALS
from utils.stack_dump import dump_stacks_on_signal
from utils.xla_runtime import device_kind

# What torch_xla and libtpu read to give a process one chip of a multi-chip host (torch_xla's
# tpu.configure_one_chip_topology; with them tpu.num_local_processes() is 1). TPU_NUM_DEVICES
# is declared by torch_xla 2.9 but read nowhere.
SINGLE_CHIP_ENV = {"TPU_VISIBLE_CHIPS": "0", "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "1,1,1"}


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
    through the environment torch_xla reads; on a CPU (kind "CPU"), one device."""
    if kind == "CPU":
        os.environ["CPU_NUM_DEVICES"] = "1"
        return
    for name, value in SINGLE_CHIP_ENV.items():
        os.environ.setdefault(name, value)


def local_process_count() -> int:
    """How many worker processes this host starts: torch_xla 2.9's own rule (run_multiprocess):
    on a TPU the chips found on the PCI bus, capped by TPU_PROCESS_BOUNDS; elsewhere one."""
    if device_kind() != "TPU":
        return 1
    from torch_xla._internal import tpu

    return tpu.num_local_processes()


def launch_replicas(replica, args: tuple, *, compile_cache: str, mode: str) -> None:
    """Run `replica(*args)` once per device of this host, the TPU host's way (module
    docstring); returns when every replica has returned, raises the first replica's error.
    A worker process that dies (SIGKILL, out of memory) is a ReplicaLost (exit 3)."""
    processes = local_process_count()
    context = multiprocessing.get_context("spawn")  # torch_xla's default: a fresh runtime per process
    with forward_stop_signals(), concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        task = functools.partial(_worker_process, processes=processes, replica=replica, args=args,
                                 compile_cache=compile_cache, mode=mode)
        futures = [pool.submit(task, local) for local in range(processes)]
        concurrent.futures.wait(futures)  # a failed replica closes its host group: the others end too
    failures = [future.exception() for future in futures if future.exception() is not None]
    if failures:
        raise first_cause(failures) from None


def first_cause(failures: list[BaseException]) -> BaseException:
    """The error to report of several replicas' (in rank order): not one that only saw a peer
    go away (ReplicaLost) when the peer's own error is there; a dead worker process
    (BrokenProcessPool: its replicas raised nothing) as a ReplicaLost."""
    if any(isinstance(err, BrokenProcessPool) for err in failures):
        return ReplicaLost("a replica process died (killed, or out of memory) and the others were stopped; the "
                           "run resumes from its last complete checkpoint with --resume auto")
    causes = [err for err in failures if not isinstance(err, ReplicaLost)]
    return (causes or failures)[0]


def _worker_process(local: int, *, processes: int, replica, args: tuple, compile_cache: str, mode: str) -> None:
    """One worker process, on its main thread: stop handlers and compile cache first, then
    torch_xla's topology set-up and one replica thread per device."""
    import torch_xla.runtime as xr
    from torch_xla._internal import pjrt

    launcher = os.getppid()
    PROCESS_SIGNALS.install()
    dump_stacks_on_signal()  # a fresh interpreter: kill -USR1 shows its replica threads too
    watch_launcher(launcher, PROCESS_SIGNALS)
    use_compile_cache(compile_cache, mode, local)
    failures: dict[int, BaseException] = {}

    def run_replica_thread() -> None:
        try:
            replica(*args)
        except BaseException as err:
            failures[xr.global_ordinal()] = err
            raise

    try:
        pjrt._run_thread_per_device(local, processes, run_replica_thread, pjrt.initialize_multiprocess)
    except BaseException as err:
        # torch_xla raises the failure of the lowest device, maybe one that only saw its peer go.
        cause = first_cause([failure for _, failure in sorted(failures.items())] or [err])
        exit_if_orphaned(launcher, f"error: {cause}", 3)
        raise cause from None
    exit_if_orphaned(launcher, None, 0)


def exit_if_orphaned(launcher: int, message: str | None, code: int) -> None:
    """With its launcher gone there is nobody to report to, and the pool's worker loop would
    wait forever for a next task (it holds its task queue's write end itself: no EOF comes)."""
    if os.getppid() == launcher:
        return
    if message:
        print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


def watch_launcher(launcher: int, signals, every_s: float = 1.0) -> None:
    """When the launching process dies without passing a signal on (SIGKILL, the out-of-memory
    killer), this worker is re-parented: its replicas then stop as on SIGTERM, checkpoint and
    exit, instead of training on unwatched and holding the chips from the next run."""
    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(every_s)
        signals.request("its launching process's exit")

    threading.Thread(target=watch, name="watch-launcher", daemon=True).start()


@contextlib.contextmanager
def forward_stop_signals():
    """In the launching process: a SIGTERM or SIGINT that reaches it (`kill PARENT`, Ctrl-C)
    goes on to the worker processes, which stop at the next step together; the launcher
    itself waits for them instead of dying first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum, frame):
        for child in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
