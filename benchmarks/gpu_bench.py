"""The native runtime's training step on a GPU against HF Trainer + PEFT, in one run on one device.

    python -m benchmarks.gpu_bench [--shape mistral-7b] [--batch 4] [--seq-len 1024] [--steps 12]
                                   [--device cuda] [--compile layers] [--profile] [--out outputs/bench/gpu_bench.json]

Three measurements, each in a process of its own (a clean allocator for its peak memory), on
Mistral-7B's shape (finetuning_pipeline/model_configs/Mistral-7B-v0.3, random bf16 weights: the
speed and memory of a step do not depend on the values), LoRA r 16 (alpha 32) on all 7 targets:
  ours    the native runtime's real step (train/stepper.py's Stepper with the native runtime's step: the micro-batch
          gradients, our masked AdamW, fp32 LoRA weights under the bf16 base), each decoder layer
          compiled (--compile layers) or eager;
  frozen  forward + backward through the frozen base (activation gradients only), compiled alike:
          the floor a LoRA step cannot beat;
  peer    transformers.Trainer (adamw_torch, bf16 base) on a peft LoRA of the same rank, targets
          and scaling, on the same token blocks.
Steps after the first WARMUP_STEPS (the compiles) are timed, from the end of the last warm-up
step's work to the end of the last step's (torch.accelerator.synchronize). Targets:
ours >= 1.5x the peer's tokens/s; ours <= 1.10x the frozen step; our peak memory <= 0.75x the
peer's. `--profile` adds, for ours and the frozen floor, the device time and the kernels of one more
step under PyTorch's profiler (on a CPU: its ops and their CPU time). `--shape tiny --device cpu`
runs the same code on the demo's shape on a CPU (a test does:
the script runs as written wherever a GPU is at hand).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.results import update_results

REPO = Path(__file__).resolve().parent.parent
SHAPES = {
    "mistral-7b": REPO / "finetuning_pipeline" / "model_configs" / "Mistral-7B-v0.3" / "config.json",
    "tiny": {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 4096},
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, LR = 16, 32, 1e-4
WARMUP_STEPS = 2
DTYPES = {"cuda": "bfloat16", "cpu": "float32"}  # a CPU's bf16 matmuls are emulated: fp32 there
QUANTIZE = ["none", "q8_0", "q4_0", "nf4"]
CHECKPOINTING = ["off", "full", "selective"]
TABLE_QUANTIZE = ["none", "q8_0", "nf4"]
LONG_CONTEXT = 16_384  # the long-context row's tokens (batch 1), at most the shape's positions


def shape_config(shape: str):
    from transformers import AutoConfig

    spec = SHAPES[shape]
    return AutoConfig.from_pretrained(spec.parent) if isinstance(spec, Path) else AutoConfig.for_model(**spec)


def planned_peak_bytes(shape: str, device: str, batch: int, seq_len: int, quantize: str, checkpointing: str) -> int:
    """What `make preflight ... runtime.backend=native` plans for one of ours' rows: the allocator's
    peak on one GPU (finetuning_pipeline/planning/gpu_plan.py), full logits as ours runs them."""
    from finetuning_pipeline.planning.gpu_plan import native_memory
    from finetuning_pipeline.planning.tpu_plan import ModelShape, PlanInputs, held_bytes

    inputs = PlanInputs(mode="dp", dtype=DTYPES[device], micro_batch=batch, grad_accum=1, seq_len=seq_len,
                        checkpointing=False if checkpointing == "off" else checkpointing, lora_r=RANK,
                        lora_targets=TARGETS, lora_dropout=0.0, assumed_mfu=0.4, steps=1, quantize=quantize)
    return int(held_bytes(native_memory(ModelShape.from_config(shape_config(shape)), inputs, devices=1)))


def build_model(shape: str, device: str, dtype, bitsandbytes_4bit: bool = False):
    """Random weights of the shape, made on the device (a 7B model never passes through the host);
    bitsandbytes_4bit: its decoder Linears quantized by bitsandbytes as they move there (QLoRA's nf4)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = shape_config(shape)
    config.use_cache = False
    if bitsandbytes_4bit:
        from transformers import BitsAndBytesConfig
        from transformers.integrations import replace_with_bnb_linear

        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_compute_dtype=dtype)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        model = replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"], quantization_config=quantization)
        return model.to(device)  # (bitsandbytes quantizes each Linear's weight as it moves to the GPU)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model


def token_blocks(vocab: int, batch: int, seq_len: int, steps: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (batch, seq_len), generator=generator) for _ in range(steps)]


def synchronize(device: str) -> None:
    import torch

    if device != "cpu":
        torch.accelerator.synchronize()


def timed(device: str, steps: int, run_step) -> dict:
    """run_step(i) for every step; the steady step time after WARMUP_STEPS, and the peak memory."""
    import torch

    if device != "cpu":
        torch.accelerator.reset_peak_memory_stats()
    start = None
    for step in range(steps):
        run_step(step)
        if step == WARMUP_STEPS - 1:
            synchronize(device)
            start = time.perf_counter()
    synchronize(device)
    seconds = (time.perf_counter() - start) / (steps - WARMUP_STEPS)
    peak = int(torch.accelerator.max_memory_allocated()) if device != "cpu" else None
    return {"step_time_s": round(seconds, 4), "peak_memory_bytes": peak}


def profiled(device: str, run_step, step: int) -> dict:
    """run_step(step) once more under PyTorch's profiler: the device's time in its kernels and how many
    ran (a CPU: its ops' own CPU time and their count), to tell the device's work from the host's."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activity, kind = (ProfilerActivity.CPU, DeviceType.CPU) if device == "cpu" else (ProfilerActivity.CUDA,
                                                                                      DeviceType.CUDA)
    with profile(activities=[activity], acc_events=True) as prof:
        run_step(step)
        synchronize(device)
    events = [e for e in prof.key_averages() if e.device_type == kind]
    own = (lambda e: e.self_cpu_time_total) if device == "cpu" else (lambda e: e.self_device_time_total)
    return {"activity": "cpu" if device == "cpu" else "cuda", "time_ms": round(sum(map(own, events)) / 1e3, 2),
            "kernels": sum(e.count for e in events)}


def measure_ours(shape: str, device: str, batch: int, seq_len: int, steps: int, compile_layers: str,
                 profile: bool = False, quantize: str = "none", checkpointing: str = "off") -> dict:
    import torch

    from finetuning_pipeline.distributed.collectives import Collectives
    from finetuning_pipeline.distributed.parallel import Parallel
    from finetuning_pipeline.model.activation_checkpointing import enable_activation_checkpointing
    from finetuning_pipeline.model.quantized_base import quantize_base
    from finetuning_pipeline.run_config import TrainConfig
    from finetuning_pipeline.runtime.native.runtime import NativeRuntime
    from finetuning_pipeline.runtime.native.step import compile_decoder_layers
    from finetuning_pipeline.train.adamw import MaskedAdamW
    from finetuning_pipeline.train.stepper import Stepper
    from lora_logic.adapters import lora_parameters
    from lora_logic.config import LoraConfig
    from lora_logic.inject import inject_lora

    total = steps + profile  # (the profiled step is one more: the stepper's LR table counts it)
    model = build_model(shape, device, getattr(torch, DTYPES[device]))
    quantize_base(model, quantize)  # (as phase_start does: quantized before the LoRA, checkpointed before compiled)
    if checkpointing != "off":
        enable_activation_checkpointing(model, checkpointing)
    inject_lora(model, LoraConfig(r=RANK, alpha=ALPHA, target_modules=TARGETS))
    model.to(device)
    model.train()
    train = TrainConfig(max_steps=total, micro_batch=batch, lr=LR, warmup_steps=1, loss_chunk_tokens=0)
    if compile_layers == "layers":  # (what the runtime's parallelize does)
        compile_decoder_layers(model)
    stepper = Stepper(model, MaskedAdamW(lora_parameters(model), lr=LR), train, phase=1, lr=LR,
                      max_steps=total, activation_checkpointing=checkpointing != "off",
                      parallel=Parallel("dp", Collectives()),
                      device=torch.device(device), start_step=0, packed=False,
                      runtime=NativeRuntime(torch.device(device), compile_layers == "layers"))
    blocks = [{"input_ids": ids.to(device), "labels": ids.to(device)}
              for ids in token_blocks(model.config.vocab_size, batch, seq_len, total)]
    results = {}

    def step(i: int) -> None:
        results.update(stepper(i, [blocks[i]]))

    figures = timed(device, steps, step)
    if profile:
        figures["profiled_step"] = profiled(device, step, steps)
    return {**figures, "last_loss": float(results["loss"])}


def measure_frozen(shape: str, device: str, batch: int, seq_len: int, steps: int, compile_layers: str,
                   profile: bool = False, quantize: str = "none", checkpointing: str = "off") -> dict:
    """The floor of the plain bf16 base without checkpointing, whatever the row (the settings are ours')."""
    import torch
    import torch.nn.functional as F

    from finetuning_pipeline.model.attention_masks import attention_masks
    from finetuning_pipeline.runtime.native.step import compile_decoder_layers

    model = build_model(shape, device, getattr(torch, DTYPES[device]))
    model.requires_grad_(False)
    if compile_layers == "layers":
        compile_decoder_layers(model)
    blocks = [ids.to(device) for ids in token_blocks(model.config.vocab_size, batch, seq_len, steps + profile)]
    mask = attention_masks(model.config, seq_len, torch.device(device), model.dtype)  # as our step's forward

    def step(i: int) -> None:
        embeds = model.get_input_embeddings()(blocks[i]).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeds, attention_mask=mask).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), blocks[i][:, 1:].flatten()).backward()

    figures = timed(device, steps, step)
    if profile:
        figures["profiled_step"] = profiled(device, step, steps)
    return figures


def measure_peer(shape: str, device: str, batch: int, seq_len: int, steps: int, compile_layers: str,
                 profile: bool = False, quantize: str = "none", checkpointing: str = "off") -> dict:
    """HF Trainer + PEFT; checkpointing other than off: with its gradient_checkpointing; quantize=nf4:
    QLoRA, the base loaded 4-bit by bitsandbytes (nf4, bf16 compute) and prepare_model_for_kbit_training."""
    import tempfile

    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import Trainer, TrainerCallback, TrainingArguments

    base = build_model(shape, device, getattr(torch, DTYPES[device]), bitsandbytes_4bit=quantize == "nf4")
    if quantize == "nf4":
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=checkpointing != "off")
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))
    blocks = token_blocks(model.config.vocab_size, batch, seq_len, steps)
    rows = [{"input_ids": row, "labels": row} for block in blocks for row in block]
    ends: list[float] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            synchronize(device) if len(ends) == WARMUP_STEPS - 1 else None
            ends.append(time.perf_counter())

    if device != "cpu":
        torch.accelerator.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(out, per_device_train_batch_size=batch, max_steps=steps, learning_rate=LR,
                                 optim="adamw_torch", lr_scheduler_type="constant", logging_steps=steps,
                                 save_strategy="no", report_to=[], dataloader_num_workers=0,
                                 use_cpu=device == "cpu", disable_tqdm=True,
                                 gradient_checkpointing=checkpointing != "off",
                                 gradient_checkpointing_kwargs={"use_reentrant": False})
        Trainer(model=model, args=args, train_dataset=rows, callbacks=[StepEnds()]).train()
    synchronize(device)
    ends[-1] = time.perf_counter()
    peak = int(torch.accelerator.max_memory_allocated()) if device != "cpu" else None
    return {"step_time_s": round((ends[-1] - ends[WARMUP_STEPS - 1]) / (steps - WARMUP_STEPS), 4),
            "peak_memory_bytes": peak}


MEASURES = {"ours": measure_ours, "frozen": measure_frozen, "peer": measure_peer}


def in_subprocess(kind: str, args: argparse.Namespace, quantize: str = "none", checkpointing: str = "off") -> dict:
    command = [sys.executable, "-m", "benchmarks.gpu_bench", "--measure", kind, "--shape", args.shape, "--device",
               args.device, "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
               "--compile", args.compile, "--quantize", quantize, "--checkpointing", checkpointing,
               ] + (["--profile"] if args.profile else [])
    env = {**os.environ, "USE_TORCH_XLA": "0", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="mistral-7b")
    parser.add_argument("--device", choices=sorted(DTYPES), default="cuda")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--compile", choices=["layers", "eager"], default="layers",
                        help="each decoder layer under torch.compile (ours and the frozen floor), or eager")
    parser.add_argument("--no-peer", action="store_true", help="skip HF Trainer + PEFT")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step of ours and of the frozen floor: the device's time and kernels")
    parser.add_argument("--quantize", choices=QUANTIZE, default="none",
                        help="ours: model.quantize; the peer: nf4 is QLoRA (bitsandbytes), the others its bf16 base")
    parser.add_argument("--checkpointing", choices=CHECKPOINTING, default="off",
                        help="ours: model.activation_checkpointing; the peer: its gradient_checkpointing")
    parser.add_argument("--table", action="store_true",
                        help="the memory/speed table: ours for every --quantize of TABLE_QUANTIZE x --checkpointing, "
                        "one long-context row, and the peers with checkpointing (QLoRA where bitsandbytes is)")
    parser.add_argument("--out", default="outputs/bench/gpu_bench.json")
    parser.add_argument("--long-context", type=int, default=LONG_CONTEXT,
                        help="--table's long-context row: batch 1 x this many tokens, nf4, full checkpointing")
    parser.add_argument("--measure", choices=sorted(MEASURES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be more than the {WARMUP_STEPS} warm-up steps")
    if args.device == "cuda" and not args.measure:
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA GPU here; --device cpu runs the same measurements on this CPU "
                         "(the figures are a GPU's to give)")
    if args.measure:  # a child process: one measurement, printed as JSON
        print(json.dumps(MEASURES[args.measure](args.shape, args.device, args.batch, args.seq_len, args.steps,
                                                args.compile, args.profile, args.quantize, args.checkpointing)))
        return {}
    if args.table:
        return table(args)
    import torch

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    tokens = args.batch * args.seq_len
    result = {"device": device_name, "torch": torch.__version__, "shape": args.shape, "batch": args.batch,
              "seq_len": args.seq_len, "steps": args.steps, "compile": args.compile, "dtype": DTYPES[args.device],
              "rank": RANK, "targets": TARGETS}
    result.update(quantize=args.quantize, checkpointing=args.checkpointing)
    for kind in ("ours", "frozen") + (() if args.no_peer else ("peer",)):
        result[kind] = {**in_subprocess(kind, args, *(() if kind == "frozen" else (args.quantize, args.checkpointing)))}
        result[kind]["tokens_per_sec"] = round(tokens / result[kind]["step_time_s"], 1)
    result["lora_step_vs_frozen"] = round(result["ours"]["step_time_s"] / result["frozen"]["step_time_s"], 3)
    if "peer" in result:
        result["tokens_per_sec_vs_peer"] = round(result["ours"]["tokens_per_sec"] / result["peer"]["tokens_per_sec"], 3)
        if result["peer"]["peak_memory_bytes"]:
            result["peak_memory_vs_peer"] = round(result["ours"]["peak_memory_bytes"]
                                                  / result["peer"]["peak_memory_bytes"], 3)
    update_results(Path(args.out), f"{args.shape}_{args.device}", result)
    print(json.dumps(result, indent=1))
    return result


def table(args: argparse.Namespace) -> dict:
    """ours for each base x checkpointing, one long-context row (batch 1 x LONG_CONTEXT, nf4, full
    checkpointing), against the frozen floor and the peers: each its step, tokens/s, step over the
    floor and peak memory (bitsandbytes' QLoRA only where it is installed, on a GPU); ours' rows also
    the peak preflight plans for them and the measured peak over it (on a GPU: preflight's check)."""
    import importlib.util

    import torch

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    tokens = args.batch * args.seq_len
    floor = in_subprocess("frozen", args)
    rows, skipped = [], {}
    section = f"{args.shape}_{args.device}_table"

    def result(complete: bool) -> dict:
        return {"device": device_name, "torch": torch.__version__, "shape": args.shape, "steps": args.steps,
                "compile": args.compile, "dtype": DTYPES[args.device], "rank": RANK, "targets": TARGETS,
                "frozen": {**floor, "tokens_per_sec": round(tokens / floor["step_time_s"], 1)}, "rows": rows,
                "skipped": skipped, "complete": complete}

    def row(kind: str, run_args: argparse.Namespace, quantize: str, checkpointing: str) -> None:
        figures = in_subprocess(kind, run_args, quantize, checkpointing)
        planned = (planned_peak_bytes(args.shape, args.device, run_args.batch, run_args.seq_len, quantize,
                                      checkpointing) if kind == "ours" else None)
        measured = figures["peak_memory_bytes"]
        rows.append({"who": kind, "quantize": quantize, "checkpointing": checkpointing, "batch": run_args.batch,
                     "seq_len": run_args.seq_len, **figures, "planned_peak_bytes": planned,
                     "peak_vs_planned": round(measured / planned, 3) if measured and planned else None,
                     "tokens_per_sec": round(run_args.batch * run_args.seq_len / figures["step_time_s"], 1),
                     "step_vs_frozen": round(figures["step_time_s"] / floor["step_time_s"], 3)
                     if run_args is args else None})
        update_results(Path(args.out), section, result(complete=False))  # each row kept as it is measured

    def peer_row(quantize: str) -> None:
        """The peer's row, or why not: a failed peer (peft missing, say) loses none of ours."""
        try:
            row("peer", args, quantize, "full")
        except SystemExit as err:
            skipped[f"peer_{quantize}"] = str(err)[-1500:]

    for quantize in TABLE_QUANTIZE:
        for checkpointing in CHECKPOINTING:
            row("ours", args, quantize, checkpointing)
    long_context = argparse.Namespace(**{**vars(args), "batch": 1, "seq_len": args.long_context})
    row("ours", long_context, "nf4", "full")
    if args.no_peer:
        skipped["peer"] = "--no-peer"
    elif not importlib.util.find_spec("peft"):
        skipped["peer"] = "peft is not installed here (pip install peft, or --no-peer)"
    else:
        peer_row("none")
        if args.device == "cuda" and importlib.util.find_spec("bitsandbytes"):
            peer_row("nf4")
        else:
            skipped["qlora_peer"] = "bitsandbytes needs a GPU and its wheel (not installed here)"
    complete = result(complete=True)
    update_results(Path(args.out), section, complete)
    print(json.dumps(complete, indent=1))
    return complete


if __name__ == "__main__":
    main()
