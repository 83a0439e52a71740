"""`make bench-memory`: peak process memory of a training step with Gemma's 262,144-token vocabulary.

    python -m benchmarks.memory_bench [--no-peer] [--out outputs/bench/bench.json]

A Gemma-3-shaped model (vocabulary 262,144, hidden 640 as Gemma-3-270M, 2 decoder layers, one
sliding and one full; fp32), LoRA r 16 on all 7 targets, micro-batch 2 x seq_len 1024, two
training steps on XLA:CPU, each side in a fresh process:
  ours_chunked  our train_step with the default chunked loss (train.loss_chunk_tokens unset)
  ours_full     our train_step building the full [tokens, vocab] logits (loss_chunk_tokens 0)
  peer          transformers.Trainer (optim adamw_torch) + a peft LoRA of the same rank and targets
The figure is the process's peak resident memory (`ru_maxrss`), the same measure for all
three, and the peak minus the process's memory just before the first step (weights, runtime).
The logits of 2 x 1024 tokens are 2 GiB per fp32 copy; the decoder layers are few so that
they, not the layers, decide the difference. Results go to the `memory` section of bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from benchmarks.results import update_results

VOCAB, HIDDEN, SEQ_LEN, MICRO_BATCH, STEPS = 262_144, 640, 1024, 2, 2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 16, 32


def gemma3_config():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2048, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=SEQ_LEN)


def rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def tokens():
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ_LEN), generator=generator)
    return {"input_ids": ids.to(torch.int32), "labels": ids.to(torch.int32),
            "position_ids": torch.arange(SEQ_LEN, dtype=torch.int32).repeat(MICRO_BATCH, 1)}


def measure_ours(chunk: str) -> dict:
    import torch
    import torch_xla
    from transformers import AutoModelForCausalLM

    from finetuning_pipeline.model.causal_lm_loss import resolve_chunk_tokens
    from finetuning_pipeline.runtime.xla.device import init_xla_device
    from finetuning_pipeline.train.adamw import MaskedAdamW
    from finetuning_pipeline.train.step import train_step
    from lora_logic.adapters import lora_parameters
    from lora_logic.config import LoraConfig
    from lora_logic.inject import inject_lora

    device = init_xla_device()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gemma3_config()).float()
    model.config.use_cache = False
    inject_lora(model, LoraConfig(r=RANK, alpha=ALPHA, target_modules=TARGETS))
    model.to(device).train()
    optimizer = MaskedAdamW(lora_parameters(model), lr=1e-4)
    loss_chunk = resolve_chunk_tokens(None if chunk == "auto" else int(chunk), model.config)
    batch = {k: v.to(device) for k, v in tokens().items()}
    torch_xla.sync()
    before = current_rss_mib()
    for _ in range(STEPS):
        results = train_step(model, optimizer, [batch], max_grad_norm=1.0, packed=False, loss_chunk=loss_chunk)
        torch_xla.sync()
    loss = results["loss"].cpu().item()
    return {
        "peak_rss_mib": round(rss_mib()),
        "before_step_mib": round(before),
        "loss": loss,
        "loss_chunk_tokens": loss_chunk,
    }


def measure_peer(out_dir: str) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from finetuning_pipeline.runtime.xla.device import init_xla_device

    init_xla_device()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gemma3_config()).float()
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS,
                                             task_type="CAUSAL_LM"))
    batch = tokens()
    rows = [{"input_ids": batch["input_ids"][i].long(), "labels": batch["labels"][i].long()}
            for i in range(MICRO_BATCH)] * STEPS
    marks = {}

    class BeforeFirstStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            marks.setdefault("before", current_rss_mib())

    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=MICRO_BATCH, max_steps=STEPS,
                             learning_rate=1e-4, optim="adamw_torch", save_strategy="no", report_to=[],
                             disable_tqdm=True, remove_unused_columns=False, logging_steps=STEPS, seed=0)
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[BeforeFirstStep()]).train()
    return {"peak_rss_mib": round(rss_mib()), "before_step_mib": round(marks["before"])}


def in_subprocess(*args: str) -> dict:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.memory_bench", "--measure", *args],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-peer", action="store_true", help="skip HF Trainer + PEFT (needs `pip install peft`)")
    parser.add_argument("--out", default="outputs/bench/bench.json")
    parser.add_argument("--measure", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:  # a child process: one measurement, printed as JSON
        kind, *rest = args.measure
        print(json.dumps(measure_ours(*rest) if kind == "ours" else measure_peer(*rest)))
        return
    results = {"model": f"Gemma-3-shaped, vocab {VOCAB}, hidden {HIDDEN}, 2 layers, fp32, LoRA r {RANK} x 7 targets",
               "tokens": f"micro-batch {MICRO_BATCH} x seq_len {SEQ_LEN}, {STEPS} steps on XLA:CPU",
               "ours_chunked": in_subprocess("ours", "auto"), "ours_full": in_subprocess("ours", "0")}
    if not args.no_peer:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            results["peer"] = in_subprocess("peer", tmp)
    chunked = results["ours_chunked"]["peak_rss_mib"]
    for other in ("ours_full", "peer"):
        if other in results:
            results[f"chunked_over_{other}"] = round(chunked / results[other]["peak_rss_mib"], 3)
    update_results(Path(args.out), "memory", results)
    for name in ("ours_chunked", "ours_full", "peer"):
        if name in results:
            r = results[name]
            print(f"{name:13s} peak {r['peak_rss_mib']:7,} MiB  (before the first step {r['before_step_mib']:,} MiB, "
                  f"step adds {r['peak_rss_mib'] - r['before_step_mib']:,} MiB)")
    print(f"chunked / full: {results['chunked_over_ours_full']}"
          + (f", chunked / peer: {results['chunked_over_peer']}" if "peer" in results else "") + f"; wrote {args.out}")


if __name__ == "__main__":
    main()
