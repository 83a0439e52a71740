"""What llama.cpp needs to know of each model family: its architecture in GGUF, the metadata it
reads, and how a Hugging Face tensor becomes a GGUF tensor.

llama.cpp's own converter (convert_hf_to_gguf.py) is the reference for every rule here, and
llama.cpp itself is the judge (tests/finetuning_pipeline/exporters/test_gguf_llama_cpp.py):
- Mistral and Llama are llama.cpp's `llama`, whose rotary embedding pairs dimension i with i + 1
  of each head, where transformers pairs i with i + head_dim / 2: the q and k rows (and biases)
  are permuted into llama.cpp's order (`permute_rotary_rows`); for a LoRA, B's rows are.
- Gemma's RMSNorms multiply by 1 + w; llama.cpp's by w: every norm weight is written + 1.
- Tied output embeddings are not written: llama.cpp reads token_embd in output's place.

What llama.cpp's architecture cannot compute as transformers does is refused before any work
(`family_problems`), or said on the way (`family_notes`), naming the config key.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch


@dataclass(frozen=True)
class Family:
    """One transformers model_type as llama.cpp takes it."""

    arch: gguf.MODEL_ARCH
    permute_rotary: bool = False  # llama: q/k rows into llama.cpp's rotary order
    norm_plus_one: bool = False  # gemma: norms store w where the model multiplies by 1 + w
    windows: str = "none"  # how llama.cpp's arch honours a sliding window: none, pattern (per layer)


FAMILIES = {
    "llama": Family(gguf.MODEL_ARCH.LLAMA, permute_rotary=True),
    "mistral": Family(gguf.MODEL_ARCH.LLAMA, permute_rotary=True),
    "qwen2": Family(gguf.MODEL_ARCH.QWEN2),
    "qwen3": Family(gguf.MODEL_ARCH.QWEN3),
    "gemma": Family(gguf.MODEL_ARCH.GEMMA, norm_plus_one=True),
    "gemma2": Family(gguf.MODEL_ARCH.GEMMA2, norm_plus_one=True, windows="pattern"),
    "gemma3_text": Family(gguf.MODEL_ARCH.GEMMA3, norm_plus_one=True, windows="pattern"),
    "phi3": Family(gguf.MODEL_ARCH.PHI3),
}
# llama.cpp picks Gemma 2's and 3's attention scale by the layer count (its 27B models scale by
# hidden / heads, the others by head_dim); transformers by query_pre_attn_scalar.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}
ROPE_TYPES = {"default", "linear", "yarn", "llama3"}


def family_of(config) -> Family:
    """The family of a transformers config, or a ValueError naming it and those llama.cpp takes."""
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise ValueError(f"model_type {config.model_type!r} has no GGUF export here (llama.cpp's architectures "
                         f"written: {', '.join(sorted(FAMILIES))}); export --format hf writes it for transformers")
    return family


def rope_parameters(config) -> tuple[dict, dict | None]:
    """(the full-attention layers' RoPE parameters, the sliding layers' or None)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" in params:
        return dict(params["full_attention"]), dict(params.get("sliding_attention") or {}) or None
    return params, None


def family_problems(config) -> list[str]:
    """Why llama.cpp would compute something else than transformers with this config (empty: it
    would not), each naming its config key."""
    family = family_of(config)
    problems = []
    rope, _ = rope_parameters(config)
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        problems.append(f"rope_parameters.rope_type={rope['rope_type']!r} (written: {', '.join(sorted(ROPE_TYPES))})")
    if config.model_type in GEMMA_27B_LAYERS:
        if config.num_hidden_layers == GEMMA_27B_LAYERS[config.model_type]:
            scale, how = config.hidden_size // config.num_attention_heads, "hidden_size / num_attention_heads"
        else:
            scale, how = config.head_dim, "head_dim"
        if config.query_pre_attn_scalar != scale:
            problems.append(f"query_pre_attn_scalar={config.query_pre_attn_scalar}: llama.cpp scales this model's "
                            f"attention by 1/sqrt({how}) = 1/sqrt({scale})")
    if family.arch == gguf.MODEL_ARCH.PHI3 and (rope.get("partial_rotary_factor") or 1.0) != 1.0:
        problems.append(f"rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']} (llama.cpp's phi3 "
                        "rotates whole heads)")
    if getattr(config, "attention_bias", False) and config.model_type in ("gemma2", "gemma3_text"):
        problems.append("attention_bias=true (llama.cpp's Gemma reads no attention biases)")
    return problems


def family_notes(config) -> list[str]:
    """What the user should know of the GGUF that does not stop it: a sliding window that
    llama.cpp's architecture does not apply (equal to the model only up to the window)."""
    family = family_of(config)
    window = sliding_window(config)
    if family.windows == "none" and window is not None:
        return [f"sliding_window={window}: llama.cpp's {gguf.MODEL_ARCH_NAMES[family.arch]} attends to the whole "
                f"context, so its outputs equal this model's for up to {window} tokens"]
    return []


def sliding_window(config) -> int | None:
    """The window the model's sliding layers use, or None when no layer slides."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if window is None or (types is not None and "sliding_attention" not in types):
        return None
    if config.model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        return None
    return window


def write_metadata(writer: gguf.GGUFWriter, config) -> None:
    """The architecture's hyperparameters, as llama.cpp reads them."""
    family = family_of(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    rope, sliding_rope = rope_parameters(config)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if sliding_rope is not None:
        writer.add_rope_freq_base_swa(sliding_rope.get("rope_theta", 10000.0))
    rope_type, factor = rope.get("rope_type", "default"), rope.get("factor")
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if (cap := getattr(config, "attn_logit_softcapping", None)) is not None:
        writer.add_attn_logit_softcapping(cap)
    if (cap := getattr(config, "final_logit_softcapping", None)) is not None:
        writer.add_final_logit_softcapping(cap)
    if family.windows == "pattern":
        types = config.layer_types
        # The window itself, and which layers slide (llama.cpp's default pattern is Gemma's own
        # release layout; a config of another layout says so layer by layer).
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in types])


def extra_tensors(config) -> dict[str, torch.Tensor]:
    """Tensors llama.cpp needs that the model computes instead of storing: Llama 3's RoPE
    frequency factors (convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors)."""
    rope, _ = rope_parameters(config)
    if rope.get("rope_type") != "llama3":
        return {}
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope.get("rope_theta", 10000.0) ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    wavelengths = 2 * torch.pi / freqs
    smooth = (old_context / wavelengths - low) / (high - low)
    factors = torch.where(wavelengths < old_context / high, torch.ones_like(freqs),
                          torch.where(wavelengths > old_context / low, torch.full_like(freqs, factor),
                                      1 / ((1 - smooth) / factor + smooth)))
    return {gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight": factors}


def permute_rotary_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """q's or k's output rows (a weight [heads * head_dim, ...], a bias, or a LoRA B) from
    transformers' rotary order (i with i + head_dim / 2) to llama.cpp's (i with i + 1)."""
    return (rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
            .swapaxes(1, 2).reshape(rows.shape))


def rotary_heads(config, hf_name: str) -> int | None:
    """How many heads a q or k projection's rows hold (None: not a q or k projection)."""
    if ".q_proj." in hf_name:
        return config.num_attention_heads
    if ".k_proj." in hf_name:
        return getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return None


def to_gguf_values(family: Family, config, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A base tensor (fp32, adapters merged) as llama.cpp reads it."""
    heads = rotary_heads(config, hf_name)
    if family.permute_rotary and heads:
        tensor = permute_rotary_rows(tensor, heads)
    if family.norm_plus_one and hf_name.endswith("norm.weight"):
        tensor = tensor + 1
    return tensor
