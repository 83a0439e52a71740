"""A hand-written LoRA for Hugging Face causal LMs: y = W0 x + (alpha/r) B A x.

No PEFT dependency; adapters are written in PEFT's layout so PEFT and vLLM load them. A model's
adapters are one set, keyed by name; a single adapter is the set of one, DEFAULT_ADAPTER.

    from lora_logic import LoraConfig, inject_lora, save_adapters

The public names below import from the package, as PEFT's do; each is imported from its module
on first use (PEP 562), so reading a LoraConfig needs no torch. The modules:
  config.py      LoraConfig, lora_scaling, DEFAULT_ADAPTER, adapter_set
  layer.py       LoRALinear: a frozen nn.Linear with its adapters (one, or several side by side)
  inject.py      inject_lora: wrap a model's target layers
  modules_to_save.py  ModulesToSave: a module trained in full beside the LoRA (embeddings, output layer)
  trainable_tokens.py  TrainableTokens: some rows of the embeddings trained beside the LoRA (new tokens)
  adapters.py    the model's adapters: names, weights by name, state dicts, only_adapter
  adapter_io.py  save_adapters / load_adapters in PEFT's layout; read an adapter without a model
  merge.py       merge_lora, unmerge_lora, merge_and_unload
  combine.py     several adapters combined into one (PEFT's add_weighted_adapter)
  dropout.py     seeded LoRA dropout (a mask from a seed tensor, replayable on XLA)
  quantize.py    block quantization: ggml's q8_0 / q4_0 (as gguf-py writes them), QLoRA's nf4
  quantized_linear.py  QuantizedLinear: a frozen Linear stored quantized, dequantized at its matmul
"""

from __future__ import annotations

import importlib

# Each public name, and the module (of this package) that defines it. No name is a module's own
# (quantize.py's quantize is not here): importing the module would set the package's attribute.
PUBLIC = {
    "config": ("LoraConfig", "lora_scaling", "DEFAULT_ADAPTER", "adapter_set"),
    "layer": ("LoRALinear",),
    "inject": ("inject_lora",),
    "adapters": ("adapter_names", "lora_parameters", "lora_state_dict", "only_adapter"),
    "adapter_io": ("save_adapters", "load_adapters", "read_adapter_config", "read_adapter_weights"),
    "merge": ("merge_lora", "unmerge_lora", "merge_and_unload"),
    "combine": ("combine_adapters", "COMBINE_METHODS"),
    "quantized_linear": ("QuantizedLinear",),
}
_MODULE_OF = {name: module for module, names in PUBLIC.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'lora_logic' has no attribute {name!r}; its public names: {', '.join(__all__)}")
    value = getattr(importlib.import_module(f"lora_logic.{module}"), name)
    globals()[name] = value  # the next lookup finds it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
