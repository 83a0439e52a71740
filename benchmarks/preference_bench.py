"""`make bench-preference`: a preference (DPO) step against an SFT step on the same tokens, on
XLA:CPU: with the reference's forward in the step, and with the reference log-probabilities
precomputed (phaseN.preference.precompute_reference).

    python -m benchmarks.preference_bench [--steps 12] [--seq-len 256] [--rows 8]

The base is train_bench's "large" shape (8 layers, hidden 512, about 30M parameters, fp32), LoRA r 16
on all 7 targets. Each step sees `rows` sequences of `seq_len` tokens: the SFT run `rows` rows of
the bundled domain text, the DPO runs `rows / 2` pairs (the bundled pairs, each row padded to
seq_len): the same shapes, so the same tokens through the model, each row from position 0 under
the plain causal mask, and the loss from the whole logits in both (train.loss_chunk_tokens=0: a
preference phase builds its full logits), so that the ratio is what the preference loss adds: the
reference's forward, the log-probabilities' sums. Each run is the real
command (`finetuning_pipeline/main.py`, phase 1 of its own config, a fresh process), and the
figure is its summary's steady-state step time (the steps after the warm-up ones). A phase-1
preference run's reference is the base (no adapter): a continued adapter's reference adds the
LoRA's products to its forward. Peak device memory is not reported by XLA:CPU: the issue's memory
claim (the reference adds no saved activations) is for a device that reports it.
Results: the "preference" section of outputs/bench/bench.json and a line on stdout.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import yaml

from benchmarks.results import update_results
from benchmarks.side_by_side_bench import timed_run
from benchmarks.train_bench import ALPHA, LR, RANK, SHAPES, TARGETS, build_model

RUNS = ("sft", "dpo", "dpo_precomputed")


def prepare(model_dir: Path, root: Path, seq_len: int) -> dict[str, Path]:
    from dataset.prepare import PrepareOptions
    from dataset.prepare import prepare as run_prepare
    from dataset.samples import DOMAIN_TEXT, PREFERENCE_PAIRS

    data = {"sft": root / "text", "dpo": root / "pairs"}
    run_prepare(PrepareOptions(inputs=[str(DOMAIN_TEXT)], tokenizer=str(model_dir), seq_len=seq_len,
                               out=str(data["sft"]), quiet=True, eval_fraction=0.05))
    run_prepare(PrepareOptions(inputs=[str(PREFERENCE_PAIRS)], tokenizer=str(model_dir), seq_len=seq_len,
                               out=str(data["dpo"]), quiet=True, eval_fraction=0.05))
    return data


def run_config(root: Path, name: str, model_dir: Path, data: Path, steps: int, rows: int) -> Path:
    pairs = name != "sft"
    config = {
        "output_dir": str(root / name),
        "model": {"path": str(model_dir), "dtype": "float32"},
        "lora": {"r": RANK, "alpha": ALPHA, "target_modules": TARGETS},
        "train": {"max_steps": steps, "micro_batch": rows // 2 if pairs else rows, "grad_accum": 1, "lr": LR,
                  "warmup_steps": 2, "warmup_compiles_steps": 2, "loss_chunk_tokens": 0},
        "eval": {"max_batches": 1},
        "checkpoint": {"every": 0, "keep": 1},
        "logging": {"every": steps, "progress_bar": False, "tensorboard": False},
        "phase1": {"data": str(data), **({"preference": {"precompute_reference": name == "dpo_precomputed"}}
                                         if pairs else {})},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def bench(steps: int, seq_len: int, rows: int, root: Path) -> dict:
    model_dir = build_model(SHAPES["large"], root)
    data = prepare(model_dir, root, seq_len)
    summaries = {name: timed_run(run_config(root, name, model_dir, data["sft" if name == "sft" else "dpo"], steps,
                                            rows))[1] for name in RUNS}
    step = {name: summaries[name]["step_time_s"] for name in RUNS}
    return {
        "config": {"model": SHAPES["large"]["model"], "steps": steps, "rows_per_step": rows, "seq_len": seq_len,
                   "rank": RANK, "targets": TARGETS, "dtype": "float32", "reference": "the base (a phase-1 run)"},
        "step_s": step,
        "dpo_vs_sft": round(step["dpo"] / step["sft"], 3),
        "dpo_precomputed_vs_sft": round(step["dpo_precomputed"] / step["sft"], 3),
        "compiles_after_warmup": {name: summaries[name]["compiles_after_warmup"] for name in RUNS},
        "host_syncs_per_step": {name: summaries[name]["host_syncs_per_step"] for name in RUNS},
        "targets": {"dpo_vs_sft": 1.4, "dpo_precomputed_vs_sft": 1.1},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rows", type=int, default=8, help="sequences a step (an even number: DPO's pairs are half)")
    parser.add_argument("--out", default="outputs/bench/bench.json")
    args = parser.parse_args(argv)
    if args.rows < 2 or args.rows % 2:
        parser.error(f"--rows {args.rows}: an even number >= 2 (a DPO step takes rows / 2 pairs)")
    with tempfile.TemporaryDirectory() as tmp:
        result = bench(args.steps, args.seq_len, args.rows, Path(tmp))
    update_results(Path(args.out), "preference", result)
    print(f"a step of {args.rows} x {args.seq_len} tokens: SFT {result['step_s']['sft']} s, DPO "
          f"{result['step_s']['dpo']} s (x{result['dpo_vs_sft']}; target 1.4), DPO with precomputed reference "
          f"{result['step_s']['dpo_precomputed']} s (x{result['dpo_precomputed_vs_sft']}; target 1.1); "
          f"wrote {args.out}")


if __name__ == "__main__":
    main()
