"""Train LoRA adapters through a curriculum of phases, on a TPU, a GPU or a CPU.

    tpu-lora train [--config CONFIG.yaml] [--phase N|all]
        [--resume auto|never|CHECKPOINT_DIR] [--force] [--accept-changes] [key=value ...]
    (or: python finetuning_pipeline/main.py ...)

The config's phases (phase1:, phase2:, phase3:, ...) run in order, each on its own data: raw
domain text (continued pretraining: every token is trained on) or chat/instruction Q&A
(assistant tokens only), each starting as its `init` says (the previous phase's adapter
continued or merged, or a fresh one on the base). Each phase reads data written by `python -m
dataset.prepare` and writes, under output_dir/phaseN/: adapter/ (PEFT layout),
checkpoints/, metrics.jsonl, summary.json; the run writes output_dir/loss.png.

Two runtimes run the same trainer (runtime.backend, finetuning_pipeline/runtime/): torch_xla
(`xla`: a TPU, or XLA:CPU rehearsing it) and native PyTorch (`native`: a GPU, a CPU, TorchTPU's
`tpu` device). The default, auto, takes xla where a TPU is attached or PJRT_DEVICE is set and
native on a GPU; the run's first lines say which, and why.

Without --config, the config named by $TPU_LORA_CONFIG, else the embedded default (the demo's,
with its paths under the repository wherever the command is started from; its tiny model and
data are built first if missing). On a TPU the XLA runtime's replicas are started the TPU host's way
(runtime/xla/launch.py: a process per chip, a replica thread per device); `parallel.launcher=tpu` takes
that same path on a CPU. On a CPU the world is otherwise one replica, run in this process, or
N replicas started by `PJRT_DEVICE=CPU torchrun --standalone --nproc-per-node N
finetuning_pipeline/main.py ...` (they talk through gloo on the loopback: collectives.py).
Everything that can be checked without a device (config, paths, data manifests against the
tokenizer, sequence length against the model, resume settings) is checked first.
The native runtime trains one device in this process (a GPU, a CPU, TorchTPU's `tpu`: on a TPU
host a process per chip, by torchrun's agent over this command), or N processes under
`--nproc-per-node N` (torchrun's agent run by this command: distributed/torchrun_agent.py) or
`torchrun --nproc-per-node N`: DDP under parallel.mode=dp, FSDP2 under fsdp; it imports no torch_xla.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python finetuning_pipeline/main.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from finetuning_pipeline.run.stop_signal import (
    PROCESS_SIGNALS,
    StopOnSignal,
    WallClockBudget,
    stopped_before_processes,
    stopped_before_step,
    watch_parent,
)
from utils.startup import pause_collector, resume_collector

if __name__ in ("__main__", "__mp_main__"):  # a process of its own: the command, or a TPU launcher's worker
    pause_collector()  # until start-up is over (utils/startup.py): its imports take 29% less time
    # A stop signal from here on is a stop (a flag honoured at the next place the run can stop),
    # not a KeyboardInterrupt in the middle of an import, nor SIGTERM's silent death
    PROCESS_SIGNALS.install()

from finetuning_pipeline.demo.inputs import DEMO_CONFIG, REPO, anchored_paths, ensure_demo_inputs
from finetuning_pipeline.distributed.collectives import launch_rank, torchrun_world
from finetuning_pipeline.distributed.host_agreement import check_hosts_agree
from finetuning_pipeline.distributed.resume_command import BECAME_TORCHRUN, resume_command
from finetuning_pipeline.distributed.torchrun_agent import run_torchrun_agent
from finetuning_pipeline.errors import SEE_THE_MASTERS, ConfigError, OutputWriteError, run_command
from finetuning_pipeline.monitor.console import summary_lines
from finetuning_pipeline.monitor.metrics_log import plot_losses
from finetuning_pipeline.run.checkpointing import checkpoint_step, complete_checkpoints
from finetuning_pipeline.run.input_checks import check_inputs, pin_model
from finetuning_pipeline.run.resume_plan import PhasePlan, check_resumable, plan_phases
from finetuning_pipeline.run.run_layout import OutputLock, RunLayout
from finetuning_pipeline.run_config import RunConfig, load_config
from finetuning_pipeline.runtime import backend, choice_line
from finetuning_pipeline.train.phase_loop import run_phase
from utils.durations import parse_duration
from utils.stack_dump import dump_stacks_on_signal


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tpu-lora train",
        description=__doc__.split("\n\n")[0],
        epilog="Overrides are dotted config keys, e.g. train.max_steps=200 lora.r=8 output_dir=outputs/try2. "
        "Unknown keys are an error. Exit status: 0 done (or stopped cleanly), 2 bad config or data, "
        "3 the run had to stop (a recompile after warm-up, diverged training, a failed checkpoint or output write, "
        "a replica that died). SIGTERM/SIGINT to any replica or to the launching process: every replica checkpoints "
        "the same step and exits 0; the same command then resumes. SIGUSR1 to any of its processes: each of its "
        "threads prints its stack (a run that seems hung), and the run carries on; a crash prints them too. "
        "Several replicas on a CPU, started the TPU host's way: CPU_NUM_DEVICES=N ... parallel.launcher=tpu; "
        "or as processes: --nproc-per-node N (or PJRT_DEVICE=CPU torchrun --standalone --nproc-per-node N "
        "finetuning_pipeline/main.py ..., whose own tracebacks and exit status 1 follow a refusal or a stop).",
    )
    parser.add_argument("--config", help=f"YAML run config (see finetuning_pipeline/configs/); default: ${CONFIG_ENV}, "
                        "else the embedded default (configs/demo.yaml, its paths under the repository)")
    parser.add_argument("--phase", default="all", metavar="N|all",
                        help="which phase to run: its number (1, 2, ... as the config's phaseN sections), or all "
                        "(default: every phase in order; finished ones are skipped under --resume auto)")
    parser.add_argument("--resume", default="auto",
                        help="auto (default): continue the unfinished phase from its newest complete checkpoint and "
                        "skip finished phases; never: start fresh; or a checkpoint directory to resume from")
    parser.add_argument("--force", action="store_true", help="with --resume never: replace an existing run's outputs")
    parser.add_argument("--accept-changes", action="store_true",
                        help="resume although optimisation settings changed since the checkpoint (train.lr, "
                        "warmup, decay, clipping, max_steps, ...: after a divergence, say); the run is then no longer "
                        "the one an uninterrupted run would give, and its summary records the changes. Model, LoRA, "
                        "data and seed changes are refused even so")
    parser.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                        help="start N processes of this command on this machine, as torchrun --standalone "
                        "--nproc-per-node N would (a GPU each; on a CPU, N processes), with torchrun's own agent run "
                        "here: a refusal is said once, a clean stop (SIGINT, SIGTERM) exits 0, and the exit status is "
                        "this command's (distributed/torchrun_agent.py). Default 1: this process. Under torchrun (on "
                        "several machines) leave it out")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser.parse_intermixed_args(argv)  # key=value overrides before and after the flags


@contextlib.contextmanager
def output_dir_lock(layout: RunLayout, parallel):
    """The master holds output_dir's lock for the run; every replica learns whether it got it."""
    lock, error = OutputLock(layout), None
    if parallel.master:
        try:
            lock.acquire()
        except ConfigError as err:
            error = err
    if not parallel.collectives.all(error is None):
        raise error or ConfigError(f"output_dir: {layout.root} is in use by another run {SEE_THE_MASTERS}")
    try:
        yield
    finally:
        lock.release()


# The config to train when --config is not given (see choose_config).
CONFIG_ENV = "TPU_LORA_CONFIG"

# The file-system errors that can only mean a write failed (a read that fails says EIO, ENOENT, ...).
WRITE_ERRNOS = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def resume_arguments(args: argparse.Namespace) -> list[str]:
    """The command's arguments as given, with --resume auto: without --config it chooses the same
    config again."""
    return [*(["--config", args.config] if args.config else []),
            *(["--nproc-per-node", str(args.nproc_per_node)] if args.nproc_per_node > 1 else []),
            "--phase", args.phase, "--resume", "auto", *args.overrides]


def run_replica(config: RunConfig, plans: list[PhasePlan], notes: list[str], resume_command: str, budget, backend,
                launcher: int) -> None:
    """Entry point of each replica (one per chip under dp, one per host under fsdp), on the
    main thread of its process or on a launcher's worker thread. Every replica runs the same
    phases and stops after the same one. notes: what the plan says (a phase resumed, one
    skipped), said by the master once it holds output_dir, so that a second command on the same
    output_dir is refused before it says anything of the run. launcher: torchrun's agent, the
    parent of each of its processes, watched by them."""
    resume_collector()  # (a TPU launcher's worker: its start-up ends here)
    runtime, parallel, device = backend.start(config)
    layout = RunLayout(config.output_dir)
    finished = False
    try:
        with StopOnSignal(budget) as stop, output_dir_lock(layout, parallel):
            if torchrun_world() > 1:  # torchrun killed (SIGKILL, the OOM killer): its processes stop with it
                watch_parent(launcher, stop.signals, "torchrun's exit")
            if parallel.master:
                for note in notes:
                    print(note, flush=True)
            check_hosts_agree(layout, plans, parallel.collectives, config.lineage)
            trained = False  # (a stop before this command trained a step draws no loss plot)
            for plan in plans:
                if plan.replace and parallel.master:
                    shutil.rmtree(layout.phase_dir(plan.phase))
                result = run_one_phase(config, plan, parallel, device, stop, layout, runtime)
                if result.stopped_before_step is not None:
                    if parallel.master:
                        print(stopped_before_step(stop.reason(), result.stopped_before_step, plan.phase,
                                                  resume_command), flush=True)
                    break
                trained = True
                if result.summary is not None:
                    print(summary_lines(result.summary), flush=True)
                if result.stopped_at_step is not None:
                    print(f"replica {parallel.rank}: stopped after step {result.stopped_at_step} of phase {plan.phase} "
                          f"({stop.reason()})", flush=True)
                    if parallel.master:
                        print(stop.after_stop(result.stopped_at_step, plan.phase, resume_command), flush=True)
                    break
            if parallel.master and trained:  # one writer: on a pod every host runs main.py, and output_dir is shared
                plot = plot_losses(config.output_dir, config.phase_numbers())
                if plot is not None:
                    print(f"loss plot: {plot}", flush=True)
        finished = True
    finally:
        parallel.collectives.close(clean=finished)


def run_one_phase(config: RunConfig, plan: PhasePlan, parallel, device, stop, layout: RunLayout, runtime):
    """run_phase, with a file-system error named for the user (metrics, TensorBoard, adapter,
    summary, data shards; checkpoints vote on theirs)."""
    try:
        return run_phase(config, plan.phase, parallel=parallel, device=device, resume_from=plan.resume_from,
                         stop_requested=stop.requested, signalled=stop.signalled,
                         accepted_changes=plan.accepted_changes, runtime=runtime)
    except OSError as err:
        latest = complete_checkpoints(layout.checkpoints(plan.phase))
        verb = "write" if err.errno in WRITE_ERRNOS else "access"
        raise OutputWriteError(
            f"cannot {verb} {err.filename or layout.phase_dir(plan.phase)}: {err.strerror or err}. The last "
            f"intact checkpoint is {latest[-1] if latest else 'none (the phase will start over)'}; fix the "
            "disk (space, permissions, a read-only mount, a missing file) and rerun with --resume auto"
        ) from None


def main(argv: list[str] | None = None) -> int:
    with PROCESS_SIGNALS.caught():  # (already caught where main.py is the process's own: its first lines)
        return run_command(train, argv, own_stop_signals=True)


def train(argv: list[str] | None) -> int:
    started = time.time()  # a session budget (train.max_wall_time) counts from here
    # The environment the runtime is chosen in: as the command started (the embedded default's
    # preparation sets PJRT_DEVICE for its own imports; that is not the user's choice)
    environ = dict(os.environ)
    launcher = os.getppid()  # (under torchrun, its agent: watched by each replica)
    args = parse_args(argv)
    check_process_count(args.nproc_per_node)
    dump_stacks_on_signal()  # kill -USR1 PID: where each thread is (utils/stack_dump.py)
    config_path, overrides = choose_config(args.config, args.overrides, args.phase)
    config = load_config(config_path, overrides)
    command, script = sys.argv[1:] if argv is None else list(argv), str(Path(__file__).resolve())
    if args.nproc_per_node > 1 and torchrun_world() == 1:  # its processes run this command and say the rest
        resume_collector()  # (this process only waits on them)
        if PROCESS_SIGNALS.stop_requested:  # (while it started: no process started yet)
            print(stopped_before_processes(PROCESS_SIGNALS.received, args.nproc_per_node,
                                           resume_command(Path(__file__).resolve(), resume_arguments(args), ())),
                  flush=True)
            return 0
        return run_torchrun_agent(["--standalone"], args.nproc_per_node, script, command)
    say = print if launch_rank() == 0 else (lambda *args, **kwargs: None)  # torchrun: said once
    runtime = backend(config, environ)
    runtime.prepare_process(config, first_process=launch_rank() == 0)  # before transformers is imported
    say(choice_line(runtime, config), flush=True)
    phases = selected_phases(args.phase, config)
    pin_model(config)
    check_inputs(config, phases, machine=runtime.target_machine(config))
    resume_collector()  # start-up is over: transformers and the runtime are imported (utils/startup.py)
    launched = runtime.before_run(config, command, script)  # (TorchTPU on a TPU host: a process per chip)
    if launched is not None:  # the run ran in the processes this one started
        return launched
    notes: list[str] = []  # the plan's, said once the run holds output_dir (run_replica)
    try:
        plans = plan_phases(config, phases, args.resume, args.force, notes.append)
        check_resumable(config, plans, args.accept_changes, notes.append)
    except Exception:  # a refused plan: what it found before the refusal is part of the answer
        for note in notes:
            say(note)
        raise
    resume = resume_command(Path(__file__).resolve(), resume_arguments(args), runtime.device_environment)
    if PROCESS_SIGNALS.stop_requested and plans and torchrun_world() == 1:
        # A stop while this command started, which alone decides (torchrun's processes vote on
        # theirs before their first step): no replica is started
        first = plans[0]
        print(stopped_before_step(PROCESS_SIGNALS.received, checkpoint_step(first.resume_from), first.phase, resume),
              flush=True)
        return 0
    budget = WallClockBudget(parse_duration(config.train.max_wall_time) if config.train.max_wall_time else None,
                             started, label=config.train.max_wall_time or "")
    if not plans:  # every phase finished: nothing is written
        for note in notes:
            say(note)
        return 0
    # run_replica on every replica of this process, started the runtime's way (its launcher)
    runtime.launch(config, run_replica, (config, plans, notes if launch_rank() == 0 else [], resume, budget, runtime,
                                         launcher))
    return 0


def check_process_count(given: int) -> None:
    """--nproc-per-node: at least 1, and under torchrun (its own agent's processes included) the
    process count it started on this node."""
    if given < 1:
        raise ConfigError(f"--nproc-per-node {given}: expected a count of processes, 1 or more")
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if given > 1 and local is not None and int(local) != given:
        raise ConfigError(f"--nproc-per-node {given}: this process is one of torchrun's {local} on this node; leave "
                          "the flag out under torchrun (its own --nproc-per-node counts the processes)")


def selected_phases(given: str, config: RunConfig) -> list[int]:
    """--phase: every phase of the config in order ("all"), or the one numbered."""
    numbers = config.phase_numbers()
    if given == "all":
        return numbers
    if given.isdigit() and int(given) in numbers:
        return [int(given)]
    raise ConfigError(f"--phase {given}: expected all or a phase of the config: {', '.join(map(str, numbers))} "
                      f"(its phase1: ... phase{numbers[-1]}: sections)")


def choose_config(given: str | None, overrides: list[str], phase: str = "all") -> tuple[Path, list[str]]:
    """The config file and the overrides to load it with: --config; else $TPU_LORA_CONFIG; else
    the embedded default, whose relative paths are anchored at the repository (ahead of the
    user's overrides, which keep their meaning) and whose tiny model and the data of the
    phases `phase` selects are built if missing. Says which config it chose when none was named."""
    if given:
        return Path(given), overrides
    # said by the command the user typed: torchrun's first process, or main.py running torchrun's agent itself
    say = print if launch_rank() == 0 and not os.environ.get(BECAME_TORCHRUN) else (lambda *args, **kwargs: None)
    if os.environ.get(CONFIG_ENV):
        say(f"config: {os.environ[CONFIG_ENV]} (from ${CONFIG_ENV})", flush=True)
        return Path(os.environ[CONFIG_ENV]), overrides
    say(f"config: {DEMO_CONFIG} (the embedded default: no --config given and ${CONFIG_ENV} unset)", flush=True)
    anchored = anchored_paths(DEMO_CONFIG, REPO)
    demo = load_config(DEMO_CONFIG, anchored + overrides)
    backend(demo).prepare_process(demo, first_process=launch_rank() == 0)  # (building its base imports transformers)
    ensure_demo_inputs(demo, selected_phases(phase, demo))
    return DEMO_CONFIG, anchored + overrides


if __name__ == "__main__":
    sys.exit(main())
