"""The embedded default's inputs: the tiny base model and the bundled corpora, prepared.

    python -m finetuning_pipeline.demo.inputs base|phase1|phase2|phase3 [--force]

One recipe for `make demo` (its file rules call this) and for `python finetuning_pipeline/main.py`
without --config, which trains the demo config wherever it is started from: its relative
paths are anchored at the repository, and what is missing is built first.
"""

from __future__ import annotations

import argparse
import fcntl
import sys
from pathlib import Path

from dataset import prepare
from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.run_config import read_config_file

REPO = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO / "finetuning_pipeline" / "configs" / "demo.yaml"
# The demo config's keys that name local paths (relative to the repository).
PATH_KEYS = ("output_dir", "model.path", "phase1.data", "phase2.data", "phase3.data")
SAMPLES = REPO / "dataset" / "samples"
INPUTS = {"phase1": [SAMPLES / "domain_text.jsonl"], "phase2": [SAMPLES / "chat_qa.jsonl", SAMPLES / "alpaca.jsonl"],
          "phase3": [SAMPLES / "preference.jsonl"]}
# Tokens a block: text and chat are packed into 256; a preference pair is a block of its own (each
# of its rows): the bundled pairs' longest prompt is 77 tokens on the demo's tokenizer, their
# longest row 92, so none is cut (prepare would count it).
SEQ_LENS = {"phase1": 256, "phase2": 256, "phase3": 128}
# The pairs: a fifth held out for evaluation (about 40, not the default 5%'s 12), their prompts whole.
OPTIONS = {"phase3": ["--eval-fraction", "0.2", "--max-prompt-len", "96"]}
DATA = tuple(INPUTS)


def anchored_paths(config_path: Path, root: Path) -> list[str]:
    """key=value overrides that put the config's relative paths under `root`."""
    raw = read_config_file(config_path)
    overrides = []
    for key in PATH_KEYS:
        value = raw
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, str) and not Path(value).is_absolute():
            overrides.append(f"{key}={root / value}")
    return overrides


def demo_paths() -> dict[str, Path]:
    """Where the demo config keeps its inputs, anchored at the repository."""
    values = dict(override.split("=", 1) for override in anchored_paths(DEMO_CONFIG, REPO))
    return {"base": Path(values["model.path"]), **{what: Path(values[f"{what}.data"]) for what in DATA}}


def build(what: str, force: bool = False) -> int:
    """Build one input of the demo ("base", or a phase's data: DATA); returns the exit status."""
    from finetuning_pipeline.demo import tiny_model  # transformers: only when the base is built

    paths = demo_paths()
    if what == "base":
        return tiny_model.main(["--out", str(paths["base"]), *(["--force"] if force else [])])
    args = ["--quiet", "--tokenizer", str(paths["base"]), "--seq-len", str(SEQ_LENS[what]), "--out", str(paths[what])]
    args += OPTIONS.get(what, [])
    for source in INPUTS[what]:
        args += ["--input", str(source)]
    return prepare.main([*(["--force"] if force else []), *args])


def ensure_demo_inputs(config, phases: list[int]) -> None:
    """Build the demo inputs this run reads and that are missing: the base, and the data of
    the phases it runs, prepared with that base's tokenizer (so only on the demo's own base).
    Paths overridden to somewhere else are the user's own, left alone. The processes of one
    command (torchrun's) build one at a time: the first builds, the others find it built."""
    paths = demo_paths()
    lock = paths["base"].parent / ".inputs.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes
        build_missing(config, phases, paths)


def build_missing(config, phases: list[int], paths: dict[str, Path]) -> None:
    ours = Path(config.model.path) == paths["base"]
    needed = {"base": ours and not (paths["base"] / "config.json").is_file()}
    for phase in phases:
        key = f"phase{phase}"  # the demo's own data is phases 1-3's; a later phase's is the user's
        needed[key] = (ours and key in paths and Path(config.phase(phase).data) == paths[key]
                       and not (paths[key] / "manifest.json").is_file())
    for what in ("base", *DATA):
        if needed.get(what):
            print(f"building the embedded default's {what} ({paths[what]}): missing", flush=True)
            if build(what) != 0:
                raise ConfigError(f"could not build the embedded default's {what} in {paths[what]} (see above); "
                                  "or pass --config")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m finetuning_pipeline.demo.inputs",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("base", *DATA),
                        help="base: the tiny model and tokenizer; phase1, phase2, phase3: that phase's prepared data")
    parser.add_argument("--force", action="store_true", help="replace what an earlier build wrote")
    args = parser.parse_args(argv)
    return build(args.what, args.force)


if __name__ == "__main__":
    sys.exit(main())
