"""`make bench-embeddings`: what training the embeddings beside the LoRA is worth in phase 1, on a
base whose pretraining was cut short (a model that knows the domain's language little), on XLA:CPU.

    python -m benchmarks.embeddings_bench [--pretrain-steps 60] [--steps 150] [--new-tokens 32]

The demo's tiny Mistral (its own tokenizer, pretrained for --pretrain-steps instead of the demo's
600), then phase 1 on the bundled domain text for --steps steps, three ways, each the real command
(`finetuning_pipeline/main.py`) in a fresh process, all else equal (r 16 on all 7 targets, lr 2e-3):
  lora           the LoRA alone;
  modules        + lora.modules_to_save [embed_tokens, lm_head] (train.embedding_lr = lr / 4);
  new_tokens     + model.new_tokens: the --new-tokens most frequent words of the text, each one
                 token (prepared with --new-tokens), their rows trained (lora.trainable_token_indices).
Reported per run: the held-out loss before and after (per token, and its perplexity), the held-out
negative log-likelihood per character (the comparable figure: new tokens tokenize the same text
into fewer tokens, so per-token losses of runs with and without them are not comparable), the
trainable weights and their bytes with AdamW (16 a weight: fp32 weight, gradient, two moments),
the process's peak resident memory (XLA:CPU reports no device peak), and the step time.
Results: the "embeddings" section of outputs/bench/bench.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from benchmarks.results import update_results

RANK, ALPHA, LR, SEQ_LEN = 16, 32, 2e-3, 128
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RUNS = ("lora", "modules", "new_tokens")


def frequent_words(path: Path, count: int, vocabulary: dict) -> list[str]:
    """The `count` most frequent words (letters only, 4 or more) of a JSONL text file that are not
    tokens of `vocabulary` as they stand, most frequent first."""
    words = collections.Counter()
    for line in path.read_text(encoding="utf-8").splitlines():
        words.update(w for w in re.findall(r"[^\W\d_]{4,}", json.loads(line)["text"]) if w not in vocabulary)
    return [word for word, _ in words.most_common(count)]


def characters_scored(data: Path, tokenizer) -> int:
    """Characters of the eval split's scored tokens (their labels), decoded."""
    from dataset.loader import open_shards

    arrays = open_shards(data, "eval")
    total = 0
    for labels in arrays["labels"]:
        scored = [int(t) for t in labels if t >= 0]
        total += len(tokenizer.decode(scored))
    return total


def run(root: Path, name: str, model_dir: Path, data: Path, steps: int, new_tokens: list[str]) -> dict:
    config = {
        "output_dir": str(root / name),
        "model": {"path": str(model_dir), "dtype": "float32", **({"new_tokens": new_tokens} if new_tokens else {})},
        "lora": {"r": RANK, "alpha": ALPHA, "target_modules": TARGETS,
                 **({"modules_to_save": ["embed_tokens", "lm_head"]} if name == "modules" else {})},
        "train": {"max_steps": steps, "micro_batch": 8, "grad_accum": 1, "lr": LR, "warmup_steps": 10,
                  **({"embedding_lr": LR / 4} if name == "modules" else {})},
        "eval": {"max_batches": None},
        "checkpoint": {"every": 0, "keep": 1},
        "logging": {"every": steps, "progress_bar": False, "tensorboard": False},
        "phase1": {"data": str(data)},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, "PJRT_DEVICE": "CPU", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(["/usr/bin/time", "-f", "peak_rss_kib=%M", sys.executable, "finetuning_pipeline/main.py",
                           "--config", str(path), "--phase", "1"], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    peak = int(re.search(r"peak_rss_kib=(\d+)", proc.stderr).group(1)) * 1024
    summary = json.loads((root / name / "phase1" / "summary.json").read_text())
    evals = [json.loads(line) for line in (root / name / "phase1" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in evals if r["kind"] == "eval"][-1]
    from safetensors.torch import load_file

    tensors = load_file(root / name / "phase1" / "adapter" / "adapter_model.safetensors")
    trainable = sum(t.numel() for t in tensors.values())
    return {"eval_loss_before": summary["eval_loss_before"], "eval_loss_after": summary["eval_loss_after"],
            "perplexity_after": summary["perplexity_after"], "eval_label_tokens": last["label_tokens"],
            "trainable_weights": trainable, "trainable_bytes_with_adamw": 16 * trainable,
            "peak_rss_bytes": peak, "step_time_s": summary["step_time_s"]}


def bench(pretrain_steps: int, steps: int, new_count: int, root: Path) -> dict:
    from dataset.prepare import PrepareOptions, prepare
    from dataset.samples import DOMAIN_TEXT
    from finetuning_pipeline.demo.tiny_model import write_tiny_model
    from utils.tokenizer_loading import load_extended_tokenizer

    model_dir = write_tiny_model(root / "base", pretrain_steps=pretrain_steps, log=lambda *a, **k: None)
    words = frequent_words(Path(DOMAIN_TEXT), new_count,
                           load_extended_tokenizer(model_dir, "--tokenizer", [], "new").get_vocab())
    data = {}
    for kind, tokens in (("base", []), ("new_tokens", words)):
        data[kind] = root / f"text_{kind}"
        prepare(PrepareOptions(inputs=[str(DOMAIN_TEXT)], tokenizer=str(model_dir), seq_len=SEQ_LEN,
                               out=str(data[kind]), quiet=True, eval_fraction=0.1, new_tokens=tokens))
    results = {}
    for name in RUNS:
        kind = "new_tokens" if name == "new_tokens" else "base"
        results[name] = run(root, name, model_dir, data[kind], steps, words if kind == "new_tokens" else [])
        tokenizer = load_extended_tokenizer(model_dir, "--tokenizer", words if kind == "new_tokens" else [], "new")
        characters = characters_scored(data[kind], tokenizer)
        results[name]["eval_characters"] = characters
        for when in ("before", "after"):
            nll = results[name][f"eval_loss_{when}"] * results[name]["eval_label_tokens"]
            results[name][f"eval_nll_per_char_{when}"] = round(nll / characters, 4)
    return {"config": {"model": "the demo's tiny Mistral (hidden 64, 2 layers, vocab 1,024)",
                       "pretrain_steps": pretrain_steps, "steps": steps, "seq_len": SEQ_LEN, "micro_batch": 8,
                       "rank": RANK, "lr": LR, "embedding_lr": LR / 4, "new_tokens": words},
            "runs": results}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretrain-steps", type=int, default=60, help="the base's pretraining, cut short (demo: 600)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--new-tokens", type=int, default=32, help="how many frequent words become tokens")
    parser.add_argument("--out", default="outputs/bench/bench.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = bench(args.pretrain_steps, args.steps, args.new_tokens, Path(tmp))
    update_results(Path(args.out), "embeddings", result)
    print(f"{'run':<11} {'eval loss/token':>18} {'nats/char':>15} {'trainable':>10} {'+AdamW MiB':>10} "
          f"{'peak RSS MiB':>12} {'step s':>7}")
    for name, r in result["runs"].items():
        print(f"{name:<11} {r['eval_loss_before']:>8.3f} -> {r['eval_loss_after']:<6.3f} "
              f"{r['eval_nll_per_char_before']:>6.3f} -> {r['eval_nll_per_char_after']:<5.3f} "
              f"{r['trainable_weights']:>10,} {r['trainable_bytes_with_adamw'] / 2**20:>10.2f} "
              f"{r['peak_rss_bytes'] / 2**20:>12.0f} {r['step_time_s']:>7.4f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
