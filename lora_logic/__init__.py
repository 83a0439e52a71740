"""A hand-written LoRA for Hugging Face causal LMs: y = W0 x + (alpha/r) B A x.

No PEFT dependency; adapters are written in PEFT's layout so PEFT and vLLM load them.
"""

from lora_logic.adapter_io import load_adapter, read_adapter_config, save_adapter
from lora_logic.config import DEFAULT_TARGET_MODULES, LoraConfig, lora_scaling
from lora_logic.inject import (inject_lora, lora_modules, lora_parameters, lora_state_dict, matches_target,
                               per_layer_lora, stacked_lora)
from lora_logic.layer import LoRALinear
from lora_logic.layer_scan import ScannedLayers, scan_decoder_layers
from lora_logic.merge import merge_and_unload, merge_lora, unmerge_lora

__all__ = [
    "DEFAULT_TARGET_MODULES",
    "LoRALinear",
    "LoraConfig",
    "ScannedLayers",
    "inject_lora",
    "load_adapter",
    "lora_modules",
    "lora_parameters",
    "lora_scaling",
    "lora_state_dict",
    "matches_target",
    "merge_and_unload",
    "merge_lora",
    "per_layer_lora",
    "read_adapter_config",
    "save_adapter",
    "scan_decoder_layers",
    "stacked_lora",
    "unmerge_lora",
]
