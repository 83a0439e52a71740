"""A hand-written LoRA for Hugging Face causal LMs: y = W0 x + (alpha/r) B A x.

No PEFT dependency; adapters are written in PEFT's layout so PEFT and vLLM load them. A model's
adapters are one set, keyed by name; a single adapter is the set of one, DEFAULT_ADAPTER.
Import each name from its module (this package imports nothing, so the config can be read
without torch):
  config.py      LoraConfig, lora_scaling, DEFAULT_ADAPTER, adapter_set
  layer.py       LoRALinear: a frozen nn.Linear with its adapters (one, or several side by side)
  inject.py      inject_lora: wrap a model's target layers
  adapters.py    the model's adapters: names, weights by name, state dicts, only_adapter
  adapter_io.py  save_adapters / load_adapters in PEFT's layout; read an adapter without a model
  merge.py       merge_lora, unmerge_lora, merge_and_unload
  combine.py     several adapters combined into one (PEFT's add_weighted_adapter)
  dropout.py     seeded LoRA dropout (a mask from a seed tensor, replayable on XLA)
  quantize.py    block quantization: ggml's q8_0 / q4_0 (as gguf-py writes them), QLoRA's nf4
  quantized_linear.py  QuantizedLinear: a frozen Linear stored quantized, dequantized at its matmul
"""
