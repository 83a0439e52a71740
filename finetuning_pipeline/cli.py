"""`tpu-lora COMMAND [ARGS ...]`: the project's commands behind one console entry point, as
torchtune's `tune`, axolotl's and litgpt's CLIs have them. Each subcommand is the module it names,
with that module's own arguments and `--help`; `python finetuning_pipeline/main.py` and the
`python -m ...` forms stay.

    tpu-lora train --config run.yaml [--phase N|all] [key=value ...]
    tpu-lora prepare --input data.jsonl --out DIR ...
    tpu-lora export --base DIR --adapter DIR --out DIR
    tpu-lora generate --model DIR --prompt TEXT
    tpu-lora evaluate --model DIR --data DIR
    tpu-lora preflight --config run.yaml
    tpu-lora tpu-check --config run.yaml
    tpu-lora help [COMMAND]                  (tpu-lora --help, tpu-lora COMMAND --help)
    tpu-lora --version
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (its module, what it does): imported only when run (transformers takes seconds).
COMMANDS = {
    "train": ("finetuning_pipeline.main", "train LoRA adapters through the config's phases"),
    "prepare": ("dataset.prepare", "tokenize, mask and pack data into shards (before any device time)"),
    "export": ("finetuning_pipeline.export", "a merged Hugging Face model, combined adapters, or GGUF"),
    "generate": ("finetuning_pipeline.generate", "generate from a model, with adapters"),
    "evaluate": ("finetuning_pipeline.evaluate", "the eval loss and perplexity of a model on prepared data"),
    "preflight": ("finetuning_pipeline.preflight", "check a config and plan its TPU or GPU time, on this CPU"),
    "tpu-check": ("finetuning_pipeline.tpu_check", "the first command on a TPU VM: every TPU-only path"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return ("usage: tpu-lora COMMAND [ARGS ...]   (tpu-lora COMMAND --help, or tpu-lora help COMMAND: its own "
            "arguments; tpu-lora --version)\n\ncommands:\n" + "\n".join(lines))


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return f"tpu-lora {installed('tpu-lora')}"
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "tpu-lora (not installed: pip install -e .)"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help") or args == ["help"]:
        print(usage())
        return 0
    if args[0] in ("-V", "--version"):
        print(version())
        return 0
    if args[0] == "help":  # `tpu-lora help train`: the command's own --help
        args = [args[1], "--help"]
    if args[0] not in COMMANDS:
        print(f"tpu-lora: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, _ = COMMANDS[args[0]]
    if args[0] == "train":  # a stop signal while it imports is a stop, as from main.py's first lines
        from finetuning_pipeline.run.stop_signal import PROCESS_SIGNALS

        with PROCESS_SIGNALS.caught():
            return importlib.import_module(module).main(args[1:])
    return importlib.import_module(module).main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
