"""Pallas attention kernels on TPU (`model.attention: auto | dense | splash | flash`).

Dense attention materialises [B, heads, L, L] scores: O(L^2) memory that rules out long
contexts. torch_xla 2.9 ships two Pallas kernels that never form the square:
- splash (`torch_xla.experimental.splash_attention`): causal, segment ids (packing), a local
  sliding window, logit soft-capping; SPMD only, on a mesh with `data` and `fsdp` axes
  (parallel.mode=fsdp). It takes no softmax scale: the query is scaled before the call.
- flash (`custom_kernel.flash_attention`): causal, segment ids; no window, no soft-cap, no
  grouped KV (the KV heads are repeated); its `sm_scale` defaults to 1.0, not 1/sqrt(d), so
  the model's own scaling is passed. Used here without SPMD (segment ids are not supported
  with SPMD in torch_xla 2.9).

Kernels run on TPUs only, so what can be checked on a CPU is checked here: the inputs each
kernel gets (segment ids from `position_ids`, the window in the kernel's convention, the
scale, the head layout) are built by `splash_inputs` / `flash_inputs`, which the tests feed to
a reference implementation of the kernels' documented semantics and compare, through whole
models of every family, with the dense masks of attention_masks.py. The kernel calls
themselves (`call_splash`, `call_flash`) have not run on TPU hardware in this repository.

Which kernel a phase runs is decided before the device, by finetuning_pipeline/model/attention_choice.py.

Wiring: the kernel is registered as a transformers attention implementation; instead of 4D
masks, the forward gets the segment ids as a [B, 1, 1, L] tensor (or a dict of them per layer
type), which transformers hands to every layer's attention as-is, with the layer's own
`scaling`, `sliding_window` and `softcap`.
"""

from __future__ import annotations

import functools

import torch

from finetuning_pipeline.model.attention_choice import IMPLEMENTATION, TargetMachine, choose_attention
from finetuning_pipeline.runtime.xla.device import device_kind
from utils.tpu_detect import tpu_generation
from utils.tpu_install import libtpu_problem, pallas_problem


def this_machine(setting: str = "auto") -> TargetMachine:
    """The machine this process runs on: its TPU generation read from the PCI bus, whether its
    install has what the kernels need (asked only where `setting`, model.attention, may take
    one), and libtpu where PJRT_DEVICE=TPU."""
    if device_kind() != "TPU":
        return TargetMachine()
    tpu = tpu_generation() or "of unknown generation"
    return TargetMachine(tpu=tpu, pallas_problem=pallas_problem() if setting != "dense" else None,
                         runtime_problem=libtpu_problem())


def attention_here(setting: str, model_config, *, spmd_mesh: bool, seq_len: int | None,
                   dp_processes: int = 1) -> tuple[str, str]:
    """choose_attention for the machine this process runs on (this_machine)."""
    machine = this_machine(setting)
    return choose_attention(setting, model_config, tpu=machine.tpu, spmd_mesh=spmd_mesh, seq_len=seq_len,
                            install_problem=machine.pallas_problem, dp_processes=dp_processes)


def repeat_kv(states: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, kv_heads, L, D] -> [B, heads, L, D], each KV head repeated for its query group."""
    groups = heads // states.shape[1]
    return states if groups == 1 else states.repeat_interleave(groups, dim=1)


def splash_inputs(
    query, key, value, segments, scaling: float, sliding_window: int | None, softcap: float | None
) -> dict:
    """The arguments of one splash call. Its LocalMask admits keys q - w <= k <= q for
    window_size w; transformers' window W admits q - W < k <= q: so w = W - 1."""
    heads = query.shape[1]
    return {"q": query * scaling, "k": repeat_kv(key, heads), "v": repeat_kv(value, heads),
            "segment_ids": segments, "window": None if sliding_window is None else sliding_window - 1,
            "soft_cap": softcap}


def flash_inputs(query, key, value, segments, scaling: float) -> dict:
    heads = query.shape[1]
    return {"q": query, "k": repeat_kv(key, heads), "v": repeat_kv(value, heads), "segment_ids": segments,
            "sm_scale": scaling}


class SplashAttentionFunction(torch.autograd.Function):
    """torch_xla 2.9's splash forward and backward ops (`xla::sa_custom_forward` / `_backward`)
    under an autograd Function that keeps the soft-cap as a Python attribute. torch_xla's own
    `SplashAttention.forward` passes the soft-cap, a float, to `ctx.save_for_backward`, which
    takes tensors only: every soft-capped model (Gemma 2) would fail at its first backward, after
    an evaluation (no gradients) that passes. `ops` is the (forward, backward) pair: torch_xla's
    on a TPU (splash_ops), a reference with the same contract in the CPU tests."""

    @staticmethod
    def forward(ctx, q, k, v, segment_ids, config: str, soft_cap: float | None, ops):
        output = ops[0](q, k, v, config, segment_ids, True, soft_cap)[0]
        ctx.save_for_backward(q, k, v, segment_ids)
        ctx.config, ctx.soft_cap, ctx.ops = config, soft_cap, ops
        return output

    @staticmethod
    def backward(ctx, grad_output):
        q, k, v, segment_ids = ctx.saved_tensors
        grad_q, grad_k, grad_v = ctx.ops[1](grad_output, q, k, v, ctx.config, segment_ids, True, ctx.soft_cap)
        return grad_q, grad_k, grad_v, None, None, None, None


def splash_ops():
    """torch_xla's splash forward and backward ops, each run the way its SplashAttention runs them
    (`requires_jax`: the PJRT client up before jax is imported)."""
    from torch_xla.experimental.custom_kernel import requires_jax
    from torch_xla.experimental.splash_attention import sa_custom_backward, sa_custom_forward

    return requires_jax(sa_custom_forward), requires_jax(sa_custom_backward)


def call_splash(inputs: dict, mesh, ops=None) -> torch.Tensor:
    """torch_xla's splash attention on a (data, fsdp) mesh; returns [B, heads, L, D]."""
    from torch_xla.experimental.splash_attention import SplashAttentionConfig

    config = SplashAttentionConfig(mesh=str(mesh), qkv_partition_spec=(("data", "fsdp"), None, None, None),
                                   segment_ids_partition_spec=(("data", "fsdp"), None),
                                   attentiontype_local_sliding=inputs["window"] is not None,
                                   slide_window_size=inputs["window"])
    return SplashAttentionFunction.apply(inputs["q"], inputs["k"], inputs["v"], inputs["segment_ids"],
                                         config.to_json(), inputs["soft_cap"], ops or splash_ops())


def call_flash(inputs: dict, mesh=None) -> torch.Tensor:
    """torch_xla's flash attention, one process per chip; returns [B, heads, L, D]."""
    from torch_xla.experimental.custom_kernel import flash_attention

    return flash_attention(inputs["q"], inputs["k"], inputs["v"], causal=True, q_segment_ids=inputs["segment_ids"],
                           kv_segment_ids=inputs["segment_ids"], sm_scale=inputs["sm_scale"])


KERNELS = {"splash": call_splash, "flash": call_flash}


def kernel_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                     softcap=None, *, kind: str, mesh=None, **kwargs):
    """A transformers attention function: query [B, heads, L, D], key/value [B, kv_heads, L, D],
    `attention_mask` the [B, 1, 1, L] segment ids of kernel_masks. Returns ([B, L, heads, D], None)."""
    segments = attention_mask[:, 0, 0, :].to(torch.int32)
    scaling = module.scaling if scaling is None else scaling
    if kind == "splash":
        inputs = splash_inputs(query, key, value, segments, scaling, sliding_window, softcap)
    else:
        inputs = flash_inputs(query, key, value, segments, scaling)
    output = KERNELS[kind](inputs, mesh)
    return output.transpose(1, 2).contiguous(), None


def enable_kernel_attention(model, kind: str, mesh=None) -> None:
    """Make `model`'s layers call the `kind` kernel (registered as a transformers attention
    implementation); the loss then passes kernel_masks instead of dense ones."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION[kind], functools.partial(kernel_attention, kind=kind, mesh=mesh))
    model.set_attn_implementation(IMPLEMENTATION[kind])
