"""Will a run fit the chips, how fast will it go, what will it cost: arithmetic on the model's
config.json and the run config, no weights and no device.

HBM per device (a chip, or a v3 TensorCore), each term an estimate with its assumptions here:
- weights: every base parameter in `model.dtype`; under fsdp, matrices are split over all
  devices, and two decoder layers' worth are whole at once (the all-gathered layer in use
  and the next one, prefetched). With `model.quantize`, the decoder Linears hold their codes
  and scales as the TPU lays them out (quantized_linear_bytes: each 2-D array padded to whole
  tiles of 128 lanes, which an nf4 scale row of 64 doubles) and two decoder layers' Linears are dequantized
  into `model.dtype` at once (the graph keeps no dequantized weight from the forward to the
  backward: docs/quantized-base.md; how many XLA on a TPU holds at once is assumed);
- LoRA and optimizer: fp32 master weights, gradients and AdamW's two moments (16 bytes per
  LoRA parameter), replicated in both modes (see finetuning_pipeline/distributed/parallel.py);
  the embeddings trained beside the LoRA (lora.modules_to_save's whole matrices, a tied pair
  once; trained token rows) the same 16 bytes a weight, replicated too;
- activations of one micro-batch kept for the backward: per layer and token, the hidden-size
  and MLP-size tensors a decoder layer saves, the attention score and probability matrices
  (XLA's attention materialises [heads, seq_len] per token), and the LoRA dropout masks when
  dropout > 0. With activation checkpointing only each layer's input is kept, plus one layer's
  full set during its recompute;
- logits: the bf16 logits, their fp32 copy and fp32 gradient (10 bytes per vocabulary entry
  per token): for 150k-260k vocabularies the largest single tensor of a step. With the
  chunked loss (train.loss_chunk_tokens, on by default for the verified families) only one
  chunk's tokens hold logits at a time, and each chunk's output projection runs once more in
  the backward (2 * hidden * vocab FLOPs per token).
A plan fits when the total is at most (1 - HEADROOM) of the device's HBM: XLA needs room for
temporaries, fusion buffers and fragmentation that no formula here sees.

FLOPs per token of a LoRA step: the frozen base costs 2N forward and 2N backward (activation
gradients only, no weight gradients): 4N with N the matmul parameters (lm_head included,
embeddings not); attention 12 * layers * seq_len * width (QK^T and AV on the full square the
masked kernel computes, forward plus twice that backward); the LoRA branch 6 * r * (in + out)
per adapted layer. Activation checkpointing adds one more forward (2N + 4 * layers * seq_len * width).
An output layer trained whole adds its weight gradient, 2 * hidden * vocab a token.

Adapters side by side (PlanInputs.adapters = K): each micro-batch holds micro_batch rows of
each adapter, so activations, logits and FLOPs are those of K * micro_batch rows, and each
adapter has its LoRA and optimizer; the weights are held once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from finetuning_pipeline.planning.tpu_chips import GIB, Slice

HEADROOM = 0.10
LOGIT_BYTES_PER_ENTRY = 2 + 4 + 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
# A quantized Linear's arrays (lora_logic/quantize.py): codes [out, in / values per byte] of
# uint8 or int8 and scales [out, in / block]: (values per code byte, block, bytes per scale).
# q8_0 and q4_0 an fp16 scale per 32 values, nf4 an fp32 scale per 64.
QUANTIZED_LAYOUT = {"q8_0": (1, 32, 2), "q4_0": (2, 32, 2), "nf4": (2, 64, 4)}
# The TPU's tiled layout of a 2-D array in HBM (XLA's TPU tiling): the minor dimension padded to
# whole 128-lane tiles, the second-minor to whole tiles of 8 rows of 4-byte values (16 of 2-byte,
# 32 of 1-byte). What it pads is HBM the quantization does not save.
TILE_LANES = 128
TILE_ROWS = {4: 8, 2: 16, 1: 32}


def tiled_bytes(rows: int, columns: int, itemsize: int) -> int:
    """The bytes of a [rows, columns] array of `itemsize`-byte values in the TPU's tiled layout."""
    tile_rows = TILE_ROWS[itemsize]
    return (-(-rows // tile_rows) * tile_rows) * (-(-columns // TILE_LANES) * TILE_LANES) * itemsize


def quantized_linear_bytes(in_features: int, out_features: int, fmt: str) -> int:
    """The HBM a quantized Linear's codes and scales take on a TPU, tile padding included."""
    per_byte, block, scale_bytes = QUANTIZED_LAYOUT[fmt]
    return (tiled_bytes(out_features, in_features // per_byte, 1)
            + tiled_bytes(out_features, in_features // block, scale_bytes))
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def weightless_model_facts(model_config) -> tuple[int, str, int]:
    """(parameters, the attention implementation transformers picks, the values per token a decoder
    layer's norms beyond the two every decoder has normalize) of the architecture, from a model
    built on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetuning_pipeline.distributed.parallel import decoder_layers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    hidden, heads = model_config.hidden_size, heads_of(model_config)
    normalized = 0  # values a token that the layer's norms normalize (each keeps its input)
    for name, module in decoder_layers(model)[0].named_modules():
        leaf, weight = name.rsplit(".", 1)[-1], getattr(module, "weight", None)
        if "norm" in leaf and weight is not None and weight.dim() == 1:
            normalized += weight.numel() * norm_applications(leaf, weight.numel(), hidden, heads)
    return sum(p.numel() for p in model.parameters()), model.config._attn_implementation, normalized - 2 * hidden


def norm_applications(leaf: str, width: int, hidden: int, heads: dict[str, int]) -> int:
    """How many times a token's norm of this weight width runs: once per head for a per-head q_norm
    or k_norm (Qwen3's, Gemma 3's: width head_dim), once otherwise (the hidden norms, and OLMo 2's
    q_norm and k_norm over the whole projection)."""
    if width != heads["head_dim"] or width == hidden:
        return 1
    return {"q": heads["heads"], "k": heads["kv_heads"]}.get(leaf[0], 1)


def heads_of(config) -> dict[str, int]:
    """heads, kv_heads and head_dim of a transformers config (head_dim where it says, else hidden / heads)."""
    heads = config.num_attention_heads
    return {"heads": heads, "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads}


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know of an architecture (from config.json)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    total_params: int  # every parameter, counted on a weightless model (biases, norms, ties included)
    tied_embeddings: bool = False  # the output layer's weight is the input embedding's
    # What transformers runs the attention with where nothing chooses for it (the native runtime):
    # "sdpa" (torch's kernel), or "eager" (Gemma 2 for its soft-capping: [heads, seq_len] scores kept).
    attn_implementation: str = "sdpa"
    # Values per token a decoder layer's further norms normalize (Gemma's after attention and MLP,
    # Gemma 3's and Qwen3's q_norm and k_norm): each keeps its input for the backward.
    extra_norm_inputs: int = 0
    attention_masks: int = 1  # the 4D masks a forward builds: one per layer type (model/attention_masks.py)

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        from finetuning_pipeline.model.attention_masks import mask_windows

        params, attention, extra_norms = weightless_model_facts(config)
        return cls(layers=config.num_hidden_layers, hidden=config.hidden_size, intermediate=config.intermediate_size,
                   **heads_of(config), vocab=config.vocab_size, total_params=params, attn_implementation=attention,
                   extra_norm_inputs=extra_norms, attention_masks=len(mask_windows(config)),
                   tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)))

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of a decoder layer."""
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, self.q_width), "k_proj": (h, self.kv_width), "v_proj": (h, self.kv_width),
                "o_proj": (self.q_width, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def layer_params(self) -> int:
        return self.layer_linear_params + 2 * self.hidden

    @property
    def layer_linear_params(self) -> int:
        return sum(a * b for a, b in self.projections().values())

    @property
    def matmul_params(self) -> int:
        return self.layers * sum(a * b for a, b in self.projections().values()) + self.hidden * self.vocab

    def lora_params(self, r: int, targets: list[str]) -> int:
        return self.layers * sum(r * (a + b) for name, (a, b) in self.projections().items() if name in targets)


def flops_per_token(shape: ModelShape, seq_len: int, r: int, targets: list[str], checkpointing: bool = False) -> float:
    """FLOPs of one trained token of a LoRA step (see the module docstring)."""
    lora = shape.layers * sum(6 * r * (a + b) for name, (a, b) in shape.projections().items() if name in targets)
    attention = 12 * shape.layers * seq_len * shape.q_width
    total = 4 * shape.matmul_params + attention + lora
    if checkpointing:
        total += 2 * shape.matmul_params + 4 * shape.layers * seq_len * shape.q_width
    return float(total)


def activation_bytes_per_token_layer(shape: ModelShape, seq_len: int, act_bytes: int, lora_dropout: bool,
                                     kernel_attention: bool = False) -> float:
    """Bytes one decoder layer keeps per token for the backward, without checkpointing. A
    kernel attention (splash/flash) keeps no [heads, seq_len] scores, only its output."""
    h, i = shape.hidden, shape.intermediate
    hidden_sized = (
        4 * h + 2 * shape.q_width + 3 * shape.kv_width + shape.q_width
    )  # norms, residual, q/k/v (+rope), attn out
    mlp_sized = 4 * i  # gate, up, act(gate), act(gate) * up
    attention = 0 if kernel_attention else 2 * shape.heads * seq_len  # scores and probabilities
    dropout_masks = (5 * h + shape.q_width + i) if lora_dropout else 0  # each target's dropped input
    return float((hidden_sized + mlp_sized + attention + dropout_masks) * act_bytes)


@dataclass
class PlanInputs:
    mode: str
    dtype: str
    micro_batch: int
    grad_accum: int
    seq_len: int
    checkpointing: bool | str  # False, or model.activation_checkpointing's mode: "full", "selective"
    lora_r: int
    lora_targets: list[str]
    lora_dropout: float
    assumed_mfu: float
    steps: int  # optimizer steps of the phase
    fsdp_axis: int = -1  # under fsdp: chips each weight matrix is split over (-1: every chip)
    loss_chunk: int = 0  # tokens per chunk of the loss (0: the full logits)
    attention: str = "dense"  # what model.attention resolves to on the planned TPU: dense, splash, flash
    attention_reason: str = ""  # why (kernel_attention.choose_attention)
    compile_s_per_layer: float = 0.0  # compile seconds per decoder layer (tpu.compile_s_per_layer)
    compile_s_fixed: float = 0.0  # compile seconds of the rest of a phase's graphs (tpu.compile_s_fixed)
    capture_step: bool = True  # train.capture_step: one micro-batch compiled, whatever grad_accum
    scanned_layers: bool = False  # train.scan_layers as resolved for the model: one layer compiled
    compile_s_scanned: float = 0.0  # compile seconds of a phase with scanned layers (tpu.compile_s_scanned)
    adapters: int = 1  # adapters trained side by side: micro_batch rows of each, and a LoRA and optimizer each
    quantize: str = "none"  # model.quantize: the decoder Linears' storage format
    # A preference phase: each of micro_batch's items is a pair, two rows (chosen, rejected); the
    # reference's forward (no backward) in the step unless its log-probabilities are precomputed.
    rows_per_item: int = 1
    reference_forward: bool = False
    # Weights trained beside the LoRA (lora.modules_to_save's matrices, trained token rows), the
    # output layer among them whole (its weight gradient each token), and what the new tokens'
    # rows alone would be (the cheap alternative to the whole matrices).
    embedding_params: int = 0
    output_layer_trained: bool = False
    new_token_rows_params: int = 0

    @property
    def rows(self) -> int:
        """Rows of a micro-batch on a device: its items' (two a pair), of every adapter side by side."""
        return self.micro_batch * self.rows_per_item * self.adapters


def tpu_memory(shape: ModelShape, inputs: PlanInputs, devices: int) -> dict[str, float]:
    """The bytes a TPU device holds at a step's peak, by term (see the module docstring), and the
    activations with and without checkpointing."""
    act_bytes = DTYPE_BYTES[inputs.dtype]
    tokens = inputs.rows * inputs.seq_len  # per device per micro-batch
    per_layer = activation_bytes_per_token_layer(shape, inputs.seq_len, act_bytes, inputs.lora_dropout > 0,
                                                 inputs.attention != "dense")
    without = tokens * shape.layers * per_layer
    checkpointed = tokens * (shape.layers * shape.hidden * act_bytes + per_layer)
    logit_tokens = min(tokens, inputs.loss_chunk) if inputs.loss_chunk else tokens
    return {"weights": weight_bytes(shape, inputs, devices),
            "lora_and_optimizer": (shape.lora_params(inputs.lora_r, inputs.lora_targets) * inputs.adapters
                                   + inputs.embedding_params) * 16,
            "activations": checkpointed if inputs.checkpointing else without,
            "logits": logit_tokens * shape.vocab * LOGIT_BYTES_PER_ENTRY,
            "activations_without_checkpointing": without, "activations_with_checkpointing": checkpointed}


def held_bytes(held: dict[str, float]) -> float:
    """A device's total at a step's peak: the sum of a `memory` function's terms."""
    return held["weights"] + held["lora_and_optimizer"] + held["activations"] + held["logits"]


def plan(shape: ModelShape, tpu: Slice, inputs: PlanInputs, memory=tpu_memory) -> dict:
    """The memory, speed and cost plan of one phase; see the module docstring. `memory`: the
    bytes a device holds by term (tpu_memory, or gpu_plan.native_memory for a GPU)."""
    devices = tpu.devices
    tokens = inputs.rows * inputs.seq_len  # per device per micro-batch
    lora_params = shape.lora_params(inputs.lora_r, inputs.lora_targets)
    held = memory(shape, inputs, devices)
    weights, lora_and_optimizer = held["weights"], held["lora_and_optimizer"]
    activations, logits = held["activations"], held["logits"]
    total = held_bytes(held)
    capacity = tpu.hbm_bytes_per_device
    fits = total <= (1 - HEADROOM) * capacity

    global_tokens = tokens * inputs.grad_accum * devices
    per_token = flops_per_token(shape, inputs.seq_len, inputs.lora_r, inputs.lora_targets, inputs.checkpointing)
    if inputs.loss_chunk and tokens > inputs.loss_chunk:
        per_token += 2 * shape.hidden * shape.vocab  # each chunk's projection again in the backward
    if inputs.output_layer_trained:  # its weight gradient, which a frozen output layer skips
        per_token += 2 * shape.hidden * shape.vocab
    if inputs.reference_forward:  # a forward is about a third of a step's (its backward: two)
        per_token += flops_per_token(shape, inputs.seq_len, inputs.lora_r, inputs.lora_targets) / 3
    step_flops = per_token * global_tokens
    step_time = step_flops / (devices * tpu.peak_flops_per_device * inputs.assumed_mfu)
    # The step's graph holds one micro-batch's layers when captured (micro_batch_loop.py),
    # grad_accum copies of them when traced every step; scanned, one layer whatever the depth.
    if inputs.scanned_layers and inputs.mode != "fsdp":  # (scan_choice: not under fsdp yet)
        compile_s = inputs.compile_s_scanned
    else:
        compile_s = inputs.compile_s_fixed + inputs.compile_s_per_layer * shape.layers * (
            1 if inputs.capture_step else inputs.grad_accum)
    hours = (inputs.steps * step_time + compile_s) / 3600
    return {
        "fits": bool(fits),
        "hbm_per_chip_gib": round(total / GIB, 2),
        "hbm_capacity_gib": round(capacity / GIB, 2),
        "hbm_usable_gib": round((1 - HEADROOM) * capacity / GIB, 2),
        "hbm_breakdown_gib": {
            "weights": round(weights / GIB, 2),
            "lora_and_optimizer": round(lora_and_optimizer / GIB, 3),
            "activations": round(activations / GIB, 2),
            "logits": round(logits / GIB, 2),
        },
        "activations_gib_without_checkpointing": round(held["activations_without_checkpointing"] / GIB, 2),
        "activations_gib_with_checkpointing": round(held["activations_with_checkpointing"] / GIB, 2),
        "flops_per_token": per_token,
        "flops_per_step": step_flops,
        "step_time_s": round(step_time, 3),
        "compile_s": round(compile_s, 1),  # per session of the phase (a warm compile cache: ~0)
        "tokens_per_sec": round(global_tokens / step_time, 1),
        "tokens_per_step": global_tokens,
        "tokens": inputs.steps * global_tokens,
        "tpu_hours": round(hours, 3),  # hours the slice is held, one compile included
        "chip_hours": round(hours * tpu.chips, 2),  # what per-chip-hour pricing bills
        "inputs": {
            **dataclasses.asdict(inputs),
            "tpu_type": tpu.type,
            "chips": tpu.chips,
            "devices": devices,
            "hosts": tpu.hosts,
            "peak_bf16_tflops_per_chip": tpu.generation.bf16_tflops_per_chip,
            "chip_facts_source": tpu.generation.source,
            "base_params": shape.total_params,
            "lora_params": lora_params,
            "headroom": HEADROOM,
        },
    }


def weight_bytes(shape: ModelShape, inputs: PlanInputs, devices: int, linear_bytes=quantized_linear_bytes,
                 dequantized_layers: int = 2) -> float:
    """The base's bytes per device (see the module docstring): a quantized Linear's bytes as
    `linear_bytes` lays them out (the TPU's tiles here; gpu_plan's without), and that many decoder
    layers' Linears dequantized at once."""
    act_bytes = DTYPE_BYTES[inputs.dtype]
    linear_params = shape.layers * shape.layer_linear_params
    quantized = inputs.quantize in QUANTIZED_LAYOUT
    layer_linears = (sum(linear_bytes(a, b, inputs.quantize) for a, b in shape.projections().values()) if quantized
                     else shape.layer_linear_params * act_bytes)
    stored = shape.layers * layer_linears + (shape.total_params - linear_params) * act_bytes
    shards = (devices if inputs.fsdp_axis == -1 else inputs.fsdp_axis) if inputs.mode == "fsdp" else 1
    whole_at_once = 0.0  # layers all-gathered (fsdp) or dequantized (quantize) for their matmuls
    if shards > 1:
        whole_at_once += 2 * (layer_linears + 2 * shape.hidden * act_bytes)
    if quantized:
        whole_at_once += dequantized_layers * shape.layer_linear_params * act_bytes
    return stored / shards + whole_at_once


def suggestions(shape: ModelShape, tpu: Slice, inputs: PlanInputs, memory=tpu_memory) -> list[dict]:
    """Changes that make a plan that does not fit fit, each as config overrides, cheapest first:
    the same run sharded, with checkpointing, with smaller micro-batches (grad_accum raised
    to keep the global batch), and combinations; and the base quantized (8 bits, else 4), alone
    or with those."""
    candidates = fitting_changes(shape, tpu, inputs, memory)
    if inputs.embedding_params > inputs.new_token_rows_params:
        # The whole embedding matrices off: the new tokens' rows (model.new_tokens) then train alone
        # (lora.trainable_token_indices), or none: a fraction of the copies and their AdamW state.
        rows_only = dataclasses.replace(inputs, embedding_params=inputs.new_token_rows_params,
                                        output_layer_trained=False)
        candidates += fitting_changes(shape, tpu, rows_only, memory, {"lora.modules_to_save": None})
    # The base stored in fewer bits than now: 8 if that is enough, else 4 (q4_0 and nf4: one size).
    for fmt in {"none": ("q8_0", "q4_0"), "q8_0": ("q4_0",)}.get(inputs.quantize, ()):
        quantized = fitting_changes(shape, tpu, dataclasses.replace(inputs, quantize=fmt), memory,
                                    {"model.quantize": fmt})
        if quantized:
            candidates += quantized
            break
    return sorted(candidates, key=lambda c: (len(c["overrides"]), c["step_time_s"]))


def fitting_changes(shape: ModelShape, tpu: Slice, inputs: PlanInputs, memory, base_change: dict | None = None
                    ) -> list[dict]:
    """suggestions' changes of mode, checkpointing and micro-batch (the largest that fits under
    each), each on top of `base_change` (the change that made `inputs`; alone where it fits)."""
    candidates = []
    modes = [inputs.mode] + (["fsdp"] if inputs.mode == "dp" and tpu.devices > 1 else [])  # (one device: no shard)
    for mode in modes:
        for checkpointing in dict.fromkeys([inputs.checkpointing, inputs.checkpointing or True]):
            micro = inputs.micro_batch
            while micro >= 1:
                change = dict(base_change or {})
                if mode != inputs.mode:
                    change["parallel.mode"] = mode
                if checkpointing != inputs.checkpointing:
                    change["model.activation_checkpointing"] = checkpointing
                if micro != inputs.micro_batch:
                    change["train.micro_batch"] = micro
                    change["train.grad_accum"] = math.ceil(inputs.grad_accum * inputs.micro_batch / micro)
                if change:
                    if mode != inputs.mode and inputs.fsdp_axis != -1:
                        change["parallel.mesh.fsdp"] = -1  # shard over every chip
                    trial = dataclasses.replace(inputs, mode=mode, checkpointing=checkpointing, micro_batch=micro,
                                                fsdp_axis=-1 if mode != inputs.mode else inputs.fsdp_axis,
                                                grad_accum=change.get("train.grad_accum", inputs.grad_accum))
                    result = plan(shape, tpu, trial, memory)
                    if result["fits"]:
                        candidates.append({"overrides": change, "hbm_per_chip_gib": result["hbm_per_chip_gib"],
                                           "step_time_s": result["step_time_s"]})
                        break  # the largest micro-batch that fits under these settings
                micro //= 2
    return candidates


def mode_advice(shape: ModelShape, tpu: Slice, inputs: PlanInputs, memory=tpu_memory) -> str:
    """Which parallel mode to choose for this model on this slice, and why."""
    whole = plan(shape, tpu, dataclasses.replace(inputs, mode="dp"), memory)
    if not whole["fits"]:
        return ("the model with its activations does not fit one chip: parallel.mode=fsdp shards the frozen base over "
                "the fsdp axis of the mesh (parallel.mesh.fsdp=-1: every chip)")
    return ("the model fits one chip: parallel.mode=dp (one process per chip) works; parallel.mode=fsdp with "
            "parallel.mesh.data=-1 parallel.mesh.fsdp=1 is the same data parallelism in one SPMD process per host "
            "(one compile per host instead of one per chip, and the mesh torch_xla's splash attention needs)")
