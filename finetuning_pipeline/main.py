"""Train LoRA adapters through the two-phase curriculum on TPU (or XLA:CPU).

    PJRT_DEVICE=TPU python finetuning_pipeline/main.py [--config CONFIG.yaml] [--phase 1|2|all]
        [--resume auto|never|CHECKPOINT_DIR] [--force] [--accept-changes] [key=value ...]

Phase 1 continues pretraining on raw domain text (every token is trained on); phase 2 tunes
on chat Q&A (assistant tokens only). Each phase reads data written by `python -m
dataset.prepare` and writes, under output_dir/phaseN/: adapter/ (PEFT layout),
checkpoints/, metrics.jsonl, summary.json; the run writes output_dir/loss.png.

Without --config, the config named by $TPU_LORA_CONFIG, else the embedded default (the demo's,
with its paths under the repository wherever the command is started from; its tiny model and
data are built first if missing). On a TPU the replicas are started the TPU host's way
(launch.py: a process per chip, a replica thread per device); `parallel.launcher=tpu` takes
that same path on a CPU. On a CPU the world is otherwise one replica, run in this process, or
N replicas started by `PJRT_DEVICE=CPU torchrun --standalone --nproc-per-node N
finetuning_pipeline/main.py ...` (they talk through gloo on the loopback: collectives.py).
Everything that can be checked without a device (config, paths, data manifests against the
tokenizer, sequence length against the model, resume settings) is checked first.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python finetuning_pipeline/main.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from finetuning_pipeline.checkpointing import complete_checkpoints  # noqa: E402
from finetuning_pipeline.collectives import launch_rank, torchrun_world  # noqa: E402
from finetuning_pipeline.config import RunConfig, load_config  # noqa: E402
from finetuning_pipeline.errors import ConfigError, OutputWriteError, run_command  # noqa: E402
from finetuning_pipeline.resume_plan import PhasePlan, check_resumable, plan_phases  # noqa: E402
from finetuning_pipeline.run_layout import OutputLock, RunLayout  # noqa: E402
from finetuning_pipeline.stop_signal import WallClockBudget, parse_duration  # noqa: E402
from utils.hub_models import model_dir, resolve_model  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python finetuning_pipeline/main.py",
        description=__doc__.split("\n\n")[0],
        epilog="Overrides are dotted config keys, e.g. train.max_steps=200 lora.r=8 output_dir=outputs/try2. "
        "Unknown keys are an error. Exit status: 0 done (or stopped cleanly), 2 bad config or data, "
        "3 the run had to stop (a recompile after warm-up, diverged training, a failed checkpoint or output write, "
        "a replica that died). SIGTERM/SIGINT to any replica or to the launching process: every replica checkpoints "
        "the same step and exits 0; the same command then resumes. Several replicas on a CPU, started the TPU host's "
        "way: CPU_NUM_DEVICES=N ... parallel.launcher=tpu; or as processes: PJRT_DEVICE=CPU torchrun --standalone "
        "--nproc-per-node N finetuning_pipeline/main.py ...",
    )
    parser.add_argument("--config", help=f"YAML run config (see finetuning_pipeline/configs/); default: ${CONFIG_ENV}, "
                        "else the embedded default (configs/demo.yaml, its paths under the repository)")
    parser.add_argument("--phase", choices=("1", "2", "all"), default="all", help="which phase(s) to run (default all)")
    parser.add_argument("--resume", default="auto",
                        help="auto (default): continue the unfinished phase from its newest complete checkpoint and "
                        "skip finished phases; never: start fresh; or a checkpoint directory to resume from")
    parser.add_argument("--force", action="store_true", help="with --resume never: replace an existing run's outputs")
    parser.add_argument("--accept-changes", action="store_true",
                        help="resume although optimisation settings changed since the checkpoint (train.lr, "
                        "warmup, decay, clipping, max_steps, ...: after a divergence, say); the run is then no longer "
                        "the one an uninterrupted run would give, and its summary records the changes. Model, LoRA, "
                        "data and seed changes are refused even so")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser.parse_args(argv)


def preflight_checks(config: RunConfig, phases: list[int]) -> None:
    """Everything that can fail before a device is touched; raises ConfigError / DataError /
    HubModelError."""
    from transformers import AutoConfig

    from dataset.loader import open_prepared
    from dataset.manifest import tokenizer_fingerprint
    from finetuning_pipeline.attention_masks import mask_windows
    from finetuning_pipeline.chunked_loss import resolve_chunk_tokens
    from finetuning_pipeline.kernel_attention import choose_attention
    from finetuning_pipeline.model_loading import check_lora_targets
    from utils.tokenizer_loading import load_tokenizer
    from utils.xla_runtime import device_kind

    files = Path(model_dir(config.model.path, config.model.revision))  # a Hub id: its snapshot, pinned by pin_model
    if not (files / "config.json").is_file():
        raise ConfigError(f"model.path: {files} has no config.json (a local Hugging Face model directory or a "
                          "Hub id is expected)")
    model_config = AutoConfig.from_pretrained(files)
    try:
        resolve_chunk_tokens(config.train.loss_chunk_tokens, model_config)
        mask_windows(model_config)
        choose_attention(config.model.attention, model_config, on_tpu=device_kind() == "TPU",
                         spmd_mesh=config.parallel.mode == "fsdp")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    tokenizer = load_tokenizer(config.model.tokenizer or files,
                               "model.tokenizer" if config.model.tokenizer else "model.path")
    fingerprint = tokenizer_fingerprint(tokenizer)
    max_positions = getattr(model_config, "max_position_embeddings", None)
    for phase in phases:
        key = f"phase{phase}.data"
        data = config.phase(phase).data
        if not data:
            raise ConfigError(f"{key}: not set (a directory written by `python -m dataset.prepare`)")
        if not Path(data).is_dir():
            raise ConfigError(f"{key}: {data} does not exist; run `python -m dataset.prepare ... --out {data}` first")
        manifest = open_prepared(data, fingerprint=fingerprint, seq_len=config.phase(phase).seq_len,
                                 setting=f"phase{phase}.seq_len")
        if manifest["phase"] != phase:
            raise ConfigError(f"{key}: {data} was prepared as phase {manifest['phase']} data, not phase {phase}")
        if max_positions is not None and manifest["seq_len"] > max_positions:
            raise ConfigError(
                f"{key}: seq_len {manifest['seq_len']} exceeds the model's max_position_embeddings {max_positions}"
            )
        if manifest["counts"]["train"] < 1:
            raise ConfigError(f"{key}: {data} has no training blocks")
    if 1 in phases or (2 in phases and config.phase2.init != "continue"):
        try:  # phase 2 `continue` trains the phase-1 adapter, with its own targets
            check_lora_targets(model_config, config.lora_config())
        except ValueError as err:
            raise ConfigError(f"lora.target_modules: {err}") from None
    if 2 in phases and 1 not in phases and config.phase2.init != "fresh":
        adapter = RunLayout(config.output_dir).adapter(1)
        if not (adapter / "adapter_config.json").is_file():
            raise ConfigError(f"phase2.init={config.phase2.init} needs the phase-1 adapter ({adapter}); "
                              "run phase 1 first, or set phase2.init=fresh")
    if config.logging.wandb.project:
        from finetuning_pipeline.wandb_log import check_wandb_available

        try:
            check_wandb_available()
        except ImportError as err:
            raise ConfigError(str(err)) from None
    inputs = {"model.path": str(files), "model.tokenizer": config.model.tokenizer,
              "phase1.data": config.phase1.data, "phase2.data": config.phase2.data}
    RunLayout(config.output_dir).check_apart_from(inputs)
    probe_output_dir(config.output_dir)


def pin_model(config: RunConfig) -> None:
    """A Hub id in model.path is downloaded now, once, and pinned to the commit it resolves to
    (config.model.revision): every replica loads those files, and the checkpoints and the
    summary record the commit, so a resume cannot silently train on other weights. A Hub id
    that cannot be resolved is a HubModelError (exit 2, errors.py)."""
    config.model.revision = resolve_model(config.model.path, config.model.revision).commit


def probe_output_dir(output_dir: str) -> None:
    """Fail now, not at the first checkpoint, if the outputs cannot be written."""
    path = Path(output_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"output_dir: cannot write to {path} ({err.strerror}); choose another output_dir") from None


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
        raise error or ConfigError(f"output_dir: {layout.root} is in use by another run (see the master's error)")
    try:
        yield
    finally:
        lock.release()


# The config to train when --config is not given (see choose_config).
CONFIG_ENV = "TPU_LORA_CONFIG"

# The file-system errors that can only mean a write failed (a read that fails says EIO, ENOENT, ...).
WRITE_ERRNOS = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def run_replica(config: RunConfig, plans: list[PhasePlan], resume_command: str, budget) -> None:
    """Entry point of each replica (one per chip under dp, one per host under fsdp), on the
    main thread of its process or on a launcher's worker thread. Every replica runs the same
    phases and stops after the same one."""
    from finetuning_pipeline.host_agreement import check_hosts_agree
    from finetuning_pipeline.parallel import start
    from finetuning_pipeline.stop_signal import StopOnSignal

    parallel, device = start(config.parallel.mode, (config.parallel.mesh.data, config.parallel.mesh.fsdp),
                             config.parallel.host_timeout_s)
    layout = RunLayout(config.output_dir)
    finished = False
    try:
        with StopOnSignal(budget) as stop, output_dir_lock(layout, parallel):
            check_hosts_agree(layout, plans, parallel.collectives)
            for plan in plans:
                if plan.replace and parallel.master:
                    shutil.rmtree(layout.phase_dir(plan.phase))
                result = run_one_phase(config, plan, parallel, device, stop, layout)
                if result.summary is not None:
                    print(format_summary(result.summary), flush=True)
                if result.stopped_at_step is not None:
                    print(f"replica {parallel.rank}: stopped after step {result.stopped_at_step} of phase {plan.phase} "
                          f"({stop.reason()})", flush=True)
                    if parallel.master:
                        print(stop.after_stop(result.stopped_at_step, plan.phase, resume_command), flush=True)
                    break
        finished = True
    finally:
        parallel.collectives.close(clean=finished)


def run_one_phase(config: RunConfig, plan: PhasePlan, parallel, device, stop, layout: RunLayout):
    """run_phase, with a file-system error named for the user (metrics, TensorBoard, adapter,
    summary, data shards; checkpoints vote on theirs)."""
    from finetuning_pipeline.trainer import run_phase

    try:
        return run_phase(config, plan.phase, parallel=parallel, device=device, resume_from=plan.resume_from,
                         stop_requested=stop.requested, accepted_changes=plan.accepted_changes)
    except OSError as err:
        latest = complete_checkpoints(layout.checkpoints(plan.phase))
        verb = "write" if err.errno in WRITE_ERRNOS else "access"
        raise OutputWriteError(
            f"cannot {verb} {err.filename or layout.phase_dir(plan.phase)}: {err.strerror or err}. The last "
            f"intact checkpoint is {latest[-1] if latest else 'none (the phase will start over)'}; fix the "
            "disk (space, permissions, a read-only mount, a missing file) and rerun with --resume auto"
        ) from None


def format_summary(summary: dict) -> str:
    if "stopped_at_step" in summary:
        return f"phase {summary['phase']}: stopped at step {summary['stopped_at_step']}"
    if summary["eval_loss_after"] is None:
        evaluation = "no eval data"
    else:
        evaluation = (f"eval loss {summary['eval_loss_before']:.4f} -> {summary['eval_loss_after']:.4f} (perplexity "
                      f"{summary['perplexity_before']:.1f} -> {summary['perplexity_after']:.1f})")
    return (
        f"phase {summary['phase']}: {summary['steps']} steps, {evaluation}, {summary['tokens_per_sec'] or 0:,.0f} tokens/s, "
        f"compiles {summary['compiles_total']} ({summary['compiles_after_warmup']} after warm-up), "
        f"host syncs/step {summary['host_syncs_per_step']}"
    )


def main(argv: list[str] | None = None) -> int:
    return run_command(train, argv)


def train(argv: list[str] | None) -> int:
    started = time.time()  # a session budget (train.max_wall_time) counts from here
    args = parse_args(argv)
    phases = [1, 2] if args.phase == "all" else [int(args.phase)]
    config_path, overrides = choose_config(args.config, args.overrides, phases)
    config = load_config(config_path, overrides)
    pin_model(config)
    preflight_checks(config, phases)
    plans = plan_phases(config, phases, args.resume, args.force)
    check_resumable(config, plans, args.accept_changes)
    budget = WallClockBudget(parse_duration(config.train.max_wall_time) if config.train.max_wall_time else None,
                             started, label=config.train.max_wall_time or "")
    if plans:
        # The command as given: without --config it chooses the same config again.
        resume_command = shlex.join([sys.executable, os.path.relpath(Path(__file__).resolve()),
                                     *(["--config", args.config] if args.config else []),
                                     "--phase", args.phase, "--resume", "auto", *args.overrides])
        start_replicas(config, (config, plans, resume_command, budget))
    if launch_rank() == 0:
        from finetuning_pipeline.metrics_log import plot_losses

        plot = plot_losses(config.output_dir)
        if plot is not None:
            print(f"loss plot: {plot}")
    return 0


def start_replicas(config: RunConfig, args: tuple) -> None:
    """run_replica on every replica of this host, started as parallel.launcher says (launch.py)."""
    from finetuning_pipeline.launch import apply_single_chip, launch_replicas, resolve_launcher
    from finetuning_pipeline.parallel import use_compile_cache
    from utils.xla_runtime import device_kind

    kind = device_kind()
    if torchrun_world() > 1 and kind != "CPU":
        raise ConfigError("torchrun starts replicas on a CPU only (PJRT_DEVICE=CPU); on a TPU run plain python: "
                          "it starts one process per chip")
    launcher = resolve_launcher(config.parallel.launcher, config.parallel.mode, kind, torchrun_world())
    if config.parallel.single_chip:
        apply_single_chip(kind)
    if launcher == "tpu":
        launch_replicas(run_replica, args, compile_cache=config.xla.compile_cache_dir, mode=config.parallel.mode)
    else:
        use_compile_cache(config.xla.compile_cache_dir, config.parallel.mode, int(os.environ.get("LOCAL_RANK", "0")))
        run_replica(*args)


def choose_config(given: str | None, overrides: list[str], phases: list[int] = (1, 2)) -> tuple[Path, list[str]]:
    """The config file and the overrides to load it with: --config; else $TPU_LORA_CONFIG; else
    the embedded default, whose relative paths are anchored at the repository (ahead of the
    user's overrides, which keep their meaning) and whose tiny model and the data of `phases`
    are built if missing. Says which config it chose when none was named."""
    if given:
        return Path(given), overrides
    if os.environ.get(CONFIG_ENV):
        print(f"config: {os.environ[CONFIG_ENV]} (from ${CONFIG_ENV})", flush=True)
        return Path(os.environ[CONFIG_ENV]), overrides
    from finetuning_pipeline.demo_inputs import DEMO_CONFIG, REPO, anchored_paths, ensure_demo_inputs

    print(f"config: {DEMO_CONFIG} (the embedded default: no --config given and ${CONFIG_ENV} unset)", flush=True)
    anchored = anchored_paths(DEMO_CONFIG, REPO)
    ensure_demo_inputs(load_config(DEMO_CONFIG, anchored + overrides), list(phases))
    return DEMO_CONFIG, anchored + overrides


if __name__ == "__main__":
    sys.exit(main())
