"""`model.quantize`: store the frozen base's decoder Linears block-quantized (q8_0, q4_0, nf4)
under the LoRA, so a 7B-9B model fits one 16 GiB chip (QLoRA on PyTorch/XLA).

Every `nn.Linear` inside the decoder layers becomes a `QuantizedLinear` (lora_logic/
quantized_linear.py); the embeddings, the LM head and the norms stay in `model.dtype`. The
values quantized are the base's weights as loaded in `model.dtype` (a bf16 checkpoint loaded in
bf16: the file's own values). Quantize before the LoRA is injected: the LoRA then wraps the
quantized layers, and its A and B stay full-precision master weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from lora_logic.quantize import dequantize, quantization_problem, stored_bytes
from lora_logic.quantized_linear import QuantizedLinear, is_linear

NONE = "none"


def decoder_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of every `nn.Linear` of the base inside the model's decoder layers (a LoRA's
    own A and B are not the base's)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no list of decoder layers at get_decoder().layers to quantize")
    prefix = next(name for name, module in model.named_modules() if module is layers)
    return [(f"{prefix}.{name}", module) for name, module in layers.named_modules()
            if isinstance(module, nn.Linear) and not _in_lora(name)]


def _in_lora(name: str) -> bool:
    return any(part.startswith("lora_") for part in name.split("."))


def quantization_problems(model: nn.Module, fmt: str) -> list[str]:
    """Why the decoder Linears of `model` (a meta-device model will do) cannot be stored in `fmt`,
    one line per distinct problem; [] when they can."""
    if fmt == NONE:
        return []
    problems = {}
    for name, linear in decoder_linears(model):
        problem = quantization_problem(fmt, tuple(linear.weight.shape))
        if problem:
            problems.setdefault(problem, name.rsplit(".", 1)[-1])
    return [f"{leaf} ({problem})" for problem, leaf in problems.items()]


def quantize_base(model: nn.Module, fmt: str, dtype: torch.dtype | None = None) -> int:
    """Replace every decoder Linear of `model` by its quantized form in `fmt`, one at a time (the
    full-precision weight is freed as the next is made); returns how many. `none`: nothing.
    dtype: the model's dtype, when its Linears hold another (see QuantizedLinear.from_linear)."""
    if fmt == NONE:
        return 0
    problems = quantization_problems(model, fmt)
    if problems:
        raise ValueError(f"model.quantize={fmt}: cannot store " + "; ".join(problems))
    linears = decoder_linears(model)
    for name, linear in linears:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        quantized = QuantizedLinear.from_linear(linear, fmt, dtype).to(linear.weight.device)
        quantized.train(linear.training)
        setattr(parent, child, quantized)
    return len(linears)


# safetensors' names of the float dtypes a model is stored in.
STORED_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def reading_dtype(model_dir: str | Path, dtype: torch.dtype) -> torch.dtype:
    """The dtype to read a base in whose decoder Linears are quantized as it loads: the files' own
    float dtype where it is not `dtype`. transformers converts every tensor of a model read in
    another dtype than its files' before a Linear can be quantized (the whole model in `dtype` in
    host memory at once: a 7B model's 13.5 GiB in bf16 from fp16 files), and maps the files of a
    model read in their own dtype. `dtype` where that cannot be done exactly as a model read in
    `dtype` would hold it: files of several float dtypes or not in safetensors, or an
    architecture that keeps modules in fp32."""
    from safetensors import safe_open
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    files = sorted(Path(model_dir).glob("*.safetensors"))
    try:
        architecture = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model_dir))]
    except (KeyError, OSError, ValueError):
        return dtype
    if not files or getattr(architecture, "_keep_in_fp32_modules", None) or getattr(
            architecture, "_keep_in_fp32_modules_strict", None):
        return dtype
    stored = set()
    for file in files:
        with safe_open(file, "pt") as tensors:
            stored |= {tensors.get_slice(key).get_dtype() for key in tensors.keys()}
    floats = {name for name in stored if name.startswith(("F", "BF"))}
    return STORED_DTYPES[floats.pop()] if len(floats) == 1 and floats <= STORED_DTYPES.keys() else dtype


def cast_as_loaded(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every float parameter and buffer of a model read in another dtype (reading_dtype) the
    dtype it has in the same model read in `dtype` (a weightless meta-device copy says which);
    the quantized Linears' codes and scales are left as they are."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    wanted = {name: t.dtype for name, t in [*reference.named_parameters(), *reference.named_buffers()]}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name in wanted and tensor.is_floating_point() and tensor.dtype != wanted[name]:
            tensor.data = tensor.data.to(wanted[name])
    model.config.dtype = dtype


def decoder_weight_bytes(model: nn.Module) -> int:
    """Bytes the decoder Linears' weights take as stored: codes and scales where quantized, the
    weight where not (what `model.quantize` shrinks; biases, norms, embeddings and the LoRA's own
    A and B aside)."""
    layers = model.get_decoder().layers
    return sum(stored_bytes(module.quantized) if isinstance(module, QuantizedLinear)
               else module.weight.numel() * module.weight.element_size()
               for name, module in layers.named_modules() if is_linear(module) and not _in_lora(name))


def quantized_summary(model: nn.Module) -> dict | None:
    """What the base's decoder Linears hold on the device, quantized: {"format", "linears",
    "weight_bytes", "bf16_bytes"} (the same weights in bf16); None when none is quantized."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]  # a model without them: any layout
    if not layers:
        return None
    return {"format": layers[0].format, "linears": len(layers), "weight_bytes": decoder_weight_bytes(model),
            "bf16_bytes": sum(2 * m.in_features * m.out_features for m in layers)}


def write_dequantized_copy(model_dir: Path, fmt: str, dtype: torch.dtype, out: Path) -> Path:
    """A copy of the model in `model_dir` (its config, weights and tokenizer) whose decoder
    Linears hold, in fp32, the dequantized weights a run in `dtype` with model.quantize=`fmt`
    computes with: the unquantized model that a quantized run must equal, step for step."""
    from transformers import AutoModelForCausalLM

    quantized = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    quantize_base(quantized, fmt)
    stored = dict(quantized.named_modules())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, linear in decoder_linears(model):
            linear.weight.copy_(dequantize(stored[name].quantized, torch.float32))
    # The config and tokenizer files; the weights are the ones saved here (in as many shards as they take).
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.index.json"))
    model.save_pretrained(out)
    return out
