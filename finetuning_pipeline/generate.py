"""Generate text from a model (optionally with an adapter), for a quick look at what training did.

    python -m finetuning_pipeline.generate --model DIR [--adapter DIR ...] \
        --prompt "Care este reședința județului Cluj?"

Chat models (a tokenizer with a chat template) get the prompt as a user turn; `--plain`
continues the raw text instead. Greedy decoding by default; runs on the CPU.
"""

from __future__ import annotations

import argparse
import sys

import torch

from finetuning_pipeline.errors import run_command
from finetuning_pipeline.model.loading import load_model
from utils.cli_types import non_negative_float, positive_int
from utils.hub_models import resolve_model
from utils.tokenizer_loading import load_tokenizer
from utils.xla_runtime import on_the_host_only


def generate(model_dir: str, prompt: str, adapters: list[str] = (), max_new_tokens: int = 64,
             plain: bool = False, temperature: float = 0.0, system: str | None = None) -> str:
    # Adapters merged: inference needs one matmul per layer instead of three.
    model, _ = load_model(model_dir, list(adapters))
    model.eval()
    tokenizer = load_tokenizer(model_dir, "--model")
    if plain or not tokenizer.chat_template:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                pad_token_id=tokenizer.pad_token_id, **sampling)
    return tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    return run_command(generate_command, argv)


def generate_command(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory or Hub id (base or merged)")
    parser.add_argument("--adapter", action="append", default=[],
                        help="LoRA adapter directory to apply (repeat to stack, in order)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--system", help="system turn for chat models")
    parser.add_argument("--plain", action="store_true", help="continue the raw text; no chat template")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 (default): greedy")
    args = parser.parse_args(argv)
    on_the_host_only()
    print(
        generate(
            resolve_model(args.model).local_dir,
            args.prompt,
            args.adapter,
            args.max_new_tokens,
            args.plain,
            args.temperature,
            args.system,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
