"""Will a native run fit its GPUs: the bytes PyTorch's allocator holds at a step's peak
(`torch.cuda.max_memory_allocated`), from the model's config.json and the run config, for the
native runtime's own path: each decoder layer compiled (runtime.compile=layers), attention by
torch's scaled_dot_product_attention, fp32 LoRA weights under the base's dtype. tpu_plan.plan
does the rest (FLOPs, step time, device-hours) with this as its `memory`.

Per device, each term what a compiled step keeps, as measured (tests/finetuning_pipeline/planning/
test_gpu_plan.py reads a compiled model's saved tensors on this CPU, and holds the plan to the peaks
measured on an H100 and an H200):
- weights: every base parameter in `model.dtype`; with `model.quantize` the decoder Linears hold
  their codes and scales as PyTorch stores them (no tile padding), and at most one decoder layer's
  Linears are dequantized into `model.dtype` at once: the compiled layer recomputes each
  dequantized weight for the backward (lora_logic/quantized_linear.py) and keeps none. Under fsdp
  (FSDP2) the matrices are split over the GPUs and two layers are whole at once (the one in use and
  the next, prefetched).
- LoRA and optimizer: fp32 weights, gradients and AdamW's two moments (16 bytes a LoRA parameter),
  and DDP's gradient buckets (4 more) when several GPUs run dp.
- activations of one micro-batch kept for the backward, per layer and token (what the min-cut
  partitioner keeps of a compiled layer, read from its saved tensors): the layer's input and the
  residual after attention (2 hidden), the query, key, value and attention output with the keys and
  values repeated to every head (4 x heads x head_dim: transformers repeats them before torch's
  attention when it is given a mask, as the trainer always does), gate and up (2 intermediate), two
  fp32 norm statistics and the attention's fp32 log-sum-exp per head; where transformers runs the
  attention eagerly (Gemma 2, for its soft-capping: ModelShape.attn_implementation) its [heads,
  seq_len] scores and probabilities instead of the log-sum-exp; the inputs of any further norms
  (Gemma's after attention and MLP, q_norm and k_norm: ModelShape.extra_norm_inputs); the LoRA adds the inputs of
  the targets' A matrices (the attention's normed input, the output projection's input, the MLP's
  normed input, the down projection's input: each distinct input once), or with LoRA dropout each
  target's own dropped input and bool mask. Once per micro-batch: the 4D attention masks (a row's
  [L, L] mask, one per row at most, for each layer type: sliding and full). Full checkpointing
  keeps each layer's input, plus one layer's set during its
  recompute; selective also keeps the attention's output and log-sum-exp.
- logits: the bf16 logits, their fp32 copy and log-softmax, and the fp32 gradient the backward
  starts from (14 bytes per vocabulary entry per token; one chunk's tokens with the chunked loss),
  and the final norm's fp32 input.
No headroom is modelled here: the plan fits when the total is at most (1 - HEADROOM) of the card's
memory, room for the CUDA context, the allocator's rounding and fragmentation (reserved memory
above allocated), and inductor's workspaces.
"""

from __future__ import annotations

import dataclasses

from finetuning_pipeline.planning.tpu_plan import (
    DTYPE_BYTES,
    QUANTIZED_LAYOUT,
    ModelShape,
    PlanInputs,
    plan,
    weight_bytes,
)

NATIVE_LOGIT_BYTES_PER_ENTRY = 2 + 4 + 4 + 4
FP32 = 4
LORA_BYTES = 16  # fp32 weight, gradient and AdamW's two moments
NF4_CODE_TABLE_BYTES = 16 * 4  # an nf4 Linear's 16 fp32 code values (a buffer of its own)
DDP_BUCKET_BYTES = 4  # DDP's fp32 copy of each gradient, the buckets its all-reduce sends


def quantized_linear_bytes_native(in_features: int, out_features: int, fmt: str) -> int:
    """A quantized Linear's codes and scales as PyTorch stores them (lora_logic/quantize.py's layout)."""
    per_byte, block, scale_bytes = QUANTIZED_LAYOUT[fmt]
    code_table = NF4_CODE_TABLE_BYTES if fmt == "nf4" else 0
    return out_features * (in_features // per_byte + in_features // block * scale_bytes) + code_table


def frozen_values_per_token_layer(shape: ModelShape, seq_len: int) -> int:
    """Values in the activations' dtype a compiled decoder layer of the frozen base keeps per token
    (with eager attention also its [heads, seq_len] scores and probabilities; further norms' inputs)."""
    scores = 2 * shape.heads * seq_len if shape.attn_implementation == "eager" else 0
    return 2 * shape.hidden + 4 * shape.q_width + 2 * shape.intermediate + scores + shape.extra_norm_inputs


def lora_bytes_per_token_layer(shape: ModelShape, targets: list[str], dropout: bool, act: int) -> int:
    """What the LoRA adds per token: the inputs its A matrices' gradients read, each distinct input
    once (siblings share it: lora_logic/layer.py's SharedInput); under dropout each target's own
    dropped input and its bool mask instead (siblings share no product while dropout draws masks)."""
    if dropout:
        return sum(a for name, (a, _) in shape.projections().items() if name in targets) * (act + 1)
    inputs = {"q_proj": ("attention input", shape.hidden), "k_proj": ("attention input", shape.hidden),
              "v_proj": ("attention input", shape.hidden), "o_proj": ("attention output", shape.q_width),
              "gate_proj": ("MLP input", shape.hidden), "up_proj": ("MLP input", shape.hidden),
              "down_proj": ("MLP hidden", shape.intermediate)}
    return sum(dict(inputs[name] for name in targets if name in inputs).values()) * act


def fp32_bytes_per_token_layer(shape: ModelShape) -> int:
    """Two norms' statistics, and torch's attention kernel's log-sum-exp per head."""
    return FP32 * (2 + (shape.heads if shape.attn_implementation == "sdpa" else 0))


def native_memory(shape: ModelShape, inputs: PlanInputs, devices: int) -> dict[str, float]:
    """The bytes a GPU's allocator holds at a native step's peak, by term (see the module docstring)."""
    act = DTYPE_BYTES[inputs.dtype]
    rows = inputs.rows
    tokens = rows * inputs.seq_len
    layer_set = (frozen_values_per_token_layer(shape, inputs.seq_len) * act + fp32_bytes_per_token_layer(shape)
                 + lora_bytes_per_token_layer(shape, inputs.lora_targets, inputs.lora_dropout > 0, act))
    mask = shape.attention_masks * rows * inputs.seq_len ** 2 * act
    without = tokens * shape.layers * layer_set + mask
    kept = shape.hidden * act
    if inputs.checkpointing == "selective":
        kept += shape.q_width * act + FP32 * shape.heads
    checkpointed = tokens * (shape.layers * kept + layer_set) + mask
    lora = shape.lora_params(inputs.lora_r, inputs.lora_targets) * inputs.adapters
    per_lora = LORA_BYTES + (DDP_BUCKET_BYTES if inputs.mode == "dp" and devices > 1 else 0)
    logit_tokens = min(tokens, inputs.loss_chunk) if inputs.loss_chunk else tokens
    return {"weights": native_weight_bytes(shape, inputs, devices),
            "lora_and_optimizer": (lora + inputs.embedding_params) * per_lora,
            "activations": checkpointed if inputs.checkpointing else without,
            "logits": logit_tokens * shape.vocab * NATIVE_LOGIT_BYTES_PER_ENTRY + tokens * shape.hidden * 2 * FP32,
            "activations_without_checkpointing": without, "activations_with_checkpointing": checkpointed}


def native_weight_bytes(shape: ModelShape, inputs: PlanInputs, devices: int) -> float:
    """The base's bytes per GPU (see the module docstring)."""
    return weight_bytes(shape, inputs, devices, quantized_linear_bytes_native, dequantized_layers=1)


def native_mode_advice(shape: ModelShape, gpus, inputs: PlanInputs) -> str:
    """Which parallel mode to choose for this model on these GPUs, and why."""
    whole = plan(shape, gpus, dataclasses.replace(inputs, mode="dp"), native_memory)
    if whole["fits"]:
        return "the model fits one GPU: parallel.mode=dp (DDP under torchrun, one process per GPU)"
    if gpus.devices == 1:
        return ("the model with its activations does not fit one GPU, and fsdp needs several to shard over "
                "(to fit: above)")
    if inputs.mode != "fsdp":
        return ("the model with its activations does not fit one GPU: parallel.mode=fsdp (FSDP2 under torchrun) "
                "shards the frozen base over the GPUs")
    sharded = plan(shape, gpus, inputs, native_memory)
    if sharded["fits"]:
        return f"the model does not fit one GPU: parallel.mode=fsdp shards the frozen base over the {gpus.devices} GPUs"
    held = sharded["hbm_breakdown_gib"]
    return (f"parallel.mode=fsdp already shards the frozen base over the {gpus.devices} GPUs (weights "
            f"{held['weights']} GiB a GPU); what does not fit is the rest (activations {held['activations']}, "
            f"logits {held['logits']} GiB): to fit, above")
