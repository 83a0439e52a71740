"""Preflight's rehearsal: the real trainer on XLA:CPU with a shrunken model of the run's
architecture (2 layers, hidden 64) under the run's LoRA, parallel mode and checkpointing: a
few steps of each phase with the recompile guard on, a checkpoint resumed to the same adapter
bit for bit, and a merged export that loads in plain transformers."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from safetensors.torch import load_file

from dataset.prepare import PrepareOptions, prepare
from dataset.samples import ALPACA, CHAT_QA, DOMAIN_TEXT
from finetuning_pipeline.exporters.merged import export_merged
from finetuning_pipeline.run.run_layout import RunLayout
from finetuning_pipeline.run_config import RunConfig
from utils.hub_models import model_dir

ROOT = Path(__file__).resolve().parents[2]
REHEARSAL_STEPS = 4
RUN_TIMEOUT_S = 1800  # a rehearsal's or check's run of a few steps: a compile or two, then seconds
STACKS_S = 5  # from asking a hung run for its stacks to killing it
REHEARSAL_CHIPS = 4  # virtual XLA:CPU devices of an fsdp rehearsal


def shrunken_config(model_config, vocab_size: int):
    """The same architecture, 2 layers of width 64, same GQA grouping, for a CPU rehearsal."""
    small = copy.deepcopy(model_config)
    heads = 4
    kv = max(1, heads * getattr(model_config, "num_key_value_heads", model_config.num_attention_heads)
             // model_config.num_attention_heads)
    small.num_hidden_layers, small.hidden_size, small.intermediate_size = 2, 64, 128
    small.num_attention_heads, small.num_key_value_heads, small.head_dim = heads, kv, 16
    small.vocab_size = vocab_size
    if getattr(small, "layer_types", None):  # one layer of each attention kind (hybrid models)
        small.layer_types = (sorted(set(model_config.layer_types)) * 2)[:2]
    if hasattr(small, "query_pre_attn_scalar"):
        small.query_pre_attn_scalar = 16
    return small


def run_trainer(config_path: Path, args: list[str], mode: str, log: Path, device: str = "CPU",
                env: dict | None = None, timeout_s: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    """main.py in a process of its own on `device` (PJRT_DEVICE), with `env` added to this
    process's environment; an fsdp run on a CPU gets REHEARSAL_CHIPS virtual devices. Its output
    is appended to `log`. A run still going after `timeout_s` is hung (what a check exists to
    find, such as a collective whose peer never comes, must not hang the check): every process
    of it prints its threads' stacks (SIGUSR1), then they are killed, and it returns failed,
    saying so. It runs in a process group of its own, so that its launcher's workers go too; on
    Ctrl-C (which reaches the terminal's group, not its) or any other error, it is killed."""
    env = {**os.environ, **(env or {}), "PJRT_DEVICE": device, "PYTHONUNBUFFERED": "1"}
    if mode == "fsdp" and device == "CPU":
        env["CPU_NUM_DEVICES"] = str(REHEARSAL_CHIPS)
    command = [sys.executable, str(ROOT / "finetuning_pipeline" / "main.py"), "--config", str(config_path), *args]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                             start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        signal_group(child.pid, signal.SIGUSR1)
        time.sleep(STACKS_S)
        signal_group(child.pid, signal.SIGKILL)
        stdout, stderr = child.communicate()
        stderr += (f"\nerror: the run did not end within {timeout_s:.0f} s and was killed: a hang (the stacks above "
                   "show where each thread was)\n")
    except BaseException:
        signal_group(child.pid, signal.SIGKILL)
        child.wait()
        raise
    proc = subprocess.CompletedProcess(command, child.returncode, stdout, stderr)
    with log.open("a") as f:
        f.write(f"$ main.py --config {config_path} {' '.join(args)}\n{proc.stdout}{proc.stderr}\n")
    return proc


def signal_group(pid: int, signum: int) -> None:
    """`signum` to every process of the process group `pid` leads (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signum)


def small_run(config: RunConfig, *, model_path: Path, output_dir: Path, data: dict[int, Path], steps: int,
              on_cpu: bool) -> dict:
    """The run config of a few steps of a small copy of the run's model (the rehearsal's, make
    tpu-check's): the run's own settings (LoRA, mode, dtype, attention, capture, scan), with a
    rehearsal's length, logging (no W&B, no time budget) and outputs; phases without data off.
    On a CPU the mesh keeps its kind only: its devices are fewer than the slice's chips (pure
    data parallelism, or the base sharded over every chip)."""
    run = config.to_dict()
    run["output_dir"] = str(output_dir)
    run["model"].update(path=str(model_path), tokenizer=None)
    run["train"].update(max_steps=steps, grad_accum=min(config.train.grad_accum, 2), warmup_steps=2,
                        warmup_compiles_steps=1, max_wall_time=None)
    run["eval"].update(every=0, max_batches=1)
    run["logging"].update(every=1, progress_bar=False, tensorboard=False)
    run["logging"]["wandb"]["project"] = None
    if on_cpu:
        run["parallel"]["mesh"] = {"data": -1, "fsdp": 1} if config.parallel.mesh.fsdp == 1 else {"data": 1,
                                                                                                   "fsdp": -1}
    for phase in config.phase_numbers():
        section = run[f"phase{phase}"]
        section.update(max_steps=None, seq_len=None)
        if section["adapters"]:  # side by side: every adapter on the rehearsal's data of the phase
            section["adapters"] = {name: {**adapter, "data": str(data[phase]), "max_steps": None}
                                   for name, adapter in section["adapters"].items()}
        else:
            section["data"] = str(data[phase]) if phase in data else ""
    return run


def trained_adapter(config: RunConfig, out: RunLayout, phase: int) -> Path:
    """The phase's adapter, or its first adapter side by side."""
    names = list(config.phase(phase).adapters)
    return out.side_by_side_adapters(phase) / names[0] if names else out.adapter(phase)


def rehearsal_data(config: RunConfig, phases: list[int], root: Path, data_ready: bool) -> tuple[dict, Path, str]:
    """(phase -> data dir, tokenizer dir, description): the prepared data when it checked out,
    else the bundled samples under the demo's tokenizer."""
    if data_ready:
        tokenizer = Path(config.model.tokenizer or model_dir(config.model.path, config.model.revision))
        # (adapters side by side rehearse on their first adapter's data)
        return ({p: Path(next(iter(config.data_dirs(p).values()))) for p in phases}, tokenizer,
                "prepared data (phaseN.data)")
    from finetuning_pipeline.demo.tiny_model import write_tiny_model  # transformers: only when it is needed

    tokenizer = write_tiny_model(root / "tokenizer")
    inputs = {1: [DOMAIN_TEXT], 2: [CHAT_QA, ALPACA]}  # phase 1 text, every later phase chat
    data = {}
    for phase in phases:
        data[phase] = root / f"data{phase}"
        prepare(PrepareOptions(inputs=[str(path) for path in inputs[min(phase, 2)]], tokenizer=str(tokenizer),
                               seq_len=128, out=str(data[phase]), quiet=True))
    return data, tokenizer, "bundled samples at seq_len 128 (phaseN.data is not prepared yet)"


def rehearse(config: RunConfig, model_config, root: Path, data_ready: bool, *, phases: list[int],
             scan_layers: bool) -> dict:
    """Train, checkpoint, resume and export a shrunken model through the real entry points.
    phases: the phases the config runs; scan_layers: whether the real model's layers will be
    scanned (the 2-layer model takes the same path; unset would decide by its own depth)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    started = time.perf_counter()
    data, tokenizer_dir, data_note = rehearsal_data(config, phases, root, data_ready)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = model_config.vocab_size if data_ready else len(tokenizer)
    model = AutoModelForCausalLM.from_config(shrunken_config(model_config, vocab))
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")

    run = small_run(config, model_path=root / "model", output_dir=root / "run", data=data, steps=REHEARSAL_STEPS,
                    on_cpu=True)
    run["model"]["dtype"] = "float32"
    run["train"].update(micro_batch=1, recompile_policy="error", scan_layers=scan_layers)
    run["eval"]["micro_batch"] = None
    run["checkpoint"].update(every=2, keep=REHEARSAL_STEPS)
    config_path = root / "rehearsal.yaml"
    config_path.write_text(yaml.safe_dump(run))
    log = root / "rehearsal.log"
    mode = config.parallel.mode
    steps = {"data": data_note, "architecture": type(model).__name__, "log": str(log)}

    proc = run_trainer(config_path, ["--resume", "never", "--force"], mode, log)
    if proc.returncode != 0:
        return {**steps, "passed": False, "failed_at": "training", "detail": (proc.stdout + proc.stderr)[-3000:]}
    out = RunLayout(root / "run")
    summaries = {p: json.loads(out.summary(p).read_text()) for p in phases}
    steps["phases"] = {f"phase{p}": {k: s[k] for k in ("steps", "compiles_total", "compiles_after_warmup",
                                                         "host_syncs_per_step", "eval_loss_before", "eval_loss_after",
                                                         "scanned_layers")}
                       for p, s in summaries.items()}

    first = phases[0]
    adapter_file = trained_adapter(config, out, first) / "adapter_model.safetensors"
    uninterrupted = load_file(adapter_file)
    checkpoint = out.checkpoints(first) / "step_00000002"
    proc = run_trainer(config_path, ["--phase", str(first), "--resume", str(checkpoint)], mode, log)
    if proc.returncode != 0:
        return {**steps, "passed": False, "failed_at": "resume", "detail": (proc.stdout + proc.stderr)[-3000:]}
    resumed = load_file(adapter_file)
    identical = uninterrupted.keys() == resumed.keys() and all((uninterrupted[k] == resumed[k]).all() for k in resumed)
    steps["resume_bitwise_identical"] = bool(identical)
    if not identical:
        return {**steps, "passed": False, "failed_at": "resume", "detail": "the resumed adapter differs"}

    last = phases[-1]  # served as the run's summary says: the adapters merged beneath it, then its own
    adapters = [str(out.adapter(n)) for n in config.lineage(last)[0]] + [str(trained_adapter(config, out, last))]
    merged = export_merged(str(root / "model"), adapters, str(root / "merged"))
    AutoModelForCausalLM.from_pretrained(merged)  # plain transformers, no project code
    steps["export"] = str(merged)
    recompiles = sum(s["compiles_after_warmup"] for s in summaries.values())
    steps["passed"] = recompiles == 0
    if recompiles:
        steps["failed_at"], steps["detail"] = "recompile guard", f"{recompiles} compiles after warm-up"
    steps["seconds"] = round(time.perf_counter() - started, 1)
    return steps
