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

Wiring: the kernel is registered as a transformers attention implementation; instead of 4D
masks, the forward gets the segment ids as a [B, 1, 1, L] tensor (or a dict of them per layer
type), which transformers hands to every layer's attention as-is, with the layer's own
`scaling`, `sliding_window` and `softcap`.
"""

from __future__ import annotations

import functools

import torch

from finetuning_pipeline.model.attention_masks import ONE_MASK, mask_windows

CHOICES = ("auto", "dense", "splash", "flash")
# (transformers reads any implementation name containing "flash" as a Hub flash-attention kernel)
IMPLEMENTATION = {"splash": "tpu_splash", "flash": "tpu_pallas_fa"}


def choose_attention(setting: str, model_config, on_tpu: bool, spmd_mesh: bool) -> tuple[str, str]:
    """(kind, why) for model.attention; raises ValueError naming the key when an explicit
    kernel cannot run this model here. auto never picks a kernel for a case it does not cover."""
    windows = [w for w in mask_windows(model_config).values() if w is not None]
    softcap = getattr(model_config, "attn_logit_softcapping", None)
    flash_gaps = [why for why, gap in (("a sliding window", windows), ("attention soft-capping", softcap),
                                       ("an SPMD mesh (its segment ids are not supported under SPMD)", spmd_mesh))
                  if gap]
    if setting == "dense":
        return "dense", "model.attention=dense"
    if not on_tpu:
        if setting != "auto":
            raise ValueError(f"model.attention={setting}: Pallas kernels run on TPU only (PJRT_DEVICE=TPU); "
                             "use model.attention=auto or dense")
        return "dense", "not a TPU: dense attention"
    if setting == "splash" or (setting == "auto" and spmd_mesh):
        if not spmd_mesh:
            raise ValueError("model.attention=splash needs parallel.mode=fsdp (an SPMD mesh with data and fsdp axes; "
                             "parallel.mesh.data=-1 parallel.mesh.fsdp=1 for pure data parallelism)")
        return "splash", "splash attention: the SPMD mesh has data and fsdp axes"
    if setting == "flash" or setting == "auto":
        if flash_gaps:
            if setting == "flash":
                raise ValueError(f"model.attention=flash: this model needs {', '.join(flash_gaps)}, which torch_xla's "
                                 "flash attention does not do; use splash (parallel.mode=fsdp) or dense")
            return (
                "dense",
                f"dense attention: flash attention lacks {', '.join(flash_gaps)}; splash needs parallel.mode=fsdp",
            )
        return "flash", "flash attention: no window, no soft-cap, one process per chip"
    raise ValueError(f"model.attention must be one of {list(CHOICES)}, got {setting!r}")


def segment_ids(position_ids: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """int32 [B, L]: samples numbered from 1 within each row, a new one wherever the position
    restarts at 0 (all 1 for a plain row). Tokens attend only within their own number."""
    if position_ids is None:
        return torch.ones(batch, length, dtype=torch.int32, device=device)
    return torch.cumsum((position_ids == 0).to(torch.int32), dim=-1)


def kernel_masks(model_config, segments: torch.Tensor):
    """What a kernel forward passes as `attention_mask`: the segment ids as [B, 1, 1, L] (4D,
    so transformers hands them to the layers as-is), per layer type where the model has types."""
    carried = segments[:, None, None, :]
    windows = mask_windows(model_config)
    if ONE_MASK in windows:
        return carried
    return {layer_type: carried for layer_type in windows}


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


def call_splash(inputs: dict, mesh) -> torch.Tensor:
    """torch_xla's splash attention on a (data, fsdp) mesh; returns [B, heads, L, D]."""
    from torch_xla.experimental.splash_attention import SplashAttentionConfig, splash_attention

    config = SplashAttentionConfig(mesh=str(mesh), qkv_partition_spec=(("data", "fsdp"), None, None, None),
                                   segment_ids_partition_spec=(("data", "fsdp"), None),
                                   attentiontype_local_sliding=inputs["window"] is not None,
                                   slide_window_size=inputs["window"])
    return splash_attention(inputs["q"], inputs["k"], inputs["v"], config.to_json(),
                            decoder_segment_ids=inputs["segment_ids"], causal=True,
                            attn_logits_soft_cap=inputs["soft_cap"])


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


def uses_kernel(model_config) -> bool:
    return getattr(model_config, "_attn_implementation", None) in IMPLEMENTATION.values()
