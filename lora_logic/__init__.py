"""A hand-written LoRA for Hugging Face causal LMs: y = W0 x + (alpha/r) B A x.

No PEFT dependency; adapters are written in PEFT's layout so PEFT and vLLM load them.

Each name is imported from its module when first used, so `lora_logic.config` (the LoraConfig
the run config's schema is built on) can be read without importing torch.
"""

import importlib

_MODULE_OF = {
    "load_adapter": "adapter_io", "read_adapter_config": "adapter_io", "read_adapter_weights": "adapter_io",
    "save_adapter": "adapter_io", "write_adapter": "adapter_io",
    "COMBINE_METHODS": "combine", "combine_adapters": "combine",
    "DEFAULT_TARGET_MODULES": "config", "LoraConfig": "config", "lora_scaling": "config",
    "inject_lora": "inject", "lora_modules": "inject", "lora_parameters": "inject", "lora_state_dict": "inject",
    "matches_target": "inject",
    "LoRALinear": "layer",
    "ScannedLayers": "layer_scan", "per_layer_lora": "layer_scan", "scan_decoder_layers": "layer_scan",
    "stacked_lora": "layer_scan",
    "merge_and_unload": "merge", "merge_lora": "merge", "unmerge_lora": "merge",
    "SideBySideLoRALinear": "side_by_side", "adapter_names": "side_by_side", "adapter_parameters": "side_by_side",
    "adapter_state_dict": "side_by_side", "inject_side_by_side": "side_by_side", "load_side_by_side": "side_by_side",
    "lora_parameters_by_adapter": "side_by_side", "only_adapter": "side_by_side", "save_side_by_side": "side_by_side",
}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'lora_logic' has no attribute {name!r}")
    return getattr(importlib.import_module(f"lora_logic.{_MODULE_OF[name]}"), name)


def __dir__() -> list[str]:
    return __all__
