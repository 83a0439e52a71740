"""Tiny models of every family with a real tokenizer, and adapters for them, saved as a user's
files are: what the GGUF export tests hand to `export --format gguf` and then to llama.cpp.

Two tokenizers, trained on the bundled texts: the demo's sentencepiece BPE (Llama 2, Mistral,
Gemma and Phi-3 use sentencepiece) and a byte-level BPE split as Qwen2's tokenizer.json splits
(Qwen). The model's vocabulary is the tokenizer's, plus a few ids the tokenizer never gives (as
real checkpoints pad their embeddings).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from model_families import FAMILIES, SHAPE, TARGETS
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    PreTrainedTokenizerFast,
)

from dataset.chat_template import CHATML_TEMPLATE, IM_END, IM_START
from dataset.samples import iter_sample_texts
from finetuning_pipeline.demo.tiny_model import build_tokenizer, train_sentencepiece
from finetuning_pipeline.exporters.gguf_vocab import QWEN2_SPLIT
from lora_logic.adapter_io import write_adapter
from lora_logic.config import LoraConfig

PADDED = 8  # embedding rows beyond the tokenizer's ids
# llama.cpp's llama, qwen2, qwen3 and phi3 attend to the whole context (gguf_families.py): their
# tiny models here have no window; Gemma 2 and 3 keep theirs (6, below the tests' lengths).
NO_WINDOW = {"mistral": dict(sliding_window=None), "qwen2": dict(use_sliding_window=False),
             "qwen3": dict(use_sliding_window=False), "phi3": dict(sliding_window=None)}
GEMMA_SCALE = dict(query_pre_attn_scalar=SHAPE["head_dim"])  # llama.cpp's scale for these sizes
CONFIGS = {**FAMILIES, "gemma": lambda: GemmaConfig(**SHAPE)}
BYTE_LEVEL = {"qwen2", "qwen3"}
GGUF_FAMILIES = sorted(CONFIGS)


@functools.cache
def sentencepiece_tokenizer():
    return build_tokenizer(train_sentencepiece())


@functools.cache
def byte_level_tokenizer(split: str = QWEN2_SPLIT, ignore_merges: bool = False):
    """A byte-level BPE with Qwen2's split regex (or `split`: Llama 3's, with its ignore_merges)
    and ChatML's special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<|endoftext|>", IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(sorted(set(iter_sample_texts())), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=IM_END, pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML_TEMPLATE.replace("{{ bos_token }}", "")
    return tokenizer


def tokenizer_for(family: str):
    return byte_level_tokenizer() if family in BYTE_LEVEL else sentencepiece_tokenizer()


def family_config(family: str, tokenizer=None, **overrides):
    tokenizer = tokenizer or tokenizer_for(family)
    config = CONFIGS[family]()
    settings = config.to_dict()
    if family in NO_WINDOW:
        settings.pop("layer_types", None)  # derived from the window settings again
    settings.update({**NO_WINDOW.get(family, {}), **(GEMMA_SCALE if family.startswith("gemma") else {}),
                     **overrides})
    config = type(config)(**settings)
    config.vocab_size = len(tokenizer) + PADDED
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    return config


def write_family_model(directory: Path, family: str, seed: int = 0, tokenizer=None, **overrides) -> Path:
    """A tiny random model of `family` with its tokenizer (or `tokenizer`), saved in fp32 to `directory`."""
    tokenizer = tokenizer or tokenizer_for(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, tokenizer, **overrides)).float()
    with torch.no_grad():  # norms away from their init (1, or Gemma's 0), so a missed + 1 shows
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_random_adapter(directory: Path, base: Path, family: str, seed: int, r: int = 4, alpha: float = 8,
                         use_rslora: bool = False, targets: list[str] | None = None) -> Path:
    """A PEFT adapter for the model in `base`, A and B both random (a trained one's B is not zero)."""
    model = AutoModelForCausalLM.from_pretrained(base)
    config = LoraConfig(r=r, alpha=alpha, use_rslora=use_rslora,
                        **({"target_modules": targets or TARGETS[family]} if targets or family in TARGETS else {}))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in config.target_modules:
            tensors[f"{name}.lora_A.weight"] = torch.randn(r, module.in_features, generator=generator) * 0.2
            tensors[f"{name}.lora_B.weight"] = torch.randn(module.out_features, r, generator=generator) * 0.2
    write_adapter(directory, tensors, config, str(base), None)
    return directory
