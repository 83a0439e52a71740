"""`make bench`: our trainer against Hugging Face Trainer + PEFT LoRA, both on XLA:CPU.

    python -m benchmarks.train_bench [--shapes small,large] [--steps 20] [--no-peer]

Two shapes, both a Mistral-architecture model with LoRA r 16 on all 7 targets, AdamW,
micro-batch per step with no accumulation, fp32:
  small  the demo's tiny model (2 layers, hidden 64), micro-batch 4 x seq_len 128: the
         per-step cost of the trainer itself (tracing, Python, optimizer, syncs) dominates,
         as it does on a TPU whenever the host falls behind the chip;
  large  8 layers, hidden 512 (GQA 8:4 heads of 64), MLP 1536, micro-batch 8 x seq_len 512:
         the matmuls dominate.
Each measurement runs in a fresh process (no graph cache shared): ours (the real
`finetuning_pipeline/main.py`; again with train.capture_step=false, the step traced every
time, as `traced_every_step`; and on the native runtime, eager PyTorch on this CPU, as
`native_runtime`), the peer (transformers.Trainer with optim adamw_torch and a
peft LoRA of the same rank, targets and scaling, on the same token blocks), a frozen-base
forward+backward of the same model (the floor a LoRA step cannot beat), and the host's XLA
matmul throughput (for `mfu_host`). Results: outputs/bench/bench.json and a table on stdout.

FLOPs of a LoRA step, per token: `finetuning_pipeline.planning.tpu_plan.flops_per_token` (4N for the frozen
base, not 6N, plus attention and the LoRA branch; its docstring has the derivation).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results import update_results

SHAPES = {
    "small": {"model": "tiny", "seq_len": 128, "micro_batch": 4},
    "large": {"model": {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
                        "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 1536},
              "seq_len": 512, "micro_batch": 8},
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, LR = 16, 32, 1e-3
WARMUP_STEPS = 3  # steps excluded from the steady-state figures (compiles happen here)


# -- building the inputs ---------------------------------------------------------------------
def build_model(shape: dict, root: Path) -> Path:
    from finetuning_pipeline.demo.tiny_model import write_tiny_model

    tiny = write_tiny_model(root / "tiny")
    if shape["model"] == "tiny":
        return tiny
    import torch
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    config = MistralConfig(vocab_size=len(tokenizer), max_position_embeddings=1024, sliding_window=None,
                           bos_token_id=1, eos_token_id=2, pad_token_id=3, **shape["model"])
    torch.manual_seed(0)
    out = root / "large"
    MistralForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def prepare_data(model_dir: Path, seq_len: int, out: Path) -> Path:
    from dataset.prepare import PrepareOptions, prepare
    from dataset.samples import DOMAIN_TEXT

    prepare(PrepareOptions(inputs=[str(DOMAIN_TEXT)], tokenizer=str(model_dir), seq_len=seq_len, out=str(out),
                           quiet=True, eval_fraction=0.05))
    return out


def step_flops_per_token(model_dir: Path, seq_len: int) -> float:
    from transformers import AutoConfig

    from finetuning_pipeline.planning.tpu_plan import ModelShape, flops_per_token

    shape = ModelShape.from_config(AutoConfig.from_pretrained(model_dir))
    return flops_per_token(shape, seq_len, RANK, TARGETS)


# -- the measurements, each run in its own process ---------------------------------------------
def measure_ours(model_dir: str, data: str, micro_batch: int, steps: int, out_dir: str, capture: int = 1,
                 runtime: str = "xla") -> dict:
    """capture 0: the step traced every time (train.capture_step false), for comparison;
    runtime native: the native runtime on this CPU (runtime.backend=native, eager)."""
    import yaml

    config = {
        "output_dir": out_dir,
        "model": {"path": model_dir, "dtype": "float32"},
        "lora": {"r": RANK, "alpha": ALPHA, "target_modules": TARGETS},
        "train": {"max_steps": steps, "micro_batch": micro_batch, "grad_accum": 1, "lr": LR, "warmup_steps": 2,
                  "warmup_compiles_steps": WARMUP_STEPS, "capture_step": bool(capture)},
        "eval": {"max_batches": 1},
        "checkpoint": {"every": 0, "keep": 1},
        "logging": {"every": steps, "progress_bar": False, "tensorboard": False},
        "phase1": {"data": data},
        "runtime": {"backend": runtime, **({"device": "cpu"} if runtime == "native" else {})},
    }
    path = Path(out_dir) / "bench.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    from finetuning_pipeline import main
    from finetuning_pipeline.run.run_layout import RunLayout

    if main.main(["--config", str(path), "--phase", "1", "--resume", "never", "--force"]) != 0:
        raise SystemExit("our trainer failed")
    summary = json.loads(RunLayout(out_dir).summary(1).read_text())
    return {
        "step_time_s": summary["step_time_s"],
        "compiles_total": summary["compiles_total"],
        "compiles_after_warmup": summary["compiles_after_warmup"],
        "compile_seconds": summary["compile_seconds"],
        "host_syncs_per_step": summary["host_syncs_per_step"],
        "data_wait_fraction": summary["data_wait_fraction"],
    }


def measure_peer(model_dir: str, data: str, micro_batch: int, steps: int, out_dir: str) -> dict:
    import numpy as np
    import torch
    import torch_xla.core.xla_model as xm
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from finetuning_pipeline.runtime.xla.counters import read_counters

    ids = np.load(Path(data) / "train" / "input_ids.npy")
    labels = np.load(Path(data) / "train" / "labels.npy")
    repeats = -(-steps * micro_batch // len(ids))
    rows = [
        {
            "input_ids": torch.from_numpy(ids[i % len(ids)]).long(),
            "labels": torch.from_numpy(labels[i % len(ids)]).long(),
        }
        for i in range(repeats * len(ids))
    ]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS,
                                             task_type="CAUSAL_LM"))

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends, self.counters = [], []

        def on_step_end(self, args, state, control, **kwargs):
            if len(self.ends) == WARMUP_STEPS - 1 or state.global_step == args.max_steps:
                xm.wait_device_ops()  # the clock starts when the warm-up steps have run, ends when all have
            self.ends.append(time.perf_counter())
            self.counters.append(read_counters())

    clock = Clock()
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=micro_batch, gradient_accumulation_steps=1, max_steps=steps,
        learning_rate=LR, optim="adamw_torch", lr_scheduler_type="cosine", warmup_steps=2, max_grad_norm=1.0,
        logging_steps=steps, save_strategy="no", report_to=[], disable_tqdm=True, remove_unused_columns=False,
        dataloader_drop_last=True, seed=0,
    )
    start = read_counters()
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[clock]).train()
    warm = clock.counters[WARMUP_STEPS - 1]
    after = clock.counters[-1] - warm
    steady_steps = len(clock.ends) - WARMUP_STEPS
    return {
        "step_time_s": steady_step_time(clock.ends),
        "compiles_total": clock.counters[-1].compiles - start.compiles,
        "compiles_after_warmup": after.compiles,
        "compile_seconds": round(clock.counters[-1].compile_seconds - start.compile_seconds, 2),
        "host_syncs_per_step": after.host_syncs / steady_steps,
        "data_wait_fraction": None,
    }


def measure_frozen(model_dir: str, data: str, micro_batch: int, steps: int, out_dir: str) -> dict:
    """Forward + backward through the frozen base (activation gradients only): a LoRA step's floor.

    Timed as our trainer's steps are (steady_step_time), with nothing waiting on the device
    between steps, so on both sides of the comparison the host traces step k+1 while step k
    runs."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    import torch_xla
    import torch_xla.core.xla_model as xm
    from transformers import AutoModelForCausalLM

    from finetuning_pipeline.model.attention_masks import attention_masks
    from finetuning_pipeline.runtime.xla.counters import read_counters
    from finetuning_pipeline.runtime.xla.device import init_xla_device

    device = init_xla_device()
    start = read_counters()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.config.use_cache = False
    for p in model.parameters():
        p.requires_grad_(False)
    ids = torch.from_numpy(np.load(Path(data) / "train" / "input_ids.npy")[:micro_batch]).long().to(device)
    mask = attention_masks(model.config, ids.shape[1], device, torch.float32)  # as our phase-1 step's forward
    ends = []
    for step in range(steps):
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeds, attention_mask=mask).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        torch_xla.sync()
        if step == WARMUP_STEPS - 1:
            xm.wait_device_ops()  # the clock starts when the warm-up steps have run
        ends.append(time.perf_counter())
    xm.wait_device_ops()
    ends[-1] = time.perf_counter()  # the last step ends when it has run
    return {"step_time_s": steady_step_time(ends),
            "compile_seconds": round(read_counters().compile_seconds - start.compile_seconds, 2)}


def steady_step_time(ends: list[float]) -> float:
    """Mean step time after warm-up, from the end of the warm-up steps' execution to the end of
    the last step's: between step boundaries the host may run steps ahead of the device,
    so intervals between them (or their median) can measure the host alone."""
    return (ends[-1] - ends[WARMUP_STEPS - 1]) / (len(ends) - WARMUP_STEPS)


def measure_matmul(*_args) -> dict:
    """This host's XLA:CPU fp32 matmul rate on a 2048^3 product, the best of 5."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    from finetuning_pipeline.runtime.xla.device import init_xla_device

    device = init_xla_device()
    n = 2048
    a = torch.randn(n, n).to(device)
    b = torch.randn(n, n).to(device)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        c = a @ b
        torch_xla.sync()
        xm.wait_device_ops()
        times.append(time.perf_counter() - start)
        a = c * 1e-3  # a data dependency, so each product really runs
    return {"flops_per_sec": 2 * n**3 / min(times[1:])}


MEASURES = {"ours": measure_ours, "peer": measure_peer, "frozen": measure_frozen, "matmul": measure_matmul}


def in_subprocess(kind: str, *args) -> dict:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.train_bench", "--measure", kind, *map(str, args)],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_shape(name: str, steps: int, peer: bool, root: Path, matmul_rate: float) -> dict:
    shape = SHAPES[name]
    model_dir = build_model(shape, root / name)
    data = prepare_data(model_dir, shape["seq_len"], root / name / "data")
    tokens_per_step = shape["micro_batch"] * shape["seq_len"]
    flops_per_token = step_flops_per_token(model_dir, shape["seq_len"])
    args = (model_dir, data, shape["micro_batch"], steps, root / name / "run")
    ours = in_subprocess("ours", *args)
    traced = in_subprocess("ours", *args[:-1], root / name / "run_traced", 0)
    native = in_subprocess("ours", *args[:-1], root / name / "run_native", 1, "native")
    frozen = in_subprocess("frozen", *args)
    result = {
        "config": {**shape, "rank": RANK, "alpha": ALPHA, "targets": TARGETS, "optimizer": "AdamW", "lr": LR,
                   "grad_accum": 1, "dtype": "float32", "steps": steps, "warmup_steps_excluded": WARMUP_STEPS},
        "flops_per_token": flops_per_token,
        **figures(ours, tokens_per_step, flops_per_token, matmul_rate),
        "traced_every_step": figures(traced, tokens_per_step, flops_per_token, matmul_rate),
        "native_runtime": figures(native, tokens_per_step, flops_per_token, matmul_rate),
        "frozen_base_fwd_bwd_step_s": frozen["step_time_s"],
        "frozen_base_fwd_bwd_compile_s": frozen["compile_seconds"],
        "lora_step_vs_frozen_fwd_bwd": round(ours["step_time_s"] / frozen["step_time_s"], 3),
    }
    if peer:
        theirs = in_subprocess("peer", model_dir, data, shape["micro_batch"], steps, root / name / "peer")
        result["peer"] = figures(theirs, tokens_per_step, flops_per_token, matmul_rate)
        result["ratio_vs_peer"] = round(result["tokens_per_sec"] / result["peer"]["tokens_per_sec"], 3)
    return result


def figures(m: dict, tokens_per_step: int, flops_per_token: float, matmul_rate: float) -> dict:
    tokens_per_sec = tokens_per_step / m["step_time_s"]
    return {
        "tokens_per_sec": round(tokens_per_sec, 1),
        "step_time_s": round(m["step_time_s"], 4),
        "compiles_total": m["compiles_total"],
        "compiles_after_warmup": m["compiles_after_warmup"],
        "compile_seconds": m["compile_seconds"],
        "host_syncs_per_step": m["host_syncs_per_step"],
        "data_wait_fraction": m["data_wait_fraction"],
        "achieved_flops_per_sec": round(tokens_per_sec * flops_per_token),
        "mfu_host": round(tokens_per_sec * flops_per_token / matmul_rate, 3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="small,large")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-peer", action="store_true", help="skip HF Trainer + PEFT (needs `pip install peft`)")
    parser.add_argument("--out", default="outputs/bench/bench.json")
    parser.add_argument("--measure", choices=sorted(MEASURES), help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.measure:  # a child process: one measurement, printed as JSON
        values = [int(v) if v.isdigit() else v for v in rest]
        print(json.dumps(MEASURES[args.measure](*values)))
        return
    peer = not args.no_peer
    if peer:
        try:
            import peft  # noqa: F401 - only whether it is installed
        except ImportError:
            print("peft is not installed: skipping the peer (pip install peft, or --no-peer)")
            peer = False
    matmul_rate = in_subprocess("matmul")["flops_per_sec"]
    results = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "xla_matmul_flops_per_sec": round(matmul_rate)}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes.split(","):
            results[name] = bench_shape(name, args.steps, peer, Path(tmp), matmul_rate)
            print_shape(name, results[name])
    for section, values in results.items():  # other benchmarks' sections stay
        update_results(Path(args.out), section, values)
    print(f"host XLA matmul: {matmul_rate / 1e9:.1f} GFLOP/s; wrote {args.out}")


def number_or_na(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def print_shape(name: str, r: dict) -> None:
    rows = [("ours", r), ("ours, traced", r["traced_every_step"])]
    rows += [("ours, native", r["native_runtime"])] if "native_runtime" in r else []
    rows += [("HF Trainer + PEFT", r["peer"])] if "peer" in r else []
    for label, f in rows:
        print(f"{name:5} {label:18} {f['tokens_per_sec']:>10,.0f} tok/s  step {f['step_time_s']:.4f} s  "
              f"graphs {f['compiles_total']} ({f['compiles_after_warmup']} after warm-up)  "
              f"host syncs/step {number_or_na(f['host_syncs_per_step'])}  mfu_host {f['mfu_host']:.3f}")
    extra = f"  ratio vs peer {r['ratio_vs_peer']:.2f}x" if "ratio_vs_peer" in r else ""
    print(f"{name:5} LoRA step / frozen fwd+bwd {r['lora_step_vs_frozen_fwd_bwd']:.2f}  compile: ours "
          f"{r['compile_seconds']} s, the frozen fwd+bwd {r['frozen_base_fwd_bwd_compile_s']} s  "
          f"data wait {r['data_wait_fraction']}{extra}")


if __name__ == "__main__":
    main()
