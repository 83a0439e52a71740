"""Generate text from a model (optionally with an adapter), for a quick look at what training did.

    python -m finetuning_pipeline.generate --model DIR [--adapter DIR ...] \
        --prompt "Care este reședința județului Cluj?"
    python -m finetuning_pipeline.generate --model model.gguf [--adapter adapter.gguf] --prompt ...

A .gguf --model (what `export --format gguf` writes) runs in llama.cpp (its Python binding:
utils/llama_cpp_install.sh), with the chat template the file carries: what llama.cpp, Ollama or
LM Studio will answer.

Chat models (a tokenizer with a chat template) get the prompt as a user turn; `--plain`
continues the raw text instead. Greedy decoding by default; on a CUDA GPU where PyTorch sees one,
else the CPU (--device, in training's runtime.device words), in --dtype (float32 by default).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from finetuning_pipeline.errors import ModelLoadError, run_command
from finetuning_pipeline.model.loading import DTYPES, check_new_tokens, context_length, load_model
from finetuning_pipeline.model.new_tokens import serving_tokenizer
from finetuning_pipeline.runtime.native.device import native_device
from finetuning_pipeline.runtime.xla.device import on_the_host_only
from utils.cli_types import non_negative_float, positive_int
from utils.hub_models import resolve_model
from utils.tokenizer_loading import load_tokenizer


def generate(model_dir: str, prompt: str, adapters: list[str] = (), max_new_tokens: int = 64,
             plain: bool = False, temperature: float = 0.0, system: str | None = None,
             device: torch.device | None = None, dtype: str = "float32") -> str:
    """The model's answer to `prompt`, on `device` (default: the CPU) in `dtype`."""
    # Adapters merged: inference needs one matmul per layer instead of three.
    model, _ = load_model(model_dir, list(adapters), DTYPES[dtype])
    model.eval().to(device or torch.device("cpu"))
    tokenizer = load_tokenizer(*serving_tokenizer(model_dir, adapters))
    if plain or not tokenizer.chat_template:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    check_new_tokens(max_new_tokens, context_length(model.config), ids.shape[1])
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    ids = ids.to(next(model.parameters()).device)
    with torch.no_grad():
        output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                pad_token_id=tokenizer.pad_token_id, **sampling)
    return tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True)


def generate_gguf(path: str, prompt: str, adapters: list[str] = (), max_new_tokens: int = 64, plain: bool = False,
                  temperature: float = 0.0, system: str | None = None) -> str:
    """The same, by llama.cpp on a GGUF file (adapters: LoRA GGUFs, applied at load)."""
    try:
        import llama_cpp
    except ImportError:
        raise ModelLoadError(f"--model {path}: a GGUF runs in llama.cpp, whose Python binding is not installed "
                             "here (utils/llama_cpp_install.sh .venv/bin/python installs it)") from None
    if len(adapters) > 1:
        raise ModelLoadError("--adapter: llama.cpp's binding applies one LoRA GGUF; export the stack as one "
                             "(export --format gguf --adapter-only --adapter A --adapter B)")
    if not Path(path).is_file():
        raise ModelLoadError(f"--model {path}: no such file")
    try:
        context = gguf_context(path)  # its header: a file that is not a GGUF fails here
    except ValueError as err:
        raise unloadable(path, err) from None
    check_new_tokens(max_new_tokens, context)  # the prompt's own tokens are known only to llama.cpp
    try:
        model = llama_cpp.Llama(str(path), n_ctx=context, verbose=False, seed=0,
                                **({"lora_path": str(adapters[0])} if adapters else {}))
    except ValueError as err:  # one llama.cpp cannot load (its own message is on stderr)
        raise unloadable(path, err) from None
    sampling = {"temperature": temperature} if temperature > 0 else {"temperature": 0.0, "top_k": 1}
    try:
        if plain or not model.metadata.get("tokenizer.chat_template"):
            return model.create_completion(prompt, max_tokens=max_new_tokens, **sampling)["choices"][0]["text"]
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        answer = model.create_chat_completion(messages, max_tokens=max_new_tokens, **sampling)
        return answer["choices"][0]["message"]["content"]
    finally:
        model.close()


def unloadable(path: str, err: ValueError) -> ModelLoadError:
    return ModelLoadError(f"--model {path}: llama.cpp cannot load it ({err}); a file `export --format gguf` wrote "
                          "loads")


def gguf_context(path: str, at_most: int = 4096) -> int:
    """The context to run a GGUF with: its model's, up to `at_most` (a prompt and an answer)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.get_field("general.architecture").contents()
    trained = reader.get_field(f"{arch}.context_length")
    return min(at_most, trained.contents()) if trained is not None else at_most


def main(argv: list[str] | None = None) -> int:
    return run_command(generate_command, argv)


def generate_command(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="tpu-lora generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="Hugging Face model directory or Hub id (base or merged), or a .gguf file (llama.cpp)")
    parser.add_argument("--adapter", action="append", default=[],
                        help="LoRA adapter directory to apply (repeat to stack, in order); a LoRA .gguf with a "
                             ".gguf --model")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--system", help="system turn for chat models")
    parser.add_argument("--plain", action="store_true", help="continue the raw text; no chat template")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "tpu"), default="auto",
                        help="in training's runtime.device words: auto (a CUDA GPU where PyTorch sees one, else the "
                        "CPU; the default), cpu, cuda, tpu (TorchTPU); a .gguf runs in llama.cpp")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="the dtype to generate in (default float32; bfloat16 halves a GPU's memory)")
    args = parser.parse_args(argv)
    if not args.prompt.strip():  # a chat model would answer its own template's tokens ("assis...")
        parser.error("--prompt is empty: give the text to answer (or, with --plain, to continue)")
    on_the_host_only()
    if args.model.endswith(".gguf"):
        print(generate_gguf(args.model, args.prompt, args.adapter, args.max_new_tokens, args.plain, args.temperature,
                            args.system))
        return 0
    device = native_device(args.device, key="--device")
    print(generate(resolve_model(args.model).local_dir, args.prompt, args.adapter, args.max_new_tokens, args.plain,
                   args.temperature, args.system, device=device, dtype=args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
