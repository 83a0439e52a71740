"""Benchmark `python -m dataset.prepare`: tokens/s and peak memory at two input sizes per phase.

    make bench-prepare            # or: python -m benchmarks.prepare_throughput [--scale 1.0]

The inputs are the bundled corpora repeated to the target size (300 MB of phase-1 text and
100 MB of phase-2 chat at scale 1, and a tenth of each to show memory does not grow with the
input), at seq_len 512, and one run per phase at seq_len 32,768 (long-context packing must
keep the throughput and memory). Repeated text is kinder to the tokenizer's word cache than
fresh text would be; the figure is an upper bound of what a real corpus gets with the tiny
tokenizer. Each run is a fresh process, so its peak RSS is its own. Results go to outputs/bench/bench_prepare.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from dataset.samples import CHAT_QA, DOMAIN_TEXT
from utils.atomic_io import atomic_write_json

RUN_ONE = """
import json, resource, sys
from dataset.prepare import main
code = main(sys.argv[1:])
print(json.dumps({"exit": code, "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def repeat_to_size(source: Path, target: Path, size_bytes: int) -> None:
    chunk = source.read_bytes()
    with open(target, "wb") as f:
        while f.tell() < size_bytes:
            f.write(chunk)


def run_prepare(inputs: Path, tokenizer: Path, out: Path, seq_len: int) -> dict:
    args = ["--input", str(inputs), "--tokenizer", str(tokenizer), "--seq-len", str(seq_len), "--out", str(out),
            "--quiet", "--force"]
    proc = subprocess.run([sys.executable, "-c", RUN_ONE, *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"prepare failed:\n{proc.stderr}")
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    stats = json.loads((out / "stats.json").read_text())
    return {
        "seq_len": seq_len,
        "input_mb": round(inputs.stat().st_size / 1e6, 1),
        "records": stats["records"]["read"],
        "tokens": stats["tokens"],
        "seconds": stats["seconds"],
        "tokens_per_sec": stats["tokens_per_sec"],
        "fill_ratio": stats["fill_ratio"],
        "peak_rss_mb": round(measured["max_rss_mb"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the input sizes (default 1)")
    parser.add_argument("--out", default="outputs/bench/bench_prepare.json")
    args = parser.parse_args(argv)
    from finetuning_pipeline.demo.tiny_model import write_tiny_model

    results = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = write_tiny_model(tmp / "base")
        # The long-context rows: packing 32K blocks must keep the throughput and memory of 512.
        plan = [("1", DOMAIN_TEXT, 30e6, 512), ("1", DOMAIN_TEXT, 300e6, 512), ("1", DOMAIN_TEXT, 30e6, 32768),
                ("2", CHAT_QA, 10e6, 512), ("2", CHAT_QA, 100e6, 512), ("2", CHAT_QA, 10e6, 32768)]
        for phase, source, size, seq_len in plan:
            inputs = tmp / f"phase{phase}_{int(size)}.jsonl"
            repeat_to_size(source, inputs, int(size * args.scale))
            run = {"phase": int(phase), **run_prepare(inputs, tokenizer, tmp / "out", seq_len)}
            results["runs"].append(run)
            print(
                f"phase {run['phase']}  seq_len {seq_len:>6}  {run['input_mb']:7.1f} MB  {run['tokens']:>12,} tokens  "
                f"{run['tokens_per_sec']:>9,} tokens/s  peak RSS {run['peak_rss_mb']:>5} MB  "
                f"fill {run['fill_ratio']:.3f}"
            )
            inputs.unlink()
    atomic_write_json(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
